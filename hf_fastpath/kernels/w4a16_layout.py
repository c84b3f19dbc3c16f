"""The W4A16 weight layout: the contract between the kernels (`kernels.w4a16`) and the formats that load and save
checkpoints (`quantization.formats`). Pure torch (no Triton): pack, unpack, and the input row of every nibble.

K = in_features, N = out_features, G = K // group_size:
  qweight int32 [K // 8, N]   8 4-bit codes a word, K-tiled and stored tile-major. K tile t (inputs 128 t ...
                              128 t + 127) is 16 word rows; nibble j (bits 4 j) of its word row i holds input
                              128 t + 16 j + i, and the tile's [16, N] words are stored as an [N, 16] block of their
                              own (64 contiguous bytes per column). A ragged last tile of R < 16 rows holds inputs
                              128 t + R j + i, stored [N, R].
  scales, zeros [G, N]        activation dtype; zeros is the integer zero point as a float (8.0 for symmetric)
  W[k, n] = scales[k // gs, n] * (code(k, n) - zeros[k // gs, n]),   y = x @ W.

Why this order (the kernels' docstring has the details): nibble plane j of a [N, 16] word tile is the j-th 16-input
slice of the K tile, so the 8 planes concatenate in registers into one K = 128 tensor-core operand; tile-major
storage keeps the weight copy 16 bytes wide per thread (GPTQ's [K / 8, N] order spreads those words N apart).
Checkpoints on disk keep their GPTQ / AWQ order: `quantization.formats` converts at load and back at save.
"""

from __future__ import annotations

import torch

__all__ = ["w4a16_pack", "w4a16_unpack", "k_tile_order"]


def k_tile_order(k: int, device=None) -> torch.Tensor:
    """The input row held by each nibble of the K-tiled layout: nibble j of word row r = 16 t + i holds input row
    128 t + R j + i (R = min(16, K / 8 - 16 t): 16 except in a ragged last tile); returned flat, index 8 r + j."""
    if k % 8 != 0:
        raise ValueError(f"K = {k} must be a multiple of 8 (8 4-bit codes per int32 word)")
    r = torch.arange(k // 8, device=device)
    t, i = r // 16, r % 16
    rows_in_tile = torch.clamp(k // 8 - 16 * t, max=16)
    order = 128 * t[:, None] + rows_in_tile[:, None] * torch.arange(8, device=device)[None, :] + i[:, None]
    return order.reshape(-1)


_PACK_CHUNK_CODES = 2**25


def _tile_chunks(k: int, n: int):
    """Row ranges of whole K tiles, about _PACK_CHUNK_CODES codes each: packing and unpacking go chunk by chunk
    so that a large layer's int64 temporaries stay ~256 MB."""
    step = max(128, (_PACK_CHUNK_CODES // max(n, 1)) // 128 * 128)
    return [(r0, min(k, r0 + step)) for r0 in range(0, k, step)]


def w4a16_pack(codes: torch.Tensor) -> torch.Tensor:
    """Integer codes [K, N] in 0..15 (input rows first, y = x @ W) -> the kernels' qweight (layout above)."""
    k, n = codes.shape
    if k % 8 != 0:
        raise ValueError(f"K = {k} must be a multiple of 8 (8 4-bit codes per int32 word)")
    out = torch.empty(k // 8, n, dtype=torch.int32, device=codes.device)
    flat = out.view(-1)
    shifts = 4 * torch.arange(8, device=codes.device).view(1, 8, 1)
    for r0, r1 in _tile_chunks(k, n):
        rows = codes[r0:r1][k_tile_order(r1 - r0, codes.device)].to(torch.int64).reshape(-1, 8, n)
        words = (rows << shifts).sum(1)
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        full = (r1 - r0) // 128  # full K tiles: [16, N] word blocks stored as [N, 16]; a ragged tail [R, N] as [N, R]
        head = words[:16 * full].reshape(full, 16, n).transpose(1, 2).reshape(-1)
        flat[r0 * n // 8:r1 * n // 8] = torch.cat([head, words[16 * full:].t().reshape(-1)])
    return out


def w4a16_unpack(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of `w4a16_pack`: qweight [K // 8, N] -> int32 codes [K, N]."""
    kw, n = qweight.shape
    k = kw * 8
    codes = torch.empty(k, n, dtype=torch.int32, device=qweight.device)
    flat = qweight.reshape(-1)
    shifts = 4 * torch.arange(8, device=qweight.device).view(1, 8, 1)
    for r0, r1 in _tile_chunks(k, n):
        part = flat[r0 * n // 8:r1 * n // 8]
        rows, full = (r1 - r0) // 8, (r1 - r0) // 128
        head = part[:16 * full * n].reshape(full, n, 16).transpose(1, 2).reshape(16 * full, n)
        words = torch.cat([head, part[16 * full * n:].reshape(n, rows - 16 * full).t()]).to(torch.int64)
        nibbles = ((words & 0xFFFFFFFF)[:, None, :] >> shifts) & 0xF
        codes[r0:r1][k_tile_order(r1 - r0, qweight.device)] = nibbles.reshape(r1 - r0, n).to(torch.int32)
    return codes
