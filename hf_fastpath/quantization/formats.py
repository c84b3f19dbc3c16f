"""Exact conversions between integer weight codes and the GPTQ / AWQ checkpoint tensors, and the W4A16 kernel layout.

The canonical representation (`IntWeight`), per linear with K = in_features, N = out_features, G groups:
    codes  int32 [K, N]  values in [0, 2**bits)
    scales float [G, N]
    zeros  int32 [G, N]  integer zero points (a GPTQ v1 file can say 2**bits: it stores zero - 1)
    g_idx  int32 [K]     group of each input row (non-monotonic for act-order / desc_act)
    W[k, n] = scales[g_idx[k], n] * (codes[k, n] - zeros[g_idx[k], n])

Checkpoint formats (what other tools read and write):
- GPTQ: `qweight` int32 [K*bits/32, N] packed along K (row k at bit bits*k of a little-endian stream of 32-bit words;
  for 2/4/8 bits that is word k // (32/bits) at bits*(k % (32/bits)); 3 bits packs 32 rows into 3 words across word
  boundaries), `qzeros` int32 [G, N*bits/32] packed the same way along N, `scales` fp16 [G, N], `g_idx` int32 [K].
  checkpoint_format "gptq" (v1) stores zero - 1, "gptq_v2" stores zero.
- AWQ GEMM (4 bits only): `qweight` int32 [K, N/8], nibble j of word c holds column 8c + [0,2,4,6,1,3,5,7][j];
  `qzeros` int32 [G, N/8] with the same interleave (no offset); `scales` fp16 [G, N]; no g_idx (groups contiguous).

Kernel layout: rows sorted by group so that row k is in group k // group_size, 4-bit `qweight` in the K-tiled,
tile-major order of `kernels.w4a16_layout` (other widths packed GPTQ-style along K: no kernel reads those; they
dequantize), float `scales` / `zeros` [G, N] in the activation dtype, and `perm` [K] (or None) such that
y = x[:, perm] @ W_sorted.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

GPTQ_BITS = (2, 3, 4, 8)
GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ word holds column 8c + AWQ_ORDER[j]
AWQ_INVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8c + i sits in nibble AWQ_INVERSE_ORDER[i]


class IntWeight(NamedTuple):
    """Integer codes and their groups' scales and zero points (see the module docstring)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor


class KernelTensors(NamedTuple):
    """What `W4A16Linear` holds: see the W4A16 kernel contract."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: torch.Tensor | None


# ---------------------------------------------------------------------------------------------------------------------
# helpers


def check_bits(bits: int, allowed=GPTQ_BITS) -> None:
    if bits not in allowed:
        raise ValueError(f"bits={bits} is not supported here; choose one of {tuple(allowed)}")


def resolve_group_size(group_size: int, in_features: int) -> int:
    """The effective group size: -1 (or anything >= in_features) means one group over all input rows."""
    if group_size == -1 or group_size >= in_features:
        return in_features
    if group_size <= 0:
        raise ValueError(f"group_size must be positive or -1, got {group_size}")
    return group_size


def num_groups(in_features: int, group_size: int) -> int:
    return math.ceil(in_features / resolve_group_size(group_size, in_features))


def pack_unit(bits: int) -> int:
    """How many values a run of whole 32-bit words holds: 32/bits, or 32 (in 3 words) for 3 bits."""
    check_bits(bits)
    return 32 // bits if 32 % bits == 0 else 32


def packed_len(length: int, bits: int, what: str = "dimension") -> int:
    """Number of int32 words that `length` values of `bits` bits need; raises if they do not fill whole words."""
    unit = pack_unit(bits)
    if length % unit != 0:
        raise ValueError(
            f"{what} of size {length} cannot be packed at {bits} bits: it must be a multiple of {unit} "
            f"({unit} values fill {unit * bits // 32} int32 word(s))"
        )
    return length * bits // 32


def trivial_g_idx(in_features: int, group_size: int, device=None) -> torch.Tensor:
    gs = resolve_group_size(group_size, in_features)
    return (torch.arange(in_features, device=device) // gs).to(torch.int32)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words holding unsigned 32-bit patterns -> int32 with the same bits (two's complement)."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _as_uint(words: torch.Tensor) -> torch.Tensor:
    """int32 words -> int64 holding their unsigned bit pattern."""
    return words.to(torch.int64) & 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------------------------------
# bit packing along dim 0 (GPTQ stream order)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer `values [L, M]` (each in [0, 2**bits)) along dim 0 into int32 `[L*bits/32, M]`."""
    length, cols = values.shape
    rows = packed_len(length, bits, "packed dimension")
    v = values.to(torch.int64).contiguous() & (2**bits - 1)
    if 32 % bits == 0:
        per = 32 // bits
        shifts = (torch.arange(per, device=v.device, dtype=torch.int64) * bits).view(1, per, 1)
        words = (v.view(rows, per, cols) << shifts).sum(dim=1)  # disjoint bit fields: sum == or
        return _as_int32(words)
    # 3 bits: 32 values fill exactly 3 words; value j sits at stream bit 3*j, possibly straddling two words
    v = v.view(length // 32, 32, cols)
    words = torch.zeros(length // 32, 3, cols, dtype=torch.int64, device=v.device)
    for j in range(32):
        start = bits * j
        word, offset = divmod(start, 32)
        words[:, word] |= (v[:, j] << offset) & 0xFFFFFFFF
        if offset + bits > 32:
            words[:, word + 1] |= v[:, j] >> (32 - offset)
    return _as_int32(words.reshape(rows, cols))


def unpack_rows(words: torch.Tensor, bits: int, length: int | None = None) -> torch.Tensor:
    """Inverse of `pack_rows`: int32 `[R, M]` -> int32 values `[R*32/bits, M]` (cut to `length` if given)."""
    check_bits(bits)
    rows, cols = words.shape
    w = _as_uint(words).contiguous()
    mask = 2**bits - 1
    if 32 % bits == 0:
        per = 32 // bits
        shifts = (torch.arange(per, device=w.device, dtype=torch.int64) * bits).view(1, per, 1)
        values = ((w.view(rows, 1, cols) >> shifts) & mask).reshape(rows * per, cols)
    else:
        if rows % 3 != 0:
            raise ValueError(f"a 3-bit packed tensor needs a multiple of 3 words along dim 0, got {rows}")
        w = w.view(rows // 3, 3, cols)
        out = torch.empty(rows // 3, 32, cols, dtype=torch.int64, device=w.device)
        for j in range(32):
            word, offset = divmod(bits * j, 32)
            value = w[:, word] >> offset
            if offset + bits > 32:
                value = value | (w[:, word + 1] << (32 - offset))
            out[:, j] = value & mask
        values = out.reshape(rows // 3 * 32, cols)
    if length is not None:
        values = values[:length]
    return values.to(torch.int32)


def pack_cols(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack `values [M, L]` along dim 1 (GPTQ qzeros order) into int32 `[M, L*bits/32]`."""
    return pack_rows(values.t(), bits).t().contiguous()


def unpack_cols(words: torch.Tensor, bits: int, length: int | None = None) -> torch.Tensor:
    return unpack_rows(words.t(), bits, length).t().contiguous()


# ---------------------------------------------------------------------------------------------------------------------
# GPTQ


def _check_format(checkpoint_format: str) -> None:
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(f"unknown GPTQ checkpoint_format {checkpoint_format!r}; expected one of {GPTQ_FORMATS}")


def gptq_shapes(in_features: int, out_features: int, bits: int, group_size: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the GPTQ tensors of one linear (raises a clear error when the sizes cannot be packed)."""
    groups = num_groups(in_features, group_size)
    return {
        "qweight": (packed_len(in_features, bits, "in_features"), out_features),
        "qzeros": (groups, packed_len(out_features, bits, "out_features")),
        "scales": (groups, out_features),
        "g_idx": (in_features,),
    }


def gptq_pack(weight: IntWeight, bits: int, checkpoint_format: str = "gptq",
              scale_dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """`IntWeight` -> GPTQ tensors {qweight, qzeros, scales, g_idx}."""
    _check_format(checkpoint_format)
    check_bits(bits)
    return {
        "qweight": pack_rows(weight.codes, bits),
        "qzeros": pack_gptq_zeros(weight.zeros, bits, checkpoint_format),
        "scales": weight.scales.to(scale_dtype).contiguous(),
        "g_idx": weight.g_idx.to(torch.int32).contiguous(),
    }


def pack_gptq_zeros(zeros: torch.Tensor, bits: int, checkpoint_format: str) -> torch.Tensor:
    """Integer zero points [G, N] -> GPTQ `qzeros` (v1 stores zero - 1)."""
    zeros = zeros.to(torch.int64)
    if checkpoint_format == "gptq":
        if (zeros < 1).any():
            raise ValueError(
                "GPTQ v1 (checkpoint_format='gptq') stores zero - 1 and cannot represent a zero point of 0; "
                "save with checkpoint_format='gptq_v2'"
            )
        zeros = zeros - 1
    if (zeros >= 2**bits).any() or (zeros < 0).any():
        raise ValueError(f"zero points out of range for {bits}-bit {checkpoint_format} storage")
    return pack_cols(zeros, bits)


def gptq_unpack(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                bits: int, group_size: int, checkpoint_format: str = "gptq",
                in_features: int | None = None) -> IntWeight:
    """GPTQ tensors -> `IntWeight` (codes, float scales, integer zeros, g_idx)."""
    _check_format(checkpoint_format)
    check_bits(bits)
    if in_features is None:
        in_features = qweight.shape[0] * 32 // bits
    out_features = qweight.shape[1]
    codes = unpack_rows(qweight, bits, in_features)
    zeros = unpack_cols(qzeros, bits, out_features)
    if checkpoint_format == "gptq":
        zeros = zeros + 1  # v1 stores zero - 1 (as every v1 kernel reads it: 15 + 1 = 16 stays 16)
    if g_idx is None:
        g_idx = trivial_g_idx(in_features, group_size, qweight.device)
    return IntWeight(codes, scales, zeros.to(torch.int32), g_idx.to(torch.int32))


# ---------------------------------------------------------------------------------------------------------------------
# AWQ (GEMM version)


def awq_shapes(in_features: int, out_features: int, group_size: int, bits: int = 4) -> dict[str, tuple[int, ...]]:
    check_bits(bits, (4,))
    groups = num_groups(in_features, group_size)
    words = packed_len(out_features, 4, "out_features")
    return {"qweight": (in_features, words), "qzeros": (groups, words), "scales": (groups, out_features)}


def awq_pack_cols(values: torch.Tensor) -> torch.Tensor:
    """4-bit values [R, N] -> int32 [R, N/8] in AWQ's interleaved nibble order."""
    rows, cols = values.shape
    words = packed_len(cols, 4, "out_features")
    v = values.to(torch.int64).contiguous().view(rows, words, 8)[:, :, list(AWQ_ORDER)]
    shifts = (torch.arange(8, device=v.device, dtype=torch.int64) * 4).view(1, 1, 8)
    return _as_int32((v << shifts).sum(dim=2))


def awq_unpack_cols(words: torch.Tensor) -> torch.Tensor:
    rows, cols = words.shape
    shifts = (torch.arange(8, device=words.device, dtype=torch.int64) * 4).view(1, 1, 8)
    nibbles = (_as_uint(words).contiguous().view(rows, cols, 1) >> shifts) & 0xF  # [rows, words, nibble]
    return nibbles[:, :, list(AWQ_INVERSE_ORDER)].reshape(rows, cols * 8).to(torch.int32)


def awq_pack(weight: IntWeight, bits: int = 4, scale_dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """`IntWeight` -> AWQ GEMM tensors {qweight, qzeros, scales}. AWQ has no g_idx: groups must be contiguous."""
    check_bits(bits, (4,))
    in_features, out_features = weight.codes.shape
    groups = weight.scales.shape[0]
    group_size = math.ceil(in_features / groups)
    if not torch.equal(weight.g_idx.to(torch.int64).cpu(), trivial_g_idx(in_features, group_size).to(torch.int64)):
        raise ValueError("AWQ stores contiguous groups only; this weight has an act-order g_idx (save it as GPTQ)")
    if (weight.zeros < 0).any() or (weight.zeros > 15).any():
        raise ValueError("AWQ zero points must lie in [0, 15]")
    return {
        "qweight": awq_pack_cols(weight.codes),
        "qzeros": awq_pack_cols(weight.zeros),
        "scales": weight.scales.to(scale_dtype).contiguous(),
    }


def awq_unpack(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
               bits: int = 4) -> IntWeight:
    """AWQ GEMM tensors -> `IntWeight`."""
    check_bits(bits, (4,))
    in_features = qweight.shape[0]
    codes = awq_unpack_cols(qweight)
    zeros = awq_unpack_cols(qzeros)
    return IntWeight(codes, scales, zeros, trivial_g_idx(in_features, group_size, qweight.device))


# ---------------------------------------------------------------------------------------------------------------------
# float reference and the kernel layout


def dequantize(weight: IntWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [K, N] (input rows first, as y = x @ W)."""
    g = weight.g_idx.long()
    w = weight.scales.float()[g] * (weight.codes.float() - weight.zeros.float()[g])
    return w.to(dtype)


def act_order_perm(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """Row order that makes groups contiguous (row k' in group k' // group_size), or None if it already is."""
    in_features = g_idx.shape[0]
    expected = trivial_g_idx(in_features, group_size, g_idx.device)
    g = g_idx.to(torch.int32)
    if torch.equal(g, expected):
        return None
    perm = torch.argsort(g.to(torch.int64), stable=True)
    if not torch.equal(g[perm], expected):
        raise ValueError(
            f"g_idx does not assign exactly group_size={resolve_group_size(group_size, in_features)} rows to each "
            "group; this act-order layout is not supported (check the checkpoint's group_size)"
        )
    return perm


def pack_kernel_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [K, N] (group-sorted row order) -> the module's qweight: 4-bit codes in the kernels' K-tiled layout
    (`hf_fastpath.kernels.w4a16_layout.w4a16_pack`), other widths packed GPTQ-style (no kernel reads those)."""
    if bits == 4:
        from ..kernels.w4a16_layout import w4a16_pack

        return w4a16_pack(codes)
    return pack_rows(codes, bits)


def unpack_kernel_rows(qweight: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Inverse of `pack_kernel_rows`."""
    if bits == 4:
        from ..kernels.w4a16_layout import w4a16_unpack

        return w4a16_unpack(qweight)
    return unpack_rows(qweight, bits, in_features)


def to_kernel_layout(weight: IntWeight, bits: int, group_size: int, dtype: torch.dtype) -> KernelTensors:
    """`IntWeight` -> the module's buffers: rows sorted by group, packed along K, float scales/zeros in `dtype`."""
    perm = act_order_perm(weight.g_idx, group_size)
    codes = weight.codes if perm is None else weight.codes[perm]
    return KernelTensors(
        qweight=pack_kernel_rows(codes, bits),
        scales=weight.scales.to(dtype).contiguous(),
        zeros=weight.zeros.to(dtype).contiguous(),
        perm=perm,
    )


def from_kernel_layout(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, perm: torch.Tensor | None,
                       bits: int, group_size: int, in_features: int) -> IntWeight:
    """Inverse of `to_kernel_layout` (zero points are rounded back to integers)."""
    codes_sorted = unpack_kernel_rows(qweight, bits, in_features)
    g_sorted = trivial_g_idx(in_features, group_size, qweight.device)
    if perm is None:
        codes, g_idx = codes_sorted, g_sorted
    else:
        codes = torch.empty_like(codes_sorted)
        codes[perm] = codes_sorted
        g_idx = torch.empty_like(g_sorted)
        g_idx[perm] = g_sorted
    return IntWeight(codes, scales, torch.round(zeros.float()).to(torch.int32), g_idx)


# ---------------------------------------------------------------------------------------------------------------------
# direct GPTQ <-> kernel layout (no float round trip: the integer codes move, the zeros are unpacked once)


def gptq_to_kernel_layout(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                          g_idx: torch.Tensor | None, bits: int, group_size: int, checkpoint_format: str,
                          dtype: torch.dtype, in_features: int) -> KernelTensors:
    """GPTQ tensors -> kernel layout; only the codes' order within K tiles changes unless act-order rows move."""
    _check_format(checkpoint_format)
    perm = None if g_idx is None else act_order_perm(g_idx, group_size)
    if perm is not None:
        weight = gptq_unpack(qweight, qzeros, scales, g_idx, bits, group_size, checkpoint_format, in_features)
        return to_kernel_layout(weight, bits, group_size, dtype)
    zeros = unpack_cols(qzeros, bits, qweight.shape[1])
    if checkpoint_format == "gptq":
        zeros = zeros + 1
    kernel_qweight = pack_kernel_rows(unpack_rows(qweight, bits, in_features), bits)
    return KernelTensors(kernel_qweight, scales.to(dtype).contiguous(), zeros.to(dtype).contiguous(), None)


def kernel_to_gptq(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, perm: torch.Tensor | None,
                   bits: int, group_size: int, in_features: int, checkpoint_format: str,
                   scale_dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """Kernel layout -> GPTQ tensors (the inverse of `gptq_to_kernel_layout`)."""
    if perm is not None:
        weight = from_kernel_layout(qweight, scales, zeros, perm, bits, group_size, in_features)
        return gptq_pack(weight, bits, checkpoint_format, scale_dtype)
    _check_format(checkpoint_format)
    return {
        "qweight": pack_rows(unpack_kernel_rows(qweight, bits, in_features), bits),
        "qzeros": pack_gptq_zeros(torch.round(zeros.float()), bits, checkpoint_format),
        "scales": scales.to(scale_dtype).contiguous(),
        "g_idx": trivial_g_idx(in_features, group_size, qweight.device),
    }
