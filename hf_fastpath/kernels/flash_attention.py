"""Triton FlashAttention (forward with LSE, FA2-style backward) for dense `[B, S, H, D]` and varlen `[T, H, D]`.

Semantics are those of `hf_fastpath.attention.reference` (bottom-right causal, window, softcap, ALiBi, GQA/MQA,
empty rows -> 0 and lse = -inf). Tensors in, tensors out; the caller validates dtypes and shapes.

Layout of the work:
- forward: one program per (query block, query head, sequence); keys are visited in up to three ranges, the
  middle one fully visible (no mask arithmetic), the outer ones masked (diagonal / window edges / sequence end).
  Scores live in the log2 domain (log2(e) folded into the scale) so the softmax uses exp2.
- backward: `_bwd_preprocess` (delta = rowsum(dO * O), lse in log2 domain), `_bwd_dkdv` (one program per key
  block and KV head, looping over the query heads of its GQA group and over query blocks: dK/dV summed in
  registers, no atomics), `_bwd_dq` (one program per query block and head, looping over key blocks).
- short query blocks (decode) split the keys across programs and merge the partial results in fp32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import cdiv, interpreting, next_pow2
from .device import compute_major, num_sms, on_input_device
from .launch import launch_cached
from .row_quant import _to_e4m3, quantize_e4m3_rows
from .split_kv import merge_splits
from .varlen_gaps import fill_outside_sequences

__all__ = ["flash_attention_forward", "flash_attention_backward", "segment_table", "cu_seqlens_segment_ids"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# ----------------------------------------------------------------------------------------------------------------
# shared device helpers
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _seq_span(b, CU, dense_len, IS_VARLEN: tl.constexpr):
    """(first token, length) of sequence b."""
    if IS_VARLEN:
        start = tl.load(CU + b)
        length = tl.load(CU + b + 1) - start
    else:  # tensors, not constexprs (a length of 1 would be specialised into a constant)
        start = b * 0
        length = dense_len + b * 0
    return start, length


@triton.jit
def _key_span(b, CU, dense_len, SEQUSED, IS_VARLEN: tl.constexpr, HAS_SEQUSED: tl.constexpr):
    """(first key, number of keys) of sequence b: with SEQUSED (a static cache), only the first SEQUSED[b] slots
    hold keys, and causal attention aligns to them."""
    start, length = _seq_span(b, CU, dense_len, IS_VARLEN)
    if HAS_SEQUSED:
        length = tl.minimum(length, tl.load(SEQUSED + b))
    return start, length


@triton.jit
def _tanh(x):
    # tanh from exp; exact limits +-1 for large |x| (exp overflows to inf -> 2/inf = 0).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _scores_log2(qk, offs_m, offs_n, diag, sm_scale, scale_log2, softcap, slope,
                 HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Raw dot products -> scores in the log2 domain, plus tanh(raw/softcap) for the softcap gradient."""
    if HAS_SOFTCAP or HAS_ALIBI:
        s = qk * sm_scale
        t = s
        if HAS_SOFTCAP:
            t = _tanh(s / softcap)
            s = softcap * t
        if HAS_ALIBI:
            dist = (offs_m[:, None] + diag) - offs_n[None, :]
            dist = tl.where(dist < 0, -dist, dist)
            s = s - slope * dist.to(tl.float32)
        return s * 1.4426950408889634, t
    else:
        return qk * scale_log2, qk


@triton.jit
def _visible(offs_m, offs_n, diag, seqlen_k, window_left, window_right,
             HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Bool [M, N]: query offs_m may see key offs_n (bottom-right aligned by `diag` = Sk - Sq)."""
    keep = offs_n[None, :] < seqlen_k
    if HAS_RIGHT:
        keep = keep & (offs_n[None, :] <= offs_m[:, None] + diag + window_right)
    if HAS_LEFT:
        keep = keep & (offs_n[None, :] >= offs_m[:, None] + diag - window_left)
    return keep


@triton.jit
def _key_visible(KM_ptr, seg_q, offs_n, seqlen_k, MASKED: tl.constexpr, MASK_MODE: tl.constexpr):
    """Bool [1, N] (MASK_MODE 1: keys whose mask entry is > 0) or [M, N] (MASK_MODE 2: keys in the query row's
    packed segment, `seg_q` [M]); keys past seqlen_k are never visible."""
    if MASKED:
        km = tl.load(KM_ptr + offs_n, mask=offs_n < seqlen_k, other=0)
    else:
        km = tl.load(KM_ptr + offs_n)
    if MASK_MODE == 2:
        visible = km[None, :] == seg_q[:, None]
    else:
        visible = (km > 0)[None, :]
    return visible


@triton.jit
def _segment_key_range(KM_ptr, stride_plane, q_first, lo, a, bb, hi, BLOCK_N: tl.constexpr):
    """Key ranges of `_key_ranges` with the lower end raised to the start of row q_first's packed segment."""
    seg_lo = (tl.load(KM_ptr + stride_plane + q_first) // BLOCK_N) * BLOCK_N
    lo = tl.maximum(lo, seg_lo)
    a = tl.maximum(a, lo)
    bb = tl.maximum(bb, a)
    hi = tl.maximum(hi, bb)
    return lo, a, bb, hi


@triton.jit
def _key_ranges(q_first, q_last, seqlen_k, diag, window_left, window_right,
                BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """For query rows q_first..q_last: keys visited as masked [lo, a), full [a, b), masked [b, hi)."""
    lo = seqlen_k * 0  # tensors throughout: the runtime `if` below may reassign them
    hi = seqlen_k
    full_lo = seqlen_k * 0
    full_hi = seqlen_k
    if HAS_LEFT:
        lo = tl.maximum(q_first + diag - window_left, 0)
        full_lo = tl.maximum(q_last + diag - window_left, 0)
    if HAS_RIGHT:
        hi = tl.minimum(q_last + 1 + diag + window_right, seqlen_k)
        full_hi = tl.maximum(tl.minimum(q_first + diag + window_right + 1, seqlen_k), 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    a = ((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    b = (full_hi // BLOCK_N) * BLOCK_N
    if b <= a:  # no fully visible block: everything goes through the masked path
        a = hi
        b = hi
    a = tl.maximum(a, lo)
    return lo, a, b, hi


@triton.jit
def _query_ranges(n0, seqlen_q, diag, window_left, window_right,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """For key rows [n0, n0+BLOCK_N): queries visited as masked [lo, a), full [a, b), masked [b, hi)."""
    lo = seqlen_q * 0
    hi = seqlen_q
    full_lo = seqlen_q * 0
    full_hi = seqlen_q
    if HAS_RIGHT:
        lo = tl.maximum(n0 - diag - window_right, 0)
        full_lo = tl.maximum(n0 + BLOCK_N - 1 - diag - window_right, 0)
    if HAS_LEFT:
        hi = tl.minimum(n0 + BLOCK_N - diag + window_left, seqlen_q)
        full_hi = tl.maximum(tl.minimum(n0 - diag + window_left + 1, seqlen_q), 0)
    lo = (lo // BLOCK_M) * BLOCK_M
    a = ((full_lo + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    b = (full_hi // BLOCK_M) * BLOCK_M
    if b <= a:
        a = hi
        b = hi
    a = tl.maximum(a, lo)
    return lo, a, b, hi


# ----------------------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K_ptr, V_ptr, stride_ks, stride_vs, k_row, k_col, v_row, v_col,
               offs_m, offs_dk, offs_dv,
               start, end, seqlen_k, diag, sm_scale, scale_log2, softcap, slope, window_left, window_right, KM_ptr,
               seg_q, D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
               USE_TMA: tl.constexpr, MASK_MODE: tl.constexpr):
    for n0 in tl.range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if USE_TMA:  # bulk tensor copies; rows past the sequence are other tokens (finite), masked below
            kt = tl.trans(K_ptr.load([k_row + n0, k_col]))
            v = V_ptr.load([v_row + n0, v_col])
            if MASKED:
                v = tl.where(offs_n[:, None] < seqlen_k, v, tl.zeros_like(v))
        else:
            kt_ptrs = K_ptr + offs_n[None, :] * stride_ks + offs_dk[:, None]
            v_ptrs = V_ptr + offs_n[:, None] * stride_vs + offs_dv[None, :]
            if MASKED:
                kt = tl.load(kt_ptrs, mask=(offs_n[None, :] < seqlen_k) & (offs_dk[:, None] < D_QK), other=0.0)
                v = tl.load(v_ptrs, mask=(offs_n[:, None] < seqlen_k) & (offs_dv[None, :] < D_V), other=0.0)
            else:
                if BLOCK_DK == D_QK:
                    kt = tl.load(kt_ptrs)
                else:
                    kt = tl.load(kt_ptrs, mask=offs_dk[:, None] < D_QK, other=0.0)
                if BLOCK_DV == D_V:
                    v = tl.load(v_ptrs)
                else:
                    v = tl.load(v_ptrs, mask=offs_dv[None, :] < D_V, other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, kt, input_precision=PREC)
        s, _t = _scores_log2(qk, offs_m, offs_n, diag, sm_scale, scale_log2, softcap, slope, HAS_SOFTCAP, HAS_ALIBI)
        if MASKED:
            keep = _visible(offs_m, offs_n, diag, seqlen_k, window_left, window_right, HAS_LEFT, HAS_RIGHT)
            if MASK_MODE:
                keep = keep & _key_visible(KM_ptr, seg_q, offs_n, seqlen_k, True, MASK_MODE)
            s = tl.where(keep, s, float("-inf"))
        elif MASK_MODE:
            s = tl.where(_key_visible(KM_ptr, seg_q, offs_n, seqlen_k, False, MASK_MODE), s, float("-inf"))
        if MASKED or MASK_MODE:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # empty so far: avoid (-inf) - (-inf)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, CU_Q, CU_K, SLOPES, SEQUSED_K, KEY_MASK,
                stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, stride_osplit, stride_lsplit,
                stride_slope_b, stride_mask_b, stride_mask_plane, dense_len_q, dense_len_k, gqa_ratio, num_splits,
                split_len,
                sm_scale, scale_log2, softcap, window_left, window_right,
                D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr, SPLIT: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                HAS_ALIBI: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, USE_TMA: tl.constexpr,
                PACK_GQA: tl.constexpr, HAS_SEQUSED: tl.constexpr, MASK_MODE: tl.constexpr):
    pid_m = tl.program_id(0)
    b = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    start_q, seqlen_q = _seq_span(b, CU_Q, dense_len_q, IS_VARLEN)
    start_k, seqlen_k = _key_span(b, CU_K, dense_len_k, SEQUSED_K, IS_VARLEN, HAS_SEQUSED)
    KM_ptr = KEY_MASK + b.to(tl.int64) * stride_mask_b
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    if PACK_GQA:
        # few queries (decode): the rows of one tile are (query head of the GQA group, query), so K/V are read
        # once per KV head instead of once per query head
        kv_head = tl.program_id(1)
        if m0 >= seqlen_q * gqa_ratio:
            return
        offs_m = rows % seqlen_q
        head = kv_head * gqa_ratio + rows // seqlen_q  # per row
        row_ok = rows < seqlen_q * gqa_ratio
        q_first = tl.min(offs_m, 0)
        q_last = tl.max(offs_m, 0)
    else:
        head = tl.program_id(1)
        kv_head = head // gqa_ratio
        if m0 >= seqlen_q:
            return
        offs_m = rows
        row_ok = rows < seqlen_q
        q_first = m0
        q_last = m0 + BLOCK_M - 1
    diag = seqlen_k - seqlen_q
    b64 = b.to(tl.int64)
    q_rows = b64 * stride_qb + (start_q.to(tl.int64) + offs_m) * stride_qs + head * stride_qh
    k_off = b64 * stride_kb + start_k.to(tl.int64) * stride_ks + kv_head * stride_kh
    v_off = b64 * stride_vb + start_k.to(tl.int64) * stride_vs + kv_head * stride_vh
    if USE_TMA:  # K/V are 2-D descriptors [rows, token stride]: element offset -> (row, column)
        K_ptr = K
        V_ptr = V
        k_row = (k_off // stride_ks).to(tl.int32)
        k_col = (k_off % stride_ks).to(tl.int32)
        v_row = (v_off // stride_vs).to(tl.int32)
        v_col = (v_off % stride_vs).to(tl.int32)
    else:
        K_ptr = K + k_off
        V_ptr = V + v_off
        k_row = 0
        k_col = 0
        v_row = 0
        v_col = 0

    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + q_rows[:, None] + offs_dk[None, :], mask=row_ok[:, None] & (offs_dk[None, :] < D_QK), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    slope = 0.0
    if HAS_ALIBI:
        if PACK_GQA:
            slope = tl.load(SLOPES + b * stride_slope_b + head, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        else:
            slope = tl.load(SLOPES + b * stride_slope_b + head).to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo, a, bb, hi = _key_ranges(q_first, q_last, seqlen_k, diag, window_left, window_right, BLOCK_N,
                                HAS_LEFT, HAS_RIGHT)
    seg_q = 0
    if MASK_MODE == 2:  # packed sequences (queries and keys are the same tokens): keys of the rows' segments only
        seg_q = tl.load(KM_ptr + offs_m, mask=row_ok, other=-1)
        lo, a, bb, hi = _segment_key_range(KM_ptr, stride_mask_plane, q_first, lo, a, bb, hi, BLOCK_N)
    r1_lo, r1_hi, r2_lo, r2_hi, r3_lo, r3_hi = lo, a, a, bb, bb, hi
    if SPLIT:  # this program owns keys [s0, s1) of the sequence (split_len is a multiple of BLOCK_N)
        s0 = split * split_len
        s1 = s0 + split_len
        r1_lo, r1_hi = tl.maximum(lo, s0), tl.minimum(a, s1)
        r2_lo, r2_hi = tl.maximum(a, s0), tl.minimum(bb, s1)
        r3_lo, r3_hi = tl.maximum(bb, s0), tl.minimum(hi, s1)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_ptr, V_ptr, stride_ks, stride_vs, k_row, k_col, v_row, v_col,
                               offs_m, offs_dk, offs_dv,
                               r1_lo, r1_hi, seqlen_k, diag, sm_scale, scale_log2, softcap, slope, window_left,
                               window_right, KM_ptr, seg_q, D_QK, D_V, BLOCK_DK, BLOCK_DV, BLOCK_N, True, HAS_LEFT,
                               HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, UPCAST, PREC, USE_TMA, MASK_MODE)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_ptr, V_ptr, stride_ks, stride_vs, k_row, k_col, v_row, v_col,
                               offs_m, offs_dk, offs_dv,
                               r2_lo, r2_hi, seqlen_k, diag, sm_scale, scale_log2, softcap, slope, window_left,
                               window_right, KM_ptr, seg_q, D_QK, D_V, BLOCK_DK, BLOCK_DV, BLOCK_N, False, HAS_LEFT,
                               HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, UPCAST, PREC, USE_TMA, MASK_MODE)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_ptr, V_ptr, stride_ks, stride_vs, k_row, k_col, v_row, v_col,
                               offs_m, offs_dk, offs_dv,
                               r3_lo, r3_hi, seqlen_k, diag, sm_scale, scale_log2, softcap, slope, window_left,
                               window_right, KM_ptr, seg_q, D_QK, D_V, BLOCK_DK, BLOCK_DV, BLOCK_N, True, HAS_LEFT,
                               HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, UPCAST, PREC, USE_TMA, MASK_MODE)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    # with SPLIT, O/LSE are the fp32 partial buffers [split, B, H, Sq, (Dv)], merged by split_kv.merge_splits
    tok = start_q.to(tl.int64) + offs_m
    o_rows = split.to(tl.int64) * stride_osplit + b64 * stride_ob + tok * stride_os + head * stride_oh
    tl.store(O + o_rows[:, None] + offs_dv[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < D_V))
    l_rows = split.to(tl.int64) * stride_lsplit + b64 * stride_lb + head * stride_lh + tok * stride_ls
    tl.store(LSE + l_rows, lse, mask=row_ok)


# ----------------------------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _bwd_preprocess(O, DO, LSE, DELTA, LSE2, CU_Q,
                    stride_ob, stride_os, stride_oh, stride_dob, stride_dos, stride_doh,
                    stride_lb, stride_lh, stride_ls, dense_len_q,
                    D_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr):
    """delta = rowsum(dO * O) in fp32; lse -> log2 domain with -inf (empty row) -> +inf so that P = 0 there."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    start_q, seqlen_q = _seq_span(b, CU_Q, dense_len_q, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    b64 = b.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < D_V)
    rows = start_q.to(tl.int64) + offs_m
    o = tl.load(O + b64 * stride_ob + head * stride_oh + rows[:, None] * stride_os + offs_d[None, :], mask=mask,
                other=0.0).to(tl.float32)
    do = tl.load(DO + b64 * stride_dob + head * stride_doh + rows[:, None] * stride_dos + offs_d[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    l_off = b64 * stride_lb + head * stride_lh + rows * stride_ls
    lse = tl.load(LSE + l_off, mask=offs_m < seqlen_q, other=0.0)
    tl.store(DELTA + l_off, tl.sum(o * do, 1), mask=offs_m < seqlen_q)
    tl.store(LSE2 + l_off, tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634),
             mask=offs_m < seqlen_q)


# FP8 mode of the backward (FP8 = 1 on the GPU, 2 emulated under the interpreter): the products with P and dS
# (dV = P^T dO, dK = dS^T Q, dQ = dS K) take e4m3 operands. dO, Q and K come quantized per token (fp32 scale per
# token and head) and transposed, `[H, D, T_pad]` (`lowbit_attention.quantize_e4m3_rows`), so that each tile is
# the K-major operand FP8 tensor cores need, read straight into shared memory. Their scales lie along the
# contraction, so they ride on P / dS, which are then scaled into e4m3's range by a running scale per accumulator
# (`_fp8_accumulate`). S and dP stay in the 16-bit dtype.


@triton.jit
def _fp8_tile(XT, SC, t0, offs_t, t_ok, offs_d, D: tl.constexpr, T_PAD, H, MASKED: tl.constexpr):
    """Rows t0 + offs_t of a transposed e4m3 copy as a [rows, D_pad] tile (the transposed view of the loaded
    [D_pad, rows] tile: K-major for a dot that contracts over the rows) and their fp32 scales."""
    ptrs = XT + offs_d[:, None] * T_PAD + (t0 + offs_t)[None, :]
    if MASKED:
        xt = tl.load(ptrs, mask=(offs_d < D)[:, None] & t_ok[None, :], other=0.0)
        sc = tl.load(SC + (t0 + offs_t) * H, mask=t_ok, other=0.0)
    else:
        xt = tl.load(ptrs, mask=(offs_d < D)[:, None], other=0.0)
        sc = tl.load(SC + (t0 + offs_t) * H)
    return tl.trans(xt), sc


@triton.jit
def _fp8_accumulate(acc, acc_scale, x, col_scale, b8, FP8: tl.constexpr):
    """acc * acc_scale + (x * col_scale[None, :]) @ b8 as (acc, acc_scale), the left operand in e4m3: divided by a
    running scale (the largest |x * col_scale| / 448 so far), so acc is only ever scaled down, in place (a separate
    product tile to scale per row would double the accumulator registers)."""
    xs = x * col_scale[None, :]
    new_scale = tl.maximum(tl.maximum(acc_scale, tl.max(tl.max(tl.abs(xs), 1), 0) / 448.0), 1e-30)
    acc = acc * (acc_scale / new_scale)
    a8 = _to_e4m3(tl.minimum(tl.maximum(xs / new_scale, -448.0), 448.0), FP8 == 2)
    if FP8 == 2:  # the interpreter has no FP8 dot: the exact e4m3 values in fp32
        acc = tl.dot(a8.to(tl.float32), b8.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a8, b8, acc)
    return acc, new_scale


@triton.jit
def _query_product(acc, acc_scale, x, b, BT8, SC, t0, offs_t, t_ok, offs_d, D: tl.constexpr, t_pad, n_heads,
                   MASKED: tl.constexpr, PREC: tl.constexpr, FP8: tl.constexpr):
    """acc (* acc_scale) += x @ b over the query rows offs_t (dV += P^T dO, dK += dS^T Q): in b's 16-bit dtype, or
    with FP8 from b's transposed e4m3 copy BT8 and its scales SC."""
    if FP8:
        b8, b_s = _fp8_tile(BT8, SC, t0, offs_t, t_ok, offs_d, D, t_pad, n_heads, MASKED)
        return _fp8_accumulate(acc, acc_scale, x, b_s, b8, FP8)
    return tl.dot(x.to(b.dtype), b, acc, input_precision=PREC), acc_scale


@triton.jit
def _bwd_dkdv_inner(dk, dv, dk_s, dv_s, k, v, Q_ptr, DO_ptr, L2_ptr, DELTA_ptr, stride_qs, stride_dos, stride_ls,
                    offs_n, offs_dk, offs_dv, start, end, seqlen_q, seqlen_k, diag, sm_scale, scale_log2, softcap,
                    slope, window_left, window_right, Q8T_ptr, QS_ptr, DO8T_ptr, DOS_ptr, t_q0, t_q_pad, n_heads,
                    KM_ptr, seg_k, D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DK: tl.constexpr,
                    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
                    HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, UPCAST: tl.constexpr,
                    PREC: tl.constexpr, FP8: tl.constexpr, MASK_MODE: tl.constexpr):
    """Accumulate dK, dV of one key block over query rows [start, end); works on transposed scores [N, M]."""
    for m0 in tl.range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        q_ptrs = Q_ptr + offs_m[:, None] * stride_qs + offs_dk[None, :]
        do_ptrs = DO_ptr + offs_m[:, None] * stride_dos + offs_dv[None, :]
        if MASKED:
            row_ok = offs_m < seqlen_q
            q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_dk[None, :] < D_QK), other=0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
            lse2 = tl.load(L2_ptr + offs_m * stride_ls, mask=row_ok, other=float("inf"))
            delta = tl.load(DELTA_ptr + offs_m * stride_ls, mask=row_ok, other=0.0)
        else:
            if BLOCK_DK == D_QK:
                q = tl.load(q_ptrs)
            else:
                q = tl.load(q_ptrs, mask=offs_dk[None, :] < D_QK, other=0.0)
            if BLOCK_DV == D_V:
                do = tl.load(do_ptrs)
            else:
                do = tl.load(do_ptrs, mask=offs_dv[None, :] < D_V, other=0.0)
            lse2 = tl.load(L2_ptr + offs_m * stride_ls)
            delta = tl.load(DELTA_ptr + offs_m * stride_ls)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        qk_t = tl.dot(k, tl.trans(q), input_precision=PREC)  # [N, M]
        # scores of the transposed block: rows are keys, columns are queries
        if HAS_SOFTCAP or HAS_ALIBI:
            s = qk_t * sm_scale
            t = s
            if HAS_SOFTCAP:
                t = _tanh(s / softcap)
                s = softcap * t
            if HAS_ALIBI:
                dist = (offs_m[None, :] + diag) - offs_n[:, None]
                dist = tl.where(dist < 0, -dist, dist)
                s = s - slope * dist.to(tl.float32)
            s = s * 1.4426950408889634
        else:
            s = qk_t * scale_log2
        p_t = tl.math.exp2(s - lse2[None, :])
        if MASKED:
            keep = offs_m[None, :] < seqlen_q
            if HAS_RIGHT:
                keep = keep & (offs_n[:, None] <= offs_m[None, :] + diag + window_right)
            if HAS_LEFT:
                keep = keep & (offs_n[:, None] >= offs_m[None, :] + diag - window_left)
            p_t = tl.where(keep, p_t, 0.0)
        if MASK_MODE == 2:  # packed sequences: this key block's keys are seen by the rows of their segment only
            seg_q = tl.load(KM_ptr + offs_m, mask=offs_m < seqlen_q, other=-1)
            p_t = tl.where(seg_k[:, None] == seg_q[None, :], p_t, 0.0)
        dv, dv_s = _query_product(dv, dv_s, p_t, do, DO8T_ptr, DOS_ptr, t_q0, offs_m, offs_m < seqlen_q, offs_dv, D_V,
                                  t_q_pad, n_heads, MASKED, PREC, FP8)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        if HAS_SOFTCAP:
            ds_t = ds_t * (1.0 - t * t)
        dk, dk_s = _query_product(dk, dk_s, ds_t, q, Q8T_ptr, QS_ptr, t_q0, offs_m, offs_m < seqlen_q, offs_dk, D_QK,
                                  t_q_pad, n_heads, MASKED, PREC, FP8)
    return dk, dv, dk_s, dv_s


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE2, DELTA, DK, DV, CU_Q, CU_K, SLOPES, SEQUSED_K, KEY_MASK, Q8T, QS, DO8T, DOS,
                     t_q_pad,
                     stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                     stride_dob, stride_dos, stride_doh, stride_dkb, stride_dks, stride_dkh,
                     stride_dvb, stride_dvs, stride_dvh, stride_lb, stride_lh, stride_ls,
                     stride_slope_b, stride_mask_b, stride_mask_plane, dense_len_q, dense_len_k, gqa_ratio,
                     sm_scale, scale_log2, softcap, window_left, window_right,
                     D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr,
                     HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                     HAS_ALIBI: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, FP8: tl.constexpr = 0,
                     HAS_SEQUSED: tl.constexpr = False, MASK_MODE: tl.constexpr = 0):
    pid_n = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.program_id(2)
    start_q, seqlen_q = _seq_span(b, CU_Q, dense_len_q, IS_VARLEN)
    start_k, seqlen_k = _key_span(b, CU_K, dense_len_k, SEQUSED_K, IS_VARLEN, HAS_SEQUSED)
    n0 = pid_n * BLOCK_N
    if n0 >= seqlen_k:  # (with SEQUSED_K the caller zero-fills dK/dV: slots past the keys get no gradient)
        return
    diag = seqlen_k - seqlen_q
    b64 = b.to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_k = start_k.to(tl.int64) + offs_n
    k_mask = (offs_n[:, None] < seqlen_k) & (offs_dk[None, :] < D_QK)
    v_mask = (offs_n[:, None] < seqlen_k) & (offs_dv[None, :] < D_V)
    k = tl.load(K + b64 * stride_kb + kv_head * stride_kh + row_k[:, None] * stride_ks + offs_dk[None, :],
                mask=k_mask, other=0.0)
    v = tl.load(V + b64 * stride_vb + kv_head * stride_vh + row_k[:, None] * stride_vs + offs_dv[None, :],
                mask=v_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_DK], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    dk_s = tl.full([], 1.0 if FP8 == 0 else 0.0, tl.float32)  # FP8: dk * dk_s, dv * dv_s are the sums
    dv_s = tl.full([], 1.0 if FP8 == 0 else 0.0, tl.float32)
    lo, a, bb, hi = _query_ranges(n0, seqlen_q, diag, window_left, window_right, BLOCK_M, BLOCK_N,
                                  HAS_LEFT, HAS_RIGHT)
    KM_ptr = KEY_MASK + b64 * stride_mask_b
    seg_k = 0
    if MASK_MODE == 2:  # packed: queries past the end of the last key's segment cannot see this block
        seg_k = tl.load(KM_ptr + offs_n, mask=offs_n < seqlen_k, other=0)
        last = tl.minimum(n0 + BLOCK_N, seqlen_k) - 1
        seg_hi = tl.load(KM_ptr + 2 * stride_mask_plane + last)
        hi = tl.minimum(hi, ((seg_hi + BLOCK_M - 1) // BLOCK_M) * BLOCK_M)
        bb = tl.minimum(bb, hi)
        a = tl.minimum(a, bb)
        lo = tl.minimum(lo, a)
    q_row0 = b64 * stride_qb + start_q.to(tl.int64) * stride_qs
    do_row0 = b64 * stride_dob + start_q.to(tl.int64) * stride_dos
    l_row0 = b64 * stride_lb + start_q.to(tl.int64) * stride_ls
    t_q0 = start_q if IS_VARLEN else b * dense_len_q  # first query token in the FP8 copies
    n_heads = tl.num_programs(1) * gqa_ratio
    for g in range(0, gqa_ratio):  # every query head reading this KV head
        head = kv_head * gqa_ratio + g
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(SLOPES + b * stride_slope_b + head).to(tl.float32)
        Q_ptr = Q + q_row0 + head * stride_qh
        DO_ptr = DO + do_row0 + head * stride_doh
        L2_ptr = LSE2 + l_row0 + head * stride_lh
        D_ptr = DELTA + l_row0 + head * stride_lh
        Q8T_ptr = Q8T + head * D_QK * t_q_pad
        DO8T_ptr = DO8T + head * D_V * t_q_pad
        dk, dv, dk_s, dv_s = _bwd_dkdv_inner(
            dk, dv, dk_s, dv_s, k, v, Q_ptr, DO_ptr, L2_ptr, D_ptr, stride_qs, stride_dos, stride_ls, offs_n, offs_dk,
            offs_dv, lo, a, seqlen_q, seqlen_k, diag, sm_scale, scale_log2, softcap, slope, window_left, window_right,
            Q8T_ptr, QS + head, DO8T_ptr, DOS + head, t_q0, t_q_pad, n_heads, KM_ptr, seg_k, D_QK, D_V, BLOCK_DK,
            BLOCK_DV, BLOCK_M,
            True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, UPCAST, PREC, FP8, MASK_MODE)
        dk, dv, dk_s, dv_s = _bwd_dkdv_inner(
            dk, dv, dk_s, dv_s, k, v, Q_ptr, DO_ptr, L2_ptr, D_ptr, stride_qs, stride_dos, stride_ls, offs_n, offs_dk,
            offs_dv, a, bb, seqlen_q, seqlen_k, diag, sm_scale, scale_log2, softcap, slope, window_left, window_right,
            Q8T_ptr, QS + head, DO8T_ptr, DOS + head, t_q0, t_q_pad, n_heads, KM_ptr, seg_k, D_QK, D_V, BLOCK_DK,
            BLOCK_DV, BLOCK_M,
            False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, UPCAST, PREC, FP8, MASK_MODE)
        dk, dv, dk_s, dv_s = _bwd_dkdv_inner(
            dk, dv, dk_s, dv_s, k, v, Q_ptr, DO_ptr, L2_ptr, D_ptr, stride_qs, stride_dos, stride_ls, offs_n, offs_dk,
            offs_dv, bb, hi, seqlen_q, seqlen_k, diag, sm_scale, scale_log2, softcap, slope, window_left, window_right,
            Q8T_ptr, QS + head, DO8T_ptr, DOS + head, t_q0, t_q_pad, n_heads, KM_ptr, seg_k, D_QK, D_V, BLOCK_DK,
            BLOCK_DV, BLOCK_M,
            True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, UPCAST, PREC, FP8, MASK_MODE)
    dk = dk * (dk_s * sm_scale)
    dv = dv * dv_s
    if MASK_MODE == 1:  # a masked key has P = 0 in every row: no gradient (its P^T rows above were not masked)
        key_ok = tl.load(KM_ptr + offs_n, mask=offs_n < seqlen_k, other=0) > 0
        dk = tl.where(key_ok[:, None], dk, 0.0)
        dv = tl.where(key_ok[:, None], dv, 0.0)
    tl.store(DK + b64 * stride_dkb + kv_head * stride_dkh + row_k[:, None] * stride_dks + offs_dk[None, :],
             dk.to(DK.dtype.element_ty), mask=k_mask)
    tl.store(DV + b64 * stride_dvb + kv_head * stride_dvh + row_k[:, None] * stride_dvs + offs_dv[None, :],
             dv.to(DV.dtype.element_ty), mask=v_mask)


@triton.jit
def _bwd_dq_inner(dq, dq_s, q, do, lse2, delta, K_ptr, V_ptr, stride_ks, stride_vs, offs_m, offs_dk, offs_dv,
                  start, end, seqlen_k, diag, sm_scale, scale_log2, softcap, slope, window_left, window_right,
                  K8T_ptr, KS_ptr, t_k0, t_k_pad, n_kv_heads, KM_ptr, seg_q,
                  D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                  HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                  FP8: tl.constexpr, MASK_MODE: tl.constexpr):
    for n0 in tl.range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kt_ptrs = K_ptr + offs_n[None, :] * stride_ks + offs_dk[:, None]
        vt_ptrs = V_ptr + offs_n[None, :] * stride_vs + offs_dv[:, None]
        if MASKED:
            kt = tl.load(kt_ptrs, mask=(offs_n[None, :] < seqlen_k) & (offs_dk[:, None] < D_QK), other=0.0)
            vt = tl.load(vt_ptrs, mask=(offs_n[None, :] < seqlen_k) & (offs_dv[:, None] < D_V), other=0.0)
        else:
            if BLOCK_DK == D_QK:
                kt = tl.load(kt_ptrs)
            else:
                kt = tl.load(kt_ptrs, mask=offs_dk[:, None] < D_QK, other=0.0)
            if BLOCK_DV == D_V:
                vt = tl.load(vt_ptrs)
            else:
                vt = tl.load(vt_ptrs, mask=offs_dv[:, None] < D_V, other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        qk = tl.dot(q, kt, input_precision=PREC)
        s, t = _scores_log2(qk, offs_m, offs_n, diag, sm_scale, scale_log2, softcap, slope, HAS_SOFTCAP, HAS_ALIBI)
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:
            keep = _visible(offs_m, offs_n, diag, seqlen_k, window_left, window_right, HAS_LEFT, HAS_RIGHT)
            p = tl.where(keep, p, 0.0)
        if MASK_MODE:
            p = tl.where(_key_visible(KM_ptr, seg_q, offs_n, seqlen_k, MASKED, MASK_MODE), p, 0.0)
        dp = tl.dot(do, vt, input_precision=PREC)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        if FP8:
            k8, k_s = _fp8_tile(K8T_ptr, KS_ptr, t_k0, offs_n, offs_n < seqlen_k, offs_dk, D_QK, t_k_pad, n_kv_heads,
                                MASKED)
            dq, dq_s = _fp8_accumulate(dq, dq_s, ds, k_s, k8, FP8)
        else:
            dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=PREC)
    return dq, dq_s


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE2, DELTA, DQ, CU_Q, CU_K, SLOPES, SEQUSED_K, KEY_MASK, K8T, KS, t_k_pad,
                   stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                   stride_dob, stride_dos, stride_doh, stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh,
                   stride_ls, stride_slope_b, stride_mask_b, stride_mask_plane, dense_len_q, dense_len_k, gqa_ratio,
                   sm_scale, scale_log2, softcap, window_left, window_right,
                   D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                   HAS_ALIBI: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, FP8: tl.constexpr = 0,
                   HAS_SEQUSED: tl.constexpr = False, MASK_MODE: tl.constexpr = 0):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    start_q, seqlen_q = _seq_span(b, CU_Q, dense_len_q, IS_VARLEN)
    start_k, seqlen_k = _key_span(b, CU_K, dense_len_k, SEQUSED_K, IS_VARLEN, HAS_SEQUSED)
    KM_ptr = KEY_MASK + b.to(tl.int64) * stride_mask_b
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    kv_head = head // gqa_ratio
    diag = seqlen_k - seqlen_q
    b64 = b.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = start_q.to(tl.int64) + offs_m
    row_ok = offs_m < seqlen_q
    q_mask = row_ok[:, None] & (offs_dk[None, :] < D_QK)
    q = tl.load(Q + b64 * stride_qb + head * stride_qh + rows[:, None] * stride_qs + offs_dk[None, :],
                mask=q_mask, other=0.0)
    do = tl.load(DO + b64 * stride_dob + head * stride_doh + rows[:, None] * stride_dos + offs_dv[None, :],
                 mask=row_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
    l_off = b64 * stride_lb + head * stride_lh + rows * stride_ls
    lse2 = tl.load(LSE2 + l_off, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + l_off, mask=row_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(SLOPES + b * stride_slope_b + head).to(tl.float32)
    K_ptr = K + b64 * stride_kb + start_k.to(tl.int64) * stride_ks + kv_head * stride_kh
    V_ptr = V + b64 * stride_vb + start_k.to(tl.int64) * stride_vs + kv_head * stride_vh
    t_k0 = start_k if IS_VARLEN else b * dense_len_k  # first key token in the FP8 copy
    n_kv_heads = tl.num_programs(1) // gqa_ratio
    K8T_ptr = K8T + kv_head * D_QK * t_k_pad
    dq = tl.zeros([BLOCK_M, BLOCK_DK], tl.float32)
    dq_s = tl.full([], 1.0 if FP8 == 0 else 0.0, tl.float32)  # FP8: dq * dq_s is the sum
    lo, a, bb, hi = _key_ranges(m0, m0 + BLOCK_M - 1, seqlen_k, diag, window_left, window_right, BLOCK_N,
                                HAS_LEFT, HAS_RIGHT)
    seg_q = 0
    if MASK_MODE == 2:
        seg_q = tl.load(KM_ptr + offs_m, mask=row_ok, other=-1)
        lo, a, bb, hi = _segment_key_range(KM_ptr, stride_mask_plane, m0, lo, a, bb, hi, BLOCK_N)
    dq, dq_s = _bwd_dq_inner(
        dq, dq_s, q, do, lse2, delta, K_ptr, V_ptr, stride_ks, stride_vs, offs_m, offs_dk, offs_dv, lo, a, seqlen_k,
        diag, sm_scale, scale_log2, softcap, slope, window_left, window_right, K8T_ptr, KS + kv_head, t_k0, t_k_pad,
        n_kv_heads, KM_ptr, seg_q, D_QK, D_V, BLOCK_DK, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
        HAS_ALIBI, UPCAST, PREC, FP8, MASK_MODE)
    dq, dq_s = _bwd_dq_inner(
        dq, dq_s, q, do, lse2, delta, K_ptr, V_ptr, stride_ks, stride_vs, offs_m, offs_dk, offs_dv, a, bb, seqlen_k,
        diag, sm_scale, scale_log2, softcap, slope, window_left, window_right, K8T_ptr, KS + kv_head, t_k0, t_k_pad,
        n_kv_heads, KM_ptr, seg_q, D_QK, D_V, BLOCK_DK, BLOCK_DV, BLOCK_N, False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
        HAS_ALIBI, UPCAST, PREC, FP8, MASK_MODE)
    dq, dq_s = _bwd_dq_inner(
        dq, dq_s, q, do, lse2, delta, K_ptr, V_ptr, stride_ks, stride_vs, offs_m, offs_dk, offs_dv, bb, hi, seqlen_k,
        diag, sm_scale, scale_log2, softcap, slope, window_left, window_right, K8T_ptr, KS + kv_head, t_k0, t_k_pad,
        n_kv_heads, KM_ptr, seg_q, D_QK, D_V, BLOCK_DK, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
        HAS_ALIBI, UPCAST, PREC, FP8, MASK_MODE)
    dq = dq * (dq_s * sm_scale)
    tl.store(DQ + b64 * stride_dqb + head * stride_dqh + rows[:, None] * stride_dqs + offs_dk[None, :],
             dq.to(DQ.dtype.element_ty), mask=q_mask)


# ----------------------------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per padded head dim, measured on H200 (benchmarks/attention.py).
_FWD_CONFIGS = {16: (64, 64, 4, 3), 32: (64, 64, 4, 3), 64: (64, 64, 4, 3), 128: (64, 64, 4, 3),
                256: (128, 64, 8, 2)}
# Few query rows (decode): memory bound, keys split across programs. Per padded head dim: at 256 the 128-key tiles
# of session 1 needed 268 KB of shared memory (K and V, 3 stages) and failed to launch on Hopper (227 KB).
# 64-key tiles: 1.07-1.3x faster than 128 on the H200 at hd 128 (benchmarks/results/attention_dispatch.json).
_FWD_DECODE_CONFIGS = {16: (16, 64, 4, 3), 32: (16, 64, 4, 3), 64: (16, 64, 4, 3), 128: (16, 64, 4, 3),
                       256: (16, 64, 4, 2)}
# hd256 backward (session 5 sweep, H200, benchmarks/results/archive/attention_hd256_s5.json): (64, 32, 4, 2) for both
# kernels, 1.14x (dK/dV) and 1.27x (dQ) faster than the session-1 choices, which spilled 0.8-1.6 KB per thread.
_DKDV_CONFIGS = {16: (64, 64, 4, 3), 32: (64, 64, 4, 3), 64: (64, 64, 4, 3), 128: (64, 64, 4, 2),
                 256: (64, 32, 4, 2)}
_DQ_CONFIGS = {16: (64, 64, 4, 3), 32: (64, 64, 4, 3), 64: (64, 64, 4, 3), 128: (128, 64, 8, 3),
               256: (64, 32, 4, 2)}
# FP8 products (H200, benchmarks/results/lowbit_attention_backward.json): the tiles that spill least (offline SASS,
# Triton 3.6, with the launch's divisibility hints: dK/dV 0.2 KB of stack per thread at hd 128, 2 KB at the bf16
# tiles). The FP8 kernels are still 0.33-0.48x the bf16 ones: quantizing P and dS every step (absmax reductions,
# divisions, conversions, a register-layout change for the FP8 operand) adds ~50% SASS to the dK/dV loop.
_BWD_FP8_CONFIGS = {16: (64, 32, 4, 2), 32: (64, 32, 4, 2), 64: (64, 32, 4, 2), 128: (64, 32, 4, 2),
                    256: (32, 32, 4, 2)}
# float32 inputs take twice the shared memory: where the 16-bit tiles would not fit in Hopper's 227 KB (offline
# builds, tests/sm90_builds.py), smaller ones.
_FP32_CONFIGS = {("fwd", 256): (64, 32, 4, 2), ("dq", 128): (64, 64, 4, 2)}
_INTERPRET_CONFIG = (16, 16, 4, 1)  # small tiles: more block boundaries per tiny test shape, quick to interpret

# Benchmarks/tests may pin configs: {"fwd": (BM, BN, warps, stages), "dkdv": ..., "dq": ...}.
CONFIG_OVERRIDE: dict = {}


def _block_dim(d: int) -> int:
    return max(16, next_pow2(d))


def _config(kind: str, block_d: int, decode: bool = False, fp32: bool = False):
    if kind in CONFIG_OVERRIDE:
        return CONFIG_OVERRIDE[kind]
    if interpreting():
        return _INTERPRET_CONFIG
    if fp32 and not decode and (kind, block_d) in _FP32_CONFIGS:
        return _FP32_CONFIGS[kind, block_d]
    if kind == "fwd":
        return (_FWD_DECODE_CONFIGS if decode else _FWD_CONFIGS)[block_d]
    if kind.endswith("_fp8"):
        return _BWD_FP8_CONFIGS[block_d]
    return (_DKDV_CONFIGS if kind == "dkdv" else _DQ_CONFIGS)[block_d]


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _dims(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """(batch, max Sq, max Sk, dense Sq, dense Sk, varlen) and the 4-D strides view [B, S, H, D] of each tensor."""
    if cu_seqlens_q is None:
        return q.shape[0], q.shape[1], k.shape[1], q.shape[1], k.shape[1], False
    batch = cu_seqlens_q.numel() - 1
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()) if batch > 0 else 0
    if max_seqlen_k is None:
        max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max().item()) if batch > 0 else 0
    return batch, int(max_seqlen_q), int(max_seqlen_k), 0, 0, True


def _strides4(t, varlen):
    """(batch, seq, head) strides; varlen tensors have no batch axis (offsets come from cu_seqlens)."""
    if varlen:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def _lse_strides(lse, varlen):
    if varlen:  # [H, T]
        return 0, lse.stride(0), lse.stride(1)
    return lse.stride(0), lse.stride(1), lse.stride(2)  # [B, H, S]


def _window(causal, window_size):
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def _slopes(alibi_slopes):
    if alibi_slopes is None:
        return None, 0
    s = alibi_slopes.to(torch.float32).contiguous()
    return s, (s.stride(0) if s.dim() == 2 else 0)


def _flags(q, left, right, softcap, slopes):
    upcast = interpreting() and q.dtype != torch.float32  # interpreter's bf16/fp16 dot is wrong
    return dict(HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, HAS_SOFTCAP=softcap > 0, HAS_ALIBI=slopes is not None,
                UPCAST=upcast, PREC="ieee" if q.dtype == torch.float32 else "tf32")


# "auto": bulk tensor copies (TMA) for K/V in the forward on sm_90+ when the layout allows; False/True force it.
USE_TMA = "auto"


def _kv_descriptor(t, block_n, block_d):
    """2-D TMA descriptor over t's memory as [rows, token stride], or None when the layout does not fit."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    ss, sh = t.stride(-3), t.stride(-2)
    sb = t.stride(0) if t.dim() == 4 else 0
    d, h = t.shape[-1], t.shape[-2]
    if (ss * t.element_size()) % 16 or t.data_ptr() % 16 or sb % ss:
        return None
    if not ((sh % ss == 0 and d <= ss) or (sh >= d and sh * (h - 1) + d <= ss)):
        return None  # a head's row would straddle two descriptor rows
    span = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1
    return TensorDescriptor(t, [cdiv(span, ss), ss], [ss, 1], [block_n, block_d])


_TMA_FAILED: set = set()  # (block dims, config) whose TMA variant did not fit in shared memory


def _use_tma(q, d_qk, d_v, bdk, bdv):
    # head dim 256 with TMA buffers exceeds Hopper's 227 KB of shared memory at useful tile sizes
    if USE_TMA is False or interpreting() or not q.is_cuda or bdk != d_qk or bdv != d_v or max(bdk, bdv) > 128:
        return False
    return USE_TMA is True or compute_major(q.device) >= 9


def _num_splits(programs, seqlen_k, block_n, device):
    if interpreting() or device.type != "cuda":
        return 1
    sms = num_sms(device)
    if programs >= sms:
        return 1
    # about two waves of programs: 1.1-1.3x faster than four at batch 1-8 (attention_dispatch.json, decode_config)
    return max(1, min(cdiv(seqlen_k, 4 * block_n), cdiv(2 * sms, programs), 128))


def segment_table(segment_ids: torch.Tensor) -> torch.Tensor:
    """int32 `[3, B, S]` describing packed sequences from per-token ids `[B, S]` (tokens of one sequence are
    contiguous and share an id): plane 0 numbers the sequences from 1, plane 1 holds each token's sequence start
    (the first key its query may see), plane 2 its sequence end (one past the last query that may see its key).
    Device ops only: no host synchronisation."""
    b, s = segment_ids.shape
    new = torch.ones(b, s, dtype=torch.bool, device=segment_ids.device)
    new[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    idx = torch.arange(s, dtype=torch.int32, device=segment_ids.device).expand(b, s)
    start = torch.where(new, idx, 0).cummax(-1).values
    last = torch.ones_like(new)
    last[:, :-1] = new[:, 1:]
    end = torch.where(last, idx + 1, s).flip(-1).cummin(-1).values.flip(-1)
    return torch.stack([new.cumsum(-1, dtype=torch.int32), start.to(torch.int32), end.to(torch.int32)]).contiguous()


def cu_seqlens_segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """int32 `[total]` packed-sequence ids of the tokens of varlen inputs with offsets `cu_seqlens` (tokens before
    cu_seqlens[0] and from cu_seqlens[-1] on form sequences of their own; empty sequences take no ids). Device ops
    only."""
    if total == 0:
        return torch.zeros(0, dtype=torch.int32, device=cu_seqlens.device)
    cuts = cu_seqlens.long()
    inside = ((cuts > 0) & (cuts < total)).to(torch.int32)  # a weight, not a filter: no data-dependent shape
    starts = torch.zeros(total, dtype=torch.int32, device=cu_seqlens.device)
    starts.scatter_reduce_(0, cuts.clamp(0, total - 1), inside, reduce="amax")  # empty sequences: one cut
    return torch.cumsum(starts, 0, dtype=torch.int32)


def _key_mask_arg(key_mask, segments, batch, mq, mk, device):
    """(tensor with unit last stride, its batch stride, its plane stride, MASK_MODE) of a per-key mask (entries > 0
    are real keys: MASK_MODE 1) or a `segment_table` (MASK_MODE 2)."""
    if key_mask is not None and segments is not None:
        raise ValueError("pass key_mask or segments, not both (a padding token is a segment of its own).")
    if segments is not None:
        if segments.dim() != 3 or segments.shape[0] != 3 or segments.shape[1] != batch or mq != mk or \
                segments.shape[2] != mk or segments.dtype != torch.int32:
            raise ValueError(f"segments must be the int32 [3, batch, seq] = [3, {batch}, {mk}] table of "
                             f"`segment_table` for as many queries as keys, got {segments.dtype} "
                             f"{tuple(segments.shape)} with {mq} queries and {mk} keys.")
        key_mask, mode = segments, 2
    elif key_mask is None:
        return None, 0, 0, 0
    else:
        if key_mask.dtype == torch.bool:
            key_mask = key_mask.view(torch.uint8)
        if key_mask.dim() != 2 or key_mask.shape[0] != batch or key_mask.shape[1] < mk:
            raise ValueError(f"key_mask must be [batch, keys] = [{batch}, {mk}], got {tuple(key_mask.shape)}.")
        key_mask, mode = key_mask[None], 1
    if key_mask.device != device:
        raise ValueError(f"key_mask / segments are on {key_mask.device}; they must be on {device} with q, k, v.")
    key_mask = _last_dim_contiguous(key_mask)
    return key_mask, key_mask.stride(1), key_mask.stride(0), mode


def _seqused_arg(seqused_k, batch, device):
    if seqused_k is None:
        return None
    if seqused_k.shape != (batch,) or seqused_k.device != device:
        raise ValueError(f"seqused_k must be an int tensor [batch] = [{batch}] on {device}, got "
                         f"{tuple(seqused_k.shape)} on {seqused_k.device}.")
    return seqused_k.to(torch.int32).contiguous()


@on_input_device
def flash_attention_forward(q, k, v, *, causal=False, softmax_scale=None, cu_seqlens_q=None, cu_seqlens_k=None,
                            max_seqlen_q=None, max_seqlen_k=None, window_size=(-1, -1), softcap=0.0,
                            alibi_slopes=None, seqused_k=None, key_mask=None, segments=None, num_splits=None,
                            out_dtype=None):
    """Returns `(out, lse)`: out like q with v's head dim (in `out_dtype`, default q.dtype: fp32 keeps ring-attention
    partials unrounded), lse fp32 `[B, Hq, Sq]` (dense) or `[Hq, T]` (varlen).
    `seqused_k` (int `[B]`): sequence b has keys in its first `seqused_k[b]` slots only (a static KV cache), and causal
    attention aligns to them. `key_mask` (`[B, Sk]`, bool or integer, dense only): keys whose entry is not > 0 are
    not attended (padding). `segments` (`segment_table`, dense, Sq == Sk): packed sequences, each attending only
    within itself. `num_splits` (None = heuristic) splits the keys across programs (dense inputs only)."""
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    batch, mq, mk, dense_q, dense_k, varlen = _dims(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    hq, hkv, d_qk, d_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d_qk)
    left, right = _window(causal, window_size)
    slopes, stride_slope_b = _slopes(alibi_slopes)
    if varlen and (key_mask is not None or segments is not None):
        raise ValueError("key_mask and segments are for dense [B, S, H, D] inputs, not with cu_seqlens.")
    key_mask, stride_mask_b, stride_mask_plane, mask_mode = _key_mask_arg(key_mask, segments, batch, mq, mk,
                                                                          q.device)
    seqused_k = _seqused_arg(seqused_k, batch, q.device)
    out = torch.empty(*q.shape[:-1], d_v, dtype=out_dtype or q.dtype, device=q.device)
    lse = torch.empty((hq, q.shape[0]) if varlen else (batch, hq, mq), dtype=torch.float32, device=q.device)
    if q.numel() == 0 or batch == 0 or k.numel() == 0 or v.numel() == 0:  # no queries, or no keys at all
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    bdk, bdv = _block_dim(d_qk), _block_dim(d_v)
    decode = mq <= 16
    bm, bn, warps, stages = _config("fwd", max(bdk, bdv), decode=decode, fp32=q.dtype == torch.float32)
    pack = decode and hq > hkv  # tile rows = (query head of the group, query): K/V read once per KV head
    rows_per_head = mq * (hq // hkv) if pack else mq
    programs = cdiv(rows_per_head, bm) * (hkv if pack else hq) * batch
    splits = 1 if varlen else (num_splits or _num_splits(programs, mk, bn, q.device))
    splits = max(1, min(splits, cdiv(max(mk, 1), bn)))
    split_len = cdiv(cdiv(max(mk, 1), splits), bn) * bn
    splits = cdiv(max(mk, 1), split_len)
    cu_q = cu_seqlens_q if varlen else q  # unused pointer when dense
    cu_k = cu_seqlens_k if varlen else q
    flags = _flags(q, left, right, softcap, slopes)
    if splits > 1:
        o_dst = torch.empty(splits, batch, hq, mq, d_v, dtype=torch.float32, device=q.device)
        l_dst = torch.empty(splits, batch, hq, mq, dtype=torch.float32, device=q.device)
        o_strides = (o_dst.stride(1), o_dst.stride(3), o_dst.stride(2))
        l_strides = (l_dst.stride(1), l_dst.stride(2), l_dst.stride(3))
        split_strides = (o_dst.stride(0), l_dst.stride(0))
    else:
        o_dst, l_dst = out, lse
        o_strides, l_strides, split_strides = _strides4(out, varlen), _lse_strides(lse, varlen), (0, 0)
    grid = (cdiv(rows_per_head, bm), hkv if pack else hq, batch * splits)
    meta = dict(D_QK=d_qk, D_V=d_v, BLOCK_DK=bdk, BLOCK_DV=bdv, BLOCK_M=bm, BLOCK_N=bn, IS_VARLEN=varlen,
                SPLIT=splits > 1, PACK_GQA=pack, HAS_SEQUSED=seqused_k is not None, MASK_MODE=mask_mode,
                num_warps=warps, num_stages=stages, **flags)
    tail = (*_strides4(q, varlen), *_strides4(k, varlen), *_strides4(v, varlen), *o_strides, *l_strides,
            *split_strides, stride_slope_b, stride_mask_b, stride_mask_plane, dense_q, dense_k, hq // hkv, splits,
            split_len,
            scale, scale * LOG2E, float(softcap), left, right)
    head = (o_dst, l_dst, cu_q, cu_k, slopes if slopes is not None else q, q if seqused_k is None else seqused_k,
            q if key_mask is None else key_mask)
    tma_key = (bdk, bdv, bm, bn, warps, stages)
    kd = vd = None
    if not decode and tma_key not in _TMA_FAILED and _use_tma(q, d_qk, d_v, bdk, bdv):
        kd, vd = _kv_descriptor(k, bn, bdk), _kv_descriptor(v, bn, bdv)
    # both launches skip Triton's per-call specialization (kernels/launch.py): decoding calls this once per layer
    # and token
    if kd is not None and vd is not None:  # bulk tensor copies (prefill on Hopper)
        try:
            launch_cached(_fwd_kernel, grid, (q, kd, vd, *head, *tail), dict(USE_TMA=True, **meta))
        except triton.runtime.errors.OutOfResources:  # TMA staging buffers too large: plain loads instead
            _TMA_FAILED.add(tma_key)
            kd = None
    if kd is None or vd is None:
        launch_cached(_fwd_kernel, grid, (q, k, v, *head, *tail), dict(USE_TMA=False, **meta))
    if splits > 1:
        merge_splits(o_dst, l_dst, out, lse, num_splits=splits, part_strides=(o_dst.stride(0), o_dst.stride(3)),
                     lse_part_strides=(l_dst.stride(0), 1), lse_log2=False)
    if varlen:  # queries outside every sequence: no program wrote them
        fill_outside_sequences(cu_seqlens_q, (out, 0.0, 0), (lse, float("-inf"), 1))
    return out, lse


@on_input_device
def flash_attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, cu_seqlens_q=None,
                             cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, seqused_k=None, key_mask=None, segments=None,
                             grad_dtype=None, fp8_products=False):
    """Returns `(dq, dk, dv)` shaped like q, k, v in `grad_dtype` (default q.dtype), from the given out and lse
    (which may be merged over several key blocks, as in ring attention). `seqused_k`, `key_mask`, `segments` as in
    the forward (keys they exclude get zero gradients). fp8_products: dV = P^T dO, dK = dS^T Q and dQ = dS K with
    e4m3 operands (see `_fp8_accumulate`), for low-precision training."""
    dout, q, k, v, out = (_last_dim_contiguous(t) for t in (dout, q, k, v, out))
    dout = dout if dout.dtype == q.dtype else dout.to(q.dtype)  # the dots take one operand dtype
    lse = lse.to(torch.float32).contiguous()
    batch, mq, mk, dense_q, dense_k, varlen = _dims(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    hq, hkv, d_qk, d_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d_qk)
    left, right = _window(causal, window_size)
    slopes, stride_slope_b = _slopes(alibi_slopes)
    if varlen and (key_mask is not None or segments is not None):
        raise ValueError("key_mask and segments are for dense [B, S, H, D] inputs, not with cu_seqlens.")
    key_mask, stride_mask_b, stride_mask_plane, mask_mode = _key_mask_arg(key_mask, segments, batch, mq, mk,
                                                                          q.device)
    seqused_k = _seqused_arg(seqused_k, batch, q.device)
    gd = grad_dtype or q.dtype
    dq = torch.empty(q.shape, dtype=gd, device=q.device)
    new_kv = torch.empty if seqused_k is None else torch.zeros  # slots past seqused_k get no program
    dk = new_kv(k.shape, dtype=gd, device=q.device)
    dv = new_kv(v.shape, dtype=gd, device=q.device)
    if batch == 0 or q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    bdk, bdv = _block_dim(d_qk), _block_dim(d_v)
    bdmax = max(bdk, bdv)
    cu_q = cu_seqlens_q if varlen else q
    cu_k = cu_seqlens_k if varlen else q
    sl = slopes if slopes is not None else q
    flags = _flags(q, left, right, softcap, slopes)
    delta = torch.empty_like(lse)
    lse2 = torch.empty_like(lse)
    l_strides = _lse_strides(lse, varlen)
    pre_bm = 64 if not interpreting() else 16
    launch_cached(_bwd_preprocess, (cdiv(mq, pre_bm), hq, batch),
                  (out, dout, lse, delta, lse2, cu_q, *_strides4(out, varlen), *_strides4(dout, varlen), *l_strides,
                   dense_q),
                  dict(D_V=d_v, BLOCK_DV=bdv, BLOCK_M=pre_bm, IS_VARLEN=varlen))
    common = dict(D_QK=d_qk, D_V=d_v, BLOCK_DK=bdk, BLOCK_DV=bdv, IS_VARLEN=varlen,
                  HAS_SEQUSED=seqused_k is not None, MASK_MODE=mask_mode, **flags)
    masks = (q if seqused_k is None else seqused_k, q if key_mask is None else key_mask)
    fp8 = (q,) * 4 + (0,)  # dkdv: Q8T, QS, DO8T, DOS, t_q_pad (unused without fp8_products)
    fp8_k = (q, q, 0)  # dq: K8T, KS, t_k_pad
    if fp8_products:
        common["FP8"] = 2 if interpreting() else 1
        (q8t, qs), (do8t, dos), (k8t, ks) = (quantize_e4m3_rows(x, "fp8", transpose=True) for x in (q, dout, k))
        fp8 = (q8t, qs, do8t, dos, q8t.shape[-1])
        fp8_k = (k8t, ks, k8t.shape[-1])
    suffix = "_fp8" if fp8_products else ""
    fp32 = q.dtype == torch.float32
    bm, bn, warps, stages = _config("dkdv" + suffix, bdmax, fp32=fp32)
    launch_cached(_bwd_dkdv_kernel, (cdiv(mk, bn), hkv, batch),
                  (q, k, v, dout, lse2, delta, dk, dv, cu_q, cu_k, sl, *masks, *fp8,
                   *_strides4(q, varlen), *_strides4(k, varlen), *_strides4(v, varlen), *_strides4(dout, varlen),
                   *_strides4(dk, varlen), *_strides4(dv, varlen), *l_strides, stride_slope_b, stride_mask_b,
                   stride_mask_plane, dense_q, dense_k, hq // hkv, scale, scale * LOG2E, float(softcap), left, right),
                  dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **common))
    bm, bn, warps, stages = _config("dq" + suffix, bdmax, fp32=fp32)
    launch_cached(_bwd_dq_kernel, (cdiv(mq, bm), hq, batch),
                  (q, k, v, dout, lse2, delta, dq, cu_q, cu_k, sl, *masks, *fp8_k,
                   *_strides4(q, varlen), *_strides4(k, varlen), *_strides4(v, varlen), *_strides4(dout, varlen),
                   *_strides4(dq, varlen), *l_strides, stride_slope_b, stride_mask_b, stride_mask_plane, dense_q,
                   dense_k, hq // hkv, scale, scale * LOG2E, float(softcap), left, right),
                  dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **common))
    if varlen:  # tokens outside every sequence: no program wrote their gradients
        fill_outside_sequences(cu_seqlens_q, (dq, 0.0, 0))
        fill_outside_sequences(cu_seqlens_k, (dk, 0.0, 0), (dv, 0.0, 0))
    return dq, dk, dv
