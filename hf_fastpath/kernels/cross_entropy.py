"""Cross-entropy over rows of logits, in place: the per-row kernel of `hf_fastpath.losses`.

One program per row: an online max / sum of exp over the vocabulary in fp32, the loss = log-sum-exp - logit[target],
then (when a gradient is wanted) the row overwritten by its gradient in the logits' own dtype, so a chunk of logits
is the only [rows, vocab] buffer the chunked loss ever holds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import interpreting
from .device import on_input_device
from .launch import COMPILE_OPTIONS

__all__ = ["cross_entropy_rows_"]


@on_input_device
def cross_entropy_rows_(logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, softcap: float | None,
                        need_grad: bool) -> torch.Tensor:
    """Per-row loss (fp32 [rows]) of `logits` [rows, V] (row stride free, unit column stride) against `target`
    [rows] (int, valid ids); with `need_grad`, overwrites `logits` with (softmax - onehot) * scale [* (1 - tanh²)
    when soft-capped], scale being a 1-element tensor."""
    rows, vocab = logits.shape
    loss = torch.empty(rows, device=logits.device, dtype=torch.float32)
    if rows == 0:
        return loss
    block = min(triton.next_power_of_2(vocab), 256 if interpreting() else 4096)
    _ce_rows_kernel[(rows,)](
        logits, logits.stride(0), target, loss, scale.float(), vocab, float(softcap or 1.0),
        HAS_SOFTCAP=softcap is not None, NEED_GRAD=need_grad, BLOCK=block, num_warps=8, **COMPILE_OPTIONS)
    return loss


@triton.jit
def _softcapped(x, cap, HAS_SOFTCAP: tl.constexpr):
    """(value, tanh) with value = cap * tanh(x / cap) when soft-capping (tanh through exp: portable to the
    interpreter); (x, 0) otherwise."""
    if HAS_SOFTCAP:
        t = 1.0 - 2.0 / (tl.exp(2.0 * x / cap) + 1.0)
        return cap * t, t
    else:
        return x, 0.0 * x


@triton.jit
def _ce_rows_kernel(LOGITS, stride_row, TARGET, LOSS, SCALE, V, cap, HAS_SOFTCAP: tl.constexpr,
                    NEED_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: pass 1 an online max / sum of exp over the vocabulary (fp32, per lane), loss =
    log-sum-exp - logit[target]; pass 2 overwrites the row with (softmax - onehot(target)) * scale [* (1 - tanh²)].
    Reads the row twice and writes it once in its own dtype: no fp32 copy of the chunk."""
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        ok = start + offs < V
        x = tl.load(base + start + offs, mask=ok, other=0.0).to(tl.float32)
        x, _ = _softcapped(x, cap, HAS_SOFTCAP)
        x = tl.where(ok, x, float("-inf"))
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # lanes that saw only padding stay at 0 / -inf
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    m_row = tl.max(m, 0)
    lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), 0))
    target = tl.load(TARGET + row)
    x_t, _ = _softcapped(tl.load(base + target).to(tl.float32), cap, HAS_SOFTCAP)
    tl.store(LOSS + row, lse - x_t)
    if NEED_GRAD:
        scale = tl.load(SCALE)
        for start in range(0, V, BLOCK):
            ok = start + offs < V
            x = tl.load(base + start + offs, mask=ok, other=0.0).to(tl.float32)
            x, t = _softcapped(x, cap, HAS_SOFTCAP)
            g = tl.exp(x - lse) - tl.where(start + offs == target, 1.0, 0.0)
            if HAS_SOFTCAP:
                g = g * (1.0 - t * t)
            tl.store(base + start + offs, (g * scale).to(LOGITS.dtype.element_ty), mask=ok)
