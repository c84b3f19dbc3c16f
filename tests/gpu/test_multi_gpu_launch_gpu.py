"""Kernels called with inputs on cuda:1 while cuda:0 is current (a model split over GPUs by `device_map="auto"`)
give the same results as with cuda:1 current. Needs two GPUs: `TRITON_INTERPRET=0 pytest
tests/gpu/test_multi_gpu_launch_gpu.py` on an nvidia-h200-x2 machine; skipped elsewhere."""

from __future__ import annotations

import os

import pytest
import torch

from hf_fastpath.kernels.flash_attention import flash_attention_backward, flash_attention_forward
from hf_fastpath.kernels.w4a16 import w4a16_matmul, w4a16_matmul_grad_input, w4a16_pack

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs two CUDA GPUs (and TRITON_INTERPRET unset or 0)")


def _on_cuda1_with_cuda0_current(fn):
    """fn() with cuda:0 current, then with cuda:1 current; both results (on cuda:1)."""
    with torch.cuda.device(0):
        away = fn()
    torch.cuda.synchronize(1)
    with torch.cuda.device(1):
        home = fn()
    torch.cuda.synchronize(1)
    return away, home


def test_attention_forward_and_backward_on_another_gpu():
    g = torch.Generator(device="cuda:1").manual_seed(0)
    q, k, v, do = (torch.randn(2, 300, 4, 64, device="cuda:1", dtype=torch.bfloat16, generator=g) for _ in range(4))

    def run():
        out, lse = flash_attention_forward(q, k, v, causal=True)
        return (out, lse, *flash_attention_backward(do, q, k, v, out, lse, causal=True))

    away, home = _on_cuda1_with_cuda0_current(run)
    assert all(t.device == torch.device("cuda:1") for t in away)
    (out_a, lse_a, *grads_a), (out_b, lse_b, *grads_b) = away, home
    torch.testing.assert_close(out_a, out_b, atol=0, rtol=0)  # the forward is deterministic
    torch.testing.assert_close(lse_a, lse_b, atol=0, rtol=0)
    for a, b in zip(grads_a, grads_b):  # dq sums through atomics: the order may vary
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("m", [1, 16, 100, 300])
def test_w4a16_on_another_gpu(m):
    g = torch.Generator(device="cuda:1").manual_seed(m)
    k, n = 1024, 512
    qweight = w4a16_pack(torch.randint(0, 16, (k, n), device="cuda:1", generator=g))
    scales = (torch.rand(k // 128, n, device="cuda:1", generator=g) * 0.05).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (k // 128, n), device="cuda:1", generator=g).to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda:1", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(m, n, device="cuda:1", dtype=torch.bfloat16, generator=g)

    def run():
        return (w4a16_matmul(x, qweight, scales, zeros, 128), w4a16_matmul_grad_input(dy, qweight, scales, zeros, 128))

    away, home = _on_cuda1_with_cuda0_current(run)
    for a, b in zip(away, home):
        assert a.device == torch.device("cuda:1")
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)  # split-K sums may differ in order
