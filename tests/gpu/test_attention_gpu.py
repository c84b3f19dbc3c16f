"""GPU checks of the attention kernels against float64 (run on the device: `TRITON_INTERPRET=0 pytest tests/gpu`).

Skipped without CUDA. With HF_FASTPATH_GPU_REPORT=path, every case's errors go to that JSON file as well.
"""

from __future__ import annotations

import os

import pytest
import torch

from hf_fastpath.attention import reference
from hf_fastpath.attention.ops import flash_attn

from tests.gpu.common import REPORT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA GPU (and TRITON_INTERPRET unset or 0)")


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


def _check(case, q, k, v, grads=False, tol=1e-2, **kw):
    """ops.flash_attn vs reference in float64: relative errors of out (and dq, dk, dv)."""
    qg, kg, vg = (t.detach().requires_grad_(grads) for t in (q, k, v))
    out, lse = flash_attn(qg, kg, vg, softmax_scale=q.shape[-1] ** -0.5, **kw)
    ref_kw = {n: x for n, x in kw.items()}
    want, want_lse = reference.attention_forward(*(t.double().cpu() for t in (q, k, v)),
                                                 softmax_scale=q.shape[-1] ** -0.5,
                                                 **{n: (x.cpu() if torch.is_tensor(x) else x)
                                                    for n, x in ref_kw.items()})
    errs = {"out": _rel(out.cpu(), want)}
    assert torch.isfinite(out).all()
    fin = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    if grads:
        g = torch.randn_like(out)
        out.backward(g)
        ref = reference.attention_backward(g.double().cpu(), *(t.double().cpu() for t in (q, k, v)), want,
                                           want_lse, softmax_scale=q.shape[-1] ** -0.5,
                                           **{n: (x.cpu() if torch.is_tensor(x) else x) for n, x in ref_kw.items()})
        for name, got, w in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), ref):
            errs[name] = _rel(got.cpu(), w)
    REPORT.append(dict(case=case, **errs))
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"{case}: {bad}"


def _qkv(b, sq, sk, hq, hkv, d):
    mk = lambda s, h: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    return mk(sq, hq), mk(sk, hkv), mk(sk, hkv)


@pytest.mark.parametrize("d", [32, 64, 80, 96, 128, 160, 192, 224, 256])
@pytest.mark.parametrize("sq", [1, 2, 3])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
def test_small_query_every_head_dim(d, sq, heads):
    torch.manual_seed(d * 10 + sq)
    q, k, v = _qkv(3, sq, 777, *heads, d)
    _check(f"decode d{d} q{sq} h{heads}", q, k, v, causal=True)
    used = torch.tensor([777, 400, sq], device="cuda", dtype=torch.int32)  # a static cache, one row nearly empty
    _check(f"static d{d} q{sq} h{heads}", q, k, v, causal=True, seqused_k=used)
    mask = torch.rand(3, 777, device="cuda") > 0.2
    mask[2] = False  # a row that sees no key: zeros, lse -inf
    _check(f"key mask d{d} q{sq} h{heads}", q, k, v, causal=True, key_mask=mask)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_forward_backward_with_key_mask(d, causal):
    torch.manual_seed(d)
    q, k, v = _qkv(2, 300, 300, 8, 2, d)
    mask = torch.ones(2, 300, dtype=torch.bool, device="cuda")
    mask[0, :37] = False  # left padding
    mask[1, 250:] = False  # right padding
    _check(f"train d{d} causal{causal} padded", q, k, v, grads=True, causal=causal, key_mask=mask)
    _check(f"train d{d} causal{causal}", q, k, v, grads=True, causal=causal)


@pytest.mark.parametrize("sq", [1, 7, 64, 129])
def test_static_cache_chunks(sq):
    torch.manual_seed(sq)
    q, k, v = _qkv(2, sq, 2048, 32, 8, 128)
    used = torch.tensor([1500, sq + 3], device="cuda", dtype=torch.int32)
    _check(f"static chunk q{sq}", q, k, v, causal=True, seqused_k=used)


@pytest.mark.parametrize("d", [64, 128])
def test_packed_segments_forward_backward(d):
    from hf_fastpath.kernels.flash_attention import segment_table

    torch.manual_seed(d + 1)
    lengths = [700, 1, 333, 64, 950]  # one-token and block-straddling sequences
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].cuda()
    q, k, v = _qkv(1, sum(lengths), sum(lengths), 8, 2, d)
    _check(f"packed d{d}", q, k, v, grads=True, causal=True, segments=segment_table(ids))
