"""Own Triton FlashAttention as an attention backend: validates inputs, then calls `kernels.flash_attention`.

Same functions and keyword arguments as `reference.py` (which defines the semantics).
"""

from __future__ import annotations

import os

import torch

from ..kernels.flash_attention import flash_attention_backward, flash_attention_forward

__all__ = ["attention_forward", "attention_backward", "check_inputs", "MAX_HEAD_DIM", "SUPPORTED_DTYPES"]

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _device_ok(t: torch.Tensor) -> bool:
    return t.is_cuda or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def check_inputs(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, alibi_slopes=None, window_size=(-1, -1)):
    """Raise a ValueError/TypeError naming the problem and the fix; return cu_seqlens as contiguous int32."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"Triton attention supports float16, bfloat16 and float32; {name} is {t.dtype}. "
                            f"Cast the inputs (e.g. q.to(torch.bfloat16)) or use backend='reference'.")
        if not _device_ok(t):
            raise ValueError(f"Triton attention needs CUDA tensors; {name} is on {t.device}. Move the tensors to "
                             f"the GPU, use backend='reference', or set TRITON_INTERPRET=1 to interpret on the CPU.")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}.")
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen and (cu_seqlens_q is None or cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together.")
    want = 3 if varlen else 4
    if q.dim() != want or k.dim() != want or v.dim() != want:
        layout = "[total_tokens, heads, head_dim] with cu_seqlens" if varlen else "[batch, seq, heads, head_dim]"
        raise ValueError(f"Expected {layout} tensors, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}.")
    d, dv = q.shape[-1], v.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"q and k head dims differ ({d} vs {k.shape[-1]}).")
    if not (0 < d <= MAX_HEAD_DIM and 0 < dv <= MAX_HEAD_DIM):
        raise ValueError(f"Triton attention supports head dims up to {MAX_HEAD_DIM}; got {d} (q/k) and {dv} (v). "
                         f"Use backend='reference' for larger heads.")
    hq, hk, hv = q.shape[-2], k.shape[-2], v.shape[-2]
    if hk != hv or hk == 0 or hq % hk != 0:
        raise ValueError(f"Query heads ({hq}) must be a multiple of key/value heads (k {hk}, v {hv}; k and v must "
                         f"match). For GQA/MQA pass K/V with their own head count, unrepeated.")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must agree on all but the head dim: {tuple(k.shape)} vs {tuple(v.shape)}.")
    if not varlen and q.shape[0] != k.shape[0]:
        raise ValueError(f"Batch sizes differ: q {q.shape[0]}, k {k.shape[0]}.")
    batch = q.shape[0]
    if varlen:
        cus = []
        for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
            if cu.dim() != 1 or cu.numel() < 1 or cu.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name} must be a 1-D int32 tensor [batch + 1] of offsets, got "
                                 f"{cu.dtype} {tuple(cu.shape)}.")
            if cu.device != q.device:
                raise ValueError(f"{name} is on {cu.device}; it must be on {q.device} with q, k, v.")
            cus.append(cu.to(torch.int32).contiguous())
        if cus[0].numel() != cus[1].numel():
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                             f"{cus[0].numel()} and {cus[1].numel()}.")
        batch = cus[0].numel() - 1
        cu_seqlens_q, cu_seqlens_k = cus
    if alibi_slopes is not None:
        if alibi_slopes.shape not in ((hq,), (batch, hq)):
            raise ValueError(f"alibi_slopes must be [heads] or [batch, heads] = ({hq},) or ({batch}, {hq}), got "
                             f"{tuple(alibi_slopes.shape)}.")
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes is on {alibi_slopes.device}; it must be on {q.device}.")
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
