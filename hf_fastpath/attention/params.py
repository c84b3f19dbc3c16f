"""The options of one attention call, checked once: `AttentionParams` (semantics: `reference.py`).

`attention()` builds one with `make_params(q, k, v, ...)`; every backend reads its fields (no loose dict), and the
checks that name a bad input and its fix live here, once (`check_qkv` for the tensors' layout). A named tuple:
immutable, and built on every call for a few hundred nanoseconds (a frozen dataclass costs microseconds, which an
eager decoding step pays per layer).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["AttentionParams", "make_params", "check_qkv"]


class AttentionParams(NamedTuple):
    causal: bool = False
    softmax_scale: float = 1.0
    window_size: tuple = (-1, -1)  # (left, right), -1 = unbounded; bottom-right aligned like causal
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None  # [Hq] or [B, Hq]
    cu_seqlens_q: torch.Tensor | None = None  # varlen: [B + 1] offsets into [T, H, D] inputs
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    seqused_k: torch.Tensor | None = None  # [B]: keys in the first seqused_k[b] slots (a static cache)
    key_mask: torch.Tensor | None = None  # [B, Sk]: keys whose entry is > 0 are attended (padding)
    segments: torch.Tensor | None = None  # kernels.flash_attention.segment_table of packed sequences

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def has_window(self) -> bool:
        return self.window_size[0] != -1 or self.window_size[1] != -1

    def masks_keys(self) -> bool:
        """Whether some keys are left out per row (padding, a static cache, packed sequences)."""
        return self.key_mask is not None or self.seqused_k is not None or self.segments is not None

    def kernel_kwargs(self) -> dict:
        """The keyword arguments of the raw halves (`reference` / `triton_backend` `attention_forward` / `_backward`)."""
        return self._asdict()


def check_qkv(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None) -> None:
    """Layout checks every backend shares: tensors, one dtype and device, `[B, S, H, D]` (or `[T, H, D]` with
    cu_seqlens), q/k head dims equal, query heads a multiple of the key/value heads, K and V alike."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}.")
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen and (cu_seqlens_q is None or cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together.")
    want = 3 if varlen else 4
    if q.dim() != want or k.dim() != want or v.dim() != want:
        layout = "[total_tokens, heads, head_dim] with cu_seqlens" if varlen else "[batch, seq, heads, head_dim]"
        raise ValueError(f"Expected {layout} tensors, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}.")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q and k head dims differ ({q.shape[-1]} vs {k.shape[-1]}).")
    hq, hk, hv = q.shape[-2], k.shape[-2], v.shape[-2]
    if hk != hv or hk == 0 or hq % hk != 0:
        raise ValueError(f"Query heads ({hq}) must be a multiple of key/value heads (k {hk}, v {hv}; k and v must "
                         f"match). For GQA/MQA pass K/V with their own head count, unrepeated.")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must agree on all but the head dim: {tuple(k.shape)} vs {tuple(v.shape)}.")
    if not varlen and q.shape[0] != k.shape[0]:
        raise ValueError(f"Batch sizes differ: q {q.shape[0]}, k {k.shape[0]}.")
    if varlen:
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if cu.dim() != 1 or cu.numel() < 1 or cu.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name} must be a 1-D int32 tensor [batch + 1] of offsets, got "
                                 f"{cu.dtype} {tuple(cu.shape)}.")
            if cu.device != q.device:
                raise ValueError(f"{name} is on {cu.device}; it must be on {q.device} with q, k, v.")
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                             f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}.")


def _check_masks(q, k, varlen, seqused_k, key_mask, segments) -> None:
    given = [n for n, t in (("seqused_k", seqused_k), ("key_mask", key_mask), ("segments", segments)) if t is not None]
    if not given:
        return
    if varlen:
        raise ValueError(f"{', '.join(given)}: for dense [B, S, H, D] inputs, not with cu_seqlens.")
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    if seqused_k is not None and tuple(seqused_k.shape) != (b,):
        raise ValueError(f"seqused_k must be [batch] = [{b}], got {tuple(seqused_k.shape)}.")
    if key_mask is not None and (key_mask.dim() != 2 or key_mask.shape[0] != b or key_mask.shape[1] < sk):
        raise ValueError(f"key_mask must be [batch, keys] = [{b}, {sk}], got {tuple(key_mask.shape)}.")
    if key_mask is not None and segments is not None:
        raise ValueError("pass key_mask or segments, not both (a padding token is a segment of its own).")
    if segments is not None and (tuple(segments.shape) != (3, b, sk) or sq != sk):
        raise ValueError(f"segments must be the [3, batch, seq] table of segment_table for as many queries as keys, "
                         f"got {tuple(segments.shape)} for q {tuple(q.shape)}, k {tuple(k.shape)}.")
    for name in given:
        t = {"seqused_k": seqused_k, "key_mask": key_mask, "segments": segments}[name]
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}; it must be on {q.device} with q, k, v.")


def make_params(q, k, v, *, causal=False, softmax_scale=None, cu_seqlens_q=None, cu_seqlens_k=None,
                max_seqlen_q=None, max_seqlen_k=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                seqused_k=None, key_mask=None, segments=None) -> AttentionParams:
    """Check a call's inputs (a clear error naming the problem and the fix) and return its parameters."""
    check_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k)
    window_size = tuple(int(w) for w in window_size)
    if len(window_size) != 2:
        raise ValueError(f"window_size must be (left, right) with -1 for unbounded, got {window_size!r}.")
    varlen = cu_seqlens_q is not None
    if alibi_slopes is not None:
        batch = cu_seqlens_q.numel() - 1 if varlen else q.shape[0]
        if alibi_slopes.shape not in ((q.shape[-2],), (batch, q.shape[-2])):
            raise ValueError(f"alibi_slopes must be [heads] or [batch, heads] = ({q.shape[-2]},) or "
                             f"({batch}, {q.shape[-2]}), got {tuple(alibi_slopes.shape)}.")
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes is on {alibi_slopes.device}; it must be on {q.device}.")
    _check_masks(q, k, varlen, seqused_k, key_mask, segments)
    return AttentionParams(
        causal=bool(causal),
        softmax_scale=float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        window_size=window_size, softcap=float(softcap or 0.0), alibi_slopes=alibi_slopes,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        seqused_k=seqused_k, key_mask=key_mask, segments=segments)
