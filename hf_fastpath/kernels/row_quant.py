"""Per-token quantization of attention operands on the GPU: rows of `[B, S, H, D]` (or `[T, H, D]`) to e4m3 with
one fp32 scale per row (FP8), to FP4 values in e4m3 containers (MXFP4 / NVFP4 block scales), or to packed MXFP4
codes + E8M0 exponents; optionally rotated by a Hadamard matrix first, optionally written transposed (the K-major
layout Hopper's FP8 MMA wants for its second operand). The low-bit attention forward (`lowbit_attention`) and the
FP8-products backward (`flash_attention`) both read these; `lowbit_quant` is the float reference of the same
numerics.

Scales lie along the head dim only (one per token and head), so quantizing never mixes tokens: causally safe.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import cdiv, interpreting, next_pow2
from .device import on_input_device
from .launch import COMPILE_OPTIONS

__all__ = ["quantize_e4m3_rows", "can_fuse_rotation", "hadamard_pm1", "QUANT_TILES"]


@triton.jit
def _ceil_exp2(y):
    """Biased fp32 exponent of the smallest power of two >= y >= 0 (the bit trick of `lowbit_quant.ceil_pow2`)."""
    bits = y.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _e2m1_index(a):
    """a >= 0 (in units of the block scale) -> index 0..7 of the nearest E2M1 magnitude (0, .5, 1, 1.5, 2, 3, 4, 6),
    ties to even, saturating: the thresholds of `lowbit_quant.e2m1_encode`."""
    return (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + \
        (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)


@triton.jit
def _round_e4m3_nonneg(x):
    """x >= 0 rounded to e4m3 (nearest, ties to even, saturating at 448) in fp32 arithmetic. Used under the
    interpreter, whose fp32->fp8 conversion drops the carry into the next binade (127.7 -> 64)."""
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum((bits >> 23) & 0xFF, 121)  # 121 = 2**-6, the smallest e4m3 normal; below, fixed 2**-9 steps
    ulp = ((e - 3) << 23).to(tl.float32, bitcast=True)
    y = x / ulp
    r = (y + 12582912.0) - 12582912.0  # 1.5 * 2**23: fp32 addition rounds to an integer, ties to even
    return tl.minimum(r * ulp, 448.0)


@triton.jit
def _to_e4m3(x, EMULATE: tl.constexpr):
    """fp32 (|x| <= 448) -> e4m3, nearest-even; under the interpreter via fp32 arithmetic (its cast mis-rounds)."""
    if EMULATE:
        r = _round_e4m3_nonneg(tl.abs(x))
        return tl.where(x < 0, -r, r).to(tl.float8e4nv)  # exact values: the cast cannot mis-round them
    return x.to(tl.float8e4nv)


@triton.jit
def _load_hadamard(HAD, D: tl.constexpr):
    offs = tl.arange(0, D)
    return tl.load(HAD + offs[:, None] * D + offs[None, :])


@triton.jit
def _rotate_rows(x, had, rot_scale, EMULATE: tl.constexpr):
    """x `[rows, D]` times the +-1 Hadamard matrix had `[D, D]` times rot_scale (= 1/sqrt(D): orthonormal): exact
    products in x's 16-bit dtype, fp32 sums (fp32 throughout under the interpreter or for fp32 x)."""
    if EMULATE or x.dtype == tl.float32:
        return tl.dot(x.to(tl.float32), had.to(tl.float32), input_precision="ieee") * rot_scale
    return tl.dot(x, had.to(x.dtype)) * rot_scale


@triton.jit
def _fp8_rows(x, EMULATE: tl.constexpr):
    """fp32 rows -> (e4m3 rows, fp32 row scales amax / 448)."""
    x = tl.minimum(tl.maximum(x.to(tl.float32), -3.0e38), 3.0e38)
    row = tl.maximum(tl.max(tl.abs(x), 1), 1e-30) / 448.0
    return _to_e4m3(tl.minimum(tl.maximum(x / row[:, None], -448.0), 448.0), EMULATE), row


@triton.jit
def _quant_rows_kernel(X, Y, S_OUT, HAD, rot_scale, stride_b, stride_s, stride_h, S, T_PAD,
                       H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, FMT: tl.constexpr,
                       TRANSPOSE: tl.constexpr, ROTATE: tl.constexpr, BLOCK_T: tl.constexpr, CHUNKS: tl.constexpr,
                       EMULATE: tl.constexpr):
    """Rows of x `[B, S, H, D]` (any strides, unit along D) -> e4m3 `[B*S, H, D]` (or `[H, D, T_PAD]` with
    TRANSPOSE) and fp32 row scales `[B*S, H]`. FMT 0: fp8 per row; 1: MXFP4 values; 2: NVFP4 values (in e4m3
    containers, as `lowbit_quant.fp4_rows_to_e4m3`); 3: packed MXFP4, uint8 codes `[B*S, H, D/2]` and E8M0
    exponents `[B*S, H, D/32]` in S_OUT, as `lowbit_quant.quantize_rows(x, "mxfp4")` (D a power of two >= 32).
    ROTATE: rows times the +-1 Hadamard matrix HAD `[D, D]` (in x's dtype: exact products, fp32 sums) times rot_scale = 1/sqrt(D) first, saving a pass over x. A program
    quantizes CHUNKS tiles of BLOCK_T rows of one head, so the matrix is read once per CHUNKS tiles (read per
    64-row tile, its 32-64 KB of L2 traffic per program nearly doubled the quantizer's time on the H200)."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    if ROTATE:
        had = _load_hadamard(HAD, D)
    else:
        had = 0.0
    for c in range(CHUNKS):
        offs_t = (pid_t * CHUNKS + c) * BLOCK_T + tl.arange(0, BLOCK_T)
        _quant_rows_tile(X, Y, S_OUT, had, rot_scale, stride_b, stride_s, stride_h, S, T_PAD, b, h, offs_t, H, D,
                         D_PAD, FMT, TRANSPOSE, ROTATE, BLOCK_T, EMULATE)


@triton.jit
def _quant_rows_tile(X, Y, S_OUT, had, rot_scale, stride_b, stride_s, stride_h, S, T_PAD, b, h, offs_t,
                     H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, FMT: tl.constexpr,
                     TRANSPOSE: tl.constexpr, ROTATE: tl.constexpr, BLOCK_T: tl.constexpr, EMULATE: tl.constexpr):
    offs_d = tl.arange(0, D_PAD)
    t_ok = offs_t < S
    d_ok = offs_d < D
    x = tl.load(X + b * stride_b + offs_t[:, None] * stride_s + h * stride_h + offs_d[None, :],
                mask=t_ok[:, None] & d_ok[None, :], other=0.0)
    if ROTATE:
        x = _rotate_rows(x, had, rot_scale, EMULATE)
    if FMT == 0:
        y, row = _fp8_rows(x, EMULATE)
    else:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -3.0e38), 3.0e38)
        BLK: tl.constexpr = 16 if FMT == 2 else 32
        xb = tl.reshape(x, (BLOCK_T, D_PAD // BLK, BLK))
        amax_b = tl.max(tl.abs(xb), 2)
        if FMT == 2:
            row_s = tl.maximum(tl.max(amax_b, 1), 1e-30) / 2688.0  # amax / (6 * 448)
            sb = _to_e4m3(tl.minimum(amax_b / 6.0 / row_s[:, None], 448.0), EMULATE).to(tl.float32)
            eff = sb * row_s[:, None]
            rel = sb / 8.0
            row = row_s * 8.0
        else:  # MXFP4: E8M0 block exponents
            e = tl.minimum(tl.maximum(_ceil_exp2(amax_b / 6.0), 1), 254)
            eff = (e << 23).to(tl.float32, bitcast=True)
            row = tl.max(eff, 1)
            rel = eff / row[:, None]
        a = tl.where(eff[:, :, None] > 0, tl.abs(xb) / tl.maximum(eff, 1e-38)[:, :, None], 0.0)
        idx = _e2m1_index(a)
        if FMT == 3:  # packed: codes two a byte (even element in the low nibble), sign bit 3; exponents as bytes
            code = idx | (((xb < 0) & (idx > 0)).to(tl.int32) << 3)
            lo, hi = tl.split(tl.reshape(code, (BLOCK_T, D // 2, 2)))
            tok = b * S + offs_t
            tl.store(Y + (tok[:, None] * H + h) * (D // 2) + tl.arange(0, D // 2)[None, :],
                     (lo | (hi << 4)).to(tl.uint8), mask=t_ok[:, None])
            tl.store(S_OUT + (tok[:, None] * H + h) * (D // 32) + tl.arange(0, D // 32)[None, :], e.to(tl.uint8),
                     mask=t_ok[:, None])
        else:
            m = tl.where(idx <= 4, idx.to(tl.float32) * 0.5, tl.where(idx == 7, 6.0, idx.to(tl.float32) - 2.0))
            v = tl.where(xb < 0, -m, m) * rel[:, :, None]
            y = _to_e4m3(tl.reshape(v, (BLOCK_T, D_PAD)), EMULATE)
    if FMT != 3:
        tok = b * S + offs_t
        if TRANSPOSE:
            tl.store(Y + (h * D + offs_d)[:, None] * T_PAD + tok[None, :], tl.trans(y),
                     mask=d_ok[:, None] & t_ok[None, :])
        else:
            tl.store(Y + (tok[:, None] * H + h) * D + offs_d[None, :], y, mask=t_ok[:, None] & d_ok[None, :])
        tl.store(S_OUT + tok * H + h, row, mask=t_ok)


_FMT_CODE = {"fp8": 0, "mxfp4": 1, "nvfp4": 2, "mxfp4_packed": 3}


_HADAMARD_PM1: dict = {}


def hadamard_pm1(d: int, device, dtype=torch.float32) -> torch.Tensor:
    """Sylvester-Hadamard matrix of +-1 entries `[d, d]` (symmetric; H @ H = d * I), cached per device and dtype."""
    key = (d, str(device), dtype)
    if key not in _HADAMARD_PM1:
        h = torch.ones(1, 1)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _HADAMARD_PM1[key] = h.to(device=device, dtype=dtype)
    return _HADAMARD_PM1[key]


# (rows per tile, tiles per program) of quantize_e4m3_rows on the GPU, without and with the rotation. H200, 4 x 4096
# tokens x 16 heads x hd 128 (results/archive/lowbit_quantizer_chunks_s6.json): rotated 58.7 -> 42.7 µs (transposed V 67.0
# -> 58.5) with 8 tiles a program; unrotated, more tiles only cost (32.3 µs with 1, 37.1 with 8).
QUANT_TILES = {False: (64, 1), True: (64, 8)}


def can_fuse_rotation(d: int) -> bool:
    """The quantizer applies the head-dim rotation itself for powers of two in [32, 128]. (At 256 every program
    reads the 256 KB matrix: on the H200 the fused hd-256 path was slower than a separate matmul, 660 vs 682
    TFLOP/s end to end.)"""
    return 32 <= d <= 128 and d & (d - 1) == 0


@on_input_device
def quantize_e4m3_rows(x: torch.Tensor, fmt: str, transpose: bool = False, rotate: bool = False):
    """Fused Triton version of `quantize_for_attention`: x `[B, S, H, D]` or `[T, H, D]` (unit stride along D) ->
    (e4m3 `[B*S, H, D]`, or `[H, D, T_pad]` with `transpose`; fp32 scales `[B*S, H]`). `rotate`: quantize
    x @ (orthonormal Hadamard) instead (needs `can_fuse_rotation(D)`). fmt "mxfp4_packed": (uint8 codes
    `[B*S, H, D/2]`, uint8 E8M0 exponents `[B*S, H, D/32]`), the operands of the native FP4 Q.K^T (D a power of
    two >= 32, no transpose)."""
    if x.dim() == 3:
        x = x[None]
    if x.stride(-1) != 1:
        x = x.contiguous()
    b, s, h, d = x.shape
    d_pad = max(32, next_pow2(d))
    t = b * s
    t_pad = (t + 15) // 16 * 16
    if fmt == "mxfp4_packed":
        if d != d_pad or transpose:
            raise ValueError(f"packed MXFP4 rows need a power-of-two head dim >= 32 and no transpose (got {d})")
        y = torch.empty(t, h, d // 2, dtype=torch.uint8, device=x.device)
        scale = torch.empty(t, h, d // 32, dtype=torch.uint8, device=x.device)
    else:
        y = torch.zeros(h, d, t_pad, dtype=torch.float8_e4m3fn, device=x.device) if transpose else \
            torch.empty(t, h, d, dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.empty(t, h, dtype=torch.float32, device=x.device)
    if rotate and not (d >= 32 and d & (d - 1) == 0):
        raise ValueError(f"the fused rotation needs a power-of-two head dim >= 32, got {d}")
    # the matrix in x's dtype (+-1 exactly): half the bytes each program reads
    had = hadamard_pm1(d, x.device, x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float32) \
        if rotate else scale
    block_t, chunks = (32, 2) if interpreting() else QUANT_TILES[bool(rotate)]
    _quant_rows_kernel[(cdiv(s, block_t * chunks), b * h)](
        x, y, scale, had, 1.0 / math.sqrt(d), x.stride(0), x.stride(1), x.stride(2), s, t_pad, H=h, D=d, D_PAD=d_pad,
        FMT=_FMT_CODE[fmt], TRANSPOSE=transpose, ROTATE=bool(rotate), BLOCK_T=block_t, CHUNKS=chunks,
        EMULATE=interpreting(),
        num_warps=4, **COMPILE_OPTIONS)
    return y, scale
