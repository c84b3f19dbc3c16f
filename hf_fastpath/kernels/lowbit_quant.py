"""FP8 (E4M3) and FP4 (E2M1) quantization of attention rows: reference arithmetic shared by kernels and tests.

Every format scales along the LAST dimension only (the head dim of one token of one head), so quantizing token t
never looks at another token: a later token can never change an earlier token's numbers (causally safe), and a KV
cache can append tokens without re-quantizing.

Formats (`x` is `[..., D]`; `...` is typically `[B, S, H]`):
- ``fp8``:   e4m3 values `[..., D]` and one fp32 scale per row `[...]` (amax / 448).
- ``mxfp4``: E2M1 codes packed two per byte `[..., D/2]` (even element in the low nibble) and one E8M0 scale
  (uint8, biased exponent, 2**(byte-127)) per 32 values `[..., D/32]`. The shared exponent is rounded UP
  (`2**ceil(log2(amax/6))`), so no value saturates; the OCP spec's floor rule clips up to 25% of a block's max.
- ``nvfp4``: E2M1 codes as above, one e4m3 scale per 16 values `[..., D/16]`, and one fp32 scale per row `[...]`
  (amax / (6 * 448)). NVIDIA's recipe uses one fp32 scale per tensor; per row keeps it causally safe.

E2M1 codes: bits 0-2 index the magnitudes (0, .5, 1, 1.5, 2, 3, 4, 6), bit 3 is the sign. Rounding is to nearest,
ties to even (the code with an even mantissa bit), like hardware conversions.

Bad input: by default (`check=True`) NaN or +-inf raise ValueError; with `check=False` (hot paths, no host sync)
+-inf saturate to the format's largest value and NaN rows give NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "FORMATS",
    "FP8_MAX",
    "E2M1_VALUES",
    "QuantizedRows",
    "quantize_rows",
    "dequantize_rows",
    "quantize_fp8",
    "round_to_e2m1",
    "e2m1_encode",
    "e2m1_decode",
    "pack_nibbles",
    "unpack_nibbles",
    "ceil_pow2",
    "fp4_rows_to_e4m3",
    "recode_for_decode",
    "recode_from_decode",
]

FORMATS = ("fp8", "mxfp4", "nvfp4")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
BLOCK = {"mxfp4": 32, "nvfp4": 16}
_TINY_AMAX = 1e-30  # zero rows get this amax: finite scale, all codes 0
_BIG = 3.0e38  # inputs are clamped here first so +-inf saturate instead of turning into NaN


@dataclass
class QuantizedRows:
    """Quantized `[..., D]` rows. `data`: e4m3 `[..., D]` (fp8) or packed uint8 `[..., D/2]` (fp4);
    `scale`: fp32 `[...]` (fp8, nvfp4) or None; `block_scale`: uint8 E8M0 (mxfp4) / e4m3 (nvfp4) `[..., D/block]`."""

    fmt: str
    data: torch.Tensor
    scale: torch.Tensor | None
    block_scale: torch.Tensor | None
    head_dim: int

    @property
    def shape(self):
        return (*self.data.shape[:-1], self.head_dim)


def _prepare(x: torch.Tensor, check: bool) -> torch.Tensor:
    if not x.is_floating_point():
        raise TypeError(f"expected a floating point tensor, got {x.dtype}")
    if check and not bool(torch.isfinite(x).all()):
        raise ValueError("cannot quantize NaN or inf values; pass check=False to saturate +-inf (NaN stays NaN)")
    return x.float().clamp(-_BIG, _BIG)


def ceil_pow2(y: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= y for y >= 0 (fp32, exact: exponent bits + 1 when the mantissa is not zero).
    Zero stays zero; fp32 subnormals give 2**-126. Mirrors the bit trick in the kernels, so both round identically."""
    bits = y.float().contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def quantize_fp8(x: torch.Tensor, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3: returns `(values e4m3 [..., D], scale fp32 [...])` with `x ~ values * scale`."""
    xf = _prepare(x, check)
    amax = xf.abs().amax(-1).clamp_min(_TINY_AMAX)
    scale = amax / FP8_MAX
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def round_to_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the signed E2M1 grid (saturating at +-6), nearest with ties to even.
    Written as threshold counting so the Triton kernels can use the identical arithmetic."""
    a = y.abs()
    m = (0.5 * ((a > 0.25).float() + (a >= 0.75).float() + (a > 1.25).float() + (a >= 1.75).float())
         + (a > 2.5).float() + (a >= 3.5).float() + 2.0 * (a > 5.0).float())
    return torch.where(y < 0, -m, m)


_CODE_OF_MAG = {v: i for i, v in enumerate(E2M1_VALUES)}


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """fp32 values (any) -> uint8 codes 0..15 of their E2M1 rounding. Zero magnitude is always code 0."""
    a = y.abs()
    idx = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
           + (a > 5.0))
    idx = idx.to(torch.uint8)
    sign = ((y < 0) & (idx > 0)).to(torch.uint8) << 3
    return idx | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> fp32 values."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """`[..., D]` codes (0..15) -> `[..., D/2]` uint8; even index in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"the packed dimension must be even, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """`[..., D/2]` uint8 -> `[..., D]` codes."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def _blocks(xf: torch.Tensor, block: int) -> torch.Tensor:
    d = xf.shape[-1]
    if d % block:
        raise ValueError(f"head dim {d} must be a multiple of the FP4 scale block ({block}); pad the head dim or "
                         "use fmt='fp8'")
    return xf.reshape(*xf.shape[:-1], d // block, block)


def quantize_rows(x: torch.Tensor, fmt: str, check: bool = True) -> QuantizedRows:
    """Quantize `[..., D]` rows to `fmt` in {"fp8", "mxfp4", "nvfp4"} (see module docstring)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown low-bit format {fmt!r}; choose one of {FORMATS}")
    d = x.shape[-1]
    if fmt == "fp8":
        q, s = quantize_fp8(x, check)
        return QuantizedRows(fmt, q, s, None, d)
    xf = _prepare(x, check)
    xb = _blocks(xf, BLOCK[fmt])
    amax_b = xb.abs().amax(-1)
    if fmt == "mxfp4":
        scale_b = ceil_pow2(amax_b / E2M1_MAX)
        # E8M0 holds 2**-127 .. 2**127; a zero block gets the smallest scale and all-zero codes.
        exp = ((scale_b.view(torch.int32) >> 23) & 0xFF).clamp(1, 254)
        scale_b = (exp << 23).view(torch.float32)
        codes = e2m1_encode(xb / scale_b[..., None])
        return QuantizedRows(fmt, pack_nibbles(codes.flatten(-2)), None, exp.to(torch.uint8), d)
    # nvfp4: per-row fp32 scale so that block scales use e4m3's whole range.
    amax = amax_b.amax(-1).clamp_min(_TINY_AMAX)
    row_scale = amax / (E2M1_MAX * FP8_MAX)
    scale_b8 = (amax_b / E2M1_MAX / row_scale[..., None]).clamp(max=FP8_MAX).to(FP8_DTYPE)
    eff = scale_b8.float() * row_scale[..., None]
    y = torch.where(eff[..., None] > 0, xb / eff[..., None].clamp_min(1e-38), torch.zeros_like(xb))
    codes = e2m1_encode(y)
    return QuantizedRows(fmt, pack_nibbles(codes.flatten(-2)), row_scale, scale_b8, d)


def block_scales_fp32(qr: QuantizedRows) -> torch.Tensor:
    """Absolute fp32 scale of each block `[..., D/block]` (FP4 formats)."""
    if qr.fmt == "mxfp4":
        return (qr.block_scale.to(torch.int32) << 23).view(torch.float32)
    return qr.block_scale.float() * qr.scale[..., None]


def dequantize_rows(qr: QuantizedRows, dtype=torch.float32) -> torch.Tensor:
    """Exact values represented by `qr`, `[..., D]`."""
    if qr.fmt == "fp8":
        return (qr.data.float() * qr.scale[..., None]).to(dtype)
    vals = e2m1_decode(unpack_nibbles(qr.data))
    block = BLOCK[qr.fmt]
    vals = vals.reshape(*vals.shape[:-1], qr.head_dim // block, block) * block_scales_fp32(qr)[..., None]
    return vals.flatten(-2).to(dtype)


def fp4_rows_to_e4m3(qr: QuantizedRows) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 rows -> `(e4m3 values [..., D], fp32 row scale [...])` for FP8 tensor cores (every E2M1 value is exact
    in E4M3). mxfp4: block scales are powers of two relative to the row's largest one, so the result is exact except
    blocks over 2**8 below the row's largest block (their values fall under e4m3's subnormals; their share of the row
    is < 2**-8 anyway). nvfp4: code x e4m3 scale has up to 5 significant bits and is rounded once to e4m3 (relative
    error <= 2**-4, below FP4's own 2**-2)."""
    vals = e2m1_decode(unpack_nibbles(qr.data))
    block = BLOCK[qr.fmt]
    vals = vals.reshape(*vals.shape[:-1], qr.head_dim // block, block)
    if qr.fmt == "mxfp4":
        bs = block_scales_fp32(qr)
        row = bs.amax(-1)
        rel = bs / row[..., None]
    else:
        row = qr.scale * 8.0  # code (<=6) x e4m3 scale (<=448) / 8 <= 336 stays inside e4m3
        rel = qr.block_scale.float() / 8.0
    e4 = (vals * rel[..., None]).flatten(-2).to(FP8_DTYPE)
    return e4, row


# Decode byte layout of packed FP4 (used by `LowBitCache(packed_decode=True)`): the same two codes per byte, with the
# bits placed so a GPU turns them into fp16 numbers with fewer integer operations. Even element: magnitude in bits
# 0-2, sign in bit 6; odd element: magnitude in bits 3-5, sign in bit 7. (Standard: even = low nibble, odd = high.)
def _decode_layout_tables():
    b = torch.arange(256, dtype=torch.int32)
    even, odd = b & 0xF, b >> 4
    fwd = (even & 7) | ((even & 8) << 3) | ((odd & 7) << 3) | ((odd & 8) << 4)
    inv = torch.empty(256, dtype=torch.int32)
    inv[fwd] = b
    return fwd.to(torch.uint8), inv.to(torch.uint8)


_TO_DECODE, _FROM_DECODE = _decode_layout_tables()


def recode_for_decode(packed: torch.Tensor) -> torch.Tensor:
    """Standard packed FP4 bytes -> the decode byte layout (a bijection on bytes)."""
    return _TO_DECODE.to(packed.device)[packed.long()]


def recode_from_decode(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `recode_for_decode`."""
    return _FROM_DECODE.to(packed.device)[packed.long()]
