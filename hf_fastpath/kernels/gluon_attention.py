"""FlashAttention forward for Hopper (sm_90) in Gluon, FlashAttention-3 style.

One CTA per (query tile, batch x head), a producer and two or three consumers (`gl.warp_specialize`):
- a 1-warp producer with few registers issues the TMA loads: Q once, then K and V tiles into a ring of STAGES
  shared-memory slots (one "ready" mbarrier per slot and operand, one "empty" mbarrier per slot);
- 4-warp consumers (warpgroups) own 64 query rows each: two (128-row tiles), or three (192 rows, FA3's hd64 tile:
  `config` takes them at hd64 but for short causal calls, key masks and packed segments; a warpgroup then stops at
  its own last key tile and passes the rest of its turns and ring slots on). Per key tile: S = Q.K^T by wgmma (both
  operands in shared memory), online softmax in registers (exp2, the scale folded into one FMA), P cast to 16 bits
  and fed back as the *register* A operand of the P.V wgmma (no shared-memory round trip). The Q.K^T of tile j is
  issued before the P.V of tile j-1 and the softmax of tile j runs while that P.V is in flight (FA3's intra-
  warpgroup overlap). With PINGPONG the warpgroups take turns issuing their wgmmas (an mbarrier per consumer passes
  the turn), so one's softmax runs under another's tensor-core work.
Causal attention is aligned bottom-right (query i sees keys j <= i + Sk - Sq): tiles above the diagonal are never
loaded, and only the diagonal / sequence-end tiles pay for the mask. Padding (`key_mask`, MASK_MODE 1): a byte per
key, checked in every tile that has a masked key; packed sequences (`segments`, MASK_MODE 2): only the key tiles of
the segments of a tile's rows are loaded, each row masked to its segment (`_tile_plan`). A sliding window (WINDOW,
flash-attn's (left, right)): the tiles left of the tile's window are never loaded and only the edge tiles are masked;
the right edge is the causal one moved (CAUSAL with diag = Sk - Sq + right). Soft-cap (SOFTCAP, Gemma-2): scores
softcap * tanh(s / softcap), tanh from exp2 (exact, one more MUFU op an element than tanh.approx). ALiBi (ALIBI,
BLOOM / Falcon-RW / MPT): scores - slope * |i + Sk - Sq - j|, one add an element when causal (`alibi_mode`). Head
dims 64, 128, 256 (hd256: 64-key tiles, 2 stages), and the multiples of 8 between them at the next of those
(`tile_dim`: 3-D descriptors whose boxes TMA zero-fills past the head dim; no copy). Rows with no visible key give
0 and lse -inf. Varlen calls (`cu_seqlens_q` / `cu_seqlens_k`, packed alike or not) run as one [1, T] row of packed
segments whose per-query key bounds carry causality and the window (`varlen_spans`; no ALiBi there).
Out-of-range rows come from TMA's zero fill (or the next sequence's rows, which the mask hides); only valid rows
are stored. Tensors in, tensors out.

Variants (`Config`; `config()` gives the default, `variants()` the opt-in ones, `gluon_attention_forward(...,
variant=)` runs one). Every flag passes the GPU tests; the default takes the two that measured faster (session 30,
`gluon_attention.json`): O stored by TMA at hd64 / hd128, and Q from registers at hd64 (a padded head dim keeps
the direct store, the key-mask kernels both old settings: `config`).
- tma_store: O goes registers -> shared memory -> one TMA store per warpgroup into out viewed [B, Sq, H*D]
  (TMA clips rows past Sq, so nothing spills into the next sequence). It is staged in Q's buffer (dead by then)
  unless a persistent CTA has room for a buffer of its own; in Q's buffer the producer must wait for the store.
  hd128 with 3 stages has no room: `persistent_s2` trades a K/V stage for it. 1-10% faster than storing from the
  accumulator's registers (whose 4-byte pieces make many partial-sector stores), most at 1k-2k tokens.
- q_regs: each consumer loads its 64 Q rows into registers once (wgmma's register A operand), so the Q.K^T
  wgmmas read only K from shared memory: +1-3% at hd64, +-1% at hd128 (where it costs 32 of 240 registers), not
  built at hd256 (64 more registers would not fit beside O's 128).
- persistent: about one CTA per SM (`_attn_fwd_persistent_kernel`), each looping over work items t = pid, pid +
  grid, ... (`_work_item`: causal takes every head's longest tile first). The producer and both consumers walk the
  same items; the K/V ring position and the ping-pong turn count run on across items, Q's phase flips per item,
  and a `q_empty` barrier hands Q's buffer back to the producer after an item's last Q.K^T, so the next item's Q
  and its first STAGES - 1 K/V tiles load under this item's last P.V and epilogue. Session 12: +10-25% at 1k
  tokens except hd128 causal, 4-12% slower from 4k (`gluon_attention_variants.json`, before TMA stores were the
  default).
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import NamedTuple

import torch
import triton

from .common import derived_once, next_pow2, nvmma_layout
from .device import compute_major, on_input_device
from .flash_attention import _key_mask_arg, _slopes, _window
from .launch import launch_cached

try:  # Gluon and its Hopper module (Triton >= 3.5); without them `supported` says no and nothing is compiled
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAS_GLUON = False

__all__ = ["gluon_attention_forward", "varlen_spans", "supported", "HEAD_DIMS", "tile_dim", "Config", "config",
           "variants"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
HEAD_DIMS = (64, 128, 256)
ROWS_PER_WARPGROUP = 64  # the wgmma M of one warpgroup; two consumers make a 128-row query tile (three: 192)
MAXNREG = 168  # 3 warpgroups x 128 threads x 168 <= 64K registers; setmaxnreg then moves them to the consumers
CONSUMER_REGS, PRODUCER_REGS = 240, 24
# three consumers (hd64, `config`): 4 warpgroups x 128 threads x 128; the workers' setmaxnreg targets, the first
# consumer (the default partition) gets the rest, 4 x 128 - 344 = 168
MAXNREG3, WORKER_REGS3 = 128, (160, 160, PRODUCER_REGS)


def tile_dim(head_dim: int, dims: tuple = HEAD_DIMS) -> int | None:
    """The tile width the kernels run a head dim at: itself when it is one of `dims`; else, for a multiple of 8 (TMA
    rows must be 16-byte aligned) between 64 and the widest of `dims` (e.g. 96: GPT-NeoX-20B; 80, 192), the next
    power of two. The padded columns cost their share of the MMAs but no copy: a 3-D descriptor (`tile_view`)
    reads them as zeros, which keeps Q.K^T and dO.V^T exact, and the stores skip them. None: not taken."""
    if head_dim in dims:
        return head_dim
    if head_dim % 8 or not 64 < head_dim < max(dims):
        return None
    return next_pow2(head_dim)


SHARED_LIMIT = 232448  # bytes of shared memory one CTA may opt in to on sm_90 (227 KB)


class Config(NamedTuple):
    """One kernel configuration: key tile, K/V ring depth, ping-pong, a persistent grid, the output stored by TMA,
    and Q.K^T's A operand (Q) loaded into registers once instead of read from shared memory by every wgmma (see
    the module docstring)."""
    block_n: int
    stages: int
    pingpong: bool
    persistent: bool = False
    tma_store: bool = False
    q_regs: bool = False
    consumers: int = 2


def block_m(cfg: Config) -> int:
    """Query rows a CTA (one work item) takes: 64 per consumer warpgroup."""
    return cfg.consumers * ROWS_PER_WARPGROUP


def max_registers(cfg: Config) -> int:
    """The launch's `maxnreg`: the register file split evenly over the warpgroups before setmaxnreg moves it."""
    return MAXNREG3 if cfg.consumers == 3 else MAXNREG


# two consumers per tile head dim (`config`), and where three take hd64 instead
_TWO_CONSUMERS = {64: Config(128, 4, True, tma_store=True, q_regs=True), 128: Config(128, 3, True, tma_store=True),
                  256: Config(64, 2, True)}
WG3_MIN_CAUSAL_KEYS = 2560  # causal hd64 below it keeps two consumers (2k keys: 0.95x, 3k: 1.08x; session 31)


def config(head_dim: int, causal: bool, padded: bool = False, key_mask: bool = False, packed: bool = False,
           seq_k: int | None = None) -> Config:
    """The default per tile head dim. `padded`: the tensors' head dim is narrower (`tile_dim`), so O is stored from
    registers (a TMA box would write the padded columns into the next head's); `key_mask`: the key-mask kernels,
    whose per-key path spills already, keep two consumers, O's direct store and Q in shared memory (both took
    140-190 more bytes of spills there); `packed`: packed segments, whose documents are short as a rule (and their
    lengths on the GPU), keep two consumers at hd64; `seq_k`: the call's keys (None: many). Measured on the H200
    (benchmarks/results/gluon_attention.json): hd128 with 3 K/V stages (229.7 KB of shared memory, just under the
    227 KB limit) is 9-26% faster than 2; ping-pong gains 0-8%; O stored by TMA (session 30) 1-10% faster than
    from the accumulator's registers (most at 1k-2k tokens). hd64 (session 31): three consumers on 192-row tiles
    (FA3's hd64 tile; Q from shared memory, as Q in registers spills there) are 1.02-1.19x two on 128 rows without
    a causal mask, and 1.08-1.13x causal from 3k keys, where the last row's diagonal costs less than the 128
    extra rows gain (1k: 0.82x, so shorter causal calls keep two, with Q from registers: +1-3%); BLOCK_N 64 with
    6 stages was 10-20% slower than 128 x 4. hd256: 64-key tiles, 2 stages (197 KB; O's [64, 256] accumulator
    takes 128 registers a thread, so S stays at 64 x 64: 128-key tiles spill ~1.9 KB and serialize the wgmmas),
    O stored from registers (a TMA box row is at most 256 bytes wide with the 128-byte swizzle). TMA boxes are
    clipped to the 128-byte swizzle by the compiler (several copies a tile)."""
    cfg = _TWO_CONSUMERS[head_dim]
    if key_mask:  # (three consumers spill 3.8 KB there)
        return cfg._replace(tma_store=False, q_regs=False)
    if head_dim == 64 and not packed and not (causal and seq_k is not None and seq_k < WG3_MIN_CAUSAL_KEYS):
        return cfg._replace(consumers=3, q_regs=False)
    return cfg._replace(tma_store=False) if padded else cfg


def variants(head_dim: int, causal: bool) -> dict[str, Config]:
    """The opt-in variants to measure beside the default (GPU tests, `benchmarks/gluon_attention.py --variants`,
    the offline builds), all of two consumers but wg3: O stored from registers, a persistent grid, Q's operand the
    other way; at hd64 two and three consumers (one of them the default, by the call's keys); none at hd256."""
    if head_dim == 256:
        return {}
    base = _TWO_CONSUMERS[head_dim]
    found = {"direct_store": base._replace(tma_store=False), "persistent": base._replace(persistent=True),
             "q_smem" if base.q_regs else "q_regs": base._replace(q_regs=not base.q_regs)}
    if head_dim == 64:
        found.update(wg2=base, wg3=base._replace(consumers=3, q_regs=False))
    if _stages_o_in_q(head_dim, found["persistent"]):
        # O must wait in Q's buffer, which delays the next item's Q: one K/V stage less buys O a buffer of its own
        found["persistent_s2"] = base._replace(stages=base.stages - 1, persistent=True)
    return found


def _shared_bytes(head_dim: int, cfg: Config, o_buffer: bool) -> int:
    """Shared memory of the 16-bit tiles (Q, the K/V ring, O's staging buffer), plus 1 KB for barriers and
    layout conversions (the compiled kernels use ~370 bytes of it)."""
    tiles = block_m(cfg) * head_dim * (2 if o_buffer else 1) + 2 * cfg.stages * cfg.block_n * head_dim
    return 2 * tiles + 1024


def _stages_o_in_q(head_dim: int, cfg: Config) -> bool:
    """Whether TMA_STORE stages O in Q's buffer: always with one CTA per tile (Q is dead by then); persistent
    only when a buffer of its own does not fit (else the next item's Q could not load under this one's store)."""
    return not cfg.persistent or _shared_bytes(head_dim, cfg, True) > SHARED_LIMIT


def kernel_args(head_dim: int, causal: bool, cfg: Config, mask_mode: int = 0, window: bool = False,
                softcap: bool = False, alibi: int = 0, dim: int | None = None) -> tuple:
    """(kernel, its constexprs) for one configuration, mask mode (0 none, 1 key mask, 2 packed segments), left window
    edge, soft-cap and ALiBi (`alibi_mode`); `causal`: keys bounded on the right (causal, or a right window edge);
    `head_dim`: the tile width, `dim`: the tensors' head dim where it is less (`tile_dim`).
    The launcher and tests/gluon_builds.py share it."""
    padded = dim is not None and dim != head_dim
    meta = dict(HEAD_DIM=head_dim, BLOCK_N=cfg.block_n, STAGES=cfg.stages, CAUSAL=bool(causal),
                PINGPONG=cfg.pingpong, TMA_STORE=cfg.tma_store)
    if padded and (cfg.persistent or cfg.tma_store):
        raise ValueError("a padded head dim takes neither the persistent nor the TMA-store variant")
    if cfg.consumers not in (2, 3) or (cfg.consumers == 3 and (cfg.persistent or head_dim != 64)):
        raise ValueError(f"{cfg.consumers} consumer warpgroups: 2 take every configuration, 3 only hd64 tiles "
                         "without a persistent grid")
    if not cfg.persistent:
        return _attn_fwd_kernel, dict(meta, MASK_MODE=mask_mode, WINDOW=bool(window), SOFTCAP=bool(softcap),
                                      ALIBI=int(alibi), DIM=dim if padded else 0, Q_REGS=cfg.q_regs,
                                      CONSUMERS=cfg.consumers)
    if mask_mode or window or softcap or alibi:
        raise ValueError("the persistent variant takes no key mask, segments, window, soft-cap or ALiBi")
    meta["O_BUFFER"] = cfg.tma_store and not _stages_o_in_q(head_dim, cfg)
    return _attn_fwd_persistent_kernel, dict(meta, Q_REGS=cfg.q_regs)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


if HAS_GLUON:
    # Triton 3.6 calls the TMA copies `async_copy_global_to_shared` / `async_copy_shared_to_global`; 3.7+ renamed
    # them `async_load` / `async_store` (the old names raise)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # 3.6's name; 3.9 calls it `barrier`
    _REGS = gl.constexpr([CONSUMER_REGS, PRODUCER_REGS])  # setmaxnreg targets of the worker partitions
    _REGS3 = gl.constexpr(list(WORKER_REGS3))

    @gluon.jit
    def _key_tiles(m0, seq_k, diag, diag_lo, TILE_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                   WINDOW: gl.constexpr = False):
        """Key tiles of the query tile at row m0 -> (first, end, u0, u1): visit tiles first..end-1, of which every
        row sees u0..u1-1 whole. Row i sees keys up to i + diag (CAUSAL: causal or a right window edge) and from
        i + diag_lo on (WINDOW: a left window edge)."""
        if CAUSAL:
            key_end = gl.minimum(seq_k, m0 + TILE_M + diag)  # keys past it are hidden from every row of the tile
            full_end = gl.minimum(seq_k, m0 + 1 + diag)  # keys before it are visible to every row
        else:
            key_end = seq_k
            full_end = seq_k
        n_tiles = gl.cdiv(gl.maximum(key_end, 0), BLOCK_N)
        n_full = gl.maximum(full_end, 0) // BLOCK_N
        if WINDOW:
            first = gl.maximum(m0 + diag_lo, 0) // BLOCK_N
            # keys from the last row's left edge on are visible to every row
            u0 = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(m0 + TILE_M - 1 + diag_lo, 0), BLOCK_N), first + 1),
                            n_tiles)
        else:
            first = 0
            u0 = 1
        return first, n_tiles, u0, gl.maximum(n_full, u0)

    @gluon.jit
    def _tile_plan(km_ptr, km_b, km_plane, b, m0, seq_q, seq_k, diag, diag_lo, TILE_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, MASK_MODE: gl.constexpr):
        """Key tiles of the query tile at row m0 -> (first, end, u0, u1) as `_key_tiles`, for MASK_MODE 0 and 1 (key
        mask: the tiles u0..u1-1 check their keys' entries); 2 (packed segments, Sq == Sk): only the keys of the
        segments of the tile's rows. A segment's tokens are contiguous and its start / end (planes 1 / 2 of the
        table) do not decrease along the sequence, so the tile's first row has the smallest start and end, its last
        row the largest."""
        first, n_tiles, u0, u1 = _key_tiles(m0, seq_k, diag, diag_lo, TILE_M, BLOCK_N, CAUSAL, WINDOW)
        if MASK_MODE == 2:
            seg = km_ptr + b * km_b
            m_last = gl.minimum(m0 + TILE_M, seq_q) - 1
            first = gl.maximum(first, gl.load(seg + km_plane + m0) // BLOCK_N)
            n_tiles = gl.minimum(n_tiles, gl.cdiv(gl.load(seg + 2 * km_plane + m_last), BLOCK_N))
            u0 = gl.minimum(gl.maximum(gl.maximum(gl.cdiv(gl.load(seg + km_plane + m_last), BLOCK_N), u0), first + 1),
                            n_tiles)
            u1 = gl.maximum(gl.minimum(u1, gl.load(seg + 2 * km_plane + m0) // BLOCK_N), u0)
        return first, n_tiles, u0, u1

    @gluon.jit
    def _work_item(t, n_m_tiles, n_bh, CAUSAL: gl.constexpr):
        """Persistent schedule: work item t -> (query tile, batch x head). Causal: every head's longest (last) tile
        before any shorter one, so the short tiles fill the tail; full: a head's tiles are consecutive, so CTAs
        running at the same time share K/V in L2 (the order of the one-CTA-per-tile grid)."""
        if CAUSAL:
            tile = n_m_tiles - 1 - t // n_bh
            bh = t % n_bh
        else:
            tile = t % n_m_tiles
            bh = t // n_m_tiles
        return tile, bh

    @gluon.jit
    def _load_tile(desc, row, col, bar, dest):
        """TMA load of one [rows, D] tile: at (row, col) of a 2-D descriptor, or at (col, row, 0) of a 3-D one
        (`tile_view`: a padded head dim, whose columns past the tensor's D arrive as zeros)."""
        if len(desc.block_type.shape) == 3:
            _tma_load(desc, [col, row, 0], bar, dest.reshape(desc.block_type.shape))
        else:
            _tma_load(desc, [row, col], bar, dest)

    @gluon.constexpr_function
    def _tile_shape(block_shape):
        """[rows, columns] of the tiles a 2-D or 3-D (`tile_view`) descriptor loads."""
        return [block_shape[-2], block_shape[-1]]

    @gluon.jit
    def _tile_buffer(desc, count: gl.constexpr):
        """Shared memory for `count` tiles of a descriptor, as 2-D [rows, columns] tiles."""
        shape: gl.constexpr = _tile_shape(desc.block_type.shape)
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(shape, desc.dtype)
        return gl.allocate_shared_memory(desc.dtype, [count] + shape, layout)

    @gluon.jit
    def _load_q(q_desc, q_smem, q_ready, q_row, q_col):
        """The query tile, one 64-row piece per consumer."""
        pieces: gl.constexpr = q_smem.type.shape[0]
        rows: gl.constexpr = q_smem.type.shape[1]
        mbarrier.expect(q_ready, pieces * q_desc.block_type.nbytes)
        for i in gl.static_range(pieces):
            _load_tile(q_desc, q_row + i * rows, q_col, q_ready, q_smem.index(i))

    @gluon.jit
    def _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, kv_row, kv_col, first, last, kv0,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """K and V tiles first..last-1 into the ring; kv0 = how many tiles went through the ring before tile 0."""
        for j in range(first, last):
            c = kv0 + j
            slot = c % STAGES
            # a fresh mbarrier counts as having completed the phase before 0: the first lap does not wait
            mbarrier.wait(kv_empty.index(slot), ((c // STAGES) & 1) ^ 1)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            _load_tile(k_desc, kv_row + j * BLOCK_N, kv_col, k_ready.index(slot), k_smem.index(slot))
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            _load_tile(v_desc, kv_row + j * BLOCK_N, kv_col, v_ready.index(slot), v_smem.index(slot))

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
                  q_row, q_col, kv_row, kv_col, first, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        _load_q(q_desc, q_smem, q_ready, q_row, q_col)
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, kv_row, kv_col, first, n_tiles, -first,
                 BLOCK_N, STAGES)

    @gluon.jit
    def _take_turn(turns, t, WARPGROUP: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong: the consumers issue their wgmmas in turn (0, 1[, 2], 0, ...), so one's softmax runs under
        another's tensor-core work instead of all softmaxes at once. t counts issue points; consumer 0's first
        wait passes (a fresh mbarrier counts as having completed the phase before 0)."""
        if PINGPONG:
            if WARPGROUP == 0:
                mbarrier.wait(turns.index(0), (t & 1) ^ 1)
            else:
                mbarrier.wait(turns.index(WARPGROUP), t & 1)

    @gluon.jit
    def _pass_turn(turns, WARPGROUP: gl.constexpr, PINGPONG: gl.constexpr):
        if PINGPONG:
            mbarrier.arrive(turns.index((WARPGROUP + 1) % turns.type.shape[0]), count=1)

    @gluon.jit
    def _tanh(x):
        # from exp2 (2.885... = 2 log2(e)), exact limits +-1 (exp2 overflows to inf: 2 / inf = 0);
        # tanh.approx.f32 would be off by up to 2^-11
        return 1.0 - gl.fdiv(gl.full_like(x, 2.0), gl.exp2(x * 2.8853900817779268) + 1.0)

    @gluon.jit
    def _online_softmax(s, m_i, l_i, qk_scale, rows, key0, seq_k, diag, diag_lo, cap_scale, key_ok, seg_lo, seg_hi,
                        s_layout: gl.constexpr, BLOCK_N: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
                        MASK_MODE: gl.constexpr, WINDOW: gl.constexpr = False, SOFTCAP: gl.constexpr = False,
                        alibi_diag=0, alibi_coef=0.0, ALIBI: gl.constexpr = 0):
        """Scores of one key tile -> (P unnormalized, the factor for the running output, new max, new sum);
        the max lives in the scaled log2 domain. Masks: key_ok (MASK_MODE 1, per key), each row's segment keys
        seg_lo..seg_hi-1 (MASK_MODE 2), keys before row + diag_lo (WINDOW). SOFTCAP: scores tanh(s * cap_scale),
        qk_scale then being softcap * log2(e). ALiBi, alibi_coef being the head's slope / (qk_scale * ln 2) (the bias
        in the units of s): ALIBI 1, scores - alibi_coef * |row + alibi_diag - key|; 2 (causal, every visible key at
        or left of row + Sk - Sq), scores + alibi_coef * (key - alibi_diag) with alibi_diag = m0 + Sk - Sq: the bias
        less its per-row part -alibi_coef * (row - m0), which the softmax does not see and the epilogue puts back
        into the LSE."""
        if SOFTCAP:
            s = _tanh(s * cap_scale)
        if MASKED or ALIBI:
            keys = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if ALIBI == 1:  # in float: a subtract, an abs and an FMA an element
            dist = gl.expand_dims((rows + alibi_diag).to(gl.float32), 1) - gl.expand_dims(keys.to(gl.float32), 0)
            s = s - alibi_coef * gl.abs(dist)
        if ALIBI == 2:  # one add an element; small near the diagonal, where the weights are (fp32 keeps them exact)
            s = s + gl.expand_dims((keys - alibi_diag).to(gl.float32) * alibi_coef, 0)
        if MASKED:
            visible = gl.expand_dims(keys < seq_k, 0)
            if CAUSAL:
                visible = visible & (gl.expand_dims(keys, 0) <= gl.expand_dims(rows + diag, 1))
            if WINDOW:
                visible = visible & (gl.expand_dims(keys, 0) >= gl.expand_dims(rows + diag_lo, 1))
            if MASK_MODE == 1:
                visible = visible & gl.expand_dims(key_ok, 0)
            if MASK_MODE == 2:
                visible = visible & (gl.expand_dims(keys, 0) >= gl.expand_dims(seg_lo, 1)) \
                    & (gl.expand_dims(keys, 0) < gl.expand_dims(seg_hi, 1))
            s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        if MASKED:  # a row with no visible key yet keeps max -inf: subtract 0 instead (exp2(-inf) = 0, no NaN)
            m_new_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        alpha = gl.exp2(m_i - m_new_safe)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new_safe, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _key_mask(km_row, key0, seq_k, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
        """Whether each key of the tile at key0 is a real one (its key-mask entry, as uint8, is > 0)."""
        keys = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        return gl.load(km_row + keys, mask=keys < seq_k, other=0) > 0

    @gluon.jit
    def _attend(j, c, t, q, k_smem, v_smem, k_ready, v_ready, kv_empty, turns, o, p, m_i, l_i, qk_scale, rows,
                seq_k, diag, diag_lo, cap_scale, km_row, seg_lo, seg_hi, s_layout: gl.constexpr,
                o_layout: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
                CAUSAL: gl.constexpr, WARPGROUP: gl.constexpr, PINGPONG: gl.constexpr, MASK_MODE: gl.constexpr,
                WINDOW: gl.constexpr = False, SOFTCAP: gl.constexpr = False, alibi_diag=0, alibi_coef=0.0,
                ALIBI: gl.constexpr = 0):
        """Key tile j (ring position c, ping-pong turn t): S_j = Q.K_j^T and O += P_{j-1}.V_{j-1} in flight
        together, softmax of S_j under the P.V (and a key mask's load under both wgmmas)."""
        slot = c % STAGES
        prev = (c - 1) % STAGES
        mbarrier.wait(k_ready.index(slot), (c // STAGES) & 1)
        ROWS: gl.constexpr = q.shape[0]
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        mbarrier.wait(v_ready.index(prev), ((c - 1) // STAGES) & 1)
        _take_turn(turns, t, WARPGROUP, PINGPONG)
        s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        o = warpgroup_mma(p, v_smem.index(prev), o, is_async=True)
        _pass_turn(turns, WARPGROUP, PINGPONG)
        if MASK_MODE == 1:
            key_ok = _key_mask(km_row, j * BLOCK_N, seq_k, BLOCK_N, s_layout)
        else:
            key_ok = None
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # wgmma groups retire in order: S_j is done
        if MASK_MODE == 1 and not MASKED:  # a tile the rows see whole unless keys are padding: mask only if so
            if gl.min(key_ok.to(gl.int32), axis=0) > 0:
                p_new, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, qk_scale, rows, j * BLOCK_N, seq_k, diag,
                                                         diag_lo, cap_scale, key_ok, seg_lo, seg_hi, s_layout,
                                                         BLOCK_N, False, CAUSAL, MASK_MODE, WINDOW, SOFTCAP,
                                                         alibi_diag, alibi_coef, ALIBI)
            else:
                p_new, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, qk_scale, rows, j * BLOCK_N, seq_k, diag,
                                                         diag_lo, cap_scale, key_ok, seg_lo, seg_hi, s_layout,
                                                         BLOCK_N, True, CAUSAL, MASK_MODE, WINDOW, SOFTCAP,
                                                         alibi_diag, alibi_coef, ALIBI)
        else:
            p_new, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, qk_scale, rows, j * BLOCK_N, seq_k, diag, diag_lo,
                                                     cap_scale, key_ok, seg_lo, seg_hi, s_layout, BLOCK_N, MASKED,
                                                     CAUSAL, MASK_MODE, WINDOW, SOFTCAP, alibi_diag, alibi_coef,
                                                     ALIBI)
        o, p = warpgroup_mma_wait(num_outstanding=0, deps=(o, p))  # P stays live until its wgmma has read it
        mbarrier.arrive(kv_empty.index(prev), count=1)
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p = gl.convert_layout(p_new.to(q.dtype), p.type.layout)
        return o, p, m_i, l_i

    @gluon.jit
    def _store_o_by_tma(o, out_desc, buf, b, row, col):
        """O -> shared memory -> TMA store into out viewed [B, Sq, H * D]: rows past Sq are clipped by TMA, not
        written into the next sequence. Waits first for this warpgroup's previous store to leave `buf`."""
        tma.store_wait(0)
        buf.store(o.to(out_desc.dtype))
        fence_async_shared()
        _tma_store(out_desc, [b, row, col], buf.reshape(out_desc.block_type.shape))

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns, out_ptr, lse_ptr,
                  m0, b, h, seq_q, seq_k, num_heads, diag, n_tiles, u1, qk_scale,
                  WARPGROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, out_desc=None, o_smem=None, q_empty=None,
                  q_phase=0, kv0=0, turn0=0, TMA_STORE: gl.constexpr = False, PERSISTENT: gl.constexpr = False,
                  O_BUFFER: gl.constexpr = False, first=0, u0=1, km_ptr=None, km_b=0, km_plane=0,
                  MASK_MODE: gl.constexpr = 0, diag_lo=0, cap_scale=1.0, WINDOW: gl.constexpr = False,
                  SOFTCAP: gl.constexpr = False, key_lo=0, key_hi=0, alibi_diag=0, alibi_coef=0.0,
                  ALIBI: gl.constexpr = 0, DIM: gl.constexpr = 0, Q_REGS: gl.constexpr = False):
        """One warpgroup's 64 rows of one query tile: key tiles first..n_tiles-1, unmasked u0..u1-1 (see
        `_tile_plan`). kv0 / turn0: K/V tiles / ping-pong turns this CTA went
        through before this tile (0 without PERSISTENT). PERSISTENT: Q comes for every tile (phase q_phase) and
        goes back to the producer through q_empty: right after the last Q.K^T, so the next tile's Q loads under
        this one's last P.V and store, or, when TMA_STORE stages O in Q's buffer (o_smem is Q's unless O_BUFFER),
        only once TMA has read O. DIM: out's head dim where it is less than the tiles' HEAD_DIM (`tile_dim`)."""
        ROWS: gl.constexpr = q_smem.type.shape[1]
        OUT_DIM: gl.constexpr = DIM if DIM else HEAD_DIM
        O_IN_Q: gl.constexpr = TMA_STORE and not O_BUFFER
        RELEASE_Q_EARLY: gl.constexpr = PERSISTENT and not O_IN_Q
        # wait for Q even without a key tile when O will overwrite it: else Q's TMA load could land on top of O
        WAIT_Q_ALWAYS: gl.constexpr = PERSISTENT or O_IN_Q
        # the wgmma accumulators: S is [ROWS, BLOCK_N], O is [ROWS, HEAD_DIM]; P is O's register A operand
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        q = q_smem.index(WARPGROUP)
        q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        rows = m0 + WARPGROUP * ROWS + gl.arange(0, ROWS, layout=row_layout)
        if ALIBI == 2:  # keys are measured from the tile's first row's diagonal (see `_online_softmax`)
            alibi_diag = alibi_diag + m0
        m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([ROWS], gl.float32, row_layout)
        o = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
        if MASK_MODE == 1:
            km_row = km_ptr + b * km_b
        else:
            km_row = None
        if MASK_MODE == 2:  # the keys each row sees: its segment's, start..end-1
            seg_rows = km_ptr + b * km_b + rows
            seg_lo = gl.load(seg_rows + km_plane, mask=rows < seq_q, other=0)
            seg_hi = gl.load(seg_rows + 2 * km_plane, mask=rows < seq_q, other=0)
        elif MASK_MODE == 3:  # a key mask whose real keys are one run: every row sees key_lo..key_hi-1
            seg_lo = gl.full([ROWS], key_lo, gl.int32, row_layout)
            seg_hi = gl.full([ROWS], key_hi, gl.int32, row_layout)
        else:
            seg_lo = None
            seg_hi = None
        # MASK_MODE 3 masks tiles as packed segments do (two bounds a row, no per-key load)
        MODE: gl.constexpr = 2 if MASK_MODE == 3 else MASK_MODE
        kvb = kv0 - first  # ring position and turn of key tile j: kvb + j, tb + j
        tb = turn0 - first
        # three consumers: this warpgroup's own key tiles end where its last row's keys do (n_tiles is the CTA's
        # last row's), and rows all past Sq (a sequence's last tile) take the first tile alone; two consumers (64-row
        # halves of 128-key tiles) would rarely skip one, and take them all
        row0 = m0 + WARPGROUP * ROWS
        own_end = n_tiles
        if CAUSAL and turns.type.shape[0] == 3:
            own_end = gl.minimum(own_end, gl.cdiv(gl.maximum(gl.minimum(seq_k, gl.minimum(row0 + ROWS, seq_q) + diag),
                                                             0), BLOCK_N))
        if row0 >= seq_q and turns.type.shape[0] == 3:
            own_end = first + 1
        own_end = gl.minimum(gl.maximum(own_end, first + 1), n_tiles)
        if WAIT_Q_ALWAYS:
            mbarrier.wait(q_ready, q_phase)
        if n_tiles > first:
            if not WAIT_Q_ALWAYS:
                mbarrier.wait(q_ready, 0)
            if Q_REGS:  # the Q.K^T's A operand from registers: shared memory then carries K alone
                qa = q_smem.index(WARPGROUP).load(q_layout)
            else:
                qa = q
            # the first tile alone (no P.V to overlap with yet); masked, as it may be the only tile
            mbarrier.wait(k_ready.index(kv0 % STAGES), (kv0 // STAGES) & 1)
            _take_turn(turns, turn0, WARPGROUP, PINGPONG)
            s = warpgroup_mma(qa, k_smem.index(kv0 % STAGES).permute((1, 0)),
                              gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
            _pass_turn(turns, WARPGROUP, PINGPONG)
            if MODE == 1:
                key_ok = _key_mask(km_row, first * BLOCK_N, seq_k, BLOCK_N, s_layout)
            else:
                key_ok = None
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, qk_scale, rows, first * BLOCK_N, seq_k, diag, diag_lo,
                                                 cap_scale, key_ok, seg_lo, seg_hi, s_layout, BLOCK_N, True, CAUSAL,
                                                 MODE, WINDOW, SOFTCAP, alibi_diag, alibi_coef, ALIBI)
            p = gl.convert_layout(p.to(qa.dtype), p_layout)
            if MODE == 2 or WINDOW:  # tiles before u0 start inside some row's segment or window
                for j in range(first + 1, gl.minimum(u0, own_end)):
                    o, p, m_i, l_i = _attend(j, kvb + j, tb + j, qa, k_smem, v_smem, k_ready, v_ready, kv_empty,
                                             turns, o, p, m_i, l_i, qk_scale, rows, seq_k, diag, diag_lo,
                                             cap_scale, km_row, seg_lo, seg_hi, s_layout, o_layout, BLOCK_N, STAGES,
                                             True, CAUSAL, WARPGROUP, PINGPONG, MODE, WINDOW, SOFTCAP,
                                             alibi_diag, alibi_coef, ALIBI)
            # tiles every row sees whole (key mask: unless some of their keys are padding)
            for j in range(u0, gl.minimum(u1, own_end)):
                o, p, m_i, l_i = _attend(j, kvb + j, tb + j, qa, k_smem, v_smem, k_ready, v_ready, kv_empty,
                                         turns, o, p, m_i, l_i, qk_scale, rows, seq_k, diag, diag_lo, cap_scale,
                                         km_row, seg_lo, seg_hi, s_layout, o_layout, BLOCK_N, STAGES, False, CAUSAL,
                                         WARPGROUP, PINGPONG, MODE, WINDOW, SOFTCAP, alibi_diag, alibi_coef,
                                         ALIBI)
            for j in range(u1, own_end):  # the diagonal, the sequence or segment end
                o, p, m_i, l_i = _attend(j, kvb + j, tb + j, qa, k_smem, v_smem, k_ready, v_ready, kv_empty,
                                         turns, o, p, m_i, l_i, qk_scale, rows, seq_k, diag, diag_lo, cap_scale,
                                         km_row, seg_lo, seg_hi, s_layout, o_layout, BLOCK_N, STAGES, True, CAUSAL,
                                         WARPGROUP, PINGPONG, MODE, WINDOW, SOFTCAP, alibi_diag, alibi_coef,
                                         ALIBI)
            if RELEASE_Q_EARLY:  # every Q.K^T has completed
                mbarrier.arrive(q_empty, count=1)
            last = (kvb + own_end - 1) % STAGES
            mbarrier.wait(v_ready.index(last), ((kvb + own_end - 1) // STAGES) & 1)
            _take_turn(turns, tb + own_end, WARPGROUP, PINGPONG)
            o = warpgroup_mma(p, v_smem.index(last), o, is_async=True)
            _pass_turn(turns, WARPGROUP, PINGPONG)
            o, p = warpgroup_mma_wait(num_outstanding=0, deps=(o, p))
            mbarrier.arrive(kv_empty.index(last), count=1)
            for j in range(own_end, n_tiles):  # tiles only later rows see: their turns and ring slots pass on
                c = kvb + j
                # once loaded (its K too: a slot must not be refilled under a TMA load still landing)
                mbarrier.wait(k_ready.index(c % STAGES), (c // STAGES) & 1)
                mbarrier.wait(v_ready.index(c % STAGES), (c // STAGES) & 1)
                _take_turn(turns, tb + j + 1, WARPGROUP, PINGPONG)
                _pass_turn(turns, WARPGROUP, PINGPONG)
                mbarrier.arrive(kv_empty.index(c % STAGES), count=1)
        else:
            if RELEASE_Q_EARLY:
                mbarrier.arrive(q_empty, count=1)

        empty = l_i == 0.0  # no visible key (causal with Sq > Sk, masked keys): out 0, lse -inf
        inv_l = 1.0 / gl.where(empty, 1.0, l_i)
        o = o * gl.expand_dims(gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout)), 1)
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        if ALIBI == 2:  # the per-row part of the bias, -slope * (row - m0), left out of the scores
            lse = lse - (alibi_coef * qk_scale * 0.6931471805599453) * (rows - m0).to(gl.float32)
        row_ok = rows < seq_q
        gl.store(lse_ptr + (b * num_heads + h).to(gl.int64) * seq_q + rows, lse, mask=row_ok)
        if TMA_STORE:
            _store_o_by_tma(o, out_desc, o_smem.index(WARPGROUP), b, m0 + WARPGROUP * ROWS, h * HEAD_DIM)
            if O_IN_Q:  # wait until TMA has read O (before the CTA exits, or before Q's buffer goes back)
                tma.store_wait(0)
                if PERSISTENT:
                    _barrier()  # the waiting thread issued the store; the releasing one may differ
                    mbarrier.arrive(q_empty, count=1)
        else:
            o_rows = m0 + WARPGROUP * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
            cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
            row_off = ((b * seq_q + o_rows).to(gl.int64) * num_heads + h) * OUT_DIM
            ptrs = out_ptr + gl.expand_dims(row_off, 1) + gl.expand_dims(cols, 0)
            o_mask = gl.expand_dims(o_rows < seq_q, 1)
            if OUT_DIM < HEAD_DIM:
                o_mask = o_mask & gl.expand_dims(cols < OUT_DIM, 0)
            gl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)

    @gluon.jit
    def _tile_consumer(q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns, out_ptr, lse_ptr, m0, b,
                       h, seq_q, seq_k, num_heads, diag, n_tiles, u1, qk_scale, WARPGROUP: gl.constexpr,
                       HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                       PINGPONG: gl.constexpr, out_desc, TMA_STORE: gl.constexpr, first, u0, km_ptr, km_b, km_plane,
                       MASK_MODE: gl.constexpr, diag_lo, cap_scale, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr,
                       run_lo, run_hi, alibi_diag, alibi_coef, ALIBI: gl.constexpr, DIM: gl.constexpr,
                       Q_REGS: gl.constexpr):
        """A consumer of the one-CTA-per-tile kernel. A key-mask call's (MASK_MODE 1) batch row whose real keys are
        one run (left / right padding, what Transformers builds) masks by its two ends (run_lo < run_hi or an empty
        run); others load the mask per key."""
        if MASK_MODE != 1:
            _consumer(q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns, out_ptr, lse_ptr, m0, b, h,
                      seq_q, seq_k, num_heads, diag, n_tiles, u1, qk_scale, WARPGROUP, HEAD_DIM, BLOCK_N, STAGES,
                      CAUSAL, PINGPONG, out_desc, q_smem, None, 0, 0, 0, TMA_STORE, False, False, first, u0, km_ptr,
                      km_b, km_plane, MASK_MODE, diag_lo, cap_scale, WINDOW, SOFTCAP, 0, 0, alibi_diag, alibi_coef,
                      ALIBI, DIM, Q_REGS)
        elif run_lo <= run_hi:
            _consumer(q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns, out_ptr, lse_ptr, m0, b, h,
                      seq_q, seq_k, num_heads, diag, n_tiles, u1, qk_scale, WARPGROUP, HEAD_DIM, BLOCK_N, STAGES,
                      CAUSAL, PINGPONG, out_desc, q_smem, None, 0, 0, 0, TMA_STORE, False, False, first, u0, None,
                      km_b, km_plane, 3, diag_lo, cap_scale, WINDOW, SOFTCAP, run_lo, run_hi, alibi_diag, alibi_coef,
                      ALIBI, DIM, Q_REGS)
        else:
            _consumer(q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns, out_ptr, lse_ptr, m0, b, h,
                      seq_q, seq_k, num_heads, diag, n_tiles, u1, qk_scale, WARPGROUP, HEAD_DIM, BLOCK_N, STAGES,
                      CAUSAL, PINGPONG, out_desc, q_smem, None, 0, 0, 0, TMA_STORE, False, False, first, u0, km_ptr,
                      km_b, km_plane, 1, diag_lo, cap_scale, WINDOW, SOFTCAP, 0, 0, alibi_diag, alibi_coef, ALIBI,
                      DIM, Q_REGS)

    @gluon.jit
    def _persistent_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                             kv_empty, seq_q, seq_k, num_heads, group, n_bh, n_m_tiles, q_row_b, q_row_h, q_col_h,
                             kv_row_b, kv_row_h, kv_col_h, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                             CAUSAL: gl.constexpr):
        """Loads for the work items of this CTA, in the consumers' order; the K/V ring position runs on across
        items, so the next item's tiles stream in while the consumers finish the last one."""
        TILE_M: gl.constexpr = 2 * q_desc.block_type.shape[0]
        kv0 = 0
        item = 0
        for t in range(gl.program_id(0), n_m_tiles * n_bh, gl.num_programs(0)):
            tile, bh = _work_item(t, n_m_tiles, n_bh, CAUSAL)
            b = bh // num_heads
            h = bh % num_heads
            hk = h // group
            m0 = tile * TILE_M
            first, n_tiles, u0, u1 = _key_tiles(m0, seq_k, seq_k - seq_q, 0, TILE_M, BLOCK_N, CAUSAL)
            kv_row = b * kv_row_b + hk * kv_row_h
            # the ring slots the last item has already freed (all but its last tile's) before Q, which is free
            # only after the last item's final Q.K^T (or its store, with O staged in Q's buffer); the rest after Q
            n_early = gl.minimum(n_tiles, STAGES - 1)
            _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, kv_row, hk * kv_col_h, 0, n_early,
                     kv0, BLOCK_N, STAGES)
            mbarrier.wait(q_empty, (item & 1) ^ 1)  # both consumers are done with the previous item's Q
            _load_q(q_desc, q_smem, q_ready, b * q_row_b + h * q_row_h + m0, h * q_col_h)
            _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, kv_row, hk * kv_col_h, n_early,
                     n_tiles, kv0, BLOCK_N, STAGES)
            kv0 += n_tiles
            item += 1

    @gluon.jit
    def _persistent_consumer(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, turns, out_ptr,
                             out_desc, o_smem, lse_ptr, seq_q, seq_k, num_heads, n_bh, n_m_tiles, qk_scale,
                             WARPGROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                             STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                             TMA_STORE: gl.constexpr, O_BUFFER: gl.constexpr, Q_REGS: gl.constexpr):
        TILE_M: gl.constexpr = 2 * q_smem.type.shape[1]
        kv0 = 0
        turn0 = 0
        item = 0
        for t in range(gl.program_id(0), n_m_tiles * n_bh, gl.num_programs(0)):
            tile, bh = _work_item(t, n_m_tiles, n_bh, CAUSAL)
            m0 = tile * TILE_M
            first, n_tiles, u0, u1 = _key_tiles(m0, seq_k, seq_k - seq_q, 0, TILE_M, BLOCK_N, CAUSAL)
            _consumer(q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns, out_ptr, lse_ptr, m0,
                      bh // num_heads, bh % num_heads, seq_q, seq_k, num_heads, seq_k - seq_q, n_tiles, u1, qk_scale,
                      WARPGROUP, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, PINGPONG,
                      out_desc, o_smem, q_empty, item & 1, kv0, turn0, TMA_STORE, True, O_BUFFER, Q_REGS=Q_REGS)
            kv0 += n_tiles
            if n_tiles > 0:  # issue points per item: one per key tile and the last P.V
                turn0 += n_tiles + 1
            item += 1
        if TMA_STORE:
            tma.store_wait(0)

    @gluon.jit
    def _allocate(q_desc, k_desc, v_desc, STAGES: gl.constexpr, CONSUMERS: gl.constexpr = 2):
        """Shared memory and mbarriers of one CTA: Q (a 64-row piece per consumer), the K/V ring, and its
        barriers."""
        q_smem = _tile_buffer(q_desc, CONSUMERS)
        k_smem = _tile_buffer(k_desc, STAGES)
        v_smem = _tile_buffer(v_desc, STAGES)
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=1)
        for i in gl.static_range(CONSUMERS):
            mbarrier.init(turns.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=CONSUMERS)  # every consumer releases a slot
        return q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns

    @gluon.jit
    def _attn_fwd_kernel(q_desc, k_desc, v_desc, out_ptr, out_desc, lse_ptr, km_ptr, km_b, km_plane, run_ptr, seq_q,
                         seq_k, num_heads, group, q_row_b, q_row_h, q_col_h, kv_row_b, kv_row_h, kv_col_h, qk_scale,
                         diag, diag_lo, cap_scale, slopes_ptr, slopes_b, alibi_diag, HEAD_DIM: gl.constexpr,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                         TMA_STORE: gl.constexpr, MASK_MODE: gl.constexpr = 0, WINDOW: gl.constexpr = False,
                         SOFTCAP: gl.constexpr = False, ALIBI: gl.constexpr = 0, DIM: gl.constexpr = 0,
                         Q_REGS: gl.constexpr = False, CONSUMERS: gl.constexpr = 2):
        """One CTA per (query tile of CONSUMERS x 64 rows, batch x head). TMA_STORE stages O in Q's buffer (Q is dead by
        then). MASK_MODE 1: km_ptr is a uint8 key mask [B, Sk] (batch stride km_b); 2: the int32 segment table [3, B,
        S] of `flash_attention.segment_table` (plane stride km_plane); 0: None. With a key mask, run_ptr [2, B] holds
        each batch row's run of real keys (lo, hi), hi < lo when they are not one run. Row i sees keys up to i + diag
        with CAUSAL (diag = Sk - Sq + the right window edge) and from i + diag_lo on with WINDOW (diag_lo = Sk - Sq -
        the left window edge); SOFTCAP: scores softcap * tanh(s * cap_scale), qk_scale = softcap * log2(e). ALIBI (1,
        or 2 when causal with no right window edge: see `alibi_mode`): scores - slope * |i + alibi_diag - j|
        (alibi_diag = Sk - Sq), slopes fp32 [B or 1, H] (batch stride slopes_b). DIM: the tensors' head dim when the
        tiles are wider (3-D descriptors of `tile_view`), else 0."""
        ROWS: gl.constexpr = _tile_shape(q_desc.block_type.shape)[0]
        TILE_M: gl.constexpr = CONSUMERS * ROWS
        pid_m = gl.program_id(0)
        if CAUSAL:  # the longest rows first, so the short ones fill the tail of the grid
            pid_m = gl.num_programs(0) - 1 - pid_m
        bh = gl.program_id(1)
        b = bh // num_heads
        h = bh % num_heads
        hk = h // group
        m0 = pid_m * TILE_M
        first, n_tiles, u0, u1 = _tile_plan(km_ptr, km_b, km_plane, b, m0, seq_q, seq_k, diag, diag_lo, TILE_M,
                                            BLOCK_N, CAUSAL, WINDOW, MASK_MODE)
        if MASK_MODE == 1:
            run_lo = gl.load(run_ptr + b)
            run_hi = gl.load(run_ptr + gl.num_programs(1) // num_heads + b)
            if run_lo <= run_hi:  # only keys run_lo..run_hi-1: tiles outside are never loaded, edge tiles masked
                first = gl.maximum(first, run_lo // BLOCK_N)
                n_tiles = gl.minimum(n_tiles, gl.cdiv(run_hi, BLOCK_N))
                u0 = gl.minimum(gl.maximum(gl.maximum(u0, gl.cdiv(run_lo, BLOCK_N)), first + 1), n_tiles)
                u1 = gl.maximum(gl.minimum(u1, run_hi // BLOCK_N), u0)
        else:
            run_lo = 0
            run_hi = 0
        if ALIBI:  # the bias in the units of s, which the softmax multiplies by qk_scale and then works in log2
            alibi_coef = gl.load(slopes_ptr + b * slopes_b + h) * (1.4426950408889634 / qk_scale)
        else:
            alibi_coef = 0.0

        q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns = _allocate(q_desc, k_desc, v_desc,
                                                                                       STAGES, CONSUMERS)
        q_row = b * q_row_b + h * q_row_h + m0
        kv_row = b * kv_row_b + hk * kv_row_h
        q_col = h * q_col_h
        kv_col = hk * kv_col_h
        if CONSUMERS == 3:
            gl.warp_specialize([
                (_tile_consumer, (q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns, out_ptr,
                                  lse_ptr, m0, b, h, seq_q, seq_k, num_heads, diag, n_tiles, u1, qk_scale, 0, HEAD_DIM,
                                  BLOCK_N, STAGES, CAUSAL, PINGPONG, out_desc, TMA_STORE, first, u0, km_ptr, km_b,
                                  km_plane, MASK_MODE, diag_lo, cap_scale, WINDOW, SOFTCAP, run_lo, run_hi,
                                  alibi_diag, alibi_coef, ALIBI, DIM, Q_REGS)),
                (_tile_consumer, (q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns, out_ptr,
                                  lse_ptr, m0, b, h, seq_q, seq_k, num_heads, diag, n_tiles, u1, qk_scale, 1, HEAD_DIM,
                                  BLOCK_N, STAGES, CAUSAL, PINGPONG, out_desc, TMA_STORE, first, u0, km_ptr, km_b,
                                  km_plane, MASK_MODE, diag_lo, cap_scale, WINDOW, SOFTCAP, run_lo, run_hi,
                                  alibi_diag, alibi_coef, ALIBI, DIM, Q_REGS)),
                (_tile_consumer, (q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns, out_ptr,
                                  lse_ptr, m0, b, h, seq_q, seq_k, num_heads, diag, n_tiles, u1, qk_scale, 2, HEAD_DIM,
                                  BLOCK_N, STAGES, CAUSAL, PINGPONG, out_desc, TMA_STORE, first, u0, km_ptr, km_b,
                                  km_plane, MASK_MODE, diag_lo, cap_scale, WINDOW, SOFTCAP, run_lo, run_hi,
                                  alibi_diag, alibi_coef, ALIBI, DIM, Q_REGS)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
                             q_row, q_col, kv_row, kv_col, first, n_tiles, BLOCK_N, STAGES)),
            ], [4, 4, 1], _REGS3)
        else:
            gl.warp_specialize([
                (_tile_consumer, (q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns, out_ptr,
                                  lse_ptr, m0, b, h, seq_q, seq_k, num_heads, diag, n_tiles, u1, qk_scale, 0, HEAD_DIM,
                                  BLOCK_N, STAGES, CAUSAL, PINGPONG, out_desc, TMA_STORE, first, u0, km_ptr, km_b,
                                  km_plane, MASK_MODE, diag_lo, cap_scale, WINDOW, SOFTCAP, run_lo, run_hi,
                                  alibi_diag, alibi_coef, ALIBI, DIM, Q_REGS)),
                (_tile_consumer, (q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns, out_ptr,
                                  lse_ptr, m0, b, h, seq_q, seq_k, num_heads, diag, n_tiles, u1, qk_scale, 1, HEAD_DIM,
                                  BLOCK_N, STAGES, CAUSAL, PINGPONG, out_desc, TMA_STORE, first, u0, km_ptr, km_b,
                                  km_plane, MASK_MODE, diag_lo, cap_scale, WINDOW, SOFTCAP, run_lo, run_hi,
                                  alibi_diag, alibi_coef, ALIBI, DIM, Q_REGS)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
                             q_row, q_col, kv_row, kv_col, first, n_tiles, BLOCK_N, STAGES)),
            ], [4, 1], _REGS)

    @gluon.jit
    def _attn_fwd_persistent_kernel(q_desc, k_desc, v_desc, out_ptr, out_desc, lse_ptr, seq_q, seq_k, num_heads,
                                    group, n_bh, q_row_b, q_row_h, q_col_h, kv_row_b, kv_row_h, kv_col_h, qk_scale,
                                    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                                    CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, TMA_STORE: gl.constexpr,
                                    O_BUFFER: gl.constexpr, Q_REGS: gl.constexpr = False):
        """A grid of about one CTA per SM; each loops over the work items t = pid, pid + grid, ... (see
        `_work_item`). TMA_STORE stages O in a buffer of its own with O_BUFFER (else in Q's, released later)."""
        TILE_M: gl.constexpr = 2 * q_desc.block_type.shape[0]
        n_m_tiles = gl.cdiv(seq_q, TILE_M)
        q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns = _allocate(q_desc, k_desc, v_desc,
                                                                                       STAGES)
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_empty, count=2)  # both consumers release Q
        if O_BUFFER:
            o_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        else:
            o_smem = q_smem
        gl.warp_specialize([
            (_persistent_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, turns,
                                    out_ptr, out_desc, o_smem, lse_ptr, seq_q, seq_k, num_heads, n_bh, n_m_tiles,
                                    qk_scale, 0, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, PINGPONG, TMA_STORE, O_BUFFER,
                                    Q_REGS)),
            (_persistent_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, turns,
                                    out_ptr, out_desc, o_smem, lse_ptr, seq_q, seq_k, num_heads, n_bh, n_m_tiles,
                                    qk_scale, 1, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, PINGPONG, TMA_STORE, O_BUFFER,
                                    Q_REGS)),
            (_persistent_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                                    v_ready, kv_empty, seq_q, seq_k, num_heads, group, n_bh, n_m_tiles, q_row_b,
                                    q_row_h, q_col_h, kv_row_b, kv_row_h, kv_col_h, BLOCK_N, STAGES, CAUSAL)),
        ], [4, 1], _REGS)


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> bool:
    """Whether `gluon_attention_forward` takes these inputs on this machine (else the caller falls back): dense
    [B, S, H, D] or varlen [T, H, D] tensors."""
    return (HAS_GLUON and q.is_cuda and q.dim() in (3, 4) and k.dim() == q.dim() and v.dim() == q.dim()
            and compute_major(q.device) == 9
            and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and v.dtype == q.dtype
            and tile_dim(q.shape[-1]) is not None and k.shape[-1] == q.shape[-1] and v.shape[-1] == q.shape[-1]
            and k.shape == v.shape and (q.dim() == 3 or q.shape[0] == k.shape[0]) and k.shape[-2] > 0
            and q.shape[-2] % k.shape[-2] == 0)


def _row_view(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A 2-D [rows, cols] view of `[B, S, H, D]` for TMA and how (b, h, s) maps onto it: row = b*row_b + h*row_h
    + s, column = h*col_h. Takes [B, S, H, D]- and [B, H, S, D]-contiguous memory without a copy."""
    B, S, H, D = x.shape
    sb, ss, sh, sd = x.stride()
    if sd == 1 and sh == D and ss == H * D and sb == S * H * D:
        return x.view(B * S, H * D), (S, 0, D)
    if sd == 1 and ss == D and sh == S * D and sb == H * S * D:
        return x.transpose(1, 2).view(B * H * S, D), (H * S, S, 0)
    return _row_view(x.contiguous())


def tile_view(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """`_row_view`, or for a head dim padded to `tile` columns a 3-D [heads, rows, D] view (TMA zero-fills a box's
    columns past D, where a 2-D box would read the next head's): its head coordinate is h * col_h."""
    view, (row_b, row_h, col_h) = _row_view(x)
    D = x.shape[-1]
    if D == tile:
        return view, (row_b, row_h, col_h)
    heads = x.shape[2] if col_h else 1
    return view.view(view.shape[0], heads, D).transpose(0, 1), (row_b, row_h, 1 if col_h else 0)


def tile_box(rows: int, tile: int, padded: bool) -> list[int]:
    """The TMA box of `rows` rows of a `tile`-wide tile: [rows, tile] over the 2-D `tile_view`, or [1, rows, tile]
    over the 3-D one of a head dim padded to the tile."""
    return [1, rows, tile] if padded else [rows, tile]


def tile_descriptor(view: torch.Tensor, rows: int, tile: int, elem) -> "TensorDescriptor":
    """The TMA descriptor of [rows, tile] boxes over a `tile_view`."""
    block = tile_box(rows, tile, padded=view.dim() == 3)
    return TensorDescriptor(view, list(view.shape), list(view.stride()), block, nvmma_layout(tuple(block), elem))


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, *,
                 caller: str = "gluon_attention_forward", fallback: str = "flash_attention_forward",
                 also: tuple = (), head_dims: tuple = HEAD_DIMS) -> None:
    """ValueErrors naming the problem and the fix for what the Gluon kernels take; `also`: more (name, tensor)
    pairs that must be 4-D and of q's dtype (the backward's dout and out); `head_dims`: the kernel's tile widths
    (`tile_dim`)."""
    if not HAS_GLUON:
        raise ValueError(f"{caller} needs Triton with Gluon's Hopper module (triton >= 3.6); use "
                         f"hf_fastpath.kernels.flash_attention.{fallback} instead")
    named = (("q", q), ("k", k), ("v", v)) + tuple(also)
    for name, t in named:
        if t.dim() != 4:
            raise ValueError(f"{name} must be [B, S, H, D]; got shape {tuple(t.shape)}")
    if not (q.is_cuda and compute_major(q.device) == 9):
        raise ValueError(f"{caller} runs on Hopper (sm_90) GPUs only; elsewhere use {fallback}")
    if q.dtype not in (torch.bfloat16, torch.float16) or any(t.dtype != q.dtype for _, t in named):
        raise ValueError(f"{', '.join(n for n, _ in named)} must all be bfloat16 or all float16; got "
                         f"{', '.join(str(t.dtype) for _, t in named)}")
    if tile_dim(q.shape[-1], head_dims) is None or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        raise ValueError(f"head dim must be one of {head_dims} or a multiple of 8 between {min(head_dims)} and "
                         f"{max(head_dims)}, and equal for q, k, v; got {q.shape[-1]}, "
                         f"{k.shape[-1]}, {v.shape[-1]} (use {fallback} for other head dims)")
    if k.shape != v.shape or q.shape[0] != k.shape[0]:
        raise ValueError(f"k and v must have equal shapes and q's batch; got q {tuple(q.shape)}, k {tuple(k.shape)}"
                         f", v {tuple(v.shape)}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})")
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be positive (the row max is taken before scaling); got "
                         f"{softmax_scale}")


@on_input_device
def gluon_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                            softmax_scale: float | None = None, key_mask: torch.Tensor | None = None,
                            segments: torch.Tensor | None = None, window_size: tuple[int, int] = (-1, -1),
                            softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                            cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                            variant: Config | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q.k^T * scale).v -> (out like q, lse fp32 [B, Hq, Sq] in natural log) for q [B, Sq, Hq, D] and
    k, v [B, Sk, Hkv, D] (Hq a multiple of Hkv). Causal is aligned bottom-right, as in flash-attn. `key_mask`
    [B, Sk]: keys whose entry is > 0 are attended (padding); `segments`: packed sequences, the table of
    `flash_attention.segment_table` (Sq == Sk); `window_size` (left, right), -1 unbounded: query i sees keys
    i + Sk - Sq - left .. i + Sk - Sq + right (flash-attn's sliding window); `softcap` > 0: scores softcap *
    tanh(scores / softcap) (Gemma-2); `alibi_slopes` [Hq] or [B, Hq]: scores - slope * |i + Sk - Sq - j| (after the
    soft-cap). Varlen: q [Tq, Hq, D], k, v [Tk, Hkv, D] and `cu_seqlens_q` / `cu_seqlens_k` [B + 1], packed alike or
    not (chunked prefill: each sequence's queries after its cached keys), lse [Hq, Tq]; no ALiBi there
    (`varlen_spans`). Rows that see no key give 0 and lse -inf. `variant` replaces `config(D, causal)` (see
    `variants`)."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        q4, k4, v4, (spans, _) = _varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window_size, key_mask,
                                                segments, alibi_slopes, "gluon_attention_forward")
        check_inputs(q4, k4, v4, softmax_scale)
        out, lse = _forward(q4, k4, v4, False, softmax_scale, (spans, spans.stride(1), spans.stride(0), 2),
                            (-1, -1), softcap, None, None, variant)
        return out[0], lse[0]
    check_inputs(q, k, v, softmax_scale)
    masks = mask_args(key_mask, segments, q.shape[0], q.shape[1], k.shape[1], q.device)
    return _forward(q, k, v, causal, softmax_scale, masks, window_size, softcap, alibi_slopes, key_mask, variant)


def _forward(q, k, v, causal, softmax_scale, masks, window_size, softcap, alibi_slopes, key_mask, variant):
    """The launch of `gluon_attention_forward` for checked dense inputs; `masks`: `mask_args`' tuple."""
    if not softcap >= 0:
        raise ValueError(f"softcap must be >= 0 (0: none); got {softcap}")
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    km, km_b, km_plane, mask_mode = masks
    slopes, slopes_b = alibi_args(alibi_slopes, B, Hq, q.device)
    out = torch.empty(B, Sq, Hq, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, Hq, Sq, device=q.device, dtype=torch.float32)
    if B == 0 or Sq == 0 or Hq == 0:
        return out, lse
    if Sk == 0:
        return out.zero_(), lse.fill_(float("-inf"))

    tile = tile_dim(D)
    cfg = variant if variant is not None else config(tile, bool(causal), padded=tile != D, key_mask=mask_mode == 1,
                                                     packed=mask_mode == 2, seq_k=Sk)
    left, right = _window(causal, window_size)
    diag = Sk - Sq
    qk_scale, cap_scale = (softcap * LOG2E, softmax_scale / softcap) if softcap > 0 else (softmax_scale * LOG2E, 1.0)
    elem = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q2, (q_row_b, q_row_h, q_col_h) = tile_view(q, tile)
    k2, (kv_row_b, kv_row_h, kv_col_h) = tile_view(k, tile)
    v2, v_map = tile_view(v, tile)
    if v_map != (kv_row_b, kv_row_h, kv_col_h):  # k and v share one address map in the kernel
        k2, (kv_row_b, kv_row_h, kv_col_h) = tile_view(k.contiguous(), tile)
        v2, _ = tile_view(v.contiguous(), tile)
    q_desc = tile_descriptor(q2, ROWS_PER_WARPGROUP, tile, elem)
    k_desc = tile_descriptor(k2, cfg.block_n, tile, elem)
    v_desc = tile_descriptor(v2, cfg.block_n, tile, elem)
    out_desc = _out_descriptor(out, elem) if cfg.tma_store else None

    kernel, meta = kernel_args(tile, right >= 0, cfg, mask_mode, left >= 0, softcap > 0, alibi_mode(slopes, right),
                               dim=D)
    n_m_tiles = triton.cdiv(Sq, block_m(cfg))
    if cfg.persistent:
        head_args, tail = (Sq, Sk, Hq, Hq // Hkv, B * Hq), ()
    else:
        runs = _runs_of(key_mask, km, Sk) if mask_mode == 1 else None
        head_args = (km, km_b, km_plane, runs, Sq, Sk, Hq, Hq // Hkv)
        tail = (diag + max(right, 0), diag - left, cap_scale, slopes, slopes_b, diag)
    # persistent: one CTA per SM at most (one fits per SM), each loops over work items
    grid = (min(n_m_tiles * B * Hq, _sm_count(q.device)), ) if cfg.persistent else (n_m_tiles, B * Hq)
    launch_cached(kernel, grid, (q_desc, k_desc, v_desc, out, out_desc, lse, *head_args, q_row_b, q_row_h, q_col_h,
                                 kv_row_b, kv_row_h, kv_col_h, qk_scale, *tail),
                  dict(meta, num_warps=4, maxnreg=max_registers(cfg)))
    return out, lse


def key_runs(key_mask: torch.Tensor) -> torch.Tensor:
    """int32 [2, B]: each batch row's real keys (entries > 0) as one run lo..hi-1 (0, 0 when it has none), or
    (0, -1) when they are not one run (a hole). Device ops only: padded batches (left or right) take the kernels'
    two-bound path, which loads no per-key mask."""
    real = key_mask > 0
    idx = torch.arange(real.shape[1], device=real.device)
    count = real.sum(1)
    lo = torch.where(real, idx, real.shape[1]).amin(1)
    hi = torch.where(real, idx + 1, 0).amax(1)
    empty = count == 0
    one_run = empty | (count == hi - lo)
    lo = torch.where(one_run & ~empty, lo, 0)
    hi = torch.where(empty, 0, torch.where(one_run, hi, -1))
    return torch.stack([lo, hi]).to(torch.int32)


_RUNS: dict = {}  # key_runs per key mask (`derived_once`)


def _runs_of(key_mask: torch.Tensor, km: torch.Tensor, seq_k: int) -> torch.Tensor:
    """`key_runs` of a call's mask, once per mask tensor: a model's layers share one mask, and the ~8 small ops cost
    more host time than a short call's kernel (1k-token hd64 forwards measured 1.5x slower with them per call)."""
    return derived_once(_RUNS, key_mask, seq_k, lambda: key_runs(km[0, :, :seq_k]))


def varlen_spans(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int,
                 causal: bool = False, window_size: tuple[int, int] = (-1, -1)) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen inputs as the kernels' packed-segment masks, for queries and keys packed alike or not -> (per query
    int32 [3, 1, total_q], per key int32 [3, 1, total_k]). Planes 1 / 2 hold the keys each query sees (lo..hi-1) in
    the first, the queries that see each key in the second; plane 0 numbers the sequences from 1 (0: no sequence).
    Sequence i's queries cu_q[i]..cu_q[i+1]-1 see its keys cu_k[i]..cu_k[i+1]-1, causally aligned bottom-right and
    within `window_size` as in flash-attn; both are folded into the bounds, so the kernels run these calls with
    MASK_MODE 2 and neither CAUSAL nor WINDOW. The bounds never decrease along the queries (sequences come in order;
    a query that sees nothing gets lo = hi), which the tile plans need, and the queries that see a key are then one
    interval too: those whose hi > key and lo <= key. Device ops only (no host synchronisation)."""
    device = cu_seqlens_q.device
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    if cu_q.numel() == 1:  # no sequence: as one empty one
        cu_q, cu_k = cu_q.repeat(2), cu_k.repeat(2)
    left, right = _window(causal, window_size)
    rows = torch.arange(total_q, device=device)
    seq = torch.searchsorted(cu_q[1:], rows, right=True).clamp(max=cu_q.numel() - 2)
    inside = (rows >= cu_q[0]) & (rows < cu_q[-1])
    k_start, k_end = cu_k[seq], cu_k[seq + 1]
    diag = rows + k_end - cu_q[seq + 1]  # the key aligned with this query (bottom-right)
    lo = k_start if left < 0 else torch.maximum(k_start, diag - left)
    hi = k_end if right < 0 else torch.minimum(k_end, diag + right + 1)
    outside = torch.where(rows < cu_q[0], cu_k[0], cu_k[-1])  # queries outside every sequence see nothing
    lo = torch.where(inside, lo, outside).clamp(0, total_k)
    hi = torch.maximum(torch.where(inside, hi, outside).clamp(0, total_k), lo)
    keys = torch.arange(total_k, device=device)
    q_lo = torch.searchsorted(hi, keys, right=True)  # the first query with hi > key ..
    q_hi = torch.searchsorted(lo, keys, right=True)  # .. the last with lo <= key, plus one
    q_seq = torch.where(inside, seq + 1, 0)
    k_seq = torch.searchsorted(cu_k[1:], keys, right=True) + 1
    k_seq = torch.where((keys >= cu_k[0]) & (keys < cu_k[-1]), k_seq, 0)
    per_query = torch.stack([q_seq, lo, hi]).to(torch.int32)[:, None]
    per_key = torch.stack([k_seq, q_lo, q_hi]).to(torch.int32)[:, None]
    return per_query.contiguous(), per_key.contiguous()


_SPANS: dict = {}  # varlen_spans per (cu_seqlens_q, cu_seqlens_k) pair (`derived_once`): every layer passes the same


def _spans_of(cu_q, cu_k, total_q, total_k, causal, window_size) -> tuple[torch.Tensor, torch.Tensor]:
    """`varlen_spans`, once per cu_seqlens pair and settings (its ~20 small ops cost more host time than a short
    call's kernel)."""
    key = (total_q, total_k, bool(causal), tuple(window_size), id(cu_k), cu_k._version)
    ref, spans = derived_once(_SPANS, cu_q, key, lambda: (weakref.ref(cu_k), varlen_spans(cu_q, cu_k, total_q,
                                                                                          total_k, causal,
                                                                                          window_size)))
    if ref() is not cu_k:  # another tensor took the id of the one these were made for
        spans = varlen_spans(cu_q, cu_k, total_q, total_k, causal, window_size)
    return spans


def _varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window_size, key_mask, segments, alibi_slopes,
                   caller: str) -> tuple:
    """Varlen q, k, v [T, H, D] -> ([1, T, H, D] views, `varlen_spans`), with errors naming what varlen calls take."""
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError(f"{caller}: pass cu_seqlens_q and cu_seqlens_k together")
    if key_mask is not None or segments is not None:
        raise ValueError(f"{caller}: key_mask and segments are for dense [B, S, H, D] inputs, not with cu_seqlens")
    if alibi_slopes is not None:
        raise ValueError(f"{caller} takes no ALiBi with cu_seqlens (its distances shift per sequence); use "
                         f"hf_fastpath.kernels.flash_attention for varlen ALiBi")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{caller}: with cu_seqlens, {name} must be [total_tokens, heads, head_dim]; got shape "
                             f"{tuple(t.shape)}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dim() != 1 or cu.numel() < 1 or cu.dtype not in (torch.int32, torch.int64) or cu.device != q.device:
            raise ValueError(f"{caller}: {name} must be an int32/int64 [batch + 1] tensor on {q.device}; got "
                             f"{cu.dtype} {tuple(cu.shape)} on {cu.device}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"{caller}: cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1); got "
                         f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    spans = _spans_of(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], causal, window_size)
    return q[None], k[None], v[None], spans


def mask_args(key_mask, segments, batch, seq_q, seq_k, device) -> tuple:
    """(tensor, batch stride, plane stride, MASK_MODE) of a key mask (as one byte per key: the kernels load a tile's
    worth per key tile) or a segment table, checked as the Triton kernel checks them; (None, 0, 0, 0) for neither."""
    if key_mask is not None and key_mask.dtype not in (torch.bool, torch.uint8):
        key_mask = key_mask > 0
    return _key_mask_arg(key_mask, segments, batch, seq_q, seq_k, device)


def alibi_mode(slopes, window_right: int) -> int:
    """The kernels' ALIBI: 0 none; 2 when no key right of the diagonal is visible (causal, no right window edge), so
    that |i + Sk - Sq - j| = i + Sk - Sq - j and the bias splits into a per-key part in the scores and a per-row part
    that softmax cancels (forward: one add an element, not three; backward: none); else 1."""
    return 0 if slopes is None else 2 if window_right == 0 else 1


def alibi_args(alibi_slopes, batch, heads, device) -> tuple:
    """(fp32 slopes, batch stride) of ALiBi slopes [H] or [B, H]; (None, 0) for none."""
    if alibi_slopes is None:
        return None, 0
    if tuple(alibi_slopes.shape) not in ((heads, ), (batch, heads)) or alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes must be [num_heads] or [batch, num_heads] = [{heads}] or [{batch}, {heads}] "
                         f"on {device}; got {tuple(alibi_slopes.shape)} on {alibi_slopes.device}")
    return _slopes(alibi_slopes)  # as the Triton kernels take them


def _out_descriptor(out: torch.Tensor, elem) -> "TensorDescriptor":
    """out [B, Sq, H, D] as [B, Sq, H*D] in [1, 64, D] boxes: TMA clips a box at Sq, so a tile's rows past the
    sequence end are not written into the next sequence."""
    B, Sq, H, D = out.shape
    out3 = out.view(B, Sq, H * D)
    block = [1, ROWS_PER_WARPGROUP, D]
    return TensorDescriptor(out3, list(out3.shape), list(out3.stride()), block,
                            nvmma_layout(tuple(block), elem))
