"""The Triton FlashAttention kernels as `torch.library` custom ops: what `torch.compile` and CUDA graphs see.

Dynamo cannot trace a Triton launch (host-side specialization, launch caches, TMA descriptors); a custom op is opaque
to it, its fake implementation gives the output shapes, and `register_autograd` puts forward and backward into one
compiled graph. Eagerly the ops' dispatch and autograd layer only cost host time, so training runs the same kernels
through `_EagerAttention` and inference calls them directly. Nothing here reads a tensor's values on the host:
varlen lengths come as ints, static-cache lengths as the `seqused_k` tensor, padding as the `key_mask` tensor, packed
sequences as the `segments` table.

    out, lse = torch.ops.hf_fastpath.flash_attn_forward(q, k, v, ...)

Arguments follow `hf_fastpath.attention.reference` (window as two ints, -1 = unbounded). The LSE carries no gradient.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from ..kernels.flash_attention import flash_attention_backward, flash_attention_forward
from ..kernels.common import gluon_build_failed
from .params import AttentionParams, make_params
from .sinks import SinkAttention
from .triton_backend import check_inputs

__all__ = ["flash_attn_forward", "flash_attn_backward", "flash_attn", "gluon_attn_forward", "gluon_attn_backward",
           "gluon_attn"]

Tensor = torch.Tensor


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, seqused_k, key_mask,
             segments, causal, softmax_scale, window_left, window_right, softcap):
    cu_q, cu_k = check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    return flash_attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens_q=cu_q,
                                   cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                   window_size=(window_left, window_right), softcap=softcap,
                                   alibi_slopes=alibi_slopes, seqused_k=seqused_k, key_mask=key_mask,
                                   segments=segments)


@torch.library.custom_op("hf_fastpath::flash_attn_forward", mutates_args=())
def flash_attn_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                       max_seqlen_q: int, max_seqlen_k: int, alibi_slopes: Optional[Tensor],
                       seqused_k: Optional[Tensor], key_mask: Optional[Tensor], segments: Optional[Tensor],
                       causal: bool, softmax_scale: float, window_left: int, window_right: int,
                       softcap: float) -> tuple[Tensor, Tensor]:
    return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, seqused_k,
                    key_mask, segments, causal, softmax_scale, window_left, window_right, softcap)


@flash_attn_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, seqused_k, key_mask, segments,
      causal, softmax_scale, window_left, window_right, softcap):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if cu_seqlens_q is not None:  # [T, H, D] -> lse [H, T]
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:  # [B, S, H, D] -> lse [B, H, S]
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return out, lse


def _backward_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                   seqused_k, key_mask, segments, causal, softmax_scale, window_left, window_right, softcap,
                   fp8_products=False):
    cu_q, cu_k = check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    return flash_attention_backward(dout.contiguous(), q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                    cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen_q,
                                    max_seqlen_k=max_seqlen_k, window_size=(window_left, window_right),
                                    softcap=softcap, alibi_slopes=alibi_slopes, seqused_k=seqused_k,
                                    key_mask=key_mask, segments=segments, fp8_products=fp8_products)


@torch.library.custom_op("hf_fastpath::flash_attn_backward", mutates_args=())
def flash_attn_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int,
                        max_seqlen_k: int, alibi_slopes: Optional[Tensor], seqused_k: Optional[Tensor],
                        key_mask: Optional[Tensor], segments: Optional[Tensor], causal: bool, softmax_scale: float,
                        window_left: int, window_right: int, softcap: float,
                        fp8_products: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _backward_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          alibi_slopes, seqused_k, key_mask, segments, causal, softmax_scale, window_left,
                          window_right, softcap, fp8_products)


@flash_attn_backward.register_fake
def _(dout, q, k, v, out, lse, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, slopes, seqused_k, key_mask, segments = inputs[:11]
    causal, scale, left, right, softcap = inputs[11:]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, slopes, seqused_k, key_mask, segments)
    ctx.args = (max_q, max_k, causal, scale, left, right, softcap)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_q, cu_k, slopes, seqused_k, key_mask, segments = ctx.saved_tensors
    max_q, max_k, causal, scale, left, right, softcap = ctx.args
    dq, dk, dv = flash_attn_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, slopes, seqused_k, key_mask,
                                     segments, causal, scale, left, right, softcap, False)
    return (dq, dk, dv) + (None,) * 13


flash_attn_forward.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """Eager training through the kernels' Python entry points, without the custom ops: their autograd layer
    (`register_autograd`: argument defaults filled, schema and alias checks, per op call) took 0.3 ms of host time
    in the forward and 0.65 ms in the backward on the H200's host (torch 2.11; session 27,
    benchmarks/results/archive/attention_host_time_s27.txt), more than both kernels take at 1k tokens. Compiled
    graphs keep the ops. `forward(q, k, v, *rest)` / `backward(dout, q, k, v, out, lse, *rest)`: the op bodies, whose
    arguments after q, k, v (resp. lse) are the same `rest`."""

    @staticmethod
    def forward(ctx, forward, backward, q, k, v, *rest):
        out, lse = forward(q, k, v, *rest)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backward_fn, ctx.rest = backward, rest
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        dq, dk, dv = ctx.backward_fn(dout, *ctx.saved_tensors, *ctx.rest)
        return (None, None, dq, dk, dv) + (None,) * len(ctx.rest)


def _differentiable(forward, backward, op, args):
    """`op(*args)` when compiling; eagerly, the kernels through `_EagerAttention` when q, k or v needs a gradient,
    else `forward` alone (decoding: the op's dispatch would add ~20 µs of host time a call)."""
    if torch.compiler.is_compiling():
        return op(*args)
    q, k, v = args[:3]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _EagerAttention.apply(forward, backward, *args)
    return forward(*args)


def _op_args(q, k, v, p: AttentionParams) -> tuple:
    """The arguments of `flash_attn_forward` for `params`. Varlen calls should carry `max_seqlen_q/k` (else one
    host read)."""
    max_q, max_k = p.max_seqlen_q, p.max_seqlen_k
    if p.varlen and (max_q is None or max_k is None):
        max_q = max_q if max_q is not None else int(torch.diff(p.cu_seqlens_q).max())
        max_k = max_k if max_k is not None else int(torch.diff(p.cu_seqlens_k).max())
    left, right = p.window_size
    return (q, k, v, p.cu_seqlens_q, p.cu_seqlens_k, int(max_q or 0), int(max_k or 0), p.alibi_slopes, p.seqused_k,
            p.key_mask, p.segments, p.causal, p.softmax_scale, int(left), int(right), p.softcap)


def flash_attn(q, k, v, params: AttentionParams | None = None, **kwargs):
    """Differentiable `(out, lse)` (`_differentiable`: the ops when compiling), for `params` (or the keyword
    arguments of `make_params`)."""
    p = params if params is not None else make_params(q, k, v, **kwargs)
    return _differentiable(_forward, _backward_impl, flash_attn_forward, _op_args(q, k, v, p))


def _backward_op(dout, *args):
    return flash_attn_backward(dout, *args, False)


def flash_attn_with_sinks(q, k, v, sinks, params: AttentionParams):
    """Differentiable `(out, lse)` with attention sinks (`sinks.SinkAttention`) over the Triton kernels (the ops
    when compiling)."""
    halves = (flash_attn_forward, _backward_op) if torch.compiler.is_compiling() else (_forward, _backward_impl)
    return SinkAttention.apply(*halves, sinks, *_op_args(q, k, v, params))


# ----------------------------------------------------------------------------------------------------------------
# The Gluon kernels (Hopper): dense calls, causal or not, with or without a key mask or packed segments, a sliding
# window, a soft-cap or ALiBi; varlen calls without ALiBi.


GLUON_BUILD_ERRORS: list[str] = []  # a Gluon kernel that failed to build here: "auto" stops choosing Gluon


def _gluon_or_triton(gluon_call, triton_call):
    """The Gluon kernel; if this Triton cannot build it (its Gluon API differs from the 3.6 and 3.9 we build
    against), our Triton kernel instead, with a one-time warning."""
    from triton.compiler.errors import CompilationError

    if not GLUON_BUILD_ERRORS:
        try:
            return gluon_call()
        except CompilationError as exc:
            gluon_build_failed(GLUON_BUILD_ERRORS, exc, __name__, "gluon-build", "Gluon attention kernel",
                               "the Triton kernel")
    return triton_call()


def _gluon_kwargs(key_mask, segments, cu_seqlens_q, cu_seqlens_k, alibi_slopes, causal, softmax_scale, window_left,
                  window_right, softcap):
    return dict(causal=causal, softmax_scale=softmax_scale, key_mask=key_mask, segments=segments,
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, window_size=(window_left, window_right),
                softcap=softcap, alibi_slopes=alibi_slopes)


def _gluon_forward(q, k, v, key_mask, segments, cu_seqlens_q, cu_seqlens_k, alibi_slopes, causal, softmax_scale,
                   window_left, window_right, softcap):
    from ..kernels.gluon_attention import gluon_attention_forward

    masks = _gluon_kwargs(key_mask, segments, cu_seqlens_q, cu_seqlens_k, alibi_slopes, causal, softmax_scale,
                          window_left, window_right, softcap)
    return _gluon_or_triton(partial(gluon_attention_forward, q, k, v, **masks),
                            partial(flash_attention_forward, q, k, v, **masks))


def _gluon_backward(dout, q, k, v, out, lse, key_mask, segments, cu_seqlens_q, cu_seqlens_k, alibi_slopes, causal,
                    softmax_scale, window_left, window_right, softcap):
    from ..kernels.gluon_attention_bwd import deterministic_supported, gluon_attention_backward, supported

    masks = _gluon_kwargs(key_mask, segments, cu_seqlens_q, cu_seqlens_k, alibi_slopes, causal, softmax_scale,
                          window_left, window_right, softcap)
    triton_call = partial(flash_attention_backward, dout.contiguous(), q, k, v, out, lse, **masks)
    # torch.use_deterministic_algorithms(True): the Gluon dQ tiles then meet in a fixed order, 0.75-0.98x its default
    # speed. Against the (atomic-free) Triton backward that is 0.95-1.78x at hd128 tiles (1.06-1.16x but for causal
    # 16k, 0.95x) and with a soft-cap (1.29x at hd64), 0.82-1.13x at hd64 otherwise, where Triton stays
    # (benchmarks/results/gluon_attention_deterministic.json); past hd128 it has no deterministic mode. Not
    # supported: e.g. Sq * Hq * D past 32-bit dQ offsets
    deterministic = torch.are_deterministic_algorithms_enabled()
    head_dim = q.shape[-1]
    triton_when_deterministic = (not deterministic_supported(head_dim) or (head_dim <= 64 and not softcap > 0)
                                 or cu_seqlens_q is not None)
    if not supported(dout, q, k, v, causal) or (deterministic and triton_when_deterministic):
        return triton_call()
    return _gluon_or_triton(partial(gluon_attention_backward, dout, q, k, v, out, lse, deterministic=deterministic,
                                    **masks), triton_call)


@torch.library.custom_op("hf_fastpath::gluon_attn_forward", mutates_args=())
def gluon_attn_forward(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], segments: Optional[Tensor],
                       cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], alibi_slopes: Optional[Tensor],
                       causal: bool, softmax_scale: float, window_left: int, window_right: int,
                       softcap: float) -> tuple[Tensor, Tensor]:
    return _gluon_forward(q, k, v, key_mask, segments, cu_seqlens_q, cu_seqlens_k, alibi_slopes, causal,
                          softmax_scale, window_left, window_right, softcap)


@gluon_attn_forward.register_fake
def _(q, k, v, key_mask, segments, cu_seqlens_q, *args):
    if cu_seqlens_q is not None:  # [T, H, D] -> lse [H, T]
        return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


@torch.library.custom_op("hf_fastpath::gluon_attn_backward", mutates_args=())
def gluon_attn_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        key_mask: Optional[Tensor], segments: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
                        cu_seqlens_k: Optional[Tensor], alibi_slopes: Optional[Tensor], causal: bool,
                        softmax_scale: float, window_left: int, window_right: int,
                        softcap: float) -> tuple[Tensor, Tensor, Tensor]:
    return _gluon_backward(dout, q, k, v, out, lse, key_mask, segments, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                           causal, softmax_scale, window_left, window_right, softcap)


@gluon_attn_backward.register_fake
def _(dout, q, k, v, out, lse, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _gluon_setup_context(ctx, inputs, output):
    q, k, v, key_mask, segments, cu_q, cu_k, alibi_slopes = inputs[:8]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_mask, segments, cu_q, cu_k, alibi_slopes)
    ctx.args = inputs[8:]  # causal, scale, window edges, softcap
    ctx.mark_non_differentiable(lse)


def _gluon_grad(ctx, dout, _dlse):
    q, k, v, out, lse, key_mask, segments, cu_q, cu_k, alibi_slopes = ctx.saved_tensors
    dq, dk, dv = gluon_attn_backward(dout, q, k, v, out, lse, key_mask, segments, cu_q, cu_k, alibi_slopes,
                                     *ctx.args)
    return (dq, dk, dv) + (None,) * 10


gluon_attn_forward.register_autograd(_gluon_grad, setup_context=_gluon_setup_context)


def gluon_attn(q, k, v, params: AttentionParams):
    """Differentiable `(out, lse)` of a dense `[B, S, H, D]` call, causal or not, with or without a key mask or packed
    segments, a sliding window, a soft-cap or ALiBi, or of a varlen one (no ALiBi there), through the Gluon forward
    and backward; `backends.GluonBackend` says which calls qualify."""
    left, right = params.window_size
    args = (q, k, v, params.key_mask, params.segments, params.cu_seqlens_q, params.cu_seqlens_k, params.alibi_slopes,
            params.causal, params.softmax_scale, int(left), int(right), float(params.softcap))
    return _differentiable(_gluon_forward, _gluon_backward, gluon_attn_forward, args)
