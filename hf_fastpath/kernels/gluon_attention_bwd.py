"""FlashAttention backward for Hopper (sm_90) in Gluon, FlashAttention-3 style (issue 20).

Status (H200, session 15, benchmarks/results/gluon_attention_backward.json): passes the GPU tests against float64
(tests/gpu/test_gluon_attention_bwd_gpu.py); 1.00-1.18x our Triton backward except hd64 causal 1k-8k (0.88-0.98x),
and 0.79-0.91x cuDNN's, so plain training runs cuDNN through SDPA. Session 17: padding masks and packed sequences
(tests/gpu/test_gluon_attention_masks_gpu.py; gluon_attention_masked.json: Gluon fwd+bwd 1.24-1.42x our Triton
kernels at hd128), which `fastpath` dispatches to it. Session 18: sliding windows (the interval of each key's visible
queries shrinks) and soft-caps (tanh recomputed from S^T; 1 - tanh^2 waits in the dS^T tile of shared memory, as
registers spilled), gluon_attention_window.json: hd128 fwd+bwd 1.25-1.31x Triton with a 4096 window, 1.40-1.64x
with a soft-cap. Session 21: ALiBi. Session 22: `deterministic=True` (dQ tiles added in a fixed order, turn counters;
gluon_attention_deterministic.json: 0.55-0.96x the default, so it beats the Triton backward only with a soft-cap).
Session 24: hd256 (gluon_attention_backward_hd256.json: 1.11-1.30x our Triton backward, 0.99-1.09x FA2, 0.64-0.77x
cuDNN; windowed / soft-capped fwd+bwd 1.18-1.48x Triton), no deterministic mode there. Session 38: varlen with
queries and keys packed differently (`_fwd.varlen_spans`: each key's visible queries as packed-segment bounds).

- preprocess: the plain-Triton `flash_attention._bwd_preprocess` (delta = rowsum(dO * O) in fp32, lse -> log2
  domain with -inf -> +inf so that rows with no visible key get P = 0);
- per CTA 128 keys of one (batch, kv-head), K and V loaded once by TMA; the CTA loops over the query heads of its
  GQA group and, per head, over the 64-row query tiles that see its keys (causal: from the tile holding query
  n0 - (Sk - Sq), bottom-right aligned). Warp-specialized: two consumer warpgroups (64 keys each, 240 registers
  by setmaxnreg) and a loader / dQ-reducer warpgroup (24 registers) that issues the TMA loads of Q_i / dO_i into
  a ring and adds each iteration's dQ_i tile into a zeroed fp32 [B, Sq, Hq, D] buffer (relaxed 16-byte atomics),
  which one torch op scales by softmax_scale and casts at the end. Per tile, each consumer:
    S^T  = K . Q_i^T                     wgmma (Q from shared memory; K too at hd128, from registers at hd64),
                                         its accumulator started at -lse2 / (scale * log2e); waited
    P^T  = exp2(S^T * scale * log2e), masked (causal, key >= Sk, query >= Sq) to 0, kept in 16 bits
    dP^T = V . dO_i^T - delta_i          | issued together, dP^T first (accumulator started at -delta_i; V as K);
    dV  += P^T . dO_i                    | dS^T is computed while dV runs (P^T the register A operand)
    dS^T = P^T * (dP^T - delta_i)        (P^T read back from its 16-bit copy, as the dV operand sees it)
    dK  += dS^T . Q_i                    (dS^T the register A operand), and dS^T -> shared memory
  then, both consumers' dS^T in shared memory (mbarrier ds_ready, dS^T double-buffered), dQ_i^T = K^T . dS^T over
  all 128 keys: at hd128 each consumer computes half the head dim, at hd64 the consumer of the iteration's parity
  all of it (FA3's split: the reducer adds one tile, no partial sums), stored untransposed (16-byte reducer reads).
  hd256: dK and dV of 128 keys at 256 columns would take 256 registers a thread, so a CTA takes 64 keys and each
  consumer half the head dim of dK, dV and dQ_i. Both compute all of S^T and dP^T (40% more MMA work, but no
  hand-over: the warpgroups stay out of step), keep their own dS^T, and add their dQ_i columns from the accumulator
  (8-byte atomics): shared memory has no room for fp32 dQ tiles beside 256-wide K, V and two Q / dO slots.
  lse2 / delta of the next tile are loaded one iteration ahead, one register each (a compact layout), and spread
  over S^T's columns only when used: with the two accumulator folds this is what made 64-row tiles fit hd128.
  Masking is branch-free; queries past Sq get lse2 = +inf and delta 0, so rows of the next sequence that a TMA box
  may read contribute nothing. With a key mask or packed segments each key's visible queries are one interval
  (`_visible_span`: one unsigned compare per element, two registers a key), and packed CTAs visit only the query
  tiles of their keys' segments. dK / dV are written once per CTA.
dQ is added in arrival order by default (bits differ run to run, as FA3's default); `deterministic=True` orders the
adds per query tile (`_dq_turn`). dQ offsets are 32-bit per (batch, head): Sq * Hq * D < 2**31.
Offline builds (tests/gluon_bwd_builds.py): no spills under Triton 3.6 (3.9's ptxas: 12 bytes of loop scalars at
hd128), wgmmas not serialized. Where the time goes (ncu) and what was tried: docs/attention.md.
"""


from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton

from . import gluon_attention as _fwd
from .device import on_input_device
from .gluon_attention import HAS_GLUON, LOG2E
from .launch import launch_cached

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from .gluon_attention import _barrier, _load_tile, _tile_shape

__all__ = ["gluon_attention_backward", "supported", "HEAD_DIMS", "VARIANTS", "DEFAULT_VARIANTS",
           "Launch", "launch", "block_n", "deterministic_supported"]

HEAD_DIMS = (64, 128, 256)
MAXNREG = 168  # 3 warpgroups x 128 threads x 168 <= 64K registers, then moved by setmaxnreg
WS_REGS = (240, 24)  # setmaxnreg of the second consumer and the loader / reducer; the first gets 3 * 168 - 264 = 240


class Launch(NamedTuple):
    """One variant: query rows per tile and Q / dO ring slots, each by head dim."""
    block_m: dict
    stages: dict
    kv_in_registers: tuple = ()  # head dims at which each consumer holds its K and V as register A operands


# H200, session 15 (gluon_attention_backward.json and docs/attention.md): the dQ hand-over untransposed (16-byte
# reducer reads), dQ_i split by head dim between the two consumers (one tile for the reducer, not two partial sums),
# 64-row query tiles at hd128 (registers freed by folding lse2 and delta into the wgmma accumulators and keeping the
# prefetched lse2 / delta one register each) and at hd64 K / V as register operands (+2-7%): 1.16-1.35x session
# 14's best. Gone, measured slower: "atomic" (no warp specialization, dQ atomics from the compute warps), "ws"
# (32-row tiles, partial dQ^T summed by the reducer), a 2- or 4-slot ring at hd64 (within 2% of 3 slots). The table
# stays for the next experiments. Session 27: "own_dq" (each consumer adds dQ_i = dS . K over its own 64 keys from
# its accumulator at hd64 / hd128, as hd256 does: no ds_ready lockstep, no reducer, a third Q / dO slot at hd128)
# ran at 0.62-0.76x "split" (docs/attention.md; removed, commit 4ec7344 has it). Session 32: 128-row query tiles at
# hd64 (two Q / dO slots, K / V from shared memory; as register operands they spilled 1.3 KB): +0-2% full, -1 to -5%
# causal (`archive/gluon_attention_backward_m128_s32.json`).
VARIANTS = {"split": Launch({64: 64, 128: 64, 256: 64}, {64: 3, 128: 2, 256: 2}, (64, ))}
DEFAULT_VARIANTS = {64: "split", 128: "split", 256: "split"}


def block_n(head_dim: int) -> int:
    """Keys per CTA: two consumer warpgroups of 64 (a wgmma's M) up to hd128; at hd256 both take the same 64 keys
    and half the head dim each, as dK and dV of 64 keys at all 256 columns would take 256 registers a thread."""
    return 64 if head_dim > 128 else 128


def launch(variant: str) -> Launch:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}; got {variant!r}")
    return VARIANTS[variant]


def deterministic_supported(head_dim: int) -> bool:
    """Whether `deterministic=True` runs at this head dim: up to hd128, where the reducer adds dQ (at hd256 both
    consumers add their dQ_i columns themselves, in arrival order)."""
    tile = _fwd.tile_dim(head_dim, HEAD_DIMS)
    return tile is not None and tile <= 128


def shared_bytes(head_dim: int, variant: str) -> int:
    """16-bit tiles of one CTA (K, V, the Q/dO ring, two dS^T tiles of all its keys) and, up to hd128, two fp32 dQ
    tiles for the reducer, plus 1 KB for barriers and layout conversions."""
    cfg = launch(variant)
    block_m = cfg.block_m[head_dim]
    bn = block_n(head_dim)
    tiles = 2 * (2 * bn * head_dim + 2 * cfg.stages[head_dim] * block_m * head_dim + 2 * bn * block_m)
    return tiles + (2 * 4 * block_m * head_dim if head_dim <= 128 else 0) + 1024


if HAS_GLUON:
    _WS_REGS = gl.constexpr(list(WS_REGS))
    _TURN_POLLS = gl.constexpr(1 << 24)  # ~10 s of polling: far past any wait of a correct order

    @gluon.jit
    def _load_qdo(q_desc, do_desc, q_smem, do_smem, ready, slot, b, h, m0, q_row_b, q_row_h, q_col_h,
                  do_row_b, do_row_h, do_col_h):
        """TMA loads of Q and dO rows m0.. of query head h into ring slot `slot`."""
        mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        _load_tile(q_desc, b * q_row_b + h * q_row_h + m0, h * q_col_h, ready.index(slot), q_smem.index(slot))
        _load_tile(do_desc, b * do_row_b + h * do_row_h + m0, h * do_col_h, ready.index(slot), do_smem.index(slot))

    @gluon.jit
    def _row_stats(lse2_ptr, delta_ptr, b, h, m0, seq_q, num_heads, valid, BLOCK_M: gl.constexpr,
                   layout: gl.constexpr):
        """lse2 and delta of query rows m0.. of head h (rows past Sq, or all when not `valid`: lse2 +inf, delta 0,
        so that their P is 0)."""
        rows = m0 + gl.arange(0, BLOCK_M, layout=layout)
        ok = (rows < seq_q) & valid
        off = (b * num_heads + h).to(gl.int64) * seq_q + rows
        return gl.load(lse2_ptr + off, mask=ok, other=float("inf")), gl.load(delta_ptr + off, mask=ok, other=0.0)

    @gluon.jit
    def _key_block(seq_q, seq_k, num_kv_heads, group, km_ptr, km_b, km_plane, diag, diag_lo, BLOCK_N: gl.constexpr,
                   BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, MASK_MODE: gl.constexpr, WINDOW: gl.constexpr,
                   LAST_FIRST: gl.constexpr = False):
        """This CTA's work: keys n0.. of (batch b, kv-head hk), the query heads h0.. of its GQA group, and per head
        the query tiles m_start..m_end-1 that see those keys -> (b, hk, h0, n0, m_start, m_end, iterations).
        Query i sees keys up to i + diag (CAUSAL) and from i + diag_lo (WINDOW) on. Packed segments (MASK_MODE 2,
        Sq == Sk): only the queries of the keys' segments, from the segment start of the first key to the segment
        end of the last (a segment's tokens are contiguous). LAST_FIRST: the last key block gets the first program
        id, so it is launched first."""
        bh = gl.program_id(1)
        b = bh // num_kv_heads
        hk = bh % num_kv_heads
        if LAST_FIRST:
            n0 = (gl.num_programs(0) - 1 - gl.program_id(0)) * BLOCK_N
        else:
            n0 = gl.program_id(0) * BLOCK_N
        if CAUSAL:  # the first query that sees key n0 is n0 - diag (bottom-right aligned)
            m_start = gl.maximum(n0 - diag, 0) // BLOCK_M
        else:
            m_start = 0
        m_end = gl.cdiv(seq_q, BLOCK_M)
        if WINDOW:  # the last query that sees the last key is that key - diag_lo
            m_end = gl.minimum(m_end, gl.cdiv(gl.maximum(gl.minimum(n0 + BLOCK_N, seq_k) - diag_lo, 0), BLOCK_M))
        if MASK_MODE == 2:
            seg = km_ptr + b * km_b
            m_start = gl.maximum(m_start, gl.load(seg + km_plane + n0) // BLOCK_M)
            k_last = gl.minimum(n0 + BLOCK_N, seq_k) - 1
            m_end = gl.minimum(m_end, gl.cdiv(gl.load(seg + 2 * km_plane + k_last), BLOCK_M))
        return b, hk, hk * group, n0, m_start, m_end, gl.maximum(m_end - m_start, 0) * group

    @gluon.jit
    def _alibi_bias(rows, keys, m0, alibi_diag, alibi_coef, ALIBI: gl.constexpr):
        """ALiBi's bias [keys, queries] in the units of S^T: -alibi_coef * |query + alibi_diag - key|; with ALIBI 2
        (no visible key right of the diagonal) split as -coef * (query - m0) + coef * (key - m0 - alibi_diag)."""
        if ALIBI == 2:
            return gl.expand_dims(-alibi_coef * (rows - m0).to(gl.float32), 0) \
                + gl.expand_dims((keys - (m0 + alibi_diag)).to(gl.float32) * alibi_coef, 1)
        else:
            return -alibi_coef * gl.abs(gl.expand_dims((rows + alibi_diag).to(gl.float32), 0)
                                        - gl.expand_dims(keys.to(gl.float32), 1))

    @gluon.jit
    def _alibi_coef(slopes_ptr, slopes_b, b, h, qk_scale, ALIBI: gl.constexpr):
        """Head h's ALiBi slope in the units of S^T (which P^T multiplies by qk_scale in log2); 0 without ALIBI."""
        if ALIBI != 0:
            return gl.load(slopes_ptr + b * slopes_b + h) * (1.4426950408889634 / qk_scale)
        else:
            return 0.0

    @gluon.jit
    def _next_tile(h, mt, m_start, m_end):
        """(query head, query tile) of the iteration after (h, mt): a head's tiles m_start..m_end-1 in order, then
        the next head of the GQA group (no integer division)."""
        last = (mt + 1 == m_end).to(gl.int32)
        return h + last, (mt + 1) * (1 - last) + m_start * last

    @gluon.jit
    def _dq_turn(n, mt, b, seq_q, seq_k, km_ptr, km_b, km_plane, diag, diag_lo, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, MASK_MODE: gl.constexpr, WINDOW: gl.constexpr):
        """Key block n's turn to add its dQ tile into query tile mt (DETERMINISTIC). `_key_block`'s m_start and
        m_end never decrease with n, so the key blocks that visit tile mt are one interval lo..hi: causal turns run
        from hi down (block hi meets tile mt first, so a CTA rarely waits; `_key_block` launches the last blocks
        first), others from lo up. A block only ever waits for blocks launched before it: no deadlock."""
        r0 = mt * BLOCK_M
        lo = 0
        hi = gl.cdiv(seq_k, BLOCK_N) - 1
        if CAUSAL:  # m_start(n) <= mt: n * BLOCK_N < r0 + BLOCK_M + diag
            hi = gl.minimum(hi, gl.cdiv(gl.maximum(r0 + BLOCK_M + diag, 0), BLOCK_N) - 1)
        if WINDOW:  # m_end(n) > mt: n * BLOCK_N + BLOCK_N > r0 + diag_lo
            lo = gl.maximum(lo, gl.maximum(r0 + diag_lo, 0) // BLOCK_N)
        if MASK_MODE == 2:  # the blocks that hold a key of a segment of rows r0..: its first key's segment start ..
            seg = km_ptr + b * km_b
            lo = gl.maximum(lo, gl.load(seg + km_plane + r0) // BLOCK_N)
            # .. up to the segment end of the tile's last row (later keys' segments start past the tile)
            hi = gl.minimum(hi, (gl.load(seg + 2 * km_plane + gl.minimum(r0 + BLOCK_M, seq_q) - 1) - 1) // BLOCK_N)
        if CAUSAL:
            return hi - n
        else:
            return n - lo

    @gluon.jit
    def _wait_turn(turn_ptr, turn):
        """Spins until the counter at turn_ptr reaches `turn` (every thread polls), then reads it once more with
        acquire semantics, each thread for itself (synchronizing with the release that handed the turn on). Not a
        fence: `fence.acq_rel.gpu` would wait for this warpgroup's last tile of atomics to land, which cost the mode
        a third of its speed (session 23: 0.58-0.68x the default mode with it, 0.86-0.93x without). Bounded
        (~seconds) so that a turn that never comes, a bug, costs time instead of a hang."""
        polls = 0
        while (gl.load(turn_ptr, volatile=True) != turn) & (polls < _TURN_POLLS):
            polls += 1
        lanes = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0]))
        gl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [turn_ptr + lanes * 0],
                                  dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _pass_turn(turn_ptr):
        """Hands the turn on: once every thread's dQ adds are issued (the barrier), one thread's release increment
        (cumulative: it publishes what the barrier ordered before it)."""
        _barrier()
        lanes = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0]))
        gl.atomic_add(turn_ptr + lanes * 0, gl.full_like(lanes, 1), mask=lanes == 0, sem="release", scope="gpu")

    @gluon.jit
    def _visible_span(km_keys, km_plane, keys, seq_q, seq_k, diag, diag_lo, CAUSAL: gl.constexpr,
                      MASK_MODE: gl.constexpr, WINDOW: gl.constexpr):
        """The queries that see each key, as (base, span): queries base..base+span-1, span 0 for none. Causality,
        a window, the sequence ends and the mask in two registers a key: causal base = key - diag, else 0; the end
        Sq, with a window key - diag_lo + 1 at most; key mask (MASK_MODE 1, km_keys its entries): span 0 for a
        padding key; packed (2, km_keys the keys' columns of the segment table): within the key's segment."""
        real = keys < seq_k
        if CAUSAL:
            base = keys - diag
        else:
            base = gl.zeros_like(keys)
        end = gl.full_like(keys, seq_q)
        if MASK_MODE == 1:
            real = real & (gl.load(km_keys, mask=real, other=0) > 0)
        if MASK_MODE == 2:
            base = gl.maximum(base, gl.load(km_keys + km_plane, mask=real, other=0))
            end = gl.load(km_keys + 2 * km_plane, mask=real, other=0)
        if WINDOW:
            end = gl.minimum(end, keys - diag_lo + 1)
        return base, gl.where(real, gl.maximum(end - base, 0), 0)

    @gluon.jit
    def _dkdv_step(k_tile, v_tile, q_tile, do_tile, q_dk, do_dv, ds_smem, dk, dv, lse2, delta, keys, key_ok, key_base,
                   key_span, m0, seq_q, diag, qk_scale, cap_scale, st_layout: gl.constexpr, CAUSAL: gl.constexpr,
                   SPANS: gl.constexpr, SOFTCAP: gl.constexpr, alibi_diag=0, alibi_coef=0.0,
                   ALIBI: gl.constexpr = 0):
        """One query tile (rows m0..) against one warpgroup's 64 keys: dV += P^T.dO, dK += dS^T.Q (unscaled), and dS^T
        left in ds_smem for the dQ wgmma (fenced, the warpgroup synced). q_dk / do_dv: the B operands of dK's and dV's
        wgmmas, the tiles' columns of this warpgroup's dK / dV (all of q_tile / do_tile but at hd256). Returns (dk, dv),
        retired. Visible: key_ok [keys, 1] (keys < Sk), causality and rows < Sq; with SPANS (a mask or a window) the
        queries key_base..key_base+key_span-1 of each key instead (`_visible_span`). SOFTCAP: scores softcap * tanh(s *
        cap_scale) with qk_scale = softcap * log2(e); dS^T gains the factor 1 - tanh^2. ALiBi (`_fwd.alibi_mode`):
        scores - alibi_coef * |query + alibi_diag - key| in the units of S^T (after the cap), in the accumulator's
        start; with ALIBI 2 (no visible key right of the diagonal) a per-key plus a per-query vector, as -lse2 is (no
        work an element beyond what the start costs anyway)."""
        dtype: gl.constexpr = q_tile.dtype
        col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)
        KEYS: gl.constexpr = ds_smem.type.shape[0]
        QUERIES: gl.constexpr = ds_smem.type.shape[1]
        st_zero = gl.zeros([KEYS, QUERIES], gl.float32, st_layout)
        if SOFTCAP:  # the cap comes before lse2 is subtracted: no fold
            st = warpgroup_mma(k_tile, q_tile.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            st = warpgroup_mma_wait(num_outstanding=0, deps=(st, ))
            st = _fwd._tanh(st * cap_scale)
            # 1 - tanh^2 waits for dP^T in this warpgroup's dS^T tile (free until dS^T): in registers, even in 16
            # bits, hd128 spilled 520+ bytes (ptxas 3.6). Each thread reads back its own elements: no barrier
            ds_smem.store((1.0 - st * st).to(dtype))
            lse2 = gl.convert_layout(lse2, col_layout)  # from the compact layout, only now: fewer live registers
            st = st - gl.expand_dims(lse2 * (1.0 / qk_scale), 0)
            if ALIBI != 0:
                st = st + _alibi_bias(m0 + gl.arange(0, QUERIES, layout=col_layout), keys, m0, alibi_diag, alibi_coef,
                                      ALIBI)
        else:
            lse2 = gl.convert_layout(lse2, col_layout)
            # the accumulator starts at -lse2 / qk_scale (rows with no visible key: -inf): P^T = exp2(acc * qk_scale)
            if ALIBI == 2:  # per query and per key: one add an element, as the plain start costs
                queries = gl.arange(0, QUERIES, layout=col_layout)  # query - m0
                start = gl.expand_dims(lse2 * (-1.0 / qk_scale) - alibi_coef * queries.to(gl.float32), 0) \
                    + gl.expand_dims((keys - (m0 + alibi_diag)).to(gl.float32) * alibi_coef, 1)
            else:
                start = st_zero - gl.expand_dims(lse2 * (1.0 / qk_scale), 0)
                if ALIBI == 1:
                    start = start + _alibi_bias(m0 + gl.arange(0, QUERIES, layout=col_layout), keys, m0, alibi_diag,
                                                alibi_coef, ALIBI)
            st = warpgroup_mma(k_tile, q_tile.permute((1, 0)), start, is_async=True)
            st = warpgroup_mma_wait(num_outstanding=0, deps=(st, ))
        rows = m0 + gl.arange(0, QUERIES, layout=col_layout)
        if SPANS:  # one unsigned compare: rows below key_base wrap around to large values
            visible = (gl.expand_dims(rows, 0) - gl.expand_dims(key_base, 1)).to(gl.uint32, bitcast=True) \
                < gl.expand_dims(key_span, 1).to(gl.uint32, bitcast=True)
        else:
            visible = key_ok & gl.expand_dims(rows < seq_q, 0)
            if CAUSAL:
                visible = visible & (gl.expand_dims(keys, 1) <= gl.expand_dims(rows + diag, 0))
        pt = gl.exp2(st * qk_scale)
        pt16 = gl.convert_layout(gl.where(visible, pt, 0.0).to(dtype), a_layout)
        # dP^T is issued first so that it retires first: dS^T is computed while dV's wgmma runs. S^T and dP^T are
        # never live together, P^T stays only in 16 bits, and dP^T's accumulator starts at -delta, so that
        # dP^T - delta comes out of the wgmma and delta is not live at the register peak
        dpt = warpgroup_mma(v_tile, do_tile.permute((1, 0)),
                            st_zero - gl.expand_dims(gl.convert_layout(delta, col_layout), 0), is_async=True)
        dv = warpgroup_mma(pt16, do_dv, dv, is_async=True)
        dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt, ))
        dst = gl.convert_layout(pt16, st_layout).to(gl.float32) * dpt
        if SOFTCAP:
            dst = dst * ds_smem.load(st_layout).to(gl.float32)
        dst16 = dst.to(dtype)
        ds_smem.store(dst16)
        dst16 = gl.convert_layout(dst16, a_layout)
        dk = warpgroup_mma(dst16, q_dk, dk, is_async=True)
        fence_async_shared()
        _barrier()  # dS^T of every warp is in shared memory before the dQ wgmma reads it
        # retire dV / dK (and free P^T, dS^T) before dQ's accumulator goes live: fewer registers at the peak
        dv, dk, pt16, dst16 = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, pt16, dst16))
        return dk, dv

    @gluon.jit
    def _store_dkdv(dk, dv, dk_ptr, dv_ptr, b, hk, key0, seq_k, num_kv_heads, sm_scale, COL0: gl.constexpr,
                    DIM: gl.constexpr):
        """dK (scaled by softmax_scale) and dV of keys key0.. and head-dim columns COL0.. into [B, Sk, Hkv, DIM], rows
        past Sk and columns past DIM (a padded head dim) masked."""
        ROWS: gl.constexpr = dk.type.shape[0]
        COLS: gl.constexpr = dk.type.shape[1]
        layout: gl.constexpr = dk.type.layout
        d_cols = COL0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        k_rows = key0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        kv_off = ((b * seq_k + k_rows).to(gl.int64) * num_kv_heads + hk) * DIM
        kv_mask = gl.expand_dims(k_rows < seq_k, 1)
        if COL0 + COLS > DIM:
            kv_mask = kv_mask & gl.expand_dims(d_cols < DIM, 0)
        kv_ptrs = gl.expand_dims(kv_off, 1) + gl.expand_dims(d_cols, 0)
        gl.store(dk_ptr + kv_ptrs, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
        gl.store(dv_ptr + kv_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)

    @gluon.jit
    def _add_dq(dq, dq_ptr, b, h, m0, seq_q, num_heads, COL0: gl.constexpr, DIM: gl.constexpr):
        """Adds dQ_i [queries m0.., head-dim columns COL0..] into the fp32 [B, Sq, Hq, DIM] buffer from the
        accumulator (relaxed atomics, two consecutive columns a vector), rows past Sq and columns past DIM masked."""
        ROWS: gl.constexpr = dq.type.shape[0]
        COLS: gl.constexpr = dq.type.shape[1]
        layout: gl.constexpr = dq.type.layout
        rows = m0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = COL0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        base = dq_ptr + (b.to(gl.int64) * seq_q * num_heads + h) * DIM
        offs = gl.expand_dims(rows * (num_heads * DIM), 1) + gl.expand_dims(cols, 0)  # int32 from (batch, head)'s base
        mask = gl.expand_dims(rows < seq_q, 1)
        if COL0 + COLS > DIM:
            mask = mask & gl.expand_dims(cols < DIM, 0)
        gl.atomic_add(base + offs, dq, mask=mask, sem="relaxed")

    @gluon.jit
    def _dq_piece(kT, ds_all, dq_tile, c: gl.constexpr, layout: gl.constexpr, BLOCK_M: gl.constexpr):
        """Rows c*64.. of dQ_i^T = K^T . dS^T over all of the CTA's keys, stored untransposed into dq_tile [BLOCK_M,
        D] (query rows, head dim contiguous: the reducer reads 16-byte vectors)."""
        acc = gl.zeros([64, BLOCK_M], gl.float32, layout)  # made here: not live across the loop
        dqt = warpgroup_mma(kT.slice(c * 64, 64, dim=0), ds_all, acc, use_acc=False, is_async=True)
        dqt = warpgroup_mma_wait(num_outstanding=0, deps=(dqt, ))
        dq_tile.slice(c * 64, 64, dim=1).permute((1, 0)).store(dqt)

    @gluon.jit
    def _consumer(k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_ready, ready, empty, ds_ready, dq_full,
                  dq_empty, lse2_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, km_ptr, km_b, km_plane, b, hk, h0, n0, m_start,
                  m_end, n_iters, seq_q, seq_k, num_heads, num_kv_heads, qk_scale, sm_scale, diag, diag_lo, cap_scale,
                  slopes_ptr, slopes_b, alibi_diag, WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                  CAUSAL: gl.constexpr, STAGES: gl.constexpr, KV_REGS: gl.constexpr, MASK_MODE: gl.constexpr,
                  WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, DIM: gl.constexpr):
        """One warpgroup's 64 keys (n0 + 64 WG ...): dK and dV in registers over all iterations. Per iteration, once
        both warpgroups' dS^T are in shared memory, its share of dQ_i goes to shared memory for the reducer (FA3's
        split: hd128, half of dQ_i's head dim over all 128 keys each; hd64, all of dQ_i by the warpgroup of the
        iteration's parity), so that no partial sums need adding and no compute warp waits on an atomic.
        hd256 (SPLIT): both warpgroups take the CTA's 64 keys, and warpgroup WG columns 128 WG.. of dK, dV and dQ_i.
        Each computes all of S^T and dP^T (40% more MMA work than needed, for no hand-over between the warpgroups:
        they run out of step, one's softmax under the other's wgmmas) and adds its dQ_i columns from its registers,
        as the shared memory holds no fp32 dQ tile beside K, V and two Q / dO slots."""
        ROWS: gl.constexpr = 64
        SPLIT: gl.constexpr = HEAD_DIM > 128
        COLS: gl.constexpr = HEAD_DIM // 2 if SPLIT else HEAD_DIM  # of dK, dV (and dQ_i at hd256)
        COL0: gl.constexpr = WG * COLS if SPLIT else 0
        KEY0: gl.constexpr = 0 if SPLIT else WG * ROWS
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BLOCK_M, 16])  # S^T, dP^T, dQ^T
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, COLS, 16])  # dK, dV (dQ_i at hd256)
        key_layout: gl.constexpr = gl.SliceLayout(1, st_layout)  # along keys
        # lse2 / delta (this and the next iteration's) wait in a compact layout: a register each instead of
        # BLOCK_M / 4; `_dkdv_step` spreads them over S^T's columns only when it needs them
        row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        k_w = k_smem.index(0).slice(KEY0, ROWS, dim=0)
        v_w = v_smem.index(0).slice(KEY0, ROWS, dim=0)
        keys = n0 + KEY0 + gl.arange(0, ROWS, layout=key_layout)
        key_ok = gl.expand_dims(keys < seq_k, 1)
        SPANS: gl.constexpr = MASK_MODE != 0 or WINDOW
        if SPANS:  # each key's visible queries as one interval base..base+span-1 (see `_visible_span`)
            if MASK_MODE:
                km_keys = km_ptr + b * km_b + keys
            else:
                km_keys = None
            key_base, key_span = _visible_span(km_keys, km_plane, keys, seq_q, seq_k, diag, diag_lo, CAUSAL,
                                               MASK_MODE, WINDOW)
        else:
            key_base = None
            key_span = None
        dk = gl.zeros([ROWS, COLS], gl.float32, kv_layout)
        dv = gl.zeros([ROWS, COLS], gl.float32, kv_layout)
        h = h0
        mt = m_start
        lse2, delta = _row_stats(lse2_ptr, delta_ptr, b, h, mt * BLOCK_M, seq_q, num_heads, n_iters > 0, BLOCK_M,
                                 row_layout)
        alibi_coef = _alibi_coef(slopes_ptr, slopes_b, b, h, qk_scale, ALIBI)
        mbarrier.wait(kv_ready, 0)
        if KV_REGS:  # S^T and dP^T take K and V from registers: 2 x 16 KB less shared-memory traffic an iteration
            kv_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=st_layout, k_width=2)
            k_op = k_w.load(kv_op_layout)
            v_op = v_w.load(kv_op_layout)
        else:
            k_op = k_w
            v_op = v_w
        for it in range(0, n_iters):
            # dS^T slot it % 2 was last read by iteration it - 2's wgmmas: every warp of this warpgroup is past them
            # (they met at iteration it - 1's barrier in `_dkdv_step`), the other warpgroup too (ds_ready, it - 1)
            h_next, mt_next = _next_tile(h, mt, m_start, m_end)
            lse2_next, delta_next = _row_stats(lse2_ptr, delta_ptr, b, h_next, mt_next * BLOCK_M, seq_q, num_heads,
                                               it + 1 < n_iters, BLOCK_M, row_layout)
            alibi_next = _alibi_coef(slopes_ptr, slopes_b, b, gl.minimum(h_next, num_heads - 1), qk_scale, ALIBI)
            slot = it % STAGES
            q_tile = q_smem.index(slot)
            do_tile = do_smem.index(slot)
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            if SPLIT:  # this warpgroup's own dS^T, and its columns of Q_i / dO_i for dK / dV
                # K and V through a loop-variant index that is always 0 (it >> 30): their wgmma descriptors (16
                # k-steps each) are then rebuilt each iteration; hoisted out of the loop, they spilled
                k_op = k_smem.index(it >> 30)
                v_op = v_smem.index(it >> 30)
                ds_w = ds_smem.index(WG)
                q_dk = q_tile.slice(COL0, COLS, dim=1)
                do_dv = do_tile.slice(COL0, COLS, dim=1)
            else:
                ds_all = ds_smem.index(it % 2)  # [keys of both warpgroups, queries]: the other warpgroup reads it too
                ds_w = ds_all.slice(WG * ROWS, ROWS, dim=0)
                q_dk = q_tile
                do_dv = do_tile
            dk, dv = _dkdv_step(k_op, v_op, q_tile, do_tile, q_dk, do_dv, ds_w, dk, dv, lse2, delta, keys, key_ok,
                                key_base, key_span, mt * BLOCK_M, seq_q, diag, qk_scale, cap_scale, st_layout, CAUSAL,
                                SPANS, SOFTCAP, alibi_diag, alibi_coef, ALIBI)
            mbarrier.arrive(empty.index(slot), count=1)  # Q_i / dO_i are no longer read: the slot may refill
            if SPLIT:  # dQ_i [queries, columns COL0..] = dS . K over the 64 keys, added from the accumulator
                dq = warpgroup_mma(ds_w.permute((1, 0)), k_op.slice(COL0, COLS, dim=1),
                                   gl.zeros([BLOCK_M, COLS], gl.float32, kv_layout), use_acc=False, is_async=True)
                dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
                _barrier()  # every warp's share of that wgmma has read dS^T before the next iteration rewrites it
                _add_dq(dq, dq_ptr, b, h, mt * BLOCK_M, seq_q, num_heads, COL0, DIM)
            else:
                _share_dq(k_smem, ds_all, dq_smem, ds_ready, dq_full, dq_empty, it, st_layout, WG, HEAD_DIM,
                          BLOCK_M)
            lse2 = lse2_next
            delta = delta_next
            alibi_coef = alibi_next
            h = h_next
            mt = mt_next

        _store_dkdv(dk, dv, dk_ptr, dv_ptr, b, hk, n0 + KEY0, seq_k, num_kv_heads, sm_scale, COL0, DIM)

    @gluon.jit
    def _share_dq(k_smem, ds_all, dq_smem, ds_ready, dq_full, dq_empty, it, st_layout: gl.constexpr,
                  WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
        """Up to hd128: once both warpgroups' dS^T of iteration `it` are in shared memory, this warpgroup's share of
        dQ_i into the reducer's slot (`_consumer`)."""
        dslot = it % 2
        # both dS^T are in (each fenced). Slot it % 2 of dS^T is next written in iteration it + 2, after this
        # barrier's next phase, which the other warpgroup completes only past this iteration's dQ wgmma
        mbarrier.arrive(ds_ready, count=1)
        mbarrier.wait(ds_ready, it & 1)
        # into shared memory once the reducer has taken what this slot held two iterations ago
        mbarrier.wait(dq_empty.index(dslot), ((it // 2) & 1) ^ 1)
        kT = k_smem.index(0).permute((1, 0))
        if HEAD_DIM == 128:
            _dq_piece(kT, ds_all, dq_smem.index(dslot), WG, st_layout, BLOCK_M)
        elif it % 2 == WG:
            _dq_piece(kT, ds_all, dq_smem.index(dslot), 0, st_layout, BLOCK_M)
        mbarrier.arrive(dq_full.index(dslot), count=1)  # (Gluon syncs the warpgroup before an arrive)

    @gluon.jit
    def _loader_reducer(q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, dq_smem, kv_ready, ready,
                        empty, dq_full, dq_empty, dq_ptr, dq_turns, b, hk, h0, n0, m_start, m_end, n_iters, seq_q,
                        seq_k, num_heads, km_ptr, km_b, km_plane, diag, diag_lo,
                        q_row_b, q_row_h, q_col_h, k_row_b, k_row_h, k_col_h, v_row_b, v_row_h, v_col_h,
                        do_row_b, do_row_h, do_col_h, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                        STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASK_MODE: gl.constexpr, WINDOW: gl.constexpr,
                        DETERMINISTIC: gl.constexpr, DIM: gl.constexpr):
        """The third warpgroup: TMA loads (K and V once, Q_i / dO_i STAGES - 1 iterations ahead into a ring) and, up to
        hd128, the dQ reduction: iteration i's dQ_i tile is atomically added to the fp32 dQ buffer. DETERMINISTIC: the
        key blocks add into each (batch, head, query tile) in a fixed order (`_dq_turn`), one counter per tile in
        dq_turns, so the fp32 sums are bitwise repeatable. dQ is [B, Sq, Hq, DIM] (DIM <= HEAD_DIM, the tiles')."""
        BLOCK_N: gl.constexpr = _tile_shape(k_desc.block_type.shape)[0]
        mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _load_tile(k_desc, b * k_row_b + hk * k_row_h + n0, hk * k_col_h, kv_ready, k_smem.index(0))
        _load_tile(v_desc, b * v_row_b + hk * v_row_h + n0, hk * v_col_h, kv_ready, v_smem.index(0))
        h = h0  # of the iteration being reduced
        mt = m_start
        h_ld = h0  # of the iteration loaded last
        mt_ld = m_start
        for i in gl.static_range(STAGES - 1):  # the ring but one slot (fresh slots: no wait)
            if i < n_iters:
                if i > 0:
                    h_ld, mt_ld = _next_tile(h_ld, mt_ld, m_start, m_end)
                _load_qdo(q_desc, do_desc, q_smem, do_smem, ready, i, b, h_ld, mt_ld * BLOCK_M, q_row_b, q_row_h,
                          q_col_h, do_row_b, do_row_h, do_col_h)
        # pieces of BLOCK_M queries by 16 head-dim elements, 4 consecutive head-dim elements (16 contiguous bytes of
        # dQ: one vector load and one vector atomic) a thread
        RED_COLS: gl.constexpr = 16
        red_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])  # [queries, head dim]
        for it in range(0, n_iters):
            nxt = it + STAGES - 1
            if nxt < n_iters:
                h_ld, mt_ld = _next_tile(h_ld, mt_ld, m_start, m_end)
                # both consumers are done with iteration nxt - STAGES (that slot's last user)
                mbarrier.wait(empty.index(nxt % STAGES), ((nxt // STAGES) & 1) ^ 1)
                _load_qdo(q_desc, do_desc, q_smem, do_smem, ready, nxt % STAGES, b, h_ld, mt_ld * BLOCK_M, q_row_b,
                          q_row_h, q_col_h, do_row_b, do_row_h, do_col_h)
            if HEAD_DIM <= 128:  # (at hd256 the consumers add their dQ_i themselves)
                slot = it % 2
                mbarrier.wait(dq_full.index(slot), (it // 2) & 1)
                queries = mt * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, red_layout))
                q_off = gl.expand_dims(queries * (num_heads * DIM), 1)  # int32, from (batch, head)'s base
                q_mask = gl.expand_dims(queries < seq_q, 1)
                base = dq_ptr + (b.to(gl.int64) * seq_q * num_heads + h) * DIM
                if DETERMINISTIC:
                    turn_ptr = dq_turns + (b * num_heads + h) * gl.cdiv(seq_q, BLOCK_M) + mt
                    _wait_turn(turn_ptr, _dq_turn(n0 // BLOCK_N, mt, b, seq_q, seq_k, km_ptr, km_b, km_plane, diag,
                                                  diag_lo, BLOCK_M, BLOCK_N, CAUSAL, MASK_MODE, WINDOW))
                for r in gl.static_range((DIM + RED_COLS - 1) // RED_COLS):  # none of the padded columns' pieces
                    dq = dq_smem.index(slot).slice(r * RED_COLS, RED_COLS, dim=1).load(red_layout)
                    d = r * RED_COLS + gl.arange(0, RED_COLS, layout=gl.SliceLayout(0, red_layout))
                    if DIM % RED_COLS:
                        d_mask = q_mask & gl.expand_dims(d < DIM, 0)
                    else:
                        d_mask = q_mask
                    gl.atomic_add(base + q_off + gl.expand_dims(d, 0), dq, mask=d_mask, sem="relaxed")
                if DETERMINISTIC:  # at once: a late handoff adds up along the order (docs/attention.md, session 22)
                    _pass_turn(turn_ptr)
                mbarrier.arrive(dq_empty.index(slot), count=1)  # every warp has read the slot (synced before arrive)
                h, mt = _next_tile(h, mt, m_start, m_end)

    @gluon.jit
    def _attn_bwd_kernel(q_desc, k_desc, v_desc, do_desc, lse2_ptr, delta_ptr, dq_ptr, dq_turns, dk_ptr, dv_ptr,
                         km_ptr, km_b, km_plane, seq_q, seq_k, num_heads, num_kv_heads, group,
                         q_row_b, q_row_h, q_col_h, k_row_b, k_row_h, k_col_h, v_row_b, v_row_h, v_col_h,
                         do_row_b, do_row_h, do_col_h, qk_scale, sm_scale, diag, diag_lo, cap_scale,
                         slopes_ptr, slopes_b, alibi_diag, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
                         STAGES: gl.constexpr, KV_REGS: gl.constexpr, MASK_MODE: gl.constexpr = 0,
                         WINDOW: gl.constexpr = False, SOFTCAP: gl.constexpr = False, ALIBI: gl.constexpr = 0,
                         DETERMINISTIC: gl.constexpr = False, DIM: gl.constexpr = 0):
        """Per CTA 128 keys of one (batch, kv-head): two consumer warpgroups of 64 keys each and a loader / dQ-reducer
        warpgroup (see `_consumer`, `_loader_reducer`); at hd256 64 keys, the head dim split between the consumers,
        which add dQ themselves. Masks as in the forward (MASK_MODE 1: km_ptr a uint8 key mask, 2: the segment table; 0:
        None); ALiBi as in the forward. DETERMINISTIC: dq_turns, zeroed int32 [B, Hq, query tiles], orders the dQ adds
        (`_loader_reducer`); else unused (None). DIM: the tensors' head dim where the tiles are wider (3-D descriptors
        of `_fwd.tile_view`), else 0."""
        BLOCK_M: gl.constexpr = _tile_shape(q_desc.block_type.shape)[0]
        BLOCK_N: gl.constexpr = _tile_shape(k_desc.block_type.shape)[0]
        OUT_DIM: gl.constexpr = DIM if DIM else HEAD_DIM
        dtype: gl.constexpr = q_desc.dtype
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        qm_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        b, hk, h0, n0, m_start, m_end, n_iters = _key_block(seq_q, seq_k, num_kv_heads, group, km_ptr, km_b, km_plane,
                                                            diag, diag_lo, BLOCK_N, BLOCK_M, CAUSAL, MASK_MODE,
                                                            WINDOW, DETERMINISTIC and CAUSAL)

        k_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_DIM], kv_layout)  # [1, ...]: see `_consumer`
        v_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_DIM], kv_layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qm_layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qm_layout)
        # dS^T [iteration % 2, all keys, queries] (hd256: [warpgroup, keys, queries]) and, up to hd128, dQ_i in fp32
        # [iteration % 2, queries, head dim]
        ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype))
        if HEAD_DIM > 128:  # no room for fp32 dQ tiles (`_consumer`): a stand-in, never read
            dq_smem = ds_smem
        else:
            dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM],
                                                gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.float32))
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_ready, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumers release a Q / dO slot
        # Only the barriers the kernel uses are initialized: the allocator treats the unused ones (the dQ hand-over's
        # at hd256) as dead and places a consumer's layout-conversion scratch on them, and plain stores to an
        # initialized mbarrier's memory are undefined (PTX: mbarrier.inval first). At hd256 that read back NaN now
        # and then as lse2 / delta of 5 query columns (sessions 25-32's rare tile-256 NaN; docs/attention.md).
        if HEAD_DIM <= 128:
            mbarrier.init(ds_ready, count=2)  # both consumers' dS^T are in shared memory
            for i in gl.static_range(2):
                mbarrier.init(dq_full.index(i), count=2)  # both consumers' dQ_i shares are in
                mbarrier.init(dq_empty.index(i), count=1)  # the reducer has read them
        gl.warp_specialize([
            (_consumer, (k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_ready, ready, empty, ds_ready,
                         dq_full, dq_empty, lse2_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, km_ptr, km_b, km_plane, b,
                         hk, h0,
                         n0, m_start, m_end, n_iters, seq_q, seq_k, num_heads, num_kv_heads, qk_scale, sm_scale, diag,
                         diag_lo, cap_scale, slopes_ptr, slopes_b, alibi_diag, 0, HEAD_DIM, BLOCK_M, CAUSAL, STAGES,
                         KV_REGS, MASK_MODE, WINDOW, SOFTCAP, ALIBI, OUT_DIM)),
            (_consumer, (k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_ready, ready, empty, ds_ready,
                         dq_full, dq_empty, lse2_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, km_ptr, km_b, km_plane, b,
                         hk, h0,
                         n0, m_start, m_end, n_iters, seq_q, seq_k, num_heads, num_kv_heads, qk_scale, sm_scale, diag,
                         diag_lo, cap_scale, slopes_ptr, slopes_b, alibi_diag, 1, HEAD_DIM, BLOCK_M, CAUSAL, STAGES,
                         KV_REGS, MASK_MODE, WINDOW, SOFTCAP, ALIBI, OUT_DIM)),
            (_loader_reducer, (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, dq_smem, kv_ready,
                               ready, empty, dq_full, dq_empty, dq_ptr, dq_turns, b, hk, h0, n0, m_start, m_end,
                               n_iters, seq_q, seq_k, num_heads, km_ptr, km_b, km_plane, diag, diag_lo, q_row_b,
                               q_row_h, q_col_h, k_row_b, k_row_h, k_col_h, v_row_b, v_row_h, v_col_h, do_row_b,
                               do_row_h, do_col_h, HEAD_DIM, BLOCK_M, STAGES, CAUSAL, MASK_MODE, WINDOW,
                               DETERMINISTIC, OUT_DIM)),
        ], [4, 4], _WS_REGS)


def kernel_args(head_dim: int, causal: bool, variant: str, mask_mode: int = 0, window: bool = False,
                softcap: bool = False, alibi: int = 0, deterministic: bool = False, dim: int | None = None) -> tuple:
    """(kernel, its constexprs) of a variant, mask mode (0 none, 1 key mask, 2 packed segments), left window edge,
    soft-cap, ALiBi (`_fwd.alibi_mode`) and the ordered dQ adds;
    `causal`: keys bounded on the right (causal, or a right window edge); `head_dim`: the tile width, `dim`: the
    tensors' head dim where it is less (`_fwd.tile_dim`). The launcher and tests/gluon_bwd_builds.py share it."""
    cfg = launch(variant)
    return _attn_bwd_kernel, dict(HEAD_DIM=head_dim, CAUSAL=bool(causal), STAGES=cfg.stages[head_dim],
                                  KV_REGS=head_dim in cfg.kv_in_registers, MASK_MODE=mask_mode, WINDOW=bool(window),
                                  SOFTCAP=bool(softcap), ALIBI=int(alibi), DETERMINISTIC=bool(deterministic),
                                  DIM=dim if dim is not None and dim != head_dim else 0)


def supported(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> bool:
    """Whether `gluon_attention_backward` takes these inputs on this machine (else the caller falls back: the Triton
    backward takes the Gluon forward's LSE)."""
    return (_fwd.supported(q, k, v, causal) and _fwd.tile_dim(q.shape[-1], HEAD_DIMS) is not None
            and dout.shape == q.shape
            and dout.dtype == q.dtype and dout.device == q.device and _offsets_fit(q if q.dim() == 4 else q[None]))


def _check(dout, q, k, v, out, lse, softmax_scale) -> None:
    for name, t in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [B, S, H, D]; got shape {tuple(t.shape)}")
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(f"dout and out must be shaped like q {tuple(q.shape)}; got {tuple(dout.shape)}, "
                         f"{tuple(out.shape)}")
    B, Sq, Hq, _ = q.shape
    if lse.shape != (B, Hq, Sq):
        raise ValueError(f"lse must be [B, Hq, Sq] = {(B, Hq, Sq)} (as the forward returns it); got "
                         f"{tuple(lse.shape)}")
    _fwd.check_inputs(q, k, v, softmax_scale, caller="gluon_attention_backward", fallback="flash_attention_backward",
                      also=(("dout", dout), ("out", out)), head_dims=HEAD_DIMS)
    if not _offsets_fit(q):
        raise ValueError(f"Sq * Hq * D = {q.shape[1] * q.shape[2] * q.shape[3]} must be below 2**31 (the kernel "
                         f"addresses dQ with 32-bit offsets per (batch, head)); use flash_attention_backward")


def _offsets_fit(q: torch.Tensor) -> bool:
    return q.shape[1] * q.shape[2] * q.shape[3] < 2**31


@on_input_device
def gluon_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, *, causal: bool = False,
                             softmax_scale: float | None = None, key_mask: torch.Tensor | None = None,
                             segments: torch.Tensor | None = None, window_size: tuple[int, int] = (-1, -1),
                             softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                             cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                             deterministic: bool = False,
                             variant: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv), shaped and typed like q, k, v, of softmax(q.k^T * scale).v for q, out, dout
    [B, Sq, Hq, D], k, v [B, Sk, Hkv, D] (GQA: dk / dv summed over each group's query heads) and lse fp32
    [B, Hq, Sq] in natural log as `gluon_attention_forward` returns it. Causal is aligned bottom-right;
    `key_mask` / `segments` / `window_size` / `softcap` / `alibi_slopes` as in `gluon_attention_forward`, and
    varlen calls too ([T, H, D] tensors, lse [Hq, Tq], `cu_seqlens_q` / `cu_seqlens_k`).
    `deterministic`: dQ bitwise repeatable (the key blocks add in a fixed order; else in arrival order; not with
    cu_seqlens). `variant`: one of `VARIANTS` (default: `DEFAULT_VARIANTS` by head dim)."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1]) if q.dim() in (3, 4) and q.shape[-1] > 0 else 1.0
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        q4, k4, v4, (_, key_spans) = _fwd._varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window_size,
                                                         key_mask, segments, alibi_slopes,
                                                         "gluon_attention_backward")
        if deterministic:  # its turn order (`_dq_turn`) would read the keys' bounds as the queries'
            raise ValueError("deterministic=True takes no cu_seqlens; use flash_attention_backward, which is "
                             "deterministic (or, for queries and keys packed alike, dense inputs with `segments`)")
        lse4 = lse[None] if lse.dim() == 2 else lse
        _check(dout[None], q4, k4, v4, out[None], lse4, softmax_scale)
        dq, dk, dv = _backward(dout[None], q4, k4, v4, out[None], lse4, False, softmax_scale,
                               (key_spans, key_spans.stride(1), key_spans.stride(0), 2), (-1, -1), softcap, None,
                               deterministic, variant)
        return dq[0], dk[0], dv[0]
    _check(dout, q, k, v, out, lse, softmax_scale)
    masks = _fwd.mask_args(key_mask, segments, q.shape[0], q.shape[1], k.shape[1], q.device)
    return _backward(dout, q, k, v, out, lse, causal, softmax_scale, masks, window_size, softcap, alibi_slopes,
                     deterministic, variant)


def _backward(dout, q, k, v, out, lse, causal, softmax_scale, masks, window_size, softcap, alibi_slopes,
              deterministic, variant):
    """The launches of `gluon_attention_backward` for checked dense inputs; `masks`: `mask_args`' tuple, its table
    read at the keys (and, `deterministic`, at the query tiles)."""
    if not softcap >= 0:
        raise ValueError(f"softcap must be >= 0 (0: none); got {softcap}")
    tile = _fwd.tile_dim(q.shape[-1], HEAD_DIMS)
    if deterministic and not deterministic_supported(tile):
        raise ValueError(f"deterministic=True is not supported at head dim {q.shape[-1]} (its dQ is added from two "
                         f"warpgroups in arrival order); use flash_attention_backward, which is deterministic")
    variant = variant or DEFAULT_VARIANTS[tile]
    cfg = launch(variant)
    from .flash_attention import _bwd_preprocess, _strides4  # the plain-Triton preprocess (delta, lse2)

    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    km, km_b, km_plane, mask_mode = masks
    slopes, slopes_b = _fwd.alibi_args(alibi_slopes, B, Hq, q.device)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty(k.shape, device=q.device, dtype=q.dtype)
    dv = torch.empty(v.shape, device=q.device, dtype=q.dtype)
    if B == 0 or Sq == 0 or Hq == 0 or Sk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()

    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    out = out if out.stride(-1) == 1 else out.contiguous()
    lse = lse.to(torch.float32).contiguous()
    delta = torch.empty_like(lse)
    lse2 = torch.empty_like(lse)
    pre_bm = 64
    launch_cached(_bwd_preprocess, (triton.cdiv(Sq, pre_bm), Hq, B),
                  (out, dout, lse, delta, lse2, q, *_strides4(out, False), *_strides4(dout, False), lse.stride(0),
                   lse.stride(1), lse.stride(2), Sq), dict(D_V=D, BLOCK_DV=tile, BLOCK_M=pre_bm, IS_VARLEN=False))

    elem = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q2, q_map = _fwd.tile_view(q, tile)
    do2, do_map = _fwd.tile_view(dout, tile)
    k2, k_map = _fwd.tile_view(k, tile)
    v2, v_map = _fwd.tile_view(v, tile)
    left, right = _fwd._window(causal, window_size)
    kernel, meta = kernel_args(tile, right >= 0, variant, mask_mode, left >= 0, softcap > 0,
                               _fwd.alibi_mode(slopes, right), deterministic, dim=D)
    qk_scale, cap_scale = (softcap * LOG2E, softmax_scale / softcap) if softcap > 0 else (softmax_scale * LOG2E, 1.0)
    block_m = cfg.block_m[tile]
    q_desc = _fwd.tile_descriptor(q2, block_m, tile, elem)
    do_desc = _fwd.tile_descriptor(do2, block_m, tile, elem)
    bn = block_n(tile)
    k_desc = _fwd.tile_descriptor(k2, bn, tile, elem)
    v_desc = _fwd.tile_descriptor(v2, bn, tile, elem)

    dq_acc = torch.zeros(B, Sq, Hq, D, device=q.device, dtype=torch.float32)
    # one turn counter per (batch, head, query tile)
    dq_turns = torch.zeros(B, Hq, triton.cdiv(Sq, block_m), device=q.device, dtype=torch.int32) \
        if deterministic else None
    grid = (triton.cdiv(Sk, bn), B * Hkv)
    launch_cached(kernel, grid, (q_desc, k_desc, v_desc, do_desc, lse2, delta, dq_acc, dq_turns, dk, dv, km, km_b,
                                 km_plane, Sq, Sk, Hq, Hkv, Hq // Hkv, *q_map, *k_map, *v_map, *do_map, qk_scale,
                                 softmax_scale, Sk - Sq + max(right, 0), Sk - Sq - left, cap_scale, slopes, slopes_b,
                                 Sk - Sq),
                  dict(meta, num_warps=4, maxnreg=MAXNREG))
    torch.mul(dq_acc, softmax_scale, out=dq)  # one pass: scaled and cast
    return dq, dk, dv
