"""Compiles the attention kernels for sm_90 (Hopper) without a GPU and prints one JSON line per build:
`{"name", "shared"}` (bytes of shared memory) or `{"name", "error"}`. Run with TRITON_INTERPRET unset or 0
(`tests/test_kernel_builds.py` starts it in a subprocess: the interpreter's `triton.jit` cannot be compiled)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hf_fastpath.kernels import flash_attention as fa  # noqa: E402
from hf_fastpath.kernels.launch import COMPILE_OPTIONS  # noqa: E402

POINTERS = {"LSE": "*fp32", "LSE2": "*fp32", "DELTA": "*fp32", "SLOPES": "*fp32", "CU_Q": "*i32", "CU_K": "*i32",
            "SEQUSED_K": "*i32", "KEY_MASK": "*i32", "QS": "*fp32", "DOS": "*fp32", "KS": "*fp32",
            "Q8T": "*fp8e4nv", "DO8T": "*fp8e4nv", "K8T": "*fp8e4nv"}
FLOATS = ("sm_scale", "scale_log2", "softcap")


def build(fn, constexprs, num_warps, num_stages, pointers=None):
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name.isupper():
            sig[p.name] = {**POINTERS, **(pointers or {})}.get(p.name, "*bf16")
        else:
            sig[p.name] = "fp32" if p.name in FLOATS else "i32"
    # what the launch specializes on with real tensors: 16-byte aligned pointers, row strides that are multiples of
    # 16 (without these hints Triton neither vectorizes nor pipelines the loads, and needs less shared memory)
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
             if not p.is_constexpr and (p.name.isupper() or p.name in ("stride_qs", "stride_ks", "stride_vs",
                                                                        "stride_os", "stride_dos", "stride_dqs",
                                                                        "stride_dks", "stride_dvs"))}
    src = ASTSource(fn, sig, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages, **COMPILE_OPTIONS))


def cases():
    """(name, kernel, constexprs, warps, stages, pointer types) for every kernel variant and dtype the wrappers use,
    with the tiles the wrappers pick (`flash_attention._config`)."""
    for dtype in ("bf16", "fp32"):
        ptrs = {n: f"*{dtype}" for n in ("Q", "K", "V", "O", "DO", "DK", "DV", "DQ")}
        common = dict(IS_VARLEN=False, HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=False, HAS_ALIBI=False,
                      UPCAST=False, PREC="ieee" if dtype == "fp32" else "tf32", HAS_SEQUSED=False)
        fp32 = dtype == "fp32"
        for d in (64, 128, 256):  # decode: GQA rows packed, keys split, a static cache with padding
            bm, bn, w, st = fa._config("fwd", d, decode=True, fp32=fp32)
            yield (f"fwd decode hd{d} {dtype}", fa._fwd_kernel,
                   dict(common, D_QK=d, D_V=d, BLOCK_DK=d, BLOCK_DV=d, BLOCK_M=bm, BLOCK_N=bn, SPLIT=True,
                        USE_TMA=False, PACK_GQA=True, HAS_SEQUSED=True, MASK_MODE=1), w, st, dict(ptrs, O="*fp32"))
        for d in (64, 128, 256):
            modes = (0, 1, 2) if dtype == "bf16" else (1,)  # plain, padding mask, packed sequences
            bm, bn, w, st = fa._config("fwd", d, fp32=fp32)
            for mode in modes:
                yield (f"fwd hd{d} mask{mode} {dtype}", fa._fwd_kernel,
                       dict(common, D_QK=d, D_V=d, BLOCK_DK=d, BLOCK_DV=d, BLOCK_M=bm, BLOCK_N=bn, SPLIT=False,
                            USE_TMA=False, PACK_GQA=False, MASK_MODE=mode), w, st, ptrs)
            for mode in modes[-2:]:
                for kind, fn in (("dkdv", fa._bwd_dkdv_kernel), ("dq", fa._bwd_dq_kernel)):
                    bm, bn, w, st = fa._config(kind, d, fp32=fp32)
                    yield (f"{kind} hd{d} mask{mode} {dtype}", fn,
                           dict(common, D_QK=d, D_V=d, BLOCK_DK=d, BLOCK_DV=d, BLOCK_M=bm, BLOCK_N=bn, FP8=0,
                                MASK_MODE=mode), w, st, ptrs)


def main():
    only = sys.argv[1:]
    for name, fn, constexprs, warps, stages, pointers in cases():
        if only and not any(o in name for o in only):
            continue
        try:
            kernel = build(fn, constexprs, warps, stages, pointers)
            print(json.dumps(dict(name=name, shared=kernel.metadata.shared)), flush=True)
        except Exception as exc:  # noqa: BLE001 - report every build
            print(json.dumps(dict(name=name, error=f"{type(exc).__name__}: {exc}"[-2000:])), flush=True)


if __name__ == "__main__":
    main()
