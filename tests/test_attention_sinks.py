"""Attention sinks (gpt-oss's `s_aux`) through `hf_fastpath.attention(..., sinks=...)`: the Triton kernels
(interpreted on the CPU) and the reference path against a float64 model written from the definition — one softmax
over the visible scores plus the sink logit, the sink's column dropped — forward and backward, sinks included."""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_fastpath.attention import attention
from hf_fastpath.attention.backends import BackendUnavailable
from hf_fastpath.attention.reference import visible_mask

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(not INTERPRETED, reason="interpreted"))]
TOL = {torch.float32: 2e-4, torch.bfloat16: 5e-2}


def sink_attention_float64(q, k, v, sinks, *, causal=False, window_size=(-1, -1), key_mask=None, scale=None):
    """q `[B, Sq, Hq, D]`, k/v `[B, Sk, Hkv, D]`, sinks `[Hq]` -> out `[B, Sq, Hq, D]`, in float64 (autograd), on
    q's device."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    k, v = (t.repeat_interleave(hq // hkv, 2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (scale if scale is not None else d ** -0.5)
    keep = torch.ones(b, 1, sq, sk, dtype=torch.bool, device=q.device)
    visible = visible_mask(sq, sk, causal, window_size, q.device)
    if visible is not None:
        keep = keep & visible
    if key_mask is not None:
        keep = keep & (key_mask > 0)[:, None, None, :]
    scores = scores.masked_fill(~keep, float("-inf"))
    with_sink = torch.cat([scores, sinks[None, :, None, None].expand(b, hq, sq, 1)], dim=-1)
    p = torch.softmax(with_sink, dim=-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _inputs(b, sq, sk, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
               for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    sinks = (2 * torch.randn(hq, generator=g, dtype=torch.float64)).float().requires_grad_()
    return q, k, v, sinks


def _check(backend, q, k, v, sinks, **kw):
    out = attention(q, k, v, sinks=sinks, backend=backend, **kw)
    ref_kw = {n: kw[n] for n in ("causal", "window_size", "key_mask") if n in kw}
    want = sink_attention_float64(q, k, v, sinks, scale=kw.get("softmax_scale"), **ref_kw)
    tol = TOL[q.dtype]
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v, sinks), dout.to(out.dtype))
    ref = torch.autograd.grad(want, (q, k, v, sinks), dout)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), got, ref):
        assert torch.isfinite(g).all(), name
        scale = max(r.abs().max().item(), 1.0)
        torch.testing.assert_close(g.double(), r.double(), atol=2 * tol * scale, rtol=2 * tol,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,kw", [
    (2, 37, 37, 4, 2, 32, dict(causal=True)),
    (1, 33, 33, 2, 2, 64, dict(causal=False)),
    (1, 40, 40, 4, 1, 16, dict(causal=True, window_size=(7, 0))),  # gpt-oss: sliding-window layers, MQA here
    (1, 5, 29, 4, 2, 32, dict(causal=True)),  # decode-like, bottom-right causal
    (1, 29, 11, 2, 1, 32, dict(causal=True)),  # Sq > Sk: the first rows see no key, their mass goes to the sink
    (2, 17, 17, 2, 2, 48, dict(causal=True, softmax_scale=0.3)),
])
def test_sinks_match_the_definition(backend, b, sq, sk, hq, hkv, d, kw):
    _check(backend, *_inputs(b, sq, sk, hq, hkv, d, torch.float32), **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_with_padding_and_a_fully_padded_row(backend):
    q, k, v, sinks = _inputs(3, 21, 21, 4, 2, 32, torch.float32, seed=1)
    key_mask = torch.ones(3, 21, dtype=torch.long)
    key_mask[0, :6] = 0  # left padding
    key_mask[2] = 0  # nothing to attend: zeros, no NaN
    _check(backend, q, k, v, sinks, causal=True, key_mask=key_mask)


@pytest.mark.skipif(not INTERPRETED, reason="interpreted")
def test_sinks_in_bfloat16_on_the_kernel():
    _check("triton", *_inputs(2, 33, 33, 4, 2, 64, torch.bfloat16, seed=2), causal=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_sinks_equal_each_sequence_alone(backend):
    lens = [9, 0, 1, 23]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v, sinks = _inputs(1, sum(lens), sum(lens), 4, 2, 32, torch.float32, seed=3)
    out = attention(q[0], k[0], v[0], causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                    max_seqlen_k=max(lens), sinks=sinks, backend=backend)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    got = torch.autograd.grad(out, (q, k, v, sinks), dout)
    want_out, want_sinks = [], torch.zeros(4, dtype=torch.float64)
    want = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    for start, n in zip(cu[:-1].tolist(), lens):
        if n == 0:
            continue
        part = [t.detach()[:, start:start + n].double().requires_grad_() for t in (q, k, v)]
        s = sinks.detach().double().requires_grad_()
        o = sink_attention_float64(*part, s, causal=True)
        grads = torch.autograd.grad(o, (*part, s), dout[None, start:start + n].double())
        for acc, g in zip(want, grads[:3]):
            acc[:, start:start + n] = g
        want_sinks += grads[3]
        want_out.append(o[0])
    torch.testing.assert_close(out.double(), torch.cat(want_out), atol=2e-4, rtol=2e-4)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), got, (*want, want_sinks)):
        torch.testing.assert_close(g.double(), r.double(), atol=5e-4, rtol=5e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.skipif(not INTERPRETED, reason="interpreted")
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sq=st.integers(1, 40), extra_k=st.integers(0, 20), hkv=st.sampled_from([1, 2]), rep=st.sampled_from([1, 3]),
       d=st.sampled_from([16, 24, 64]), left=st.sampled_from([-1, 0, 5]), seed=st.integers(0, 2**16))
def test_random_shapes_on_the_kernel(sq, extra_k, hkv, rep, d, left, seed):
    _check("triton", *_inputs(1, sq, sq + extra_k, hkv * rep, hkv, d, torch.float32, seed=seed), causal=True,
           window_size=(left, 0))


def test_sinks_return_the_lse_of_the_whole_row():
    q, k, v, sinks = _inputs(1, 9, 9, 2, 2, 16, torch.float32)
    _, lse = attention(q, k, v, causal=True, return_lse=True, backend="reference")
    _, lse_sinks = attention(q, k, v, causal=True, sinks=sinks, return_lse=True, backend="reference")
    torch.testing.assert_close(lse_sinks, torch.logaddexp(lse, sinks[:, None]))


def test_bad_sink_calls_are_refused_clearly():
    q, k, v, sinks = _inputs(1, 8, 8, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match=r"one logit per query head, shape \(4,\)"):
        attention(q, k, v, sinks=sinks[:2])
    with pytest.raises(NotImplementedError, match="dropout"):
        attention(q, k, v, sinks=sinks, dropout_p=0.1)
    with pytest.raises(BackendUnavailable, match="'sdpa' has no attention sinks"):
        attention(q, k, v, sinks=sinks, backend="sdpa")
