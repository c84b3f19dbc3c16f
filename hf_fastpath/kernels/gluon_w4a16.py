"""W4A16 mixed-input GEMM for Hopper (sm_90) in Gluon, Machete style ("swap AB", register-A wgmma, warp
specialization). Status: GPU-verified on an H200 (sessions 12-13, 259 cases); `w4a16_matmul` runs it on Hopper for
24-512 rows inside CUDA graphs, where it measured fastest (`kernels.w4a16.GLUON_MIN_M / GLUON_MAX_M`; eagerly its
launch's host time loses: `w4a16.GLUON_EAGER`).

Same semantics and weight layout as `kernels.w4a16.w4a16_matmul` (layout: `kernels.w4a16_layout`): qweight int32
[K // 8, N] K-tiled and tile-major, scales / zeros [K // gs, N] in x's dtype, W[k, n] = s * (code - z), y = x @ W.

Why this shape (plain Triton cannot overlap the dequantization with the MMA: docs/w4a16.md, negative results):
- The kernel computes y^T[n, m] = sum_k W^T[n, k] x^T[k, m]: the dequantized weights are wgmma's *register* A
  operand (64 rows of N per warpgroup) and x^T is the shared-memory B operand (x's [BLOCK_M, 128] tile, loaded by
  TMA, read through `.permute((1, 0))`), so M sits in wgmma's N dimension (64 or 128 here).
- One CTA owns 128 columns of N (two consumer warpgroups x 64) and BLOCK_M rows of M. A 1-warp producer
  (`gl.warp_specialize`, few registers) TMA-loads, per K tile of 128 inputs, x's tile and the weight tile's
  [128, 16] packed words (the tile-major layout makes them one 2-D box of a [K / 128 * N, 16] view) into a ring
  of STAGES shared-memory slots (mbarriers "ready" / "empty" per slot).
- Each consumer, per K tile: loads its [64, 16] words from shared memory straight into the thread order of the
  A operand (nibble plane j of word column i is input 16 j + i, so the 8 planes side by side are the K = 128
  operand: a reshape of [64, 8, 16] that moves no data), dequantizes and issues the async wgmma; then waits with
  one wgmma group outstanding, so tile i + 1 is dequantized while the wgmma of tile i runs. Dequantization
  (`unpack`): "ptx" (default) is kernels/w4a16.py's GPU-verified PTX on 16-bit pairs (PRMT + LOP3 magic numbers
  bias + q, then (q - z) exact and one rounding of * s, ~1.6 SASS instructions a weight); "plain" does (q - z) * s
  in fp32 (q via the 2^23 magic number, ~6 a weight, any float zero point). For integer zero points both round
  s * (q - z) once to 16 bits: bitwise equal A operands (the GPU test checks it).
- Two register sets for A, alternating between even and odd K tiles and carried through the loop: the registers
  a wgmma reads are never rewritten before the wait that retires it (the read-after-write hazard of pipelined
  register-A wgmma, triton issue 9433 / PR 9514, which Triton 3.6 does not have).
- Scales and zeros (default, groups of 128 and more, N a multiple of 8): the producer brings each tile's 128
  scales and zeros through the ring with its weights, as 1-D TMA boxes of the flat [G * N] tensors (a box past N
  reads values only masked-out columns use; boxes that start off 16 bytes, N = 1001, faulted). Otherwise
  (`scales_by="load"`, groups of 32 / 64: one row per 16-input plane) the consumers load them one K tile ahead
  into registers: an unhidden load per tile, 1.04-1.49x slower (session 13).
- The output is stored transposed back (rows = M) with masks; x rows past M come from TMA's zero fill, weight
  columns past N read the next tile's words (finite garbage in masked columns).
- Tiles: BLOCK_N 128 (2 x 64), BLOCK_K 128, BLOCK_M (wgmma's N) 16 / 32 / 64 / 128 by M with 16 / 12 / 8 / 5
  stages (`config`); ~200 KB of shared memory. Launch maxnreg 168, setmaxnreg 240 consumers / 24 producer (as
  `gluon_attention`).
What ptxas needs to keep the wgmmas asynchronous (read off `ptxas -v` notes C7514/C7515 and the SASS, 3.6's
ptxas 12.8 and 3.9's 13.4; `tests/gluon_w4a16_builds.py` checks every build): no branch and no write of the
accumulator between a wgmma and the wait that retires it. Three things broke that and each made ptxas serialize
*every* wgmma (a `WARPGROUP.DEPBAR.LE gsb0, 0x0` after each HGMMA, so no overlap at all): (1) a masked scale
load whose mask held the scalar `i < n_k` (it became a branch; clamped indices now), (2) a conditional tail step
for odd tile counts (now a phantom tile wholly outside x and the weights, which TMA fills with zeros), (3) a
zero-trip path that initialized the accumulator after the loop (the first pair of steps now comes before it). Also:
a wait that names the in-flight accumulator in its deps (Gluon tutorials' `wait(1, deps=(acc,))`) draws C7514 in
this kernel; the accumulator is carried as the async token instead (`warpgroup_mma_init`).
- Split-K when the output tiles leave most SMs idle (small M): each split writes fp32 partials and torch sums
  them (deterministic; two extra small kernels). CTAs run in grouped order (GROUP_M row tiles per band) for L2.
- Tried and removed: 2 or 4 accumulators per warpgroup (`acc_parts`, sessions 13-14) timed within ±3% of one at
  M = 1-64 on the H200: the dependent wgmma chain is not what sets the small-M cost per K tile (docs/w4a16.md).
Limits (`supported` says no, `gluon_w4a16_matmul` raises): K a multiple of 128 (no ragged K tile), group size 32,
64 or a multiple of 128 (incl. -1 = K), bf16/fp16, sm_90. At M = 1 the plain-Triton fused kernel is faster (this
kernel 0.64-0.90x of it, ~0.56 µs per K tile against ~0.2 µs of weight bytes; session 13), at M = 16 on two of
four Llama-3 shapes.
"""

from __future__ import annotations

import functools

import torch
import triton

from .common import nvmma_layout
from .device import compute_major, on_input_device
from .launch import LaunchCache
from .w4a16 import PTX_CONSTS, PTX_NIBBLE_PAIRS, PTX_PLANE

try:  # Gluon and its Hopper module (Triton >= 3.5); without them `supported` says no and nothing is compiled
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma, warpgroup_mma_init,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAS_GLUON = False

__all__ = ["gluon_w4a16_matmul", "gluon_w4a16_matmul_rows", "supported", "config", "HAS_GLUON"]

BLOCK_K = 128  # inputs per K tile: 16 packed word rows, the 8 nibble planes of 16 inputs each
ROWS_PER_WARPGROUP = 64  # wgmma M: weight rows (output columns) per consumer warpgroup
BLOCK_N = 2 * ROWS_PER_WARPGROUP  # two consumer warpgroups per CTA
MAXNREG = 168  # 3 warpgroups x 128 threads x 168 <= 64K registers; setmaxnreg moves them to the consumers
CONSUMER_REGS, PRODUCER_REGS = 240, 24
SHARED_BYTES = 232448  # sm_90 opt-in shared memory per block
PLANE_GROUP_SIZES = (32, 64)  # groups smaller than a K tile: one scale row per 16-input plane
GROUP_M = 8  # row tiles per band of the CTA order (L2 reuse); not tuned on a GPU yet


def config(m: int) -> tuple[int, int]:
    """(BLOCK_M, STAGES) for M rows: the wgmma N is BLOCK_M, so rows past M are tensor-core work thrown away (at
    M = 1 a 64-row tile made each K tile ~0.28 µs of MMA against ~0.2 µs of weight bytes: the tile's measured
    ~0.8 µs at 4096 x 14336). Stages fill ~200 KB of shared memory (x tile BLOCK_M * 256 bytes + 8 KB of words +
    512 bytes of scales and zeros per stage). 256-row tiles spill under ptxas (128 accumulator + 64 A registers >
    the 168 it allocates), so larger M takes more 128-row tiles."""
    if m <= 16:
        return 16, 16
    if m <= 32:
        return 32, 12
    if m <= 64:
        return 64, 8
    return 128, 5


def _group_ok(group_size: int, k: int) -> bool:
    return group_size in PLANE_GROUP_SIZES or (group_size % BLOCK_K == 0 and k % group_size == 0)


# The PTX unpack of kernels/w4a16.py (GPU-verified there), per pair of words (a, b) = two consecutive inputs of one
# 16-input plane, i.e. one 32-bit register of the wgmma A fragment: PRMT gathers both words' low / high halves, and
# one LOP3 per plane makes the pair of "magic" 16-bit floats bias + q (bias 128 bf16, 1024 fp16): 8 outputs, plane j.
_UNPACK = "{{\n.reg .b32 lo, hi, a1, a2, a3, b1, b2, b3;\n" + PTX_NIBBLE_PAIRS + "}}"

if HAS_GLUON:  # per plane value pair with its own groups: kernels/w4a16.py's PTX_PLANE (q - z exact, one rounding)
    _UNPACK_BF16 = gl.constexpr(_UNPACK.format(magic=PTX_CONSTS["bf16"]["magic"]))
    _UNPACK_F16 = gl.constexpr(_UNPACK.format(magic=PTX_CONSTS["f16"]["magic"]))
    _PLANE_BF16 = gl.constexpr(PTX_PLANE.format(t="bf16", one=PTX_CONSTS["bf16"]["one"]))
    _PLANE_F16 = gl.constexpr(PTX_PLANE.format(t="f16", one=PTX_CONSTS["f16"]["one"]))
    _UNPACK_CONSTRAINTS = gl.constexpr("=r,=r,=r,=r,=r,=r,=r,=r,r,r")
    _PLANE_CONSTRAINTS = gl.constexpr("=r,r,r,r")

    # Triton 3.6 calls the TMA load `async_copy_global_to_shared`; 3.7+ renamed it `async_load` (the old name raises)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _REGS = gl.constexpr([CONSUMER_REGS, PRODUCER_REGS])  # setmaxnreg targets of the worker partitions

    @functools.lru_cache(maxsize=None)
    def scales_layout():
        """Shared layout of a scales / zeros box (scales_by="tma"): 128 16-bit values, unswizzled."""
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=1)

    @gluon.jit
    def _producer(x_desc, w_desc, s_desc, z_desc, x_smem, w_smem, s_smem, z_smem, ready, empty, m0, w_row0, s_row0,
                  N, kt0, n_steps, group_size, STAGES: gl.constexpr, SCALES_TMA: gl.constexpr):
        """TMA: x[m0:+BLOCK_M, 128 t:+128] and the words of 128 weight rows of K tile t = kt0 + i (rows
        w_row0 + t N... of the [K / 128 * N, 16] word view) into slot i % STAGES (SCALES_TMA: also that tile's
        scales and zeros of those rows, 128 values of the flat [G * N] tensors from s_row0 + (t * 128 //
        group_size) N; past N they run into the next row or off the end (zeros), for outputs that are never
        stored). Unsegmented w_row0 = s_row0 = n0; a segment (`_segment`) passes its own base, and its own width
        as N. A phantom tile (odd tile count: only the last split has one) lies past x: TMA fills it with zeros
        (x = 0 makes its product exactly 0, the weights it reads being finite)."""
        for i in range(n_steps):
            slot = i % STAGES
            # a fresh mbarrier counts as having completed the phase before 0: the first lap does not wait
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            if SCALES_TMA:
                mbarrier.expect(ready.index(slot), x_desc.block_type.nbytes + w_desc.block_type.nbytes
                                + s_desc.block_type.nbytes + z_desc.block_type.nbytes)
            else:
                mbarrier.expect(ready.index(slot), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            _tma_load(x_desc, [m0, (kt0 + i) * 128], ready.index(slot), x_smem.index(slot))
            _tma_load(w_desc, [(kt0 + i) * N + w_row0, 0], ready.index(slot), w_smem.index(slot))
            if SCALES_TMA:
                row = ((kt0 + i) * 128) // group_size * N + s_row0
                _tma_load(s_desc, [row], ready.index(slot), s_smem.index(slot))
                _tma_load(z_desc, [row], ready.index(slot), z_smem.index(slot))

    @gluon.jit
    def _scales(s_ptr, z_ptr, i, kt0, n_k, rows, N, group_size, L3: gl.constexpr, PLANE_GROUPS: gl.constexpr):
        """Raw scales and zeros of K tile kt0 + i (of this split's n_k) for this warpgroup's rows: [64, 1, 1]
        (one group per tile) or [64, 8, 1] (a group per 16-input plane). No masks: tiles past the end re-read the
        last one and rows past N read row N - 1 (finite values for outputs that are never stored). A mask with a
        tile condition became a branch in the loop, and a branch while a wgmma is in flight makes ptxas serialize
        them all (C7514)."""
        t = kt0 + gl.minimum(i, n_k - 1)
        rows = gl.minimum(rows, N - 1)
        if PLANE_GROUPS:
            planes = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
            group = (t * 128 + 16 * planes) // group_size
            offs = gl.expand_dims(group * N, 0) + gl.expand_dims(rows, 1)  # [64, 8]
            return gl.expand_dims(gl.load(s_ptr + offs), 2), gl.expand_dims(gl.load(z_ptr + offs), 2)
        else:
            offs = ((t * 128) // group_size) * N + rows
            s = gl.load(s_ptr + offs)
            z = gl.load(z_ptr + offs)
            return gl.expand_dims(gl.expand_dims(s, 1), 2), gl.expand_dims(gl.expand_dims(z, 1), 2)

    @gluon.jit
    def _dequant(words, s, z, dtype: gl.constexpr, L3: gl.constexpr, a_layout: gl.constexpr, PTX: gl.constexpr):
        """[64, 16] packed words (thread order of the A operand) -> the [64, 128] A operand, (q - z) * s in dtype.
        Element (n, j, i) of the [64, 8, 16] nibble tensor is input 16 j + i, so the reshape to [64, 128] is the
        operand's own order (assert_trivial: no data moves)."""
        if PTX:
            w = _planes_ptx(words, s, z, L3)
        else:
            shifts = 4 * gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
            shifts = gl.expand_dims(gl.expand_dims(shifts, 0), 2).to(gl.uint32)  # [1, 8, 1]
            words = words.to(gl.uint32, bitcast=True)  # logical shifts (an arithmetic one costs a sign extend)
            q = (gl.expand_dims(words, 1) >> shifts) & 0xF  # [64, 8, 16]
            # 2^23 + q as fp32 bits, minus 2^23: q exactly, without an int-to-float conversion
            qf = (q | 0x4B000000).to(gl.float32, bitcast=True) - 8388608.0
            sf = s.to(gl.float32)
            zs = z.to(gl.float32) * sf  # exact: a 16-bit float times a 16-bit float fits fp32's mantissa
            w = (qf * sf - zs).to(dtype)  # s * (q - z), rounded once to 16 bits (as the reference dequantizes)
        w = gl.reshape(w, [64, 128])
        return gl.convert_layout(w, a_layout, assert_trivial=True)

    @gluon.jit
    def _unpack_ptx(words, s):
        """[64, 16] packed words -> their 8 nibble planes p0..p7 ([64, 16] each), as bias + q pairs in s's dtype (the
        activation dtype, taken from a tensor: a dtype argument would arrive as a constexpr). pack=2 hands the asm
        two consecutive registers: words (n, i), (n, i + 1), one A register's pair."""
        dt = s.dtype
        if dt == gl.bfloat16:
            return gl.inline_asm_elementwise(_UNPACK_BF16, _UNPACK_CONSTRAINTS, [words], dtype=(dt, ) * 8,
                                             is_pure=True, pack=2)
        else:
            return gl.inline_asm_elementwise(_UNPACK_F16, _UNPACK_CONSTRAINTS, [words], dtype=(dt, ) * 8,
                                             is_pure=True, pack=2)

    @gluon.jit
    def _scale_planes(q, s, z):
        """Planes q (bias + q, from `_unpack_ptx`) -> s * (q - z) by kernels/w4a16.py's PTX_PLANE (q - z exact, one
        rounding); s, z broadcast against q."""
        dt = s.dtype  # (as a tensor's dtype: a dtype argument would arrive as a constexpr)
        if dt == gl.bfloat16:
            nzb = (-(z.to(gl.float32) + 128.0)).to(dt)
        else:
            nzb = (-(z.to(gl.float32) + 1024.0)).to(dt)
        nzb = gl.broadcast(nzb, q)[0]
        s = gl.broadcast(s, q)[0]
        if dt == gl.bfloat16:
            return gl.inline_asm_elementwise(_PLANE_BF16, _PLANE_CONSTRAINTS, [q, nzb, s], dtype=dt,
                                             is_pure=True, pack=2)
        else:
            return gl.inline_asm_elementwise(_PLANE_F16, _PLANE_CONSTRAINTS, [q, nzb, s], dtype=dt,
                                             is_pure=True, pack=2)

    @gluon.jit
    def _planes_ptx(words, s, z, L3: gl.constexpr):
        """The PTX path of _dequant: ~2 instructions a weight (16-bit pairs) instead of ~6 (fp32, one at a time)."""
        p0, p1, p2, p3, p4, p5, p6, p7 = _unpack_ptx(words, s)
        # stack the planes on a new axis 1 (j = 4 a + 2 b + c): [64, 16] x 8 -> [64, 8, 16], register renaming
        q = gl.join(gl.join(gl.join(p0, p1), gl.join(p2, p3)), gl.join(gl.join(p4, p5), gl.join(p6, p7)))
        q = gl.reshape(gl.permute(q, (0, 4, 3, 2, 1)), [64, 8, 16])
        return _scale_planes(gl.convert_layout(q, L3, assert_trivial=True), s, z)

    @gluon.jit
    def _step(i, acc, a_old, s, z, w_smem, x_smem, s_smem, z_smem, ready, empty, s_ptr, z_ptr, rows, N, kt0, n_k,
              group_size, ROW0: gl.constexpr, STAGES: gl.constexpr, L3: gl.constexpr, a_layout: gl.constexpr,
              PLANE_GROUPS: gl.constexpr, PTX: gl.constexpr, SCALES_TMA: gl.constexpr):
        """K tile i: dequantize (while wgmma i - 1 runs), issue wgmma i, retire wgmma i - 1 and free its slot.
        s, z are tile i's scales (loaded one step earlier); returns tile i + 1's (SCALES_TMA: they come with the
        tile through the producer's ring instead, and s, z only pass through). a_old is the A operand of wgmma
        i - 1: passing it through the wait keeps its registers untouched until that wgmma is done."""
        slot = i % STAGES
        if SCALES_TMA:
            s_next, z_next = s, z
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            row_layout: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, L3))
            s = gl.expand_dims(gl.expand_dims(s_smem.index(slot).slice(ROW0, 64).load(row_layout), 1), 2)
            z = gl.expand_dims(gl.expand_dims(z_smem.index(slot).slice(ROW0, 64).load(row_layout), 1), 2)
        else:
            s_next, z_next = _scales(s_ptr, z_ptr, i + 1, kt0, n_k, rows, N, group_size, L3, PLANE_GROUPS)
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        words = w_smem.index(slot).slice(ROW0, 64).load(gl.SliceLayout(1, L3))
        a = _dequant(words, s, z, x_smem.dtype, L3, a_layout, PTX)
        acc = warpgroup_mma(a, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
        # groups retire in order: wgmma i - 1 is done. acc (wgmma i's, in flight) stays an async token and out of
        # deps: a wait that names in-flight accumulator registers makes ptxas serialize every wgmma (C7514)
        a_old = warpgroup_mma_wait(num_outstanding=1, deps=(a_old, ))
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1, pred=i > 0)
        return acc, a, s_next, z_next

    @gluon.jit
    def _store_tile(acc, y_ptr, M, N, m0, row0, acc_layout: gl.constexpr):
        """acc [64 output columns from row0, BLOCK_M rows from m0] -> y[m, n] (transposed back), masked."""
        BLOCK_M: gl.constexpr = acc.type.shape[1]
        n_idx = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
        m_idx = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_layout))
        ptrs = y_ptr + gl.expand_dims(m_idx.to(gl.int64) * N, 0) + gl.expand_dims(n_idx, 1)
        mask = gl.expand_dims(m_idx < M, 0) & gl.expand_dims(n_idx < N, 1)
        gl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _consumer(x_smem, w_smem, s_smem, z_smem, ready, empty, s_ptr, z_ptr, y_ptr, M, N, kt0, n_k, n_steps,
                  group_size, m0, n0, WARPGROUP: gl.constexpr, STAGES: gl.constexpr, PLANE_GROUPS: gl.constexpr,
                  PTX: gl.constexpr, SCALES_TMA: gl.constexpr):
        BLOCK_M: gl.constexpr = x_smem.type.shape[1]
        ROW0: gl.constexpr = WARPGROUP * 64
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_M, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        # [64 rows, 8 planes, 16 word columns] in the A operand's thread order (16-bit wgmma A fragment: lane
        # 4 g + t holds rows g, g + 8 and inputs 2t, 2t + 1, 2t + 8, 2t + 9 of each 16-input slice; warp w
        # rows 16 w...). Word (n, i) feeds inputs 16 j + i, so a thread holds every plane of its words.
        L3: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [8, 0, 0], [0, 0, 8], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
            lane_bases=[[0, 0, 2], [0, 0, 4], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 8, 16])

        rows = n0 + ROW0 + gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        acc = warpgroup_mma_init(gl.zeros([64, BLOCK_M], gl.float32, acc_layout))  # an async token in the loop
        a_even = gl.zeros([64, 128], x_smem.dtype, a_layout)
        a_odd = gl.zeros([64, 128], x_smem.dtype, a_layout)
        s, z = _scales(s_ptr, z_ptr, 0, kt0, n_k, rows, N, group_size, L3, PLANE_GROUPS)  # (SCALES_TMA: unused)
        # Two A register sets, even and odd tiles: the dequant of tile i never writes the registers that the
        # still running wgmma i - 1 reads. The loop runs whole pairs (n_steps even: an odd n_k gets a phantom
        # tile that TMA fills with zeros) and the first pair comes before it (n_steps >= 2), so there is no
        # branch and no accumulator write while a wgmma is in flight: ptxas serializes every wgmma otherwise.
        acc, a_even, s, z = _step(0, acc, a_odd, s, z, w_smem, x_smem, s_smem, z_smem, ready, empty, s_ptr, z_ptr,
                                  rows, N, kt0, n_k, group_size, ROW0, STAGES, L3, a_layout, PLANE_GROUPS, PTX,
                                  SCALES_TMA)
        acc, a_odd, s, z = _step(1, acc, a_even, s, z, w_smem, x_smem, s_smem, z_smem, ready, empty, s_ptr, z_ptr,
                                 rows, N, kt0, n_k, group_size, ROW0, STAGES, L3, a_layout, PLANE_GROUPS, PTX,
                                 SCALES_TMA)
        for i in range(2, n_steps, 2):
            acc, a_even, s, z = _step(i, acc, a_odd, s, z, w_smem, x_smem, s_smem, z_smem, ready, empty, s_ptr,
                                      z_ptr, rows, N, kt0, n_k, group_size, ROW0, STAGES, L3, a_layout,
                                      PLANE_GROUPS, PTX, SCALES_TMA)
            acc, a_odd, s, z = _step(i + 1, acc, a_even, s, z, w_smem, x_smem, s_smem, z_smem, ready, empty, s_ptr,
                                     z_ptr, rows, N, kt0, n_k, group_size, ROW0, STAGES, L3, a_layout,
                                     PLANE_GROUPS, PTX, SCALES_TMA)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        # (the last slot is not released: the producer is done)
        _store_tile(acc, y_ptr, M, N, m0, n0 + ROW0, acc_layout)

    @gluon.jit
    def _segment(n0, N, k_tiles, group_size, seg1, seg2):
        """Up to three weights stored back to back, each packed on its own (`w4a16_matmul_concat`'s parts), as one
        [K, N] layer: the part that holds output column n0 (columns [0, seg1), [seg1, seg2), [seg2, N); each part a
        whole number of 128-column tiles) -> (its first word row + n0's offset in it, the same in the flat
        scales, its width). A part of width Nj starting at column c0 is k_tiles * Nj word rows from k_tiles * c0,
        and G * Nj scales from G * c0."""
        in1 = (n0 >= seg1).to(gl.int32)
        in2 = (n0 >= seg2).to(gl.int32)
        start = in1 * seg1 + in2 * (seg2 - seg1)
        width = seg1 + in1 * (seg2 - 2 * seg1) + in2 * (N - 2 * seg2 + seg1)
        return k_tiles * start + (n0 - start), (k_tiles * 128 // group_size) * start + (n0 - start), width

    @gluon.jit
    def _w4a16_kernel(x_desc, w_desc, s_desc, z_desc, s_ptr, z_ptr, y_ptr, M, N, k_tiles, chunk, group_size, seg1,
                      seg2, STAGES: gl.constexpr, PLANE_GROUPS: gl.constexpr, PTX: gl.constexpr,
                      GROUP_M: gl.constexpr, SCALES_TMA: gl.constexpr, SEGMENTED: gl.constexpr):
        """One CTA: output tile (m0, n0) over K tiles [kt0, kt0 + n_k) of its split (split-K: `chunk` tiles a
        split, even when there are several, so only the last split can have a phantom tile; each split writes its
        own fp32 partial y_ptr[split], which the host sums)."""
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        # Grouped order (Triton's matmul tutorial): CTAs running together cover GROUP_M row tiles x a band of
        # column tiles, so both their x tiles and their weight tiles stay in L2 (8192 x 28672: all weight tiles,
        # 117 MB, would not, and N-fastest order re-read them from HBM for every row tile).
        pid = gl.program_id(0)
        tiles_m = gl.cdiv(M, BLOCK_M)
        tiles_n = gl.cdiv(N, 128)
        split = pid // (tiles_m * tiles_n)
        pid = pid % (tiles_m * tiles_n)
        kt0 = split * chunk
        n_k = gl.minimum(chunk, k_tiles - kt0)
        n_steps = n_k + n_k % 2
        y_ptr += split.to(gl.int64) * M * N
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = gl.minimum(tiles_m - first_m, GROUP_M)
        m0 = (first_m + (pid % per_group) % group_rows) * BLOCK_M
        n0 = ((pid % per_group) // group_rows) * 128

        x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        if SCALES_TMA:
            s_smem = gl.allocate_shared_memory(s_desc.dtype, [STAGES] + s_desc.block_type.shape, s_desc.layout)
            z_smem = gl.allocate_shared_memory(z_desc.dtype, [STAGES] + z_desc.block_type.shape, z_desc.layout)
        else:  # not read
            s_smem = w_smem
            z_smem = w_smem
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumers release a slot

        if SEGMENTED:  # (scales by TMA: the host checks)
            w_row0, s_row0, n_part = _segment(n0, N, k_tiles, group_size, seg1, seg2)
        else:
            w_row0, s_row0, n_part = n0, n0, N
        gl.warp_specialize([
            (_consumer, (x_smem, w_smem, s_smem, z_smem, ready, empty, s_ptr, z_ptr, y_ptr, M, N, kt0, n_k, n_steps,
                         group_size, m0, n0, 0, STAGES, PLANE_GROUPS, PTX, SCALES_TMA)),
            (_consumer, (x_smem, w_smem, s_smem, z_smem, ready, empty, s_ptr, z_ptr, y_ptr, M, N, kt0, n_k, n_steps,
                         group_size, m0, n0, 1, STAGES, PLANE_GROUPS, PTX, SCALES_TMA)),
            (_producer, (x_desc, w_desc, s_desc, z_desc, x_smem, w_smem, s_smem, z_smem, ready, empty, m0, w_row0,
                         s_row0, n_part, kt0, n_steps, group_size, STAGES, SCALES_TMA)),
        ], [4, 1], _REGS)

    _LAUNCH = LaunchCache(_w4a16_kernel)


def _chunk_for(k_tiles: int, splits: int) -> int:
    """K tiles per split for about `splits` splits: even whenever there are several (a phantom tile, added to an
    odd count, must lie past K, so only the last split may have an odd count)."""
    if splits <= 1 or k_tiles <= 2:
        return k_tiles
    return 2 * -(-k_tiles // (2 * splits))


def _split_chunk(tiles: int, k_tiles: int, n_sms: int) -> int:
    """Split K only when the output tiles leave most SMs idle (one CTA per SM fits: ~200 KB of shared memory):
    about one wave of CTAs, each with >= 8 K tiles. Not tuned on a GPU yet."""
    if tiles * 2 > n_sms:
        return k_tiles
    return _chunk_for(k_tiles, max(1, min(n_sms // tiles, k_tiles // 8)))


def _num_sms(device) -> int:
    from .device import num_sms

    return num_sms(device)


def scales_by_tma(n: int, group_size: int) -> bool:
    """Whether the producer can bring the scales and zeros by TMA: 128-value boxes of the flat [G * N] tensors,
    one per K tile (groups of >= 128 inputs) starting on 16 bytes (N = 1001 raised an illegal-instruction fault
    on the H200)."""
    return group_size % BLOCK_K == 0 and n % 8 == 0


def supported(x: torch.Tensor, qweight: torch.Tensor, group_size: int) -> bool:
    """Whether `gluon_w4a16_matmul` takes these inputs on this machine (else the caller falls back)."""
    if not (HAS_GLUON and isinstance(x, torch.Tensor) and isinstance(qweight, torch.Tensor)):
        return False
    if not (x.is_cuda and qweight.is_cuda and x.dim() >= 1 and x.dtype in (torch.bfloat16, torch.float16)
            and qweight.dtype == torch.int32 and qweight.dim() == 2):
        return False
    k = qweight.shape[0] * 8
    gs = k if group_size in (-1, None) else int(group_size)
    return (compute_major(x.device) == 9 and k > 0 and k % BLOCK_K == 0
            and x.shape[-1] == k and gs > 0 and _group_ok(gs, k))


def _check(x, qweight, scales, zeros, group_size, scales_by="load"):
    what = "gluon_w4a16_matmul"
    if not HAS_GLUON:
        raise ValueError(f"{what} needs Triton with Gluon's Hopper module (triton >= 3.6); use "
                         "hf_fastpath.kernels.w4a16.w4a16_matmul instead")
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float16) or x.dim() < 1:
        raise ValueError(f"{what}: x must be a float16 or bfloat16 tensor [..., K], got "
                         f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    if not isinstance(qweight, torch.Tensor) or qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"{what}: qweight must be a 2-D int32 tensor [K // 8, N] (w4a16_pack's layout), got "
                         f"{getattr(qweight, 'dtype', type(qweight))} {tuple(getattr(qweight, 'shape', ()))}")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"{what}: x has {x.shape[-1]} features but qweight holds K = {k} (qweight.shape[0] * 8)")
    if k == 0 or k % BLOCK_K != 0:
        raise ValueError(f"{what}: K = {k} must be a positive multiple of {BLOCK_K} (no ragged K tile); use "
                         "w4a16_matmul for this layer")
    gs = k if group_size in (-1, None) else int(group_size)
    if gs <= 0 or k % gs != 0 or not _group_ok(gs, k):
        raise ValueError(f"{what}: group_size {group_size} is not supported (32, 64, a multiple of 128 dividing "
                         f"K = {k}, or -1); use w4a16_matmul for this layer")
    if scales_by == "tma" and not scales_by_tma(n, gs):
        raise ValueError(f"{what}: scales_by='tma' takes group sizes that are multiples of {BLOCK_K} (or one "
                         f"group) and N a multiple of 8 (each box starts on 16 bytes), got group_size {group_size}, "
                         f"N = {n}; use scales_by='load'")
    for name, t in (("scales", scales), ("zeros", zeros)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (k // gs, n):
            raise ValueError(f"{what}: {name} must have shape [K // group_size, N] = [{k // gs}, {n}], got "
                             f"{tuple(getattr(t, 'shape', ()))}")
        if t.dtype != x.dtype:
            raise ValueError(f"{what}: {name} dtype {t.dtype} differs from x's {x.dtype}; cast it once at load "
                             f"time ({name}.to({x.dtype}))")
    for name, t in (("x", x), ("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        if not t.is_cuda:
            raise ValueError(f"{what}: {name} is on {t.device}; this kernel runs on Hopper GPUs only (elsewhere use "
                             "w4a16_matmul)")
    if any(t.device != x.device for t in (qweight, scales, zeros)):
        raise ValueError(f"{what}: x, qweight, scales and zeros must be on one device")
    if compute_major(x.device) != 9:
        raise ValueError(f"{what} runs on Hopper (sm_90) GPUs only; elsewhere use w4a16_matmul")
    return k, n, gs


@on_input_device
def gluon_w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       group_size: int, *, unpack: str = "ptx", splits: int | None = None,
                       scales_by: str = "auto") -> torch.Tensor:
    """y = x @ W with W held as 4-bit words (`w4a16_pack`'s layout), as `w4a16_matmul`: x [..., K] bf16/fp16,
    returns [..., N] in x's dtype. group_size: 32, 64, a multiple of 128, or -1 (one group over K).
    unpack: "ptx" (16-bit pair arithmetic, exact q - z for integer zero points, as every checkpoint format stores)
    or "plain" (fp32 arithmetic, any float zero point; ~3x the dequantization instructions).
    splits: K splits (None: enough to fill the GPU when there are few output tiles, i.e. small M); with more than
    one, fp32 partial sums are written and summed (deterministically) by torch.
    scales_by: "tma" (the producer brings each tile's scales and zeros through the ring with its weights: 1.04-1.49x
    faster on the H200, session 13; group sizes that are a multiple of 128 or one group, N a multiple of 8),
    "load" (the consumers load them one tile ahead), or "auto" (default): "tma" where it applies."""
    if unpack not in ("ptx", "plain"):
        raise ValueError(f"gluon_w4a16_matmul: unpack must be 'ptx' or 'plain', got {unpack!r}")
    if scales_by not in ("auto", "load", "tma"):
        raise ValueError(f"gluon_w4a16_matmul: scales_by must be 'auto', 'load' or 'tma', got {scales_by!r}")
    if splits is not None and (not isinstance(splits, int) or splits < 1):
        raise ValueError(f"gluon_w4a16_matmul: splits must be a positive int or None, got {splits!r}")
    k, n, gs = _check(x, qweight, scales, zeros, group_size, scales_by)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = gluon_w4a16_matmul_rows(x2, qweight.contiguous(), scales.contiguous(), zeros.contiguous(), gs,
                                unpack=unpack, splits=splits, scales_by=scales_by)
    return y.reshape(*lead, n)


def gluon_w4a16_matmul_rows(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                            group_size: int, *, unpack: str = "ptx", splits: int | None = None,
                            scales_by: str = "auto", segments: tuple[int, int] | None = None) -> torch.Tensor:
    """`gluon_w4a16_matmul` without its argument checks, for callers that checked the layer once and asked
    `supported` (`w4a16_matmul_rows`): x2 [M, K] with unit column stride on x2's current device, contiguous
    weights in x2's dtype, group_size the effective one. Returns [M, N]. Its host time is what an eager prefill
    pays per linear: the launch skips Triton's argument binding (`LaunchCache`, ~50 µs on the H200's host).
    segments=(seg1, seg2): qweight / scales / zeros span up to three weights packed each on its own and stored back
    to back (`w4a16_matmul_concat`'s parts, columns [0, seg1), [seg1, seg2), [seg2, N); seg2 = N for two), each
    a multiple of 128 columns wide; scales by TMA only. GPU-tested in session 14 (float64, a CUDA-graph dispatch)."""
    m, k = x2.shape
    n = qweight.shape[1]
    y = torch.empty((m, n), device=x2.device, dtype=x2.dtype)
    if m == 0 or n == 0:
        return y
    if x2.stride(0) != k or x2.data_ptr() % 16 != 0:  # TMA: dense rows, a 16-byte aligned base
        x2 = x2.clone(memory_format=torch.contiguous_format)
    if qweight.data_ptr() % 16 != 0:  # a view into a larger buffer: TMA needs a 16-byte aligned base
        qweight = qweight.clone()
    s_desc = z_desc = None
    if scales_by == "tma" or (scales_by == "auto" and scales_by_tma(n, group_size)):
        s_desc, z_desc = (TensorDescriptor(t.view(-1) if t.data_ptr() % 16 == 0 else t.reshape(-1).clone(),
                                           [t.numel()], [1], [BLOCK_N], scales_layout()) for t in (scales, zeros))
    block_m, stages = config(m)
    elem = gl.bfloat16 if x2.dtype == torch.bfloat16 else gl.float16
    x_block = (block_m, BLOCK_K)
    x_desc = TensorDescriptor(x2, [m, k], [k, 1], list(x_block), nvmma_layout(x_block, elem))
    words = qweight.view(-1, 16)  # tile-major: K tile t's words for column c are row t * N + c, 16 words each
    w_desc = TensorDescriptor(words, list(words.shape), [16, 1], [BLOCK_N, 16], nvmma_layout((BLOCK_N, 16), gl.int32))
    tiles = triton.cdiv(n, BLOCK_N) * triton.cdiv(m, block_m)
    k_tiles = k // BLOCK_K
    chunk = _split_chunk(tiles, k_tiles, _num_sms(x2.device)) if splits is None else _chunk_for(k_tiles, splits)
    n_splits = triton.cdiv(k_tiles, chunk)
    # several splits: fp32 partials [splits, M, N] summed here (deterministic: no atomics)
    out = y if n_splits == 1 else torch.empty((n_splits, m, n), device=x2.device, dtype=torch.float32)
    plane_groups, ptx, tma_scales = group_size in PLANE_GROUP_SIZES, unpack == "ptx", s_desc is not None
    seg1, seg2 = segments if segments is not None else (n, n)
    if segments is not None and (not tma_scales or seg1 % BLOCK_N or seg2 % BLOCK_N or n % BLOCK_N
                                 or not 0 < seg1 <= seg2 <= n):
        raise ValueError(f"gluon_w4a16_matmul_rows: segments {segments} over N = {n} need parts that are whole "
                         f"{BLOCK_N}-column tiles and scales by TMA")
    _LAUNCH.launch((tiles * n_splits, ), (x_desc, w_desc, s_desc, z_desc, scales, zeros, out, m, n, k_tiles, chunk,
                                         group_size, seg1, seg2),
                   dict(STAGES=stages, PLANE_GROUPS=plane_groups, PTX=ptx, GROUP_M=GROUP_M, SCALES_TMA=tma_scales,
                        SEGMENTED=segments is not None, num_warps=4, maxnreg=MAXNREG),
                   (stages, plane_groups, ptx, tma_scales, segments is not None))
    if n_splits > 1:
        torch.sum(out, dim=0, out=y)  # fp32 sums rounded once into y
    return y
