"""The last step of split-KV attention: merge the partial results of key ranges computed by separate programs.

Each split left, per query row, its output normalised over its own keys (fp32) and its log-sum-exp; the merged row
is the LSE-weighted mean: out = sum_s exp(lse_s - lse) out_s with lse = logsumexp_s(lse_s). A split that saw no key
has lse_s = -inf and weight 0; a row that no split saw gives zeros and lse = -inf. Used by the bf16 decode path
(`flash_attention`) and the low-bit cache decode (`lowbit_decode`), whose partials differ only in layout and in the
base of their LSE, so both are arguments.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import next_pow2
from .launch import launch_cached

__all__ = ["merge_splits"]


@triton.jit
def _merge_kernel(O_PART, L_PART, O, LSE, num_splits, num_heads, seqlen_q,
                  stride_part_split, stride_part_row, stride_lpart_split, stride_lpart_row,
                  stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr, LSE_LOG2: tl.constexpr):
    """Row r = (b * H + h) * Sq + i of the partials -> out[b, i, h] (strided) and lse[b, h, i] (natural log)."""
    r = tl.program_id(0)
    i = r % seqlen_q
    h = (r // seqlen_q) % num_heads
    b = (r // (seqlen_q * num_heads)).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    lse_s = tl.load(L_PART + offs_s.to(tl.int64) * stride_lpart_split + r * stride_lpart_row, mask=s_ok,
                    other=float("-inf"))
    if LSE_LOG2:
        lse_s = lse_s * 0.6931471805599453
    m = tl.max(lse_s, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_use)
    total = tl.sum(w, 0)
    o_s = tl.load(O_PART + offs_s.to(tl.int64)[:, None] * stride_part_split + r * stride_part_row + offs_d[None, :],
                  mask=s_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    out = tl.sum(o_s * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    lse = tl.where(total == 0.0, float("-inf"), m_use + tl.log(tl.where(total == 0.0, 1.0, total)))
    tl.store(O + b * stride_ob + i * stride_os + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=offs_d < D)
    tl.store(LSE + b * stride_lb + h * stride_lh + i * stride_ls, lse)


def merge_splits(o_part, l_part, out, lse, *, num_splits: int, part_strides, lse_part_strides, lse_log2: bool):
    """Merge `num_splits` partials into out `[B, Sq, H, D]` (any strides: row (b, i, h)) and lse `[B, H, Sq]`.
    `part_strides` / `lse_part_strides`: (split stride, row stride) of o_part / l_part, rows numbered
    (b * H + h) * Sq + i; `lse_log2`: the partial LSEs are in base 2."""
    batch, sq, heads, d = out.shape
    block_splits = max(2, next_pow2(num_splits))
    args = (o_part, l_part, out, lse, num_splits, heads, sq, *part_strides, *lse_part_strides, out.stride(0),
            out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), lse.stride(2))
    meta = dict(D=d, BLOCK_D=max(16, next_pow2(d)), BLOCK_SPLITS=block_splits, LSE_LOG2=lse_log2, num_warps=4)
    launch_cached(_merge_kernel, (batch * heads * sq,), args, meta)
