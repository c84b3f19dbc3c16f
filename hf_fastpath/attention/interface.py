"""One functional API over every attention backend.

`attention(q, k, v, ...)` is differentiable and picks a backend; `attention_forward` / `attention_backward` are the
raw (non-autograd) halves that ring attention composes. Semantics are defined in `reference.py`.
"""

from __future__ import annotations

import os

import torch

from . import reference

__all__ = ["attention", "attention_forward", "attention_backward", "use_triton"]


def use_triton(t: torch.Tensor) -> bool:
    """Own Triton kernels run on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1 (CI)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _raw_backend(q):
    # TODO(attention kernels): replace with the real backend choice once triton_backend exists.
    if use_triton(q):
        try:
            from . import triton_backend

            return triton_backend
        except ImportError:
            pass
    return reference


def attention_forward(q, k, v, **kw):
    """`(out, lse)` for one block of attention; kwargs as in `reference.attention_forward`."""
    return _raw_backend(q).attention_forward(q, k, v, **kw)


def attention_backward(dout, q, k, v, out, lse, **kw):
    """`(dq, dk, dv)` from the (possibly merged) out and lse; `grad_dtype=torch.float32` keeps partial sums exact."""
    return _raw_backend(q).attention_backward(dout, q, k, v, out, lse, **kw)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kw):
        out, lse = attention_forward(q, k, v, **kw)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kw = kw
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(dout.contiguous(), q, k, v, out, lse, **ctx.kw)
        return dq, dk, dv, None


def attention(
    q,
    k,
    v,
    *,
    causal=False,
    softmax_scale=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    return_lse=False,
    backend="auto",
):
    """FlashAttention in the `[B, S, H, D]` layout (or `[T, H, D]` with `cu_seqlens_q/k`).

    Returns `out`, or `(out, lse)` with `return_lse=True` (lse fp32, `[B, Hq, Sq]` or `[Hq, T]`).
    The LSE is returned for composition (ring attention) and carries no gradient.
    `backend`: "auto" (FA3 > FA4 > FA2 > own Triton on CUDA; reference on CPU unless TRITON_INTERPRET=1),
    or one of "triton", "fa2", "fa3", "fa4", "reference" (fails clearly when missing).
    """
    if backend not in ("auto", "reference", "triton"):  # TODO(attention kernels): FA adapters
        raise NotImplementedError(f"attention backend {backend!r} is not available yet")
    kw = dict(
        causal=causal,
        softmax_scale=softmax_scale,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        window_size=tuple(window_size),
        softcap=softcap,
        alibi_slopes=alibi_slopes,
    )
    out, lse = _Attention.apply(q, k, v, kw)
    return (out, lse) if return_lse else out
