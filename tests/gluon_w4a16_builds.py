"""Compiles the Gluon W4A16 GEMM (`hf_fastpath.kernels.gluon_w4a16`) for sm_90 without a GPU and prints one JSON
line per variant: `{"name", "shared", "spills", "setmaxnreg", "wgmma_wait_1", ...}` or `{"name", "error"}`. Run with
TRITON_INTERPRET unset or 0 (Gluon has no interpreter); `tests/test_gluon_w4a16_builds.py` starts it in a
subprocess. GLUON_BUILDS_DUMP=dir writes each variant's ttgir / ptx there."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from hf_fastpath.kernels import gluon_w4a16 as gw  # noqa: E402
from hf_fastpath.kernels.launch import COMPILE_OPTIONS  # noqa: E402
from offline_builds import (barrier_overlaps, build_error, descriptor_type, dump_asm,  # noqa: E402
                            ptxas_report)


def build(block_m, stages, plane_groups, dtype=torch.bfloat16, ptx=True, split=False, scales_tma=False,
          segmented=False):
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = gw._w4a16_kernel
    elem = gw.gl.bfloat16 if dtype == torch.bfloat16 else gw.gl.float16
    ptr = "*bf16" if dtype == torch.bfloat16 else "*fp16"
    sig = {}
    constexprs = dict(STAGES=stages, PLANE_GROUPS=plane_groups, PTX=ptx, GROUP_M=gw.GROUP_M, SCALES_TMA=scales_tma,
                      SEGMENTED=segmented)
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name in ("s_desc", "z_desc"):  # scales_by="tma": 1-D boxes of 128; else None (a constexpr)
            if scales_tma:
                sig[p.name] = descriptor_type(dtype, [gw.BLOCK_N], elem, gw.scales_layout())
            else:
                sig[p.name], constexprs[p.name] = "constexpr", None
        elif p.name == "x_desc":
            sig[p.name] = descriptor_type(dtype, [block_m, gw.BLOCK_K], elem)
        elif p.name == "w_desc":
            sig[p.name] = descriptor_type(torch.int32, [gw.BLOCK_N, 16], gw.gl.int32)
        elif p.name == "y_ptr" and split:  # split-K: fp32 partial sums
            sig[p.name] = "*fp32"
        elif p.name.endswith("_ptr"):
            sig[p.name] = ptr
        else:
            sig[p.name] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params) if p.name.endswith("_ptr")}
    src = GluonASTSource(fn, sig, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=gw.MAXNREG,
                                                                            **COMPILE_OPTIONS))


def cases():
    """Every launch configuration `gluon_w4a16_matmul` can pick (config(m) for each M bucket), both group modes,
    both unpack paths, split-K's fp32 output, scales by TMA, segments: (name, block_m, stages, plane_groups, dtype,
    ptx, split[, scales_tma[, segmented]])."""
    seen = set()
    for m in (1, 32, 64, 4096):
        block_m, stages = gw.config(m)
        if block_m in seen:
            continue
        seen.add(block_m)
        for ptx in (True, False):
            tag = "" if ptx else " plain"
            yield f"m{block_m} s{stages} g128 bf16{tag}", block_m, stages, False, torch.bfloat16, ptx, False
            yield f"m{block_m} s{stages} g32 bf16{tag}", block_m, stages, True, torch.bfloat16, ptx, False
        yield f"m{block_m} s{stages} g128 bf16 split", block_m, stages, False, torch.bfloat16, True, True
    block_m, stages = gw.config(4096)
    for ptx in (True, False):
        tag = "" if ptx else " plain"
        yield f"m{block_m} s{stages} g128 fp16{tag}", block_m, stages, False, torch.float16, ptx, False
        yield f"m{block_m} s{stages} g64 fp16{tag}", block_m, stages, True, torch.float16, ptx, False
    for m in (1, 32, 64, 4096):  # scales_by="tma" (group sizes of 128 and up)
        block_m, stages = gw.config(m)
        yield f"m{block_m} s{stages} g128 bf16 tma", block_m, stages, False, torch.bfloat16, True, False, True
        yield f"m{block_m} s{stages} g128 bf16 split tma", block_m, stages, False, torch.bfloat16, True, True, True
    yield f"m{block_m} s{stages} g128 fp16 tma", block_m, stages, False, torch.float16, True, False, True
    for m in (1, 4096):  # segments (up to three weights packed on their own, back to back)
        block_m, stages = gw.config(m)
        yield f"m{block_m} s{stages} g128 bf16 split tma segmented", block_m, stages, False, torch.bfloat16, True, \
            True, True, True


def main():
    only = sys.argv[1:]
    for name, *case in cases():
        if only and not any(o in name for o in only):
            continue
        try:
            kernel = build(*case)
            ptx = kernel.asm.get("ptx", "")
            print(json.dumps(dict(name=name, shared=kernel.metadata.shared, spills=ptx.count("local.") > 0,
                                  setmaxnreg=ptx.count("setmaxnreg"), n_regs=getattr(kernel, "n_regs", None),
                                  wgmma=ptx.count("wgmma.mma_async"),
                                  wgmma_wait_1=ptx.count("wgmma.wait_group.sync.aligned 1"),
                                  triton=triton.__version__, **ptxas_report(kernel),
                                  barrier_overlaps=barrier_overlaps(kernel))),
                  flush=True)
            dump_asm(kernel, name)
        except Exception as exc:  # noqa: BLE001 - report every build
            print(json.dumps(dict(name=name, error=build_error(exc))), flush=True)


if __name__ == "__main__":
    main()
