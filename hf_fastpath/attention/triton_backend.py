"""Own Triton FlashAttention as an attention backend: validates inputs, then calls `kernels.flash_attention`.

Same functions and keyword arguments as `reference.py` (which defines the semantics).
"""

from __future__ import annotations


import torch

from ..kernels.flash_attention import flash_attention_backward, flash_attention_forward
from ..kernels.common import triton_runs_on
from .params import check_qkv

__all__ = ["attention_forward", "attention_backward", "check_inputs", "MAX_HEAD_DIM", "SUPPORTED_DTYPES"]

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _device_ok(t: torch.Tensor) -> bool:
    return triton_runs_on(t)


def check_inputs(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, alibi_slopes=None, window_size=(-1, -1)):
    """Raise a ValueError/TypeError naming the problem and the fix; return cu_seqlens as contiguous int32. The
    layout checks are `params.check_qkv`'s; these add what our kernels need (dtype, device, head dim)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"Triton attention supports float16, bfloat16 and float32; {name} is {t.dtype}. "
                            f"Cast the inputs (e.g. q.to(torch.bfloat16)) or use backend='reference'.")
        if isinstance(t, torch.Tensor) and not _device_ok(t):
            raise ValueError(f"Triton attention needs CUDA tensors; {name} is on {t.device}. Move the tensors to "
                             f"the GPU, use backend='reference', or set TRITON_INTERPRET=1 to interpret on the CPU.")
    check_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k)
    d, dv = q.shape[-1], v.shape[-1]
    if not (0 < d <= MAX_HEAD_DIM and 0 < dv <= MAX_HEAD_DIM):
        raise ValueError(f"Triton attention supports head dims up to {MAX_HEAD_DIM}; got {d} (q/k) and {dv} (v). "
                         f"Use backend='reference' for larger heads.")
    if cu_seqlens_q is not None:
        cu_seqlens_q, cu_seqlens_k = (cu.to(torch.int32).contiguous() for cu in (cu_seqlens_q, cu_seqlens_k))
    if alibi_slopes is not None:
        hq = q.shape[-2]
        batch = cu_seqlens_q.numel() - 1 if cu_seqlens_q is not None else q.shape[0]
        if alibi_slopes.shape not in ((hq,), (batch, hq)):
            raise ValueError(f"alibi_slopes must be [heads] or [batch, heads] = ({hq},) or ({batch}, {hq}), got "
                             f"{tuple(alibi_slopes.shape)}.")
    if len(tuple(window_size)) != 2:
        raise ValueError(f"window_size must be (left, right) with -1 for unbounded, got {window_size!r}.")
    return cu_seqlens_q, cu_seqlens_k


def attention_forward(q, k, v, *, causal=False, softmax_scale=None, cu_seqlens_q=None, cu_seqlens_k=None,
                      max_seqlen_q=None, max_seqlen_k=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                      seqused_k=None, key_mask=None, segments=None, compute_dtype=None, out_dtype=None):
    """`(out, lse)`; see `reference.attention_forward`. `compute_dtype` is accepted for a uniform signature: the
    kernel always accumulates in fp32. `out_dtype` (default q.dtype) lets ring attention keep fp32 partials."""
    if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"out_dtype must be one of float16, bfloat16, float32, got {out_dtype}.")
    cu_q, cu_k = check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, window_size)
    return flash_attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens_q=cu_q,
                                   cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                   window_size=tuple(window_size), softcap=float(softcap or 0.0),
                                   alibi_slopes=alibi_slopes, seqused_k=seqused_k, key_mask=key_mask,
                                   segments=segments, out_dtype=out_dtype)


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, cu_seqlens_q=None,
                       cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, window_size=(-1, -1), softcap=0.0,
                       alibi_slopes=None, seqused_k=None, key_mask=None, segments=None, grad_dtype=None):
    """`(dq, dk, dv)`; see `reference.attention_backward`."""
    cu_q, cu_k = check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, window_size)
    if dout.shape != out.shape or out.shape[:-1] != q.shape[:-1] or out.shape[-1] != v.shape[-1]:
        raise ValueError(f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must be shaped "
                         f"{(*q.shape[:-1], v.shape[-1])}.")
    if grad_dtype is not None and grad_dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"grad_dtype must be one of float16, bfloat16, float32, got {grad_dtype}.")
    return flash_attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                    cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen_q,
                                    max_seqlen_k=max_seqlen_k, window_size=tuple(window_size),
                                    softcap=float(softcap or 0.0), alibi_slopes=alibi_slopes, seqused_k=seqused_k,
                                    key_mask=key_mask, segments=segments, grad_dtype=grad_dtype)
