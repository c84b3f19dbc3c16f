"""GPU checks of the Gluon Hopper attention backward (`gluon_attention_bwd`) against float64
(run on an H200: `TRITON_INTERPRET=0 pytest tests/gpu/test_gluon_attention_bwd_gpu.py`). Skipped without an sm_90
GPU. The yardstick is our plain-Triton backward (`flash_attention_backward`) on the same out / lse: the Gluon
kernel's relative error per gradient must be within 2x of it (plus a small floor).

With HF_FASTPATH_GPU_REPORT=path, every case's errors go to that JSON file as well."""

from __future__ import annotations

import pytest
import torch

from hf_fastpath.attention import reference
from hf_fastpath.kernels import gluon_attention as ga
from hf_fastpath.kernels import gluon_attention_bwd as gb
from hf_fastpath.kernels.flash_attention import flash_attention_backward

from tests.gpu.common import REPORT, attention_inputs, check_finite, needs_sm90_gluon, rel_error as _rel

pytestmark = needs_sm90_gluon(gb.HAS_GLUON)


def _inputs(*args, **kwargs):
    return attention_inputs(*args, **kwargs, dout=True)  # q, k, v, dout


def _check(name, q, k, v, dout, causal, floor=2e-3, variant=None):
    out, lse = ga.gluon_attention_forward(q, k, v, causal=causal)
    d64 = [t.double() for t in (q, k, v, dout)]
    ref_out, ref_lse = reference.attention_forward(*d64[:3], causal=causal)
    ref = reference.attention_backward(d64[3], *d64[:3], ref_out, ref_lse, causal=causal)
    check_finite(name, {"out": out}, q=q, k=k, v=v)
    got = gb.gluon_attention_backward(dout, q, k, v, out, lse, causal=causal, variant=variant)
    yard = flash_attention_backward(dout, q, k, v, out, lse, causal=causal)
    # all three at once: the report then says which gradients a rare NaN reaches
    check_finite(name, dict(zip(("dq", "dk", "dv"), got)), q=q, k=k, v=v, dout=dout, out=out, lse=lse)
    errs = {}
    scale = ref[2].norm()  # dV's: P^T . dO, never 0 here
    for gname, x, y, r, like in zip(("dq", "dk", "dv"), got, yard, ref, (q, k, v)):
        assert x.shape == like.shape and x.dtype == like.dtype, gname
        errs[gname] = (_rel(x, r, scale), _rel(y, r, scale))
    REPORT.append(dict(case=name, **{f"{g}_rel": e[0] for g, e in errs.items()},
                       **{f"{g}_rel_triton": e[1] for g, e in errs.items()}))
    for gname, (e, e_triton) in errs.items():
        assert e <= 2 * e_triton + floor, (name, gname, e, e_triton)
    return got, lse


LENGTHS = [1, 17, 129, 1000, 2049]
HEADS = [(4, 4), (32, 8)]  # MHA, GQA 32/8


@pytest.mark.parametrize("variant", list(gb.VARIANTS))
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}-{h[1]}")
@pytest.mark.parametrize("s", LENGTHS)
def test_matches_float64_reference(s, heads, causal, d, variant):
    hq, hkv = heads
    b = 2 if s <= 129 else 1
    _check(f"s={s} h={heads} causal={causal} d={d} {variant}", *_inputs(b, s, s, hq, hkv, d), causal,
           variant=variant)


@pytest.mark.parametrize("variant", list(gb.VARIANTS))
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("sq, sk", [(17, 1000), (1000, 129), (700, 130), (129, 2049), (2049, 1000), (1, 17)])
def test_sq_ne_sk_causal(sq, sk, d, variant):
    """Causal aligned bottom-right; with Sq > Sk the first Sq - Sk queries see no key (lse -inf): their dQ is
    exactly 0 and they add nothing to dK / dV (no NaN)."""
    q, k, v, dout = _inputs(2, sq, sk, 8, 2, d, seed=1)
    (dq, _, _), lse = _check(f"sq={sq} sk={sk} causal d={d} {variant}", q, k, v, dout, True, variant=variant)
    empty = (lse == float("-inf")).transpose(1, 2)  # [B, Sq, H]
    if empty.any():
        assert (dq[empty] == 0).all()
    _check(f"sq={sq} sk={sk} full d={d} {variant}", q, k, v, dout, False, variant=variant)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bhsd", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_dtypes_and_layouts(dtype, bhsd, d):
    _check(f"dtype={dtype} bhsd={bhsd} d={d}", *_inputs(2, 300, 333, 8, 2, d, dtype=dtype, bhsd=bhsd, seed=2),
           True)


def test_softmax_scale():
    q, k, v, dout = _inputs(1, 200, 200, 4, 2, 64, seed=3)
    out, lse = ga.gluon_attention_forward(q, k, v, causal=True, softmax_scale=0.3)
    d64 = [t.double() for t in (q, k, v, dout)]
    ref_out, ref_lse = reference.attention_forward(*d64[:3], causal=True, softmax_scale=0.3)
    ref = reference.attention_backward(d64[3], *d64[:3], ref_out, ref_lse, causal=True, softmax_scale=0.3)
    got = gb.gluon_attention_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=0.3)
    for x, r in zip(got, ref):
        assert _rel(x, r) < 2e-2


def test_lse_from_the_triton_forward():
    """The lse convention of `flash_attention_forward` (natural log, [B, Hq, Sq]) works as well."""
    from hf_fastpath.kernels.flash_attention import flash_attention_forward

    q, k, v, dout = _inputs(1, 333, 333, 8, 2, 128, seed=4)
    out, lse = flash_attention_forward(q, k, v, causal=True)[:2]
    got = gb.gluon_attention_backward(dout, q, k, v, out, lse, causal=True)
    yard = flash_attention_backward(dout, q, k, v, out, lse, causal=True)
    for x, y in zip(got, yard):
        assert _rel(x, y.double()) < 2e-2


def test_rejects_unsupported_inputs_with_a_clear_error():
    q, k, v, dout = _inputs(1, 16, 16, 4, 4, 64)
    out, lse = ga.gluon_attention_forward(q, k, v)
    with pytest.raises(ValueError, match="head dim"):
        gb.gluon_attention_backward(dout[..., :48], q[..., :48], k[..., :48], v[..., :48], out[..., :48], lse)
    with pytest.raises(ValueError, match="multiple"):
        gb.gluon_attention_backward(dout[:, :, :3], q[:, :, :3], k[:, :, :2], v[:, :, :2], out[:, :, :3],
                                    lse[:, :3])
    with pytest.raises(ValueError, match="bfloat16 or all float16"):
        gb.gluon_attention_backward(dout.half(), q, k, v, out, lse)
    assert gb.supported(dout, q, k, v) and not gb.supported(dout.float(), q.float(), k.float(), v.float())
    q, k, v, dout = _inputs(1, 16, 16, 4, 4, 256)
    out, lse = ga.gluon_attention_forward(q, k, v)
    with pytest.raises(ValueError, match="deterministic=True is not supported at head dim 256"):
        gb.gluon_attention_backward(dout, q, k, v, out, lse, deterministic=True)
