"""Rows of a varlen tensor that no sequence covers: tokens before `cu_seqlens[0]` and from `cu_seqlens[-1]` on
(a packed batch padded to a fixed length, say). Varlen kernels launch one program per sequence tile, so they never
write those rows: `fill_outside_sequences` gives them a defined value (0 for outputs and gradients, -inf for the
LSE) without reading `cu_seqlens` on the host. A tile wholly inside the sequences writes nothing, so a batch that
the sequences cover costs one launch (for up to two tensors) of programs that each read two integers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cdiv, interpreting, next_pow2
from .launch import launch_cached

__all__ = ["fill_outside_sequences"]


@triton.jit
def _fill_rows(ptr, rows, outside, n_cols, stride_r, stride_c, value, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    fill = (tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32) + value).to(ptr.dtype.element_ty)
    for c0 in range(0, n_cols, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        ptrs = ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_c
        tl.store(ptrs, fill, mask=outside[:, None] & (cols[None, :] < n_cols))


@triton.jit
def _fill_outside_kernel(x_ptr, y_ptr, cu_ptr, last_cu, n_rows, x_cols, x_stride_r, x_stride_c, x_value,
                         y_cols, y_stride_r, y_stride_c, y_value,
                         HAS_Y: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r0 = tl.program_id(0) * BLOCK_R
    first = tl.load(cu_ptr)
    last = tl.load(cu_ptr + last_cu)
    if (r0 < first) | (r0 + BLOCK_R > last):
        rows = r0 + tl.arange(0, BLOCK_R)
        outside = ((rows < first) | (rows >= last)) & (rows < n_rows)
        _fill_rows(x_ptr, rows, outside, x_cols, x_stride_r, x_stride_c, x_value, BLOCK_R, BLOCK_C)
        if HAS_Y:
            _fill_rows(y_ptr, rows, outside, y_cols, y_stride_r, y_stride_c, y_value, BLOCK_R, BLOCK_C)


def _token_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    try:  # a view, never a copy: the writes must land in x
        return x.movedim(dim, 0).view(x.shape[dim], -1)
    except RuntimeError as e:
        raise ValueError(f"fill_outside_sequences needs a tensor whose non-token dims flatten to one stride, got "
                         f"shape {tuple(x.shape)} strides {x.stride()} (token dim {dim})") from e


def fill_outside_sequences(cu_seqlens: torch.Tensor, *targets) -> None:
    """Set, in place, the slices outside every sequence of `cu_seqlens` (int32 offsets `[B + 1]`, on the targets'
    device) of one or two `(tensor, value, token_dim)` targets with as many tokens, in one launch (out and lse;
    dk and dv). Each target's other dimensions must flatten to one stride (a fresh output, or an LSE `[H, T]` with
    token_dim 1)."""
    if not 1 <= len(targets) <= 2:
        raise ValueError(f"fill_outside_sequences takes one or two (tensor, value, token_dim) targets, got "
                         f"{len(targets)}")
    rows = [(_token_rows(x, dim), float(value)) for x, value, dim in targets]
    n_rows = rows[0][0].shape[0]
    if any(r.shape[0] != n_rows for r, _ in rows):
        raise ValueError(f"fill_outside_sequences targets must have as many tokens, got "
                         f"{[r.shape[0] for r, _ in rows]}")
    if n_rows == 0 or cu_seqlens.numel() == 0:
        return
    (x, x_value), (y, y_value) = rows[0], rows[-1]
    block_r = 16 if interpreting() else 64
    block_c = min(next_pow2(max(x.shape[1], y.shape[1], 1)), 32 if interpreting() else 256)
    launch_cached(_fill_outside_kernel, (cdiv(n_rows, block_r),),
                  (x, y, cu_seqlens, cu_seqlens.numel() - 1, n_rows, x.shape[1], x.stride(0), x.stride(1), x_value,
                   y.shape[1], y.stride(0), y.stride(1), y_value),
                  dict(HAS_Y=len(rows) == 2, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4, num_stages=1))
