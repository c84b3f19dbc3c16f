"""Compiles the Gluon Hopper attention kernel for sm_90 without a GPU and prints one JSON line per build (the
defaults, the key-mask and packed-segment kernels, then every opt-in variant of `gluon_attention.variants`):
`{"name", "shared", "spills", ...}` or `{"name", "error"}`. Arguments: substrings of the names to build; GLUON_BUILDS_DUMP=dir writes each ttgir and PTX.
Run with TRITON_INTERPRET unset or 0 (Gluon has no interpreter); `tests/test_gluon_builds.py` starts it in a
subprocess."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from hf_fastpath.kernels import gluon_attention as ga  # noqa: E402
from hf_fastpath.kernels.launch import COMPILE_OPTIONS  # noqa: E402
from offline_builds import (barrier_overlaps, build_error, descriptor_type, dump_asm,  # noqa: E402
                            ptxas_report)


MASK_POINTER = {1: "*u8", 2: "*i32"}  # the key mask as bytes, the segment table


def default_config(head_dim, causal, mask_mode):
    """The launcher's default for a long call (`ga.config` without seq_k)."""
    tile = ga.tile_dim(head_dim)
    return ga.config(tile, causal, padded=tile != head_dim, key_mask=mask_mode == 1, packed=mask_mode == 2)


def build(head_dim, causal, dtype=torch.bfloat16, cfg=None, mask_mode=0, window=False, softcap=False, alibi=0):
    from triton.experimental.gluon._runtime import GluonASTSource

    tile = ga.tile_dim(head_dim)  # a padded head dim (`ga.tile_view`) loads through 3-D descriptors
    cfg = cfg or default_config(head_dim, causal, mask_mode)
    fn, constexprs = ga.kernel_args(tile, causal, cfg, mask_mode, window, softcap, alibi, dim=head_dim)
    ptr = "*bf16" if dtype == torch.bfloat16 else "*fp16"
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name == "q_desc":
            sig[p.name] = descriptor_type(dtype, ga.tile_box(ga.ROWS_PER_WARPGROUP, tile, padded=tile != head_dim))
        elif p.name in ("k_desc", "v_desc"):
            sig[p.name] = descriptor_type(dtype, ga.tile_box(cfg.block_n, tile, padded=tile != head_dim))
        elif p.name == "out_desc":  # None (a constexpr) unless the output goes out by TMA
            if cfg.tma_store:
                sig[p.name] = descriptor_type(dtype, [1, ga.ROWS_PER_WARPGROUP, head_dim])
            else:
                sig[p.name], constexprs = "constexpr", dict(constexprs, out_desc=None)
        elif p.name == "out_ptr":
            sig[p.name] = ptr
        elif p.name == "lse_ptr":
            sig[p.name] = "*fp32"
        elif p.name == "km_ptr":  # None (a constexpr) without a mask
            if mask_mode:
                sig[p.name] = MASK_POINTER[mask_mode]
            else:
                sig[p.name], constexprs = "constexpr", dict(constexprs, km_ptr=None)
        elif p.name == "slopes_ptr":  # ALiBi's slopes, else None
            if alibi:
                sig[p.name] = "*fp32"
            else:
                sig[p.name], constexprs = "constexpr", dict(constexprs, slopes_ptr=None)
        elif p.name == "run_ptr":  # a key mask's runs of real keys, else None
            if mask_mode == 1:
                sig[p.name] = "*i32"
            else:
                sig[p.name], constexprs = "constexpr", dict(constexprs, run_ptr=None)
        else:
            sig[p.name] = "fp32" if p.name in ("qk_scale", "cap_scale") else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params) if p.name in ("out_ptr", "lse_ptr")}
    src = GluonASTSource(fn, sig, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=ga.max_registers(cfg), **COMPILE_OPTIONS))


def cases():
    """(name, head dim, causal, dtype, config, mask mode, window, softcap[, alibi]): the defaults, the masked kernels
    (hd128 in each mode and causality, hd64 causal; packed full at every head dim: differently packed varlen), sliding
    window, soft-cap and ALiBi kernels, then every opt-in
    variant of `ga.variants`."""
    for head_dim in ga.HEAD_DIMS:
        for causal in (False, True):
            yield (f"fwd hd{head_dim} {'causal' if causal else 'full'} bf16", head_dim, causal, torch.bfloat16, None, 0,
                   False, False)
    yield "fwd hd128 causal fp16", 128, True, torch.float16, None, 0, False, False
    for head_dim, causal in ((128, False), (128, True), (64, True), (256, True)):
        for mode, what in ((1, "keymask"), (2, "packed")):
            yield (f"fwd hd{head_dim} {'causal' if causal else 'full'} bf16 {what}", head_dim, causal, torch.bfloat16,
                   None, mode, False, False)
    for head_dim in ga.HEAD_DIMS:  # Mistral / Gemma-2 shapes: causal with a left edge, soft-cap, both
        yield f"fwd hd{head_dim} causal bf16 window", head_dim, True, torch.bfloat16, None, 0, True, False
        yield f"fwd hd{head_dim} causal bf16 softcap", head_dim, True, torch.bfloat16, None, 0, False, True
    for head_dim in (128, 256):
        yield f"fwd hd{head_dim} causal bf16 window softcap", head_dim, True, torch.bfloat16, None, 0, True, True
    yield "fwd hd128 full bf16 window", 128, False, torch.bfloat16, None, 0, True, False
    yield "fwd hd128 causal bf16 window packed", 128, True, torch.bfloat16, None, 2, True, False
    # varlen with queries and keys packed differently: packed, neither CAUSAL nor WINDOW (`ga.varlen_spans`)
    for head_dim in (64, 256):
        yield f"fwd hd{head_dim} full bf16 packed", head_dim, False, torch.bfloat16, None, 2, False, False
    yield "fwd hd128 causal bf16 window keymask softcap", 128, True, torch.bfloat16, None, 1, True, True
    # ALiBi (Falcon-RW / BLOOM / MPT): one-sided when causal (mode 2, `ga.alibi_mode`), with |i - j| when not (1)
    for head_dim, causal in ((64, True), (128, True), (128, False)):
        yield (f"fwd hd{head_dim} {'causal' if causal else 'full'} bf16 alibi", head_dim, causal, torch.bfloat16, None,
               0, False, False, 2 if causal else 1)
    yield "fwd hd128 causal bf16 alibi keymask", 128, True, torch.bfloat16, None, 1, False, False, 2
    # head dims padded to the next tile width (`ga.tile_dim`): GPT-NeoX-20B's 96, and 192
    yield "fwd hd96 causal bf16", 96, True, torch.bfloat16, None, 0, False, False
    yield "fwd hd96 full bf16 keymask", 96, False, torch.bfloat16, None, 1, False, False
    yield "fwd hd192 causal bf16 window softcap", 192, True, torch.bfloat16, None, 0, True, True
    for head_dim in ga.HEAD_DIMS:
        for causal in (False, True):
            for variant, cfg in ga.variants(head_dim, causal).items():
                yield (f"fwd hd{head_dim} {'causal' if causal else 'full'} bf16 {variant}", head_dim, causal,
                       torch.bfloat16, cfg, 0, False, False)


def main():
    only = sys.argv[1:]
    for name, head_dim, causal, dtype, cfg, mask_mode, window, softcap, *alibi in cases():
        if only and not any(o in name for o in only):
            continue
        try:
            kernel = build(head_dim, causal, dtype, cfg, mask_mode, window, softcap, *alibi)
            ptx = kernel.asm.get("ptx", "")
            tile = ga.tile_dim(head_dim)
            cfg = cfg or default_config(head_dim, causal, mask_mode)
            o_buffer = ga.kernel_args(tile, causal, cfg)[1].get("O_BUFFER", False)
            print(json.dumps(dict(name=name, shared=kernel.metadata.shared, spills=ptx.count("local.") > 0,
                                  setmaxnreg=ptx.count("setmaxnreg"), tags=[f"consumers{cfg.consumers}"],
                                  shared_estimate=ga._shared_bytes(tile, cfg, o_buffer), triton=triton.__version__,
                                  **ptxas_report(kernel), barrier_overlaps=barrier_overlaps(kernel))),
                  flush=True)
            dump_asm(kernel, name)
        except Exception as exc:  # noqa: BLE001 - report every build
            print(json.dumps(dict(name=name, error=build_error(exc))), flush=True)


if __name__ == "__main__":
    main()
