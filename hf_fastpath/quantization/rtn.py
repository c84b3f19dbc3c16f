"""Round-to-nearest (RTN) weight quantization, and the integer grid every method shares.

Conventions (shared by gptq.py and awq.py):
- a weight is handled as `W [rows=out_features, cols=in_features]` (nn.Linear layout), float32;
- a group is `group_size` consecutive input columns; one scale and one zero point per (group, output row);
- the grid: `q = clamp(round(w / scale) + zero, 0, 2**bits - 1)`, `w_hat = scale * (q - zero)`; zero is an integer;
- the result (`QuantizedWeight`) is in the layout `W4A16Linear.from_quantized` takes: codes `[K, N]`,
  scales/zeros `[G, N]`, g_idx `[K]` (K = in_features, N = out_features).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import resolve_group_size

SUPPORTED_BITS = (2, 3, 4, 8)


@dataclass
class QuantizedWeight:
    """Integer codes with their per-group scale and zero point; W[k, n] = scales[g_idx[k], n] * (codes[k, n] - zeros[g_idx[k], n])."""

    codes: torch.Tensor  # int32 [K, N]
    scales: torch.Tensor  # float32 [G, N] (already rounded to the storage dtype)
    zeros: torch.Tensor  # int32 [G, N]
    g_idx: torch.Tensor  # int32 [K]
    bits: int
    group_size: int  # -1 means one group over all of K

    def dequantize(self) -> torch.Tensor:
        """The quantized weight back in nn.Linear layout `[N, K]`, float32."""
        g = self.g_idx.long()
        w = self.scales[g] * (self.codes.float() - self.zeros[g].float())
        return w.t().contiguous()


def check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported; choose one of {SUPPORTED_BITS}")


def pad_columns(w: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero columns appended up to a multiple of `multiple` (zeros never widen a group's range: it always holds 0)."""
    extra = -w.shape[-1] % multiple
    return torch.nn.functional.pad(w, (0, extra)) if extra else w


def grid_params(w: torch.Tensor, bits: int, sym: bool, scale_dtype: torch.dtype | None = torch.float16):
    """Scale and integer zero point per row of `w [rows, cols]` so that the row's range fits the grid.

    Zero always lies inside the range (so exact zeros stay exact). `scale_dtype` rounds the scale to the dtype it will
    be stored in, so that what the algorithms see is exactly what the kernel later computes.
    """
    maxq = 2**bits - 1
    wmin = w.min(dim=1).values.clamp(max=0)
    wmax = w.max(dim=1).values.clamp(min=0)
    if sym:
        wmax = torch.maximum(wmin.abs(), wmax)
        scale = 2 * wmax / maxq
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        scale = (wmax - wmin) / maxq
    # An all-zero row: any scale works; 1 keeps the codes at the zero point.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if scale_dtype is not None:
        tiny = torch.finfo(scale_dtype).tiny
        scale = scale.clamp(min=tiny).to(scale_dtype).float()
    if not sym:
        zero = torch.round(-wmin / scale).clamp(0, maxq)
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes (as float) of `w [rows, ...]` on the grid given per row by scale/zero `[rows]`."""
    maxq = 2**bits - 1
    shape = (-1,) + (1,) * (w.dim() - 1)
    return torch.clamp(torch.round(w / scale.view(shape)) + zero.view(shape), 0, maxq)


def fake_quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    shape = (-1,) + (1,) * (w.dim() - 1)
    return scale.view(shape) * (quantize_codes(w, scale, zero, bits) - zero.view(shape))


def fake_quantize_grouped(w: torch.Tensor, bits: int, group_size: int, sym: bool,
                          scale_dtype: torch.dtype | None = torch.float16) -> torch.Tensor:
    """RTN quantize-dequantize of `w [rows, cols]` with groups of `group_size` input columns (used by AWQ's search)."""
    rows, cols = w.shape
    gs = resolve_group_size(group_size, cols)
    wp = pad_columns(w, gs)
    wg = wp.reshape(-1, gs)
    scale, zero = grid_params(wg, bits, sym, scale_dtype)
    return fake_quantize(wg, scale, zero, bits).reshape(rows, -1)[:, :cols]


def rtn_quantize(weight: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True,
                 scale_dtype: torch.dtype | None = torch.float16) -> QuantizedWeight:
    """Round every weight to the nearest grid point; `weight` in nn.Linear layout `[out, in]`."""
    check_bits(bits)
    w = weight.detach().float()
    rows, cols = w.shape
    gs = resolve_group_size(group_size, cols)
    wp = pad_columns(w, gs)
    groups = wp.shape[1] // gs
    wg = wp.reshape(rows, groups, gs).transpose(0, 1).reshape(groups * rows, gs)  # [G*N, gs]
    scale, zero = grid_params(wg, bits, sym, scale_dtype)
    codes = quantize_codes(wg, scale, zero, bits)  # [G*N, gs]
    codes = codes.reshape(groups, rows, gs).permute(0, 2, 1).reshape(groups * gs, rows)[:cols]  # [K, N]
    return QuantizedWeight(
        codes=codes.to(torch.int32),
        scales=scale.reshape(groups, rows),
        zeros=zero.reshape(groups, rows).to(torch.int32),
        g_idx=(torch.arange(cols, device=w.device) // gs).to(torch.int32),
        bits=bits,
        group_size=group_size,
    )
