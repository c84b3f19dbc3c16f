"""Context parallelism for Transformers models: the `fastpath_ring` attention, and process groups under Accelerate.

Usage (any launcher that initialises torch.distributed: `accelerate launch`, torchrun), see
`examples/long_context_finetune.py`:

    accelerator = Accelerator()                      # DDP or FSDP2 over ALL ranks, as usual
    groups = build_context_parallel_groups(cp_size)  # CP groups of consecutive ranks; DP over the rest
    model, optimizer = accelerator.prepare(model, optimizer)
    # every rank of a CP group must load the SAME samples: shard the data over groups.dp_rank / groups.dp_size
    with context_parallel(model, groups.cp_group):
        for batch in loader:
            shard = shard_causal_lm_batch(batch, groups.cp_group)   # zigzag shard; labels shifted first
            labels = shard.pop("shift_labels")
            logits = model(**shard).logits
            loss = context_parallel_loss(logits, labels, groups.cp_group)  # right under DDP/FSDP averaging
            accelerator.backward(loss)

`context_parallel(model, group)` switches the model to the `fastpath_ring` attention (registered with
`transformers.AttentionInterface` and `AttentionMaskInterface`) and tells its attention modules which group to
ring over; on exit the previous attention is restored. The mask function returns None (the ring applies causality
itself) and refuses padded batches: pack sequences instead. `position_ids` must be the GLOBAL positions of the local
tokens (`shard_causal_lm_batch` provides them), so rotary embeddings are right. Packed batches pass the GLOBAL
`cu_seq_lens_q/k` to the model; the ring splits every document zigzag-wise.

Supported: models whose attention goes through `ALL_ATTENTION_FUNCTIONS` (tested: Llama, GPT-2, GPT-NeoX, GPT-J,
GPT-BigCode), training and full-sequence forward, DDP and FSDP2 (tested on CPU with gloo). Not supported: Falcon (own attention classes), KV-cache
decoding, sliding windows, attention sinks, ALiBi, attention dropout.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..parallel.ring_attention import ring_attention
from .models import MODELS, facts_for

__all__ = [
    "ATTENTION_NAME",
    "ring_attention_forward",
    "ring_attention_mask",
    "register",
    "context_parallel",
    "enable_context_parallel",
    "disable_context_parallel",
    "ContextParallelGroups",
    "build_context_parallel_groups",
]

logger = logging.getLogger(__name__)

ATTENTION_NAME = "fastpath_ring"
_GROUP_ATTR = "_hf_fastpath_cp_group"
_SAVED_ATTR = "_hf_fastpath_cp_saved"


def ring_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Transformers attention function: query `[B, Hq, S_local, D]`, key/value `[B, Hkv, S_local, D]` -> out
    `[B, S_local, Hq, D]`, None. The group comes from `context_parallel(model, group)`."""
    if not hasattr(module, _GROUP_ATTR):
        raise RuntimeError(
            f"attn_implementation={ATTENTION_NAME!r} needs a context-parallel group: run the model inside "
            "`with hf_fastpath.parallel.context_parallel(model, group):`."
        )
    group = getattr(module, _GROUP_ATTR)
    if dropout and dropout > 0:
        raise NotImplementedError("Ring attention has no attention dropout; set the model's attention_dropout to 0.")
    for name in ("sliding_window", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"Ring attention does not support `{name}` (model {type(module).__name__}).")
    if attention_mask is not None:
        raise ValueError("Ring attention got an attention mask; it handles causality itself and does not support "
                         "padding. Pack the sequences instead.")
    if query.shape[2] != key.shape[2]:
        raise NotImplementedError(
            f"Ring attention needs as many keys as queries (got {query.shape[2]} queries, {key.shape[2]} keys): "
            "KV-cache decoding is not supported with context parallelism; use use_cache=False."
        )
    cu = kwargs.get("cu_seq_lens_q")
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu is not None and cu_k is not None and not torch.equal(cu.cpu(), cu_k.cpu()):
        raise ValueError("Ring attention needs cu_seq_lens_q == cu_seq_lens_k (self-attention over a packed batch).")
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    out = ring_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        causal=bool(causal),
        group=group,
        cu_seqlens=cu,
        softmax_scale=scaling,
        softcap=kwargs.get("softcap") or 0.0,
    )
    return out, None


def ring_attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                        attention_mask=None, **kwargs):
    """Mask function for `fastpath_ring`: None (the ring applies causality); refuses padding."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError(
            "Context parallelism does not support padded batches (attention_mask has zeros). Pack the sequences "
            "(transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)) and shard them with "
            "hf_fastpath.parallel.shard_causal_lm_batch."
        )
    return None


def register() -> None:
    """Register `fastpath_ring` with Transformers (idempotent; class-level, so every model sees it)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, ring_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, ring_attention_mask)


def _unwrap(model):
    """The Transformers model inside DDP / torch.compile wrappers (FSDP2 keeps the module itself)."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "config") and hasattr(model, "set_attn_implementation"):
            return model
        inner = getattr(model, "module", None)
        inner = getattr(model, "_orig_mod", None) if inner is None else inner
        model = model if inner is None else inner
    raise TypeError(f"{type(model).__name__} is not a Transformers model (no config / set_attn_implementation).")


def _as_group(group):
    if group is not None and hasattr(group, "get_group") and hasattr(group, "mesh"):  # a 1-D DeviceMesh
        return group.get_group()
    return group


def enable_context_parallel(model, group=None):
    """Make `model`'s attention ring over `group` (default: all ranks) until `disable_context_parallel(model)`."""
    register()
    inner = _unwrap(model)
    if not facts_for(inner).ring_attention:
        supported = ", ".join(sorted(t for t, row in MODELS.items() if row.ring_attention))
        raise NotImplementedError(
            f"Context parallelism does not support model type {getattr(inner.config, 'model_type', None)!r} (its "
            f"attention does not go through Transformers' AttentionInterface, or uses a sliding window); supported: "
            f"{supported}.")
    if hasattr(inner, _SAVED_ATTR):
        raise RuntimeError("Context parallelism is already enabled on this model.")
    group = _as_group(group)
    setattr(inner, _SAVED_ATTR, (inner.config._attn_implementation, getattr(inner.config, "use_cache", None)))
    inner.set_attn_implementation(ATTENTION_NAME)
    if getattr(inner.config, "use_cache", None):
        inner.config.use_cache = False  # a KV cache makes no sense for sharded training sequences
    for m in inner.modules():
        object.__setattr__(m, _GROUP_ATTR, group)
    return model


def disable_context_parallel(model):
    """Undo `enable_context_parallel`: restore the previous attention implementation and use_cache."""
    inner = _unwrap(model)
    if not hasattr(inner, _SAVED_ATTR):
        return model
    attn, use_cache = getattr(inner, _SAVED_ATTR)
    object.__delattr__(inner, _SAVED_ATTR)
    for m in inner.modules():
        if _GROUP_ATTR in m.__dict__:
            object.__delattr__(m, _GROUP_ATTR)
    inner.set_attn_implementation(attn)
    if use_cache is not None:
        inner.config.use_cache = use_cache
    return model


@contextlib.contextmanager
def context_parallel(model, group=None):
    """`with context_parallel(model, cp_group):` run the model's attention as zigzag ring attention over
    `cp_group` (a ProcessGroup or a 1-D DeviceMesh; None = all ranks). Inputs must be zigzag shards
    (`shard_causal_lm_batch`)."""
    enable_context_parallel(model, group)
    try:
        yield model
    finally:
        disable_context_parallel(model)


@dataclass
class ContextParallelGroups:
    """Process groups for CP x DP: `cp_group` holds `cp_size` consecutive ranks that share samples; `dp_group`
    holds the ranks with the same position in their CP group (data parallel over the rest)."""

    cp_group: object
    dp_group: object
    cp_size: int
    cp_rank: int
    dp_size: int
    dp_rank: int


def build_context_parallel_groups(cp_size: int, accelerator=None) -> ContextParallelGroups:
    """Create the CP and DP groups from the running distributed state (Accelerate's, when `accelerator` is given,
    or torch.distributed's). Every rank must call this, in the same order as its other `new_group` calls."""
    if accelerator is not None:
        world, rank = accelerator.num_processes, accelerator.process_index
    elif dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    else:
        world, rank = 1, 0
    if cp_size < 1 or world % cp_size:
        raise ValueError(f"cp_size={cp_size} must divide the number of processes ({world}).")
    if world == 1:
        return ContextParallelGroups(None, None, 1, 0, 1, 0)
    dp_size = world // cp_size
    cp_group = dp_group = None
    for i in range(dp_size):  # every rank creates every group
        g = dist.new_group(list(range(i * cp_size, (i + 1) * cp_size)))
        if rank // cp_size == i:
            cp_group = g
    for j in range(cp_size):
        g = dist.new_group(list(range(j, world, cp_size)))
        if rank % cp_size == j:
            dp_group = g
    return ContextParallelGroups(cp_group, dp_group, cp_size, rank % cp_size, dp_size, rank // cp_size)
