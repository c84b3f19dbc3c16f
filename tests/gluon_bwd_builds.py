"""Compiles the Gluon Hopper attention backward (`hf_fastpath.kernels.gluon_attention_bwd`) for sm_90 without a GPU
and prints one JSON line per build: `{"name", "shared", "spills", "ptxas_regs", "serialized", ...}` or
`{"name", "error"}`. Arguments: substrings of the names to build; GLUON_BUILDS_DUMP=dir writes each ttgir and PTX.
Run with TRITON_INTERPRET unset or 0 (Gluon has no interpreter); `tests/test_gluon_bwd_builds.py` starts it in a
subprocess."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from hf_fastpath.kernels import gluon_attention_bwd as gb  # noqa: E402
from hf_fastpath.kernels.launch import COMPILE_OPTIONS  # noqa: E402
from offline_builds import (barrier_overlaps, build_error, descriptor_type, dump_asm,  # noqa: E402
                            ptxas_report)


MASK_POINTER = {1: "*u8", 2: "*i32"}  # the key mask as bytes, the segment table


def build(head_dim, causal, dtype, variant, mask_mode=0, window=False, softcap=False, alibi=0, deterministic=False):
    from triton.experimental.gluon._runtime import GluonASTSource

    tile = gb._fwd.tile_dim(head_dim, gb.HEAD_DIMS)  # a padded head dim loads through 3-D descriptors
    fn, constexprs = gb.kernel_args(tile, causal, variant, mask_mode, window, softcap, alibi, deterministic,
                                    dim=head_dim)
    cfg = gb.launch(variant)
    ptr = "*bf16" if dtype == torch.bfloat16 else "*fp16"
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name in ("q_desc", "do_desc"):
            sig[p.name] = descriptor_type(dtype, gb._fwd.tile_box(cfg.block_m[tile], tile, padded=tile != head_dim))
        elif p.name in ("k_desc", "v_desc"):
            sig[p.name] = descriptor_type(dtype, gb._fwd.tile_box(gb.block_n(tile), tile, padded=tile != head_dim))
        elif p.name in ("dk_ptr", "dv_ptr"):
            sig[p.name] = ptr
        elif p.name == "km_ptr":  # None (a constexpr) without a mask
            if mask_mode:
                sig[p.name] = MASK_POINTER[mask_mode]
            else:
                sig[p.name], constexprs = "constexpr", dict(constexprs, km_ptr=None)
        elif p.name == "slopes_ptr" and not alibi:  # None without ALiBi
            sig[p.name], constexprs = "constexpr", dict(constexprs, slopes_ptr=None)
        elif p.name == "dq_turns":  # the turn counters, None unless deterministic
            if deterministic:
                sig[p.name] = "*i32"
            else:
                sig[p.name], constexprs = "constexpr", dict(constexprs, dq_turns=None)
        elif p.name.endswith("_ptr"):  # lse2, delta, the fp32 dQ buffer, ALiBi's slopes
            sig[p.name] = "*fp32"
        else:
            sig[p.name] = "fp32" if p.name in ("qk_scale", "sm_scale", "cap_scale") else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params) if p.name.endswith("_ptr")}
    src = GluonASTSource(fn, sig, constexprs, attrs)
    # the setmaxnreg partitions need the launch's register budget
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=gb.MAXNREG,
                                                                            **COMPILE_OPTIONS))


def cases():
    """(name, head dim, causal, dtype, variant, mask mode, window, softcap[, alibi]): every head dim, causality and
    variant in bf16, causal fp16; with each head dim's default variant, the key-mask and packed kernels causal at
    every head dim and full at hd128 (packed full at every head dim: differently packed varlen), the sliding-window and soft-cap kernels (causal at every head dim; with packed
    segments or soft-cap at hd128), ALiBi (causal at every head dim, full and with a key mask at hd128) and the
    deterministic dQ (causal and full where supported, with a window and packed segments at hd128)."""
    for head_dim in gb.HEAD_DIMS:
        for variant in gb.VARIANTS:
            for causal in (False, True):
                yield (f"bwd hd{head_dim} {'causal' if causal else 'full'} bf16 {variant}", head_dim, causal,
                       torch.bfloat16, variant, 0, False, False)
            yield f"bwd hd{head_dim} causal fp16 {variant}", head_dim, True, torch.float16, variant, 0, False, False
        variant = gb.DEFAULT_VARIANTS[head_dim]  # the features: where a variant becomes the default, they build with it
        for causal in (True, False) if head_dim == 128 else (True,):
            for mode, what in ((1, "keymask"), (2, "packed")):
                yield (f"bwd hd{head_dim} {'causal' if causal else 'full'} bf16 {variant} {what}", head_dim,
                       causal, torch.bfloat16, variant, mode, False, False)
        if head_dim != 128:  # differently packed varlen: packed, neither CAUSAL nor WINDOW (`varlen_spans`)
            yield (f"bwd hd{head_dim} full bf16 {variant} packed", head_dim, False, torch.bfloat16, variant, 2, False,
                   False)
        for what, window, softcap in (("window", True, False), ("softcap", False, True)):
            yield (f"bwd hd{head_dim} causal bf16 {variant} {what}", head_dim, True, torch.bfloat16, variant, 0,
                   window, softcap)
        if head_dim == 128:
            yield (f"bwd hd{head_dim} causal bf16 {variant} window packed", head_dim, True, torch.bfloat16,
                   variant, 2, True, False)
            yield (f"bwd hd{head_dim} causal bf16 {variant} window softcap", head_dim, True, torch.bfloat16,
                   variant, 0, True, True)
            yield (f"bwd hd{head_dim} full bf16 {variant} alibi", head_dim, False, torch.bfloat16, variant, 0,
                   False, False, 1)
            yield (f"bwd hd{head_dim} causal bf16 {variant} alibi keymask", head_dim, True, torch.bfloat16,
                   variant, 1, False, False, 2)
            yield (f"bwd hd{head_dim} causal bf16 {variant} alibi softcap", head_dim, True, torch.bfloat16,
                   variant, 0, False, True, 2)
        yield (f"bwd hd{head_dim} causal bf16 {variant} alibi", head_dim, True, torch.bfloat16, variant, 0, False,
               False, 2)
        for causal in (True, False) if gb.deterministic_supported(head_dim) else ():
            yield (f"bwd hd{head_dim} {'causal' if causal else 'full'} bf16 {variant} deterministic", head_dim,
                   causal, torch.bfloat16, variant, 0, False, False, 0, True)
        if head_dim == 128 and gb.deterministic_supported(head_dim):  # every input of the turn order
            yield (f"bwd hd{head_dim} causal bf16 {variant} window packed deterministic", head_dim, True,
                   torch.bfloat16, variant, 2, True, False, 0, True)
    # head dims padded to 128 (`tile_dim`): GPT-NeoX-20B's 96; 104 stores part of a 16-column dQ piece
    yield "bwd hd96 causal bf16 split", 96, True, torch.bfloat16, "split", 0, False, False
    yield "bwd hd104 full bf16 split keymask", 104, False, torch.bfloat16, "split", 1, False, False


def main():
    only = sys.argv[1:]
    for name, head_dim, causal, dtype, variant, mask_mode, window, softcap, *alibi in cases():
        if only and not any(o in name for o in only):
            continue
        try:
            kernel = build(head_dim, causal, dtype, variant, mask_mode, window, softcap, *alibi)
            ptx = kernel.asm.get("ptx", "")
            print(json.dumps(dict(name=name, shared=kernel.metadata.shared, spills=ptx.count("local.") > 0,
                                  shared_estimate=gb.shared_bytes(gb._fwd.tile_dim(head_dim, gb.HEAD_DIMS), variant),
                                  n_regs=getattr(kernel, "n_regs", None),
                                  wgmma=ptx.count("wgmma.mma_async"), triton=triton.__version__,
                                  **ptxas_report(kernel), barrier_overlaps=barrier_overlaps(kernel))),
                  flush=True)
            dump_asm(kernel, name)
        except Exception as exc:  # noqa: BLE001 - report every build
            print(json.dumps(dict(name=name, error=build_error(exc))), flush=True)


if __name__ == "__main__":
    main()
