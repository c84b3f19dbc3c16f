"""GPU checks of the Gluon Hopper attention forward and backward with a padding mask (`key_mask`), packed sequences
(`segments`), a sliding window (`window_size`), a soft-cap (`softcap`) or ALiBi (`alibi_slopes`), alone and together,
against float64 (run
on an H200: `TRITON_INTERPRET=0 pytest tests/gpu/test_gluon_attention_masks_gpu.py`).
Skipped without an sm_90 GPU. Forward: out within 1e-2 (relative), lse within 2e-3, rows that see no key exactly 0
with lse -inf. Backward: each gradient's relative error within 2x our plain-Triton backward's on the same out / lse
(plus a small floor), and exactly 0 for queries that see no key.

With HF_FASTPATH_GPU_REPORT=path, every case's errors go to that JSON file as well."""

from __future__ import annotations

import pytest
import torch

from hf_fastpath.attention import reference
from hf_fastpath.kernels import gluon_attention as ga
from hf_fastpath.kernels import gluon_attention_bwd as gb
from hf_fastpath.kernels.flash_attention import flash_attention_backward, segment_table

from tests.gpu.common import REPORT, attention_inputs, check_finite, needs_sm90_gluon, rel_error as _rel

pytestmark = needs_sm90_gluon(ga.HAS_GLUON)


def key_mask(b, sk, kind, seed=0, dtype=torch.int64):
    """[B, Sk] padding masks: right / left padding of random lengths, random holes, or holes with a batch row that
    masks every key."""
    g = torch.Generator().manual_seed(seed)
    if kind in ("right", "left"):
        lengths = torch.randint(1, sk + 1, (b,), generator=g)
        pos = torch.arange(sk)
        m = pos[None] < lengths[:, None] if kind == "right" else pos[None] >= sk - lengths[:, None]
    else:
        m = torch.rand(b, sk, generator=g) < 0.7
        if kind == "empty":
            m[0] = False
    return m.to(dtype).cuda()


def segment_ids(b, s, kind, seed=0):
    """[B, S] packed-sequence ids: random cuts (some one-token segments), every token alone, one segment, or a few
    long segments (whole key tiles inside a segment: the unmasked path)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        if kind == "random":
            n = int(torch.randint(1, max(s // 8, 1) + 1, (1,), generator=g))
            cuts = torch.randperm(max(s - 1, 1), generator=g)[:n - 1] + 1 if s > 1 else torch.zeros(0, dtype=torch.long)
            ids = torch.zeros(s, dtype=torch.long)
            ids[cuts[cuts < s]] = 1
            ids = ids.cumsum(0)
        elif kind == "ones":
            ids = torch.arange(s)
        elif kind == "one":
            ids = torch.zeros(s, dtype=torch.long)
        else:  # "long": 1, ~s/3, 1, then the rest
            cut = [0, 1, 1 + s // 3, 2 + s // 3]
            ids = torch.zeros(s, dtype=torch.long)
            for c in cut[1:]:
                if c < s:
                    ids[c:] += 1
        rows.append(ids)
    return torch.stack(rows).cuda()


def _check(name, q, k, v, dout, causal, masks, floor=2e-3):
    out, lse = ga.gluon_attention_forward(q, k, v, causal=causal, **masks)
    d64 = [t.double() for t in (q, k, v, dout)]
    ref_out, ref_lse = reference.attention_forward(*d64[:3], causal=causal, **masks)
    assert out.shape == q.shape
    check_finite(name, dict(out=out), q=q, k=k, v=v)
    empty = ref_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), f"{name}: lse -inf rows differ from the reference"
    rows = empty.transpose(1, 2)  # [B, Sq, H]
    assert (out[rows] == 0).all(), f"{name}: a row that sees no key is not 0"
    out_rel = _rel(out, ref_out)
    lse_err = (lse.double() - ref_lse)[~empty].abs().max().item() if (~empty).any() else 0.0

    ref = reference.attention_backward(d64[3], *d64[:3], ref_out, ref_lse, causal=causal, **masks)
    got = gb.gluon_attention_backward(dout, q, k, v, out, lse, causal=causal, **masks)
    yard = flash_attention_backward(dout, q, k, v, out, lse, causal=causal, **masks)
    scale = ref[2].norm()
    check_finite(name, dict(zip(("dq", "dk", "dv"), got)), q=q, k=k, v=v, dout=dout, out=out, lse=lse, **masks)
    errs = {}
    for gname, x, y, r, like in zip(("dq", "dk", "dv"), got, yard, ref, (q, k, v)):
        assert x.shape == like.shape and x.dtype == like.dtype, gname
        errs[gname] = (_rel(x, r, scale), _rel(y, r, scale))
    assert (got[0][rows] == 0).all(), f"{name}: dq of a row that sees no key is not 0"
    REPORT.append(dict(case=name, out_rel=out_rel, lse_abs=lse_err, **{f"{g}_rel": e[0] for g, e in errs.items()},
                       **{f"{g}_rel_triton": e[1] for g, e in errs.items()}))
    assert out_rel < 1e-2 and lse_err < 2e-3, (name, out_rel, lse_err)
    for gname, (e, e_triton) in errs.items():
        assert e <= 2 * e_triton + floor, (name, gname, e, e_triton)


HEADS = [(4, 4), (16, 4)]  # MHA, GQA


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}-{h[1]}")
@pytest.mark.parametrize("kind", ["right", "left", "holes", "empty"])
@pytest.mark.parametrize("sq, sk", [(1, 1), (17, 17), (129, 129), (1000, 1000), (2049, 2049), (17, 1000),
                                    (1000, 129)])
def test_key_mask(sq, sk, kind, heads, causal, d):
    b = 3 if sk <= 1000 else 2
    q, k, v, dout = attention_inputs(b, sq, sk, *heads, d, dout=True, seed=sq + sk)
    _check(f"key_mask {kind} sq={sq} sk={sk} h={heads} causal={causal} d={d}", q, k, v, dout, causal,
           dict(key_mask=key_mask(b, sk, kind, seed=sq)))


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int32])
def test_key_mask_dtypes(dtype):
    q, k, v, dout = attention_inputs(2, 300, 300, 8, 2, 128, dout=True, seed=5)
    _check(f"key_mask dtype={dtype}", q, k, v, dout, True, dict(key_mask=key_mask(2, 300, "holes", 5, dtype)))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}-{h[1]}")
@pytest.mark.parametrize("kind", ["random", "ones", "one", "long"])
@pytest.mark.parametrize("s", [1, 17, 129, 300, 1000, 3001])
def test_segments(s, kind, heads, causal, d):
    b = 3 if s <= 1000 else 1
    q, k, v, dout = attention_inputs(b, s, s, *heads, d, dout=True, seed=s)
    _check(f"segments {kind} s={s} h={heads} causal={causal} d={d}", q, k, v, dout, causal,
           dict(segments=segment_table(segment_ids(b, s, kind, seed=s))))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s", [17, 1000, 2049])
def test_hd256_masks(s, causal):
    # head dim 256 (Gemma-2) with padding and packed sequences
    q, k, v, dout = attention_inputs(2, s, s, 8, 4, 256, dout=True, seed=s)
    for kind in ("right", "left", "holes", "empty"):
        _check(f"hd256 key_mask {kind} s={s} causal={causal}", q, k, v, dout, causal,
               dict(key_mask=key_mask(2, s, kind, seed=s)))
    for kind in ("random", "ones", "long"):
        _check(f"hd256 segments {kind} s={s} causal={causal}", q, k, v, dout, causal,
               dict(segments=segment_table(segment_ids(2, s, kind, seed=s))))


def test_bhsd_layout_and_fp16():
    q, k, v, dout = attention_inputs(2, 500, 500, 8, 2, 64, dtype=torch.float16, bhsd=True, dout=True, seed=7)
    _check("segments bhsd fp16", q, k, v, dout, True, dict(segments=segment_table(segment_ids(2, 500, "random"))))
    _check("key_mask bhsd fp16", q, k, v, dout, False, dict(key_mask=key_mask(2, 500, "left")))


def test_repeat_runs_are_bitwise_equal():
    q, k, v = attention_inputs(2, 2049, 2049, 8, 2, 128, seed=8)
    masks = dict(segments=segment_table(segment_ids(2, 2049, "random", seed=8)))
    first = ga.gluon_attention_forward(q, k, v, causal=True, **masks)
    for _ in range(3):
        again = ga.gluon_attention_forward(q, k, v, causal=True, **masks)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


WINDOWS = {"causal w0": (True, (0, -1)), "causal w63": (True, (63, -1)), "causal w200": (True, (200, -1)),
           "causal w1000": (True, (1000, -1)), "full w50": (False, (50, -1)), "full w100 r40": (False, (100, 40)),
           "full r0": (False, (-1, 0))}


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("sq, sk", [(1, 1), (17, 17), (129, 129), (1000, 1000), (2049, 2049), (17, 1000),
                                    (1000, 129)])
def test_window(sq, sk, window, d):
    # Mistral / Gemma-2 windows (causal, a left edge) and flash-attn's general (left, right) ones, bottom-right
    # aligned when Sq != Sk; rows that see no key (Sq > Sk, or a window past the keys) give 0
    causal, size = WINDOWS[window]
    b = 2
    q, k, v, dout = attention_inputs(b, sq, sk, 8, 2, d, dout=True, seed=sq + 3 * sk)
    _check(f"window {window} sq={sq} sk={sk} d={d}", q, k, v, dout, causal, dict(window_size=size))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("softcap", [1.5, 30.0])  # 1.5: most scores in tanh's bend; 30: nearly linear
@pytest.mark.parametrize("window", [None, (200, -1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s", [17, 300, 2049])
def test_softcap(s, causal, window, softcap, d):
    q, k, v, dout = attention_inputs(2, s, s, 8, 2, d, dout=True, seed=s + d)
    masks = dict(softcap=softcap) if window is None else dict(softcap=softcap, window_size=window)
    _check(f"softcap {softcap} window={window} s={s} causal={causal} d={d}", q, k, v, dout, causal, masks)


def alibi_slopes(heads, batch=None, seed=0):
    """ALiBi's slopes 2^(-8 i / heads) (BLOOM, Falcon-RW, MPT); per batch row ([batch, heads]) scaled at random."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)
    if batch is not None:
        g = torch.Generator().manual_seed(seed)
        slopes = slopes * torch.rand(batch, 1, generator=g) * 2
    return slopes.cuda()


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_batch", [False, True], ids=["per_head", "per_batch"])
@pytest.mark.parametrize("sq, sk", [(1, 1), (17, 17), (129, 129), (1000, 1000), (2049, 2049), (17, 1000),
                                    (1000, 129)])
def test_alibi(sq, sk, per_batch, causal, d):
    # BLOOM / Falcon-RW / MPT: -slope * |i + Sk - Sq - j| added to the scores, slopes per head (GQA: the backward's
    # iterations change head within a kv group) or per batch row and head; gentle slopes too (long-range weights)
    b = 2
    q, k, v, dout = attention_inputs(b, sq, sk, 8, 2, d, dout=True, seed=sq + 5 * sk)
    slopes = alibi_slopes(8, b if per_batch else None, seed=sq)
    _check(f"alibi per_batch={per_batch} sq={sq} sk={sk} causal={causal} d={d}", q, k, v, dout, causal,
           dict(alibi_slopes=slopes))
    _check(f"alibi gentle sq={sq} sk={sk} causal={causal} d={d}", q, k, v, dout, causal,
           dict(alibi_slopes=slopes / 64))


@pytest.mark.parametrize("d", [64, 128])
def test_alibi_with_masks(d):
    # ALiBi with padding (BLOOM / Falcon-RW batches), packed sequences, a window and a soft-cap
    q, k, v, dout = attention_inputs(3, 1000, 1000, 8, 2, d, dout=True, seed=13)
    slopes = alibi_slopes(8) / 8
    for kind in ("right", "left", "holes", "empty"):
        _check(f"alibi + key_mask {kind} d={d}", q, k, v, dout, True,
               dict(alibi_slopes=slopes, key_mask=key_mask(3, 1000, kind, seed=6)))
    _check(f"alibi + segments d={d}", q, k, v, dout, True,
           dict(alibi_slopes=slopes, segments=segment_table(segment_ids(3, 1000, "random", seed=7))))
    _check(f"alibi + window + softcap d={d}", q, k, v, dout, False,
           dict(alibi_slopes=slopes, window_size=(200, 30), softcap=5.0))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_window_with_masks(d):
    # a window together with padding or packed sequences (Gemma-2 / Mistral batches), soft-cap too
    q, k, v, dout = attention_inputs(3, 1000, 1000, 8, 2, d, dout=True, seed=11)
    for kind in ("right", "holes", "empty"):
        _check(f"window + key_mask {kind} d={d}", q, k, v, dout, True,
               dict(window_size=(150, -1), key_mask=key_mask(3, 1000, kind, seed=3)))
    for kind in ("random", "long", "ones"):
        _check(f"window + segments {kind} d={d}", q, k, v, dout, True,
               dict(window_size=(150, -1), segments=segment_table(segment_ids(3, 1000, kind, seed=4))))
    _check(f"window + segments + softcap d={d}", q, k, v, dout, True,
           dict(window_size=(300, -1), softcap=5.0, segments=segment_table(segment_ids(3, 1000, "random", seed=5))))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("features", ["causal", "full", "window", "softcap", "alibi"])
@pytest.mark.parametrize("lengths", ["mixed", "ones", "one"])
def test_varlen_one_packing(lengths, features, d):
    # varlen inputs whose queries and keys share one cu_seqlens tensor (packed training), through the backend
    # `attention` picks: against float64, with empty and one-token sequences; gradients within 2x the Triton varlen
    # kernel's error
    from hf_fastpath.attention import attention

    lens = {"mixed": [700, 0, 1, 129, 2000, 1, 63], "ones": [1] * 40, "one": [1500]}[lengths]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    total = int(cu[-1])
    q, k, v, dout = (t[0] for t in attention_inputs(1, total, total, 8, 2, d, dout=True, seed=len(lens)))
    kw = dict(causal=features != "full", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
              max_seqlen_k=max(lens), window_size=(150, -1) if features == "window" else (-1, -1),
              softcap=5.0 if features == "softcap" else 0.0,
              alibi_slopes=alibi_slopes(8) / 8 if features == "alibi" else None)
    results = {}
    for backend in ("gluon", "triton"):
        x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = attention(*x, backend=backend, return_lse=True, **kw)
        results[backend] = (out, lse, torch.autograd.grad(out, x, dout))
    x64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference.attention_forward(*x64, **kw)
    ref = torch.autograd.grad(ref_out, x64, dout.double())
    out, lse, grads = results["gluon"]
    name = f"varlen {lengths} {features} d={d}"
    assert lse.shape == ref_lse.shape and torch.isfinite(out).all(), name
    out_rel, lse_err = _rel(out, ref_out), (lse.double() - ref_lse).abs().max().item()
    scale = ref[2].norm()
    errs = {g: (_rel(a, r, scale), _rel(b, r, scale)) for g, a, b, r in zip(("dq", "dk", "dv"), grads,
                                                                               results["triton"][2], ref)}
    REPORT.append(dict(case=name, out_rel=out_rel, lse_abs=lse_err, **{f"{g}_rel": e[0] for g, e in errs.items()}))
    assert out_rel < 1e-2 and lse_err < 2e-3, (name, out_rel, lse_err)
    for g, (e, e_triton) in errs.items():
        assert e <= 2 * e_triton + 2e-3, (name, g, e, e_triton)


def test_rejects_bad_masks_with_a_clear_error():
    q, k, v = attention_inputs(2, 16, 16, 4, 4, 64)
    with pytest.raises(ValueError, match="key_mask must be"):
        ga.gluon_attention_forward(q, k, v, key_mask=torch.ones(3, 16, device="cuda"))
    with pytest.raises(ValueError, match="segments must be"):
        ga.gluon_attention_forward(q, k[:, :8], v[:, :8], segments=segment_table(segment_ids(2, 16, "one")))
    with pytest.raises(ValueError, match="not both"):
        ga.gluon_attention_forward(q, k, v, key_mask=torch.ones(2, 16, device="cuda"),
                                   segments=segment_table(segment_ids(2, 16, "one")))
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        ga.gluon_attention_forward(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match=r"alibi_slopes must be \[num_heads\] or \[batch, num_heads\]"):
        ga.gluon_attention_forward(q, k, v, alibi_slopes=torch.ones(3, 4, device="cuda"))
