"""Zigzag sharding of a sequence over a context-parallel group.

The sequence (or, for a packed batch, every document in it) is cut into `2 * world` equal chunks; rank `r` keeps
chunks `r` and `2 * world - 1 - r`, in that order. Under a causal mask the early chunk sees little and the late
chunk sees much, so every rank does the same amount of attention work.

Packed batches (documents back to back, described by `cu_seqlens` of the GLOBAL batch) are split per document, so a
rank's shard holds, for document 0, its two chunks, then the two chunks of document 1, and so on: the local
`cu_seqlens` is the global one divided by `world`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "group_size_and_rank",
    "check_zigzag_lengths",
    "zigzag_indices",
    "zigzag_shard",
    "zigzag_unshard",
]


def group_size_and_rank(group=None) -> tuple[int, int]:
    """(world size, rank) of `group`; (1, 0) when torch.distributed is not initialised and no group is given."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _as_list(cu_seqlens) -> list[int]:
    return [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]


def check_zigzag_lengths(seq_len: int | None, world_size: int, cu_seqlens=None) -> None:
    """Raise a ValueError naming the sequence/document whose length is not a multiple of `2 * world_size`."""
    multiple = 2 * world_size
    if cu_seqlens is None:
        if seq_len % multiple:
            raise ValueError(
                f"Sequence length {seq_len} is not a multiple of {multiple} (2 x context-parallel size {world_size}); "
                f"zigzag sharding needs equal chunks. Pad the sequence to a multiple of {multiple} "
                "(hf_fastpath.parallel.pad_documents_to_multiple pads packed documents)."
            )
        return
    cu = _as_list(cu_seqlens)
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu[:8]}{'...' if len(cu) > 8 else ''}.")
    if seq_len is not None and cu[-1] != seq_len:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but the packed sequence has {seq_len} tokens.")
    for d, (a, b) in enumerate(zip(cu, cu[1:])):
        if (b - a) % multiple:
            raise ValueError(
                f"Document {d} of the packed batch has {b - a} tokens; with context-parallel size {world_size} every "
                f"document's length must be a multiple of {multiple} (2 x {world_size}). Pad each document with "
                f"hf_fastpath.parallel.pad_documents_to_multiple(..., multiple={multiple})."
            )


def zigzag_indices(seq_len: int, world_size: int, rank: int, *, cu_seqlens=None, device=None) -> torch.Tensor:
    """Global token positions held by `rank`, in local order (int64). `seq_len` is the global (packed) length."""
    check_zigzag_lengths(seq_len, world_size, cu_seqlens)
    starts = _as_list(cu_seqlens) if cu_seqlens is not None else [0, seq_len]
    n = 2 * world_size
    parts = []
    for a, b in zip(starts, starts[1:]):
        c = (b - a) // n
        parts.append(torch.arange(a + rank * c, a + (rank + 1) * c))
        parts.append(torch.arange(a + (n - 1 - rank) * c, a + (n - rank) * c))
    idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    return idx.to(device) if device is not None else idx


def zigzag_shard(x: torch.Tensor, dim: int, group=None, *, cu_seqlens=None) -> torch.Tensor:
    """This rank's zigzag shard of the full tensor `x` along `dim` (every rank passes the same `x`)."""
    world, rank = group_size_and_rank(group)
    dim = dim % x.dim()
    idx = zigzag_indices(x.shape[dim], world, rank, cu_seqlens=cu_seqlens, device=x.device)
    return x.index_select(dim, idx)


def zigzag_unshard(x: torch.Tensor, dim: int, group=None, *, cu_seqlens=None) -> torch.Tensor:
    """Inverse of `zigzag_shard`: all-gather the shards of `group` and put every token back at its global position.

    Not differentiable (it is meant for outputs, logging and tests). `cu_seqlens` is the GLOBAL one.
    """
    world, rank = group_size_and_rank(group)
    dim = dim % x.dim()
    if world == 1:
        return x
    x = x.contiguous()
    shards = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(shards, x, group=group)
    gathered = torch.cat(shards, dim)
    seq_len = x.shape[dim] * world
    positions = torch.cat([zigzag_indices(seq_len, world, r, cu_seqlens=cu_seqlens) for r in range(world)])
    return gathered.index_select(dim, torch.argsort(positions).to(x.device))
