"""One functional API over every attention backend.

`attention(q, k, v, ...)` is differentiable and picks a backend; `attention_forward` / `attention_backward` are the
raw (non-autograd) halves that ring attention composes. Semantics are defined in `reference.py`.
"""

from __future__ import annotations


import torch

from . import reference
from .params import AttentionParams, make_params
from ..kernels.common import triton_runs_on

__all__ = ["attention", "attention_forward", "attention_backward", "use_triton"]


def use_triton(t: torch.Tensor) -> bool:
    """Own Triton kernels run on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1 (CI)."""
    return triton_runs_on(t)


def _raw_backend(q, v=None):
    """Module computing the raw halves: own Triton kernels where they run and support the dtype/head dim, else the
    reference (float64 inputs, e.g. in exactness tests, always take the reference)."""
    if use_triton(q):
        from . import triton_backend

        head_dim = max(q.shape[-1], v.shape[-1] if v is not None else 0)
        if q.dtype in triton_backend.SUPPORTED_DTYPES and head_dim <= triton_backend.MAX_HEAD_DIM:
            return triton_backend
    return reference


def attention_forward(q, k, v, *, out_dtype=None, **kw):
    """`(out, lse)` for one block of attention; kwargs as in `reference.attention_forward`.
    `out_dtype` (e.g. torch.float32 for bf16 inputs) returns the output unrounded, for merging partial results."""
    backend = _raw_backend(q, v)
    if out_dtype is None or out_dtype == q.dtype:
        return backend.attention_forward(q, k, v, **kw)
    if backend is reference:  # the reference computes in fp32 anyway: feed it fp32 and skip the final rounding
        cast = (lambda t: t.to(out_dtype)) if out_dtype in (torch.float32, torch.float64) else (lambda t: t)
        out, lse = reference.attention_forward(cast(q), cast(k), cast(v), **kw)
        return out.to(out_dtype), lse
    return backend.attention_forward(q, k, v, out_dtype=out_dtype, **kw)


def attention_backward(dout, q, k, v, out, lse, **kw):
    """`(dq, dk, dv)` from the (possibly merged) out and lse; `grad_dtype=torch.float32` keeps partial sums exact."""
    return _raw_backend(q, v).attention_backward(dout, q, k, v, out, lse, **kw)


class _Attention(torch.autograd.Function):
    """Autograd over a module's raw halves (the reference; the Triton kernels have their own, in `ops`)."""

    @staticmethod
    def forward(ctx, q, k, v, params, module):
        out, lse = module.attention_forward(q, k, v, **params.kernel_kwargs())
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.params = params
        ctx.module = module
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.module.attention_backward(dout.contiguous(), q, k, v, out, lse, **ctx.params.kernel_kwargs())
        return dq, dk, dv, None, None


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
    seqused_k=None,
    key_mask=None,
    segments=None,
    return_lse=False,
    backend="auto",
    dropout_p=0.0,
    sinks=None,
):
    """FlashAttention in the `[B, S, H, D]` layout (or `[T, H, D]` with `cu_seqlens_q/k`).

    Returns `out`, or `(out, lse)` with `return_lse=True` (lse fp32, `[B, Hq, Sq]` or `[Hq, T]`).
    The LSE is returned for composition (ring attention) and carries no gradient.
    `seqused_k` (int `[B]`): only the first `seqused_k[b]` key slots of sequence b hold keys (a static KV cache);
    `key_mask` (`[B, Sk]`): only keys whose entry is > 0 are attended (padding); `segments`
    (`kernels.flash_attention.segment_table`, Sq == Sk): packed sequences in one row, each attending only within
    itself. None of the three needs a host synchronisation with our kernel.
    `backend`: "auto" (FA3 > FA4 > FA2 when installed, else our Triton kernel or torch SDPA, whichever measured
    faster for such a call on this GPU (`dispatch.py`); the reference on CPU unless TRITON_INTERPRET=1), or one of
    "triton", "sdpa", "fa2", "fa3", "fa4", "reference" (fails clearly when missing or unable to serve the call).
    `dropout_p > 0` needs FA2 (flash-attn); the other backends raise NotImplementedError.
    `sinks` (`[Hq]`, differentiable): attention sinks as gpt-oss has them, one logit per query head that every row's
    softmax counts as a key with no value (`sinks.py`); they run on our Triton kernel (the reference on the CPU), so
    `backend` must be "auto", "triton" or "reference".
    Under `torch.use_deterministic_algorithms(True)` gradients are bitwise repeatable: FlashAttention gets
    `deterministic=True`; our Gluon backward orders its dQ adds (`deterministic=True`) where that still beats the
    atomic-free Triton backward (soft-capped calls), else hands over to the Triton one.
    """
    from .backends import select_backend

    params = make_params(q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens_q=cu_seqlens_q,
                         cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, seqused_k=seqused_k,
                         key_mask=key_mask, segments=segments)
    if sinks is not None:
        out, lse = _attention_with_sinks(q, k, v, sinks, params, backend, dropout_p)
        return (out, lse) if return_lse else out
    chosen = select_backend(backend, q, k, v, params, dropout_p, return_lse)
    if params.masks_keys() and not chosen.takes_masks:  # FlashAttention: varlen only
        out, lse = _unpadded(lambda q, k, v, p: chosen.run(q, k, v, p, dropout_p, return_lse), q, k, v, params)
    else:
        out, lse = chosen.run(q, k, v, params, dropout_p, return_lse)
    return (out, lse) if return_lse else out


def _attention_with_sinks(q, k, v, sinks, params: AttentionParams, backend: str, dropout_p: float):
    from .backends import BackendUnavailable
    from .sinks import SinkAttention

    if not isinstance(sinks, torch.Tensor) or sinks.shape != (q.shape[-2],) or not sinks.is_floating_point():
        raise ValueError(f"sinks must be a float tensor of one logit per query head, shape ({q.shape[-2]},); got "
                         f"{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}.")
    if dropout_p:
        raise NotImplementedError("attention sinks with attention dropout are not supported: pass dropout_p=0.0.")
    if backend not in ("auto", "triton", "reference"):
        raise BackendUnavailable(f"attention backend {backend!r} has no attention sinks; use backend='auto', "
                                 "'triton' or 'reference'.")
    if backend == "reference" or (backend == "auto" and _raw_backend(q, v) is reference):
        def forward(q, k, v, p):
            return reference.attention_forward(q, k, v, **p.kernel_kwargs())

        def backward(dout, q, k, v, out, lse, p):
            return reference.attention_backward(dout, q, k, v, out, lse, **p.kernel_kwargs())

        return SinkAttention.apply(forward, backward, sinks, q, k, v, params)
    from .ops import flash_attn_with_sinks

    return flash_attn_with_sinks(q, k, v, sinks.to(q.device), params)


def _unpadded(run, q, k, v, params: AttentionParams):
    """Attention through a varlen-only backend (one host synchronisation). Packed `segments` become sequences.
    Keys left out by `key_mask` / `seqused_k` are dropped; with as many queries as keys (prefill) the queries are
    dropped likewise and get zeros, with fewer (decoding) all are kept and align causally to the last kept key, as
    Transformers' FA2 path does. `run(q, k, v, varlen_params) -> (out, lse)`."""
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
    if params.segments is not None:
        ids = params.segments[0].flatten().long() + torch.arange(b, device=q.device).repeat_interleave(sk) * (sk + 1)
        starts = torch.nonzero(torch.diff(ids, prepend=ids[:1] - 1)).flatten().to(torch.int32)
        cu = torch.cat([starts, starts.new_full((1,), b * sk)])
        max_len = int(torch.diff(cu).max())
        out, _ = run(flat(q), flat(k), flat(v), params._replace(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                                                max_seqlen_k=max_len, segments=None))
        return out.view(b, sq, *out.shape[1:]), None
    keep = torch.ones(b, sk, dtype=torch.bool, device=q.device) if params.key_mask is None else params.key_mask > 0
    if params.seqused_k is not None:
        keep = keep & (torch.arange(sk, device=q.device)[None, :] < params.seqused_k[:, None])
    lens_k = keep.sum(-1, dtype=torch.int32)
    idx_k = keep.flatten().nonzero().flatten()
    cu_k = torch.nn.functional.pad(torch.cumsum(lens_k, 0, dtype=torch.int32), (1, 0))
    if sq == sk and params.seqused_k is None:
        idx_q, cu_q, max_q = idx_k, cu_k, None
    else:
        idx_q = torch.arange(b * sq, device=q.device)
        cu_q, max_q = torch.arange(b + 1, dtype=torch.int32, device=q.device) * sq, sq
    max_k = int(lens_k.max())
    max_q = max_k if max_q is None else max_q
    varlen = params._replace(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                             seqused_k=None, key_mask=None)
    out, _ = run(flat(q)[idx_q], flat(k)[idx_k], flat(v)[idx_k], varlen)
    full = out.new_zeros(b * sq, *out.shape[1:]).index_copy(0, idx_q, out)
    return full.view(b, sq, *out.shape[1:]), None
