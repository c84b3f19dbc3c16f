"""Compiles the Triton attention kernels and the W4A16 decode kernel for sm_90 (Hopper) without a GPU and prints
one JSON line per build: `{"name", "shared"}` (bytes of shared memory) or `{"name", "error"}`. Run with
TRITON_INTERPRET unset or 0 (`tests/test_kernel_builds.py` starts it in a subprocess: the interpreter's
`triton.jit` cannot be compiled)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hf_fastpath.kernels import flash_attention as fa  # noqa: E402
from hf_fastpath.kernels import varlen_gaps  # noqa: E402
from hf_fastpath.kernels import w4a16  # noqa: E402
from hf_fastpath.kernels.launch import COMPILE_OPTIONS  # noqa: E402

POINTERS = {"LSE": "*fp32", "LSE2": "*fp32", "DELTA": "*fp32", "SLOPES": "*fp32", "CU_Q": "*i32", "CU_K": "*i32",
            "SEQUSED_K": "*i32", "KEY_MASK": "*i32", "QS": "*fp32", "DOS": "*fp32", "KS": "*fp32",
            "Q8T": "*fp8e4nv", "DO8T": "*fp8e4nv", "K8T": "*fp8e4nv"}
FLOATS = ("sm_scale", "scale_log2", "softcap", "x_value", "y_value")


def build(fn, constexprs, num_warps, num_stages, pointers=None):
    # a kernel names its pointers one way: `x_ptr` (W4A16), else upper case (attention's Q, K, V, LSE...)
    suffixed = any(p.name.endswith("_ptr") for p in fn.params)
    is_pointer = {p.name: p.name.endswith("_ptr") if suffixed else p.name.isupper() for p in fn.params}
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif is_pointer[p.name]:
            sig[p.name] = {**POINTERS, **(pointers or {})}.get(p.name, "*bf16")
        else:
            sig[p.name] = "fp32" if p.name in FLOATS else "i32"
    # what the launch specializes on with real tensors: 16-byte aligned pointers, row strides that are multiples of
    # 16 (without these hints Triton neither vectorizes nor pipelines the loads, and needs less shared memory)
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
             if not p.is_constexpr and (is_pointer[p.name] or p.name in ("stride_qs", "stride_ks", "stride_vs",
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


def fill_cases():
    """The varlen gap fill (`varlen_gaps._fill_outside_kernel`): an output and its fp32 LSE in one launch, at its
    GPU tiles."""
    for dtype in ("bf16", "fp32"):
        yield (f"fill outside sequences {dtype}", varlen_gaps._fill_outside_kernel,
               dict(HAS_Y=True, BLOCK_R=64, BLOCK_C=256), 4, 1,
               {"x_ptr": f"*{dtype}", "y_ptr": "*fp32", "cu_ptr": "*i32"})


def w4a16_cases():
    """The W4A16 decode kernel (`w4a16._decode_kernel`) with the configs its planner picks on an H100 (132 SMs) for
    Llama-3-8B / Mixtral shapes: 1-64 rows, split-K, gate and up side by side (SEGMENTED), a mixture of experts'
    stacked weights (EXPERTS) and both."""
    pointers = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "out_ptr": "*bf16",
                "ws_ptr": "*fp32", "count_ptr": "*i32", "tiles_ptr": "*i32"}
    for m, k, n, group in ((1, 4096, 14336, 128), (4, 4096, 4096, 128), (16, 4096, 14336, 128), (64, 14336, 4096, 128),
                           (1, 4096, 4096, 32)):
        for segmented, experts in ((False, False), (True, False), (False, True), (True, True)):
            _, _, split_k, _, meta = w4a16._decode_plan(m, k, n, group, 132, False, True, segmented,
                                                        8 if experts else 1)
            meta = dict(meta, EXPERTS=experts)
            warps, stages = meta.pop("num_warps"), meta.pop("num_stages")
            tags = "".join(t for t, on in ((" split", split_k > 1), (" segmented", segmented), (" experts", experts))
                           if on)
            yield f"w4a16 decode m{m} {k}x{n} g{group}{tags}", w4a16._decode_kernel, meta, warps, stages, pointers


def main():
    only = sys.argv[1:]
    for name, fn, constexprs, warps, stages, pointers in (*cases(), *fill_cases(), *w4a16_cases()):
        if only and not any(o in name for o in only):
            continue
        try:
            kernel = build(fn, constexprs, warps, stages, pointers)
            print(json.dumps(dict(name=name, shared=kernel.metadata.shared)), flush=True)
        except Exception as exc:  # noqa: BLE001 - report every build
            print(json.dumps(dict(name=name, error=f"{type(exc).__name__}: {exc}"[-2000:])), flush=True)


if __name__ == "__main__":
    main()
