"""GPU checks of the Gluon backward's deterministic mode (`gluon_attention_backward(..., deterministic=True)`: the key
blocks add their dQ tiles in a fixed order per query tile). Every input of that order is varied: causal or not,
Sq != Sk, GQA, sliding windows (left and right edges), packed segments, key masks, and soft-cap / ALiBi on top.
Each case must give bitwise equal gradients over repeated runs and match float64 as closely as the default mode's
tolerance (`test_gluon_attention_masks_gpu._check`'s: within 2x our Triton backward's error). Skipped without an
sm_90 GPU.

A wrong order makes a key block wait for a turn that never comes: the wait gives up after ~2^24 polls (seconds a
tile), so such a bug shows as a slow, non-repeatable case rather than a hang."""

from __future__ import annotations

import pytest
import torch

from hf_fastpath.attention import reference
from hf_fastpath.kernels import gluon_attention as ga
from hf_fastpath.kernels import gluon_attention_bwd as gb
from hf_fastpath.kernels.flash_attention import flash_attention_backward, segment_table

from tests.gpu.common import REPORT, attention_inputs, check_finite, needs_sm90_gluon, rel_error as _rel
from tests.gpu.test_gluon_attention_masks_gpu import alibi_slopes, key_mask, segment_ids

pytestmark = needs_sm90_gluon(ga.HAS_GLUON)


def _masks(feature, b, sq, sk, hq, seed):
    if feature == "segments":
        return dict(segments=segment_table(segment_ids(b, sq, "random", seed=seed)))
    if feature == "segments window":
        return dict(segments=segment_table(segment_ids(b, sq, "long", seed=seed)), window_size=(300, -1))
    if feature == "key_mask":
        return dict(key_mask=key_mask(b, sk, "holes", seed=seed))
    if feature == "window":
        return dict(window_size=(200, -1))
    if feature == "window left right":
        return dict(window_size=(300, 100))
    if feature == "softcap":
        return dict(softcap=30.0)
    if feature == "alibi":
        return dict(alibi_slopes=alibi_slopes(hq))
    return {}


CASES = [  # (feature, sq, sk, causal)
    ("plain", 2049, 2049, True), ("plain", 2049, 2049, False), ("plain", 1000, 2049, True),
    ("plain", 2049, 700, True), ("plain", 129, 3001, False), ("plain", 1, 1, True),
    ("segments", 3001, 3001, True), ("segments", 3001, 3001, False), ("segments window", 3001, 3001, True),
    ("key_mask", 2049, 2049, True), ("window", 3001, 3001, True), ("window", 1000, 3001, True),
    ("window left right", 2049, 2049, False), ("softcap", 2049, 2049, True), ("alibi", 2049, 2049, True),
]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (16, 4)], ids=lambda h: f"h{h[0]}-{h[1]}")
@pytest.mark.parametrize("feature, sq, sk, causal", CASES, ids=lambda c: str(c))
def test_deterministic_backward(feature, sq, sk, causal, heads, d):
    name = f"deterministic {feature} sq={sq} sk={sk} causal={causal} h={heads} d={d}"
    b = 2
    q, k, v, dout = attention_inputs(b, sq, sk, *heads, d, dout=True, seed=sq + sk + d)
    masks = _masks(feature, b, sq, sk, heads[0], seed=sq)
    out, lse = ga.gluon_attention_forward(q, k, v, causal=causal, **masks)
    first = gb.gluon_attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, **masks)
    for _ in range(3):
        again = gb.gluon_attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, **masks)
        for gname, x, y in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(x, y), f"{name}: {gname} differs between runs"

    d64 = [t.double() for t in (q, k, v, dout)]
    ref_out, ref_lse = reference.attention_forward(*d64[:3], causal=causal, **masks)
    ref = reference.attention_backward(d64[3], *d64[:3], ref_out, ref_lse, causal=causal, **masks)
    yard = flash_attention_backward(dout, q, k, v, out, lse, causal=causal, **masks)
    scale = ref[2].norm()
    check_finite(name, dict(zip(("dq", "dk", "dv"), first)), q=q, k=k, v=v, dout=dout, out=out, lse=lse, **masks)
    errs = {}
    for gname, x, y, r in zip(("dq", "dk", "dv"), first, yard, ref):
        errs[gname] = (_rel(x, r, scale), _rel(y, r, scale))
    REPORT.append(dict(case=name, **{f"{g}_rel": e[0] for g, e in errs.items()},
                       **{f"{g}_rel_triton": e[1] for g, e in errs.items()}))
    for gname, (e, e_triton) in errs.items():
        assert e <= 2 * e_triton + 2e-3, (name, gname, e, e_triton)


def test_default_mode_adds_in_arrival_order():
    """The control: without `deterministic`, dQ of a long GQA call does differ between runs (the atomics land in
    arrival order), so the test above can tell the two modes apart. dK / dV never differ (one CTA each)."""
    q, k, v, dout = attention_inputs(1, 8192, 8192, 32, 8, 128, dout=True, seed=9)
    out, lse = ga.gluon_attention_forward(q, k, v, causal=False)
    runs = [gb.gluon_attention_backward(dout, q, k, v, out, lse) for _ in range(5)]
    assert all(torch.equal(r[1], runs[0][1]) and torch.equal(r[2], runs[0][2]) for r in runs)
    assert any(not torch.equal(r[0], runs[0][0]) for r in runs[1:])
