"""Attention sinks (gpt-oss's `s_aux`): one logit s_h per query head that every row's softmax counts as an extra key
with no value, so a row can give part of its attention to nothing.

Exact on top of any attention whose forward returns its LSE, with no kernel change: with L = logaddexp(lse, s_h),
the output is out * exp(lse - L), and L is the LSE of the whole row, sink included. A FlashAttention backward given
that output and L computes P = exp(S - L), the sink-normalised probabilities, and delta = rowsum(dO * O) as always,
so its dq, dk, dv are exact; the sink's own gradient is -sum over rows of exp(s_h - L) * delta. A row that sees no
key (lse = -inf) gives zeros and L = s_h: all its mass goes to the sink, no NaN.
"""

from __future__ import annotations

import torch

__all__ = ["add_sinks", "sink_grad", "SinkAttention"]


def _by_row(t: torch.Tensor) -> torch.Tensor:
    """An LSE-shaped tensor, `[B, H, S]` (varlen `[H, T]`), as the output's rows: `[B, S, H, 1]` (`[T, H, 1]`)."""
    return t.transpose(-1, -2).unsqueeze(-1)


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out, lse)` of attention without sinks -> with them. sinks `[Hq]` (any float dtype; computed in fp32)."""
    total = torch.logaddexp(lse, sinks.float()[:, None])
    kept = torch.exp(lse - total)  # the share of each row's mass that stays on real keys
    return (out.float() * _by_row(kept)).to(out.dtype), total


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks from the output and LSE that `add_sinks` returned."""
    delta = (dout.float() * out.float()).sum(-1)  # [B, S, H] or [T, H]
    p_sink = _by_row(torch.exp(sinks.float()[:, None] - lse)).squeeze(-1)
    return -(p_sink * delta).reshape(-1, sinks.numel()).sum(0).to(sinks.dtype)


class SinkAttention(torch.autograd.Function):
    """`apply(forward, backward, sinks, q, k, v, *rest) -> (out, lse)` with sinks, from raw halves without them:
    `forward(q, k, v, *rest) -> (out, lse)` and `backward(dout, q, k, v, out, lse, *rest) -> (dq, dk, dv)`."""

    @staticmethod
    def forward(ctx, forward, backward, sinks, q, k, v, *rest):
        out, lse = add_sinks(*forward(q, k, v, *rest), sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.backward_fn, ctx.rest = backward, rest
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = ctx.backward_fn(dout, q, k, v, out, lse, *ctx.rest)
        dsinks = sink_grad(dout, out, lse, sinks) if ctx.needs_input_grad[2] else None
        return (None, None, dsinks, dq, dk, dv) + (None,) * len(ctx.rest)
