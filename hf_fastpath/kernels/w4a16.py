"""W4A16 matmuls: 4-bit packed weights, fp16/bf16 activations, fp32 accumulation, in Triton.

Weight layout: `w4a16_layout` (the contract shared with `hf_fastpath.quantization`): qweight int32 [K // 8, N],
K-tiled and tile-major; scales, zeros [G, N] in the activation dtype; W[k, n] = scales[k // gs, n] * (code(k, n) -
zeros[k // gs, n]), y = x @ W.

How the kernels avoid the usual costs (all measured / read off the SASS on sm_90):
  * M <= 192 (decode and short prefill) computes y^T = W^T x^T so the weights are the *register* operand of the tensor-core
    dot: the packed words come through shared memory (cp.async, pipelined over K tiles), the unpack runs in the MMA
    operand layout and no unpacked weight touches shared memory.
  * The K-tiled layout makes nibble plane j of a [BLOCK_N, 16] word tile the j-th 16-input slice of the K tile:
    the 8 planes concatenate (register renaming) into one [BLOCK_N, 128] operand, and x^T[128, BLOCK_M] goes from
    memory straight into the dot's shared-memory operand. One dot per K tile: its 8 wgmmas issue back to back
    with one wait, where the GPTQ order needed 8 dots, each re-staging a strided x slice through shared memory
    with a fence and a wait. The tile-major storage keeps the weight copy 16 bytes wide: the operand wants 4
    consecutive word rows per thread, which the GPTQ [K / 8, N] order spreads N words apart (4-byte copies, M = 1
    2.7x slower on the H200).
  * Every load in the K loop is wide enough for Triton's cp.async pipeline (>= 4 bytes per thread, contiguity
    not hidden by a clamp): per-plane scales load as one masked [BLOCK_N, 8] tile split in registers, the
    input gradient's as 2-D tiles; the per-tile scales/zeros of the forward, [BLOCK_N] vectors, are prefetched one
    tile ahead by hand. Synchronous loads inside the loop held the first version at ~1 TB/s.
  * The unpack is a few PTX instructions per *pair* of words: PRMT pairs two words' halves, and one LOP3 turns a
    nibble pair into two fp16/bf16 "magic" numbers (bias + q, bias = 1024 fp16 / 128 bf16), ~1 instruction per
    weight instead of shift + int-to-float convert + scale per weight.
  * Scales and zeros (MODE): up to 16 rows the dot runs on bias + q and they apply once per output and tile,
    y += s * (x.(bias+q) - (z + bias) * sum(x)); 17-32 rows dequantize in pairs (q*s - z*s, one fma); 33-64 rows
    dot the exact q - z (integer zero points) and scale after. Groups that do not cover whole K tiles dequantize
    each plane with its own group.
  * Large M (> 192): dequantize W once into a scratch tile and call cuBLAS. The fused kernel (64-row tiles, each
    re-dequantizing its weights) wins up to 192 rows on an H200 (1.1-2.4x dequantize + cuBLAS, whose x @ W
    is slow at M = 128), loses from 256-384; with big tiles (up to 256 x 128, 8 warps) it stays <= 0.6x cuBLAS,
    because ptxas serializes wgmmas whose A operand comes from registers (a wait after each), so the unpack
    never overlaps the MMA (session 9, benchmarks/results/archive/w4a16_prefill_fused_s9.json).
  * On Hopper, 24-512 rows run the Gluon kernel instead (`gluon_w4a16`): a TMA producer warp and register-A
    wgmmas that stay asynchronous, so the unpack overlaps the MMA (GLUON_MIN_M / GLUON_MAX_M); only while a CUDA
    graph is captured: eagerly its launch's host time outweighs its GPU-time lead (GLUON_EAGER).
  * Split-K: partial sums meet in an fp32 workspace through atomics; the last program of each tile (a ticket
    counter) casts the sum into the output and re-zeroes its workspace, so a call is one launch.
  * Layers that share their input (q/k/v, gate/up) run as one launch when stored back to back (SEGMENTED mode,
    `w4a16_matmul_concat`): a program's column block lies in one layer, whose own layout it reads.
  * Up to 8 rows, 1- or 8-row tiles: Triton pads the MMA to its minimum shape, but the accumulator, the epilogue
    and the registers shrink (mma.sync, 128 registers instead of wgmma's 227 at 16 rows: twice the resident warps).
Under TRITON_INTERPRET=1 (CPU tests) the same kernels run with plain Triton ops in place of the PTX and fp32 dots.

Measured status and the gaps to the targets: docs/w4a16.md and benchmarks/results/w4a16.json.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError

from .common import cdiv, gluon_build_failed, interpreting
from .device import cuda_index, current_stream, num_sms, on_input_device
from .launch import COMPILE_OPTIONS, LaunchCache
from .w4a16_layout import k_tile_order, w4a16_pack, w4a16_unpack  # noqa: F401  (re-exported: the public API)

__all__ = ["w4a16_matmul", "w4a16_matmul_rows", "w4a16_matmul_concat", "w4a16_matmul_concat_rows",
           "w4a16_back_to_back", "w4a16_segment_columns", "w4a16_experts_matmul_rows", "w4a16_expert_tiles",
           "w4a16_expert_block_m", "expert_tile_count", "w4a16_matmul_grad_input", "w4a16_dequantize", "w4a16_pack",
           "w4a16_unpack", "k_tile_order"]

logger = logging.getLogger(__name__)

DECODE_MAX_M = 192  # forward: above this many rows dequantize + cuBLAS (H200: faster from M = 256 on 4096^2,
# from 384 on every Llama-3 shape; benchmarks/results/archive/w4a16_prefill_crossover_s4.json)
# Hopper: from 24 to 512 rows the Gluon kernel (`gluon_w4a16`: TMA producer warp, register-A wgmma overlapping the
# unpack) runs instead. H200, Llama-3 shapes, scales by TMA, 16/32-row tiles (benchmarks/results/gluon_w4a16.json,
# session 13): 1.09-1.56x the fused kernel at 32-64 rows (its 32-row tile beat the fused kernel's 24-row times on
# all four shapes), 1.00-1.47x the better of the fused kernel and dequantize + cuBLAS at 128-512; at 16 rows it won
# on two shapes of four, at 1 row on none (0.64-0.90x); from 768 it ties dequantize + cuBLAS (0.89-1.10x,
# gluon_w4a16_crossover.json).
GLUON_MIN_M, GLUON_MAX_M = 24, 512
# ...inside CUDA graphs only (torch.compile mode="reduce-overhead", static-cache generate), unless GLUON_EAGER: its
# launch costs more host time than the fused kernel's (57 vs 33 µs a call on one H200 host, 120-140 vs 35-50 on
# another: TMA descriptors, Triton's launcher for them, split-K partial sums), and eager forward passes are
# host-bound at these row counts. 4-layer Llama-3-8B W4A16 prefill of 48-512 tokens (benchmarks/results/
# w4a16_prefill.json, session 13): from a CUDA graph 1.07-1.17x faster with Gluon; eagerly 0.52-0.90x with it.
GLUON_EAGER = False
GLUON_BUILD_ERRORS: list[str] = []  # the Gluon kernel failed to build with this Triton: not tried again
GRAD_DECODE_MAX_M = 16  # grad_input: the fused kernel only wins for very few rows (H200 sweep)
_BLOCK_K = 128  # input rows per K step of the decode kernels (16 packed rows: the minimum tensor-core K)




# ----------------------------------------------------------------------------------------------------------------
# Unpacking: PTX on the GPU, plain Triton ops under the interpreter (or if the PTX self-check ever fails)
# ----------------------------------------------------------------------------------------------------------------

# Two words in ($8, $9) -> eight registers, each two 16-bit floats: nibble j of word $8 (low half) and of $9 (high).
# lo/hi gather the low/high 16 bits of both words, so nibbles (j, j) of the two words sit 16 bits apart and one
# LOP3 ((v & 0x000F000F) | magic) makes the pair of magic numbers bias + q.
PTX_NIBBLE_PAIRS = """prmt.b32 lo, $8, $9, 0x5410;
prmt.b32 hi, $8, $9, 0x7632;
shr.u32 a1, lo, 4;
shr.u32 a2, lo, 8;
shr.u32 a3, lo, 12;
shr.u32 b1, hi, 4;
shr.u32 b2, hi, 8;
shr.u32 b3, hi, 12;
lop3.b32 $0, lo, 0x000F000F, {magic}, 0xEA;
lop3.b32 $1, a1, 0x000F000F, {magic}, 0xEA;
lop3.b32 $2, a2, 0x000F000F, {magic}, 0xEA;
lop3.b32 $3, a3, 0x000F000F, {magic}, 0xEA;
lop3.b32 $4, hi, 0x000F000F, {magic}, 0xEA;
lop3.b32 $5, b1, 0x000F000F, {magic}, 0xEA;
lop3.b32 $6, b2, 0x000F000F, {magic}, 0xEA;
lop3.b32 $7, b3, 0x000F000F, {magic}, 0xEA;
"""  # registers lo, hi, a1-a3, b1-b3 declared by the caller; also used by kernels/gluon_w4a16.py
_PTX_HEAD = "{{\n.reg .b32 lo, hi, a1, a2, a3, b1, b2, b3, c1, c2, s2, z2;\n" + PTX_NIBBLE_PAIRS
# Dequantize each pair: q = (bias + q) - bias exactly, then q * s + (-z * s) with one rounding. $10/$11 hold the
# scale and -zero*scale pairs of the two words.
_PTX_DEQUANT = "".join(
    "fma.rn.{t}x2 $%d, $%d, c1, c2;\nfma.rn.{t}x2 $%d, $%d, $10, $11;\n" % (i, i, i, i) for i in range(8))
PTX_CONSTS = {"bf16": dict(magic="0x43004300", one="0x3F803F80", mbias="0xC300C300"),
               "f16": dict(magic="0x64006400", one="0x3C003C00", mbias="0xE400E400")}


def _ptx(kind: str, dequant: bool) -> str:
    c = PTX_CONSTS[kind]
    body = ""
    if dequant:
        body = f"mov.b32 c1, {c['one']};\nmov.b32 c2, {c['mbias']};\n" + _PTX_DEQUANT.format(t=kind)
    return _PTX_HEAD.format(magic=c["magic"]) + body + "}"


# One plane value pair with its own groups: (bias + q) - (z + bias) = q - z exactly, then * s with one rounding
# ($1: the magic pair, $2: -(z + bias), $3: s; -0.0 as the addend keeps the product exact before rounding).
PTX_PLANE = """{{
.reg .b32 t, one, nz;
mov.b32 one, {one};
mov.b32 nz, 0x80008000;
fma.rn.{t}x2 t, $1, one, $2;
fma.rn.{t}x2 $0, t, $3, nz;
}}"""
PLANE_BF16 = tl.constexpr(PTX_PLANE.format(t="bf16", one=PTX_CONSTS["bf16"]["one"]))
PLANE_F16 = tl.constexpr(PTX_PLANE.format(t="f16", one=PTX_CONSTS["f16"]["one"]))
PLANE_CONSTRAINTS = tl.constexpr("=r,r,r,r")
UNPACK_BF16 = tl.constexpr(_ptx("bf16", False))
UNPACK_F16 = tl.constexpr(_ptx("f16", False))
DEQUANT_BF16 = tl.constexpr(_ptx("bf16", True))
DEQUANT_F16 = tl.constexpr(_ptx("f16", True))
DEQUANT_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r")  # 8 pair outputs; 2 words, s pair, -z*s pair
UNPACK_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r,=r,=r,=r,=r,r,r")


@triton.jit
def _nibbles8(w, s, nzs, like, DEQUANT: tl.constexpr, USE_PTX: tl.constexpr):
    """Word tile -> 8 tiles of its shape in like's dtype: nibble j of every word, as bias + q (DEQUANT=False) or
    dequantized q * s + nzs (s, nzs = -z * s: tiles of w's shape in that dtype)."""
    dtype = like.dtype
    if USE_PTX:
        if DEQUANT:
            if dtype == tl.bfloat16:
                return tl.inline_asm_elementwise(DEQUANT_BF16, DEQUANT_CONSTRAINTS, [w, s, nzs],
                                                 dtype=(dtype,) * 8, is_pure=True, pack=2)
            else:
                return tl.inline_asm_elementwise(DEQUANT_F16, DEQUANT_CONSTRAINTS, [w, s, nzs],
                                                 dtype=(dtype,) * 8, is_pure=True, pack=2)
        else:
            if dtype == tl.bfloat16:
                return tl.inline_asm_elementwise(UNPACK_BF16, UNPACK_CONSTRAINTS, [w],
                                                 dtype=(dtype,) * 8, is_pure=True, pack=2)
            else:
                return tl.inline_asm_elementwise(UNPACK_F16, UNPACK_CONSTRAINTS, [w],
                                                 dtype=(dtype,) * 8, is_pure=True, pack=2)
    else:
        if DEQUANT:
            return (_deq(w, 0, s, nzs, dtype), _deq(w, 4, s, nzs, dtype), _deq(w, 8, s, nzs, dtype),
                    _deq(w, 12, s, nzs, dtype), _deq(w, 16, s, nzs, dtype), _deq(w, 20, s, nzs, dtype),
                    _deq(w, 24, s, nzs, dtype), _deq(w, 28, s, nzs, dtype))
        else:
            return (_magic(w, 0, dtype), _magic(w, 4, dtype), _magic(w, 8, dtype), _magic(w, 12, dtype),
                    _magic(w, 16, dtype), _magic(w, 20, dtype), _magic(w, 24, dtype), _magic(w, 28, dtype))


@triton.jit
def _magic(w, shift: tl.constexpr, dtype: tl.constexpr):
    return (((w >> shift) & 0xF).to(tl.float32) + _magic_bias(dtype)).to(dtype)


@triton.jit
def _deq(w, shift: tl.constexpr, s, nzs, dtype: tl.constexpr):
    q = ((w >> shift) & 0xF).to(tl.float32)
    return (q * s.to(tl.float32) + nzs.to(tl.float32)).to(dtype)


@triton.jit
def _cat(a, b):
    """Two [R, C] tiles -> [R, 2C], b's columns after a's. In the tensor-core operand layout each thread already
    holds matching positions of a and b, so this is register renaming, not a shuffle (checked in the SASS)."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (a.shape[0], 2 * a.shape[1]))


@triton.jit
def _cat8(p0, p1, p2, p3, p4, p5, p6, p7):
    return _cat(_cat(_cat(p0, p1), _cat(p2, p3)), _cat(_cat(p4, p5), _cat(p6, p7)))


@triton.jit
def _magic_bias(dtype: tl.constexpr):
    if dtype == tl.bfloat16:
        return 128.0
    else:
        return 1024.0


@triton.jit
def _grouped_plane(q, j: tl.constexpr, k0, i_idx, n_idx, rows_in_tile, s_ptr, z_ptr, N, K, group_size,
                   USE_PTX: tl.constexpr):
    """Nibble plane j (bias + q; its inputs k0 + R j + i) dequantized with a group per element, for groups that
    split a plane (see _plane_groups): a gathered scale tile per plane, slow but rare. i_idx, n_idx: index tiles
    broadcastable to q."""
    g = tl.minimum(k0 + rows_in_tile * j + i_idx, K - 1) // group_size
    return _plane_dequant(q, tl.load(s_ptr + g * N + n_idx), tl.load(z_ptr + g * N + n_idx), USE_PTX)


@triton.jit
def _plane_tile(ptr, k0, rows_in_tile, offs_n, N, group_size):
    """Scales (or zeros) [BLOCK_N, 8] of the 8 nibble planes of the K tile at k0 when each plane lies in one group:
    one masked 2-D load (a clamped column index would hide the contiguity that Triton's cp.async pipeline needs;
    8 separate [BLOCK_N] vectors of 2-byte values are too narrow for it)."""
    g = (k0 + rows_in_tile * tl.arange(0, 8)) // group_size
    return tl.load(ptr + g[None, :] * N + offs_n[:, None], mask=(offs_n < N)[:, None], other=0.0)


@triton.jit
def _split8(t):
    """The 8 columns of a [C, 8] tile as [C] vectors (column j = 4 a + 2 b + c: three splits of the last axis)."""
    t = tl.reshape(t, (t.shape[0], 2, 2, 2))
    e, o = tl.split(t)
    ee, eo = tl.split(e)
    oe, oo = tl.split(o)
    c0, c4 = tl.split(ee)
    c2, c6 = tl.split(eo)
    c1, c5 = tl.split(oe)
    c3, c7 = tl.split(oo)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _along(v, N_AXIS: tl.constexpr):
    if N_AXIS == 0:
        return v[:, None]
    else:
        return v[None, :]


@triton.jit
def _plane_group_planes(w, s8, z8, like, N_AXIS: tl.constexpr, USE_PTX: tl.constexpr):
    """The 8 nibble planes of word tile w dequantized with one group each: s8, z8 are _plane_tile's [BLOCK_N, 8]
    tiles; N_AXIS is w's column axis (0: [BLOCK_N, 16] in the forward, 1: [16, BLOCK_N])."""
    s0, s1, s2, s3, s4, s5, s6, s7 = _split8(s8)
    z0, z1, z2, z3, z4, z5, z6, z7 = _split8(z8)
    q0, q1, q2, q3, q4, q5, q6, q7 = _nibbles8(w, w, w, like, False, USE_PTX)
    return (_plane_dequant(q0, _along(s0, N_AXIS), _along(z0, N_AXIS), USE_PTX),
            _plane_dequant(q1, _along(s1, N_AXIS), _along(z1, N_AXIS), USE_PTX),
            _plane_dequant(q2, _along(s2, N_AXIS), _along(z2, N_AXIS), USE_PTX),
            _plane_dequant(q3, _along(s3, N_AXIS), _along(z3, N_AXIS), USE_PTX),
            _plane_dequant(q4, _along(s4, N_AXIS), _along(z4, N_AXIS), USE_PTX),
            _plane_dequant(q5, _along(s5, N_AXIS), _along(z5, N_AXIS), USE_PTX),
            _plane_dequant(q6, _along(s6, N_AXIS), _along(z6, N_AXIS), USE_PTX),
            _plane_dequant(q7, _along(s7, N_AXIS), _along(z7, N_AXIS), USE_PTX))


@triton.jit
def _plane_dequant(q, s, z, USE_PTX: tl.constexpr):
    """(q - z) * s for a plane q of bias + q values: q - z exact, one rounding. s, z broadcast to q's shape."""
    zb = z.to(tl.float32) + _magic_bias(q.dtype)
    if USE_PTX:
        nzb = tl.broadcast_to((-zb).to(q.dtype), q.shape)
        s2 = tl.broadcast_to(s, q.shape)
        if q.dtype == tl.bfloat16:
            return tl.inline_asm_elementwise(PLANE_BF16, PLANE_CONSTRAINTS, [q, nzb, s2], dtype=q.dtype,
                                             is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(PLANE_F16, PLANE_CONSTRAINTS, [q, nzb, s2], dtype=q.dtype,
                                             is_pure=True, pack=2)
    else:
        return ((q.to(tl.float32) - zb) * s.to(tl.float32)).to(q.dtype)


@triton.jit
def _grouped_planes(w, k0, i_idx, n_idx, rows_in_tile, s_ptr, z_ptr, N, K, group_size, like, USE_PTX: tl.constexpr):
    """The 8 nibble planes of word tile w, dequantized with a group per element."""
    q0, q1, q2, q3, q4, q5, q6, q7 = _nibbles8(w, w, w, like, False, USE_PTX)
    return (_grouped_plane(q0, 0, k0, i_idx, n_idx, rows_in_tile, s_ptr, z_ptr, N, K, group_size, USE_PTX),
            _grouped_plane(q1, 1, k0, i_idx, n_idx, rows_in_tile, s_ptr, z_ptr, N, K, group_size, USE_PTX),
            _grouped_plane(q2, 2, k0, i_idx, n_idx, rows_in_tile, s_ptr, z_ptr, N, K, group_size, USE_PTX),
            _grouped_plane(q3, 3, k0, i_idx, n_idx, rows_in_tile, s_ptr, z_ptr, N, K, group_size, USE_PTX),
            _grouped_plane(q4, 4, k0, i_idx, n_idx, rows_in_tile, s_ptr, z_ptr, N, K, group_size, USE_PTX),
            _grouped_plane(q5, 5, k0, i_idx, n_idx, rows_in_tile, s_ptr, z_ptr, N, K, group_size, USE_PTX),
            _grouped_plane(q6, 6, k0, i_idx, n_idx, rows_in_tile, s_ptr, z_ptr, N, K, group_size, USE_PTX),
            _grouped_plane(q7, 7, k0, i_idx, n_idx, rows_in_tile, s_ptr, z_ptr, N, K, group_size, USE_PTX))


@triton.jit
def _word_offsets(kt, N, n_idx, i_idx, rows_in_tile, EVEN_K: tl.constexpr):
    """Offsets of words (n, i) of K tile kt: the tile is an [N, R] block of its own (R = 16 word rows, fewer in a
    ragged last tile), so a program's [BLOCK_N, 16] tile is one contiguous run with 64 bytes per column."""
    if EVEN_K:
        return kt * (N * 16) + n_idx * 16 + i_idx
    else:
        return kt * (N * 16) + n_idx * rows_in_tile + tl.minimum(i_idx, rows_in_tile - 1)


@triton.jit
def _tile_group(s_ptr, z_ptr, kt, N, group_size, n_idx):
    """Scales and zeros [BLOCK_N] of K tile kt when the whole tile lies in one group."""
    offs = (kt * 128 // group_size) * N + n_idx
    return tl.load(s_ptr + offs), tl.load(z_ptr + offs)


@triton.jit
def _dot(a, b, acc, FP32: tl.constexpr):
    if FP32:  # the interpreter's 16-bit dot is wrong; fp32 is exact there
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------

# How the forward applies scales and zeros (MODE): the first three need a single group per K tile.
FACTORED = tl.constexpr(0)
CENTERED = tl.constexpr(1)
DEQUANT = tl.constexpr(2)
GROUPED = tl.constexpr(3)
MODES = {"factored": 0, "centered": 1, "dequant": 2, "grouped": 3}


@triton.jit
def _decode_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, count_ptr,
    M, N, K, stride_xm, stride_om, group_size, tiles_per_split, n_splits, seg1, seg2,
    tiles_ptr, expert_words, expert_groups,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, PLANE_GROUPS: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, SPLIT: tl.constexpr, USE_PTX: tl.constexpr, FP32_DOT: tl.constexpr,
    SEGMENTED: tl.constexpr, EXPERTS: tl.constexpr,
):
    """out^T[n, m] = sum_k W[k, n] x[m, k] for one [BLOCK_N, BLOCK_M] tile and one K split.

    Per K tile the 8 nibble planes of the [BLOCK_N, 16] word tile are the 8 consecutive 16-input slices of the
    tile (K-tiled layout), so they concatenate into one [BLOCK_N, 128] register operand and the tile is one
    tensor-core dot against x^T[128, BLOCK_M], loaded straight from memory into the dot's shared-memory operand.
    MODE: FACTORED dots bias + q and applies y += s * (part - (z + bias) * sum(x)) per output; CENTERED dots the
    exact q - z (integer zero points) and scales after; DEQUANT dots q * s - z * s; GROUPED dequantizes with a
    group per input row (groups smaller than, or not aligned to, the K tile).

    With SPLIT, the n_splits programs of a tile add their partial sums into the fp32 workspace ws (same shape and
    strides as out) and take a ticket from count[tile]; the last one casts the sum into out and leaves ws and
    count zeroed for the next call. One launch: no memset before, no cast kernel after.

    SEGMENTED: W is up to three weights side by side along N (columns [0, seg1), [seg1, seg2), [seg2, N)), each
    stored in its own [K // 8, N_j] layout, the three back to back in memory from qw_ptr (scales and zeros from
    s_ptr / z_ptr likewise): layers that share their input (q/k/v, gate/up) in one launch. Every segment is a
    multiple of BLOCK_N columns, so a program's columns lie in one segment.

    EXPERTS: one weight per expert of a mixture of experts, expert e's at qw_ptr + e * expert_words (scales and
    zeros at e * expert_groups), and x's rows sorted by expert. Row tile pid_m is entry pid_m of the int32 table
    tiles [T, 3] = (expert, first row, end row): at most BLOCK_M rows, all routed to one expert; an empty entry
    (first row == end row) computes nothing (`w4a16_expert_tiles`)."""
    # Row tiles vary fastest: the programs that share a weight tile run side by side, so all but the first read
    # it from L2 instead of HBM.
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n = tl.program_id(2)
    dtype = x_ptr.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_end = M
    if EXPERTS:
        expert = tl.load(tiles_ptr + 3 * pid_m).to(tl.int64)
        row_start = tl.load(tiles_ptr + 3 * pid_m + 1)
        row_end = tl.load(tiles_ptr + 3 * pid_m + 2)
        offs_m = row_start + tl.arange(0, BLOCK_M)
        qw_ptr += expert * expert_words
        s_ptr += expert * expert_groups
        z_ptr += expert * expert_groups
    offs_i = tl.arange(0, 16)
    offs_c = tl.arange(0, 128)
    n_mask = offs_n < N
    m_mask = offs_m < row_end
    # Out-of-range rows/columns read clamped (valid) addresses instead of masking every load; their results are
    # dropped by the masked store. Only a ragged K tail must be zeroed (in x), which EVEN_K rules out. When N is a
    # multiple of BLOCK_N nothing is clamped: the clamp would hide the columns' contiguity from Triton, which then
    # loads one 4-byte word per instruction instead of 16 bytes.
    if EVEN_N:
        n_safe = offs_n
    else:
        n_safe = tl.minimum(offs_n, N - 1)
    cols = offs_n  # this program's columns within the weight it reads (its segment's), unclamped
    n_cols = N
    if SEGMENTED:
        first = pid_n * BLOCK_N
        seg_lo = tl.where(first >= seg2, seg2, tl.where(first >= seg1, seg1, 0))
        n_cols = tl.where(first >= seg2, N, tl.where(first >= seg1, seg2, seg1)) - seg_lo
        qw_ptr += seg_lo * (K // 8)  # the segments before hold (K / 8) * seg_lo words
        s_ptr += seg_lo * (K // group_size)
        z_ptr += seg_lo * (K // group_size)
        n_safe -= seg_lo
        cols -= seg_lo
    m_safe = tl.minimum(offs_m, row_end - 1)
    n_words = K // 8
    kt_start = pid_k * tiles_per_split
    kt_end = tl.minimum(kt_start + tiles_per_split, tl.cdiv(K, 128))
    if EXPERTS:  # an empty table entry: no rows to read (its expert 0 and row 0 keep every address valid)
        m_safe = tl.maximum(m_safe, 0)
        kt_end = tl.where(row_start < row_end, kt_end, kt_start)
    xt_ptrs = x_ptr + m_safe[None, :] * stride_xm
    # The tile's scales/zeros (2-byte values spread thinly over the threads: too narrow for the cp.async pipeline)
    # are loaded one iteration ahead by hand so that their latency overlaps the current tile.
    if MODE != GROUPED:
        s_next, z_next = _tile_group(s_ptr, z_ptr, kt_start, n_cols, group_size, n_safe)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for kt in range(kt_start, kt_end):
        k0 = kt * 128
        if EVEN_K:
            rows_in_tile = 16
            w = tl.load(qw_ptr + _word_offsets(kt, n_cols, n_safe[:, None], offs_i[None, :], 16, True))
            xt = tl.load(xt_ptrs + (k0 + offs_c)[:, None])
        else:  # a ragged last tile of R < 16 word rows holds inputs k0 + R * j + i
            rows_in_tile = tl.minimum(n_words - kt * 16, 16)
            w = tl.load(qw_ptr + _word_offsets(kt, n_cols, n_safe[:, None], offs_i[None, :], rows_in_tile, False))
            i = offs_c % 16
            xt = tl.load(xt_ptrs + (k0 + rows_in_tile * (offs_c // 16) + i)[:, None],
                         mask=(i < rows_in_tile)[:, None], other=0.0)
        if MODE != GROUPED:
            s1 = s_next
            z1 = z_next
            s_next, z_next = _tile_group(s_ptr, z_ptr, tl.minimum(kt + 1, kt_end - 1), n_cols, group_size, n_safe)
        if MODE == FACTORED:
            q0, q1, q2, q3, q4, q5, q6, q7 = _nibbles8(w, w, w, xt, False, USE_PTX)
        elif MODE == GROUPED and PLANE_GROUPS:
            q0, q1, q2, q3, q4, q5, q6, q7 = _plane_group_planes(
                w, _plane_tile(s_ptr, k0, rows_in_tile, cols, n_cols, group_size),
                _plane_tile(z_ptr, k0, rows_in_tile, cols, n_cols, group_size), xt, 0, USE_PTX)
        elif MODE == GROUPED:
            q0, q1, q2, q3, q4, q5, q6, q7 = _grouped_planes(
                w, k0, offs_i[None, :], n_safe[:, None], rows_in_tile, s_ptr, z_ptr, n_cols, K, group_size, xt, USE_PTX)
        else:
            if MODE == CENTERED:  # (bias + q) * 1 - z: exact for integer zero points
                s2 = tl.full((BLOCK_N, 16), 1.0, dtype)
                nzs = tl.broadcast_to((-z1.to(tl.float32)).to(dtype)[:, None], (BLOCK_N, 16))
            else:
                s2 = tl.broadcast_to(s1[:, None], (BLOCK_N, 16))
                nzs = tl.broadcast_to((-(z1.to(tl.float32) * s1.to(tl.float32))).to(dtype)[:, None], (BLOCK_N, 16))
            q0, q1, q2, q3, q4, q5, q6, q7 = _nibbles8(w, s2, nzs, xt, True, USE_PTX)
        a = _cat8(q0, q1, q2, q3, q4, q5, q6, q7)
        if MODE == FACTORED:
            part = _dot(a, xt, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), FP32_DOT)
            xsum = tl.sum(xt.to(tl.float32), axis=0)
            zb = z1.to(tl.float32) + _magic_bias(dtype)
            acc += s1.to(tl.float32)[:, None] * (part - zb[:, None] * xsum[None, :])
        elif MODE == CENTERED:
            part = _dot(a, xt, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), FP32_DOT)
            acc += s1.to(tl.float32)[:, None] * part
        else:
            acc = _dot(a, xt, acc, FP32_DOT)
    out_offs = offs_m[None, :] * stride_om + offs_n[:, None]
    out_mask = m_mask[None, :] & n_mask[:, None]
    if SPLIT:
        tl.atomic_add(ws_ptr + out_offs, acc, mask=out_mask, sem="relaxed")
        # Every thread's adds happen before the barrier; the ticket's release (cumulative) publishes them, and
        # the last program's acquire makes all splits' adds visible to its loads (L2, where the adds landed).
        tl.debug_barrier()
        tile = pid_n * tl.num_programs(0) + pid_m
        ticket = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == n_splits - 1:
            total = tl.load(ws_ptr + out_offs, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            # Triton gives this load and the zeroing store below different thread layouts: without the barrier a
            # thread could zero a sum that another thread has not read yet. On the H200 that lost partial sums in
            # up to 146 of 300 calls (benchmarks/results/w4a16_split_race.json).
            tl.debug_barrier()
            tl.store(ws_ptr + out_offs, tl.zeros_like(total), mask=out_mask)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed")
    else:
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _weight_planes(w, k0, rows_in_tile, s_ptr, z_ptr, offs_n, N, K, group_size, like, TILE_GROUPS: tl.constexpr,
                   PLANE_GROUPS: tl.constexpr, USE_PTX: tl.constexpr):
    """The 8 dequantized nibble planes of a [16, BLOCK_N] word tile (plane j: inputs k0 + R * j + i); columns
    offs_n past N come out as zeros when the groups allow, else clamped (finite) weights.

    Scales and zeros are loaded as 2-D tiles, masked rather than clamped (a clamp hides the columns' contiguity):
    only then are they wide enough for Triton's cp.async pipeline when this runs in a loop (a synchronous load per
    step cost the input-gradient kernel up to 1.7x at M = 1 on the H200). A whole-tile group loads a
    [16, BLOCK_N] tile of equal rows, per-plane groups a [BLOCK_N, 8] tile split into its columns."""
    offs_i = tl.arange(0, 16)
    n_mask = offs_n < N
    if TILE_GROUPS:
        # equal rows, but computed so that Triton does not fold them into one narrow [BLOCK_N] load
        offs = (tl.minimum(k0 + offs_i, K - 1) // group_size)[:, None] * N + offs_n[None, :]
        s = tl.load(s_ptr + offs, mask=n_mask[None, :], other=0.0)
        nzs = (-(tl.load(z_ptr + offs, mask=n_mask[None, :], other=0.0).to(tl.float32) * s.to(tl.float32)))
        return _nibbles8(w, s, nzs.to(like.dtype), like, True, USE_PTX)
    elif PLANE_GROUPS:
        return _plane_group_planes(w, _plane_tile(s_ptr, k0, rows_in_tile, offs_n, N, group_size),
                                   _plane_tile(z_ptr, k0, rows_in_tile, offs_n, N, group_size), like, 1, USE_PTX)
    else:
        return _grouped_planes(w, k0, offs_i[:, None], tl.minimum(offs_n, N - 1)[None, :], rows_in_tile, s_ptr,
                               z_ptr, N, K, group_size, like, USE_PTX)


@triton.jit
def _decode_grad_kernel(
    dy_ptr, qw_ptr, s_ptr, z_ptr, dx_ptr,
    M, N, K, stride_dym, stride_dxm, group_size, tiles_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_GROUPS: tl.constexpr, PLANE_GROUPS: tl.constexpr,
    EVEN_K: tl.constexpr,
    ATOMIC: tl.constexpr, USE_PTX: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """dx^T[k, m] = sum_n W[k, n] dy[m, n] for the 8 16-input slices of one K tile, over one split of N."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_i = tl.arange(0, 16)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    n_words = K // 8
    k0 = pid_k * 128
    rows_in_tile = tl.minimum(n_words - pid_k * 16, 16)
    nt_start = pid_n * tiles_per_split
    nt_end = tl.minimum(nt_start + tiles_per_split, tl.cdiv(N, BLOCK_N))
    a0 = tl.zeros([16, BLOCK_M], dtype=tl.float32)
    a1 = tl.zeros([16, BLOCK_M], dtype=tl.float32)
    a2 = tl.zeros([16, BLOCK_M], dtype=tl.float32)
    a3 = tl.zeros([16, BLOCK_M], dtype=tl.float32)
    a4 = tl.zeros([16, BLOCK_M], dtype=tl.float32)
    a5 = tl.zeros([16, BLOCK_M], dtype=tl.float32)
    a6 = tl.zeros([16, BLOCK_M], dtype=tl.float32)
    a7 = tl.zeros([16, BLOCK_M], dtype=tl.float32)
    for nt in range(nt_start, nt_end):
        offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        n_safe = tl.minimum(offs_n, N - 1)
        w = tl.load(qw_ptr + _word_offsets(pid_k, N, n_safe[None, :], offs_i[:, None], rows_in_tile, EVEN_K))
        # columns past N read clamped weights; their dy is zero
        dyt = tl.load(dy_ptr + offs_m[None, :] * stride_dym + offs_n[:, None], mask=n_mask[:, None] & m_mask[None, :],
                      other=0.0)
        d0, d1, d2, d3, d4, d5, d6, d7 = _weight_planes(w, k0, rows_in_tile, s_ptr, z_ptr, offs_n, N, K, group_size,
                                                        dyt, TILE_GROUPS, PLANE_GROUPS, USE_PTX)
        a0 = _dot(d0, dyt, a0, FP32_DOT)
        a1 = _dot(d1, dyt, a1, FP32_DOT)
        a2 = _dot(d2, dyt, a2, FP32_DOT)
        a3 = _dot(d3, dyt, a3, FP32_DOT)
        a4 = _dot(d4, dyt, a4, FP32_DOT)
        a5 = _dot(d5, dyt, a5, FP32_DOT)
        a6 = _dot(d6, dyt, a6, FP32_DOT)
        a7 = _dot(d7, dyt, a7, FP32_DOT)
    base = dx_ptr + offs_m[None, :] * stride_dxm + (k0 + offs_i)[:, None]
    mask = (offs_i < rows_in_tile)[:, None] & m_mask[None, :]
    _store_rows(base, a0, mask, ATOMIC)
    _store_rows(base + rows_in_tile, a1, mask, ATOMIC)
    _store_rows(base + 2 * rows_in_tile, a2, mask, ATOMIC)
    _store_rows(base + 3 * rows_in_tile, a3, mask, ATOMIC)
    _store_rows(base + 4 * rows_in_tile, a4, mask, ATOMIC)
    _store_rows(base + 5 * rows_in_tile, a5, mask, ATOMIC)
    _store_rows(base + 6 * rows_in_tile, a6, mask, ATOMIC)
    _store_rows(base + 7 * rows_in_tile, a7, mask, ATOMIC)


@triton.jit
def _store_rows(ptrs, vals, mask, ATOMIC: tl.constexpr):
    if ATOMIC:
        tl.atomic_add(ptrs, vals, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, vals.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, K, group_size,
                    BLOCK_N: tl.constexpr, TILE_GROUPS: tl.constexpr, PLANE_GROUPS: tl.constexpr, EVEN_K: tl.constexpr,
                    USE_PTX: tl.constexpr):
    """W[k, n] for one 128-input K tile and BLOCK_N columns."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_i = tl.arange(0, 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    n_safe = tl.minimum(offs_n, N - 1)
    n_words = K // 8
    k0 = pid_k * 128
    rows_in_tile = tl.minimum(n_words - pid_k * 16, 16)
    w = tl.load(qw_ptr + _word_offsets(pid_k, N, n_safe[None, :], offs_i[:, None], rows_in_tile, EVEN_K))
    like = tl.zeros([1], dtype=w_ptr.dtype.element_ty)
    d0, d1, d2, d3, d4, d5, d6, d7 = _weight_planes(w, k0, rows_in_tile, s_ptr, z_ptr, offs_n, N, K, group_size,
                                                    like, TILE_GROUPS, PLANE_GROUPS, USE_PTX)
    mask = (offs_i < rows_in_tile)[:, None] & n_mask[None, :]
    base = w_ptr + (k0 + offs_i)[:, None] * N + offs_n[None, :]
    step = rows_in_tile * N
    tl.store(base, d0, mask=mask)
    tl.store(base + step, d1, mask=mask)
    tl.store(base + 2 * step, d2, mask=mask)
    tl.store(base + 3 * step, d3, mask=mask)
    tl.store(base + 4 * step, d4, mask=mask)
    tl.store(base + 5 * step, d5, mask=mask)
    tl.store(base + 6 * step, d6, mask=mask)
    tl.store(base + 7 * step, d7, mask=mask)


# ----------------------------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------------------------


def _check_weights(qweight, scales, zeros, group_size, act_dtype, device, what):
    if not isinstance(qweight, torch.Tensor) or qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"{what}: qweight must be a 2-D int32 tensor [K // 8, N], got "
                         f"{getattr(qweight, 'dtype', type(qweight))} {tuple(getattr(qweight, 'shape', ()))}; "
                         "pack integer codes with w4a16_pack (or load the layer as W4A16Linear)")
    k = qweight.shape[0] * 8
    n = qweight.shape[1]
    if group_size is None or group_size == -1:
        group_size = k
    group_size = int(group_size)
    if group_size <= 0:
        raise ValueError(f"{what}: group_size must be positive or -1 (one group over all of K), got {group_size}")
    if k % group_size != 0:
        raise ValueError(f"{what}: K = {k} (qweight rows * 8) must be a multiple of group_size = {group_size}")
    n_groups = k // group_size
    if n_groups > 1 and group_size % 8 != 0:
        raise ValueError(f"{what}: group_size = {group_size} must be a multiple of 8 (a packed word must not span "
                         "two groups)")
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != (n_groups, n):
            raise ValueError(f"{what}: {name} must have shape [K // group_size, N] = [{n_groups}, {n}], "
                             f"got {tuple(t.shape)}")
        if t.dtype != act_dtype:
            raise ValueError(f"{what}: {name} dtype {t.dtype} differs from the activation dtype {act_dtype}; "
                             f"cast it once at load time (e.g. {name}.to({act_dtype}))")
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        if t.device != device:
            raise ValueError(f"{what}: {name} is on {t.device} but the activations are on {device}")
    return k, n, group_size


def _check_activation(x, what, name):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what}: {name} must be a tensor, got {type(x)}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{what}: {name} must be float16 or bfloat16, got {x.dtype}; cast the input "
                         f"(e.g. {name}.to(torch.bfloat16)) or load the model in a 16-bit dtype")
    if x.dim() < 1:
        raise ValueError(f"{what}: {name} must have at least one dimension")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"{what}: the Triton kernels need a CUDA tensor, got {x.device} "
                         "(set TRITON_INTERPRET=1 to run them, slowly, on the CPU)")


def _contiguous(t):
    return t if t.is_contiguous() else t.contiguous()


def _as_rows(t, features: int, what: str, holds: str):
    """[..., features] -> (a [rows, features] matrix with unit column stride, the leading shape)."""
    if t.shape[-1] != features:
        raise ValueError(f"{what} has {t.shape[-1]} features but qweight holds {holds}")
    t2 = t.reshape(-1, features)
    if t2.stride(-1) != 1 or (t2.shape[0] > 1 and t2.stride(0) < features):
        t2 = t2.contiguous()
    return t2, t.shape[:-1]


# ----------------------------------------------------------------------------------------------------------------
# Launch choices
# ----------------------------------------------------------------------------------------------------------------

_PTX_OK: dict = {}


def _num_sms(device) -> int:
    return num_sms(device) if device.type == "cuda" else 1  # the interpreter: fewest programs


_WORKSPACES: dict = {}


def _stream_key(device) -> int:
    return current_stream(cuda_index(device)) if device.type == "cuda" else 0


def _split_workspace(device, n_values: int, n_tiles: int, cached: bool = True):
    """(fp32 partial sums, int32 tickets): zeroed once, left zeroed by every split-K launch (its last program per
    tile cleans up), so decode needs no memset and no cast kernel per call. One per (device, stream): launches on
    one stream run in order. Two CUDA graphs captured on the same stream must not be replayed concurrently.
    cached=False: fresh zeroed tensors for this call only."""
    if not cached:
        return (torch.zeros(n_values, device=device, dtype=torch.float32),
                torch.zeros(n_tiles, device=device, dtype=torch.int32))
    key = (device, _stream_key(device))
    ws, count = _WORKSPACES.get(key, (None, None))
    if ws is None or ws.numel() < n_values or count.numel() < n_tiles:
        grow = max(n_values, 2 * ws.numel() if ws is not None else 0)
        ws = torch.zeros(grow, device=device, dtype=torch.float32)
        count = torch.zeros(max(n_tiles, 2 * count.numel() if count is not None else 0, 1024), device=device,
                            dtype=torch.int32)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return ws, count  # memory of the graph being captured (its replays re-zero it): never cached
        _WORKSPACES[key] = (ws, count)
    return ws, count


def _splits(tiles: int, steps: int, n_sms: int, min_steps: int = 2, per_sm: int = 2) -> int:
    """Split the reduction until about `per_sm` programs per SM are busy, keeping >= min_steps steps per split."""
    split = 1
    while tiles * split < per_sm * n_sms and steps // (split * 2) >= min_steps:
        split *= 2
    return split


def _use_ptx(device, dtype) -> bool:
    """The PTX unpack, verified once per device and dtype against the plain-Triton unpack (guards against a
    Triton version packing inline-asm operands differently); on a mismatch fall back with a warning."""
    if interpreting() or device.type != "cuda":
        return False
    key = (device.index, dtype)
    if key not in _PTX_OK:
        if torch.cuda.is_current_stream_capturing():
            return True  # cannot check while a CUDA graph is being captured; the first eager call checks
        gen = torch.Generator(device=device).manual_seed(1234)
        k, n, gs = 256, 96, 64
        qw = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), device=device, dtype=torch.int32, generator=gen)
        s = (torch.rand(k // gs, n, device=device, generator=gen) + 0.5).to(dtype)
        z = torch.randint(0, 16, (k // gs, n), device=device, generator=gen).to(dtype)
        try:  # per-plane groups (unpack + plane dequantize) and tile groups (unpack + pair dequantize)
            ok = all(torch.equal(_dequantize(qw, s[::g].contiguous(), z[::g].contiguous(), gs * g, dtype, True),
                                 _dequantize(qw, s[::g].contiguous(), z[::g].contiguous(), gs * g, dtype, False))
                     for g in (1, 2))
        except Exception as exc:  # noqa: BLE001 - e.g. ptxas rejecting the inline PTX on a future toolchain
            logger.warning("hf_fastpath W4A16: the PTX unpack failed to build (%s)", exc)
            ok = False
        if not ok:
            logger.warning("hf_fastpath W4A16: the PTX nibble unpack is unusable or disagrees with the reference "
                           "unpack on this Triton %s; using the slower plain-Triton unpack", triton.__version__)
        _PTX_OK[key] = ok
    return _PTX_OK[key]


def _decode_config(m: int, k: int, n: int, interpret: bool, tile_groups: bool, plane_groups: bool = False):
    """Launch configuration for M rows of a K x N weight. tile_groups: every K tile lies in one quantization group
    (group size a multiple of 128, or one group), so scales and zeros can apply once per tile and output;
    plane_groups: every 16-input nibble plane lies in one group (g32/g64)."""
    small = m <= 8 and (tile_groups or plane_groups)
    rows = 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8  # the narrowest row tile that holds M (small M)
    if interpret:  # the GPU's row tiles, narrower columns: fast enough for the interpreter
        return dict(BLOCK_M=(1 if m == 1 else 8) if small else 16, BLOCK_N=64, num_warps=4, num_stages=1, per_sm=1,
                    mode="factored")
    # H200 sweeps (benchmarks/results/w4a16_sweep*.json). Up to 8 rows (session 3): a 1- or 8-row tile (Triton pads
    # the MMA; mma.sync, 128 registers instead of wgmma's 227 at 16 rows) with ~2 programs per SM was 1.15-1.45x
    # faster than the 16-row tile on Llama-3 8B/70B shapes (w4a16_sweep_s3*.json). With per-plane groups (g32) the
    # 8-row tile with 2 warps was fastest at M = 1 (session 5, archive/w4a16_sweep_g32.json).
    if small and not tile_groups:
        return dict(BLOCK_M=8, BLOCK_N=128, num_warps=2, num_stages=4, per_sm=2, mode="factored")
    if small and (n >= 12288 or (k >= 16384 and n >= 8192)):
        # Large layers (session 8, archive/w4a16_small_m_confirm_s8.json, weights streamed from HBM): a row tile as narrow
        # as M allows, 256 columns, 2 warps: 1.00-1.17x the configs below on 4096x14336, 8192x28672, 28672x8192 and
        # the 8B/70B gate/up pairs at M = 1-8; on narrower layers (q/k/v, 4096^2) it lost up to 13%.
        return dict(BLOCK_M=rows, BLOCK_N=256, num_warps=2, num_stages=3, per_sm=2, mode="factored")
    if small and m == 1:
        return dict(BLOCK_M=1, BLOCK_N=128, num_warps=2, num_stages=4, per_sm=2, mode="factored")
    if small:  # 2-8 rows of narrower layers: 1.05-1.16x the 8-row, 256-column, 4-warp tile that ran here before
        # (session 29, archive/w4a16_small_m_confirm_s29.json: 4096^2 and 14336 x 4096, interleaved rounds)
        return dict(BLOCK_M=rows, BLOCK_N=128, num_warps=2, num_stages=3, per_sm=2, mode="factored")
    # 9-32 rows: 256 columns, 4 warps, 3 stages (session 2). From 33 rows, 64-row tiles dotting the exact q - z
    # operand, scaled after the dot: 10-25% faster than dequantizing in the loop (session 4, archive/w4a16_sweep_s4.json).
    if m <= 32:
        return dict(BLOCK_M=16 if m <= 16 else 32, BLOCK_N=256, num_warps=4, num_stages=3, per_sm=1,
                    mode="factored" if m <= 16 else "dequant")
    return dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3, per_sm=1, mode="centered")


def _tile_groups(group_size: int, k: int) -> bool:
    return group_size % _BLOCK_K == 0 or group_size == k


def _plane_groups(group_size: int, k: int) -> bool:
    """Every nibble plane lies in one group: 16 inputs in a full K tile, R = (K % 128) / 8 in a ragged last one."""
    tail_rows = (k % _BLOCK_K) // 8
    return group_size % 16 == 0 and (tail_rows == 0 or group_size % tail_rows == 0)


# ----------------------------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------------------------


def _decode_plan(m: int, k: int, n: int, group_size: int, n_sms: int, interpret: bool, use_ptx: bool,
                 segmented: bool = False, row_groups: int = 1, cfg=None, split_k=None):
    """(grid, tiles_per_split, n_splits, output tiles, constexprs and launch options) of the fused forward: pure
    host arithmetic, cached for the default configs (`_default_decode_plan`) because decoding launches the same few
    shapes thousands of times and its host time per call shows."""
    tile_groups = _tile_groups(group_size, k)
    plane_groups = _plane_groups(group_size, k)
    cfg = cfg or _decode_config(m, k, n, interpret, tile_groups, plane_groups)
    n_tiles = cdiv(n, cfg["BLOCK_N"])
    m_tiles = cdiv(m, cfg["BLOCK_M"])
    k_steps = cdiv(k, _BLOCK_K)
    if split_k is None:  # row_groups: experts that get (about) m rows each
        split_k = _splits(n_tiles * m_tiles * row_groups, k_steps, n_sms, min_steps=1, per_sm=cfg.get("per_sm", 1))
    per_split = cdiv(k_steps, split_k)
    split_k = cdiv(k_steps, per_split)
    meta = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                MODE=MODES[cfg["mode"]] if tile_groups else MODES["grouped"], PLANE_GROUPS=plane_groups,
                EVEN_K=k % _BLOCK_K == 0, EVEN_N=n % cfg["BLOCK_N"] == 0, SPLIT=split_k > 1, USE_PTX=use_ptx,
                FP32_DOT=interpret, SEGMENTED=segmented, EXPERTS=False, num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"])
    return (m_tiles, split_k, n_tiles), per_split, split_k, n_tiles * m_tiles, meta


_default_decode_plan = functools.lru_cache(maxsize=4096)(_decode_plan)
_DECODE_LAUNCH = LaunchCache(_decode_kernel)


def _decode_matmul(x2, qweight, scales, zeros, group_size, out, cfg=None, split_k=None, cache_workspace=True,
                   segments=None, experts=None):
    """out = x2 @ W; segments=(seg1, seg2): W is out.shape[1] columns of weights stored back to back from qweight,
    scales and zeros (the kernel's SEGMENTED mode); experts=(tiles, rows per expert): qweight / scales / zeros are
    [E, ...] stacks, one weight per expert, x2's rows sorted by expert (EXPERTS mode)."""
    m, k = x2.shape
    n = out.shape[1]
    device = x2.device
    seg1, seg2 = segments or (n, n)
    plan_m = m if experts is None else experts[1]
    row_groups = 1 if experts is None else max(1, min(qweight.shape[0], m // max(plan_m, 1)))
    plan_args = (plan_m, k, n, group_size, _num_sms(device), interpreting(), _use_ptx(device, x2.dtype),
                 segments is not None, row_groups)
    custom = cfg is not None or split_k is not None
    grid, per_split, split_k, tiles, meta = (_decode_plan(*plan_args, cfg, split_k) if custom
                                             else _default_decode_plan(*plan_args))
    table, expert_words, expert_groups = out, 0, 0  # unused without experts
    if experts is not None:
        table = experts[0]
        if table.shape[0] != expert_tile_count(m, qweight.shape[0], plan_m, meta["BLOCK_M"]):
            raise ValueError("w4a16 experts: the tile table was built for another row tile (w4a16_expert_tiles)")
        grid = (table.shape[0], *grid[1:])
        tiles = table.shape[0] * grid[2]
        expert_words, expert_groups = qweight.stride(0), scales.stride(0)
        meta = {**meta, "EXPERTS": True}
    ws = count = out  # unused without split-K
    if split_k > 1:
        ws, count = _split_workspace(device, (m - 1) * out.stride(0) + n, tiles, cache_workspace)
    args = (x2, qweight, scales, zeros, out, ws, count, m, n, k, x2.stride(0), out.stride(0), group_size, per_split,
            split_k, seg1, seg2, table, expert_words, expert_groups)
    if custom:
        _decode_kernel[grid](*args, **meta, **COMPILE_OPTIONS)
    else:  # plan_args determine meta
        _DECODE_LAUNCH.launch(grid, args, meta, (plan_args, experts is not None))
    return out


def _decode_grad_input(dy2, qweight, scales, zeros, group_size, dx, cfg=None, split_n=None):
    m, n = dy2.shape
    k = qweight.shape[0] * 8
    interpret = interpreting()
    if cfg is None:
        # One warp per program: with a 16-row output tile more warps would only replicate the unpacking.
        cfg = dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=1) if interpret else \
            dict(BLOCK_M=16 if m <= 16 else 32, BLOCK_N=64, num_warps=1, num_stages=4)
    k_tiles = cdiv(k, _BLOCK_K)
    m_tiles = cdiv(m, cfg["BLOCK_M"])
    n_steps = cdiv(n, cfg["BLOCK_N"])
    if split_n is None:
        split_n = _splits(k_tiles * m_tiles, n_steps, _num_sms(dy2.device), min_steps=4, per_sm=8)
    per_split = cdiv(n_steps, split_n)
    split_n = cdiv(n_steps, per_split)
    target = dx if split_n == 1 else torch.zeros((m, k), device=dy2.device, dtype=torch.float32)
    _decode_grad_kernel[(k_tiles, split_n, m_tiles)](
        dy2, qweight, scales, zeros, target, m, n, k, dy2.stride(0), target.stride(0), group_size, per_split,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], TILE_GROUPS=_tile_groups(group_size, k),
        PLANE_GROUPS=_plane_groups(group_size, k), EVEN_K=k % _BLOCK_K == 0, ATOMIC=split_n > 1,
        USE_PTX=_use_ptx(dy2.device, dy2.dtype), FP32_DOT=interpret,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **COMPILE_OPTIONS)
    if split_n > 1:
        dx.copy_(target)
    return dx


def _dequantize(qweight, scales, zeros, group_size, dtype, use_ptx=None):
    k = qweight.shape[0] * 8
    n = qweight.shape[1]
    w = torch.empty((k, n), device=qweight.device, dtype=dtype)
    block_n, warps = (64, 4) if interpreting() else (256, 8)
    if use_ptx is None:
        use_ptx = _use_ptx(qweight.device, dtype)
    grid = (cdiv(k, _BLOCK_K), cdiv(n, block_n))
    _dequant_kernel[grid](qweight, scales, zeros, w, n, k, group_size, BLOCK_N=block_n,
                          TILE_GROUPS=_tile_groups(group_size, k), PLANE_GROUPS=_plane_groups(group_size, k),
                          EVEN_K=k % _BLOCK_K == 0, USE_PTX=use_ptx,
                          num_warps=warps, **COMPILE_OPTIONS)
    return w


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, *, cache_workspace: bool = True) -> torch.Tensor:
    """y = x @ W with W held as 4-bit words (layout in the module docstring).

    x: [..., K] float16/bfloat16 (contiguous last dim preferred); returns [..., N] in x's dtype.
    group_size: K // scales.shape[0], or -1 for one group over all of K.
    qweight is `w4a16_pack(codes)` (what W4A16Linear holds), not a GPTQ checkpoint's qweight.
    M (rows of x) <= DECODE_MAX_M runs the fused kernel; larger M dequantizes W into a temporary [K, N] tensor
    (K * N * 2 bytes) and calls cuBLAS, which measured faster there. On Hopper, GLUON_MIN_M <= M <= GLUON_MAX_M
    runs the Gluon kernel (`gluon_w4a16_matmul`) instead, where it supports the layer (K a multiple of 128).
    cache_workspace=False zeroes a fresh split-K workspace per call (two small memsets) instead of reusing the
    cached, self-cleaning one: for callers whose allocations live in a CUDA-graph memory pool (torch.compile
    mode="reduce-overhead"), where a cached tensor would outlive the pool's bookkeeping.
    """
    what = "w4a16_matmul"
    _check_activation(x, what, "x")
    k, n, group_size = _check_weights(qweight, scales, zeros, group_size, x.dtype, x.device, what)
    x2, lead = _as_rows(x, k, f"{what}: x", f"K = {k} (qweight.shape[0] * 8)")
    y = w4a16_matmul_rows(x2, _contiguous(qweight), _contiguous(scales), _contiguous(zeros), group_size,
                          cache_workspace=cache_workspace)
    return y.reshape(*lead, n)


@on_input_device
def w4a16_matmul_rows(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      group_size: int, *, cache_workspace: bool = True) -> torch.Tensor:
    """`w4a16_matmul` without its argument checks, for callers that validated the weights once (W4A16Linear at
    load): x2 [M, K] with unit column stride, contiguous qweight/scales/zeros of x2's dtype and device,
    group_size the effective one (K for a single group). Returns [M, N]. Decoding calls this once per linear per
    token, so its host time per call is what eager generate() pays."""
    m = x2.shape[0]
    if GLUON_MIN_M <= m <= GLUON_MAX_M and _gluon_pays_off(x2):
        y = _gluon_matmul(x2, qweight, scales, zeros, group_size)
        if y is not None:
            return y
    if m > DECODE_MAX_M:
        return torch.matmul(x2, _dequantize(qweight, scales, zeros, group_size, x2.dtype))
    n = qweight.shape[1]
    out = torch.empty((m, n), device=x2.device, dtype=x2.dtype)
    if m > 0 and n > 0:
        _decode_matmul(x2, qweight, scales, zeros, group_size, out, cache_workspace=cache_workspace)
    return out


def _gluon_pays_off(x2) -> bool:
    """Whether the Gluon kernel's GPU-time lead counts: inside a CUDA graph (captured once, replayed without host
    work), or eagerly if GLUON_EAGER asks for it (eager W4A16 forward passes measured host-bound: GLUON_EAGER)."""
    return GLUON_EAGER or (x2.is_cuda and torch.cuda.is_current_stream_capturing())


def _gluon_matmul(x2, qweight, scales, zeros, group_size, segments=None):
    """x2 @ W by the Gluon kernel, or None where it does not run (not Hopper, no Gluon in this Triton, a layer it
    does not take, or it failed to build here: one warning, then the Triton paths from then on). segments: as for
    `gluon_w4a16_matmul_rows` (needs scales by TMA)."""
    if GLUON_BUILD_ERRORS or not x2.is_cuda or interpreting():
        return None
    from . import gluon_w4a16  # imports this module (the shared PTX): only here, not at import time

    if not gluon_w4a16.supported(x2, qweight, group_size) or (
            segments is not None and not gluon_w4a16.scales_by_tma(qweight.shape[1], group_size)):
        return None
    try:
        return gluon_w4a16.gluon_w4a16_matmul_rows(x2, qweight, scales, zeros, group_size, segments=segments)
    except CompilationError as exc:
        gluon_build_failed(GLUON_BUILD_ERRORS, exc, __name__, "gluon-w4a16-build", "Gluon W4A16 kernel",
                           "the Triton W4A16 kernels")
        return None


SEGMENT_COLUMNS = 256  # one launch over several weights needs each N_j a multiple of every decode config's BLOCK_N
# One launch over several weights beat one call per weight up to 16 rows on every Llama-3 8B/70B group measured
# (1.02-2.15x, H200, benchmarks/results/w4a16_fused_projections.json); from 64 rows it lost on some (0.77x).
CONCAT_MAX_M = 16
_INTERPRET_SEGMENT_COLUMNS = 64  # the interpreter's BLOCK_N


def w4a16_segment_columns() -> int:
    """What each weight's N must be a multiple of for `w4a16_matmul_concat` to run it in one launch with others."""
    return _INTERPRET_SEGMENT_COLUMNS if interpreting() else SEGMENT_COLUMNS


def w4a16_back_to_back(parts) -> bool:
    """Whether 1-3 weights (qweight, scales, zeros) can run as one launch in `w4a16_matmul_concat`: same K and
    groups, each N_j a multiple of `w4a16_segment_columns()`, and each of the three tensor kinds stored back to
    back in memory in the parts' order (e.g. contiguous slices of one allocation, as `W4A16Linear` layers hold
    them after `quantization.fusion.fuse_siblings`)."""
    if not 1 <= len(parts) <= 3:
        return False
    q0, s0, z0 = parts[0]
    words, groups = q0.shape[0], s0.shape[0]
    align = w4a16_segment_columns()
    cols = 0
    for q, s, z in parts:
        if (q.shape[0] != words or s.shape[0] != groups or q.shape[1] % align
                or not (q.is_contiguous() and s.is_contiguous() and z.is_contiguous())
                or q.data_ptr() != q0.data_ptr() + 4 * words * cols
                or s.data_ptr() != s0.data_ptr() + s0.element_size() * groups * cols
                or z.data_ptr() != z0.data_ptr() + z0.element_size() * groups * cols):
            return False
        cols += q.shape[1]
    return True


def w4a16_matmul_concat(x: torch.Tensor, parts, group_size: int, *, cache_workspace: bool = True) -> torch.Tensor:
    """y = x @ [W_0 | W_1 | W_2]: 1-3 weights that share their input (q/k/v, gate/up), parts = [(qweight, scales,
    zeros), ...] as for `w4a16_matmul`, same K and group_size. Returns [..., N_0 + N_1 + N_2].

    Up to CONCAT_MAX_M rows and with the parts `w4a16_back_to_back`, one launch covers all the parts (decoding:
    one call instead of three, and the short calls of the small k/v projections fill the GPU together); otherwise
    one call per part, concatenated. cache_workspace as for `w4a16_matmul`."""
    what = "w4a16_matmul_concat"
    _check_activation(x, what, "x")
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"{what}: takes 1 to 3 weights, got {len(parts)}")
    checked = [_check_weights(q, s, z, group_size, x.dtype, x.device, f"{what}: part {i}")
               for i, (q, s, z) in enumerate(parts)]
    k, _, group_size = checked[0]
    if any(c[0] != k or c[2] != group_size for c in checked):
        raise ValueError(f"{what}: every part must have the same K and group size, got "
                         f"{[(c[0], c[2]) for c in checked]}")
    x2, lead = _as_rows(x, k, f"{what}: x", f"K = {k} (qweight.shape[0] * 8)")
    if len(parts) > 1 and 0 < x2.shape[0] <= CONCAT_MAX_M and w4a16_back_to_back(parts):
        y = w4a16_matmul_concat_rows(x2, parts, group_size, cache_workspace=cache_workspace)
    else:
        y = torch.cat([w4a16_matmul_rows(x2, *p, group_size, cache_workspace=cache_workspace) for p in parts], 1)
    return y.reshape(*lead, y.shape[1])


@on_input_device
def w4a16_matmul_concat_rows(x2: torch.Tensor, parts, group_size: int, *, cache_workspace: bool = True) -> torch.Tensor:
    """One launch of `w4a16_matmul_concat` without its checks: x2 [M, K] with 1 <= M <= DECODE_MAX_M (fastest up to
    CONCAT_MAX_M) and unit column stride, parts `w4a16_back_to_back` in x2's dtype and device, group_size the
    effective one."""
    ns = [p[0].shape[1] for p in parts]
    segments = (ns[0], ns[0] + ns[1] if len(ns) == 3 else sum(ns))
    if GLUON_MIN_M <= x2.shape[0] <= GLUON_MAX_M and _gluon_pays_off(x2) and not any(n % 128 for n in ns):
        y = _gluon_matmul(x2, *_spanning(parts, sum(ns)), group_size, segments=segments)
        if y is not None:
            return y
    out = torch.empty((x2.shape[0], sum(ns)), device=x2.device, dtype=x2.dtype)
    _decode_matmul(x2, *parts[0], group_size, out, cache_workspace=cache_workspace, segments=segments)
    return out


def w4a16_expert_block_m(rows_per_expert: int, k: int, n: int, group_size: int) -> int:
    """The row tile `w4a16_experts_matmul_rows` runs a [E, K, N] stack with when experts get about
    `rows_per_expert` rows each: the tile table (`w4a16_expert_tiles`) must be built for it."""
    return _decode_config(rows_per_expert, k, n, interpreting(), _tile_groups(group_size, k),
                          _plane_groups(group_size, k))["BLOCK_M"]


def expert_tile_count(rows: int, experts: int, rows_per_expert: int, block_m: int) -> int:
    """Entries of the tile table: every expert's last tile may be partial, and at most min(E, rows) experts have
    rows (a fixed count: no host sync, and a CUDA graph replays any routing)."""
    return cdiv(rows, block_m) + min(experts, rows)


def w4a16_expert_tiles(offsets: torch.Tensor, rows: int, block_m: int) -> torch.Tensor:
    """int32 [T, 3] (expert, first row, end row) tiles of `block_m` rows over rows sorted by expert, expert e's rows
    being [offsets[e], offsets[e + 1]); T = `expert_tile_count`, the unused entries empty (0, 0, 0). Torch ops
    only, no host sync: one table serves every launch of a forward that uses this row tile."""
    experts = offsets.shape[0] - 1
    counts = offsets[1:] - offsets[:-1]
    per_expert = (counts + block_m - 1) // block_m
    last = torch.cumsum(per_expert, 0)  # one past each expert's last tile
    t = torch.arange(cdiv(rows, block_m) + min(experts, rows), device=offsets.device)
    expert = torch.searchsorted(last, t, right=True)
    valid = expert < experts
    e = expert.clamp(max=experts - 1)
    start = offsets[:-1][e] + (t - (last[e] - per_expert[e])) * block_m
    end = torch.minimum(start + block_m, offsets[1:][e])
    return torch.stack([e, start, end], 1).masked_fill(~valid[:, None], 0).to(torch.int32)


@on_input_device
def w4a16_experts_matmul_rows(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                              group_size: int, tiles: torch.Tensor, rows_per_expert: int, widths=None, *,
                              cache_workspace: bool = True) -> torch.Tensor:
    """One launch for a mixture of experts' weights: row r of x2 [R, K] (rows sorted by expert) times the weight of
    its expert. qweight [E, K / 8, N], scales / zeros [E, G, N]: each expert's weight in `w4a16_matmul`'s layout,
    stacked (views of back-to-back storage are fine: only unit strides inside an expert are needed); tiles from
    `w4a16_expert_tiles` with `w4a16_expert_block_m(rows_per_expert, ...)`. widths (N_0, N_1[, N_2]): each expert
    holds 2-3 weights of one input back to back (gate, up), qweight / scales / zeros being the first one's stacks
    and the expert stride covering all; the outputs come side by side ([R, sum N_j]), each N_j a multiple of
    `w4a16_segment_columns()`. Returns [R, N]; rows of no tile (routed to no expert) are left unwritten."""
    n = qweight.shape[2] if not widths else sum(widths)
    segments = None if not widths else (widths[0], widths[0] + widths[1] if len(widths) == 3 else n)
    out = torch.empty((x2.shape[0], n), device=x2.device, dtype=x2.dtype)
    if x2.shape[0] > 0 and n > 0:
        _decode_matmul(x2, qweight, scales, zeros, group_size, out, cache_workspace=cache_workspace,
                       segments=segments, experts=(tiles, rows_per_expert))
    return out


def _spanning(parts, n: int):
    """(qweight, scales, zeros) views over back-to-back parts as if one layer of n columns: the same memory, the
    parts' flat data one after the other (each still packed on its own: `segments` tells the kernel where)."""
    return tuple(t.as_strided((t.shape[0], n), (n, 1)) for t in parts[0])


@on_input_device
def w4a16_matmul_grad_input(dy: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                            group_size: int) -> torch.Tensor:
    """dx = dy @ W^T: dy [..., N] float16/bfloat16 -> dx [..., K] in dy's dtype (the input gradient of y = x @ W).
    Fused for M <= GRAD_DECODE_MAX_M, dequantize + cuBLAS above (training batches)."""
    what = "w4a16_matmul_grad_input"
    _check_activation(dy, what, "dy")
    k, n, group_size = _check_weights(qweight, scales, zeros, group_size, dy.dtype, dy.device, what)
    dy2, lead = _as_rows(dy, n, f"{what}: dy", f"N = {n} (qweight.shape[1])")
    m = dy2.shape[0]
    qweight, scales, zeros = _contiguous(qweight), _contiguous(scales), _contiguous(zeros)
    if m > GRAD_DECODE_MAX_M:
        return torch.matmul(dy2, _dequantize(qweight, scales, zeros, group_size, dy.dtype).t()).reshape(*lead, k)
    dx = torch.empty((m, k), device=dy.device, dtype=dy.dtype)
    if m > 0:
        if n == 0:
            dx.zero_()
        else:
            _decode_grad_input(dy2, qweight, scales, zeros, group_size, dx)
    return dx.reshape(*lead, k)


@on_input_device
def w4a16_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """Materialise W [K, N] (rounded once to scales' dtype, or `dtype`): for peers, LoRA merging, debugging."""
    what = "w4a16_dequantize"
    if not isinstance(scales, torch.Tensor) or scales.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{what}: scales must be a float16 or bfloat16 tensor, got {getattr(scales, 'dtype', None)}")
    if qweight.device.type != "cuda" and not interpreting():
        raise ValueError(f"{what}: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1)")
    k, n, group_size = _check_weights(qweight, scales, zeros, group_size, scales.dtype, qweight.device, what)
    dtype = dtype or scales.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{what}: dtype must be float16 or bfloat16, got {dtype}")
    scales, zeros = scales.to(dtype), zeros.to(dtype)
    return _dequantize(_contiguous(qweight), _contiguous(scales), _contiguous(zeros), group_size, dtype)
