"""The Gluon Hopper attention backward (`gluon_attention_bwd`) compiles for sm_90, fits its shared memory, does not
spill and keeps its wgmmas asynchronous, checked without a GPU; and its host-side checks work off the GPU.

Gluon has no interpreter: `gluon_bwd_builds.py` builds each variant with Triton's own compiler in a subprocess
(TRITON_INTERPRET=0), for the Triton installed here, and runs ptxas on it (registers, spills, serialized wgmmas).
"""

from __future__ import annotations

import pytest
import torch

from hf_fastpath.kernels import gluon_attention_bwd as gb

from tests.offline_builds import HOPPER_SHARED_BYTES, assert_sm90_builds_sound, run_build_script


@pytest.mark.skipif(not gb.HAS_GLUON, reason="this Triton has no Gluon Hopper module")
def test_gluon_attention_backward_builds_for_sm90():
    builds = run_build_script("gluon_bwd_builds.py")
    # hd128 fills the consumers' 240 registers: 3.9's ptxas spills a few loop scalars there (12 bytes), 3.6's none;
    # the soft-cap's tanh needs 44-112 bytes at hd128 under 3.6, 12-32 under 3.9 (docs/attention.md, session 18);
    # ALiBi at hd128 88-304 under 3.6, 12-88 under 3.9 (session 21: still 1.11-1.14x the Triton backward); the
    # deterministic dQ turns with a window and packed segments 36 under 3.9 (3.6, the GPU's: none); hd256 none under
    # 3.6, 0-96 under 3.9 (session 24: K / V descriptors hoisted out of the loop had spilled ~700 bytes under 3.6,
    # 1.09-1.12x slower; docs/attention.md)
    assert_sm90_builds_sound(builds, {"softcap": 128, "alibi": 320, "deterministic": 40, "hd256": 128})
    # every variant plain, the features with each head dim's default
    plain = {f"bwd hd{d} {kind} {v}" for d in gb.HEAD_DIMS for v in gb.VARIANTS
             for kind in ("full bf16", "causal bf16", "causal fp16")}
    v = "split"
    assert set(gb.DEFAULT_VARIANTS.values()) == {v}
    masked = {f"bwd hd{d} {kind} bf16 {v} {mask}" for mask in ("keymask", "packed")
              for d, kind in ((64, "causal"), (128, "causal"), (128, "full"), (256, "causal"))}
    masked |= {f"bwd hd{d} full bf16 {v} packed" for d in gb.HEAD_DIMS}  # differently packed varlen
    windowed = {f"bwd hd{d} causal bf16 {v} {what}" for d in gb.HEAD_DIMS for what in ("window", "softcap")}
    windowed |= {f"bwd hd128 causal bf16 {v} {what}" for what in ("window packed", "window softcap")}
    alibi = {f"bwd hd{d} causal bf16 {v} alibi" for d in gb.HEAD_DIMS}
    alibi |= {f"bwd hd128 {what} {v} alibi{extra}"
              for what, extra in (("full bf16", ""), ("causal bf16", " keymask"), ("causal bf16", " softcap"))}
    deterministic = {f"bwd hd{d} {kind} bf16 {v} deterministic" for d in (64, 128) for kind in ("causal", "full")}
    deterministic |= {f"bwd hd128 causal bf16 {v} window packed deterministic"}
    padded = {"bwd hd96 causal bf16 split", "bwd hd104 full bf16 split keymask"}
    assert {b["name"] for b in builds} == plain | masked | windowed | alibi | deterministic | padded
    assert all(b["hgmma"] > 0 for b in builds), builds


def _args(b=1, sq=5, sk=7, hq=4, hkv=2, d=64, dtype=torch.bfloat16):
    q = torch.zeros(b, sq, hq, d, dtype=dtype)
    k = torch.zeros(b, sk, hkv, d, dtype=dtype)
    v = torch.zeros(b, sk, hkv, d, dtype=dtype)
    lse = torch.zeros(b, hq, sq, dtype=torch.float32)
    return torch.zeros_like(q), q, k, v, torch.zeros_like(q), lse


def test_not_supported_off_gpu():
    dout, q, k, v, _, _ = _args()
    assert gb.supported(dout, q, k, v) is False
    assert gb.supported(dout, q, k, v, causal=True) is False


def test_offline_shared_estimate_and_blocks():
    for d in gb.HEAD_DIMS:
        for variant, cfg in gb.VARIANTS.items():
            assert gb.shared_bytes(d, variant) <= HOPPER_SHARED_BYTES
            assert set(cfg.block_m) == set(cfg.stages) == set(gb.HEAD_DIMS)
    assert set(gb.DEFAULT_VARIANTS) == set(gb.HEAD_DIMS) and set(gb.DEFAULT_VARIANTS.values()) <= set(gb.VARIANTS)
    assert gb.kernel_args(128, True, "split")[1] == dict(HEAD_DIM=128, CAUSAL=True, STAGES=2, KV_REGS=False,
                                                         MASK_MODE=0, WINDOW=False, SOFTCAP=False, ALIBI=0,
                                                         DETERMINISTIC=False, DIM=0)
    meta = gb.kernel_args(128, True, "split", 1, True, True, 2, True)[1]
    assert (meta["MASK_MODE"], meta["WINDOW"], meta["SOFTCAP"], meta["ALIBI"], meta["DETERMINISTIC"]) == \
        (1, True, True, 2, True)
    assert gb.kernel_args(128, True, "split", 2)[1]["MASK_MODE"] == 2
    assert gb.kernel_args(64, False, "split")[1]["KV_REGS"]
    assert gb.kernel_args(128, True, "split", dim=96)[1]["DIM"] == 96  # a padded head dim's stores
    # the ordered dQ lives in the reducer, which hd256 (and the head dims padded to it) does not have
    assert [gb.deterministic_supported(d) for d in (48, 64, 96, 128, 160, 256)] == [False, True, True, True, False,
                                                                                     False]
    with pytest.raises(ValueError, match="variant must be one of"):
        gb.launch("wg2")


@pytest.mark.parametrize("case, match", [
    (dict(q=torch.zeros(2, 5, 4)), "must be \\[B, S, H, D\\]"),
    (dict(dout=torch.zeros(1, 6, 4, 64, dtype=torch.bfloat16)), "shaped like q"),
    (dict(lse=torch.zeros(1, 5, 4)), "lse must be \\[B, Hq, Sq\\]"),
    (dict(), "sm_90"),  # CPU tensors: the device check
])
def test_argument_errors(case, match):
    dout, q, k, v, out, lse = _args()
    args = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    args.update(case)
    with pytest.raises(ValueError, match=match):
        gb.gluon_attention_backward(args["dout"], args["q"], args["k"], args["v"], args["out"], args["lse"])


def test_offsets_bound():
    q = torch.empty(1, 2**16, 256, 128, dtype=torch.bfloat16, device="meta")
    assert not gb._offsets_fit(q)
    assert gb._offsets_fit(q[:, :1024])


@pytest.mark.skipif(not gb.HAS_GLUON, reason="this Triton has no Gluon Hopper module")
def test_barrier_overlaps_finds_scratch_on_an_unused_barrier():
    # the builds' "no allocation on an mbarrier" check, on a kernel built to fail it and on its sound twin
    builds = {b["name"]: b for b in run_build_script("barrier_overlap_control.py", timeout=300)}
    assert [b for b in builds.values() if "error" in b] == []
    assert builds["control barrier unused"]["barrier_overlaps"], builds
    assert builds["control barrier used"]["barrier_overlaps"] == [], builds
