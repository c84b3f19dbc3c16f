"""`hf-fastpath bench`: a one-minute check of this GPU against the peers (full sweeps live in `benchmarks/`)."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def _time_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_attention() -> list[tuple[str, float, float]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .attention import attention

    rows = []
    for seq in (2048, 8192):
        b, h, d = 16384 // seq, 16, 128
        q, k, v = (torch.randn(b, seq, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * seq * seq * d / 2  # causal
        ours = _time_ms(lambda: attention(q, k, v, causal=True, backend="triton"))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            peer = _time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True))
        rows.append((f"attention fwd causal bf16 seq {seq} hd {d}", flops / ours / 1e9, flops / peer / 1e9))
    return rows


def bench_w4a16() -> list[tuple[str, float, float]]:
    from .kernels.w4a16 import w4a16_matmul

    rows = []
    k, n, gs = 4096, 14336, 128
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), device="cuda", dtype=torch.int32)
    scales = torch.rand(k // gs, n, device="cuda", dtype=torch.bfloat16) / 100
    zeros = torch.full((k // gs, n), 8.0, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for m in (1, 16, 2048):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ours = _time_ms(lambda: w4a16_matmul(x, qweight, scales, zeros, gs))
        peer = _time_ms(lambda: x @ w.T)
        flops = 2 * m * k * n
        rows.append((f"w4a16 {k}x{n} M={m}", flops / ours / 1e9, flops / peer / 1e9))
    return rows


def main(args) -> int:
    if not torch.cuda.is_available():
        print("hf-fastpath bench needs a CUDA GPU (see `hf-fastpath env`).")
        return 1
    rows = []
    if args.what in ("attention", "all"):
        rows += bench_attention()
    if args.what in ("w4a16", "all"):
        rows += bench_w4a16()
    print(f"{'case':<44} {'ours TFLOP/s':>13} {'peer TFLOP/s':>13} {'ratio':>6}")
    for name, ours, peer in rows:
        print(f"{name:<44} {ours:>13.1f} {peer:>13.1f} {ours / peer:>6.2f}")
    print("peers: SDPA cuDNN backend (attention), cuBLAS bf16 x @ W.T (w4a16)")
    return 0
