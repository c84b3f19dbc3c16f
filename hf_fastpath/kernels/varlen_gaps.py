"""Rows of a varlen tensor that no sequence covers: tokens before `cu_seqlens[0]` and from `cu_seqlens[-1]` on
(a packed batch padded to a fixed length, say). Varlen kernels launch one program per sequence tile, so they never
write those rows: `fill_outside_sequences` gives them a defined value (0 for outputs and gradients, -inf for the
LSE) without reading `cu_seqlens` on the host. A tile wholly inside the sequences writes nothing, so a batch that
the sequences cover costs one launch of programs that each read two integers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cdiv, interpreting, next_pow2
from .launch import launch_cached

__all__ = ["fill_outside_sequences"]


@triton.jit
def _fill_outside_kernel(x_ptr, cu_ptr, last_cu, n_rows, n_cols, stride_r, stride_c, value,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r0 = tl.program_id(0) * BLOCK_R
    first = tl.load(cu_ptr)
    last = tl.load(cu_ptr + last_cu)
    if (r0 < first) | (r0 + BLOCK_R > last):
        rows = r0 + tl.arange(0, BLOCK_R)
        outside = ((rows < first) | (rows >= last)) & (rows < n_rows)
        fill = (tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32) + value).to(x_ptr.dtype.element_ty)
        for c0 in range(0, n_cols, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_c
            tl.store(ptrs, fill, mask=outside[:, None] & (cols[None, :] < n_cols))


def fill_outside_sequences(x: torch.Tensor, cu_seqlens: torch.Tensor, value: float = 0.0, dim: int = 0) -> None:
    """Set, in place, the slices of `x` along `dim` (its token dimension) that lie outside every sequence of
    `cu_seqlens` (int32 offsets `[B + 1]`, on x's device) to `value`. The other dimensions must flatten to one
    stride (a fresh output, or an LSE `[H, T]` with dim=1)."""
    n_rows = x.shape[dim]
    if x.numel() == 0 or cu_seqlens.numel() == 0:
        return
    rows = x.movedim(dim, 0)
    try:
        rows = rows.view(n_rows, -1)  # a view, never a copy: the writes must land in x
    except RuntimeError as e:
        raise ValueError(f"fill_outside_sequences needs a tensor whose non-token dims flatten to one stride, got "
                         f"shape {tuple(x.shape)} strides {x.stride()} (token dim {dim})") from e
    n_cols = rows.shape[1]
    block_r = 16 if interpreting() else 64
    block_c = min(next_pow2(n_cols), 32 if interpreting() else 256)
    launch_cached(_fill_outside_kernel, (cdiv(n_rows, block_r),),
                  (rows, cu_seqlens, cu_seqlens.numel() - 1, n_rows, n_cols, rows.stride(0), rows.stride(1),
                   float(value)),
                  dict(BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4, num_stages=1))
