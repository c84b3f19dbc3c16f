"""GPU checks of attention sinks (`attention(..., sinks=...)`, the compiled Triton kernels) against the float64
definition of `tests/test_attention_sinks.py`, at gpt-oss's head layout (64 query heads of 64 over 8 KV heads, every
other layer a 128-token window), forward and backward, sinks included. Run on the device:
`TRITON_INTERPRET=0 pytest tests/gpu/test_attention_sinks_gpu.py`."""

from __future__ import annotations

import os

import pytest
import torch

from hf_fastpath.attention import attention
from tests.gpu.common import REPORT
from tests.test_attention_sinks import sink_attention_float64

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA GPU (and TRITON_INTERPRET unset or 0)")


DEVICE = "cuda"  # the float64 definition runs there too (64 heads of 2000 x 2000 scores)


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,sq,sk,window,padded", [
    (2, 1024, 1024, -1, False), (1, 2000, 2000, 127, False), (2, 777, 777, 127, True),
    (4, 1, 1537, -1, True),  # decoding
])
def test_sinks_on_the_compiled_kernel(dtype, b, sq, sk, window, padded):
    g = torch.Generator().manual_seed(sq + sk)
    q = torch.randn(b, sq, 64, 64, generator=g).to(dtype)
    k, v = (torch.randn(b, sk, 8, 64, generator=g).to(dtype) for _ in range(2))
    sinks = 2 * torch.randn(64, generator=g)
    key_mask = None
    if padded:
        key_mask = torch.ones(b, sk, dtype=torch.long)
        key_mask[0, : sk // 3] = 0
    kw = dict(causal=True, window_size=(window, 0))
    qc, kc, vc, sc = (t.to(DEVICE).detach().requires_grad_() for t in (q, k, v, sinks))
    out = attention(qc, kc, vc, sinks=sc, key_mask=None if key_mask is None else key_mask.to(DEVICE), **kw)
    dout = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(dout.to(DEVICE))
    q64, k64, v64, s64 = (t.to(DEVICE, torch.float64).detach().requires_grad_() for t in (q, k, v, sinks))
    want = sink_attention_float64(q64, k64, v64, s64, key_mask=None if key_mask is None else key_mask.to(DEVICE), **kw)
    want.backward(dout.to(DEVICE, torch.float64))
    errs = {"out": _rel(out.detach(), want.detach())}
    for name, got, ref in zip(("dq", "dk", "dv", "dsinks"), (qc, kc, vc, sc), (q64, k64, v64, s64)):
        errs[name] = _rel(got.grad, ref.grad)
    REPORT.append(dict(case=f"{dtype} b{b} {sq}x{sk} w{window} pad{padded}", **errs))
    bad = {n: e for n, e in errs.items() if not e <= 2e-2}
    assert not bad, bad
