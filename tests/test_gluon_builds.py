"""The Gluon Hopper attention kernel (the default and every opt-in variant) compiles for sm_90 and fits its shared
memory, checked without a GPU.

Gluon has no interpreter, so nothing else in CI compiles it: `gluon_builds.py` builds each variant with Triton's
own compiler in a subprocess (TRITON_INTERPRET=0), for the Triton installed here.
"""

from __future__ import annotations

import pytest

from hf_fastpath.kernels import gluon_attention as ga

from tests.offline_builds import assert_sm90_builds_sound, run_build_script


@pytest.mark.skipif(not ga.HAS_GLUON, reason="this Triton has no Gluon Hopper module")
def test_gluon_attention_builds_for_sm90():
    builds = run_build_script("gluon_builds.py")
    # the key-mask kernels' per-key path (rows whose real keys are not one run) spills 140-1448 bytes under 3.6,
    # 20-1412 under 3.9; their one-run path's tile loops none (docs/attention.md session 18). A regression is KBs.
    # The shared-memory estimate decides whether O gets a buffer of its own: it must not undercount.
    # ALiBi's causal hd128 forward: none under 3.6, 96 bytes under 3.9 (session 21)
    assert_sm90_builds_sound(builds, {"keymask": 1536, "alibi": 128})
    names = {b["name"] for b in builds}
    assert {"fwd hd64 full bf16", "fwd hd128 causal bf16", "fwd hd128 causal fp16"} <= names
    assert {f"fwd hd{d} {kind} bf16 {mask}" for mask in ("keymask", "packed")
            for d, kind in ((64, "causal"), (128, "causal"), (128, "full"))} <= names
    assert {f"fwd hd{d} causal bf16 {what}" for d in ga.HEAD_DIMS for what in ("window", "softcap")} <= names
    assert {"fwd hd128 causal bf16 window softcap", "fwd hd128 causal bf16 window packed"} <= names
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
