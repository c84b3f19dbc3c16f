"""Sharding a Transformers causal-LM batch over a context-parallel group, and the matching loss.

Why labels are shifted BEFORE sharding: a rank holds two non-adjacent chunks of the sequence, so the token that
follows its last local token usually lives on another rank. Shifting first turns `labels` into per-position
"next token" targets (`shift_labels`, last position of every document = -100), which then shard like any other
per-token tensor, and the model must not shift again (use `context_parallel_loss`, not the model's `labels=`).

Loss normalisation under DDP / FSDP2: the context-parallel (CP) ranks hold different tokens of the SAME samples, and
DDP/FSDP average gradients over ALL ranks (CP x DP). `context_parallel_loss` returns
`cp_size * local_loss_sum / tokens_in_cp_group`: its mean over the CP group is the one-process mean loss, so the
all-rank gradient average equals the average over DP replicas of the one-process gradients, exactly what plain DDP
computes without CP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .zigzag import group_size_and_rank, zigzag_shard

__all__ = ["pad_documents_to_multiple", "shard_causal_lm_batch", "causal_lm_loss_sum", "context_parallel_loss"]

IGNORE_INDEX = -100
_CU_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _documents(batch: dict) -> list[int] | None:
    """Global cu_seqlens of a packed batch (batch size 1) as a list, or None for an ordinary batch."""
    if batch.get("cu_seq_lens_q") is not None:
        return [int(c) for c in batch["cu_seq_lens_q"].tolist()]
    pos = batch.get("position_ids")
    if pos is None or pos.shape[-1] < 2:
        return None
    restarts = (pos[..., 1:] == 0).any(-1).reshape(-1)  # a position id restarting at 0 inside a row: packed
    if pos.dim() == 2 and pos.shape[0] > 1 and bool(restarts.any()):
        raise ValueError(
            "position_ids restart inside a row of a batch with several rows: context parallelism takes packed "
            "documents as ONE row (batch size 1), e.g. from DataCollatorWithFlattening."
        )
    if not bool(restarts.any()):
        return None
    starts = (pos.reshape(-1) == 0).nonzero().flatten().tolist()
    if starts[0] != 0:
        starts = [0] + starts
    return starts + [pos.shape[-1]]


def _shift(labels: torch.Tensor, cu: list[int] | None) -> torch.Tensor:
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    if cu is not None:  # no target across a document boundary
        ends = torch.tensor([c - 1 for c in cu[1:] if c > 0], dtype=torch.long, device=labels.device)
        shifted[:, ends] = IGNORE_INDEX
    return shifted


def pad_documents_to_multiple(batch: dict, multiple: int, *, pad_token_id: int = 0) -> dict:
    """Pad every document of a packed batch (or every row of an ordinary batch) at its end to a multiple of
    `multiple` tokens (`2 * cp_size` for zigzag sharding).

    Padding goes AFTER each document's last token, so under a causal mask no real token can see it; padded
    positions get `pad_token_id` in `input_ids`, -100 in `labels`/`shift_labels` and continue the document's
    `position_ids`. Returns a new dict; packed batches get updated `cu_seq_lens_q/k` and `max_length_q/k`.
    """
    ids = batch["input_ids"]
    cu = _documents(batch)
    bounds = cu if cu is not None else [0, ids.shape[1]]
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.cat([torch.arange(b - a, device=ids.device) for a, b in zip(bounds, bounds[1:])])
        pos = pos.unsqueeze(0).expand(ids.shape[0], -1)
    fill = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX}
    out = {k: v for k, v in batch.items() if k not in _CU_KEYS}
    pieces = {k: [] for k in ("position_ids", *[k for k in fill if k in batch])}
    new_cu = [0]
    for a, b in zip(bounds, bounds[1:]):
        n = b - a
        pad = (-n) % multiple
        for key in pieces:
            src = pos if key == "position_ids" else batch[key]
            seg = src[:, a:b]
            if pad:
                if key == "position_ids":
                    last = seg[:, -1:] if n else torch.full_like(src[:, :1], -1)
                    extra = last + torch.arange(1, pad + 1, device=src.device)
                else:
                    extra = torch.full((src.shape[0], pad), fill[key], dtype=src.dtype, device=src.device)
                seg = torch.cat([seg, extra], 1)
            pieces[key].append(seg)
        new_cu.append(new_cu[-1] + n + pad)
    for key, segs in pieces.items():
        out[key] = torch.cat(segs, 1)
    if "attention_mask" in batch and batch["attention_mask"] is not None:
        out["attention_mask"] = torch.ones_like(out["input_ids"])
    if cu is not None:
        cu_t = torch.tensor(new_cu, dtype=torch.int32, device=ids.device)
        longest = max(b - a for a, b in zip(new_cu, new_cu[1:]))
        out.update(cu_seq_lens_q=cu_t, cu_seq_lens_k=cu_t, max_length_q=longest, max_length_k=longest)
    return out


def shard_causal_lm_batch(batch: dict, group=None, *, pad_token_id: int = 0) -> dict:
    """This rank's share of a causal-LM batch for context parallelism over `group`.

    `batch`: `input_ids [B, S]`, optional `labels` (default: `input_ids`), `position_ids`, and for packed batches
    (B = 1, e.g. `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`) `cu_seq_lens_q/k` (or position_ids
    restarting at 0 per document). `attention_mask` must be all ones: padding inside a sequence is not supported
    with context parallelism; pack sequences instead.

    Steps: shift labels (every document's last target = -100), pad every document to a multiple of `2 * cp_size`,
    zigzag-shard `input_ids`, `shift_labels` and `position_ids` (GLOBAL positions, for rotary embeddings).
    Returns `input_ids`, `position_ids`, `shift_labels` and, when packed, the GLOBAL `cu_seq_lens_q/k`,
    `max_length_q/k` (the ring attention needs the global layout). Pop `shift_labels` before calling the model and
    pass it to `context_parallel_loss`.
    """
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError(
            "The batch has padding (attention_mask has zeros). Context parallelism does not support padded batches: "
            "pack the sequences instead (transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)) "
            "or drop the padding."
        )
    world, _ = group_size_and_rank(group)
    cu = _documents(batch)
    if cu is not None and ids.shape[0] != 1:
        raise ValueError(f"A packed batch must have batch size 1, got input_ids {tuple(ids.shape)}.")
    labels = batch.get("labels")
    labels = ids if labels is None else labels
    work = {"input_ids": ids, "shift_labels": _shift(labels, cu)}
    if batch.get("position_ids") is not None:
        work["position_ids"] = batch["position_ids"]
    if cu is not None:
        work["cu_seq_lens_q"] = torch.tensor(cu, dtype=torch.int32, device=ids.device)
    padded = pad_documents_to_multiple(work, 2 * world, pad_token_id=pad_token_id)
    cu_global = padded.get("cu_seq_lens_q")
    out = {}
    for key in ("input_ids", "shift_labels", "position_ids"):
        t = padded[key].expand(ids.shape[0], -1) if key == "position_ids" else padded[key]
        out[key] = zigzag_shard(t, 1, group, cu_seqlens=cu_global)
    if cu_global is not None:
        out.update({k: padded[k] for k in _CU_KEYS})
    return out


def causal_lm_loss_sum(logits: torch.Tensor, shift_labels: torch.Tensor, ignore_index: int = IGNORE_INDEX):
    """(sum of token cross-entropies in fp32, number of counted tokens) for already shifted labels."""
    flat = shift_labels.reshape(-1).to(logits.device)
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()  # cross-entropy of bf16/fp16 logits in fp32
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), flat, ignore_index=ignore_index, reduction="sum")
    return total, (flat != ignore_index).sum()


def context_parallel_loss(logits: torch.Tensor, shift_labels: torch.Tensor, group=None,
                          ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The loss to call `backward()` on for this rank under context parallelism (see the module docstring).

    Equals `cp_size * local_sum / tokens_in_group`: averaging it over the CP group (what DDP/FSDP do to gradients,
    and what you do for logging: `all_reduce(loss.detach(), AVG)`) gives the one-process mean token loss.
    """
    total, count = causal_lm_loss_sum(logits, shift_labels, ignore_index)
    world, _ = group_size_and_rank(group)
    count = count.to(total.dtype)
    if world > 1:
        dist.all_reduce(count, group=group)
    return total * world / count.clamp(min=1)
