"""FP8 FlashAttention forward for Hopper (sm_90) in Gluon: the numerics of `lowbit_attention` (e4m3 Q, K and V^T
with one fp32 scale per token and head, P scaled by the V scales and 256 / the row's causally safe V-scale maximum
before it is rounded to e4m3; its module docstring has the details) on the pipeline of `gluon_attention`.

One CTA per (128-query tile, sequence x head): a 1-warp producer issues the TMA loads (Q once, then K tiles
`[BLOCK_N, D]` and V^T tiles `[D, BLOCK_N]` into a ring of STAGES slots), two consumer warpgroups own 64 query
rows each and run FP8 wgmmas with both K and V^T K-major in shared memory (what Hopper's FP8 MMA needs), P as the
register A operand, the Q.K^T of tile j in flight with the P.V of tile j - 1, and ping-pong between the two
warpgroups. Per key tile a consumer loads the tile's K and V scales (an interleaved `[Hkv * 2, T]` copy: one
contiguous row each). Varlen layout as `lowbit_flash_forward`: q `[Tq, H, D]`, k `[Tk, Hkv, D]`, vt
`[Hkv, D, Tk_pad]`, `cu_seqlens`; a tile's rows past its sequence read the next sequence (masked) or TMA's zeros.
Causal is aligned bottom-right per sequence. Head dims 64 and 128.
"""

from __future__ import annotations

import math

import torch
import triton

from . import gluon_attention as ga
from .common import nvmma_layout
from .device import compute_major, on_input_device

if ga.HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

__all__ = ["gluon_lowbit_forward", "supported", "HEAD_DIMS", "config"]

HEAD_DIMS = (64, 128)
ROWS = ga.ROWS_PER_WARPGROUP
LOG2E = 1.4426950408889634
P_SCALE = 256.0  # as lowbit_attention.P_SCALE
P_IN_REGS = True  # P' as the register operand of P.V (else through shared memory)


def config(head_dim: int) -> tuple[int, int]:
    """(BLOCK_N, STAGES): 128-key tiles; hd128: 4 stages (16 KB of Q + 4 x 32 KB of K/V^T), hd64 6."""
    return (128, 4) if head_dim == 128 else (128, 6)


if ga.HAS_GLUON:
    _tma_load = ga._tma_load

    @gluon.jit
    def _producer(q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, q_row, q_col,
                  k_row, kv_col, vt_row, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """Q, then K tile j (rows k_row + j * BLOCK_N) and V^T tile j (columns likewise) into ring slot j % STAGES."""
        if n_tiles > 0:
            ga._load_q(q_desc, q_smem, q_ready, q_row, q_col)
        for j in range(0, n_tiles):
            slot = j % STAGES
            mbarrier.wait(kv_empty.index(slot), ((j // STAGES) & 1) ^ 1)  # a fresh barrier: the first lap passes
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            _tma_load(k_desc, [k_row + j * BLOCK_N, kv_col], k_ready.index(slot), k_smem.index(slot))
            mbarrier.expect(v_ready.index(slot), vt_desc.block_type.nbytes)
            _tma_load(vt_desc, [vt_row, k_row + j * BLOCK_N], v_ready.index(slot), v_smem.index(slot))

    @gluon.jit
    def _tile_scales(ks_row, vs_row, key0, k_len, layout: gl.constexpr, BLOCK_N: gl.constexpr,
                     MASKED: gl.constexpr):
        """K and V scales of the keys key0..key0+BLOCK_N-1 (from the sequence's rows of the interleaved copy);
        masked keys get 0."""
        keys = key0 + gl.arange(0, BLOCK_N, layout=layout)
        if MASKED:
            ks = gl.load(ks_row + keys, mask=keys < k_len, other=0.0)
            vs = gl.load(vs_row + keys, mask=keys < k_len, other=0.0)
        else:
            ks = gl.load(ks_row + keys)
            vs = gl.load(vs_row + keys)
        return ks, vs

    @gluon.jit
    def _softmax(s, ks, vs, m_i, l_i, qs, lv, rows, key0, k_len, diag, s_layout: gl.constexpr,
                 BLOCK_N: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr):
        """Raw FP8 scores of one key tile -> (P' = P * 2**lv * v_scale, still fp32; the factor for the running
        output; new max; new sum). The max is taken on s * k_scale, so the row's Q scale, max and V normaliser lv
        fuse into one FMA (as the Triton kernel's `_softmax_pv`)."""
        t = s * gl.expand_dims(ks, 0)
        if MASKED:
            keys = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            visible = gl.expand_dims(keys < k_len, 0)
            if CAUSAL:
                visible = visible & (gl.expand_dims(keys, 0) <= gl.expand_dims(rows + diag, 1))
            t = gl.where(visible, t, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(t, axis=1) * qs)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: no NaN
        else:
            m_new = gl.maximum(m_i, gl.max(t, axis=1) * qs)
            m_safe = m_new
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(t * gl.expand_dims(qs, 1) - gl.expand_dims(m_safe - lv, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p * gl.expand_dims(vs, 0), alpha, m_new, l_i

    @gluon.jit
    def _stage_p(p, p_smem):
        """P' -> e4m3 in this warpgroup's shared tile, visible to its next wgmma. (FP8 P stays out of registers:
        Triton 3.6 cannot tie an 8-bit register operand to its wgmma's wait.)"""
        p_smem.store(p.to(gl.float8e4nv))
        fence_async_shared()
        ga._barrier()

    @gluon.jit
    def _hold(p):
        """A use of the register operand P after its wgmma's wait, so that its registers stay untouched until then
        (Triton 3.6 cannot tie an 8-bit operand to the wait itself)."""
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [p], dtype=gl.float8e4nv, is_pure=False, pack=4)

    @gluon.jit
    def _attend(j, q, k_smem, v_smem, p_smem, p, k_ready, v_ready, kv_empty, turns, o, m_i, l_i, qs, lv, rows,
                ks_row, vs_row, k_len, diag, s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                STAGES: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr, WARPGROUP: gl.constexpr,
                PINGPONG: gl.constexpr, P_IN_REGS: gl.constexpr):
        """Key tile j: S_j = Q.K_j^T and O += P'_{j-1}.V_{j-1} in flight together, the scale loads and the softmax
        of S_j under them; P'_j replaces P'_{j-1} once that wgmma is done."""
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        ga._take_turn(turns, j, WARPGROUP, PINGPONG)
        R: gl.constexpr = q.shape[0]
        s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), gl.zeros([R, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        if P_IN_REGS:
            o = warpgroup_mma(p, v_smem.index(prev).permute((1, 0)), o, is_async=True)
        else:
            o = warpgroup_mma(p_smem, v_smem.index(prev).permute((1, 0)), o, is_async=True)
        ga._pass_turn(turns, WARPGROUP, PINGPONG)
        ks, vs = _tile_scales(ks_row, vs_row, j * BLOCK_N, k_len, gl.SliceLayout(0, s_layout), BLOCK_N, MASKED)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        p_new, alpha, m_i, l_i = _softmax(s, ks, vs, m_i, l_i, qs, lv, rows, j * BLOCK_N, k_len, diag, s_layout,
                                          BLOCK_N, MASKED, CAUSAL)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
        mbarrier.arrive(kv_empty.index(prev), count=1)
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        if P_IN_REGS:
            _hold(p)
            p = gl.convert_layout(p_new.to(gl.float8e4nv), p.type.layout)
        else:
            _stage_p(p_new, p_smem)
        return o, p, m_i, l_i

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, p_smems, q_ready, k_ready, v_ready, kv_empty, turns, qs_ptr, sc_ptr, vmax_ptr,
                  out_ptr, lse_ptr, m0, q_start, q_len, k_start, k_len, h, hk, num_heads, num_kv_heads, t_q, t_s,
                  n_tiles, u1, qk_scale, WARPGROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, P_IN_REGS: gl.constexpr):
        """One warpgroup's 64 rows: the first key tile (masked), tiles 1..u1-1 whole, u1..n_tiles-1 masked.
        P_IN_REGS: P' is the P.V wgmma's register operand, else it goes through shared memory."""
        R: gl.constexpr = q_smem.type.shape[1]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 32])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        q = q_smem.index(WARPGROUP)
        p_smem = p_smems.index(WARPGROUP)
        rows = m0 + WARPGROUP * R + gl.arange(0, R, layout=row_layout)
        row_ok = rows < q_len
        diag = k_len - q_len  # query i sees key j iff j <= i + diag
        # the row's Q scale with softmax_scale * log2(e), and lv = log2(256 / the largest V scale among the keys it
        # sees: a prefix max, so causally safe); the floor keeps 2**lv and the row sum finite for all-zero V
        qs = gl.load(qs_ptr + (q_start + rows) * num_heads + h, mask=row_ok, other=1.0) * qk_scale
        if CAUSAL:
            last = gl.minimum(rows + diag, k_len - 1)
        else:
            last = gl.zeros_like(rows) + (k_len - 1)
        vmax = gl.load(vmax_ptr + (k_start + gl.maximum(last, 0)) * num_kv_heads + hk, mask=row_ok & (last >= 0),
                       other=1.0)
        lv = gl.log2(256.0 / gl.maximum(vmax, 1e-18))
        ks_row = sc_ptr + (2 * hk) * t_s + k_start
        vs_row = ks_row + t_s
        m_i = gl.full([R], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([R], gl.float32, row_layout)
        o = gl.zeros([R, HEAD_DIM], gl.float32, o_layout)
        if n_tiles > 0:
            mbarrier.wait(q_ready, 0)
            mbarrier.wait(k_ready.index(0), 0)
            ga._take_turn(turns, 0, WARPGROUP, PINGPONG)
            s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), gl.zeros([R, BLOCK_N], gl.float32, s_layout),
                              use_acc=False, is_async=True)
            ga._pass_turn(turns, WARPGROUP, PINGPONG)
            ks, vs = _tile_scales(ks_row, vs_row, 0, k_len, gl.SliceLayout(0, s_layout), BLOCK_N, True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            p, alpha, m_i, l_i = _softmax(s, ks, vs, m_i, l_i, qs, lv, rows, 0, k_len, diag, s_layout, BLOCK_N, True,
                                          CAUSAL)
            if P_IN_REGS:
                p = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
            else:
                _stage_p(p, p_smem)
            for j in range(1, u1):  # tiles every row sees whole
                o, p, m_i, l_i = _attend(j, q, k_smem, v_smem, p_smem, p, k_ready, v_ready, kv_empty, turns, o, m_i,
                                         l_i, qs, lv, rows, ks_row, vs_row, k_len, diag, s_layout, o_layout, BLOCK_N,
                                         STAGES, False, CAUSAL, WARPGROUP, PINGPONG, P_IN_REGS)
            for j in range(u1, n_tiles):  # the diagonal and the sequence end
                o, p, m_i, l_i = _attend(j, q, k_smem, v_smem, p_smem, p, k_ready, v_ready, kv_empty, turns, o, m_i,
                                         l_i, qs, lv, rows, ks_row, vs_row, k_len, diag, s_layout, o_layout, BLOCK_N,
                                         STAGES, True, CAUSAL, WARPGROUP, PINGPONG, P_IN_REGS)
            last_slot = (n_tiles - 1) % STAGES
            mbarrier.wait(v_ready.index(last_slot), ((n_tiles - 1) // STAGES) & 1)
            ga._take_turn(turns, n_tiles, WARPGROUP, PINGPONG)
            if P_IN_REGS:
                o = warpgroup_mma(p, v_smem.index(last_slot).permute((1, 0)), o, is_async=True)
            else:
                o = warpgroup_mma(p_smem, v_smem.index(last_slot).permute((1, 0)), o, is_async=True)
            ga._pass_turn(turns, WARPGROUP, PINGPONG)
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
            if P_IN_REGS:
                _hold(p)
            mbarrier.arrive(kv_empty.index(last_slot), count=1)

        # O and l both carry 2**lv; rows with no visible key give 0 and lse -inf
        empty = l_i == 0.0
        inv_l = 1.0 / gl.where(empty, 1.0, l_i)
        o = o * gl.expand_dims(gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout)), 1)
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i)) - lv) * 0.6931471805599453)
        gl.store(lse_ptr + h.to(gl.int64) * t_q + q_start + rows, lse, mask=row_ok)
        o_rows = m0 + WARPGROUP * R + gl.arange(0, R, layout=gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        row_off = ((q_start + o_rows).to(gl.int64) * num_heads + h) * HEAD_DIM
        ptrs = out_ptr + gl.expand_dims(row_off, 1) + gl.expand_dims(cols, 0)
        gl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(o_rows < q_len, 1))

    @gluon.jit
    def _fp8_fwd_kernel(q_desc, k_desc, vt_desc, qs_ptr, sc_ptr, vmax_ptr, out_ptr, lse_ptr, cu_q, cu_k, num_heads,
                        num_kv_heads, t_q, t_s, qk_scale, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                        STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, P_IN_REGS: gl.constexpr):
        """One CTA per (query tile, sequence x head); tiles past their sequence's queries do nothing."""
        TILE_M: gl.constexpr = 2 * q_desc.block_type.shape[0]
        pid_m = gl.program_id(0)
        if CAUSAL:  # the longest rows first, so the short ones fill the tail of the grid
            pid_m = gl.num_programs(0) - 1 - pid_m
        bh = gl.program_id(1)
        b = bh // num_heads
        h = bh % num_heads
        hk = h // (num_heads // num_kv_heads)
        q_start = gl.load(cu_q + b)
        q_len = gl.load(cu_q + b + 1) - q_start
        k_start = gl.load(cu_k + b)
        k_len = gl.load(cu_k + b + 1) - k_start
        m0 = pid_m * TILE_M
        _, n_tiles, _, u1 = ga._key_tiles(m0, k_len, k_len - q_len, 0, TILE_M, BLOCK_N, CAUSAL)
        n_tiles = gl.where(m0 < q_len, n_tiles, 0)
        u1 = gl.minimum(u1, n_tiles)
        q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns = ga._allocate(q_desc, k_desc, vt_desc,
                                                                                          STAGES)
        P_LAYOUT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([q_desc.block_type.shape[0], BLOCK_N],
                                                                      gl.float8e4nv)
        p_smems = gl.allocate_shared_memory(gl.float8e4nv, [2, q_desc.block_type.shape[0], BLOCK_N], P_LAYOUT)
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, p_smems, q_ready, k_ready, v_ready, kv_empty, turns, qs_ptr, sc_ptr,
                         vmax_ptr, out_ptr, lse_ptr, m0, q_start, q_len, k_start, k_len, h, hk, num_heads,
                         num_kv_heads, t_q, t_s, n_tiles, u1, qk_scale, 0, HEAD_DIM, BLOCK_N, STAGES, CAUSAL,
                         PINGPONG, P_IN_REGS)),
            (_consumer, (q_smem, k_smem, v_smem, p_smems, q_ready, k_ready, v_ready, kv_empty, turns, qs_ptr, sc_ptr,
                         vmax_ptr, out_ptr, lse_ptr, m0, q_start, q_len, k_start, k_len, h, hk, num_heads,
                         num_kv_heads, t_q, t_s, n_tiles, u1, qk_scale, 1, HEAD_DIM, BLOCK_N, STAGES, CAUSAL,
                         PINGPONG, P_IN_REGS)),
            (_producer, (q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
                         q_start + m0, h * HEAD_DIM, k_start, hk * HEAD_DIM, hk * HEAD_DIM, n_tiles, BLOCK_N,
                         STAGES)),
        ], [4, 1], ga._REGS)


def supported(q: torch.Tensor, k: torch.Tensor, vt: torch.Tensor, q_scale, p_fp4: bool = False) -> bool:
    """Whether `gluon_lowbit_forward` takes these `lowbit_flash_forward` inputs (e4m3 with scales, no FP4 P, a
    head dim it has, contiguous tensors TMA can address) on this machine."""
    return (ga.HAS_GLUON and q.is_cuda and compute_major(q.device) == 9 and not p_fp4 and q_scale is not None
            and q.dtype == k.dtype == vt.dtype == torch.float8_e4m3fn and q.dim() == 3 and k.dim() == 3
            and q.shape[-1] in HEAD_DIMS and k.shape[-1] == q.shape[-1] and vt.shape[1] == q.shape[-1]
            and q.is_contiguous() and k.is_contiguous() and vt.is_contiguous() and k.shape[1] > 0
            and q.shape[1] % k.shape[1] == 0)


def interleaved_scales(k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """fp32 `[T, Hkv]` K and V scales -> `[Hkv * 2, T_pad]`: rows 2h and 2h + 1 hold KV head h's K and V scales,
    tokens contiguous (T padded to 4)."""
    t, hkv = k_scale.shape
    st = torch.zeros(hkv, 2, triton.cdiv(t, 4) * 4, dtype=torch.float32, device=k_scale.device)
    st[:, 0, :t] = k_scale.t()
    st[:, 1, :t] = v_scale.t()
    return st.view(hkv * 2, -1)


@on_input_device
def gluon_lowbit_forward(q, q_scale, k, k_scale, vt, v_scale, vmax, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         causal=False, softmax_scale=None, out_dtype=torch.bfloat16):
    """`lowbit_flash_forward` for e4m3 inputs on the Gluon pipeline: q `[Tq, H, D]`, k `[Tk, Hkv, D]`, vt
    `[Hkv, D, Tk_pad]` (e4m3), their fp32 `[T, heads]` scales, `vmax` the prefix maximum of v_scale per sequence
    (`lowbit_attention._prefix_max_kernel`), int32 cu_seqlens `[B + 1]`. -> out `[Tq, H, D]` (out_dtype), lse
    `[H, Tq]` (fp32, natural log). `supported` says which inputs it takes."""
    tq, h, d = q.shape
    tk, hkv = k.shape[:2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    out = torch.empty(tq, h, d, dtype=out_dtype, device=q.device)
    lse = torch.empty(h, tq, dtype=torch.float32, device=q.device)
    batch = cu_seqlens_q.numel() - 1
    if tq == 0 or batch == 0:
        return out, lse
    block_n, stages = config(d)
    fp8 = gl.float8e4nv
    q2, k2, vt2 = q.view(tq, h * d), k.view(tk, hkv * d), vt.view(hkv * d, vt.shape[-1])
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [ROWS, d], nvmma_layout((ROWS, d), fp8))
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [block_n, d], nvmma_layout((block_n, d), fp8))
    vt_desc = TensorDescriptor(vt2, list(vt2.shape), list(vt2.stride()), [d, block_n],
                               nvmma_layout((d, block_n), fp8))
    scales = interleaved_scales(k_scale, v_scale)
    grid = (triton.cdiv(max(int(max_seqlen_q), 1), ga.BLOCK_M), batch * h)
    _fp8_fwd_kernel[grid](q_desc, k_desc, vt_desc, q_scale, scales, vmax, out, lse, cu_seqlens_q, cu_seqlens_k, h, hkv,
                          tq, scales.shape[1], scale * LOG2E, HEAD_DIM=d, BLOCK_N=block_n, STAGES=stages,
                          CAUSAL=bool(causal), PINGPONG=True, P_IN_REGS=P_IN_REGS, num_warps=4, maxnreg=ga.MAXNREG)
    return out, lse
