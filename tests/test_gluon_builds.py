"""The Gluon Hopper attention kernel (the default and every opt-in variant) compiles for sm_90 and fits its shared
memory, checked without a GPU.

Gluon has no interpreter, so nothing else in CI compiles it: `gluon_builds.py` builds each variant with Triton's
own compiler in a subprocess (TRITON_INTERPRET=0), for the Triton installed here.
"""

from __future__ import annotations

import pytest
import triton

from hf_fastpath.kernels import gluon_attention as ga

from tests.offline_builds import assert_sm90_builds_sound, run_build_script


@pytest.mark.skipif(not ga.HAS_GLUON, reason="this Triton has no Gluon Hopper module")
def test_gluon_attention_builds_for_sm90():
    builds = run_build_script("gluon_builds.py")
    # the key-mask kernels' per-key path (rows whose real keys are not one run) spills 140-1448 bytes under 3.6,
    # 20-1412 under 3.9; their one-run path's tile loops none (docs/attention.md session 18). A regression is KBs.
    # The shared-memory estimate decides whether O gets a buffer of its own: it must not undercount.
    # ALiBi's causal hd128 forward: none under 3.6, 96 bytes under 3.9 (session 21). Three consumers (hd64, 160
    # registers each): none under 3.6-3.8, 136 (full) to 1440 bytes (causal ALiBi) under 3.9, whose PTX goes
    # through CUDA 13.4's ptxas (docs/attention.md session 33)
    allowance = {"keymask": 1536, "alibi": 128}
    if not triton.__version__.startswith("3.6"):
        allowance["consumers3"] = 1536
    assert_sm90_builds_sound(builds, allowance)
    names = {b["name"] for b in builds}
    assert {"fwd hd64 full bf16", "fwd hd128 causal bf16", "fwd hd128 causal fp16"} <= names
    assert {f"fwd hd{d} {kind} bf16 {mask}" for mask in ("keymask", "packed")
            for d, kind in ((64, "causal"), (128, "causal"), (128, "full"))} <= names
    assert {f"fwd hd{d} causal bf16 {what}" for d in ga.HEAD_DIMS for what in ("window", "softcap")} <= names
    assert {"fwd hd128 causal bf16 window softcap", "fwd hd128 causal bf16 window packed"} <= names
    assert {f"fwd hd{d} full bf16 packed" for d in ga.HEAD_DIMS} <= names  # differently packed varlen
    assert {f"fwd hd256 {kind} bf16" for kind in ("full", "causal")} | {"fwd hd256 causal bf16 window softcap"} <= names
    assert {"fwd hd64 causal bf16 alibi", "fwd hd128 causal bf16 alibi", "fwd hd128 full bf16 alibi",
            "fwd hd128 causal bf16 alibi keymask"} <= names
    for head_dim in ga.HEAD_DIMS:  # every opt-in variant builds too
        for causal in (False, True):
            kind = "causal" if causal else "full"
            assert {f"fwd hd{head_dim} {kind} bf16 {v}" for v in ga.variants(head_dim, causal)} <= names


def test_key_runs_finds_each_rows_run_of_real_keys():
    # left / right padding is one run of real keys (the kernels' two-bound path), a hole is not (per-key path)
    import torch

    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1],
                         [0, 0, 3, 0, 0]])
    runs = ga.key_runs(mask)
    assert runs.dtype == torch.int32
    assert runs.tolist() == [[0, 2, 0, 0, 0, 2], [3, 5, -1, 0, 5, 3]]


def test_key_runs_are_computed_once_per_mask():
    # a model's layers pass one mask: its runs are computed once, again after it changes in place, and die with it
    import gc

    import torch

    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    km = mask.to(torch.uint8)[None]
    first = ga._runs_of(mask, km, 3)
    assert ga._runs_of(mask, km, 3) is first and first.tolist() == [[0, 1], [2, 3]]
    mask[0, 2] = 1
    km = mask.to(torch.uint8)[None]
    assert ga._runs_of(mask, km, 3).tolist() == [[0, 1], [3, 3]]
    del mask
    gc.collect()
    assert len(ga._RUNS) == 0


def test_alibi_arguments_and_mode():
    # slopes [H] (batch stride 0) or [B, H] as fp32; anything else is a clear error; causal calls with no right
    # window edge take the one-sided mode (2), others the |i - j| one (1)
    import pytest
    import torch

    slopes, stride = ga.alibi_args(torch.tensor([0.5, 0.25], dtype=torch.bfloat16), 3, 2, torch.device("cpu"))
    assert slopes.dtype == torch.float32 and slopes.tolist() == [0.5, 0.25] and stride == 0
    assert ga.alibi_args(torch.ones(3, 2), 3, 2, torch.device("cpu"))[1] == 2
    assert ga.alibi_args(None, 3, 2, torch.device("cpu")) == (None, 0)
    with pytest.raises(ValueError, match=r"alibi_slopes must be \[num_heads\] or \[batch, num_heads\] = \[2\]"):
        ga.alibi_args(torch.ones(4), 3, 2, torch.device("cpu"))
    assert [ga.alibi_mode(None, 0), ga.alibi_mode(slopes, 0), ga.alibi_mode(slopes, -1),
            ga.alibi_mode(slopes, 5)] == [0, 2, 1, 1]


def test_tile_dims_and_views_of_padded_head_dims():
    # a head dim the tiles lack runs at the next width through a 3-D [heads, rows, D] view: the element a TMA box
    # reads at (h * col_h, row_b * b + row_h * h + s, d) is x[b, s, h, d], for [B, S, H, D] and [B, H, S, D] memory
    import torch

    assert [ga.tile_dim(d) for d in (64, 72, 96, 128, 136, 192, 256)] == [64, 128, 128, 128, 256, 256, 256]
    assert [ga.tile_dim(d) for d in (32, 48, 100, 264)] == [None] * 4
    assert ga.tile_dim(192, (64, 128)) is None and ga.tile_dim(96, (64, 128)) == 128  # the backward's widths
    B, S, H, D = 2, 5, 3, 96
    for bhsd in (False, True):
        x = torch.arange(B * S * H * D).view(B, H, S, D).transpose(1, 2) if bhsd else \
            torch.arange(B * S * H * D).view(B, S, H, D)
        view, (row_b, row_h, col_h) = ga.tile_view(x, 128)
        assert view.dim() == 3 and view.shape[-1] == D and view.stride(-1) == 1
        assert all(st * 2 % 16 == 0 for st in view.stride()[:-1])  # TMA: 16-byte strides (bf16)
        for b, s, h in ((0, 0, 0), (1, 4, 2), (1, 2, 1)):
            assert torch.equal(view[h * col_h, row_b * b + row_h * h + s], x[b, s, h])
        assert ga.tile_view(x, D)[0].dim() == 2  # a width the tiles have: the 2-D row view
