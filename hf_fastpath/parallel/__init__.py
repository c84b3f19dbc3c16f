"""Context parallelism: zigzag ring attention and sequence sharding (see ring_attention.py and zigzag.py).

`context_parallel(model, group)` (Transformers wiring) lives in `hf_fastpath.integrations.context_parallel`; it is
reachable here too, loaded on first use so that this package does not import Transformers.
"""

from .batch import (
    causal_lm_loss_sum,
    context_parallel_loss,
    pad_documents_to_multiple,
    shard_causal_lm_batch,
)
from .ring_attention import ring_attention
from .zigzag import check_zigzag_lengths, zigzag_indices, zigzag_shard, zigzag_unshard

__all__ = [
    "ring_attention",
    "zigzag_shard",
    "zigzag_unshard",
    "zigzag_indices",
    "check_zigzag_lengths",
    "pad_documents_to_multiple",
    "shard_causal_lm_batch",
    "causal_lm_loss_sum",
    "context_parallel_loss",
    "context_parallel",
    "ContextParallelGroups",
    "build_context_parallel_groups",
]

_INTEGRATION_NAMES = ("context_parallel", "ContextParallelGroups", "build_context_parallel_groups")


def __getattr__(name):
    if name in _INTEGRATION_NAMES:
        from ..integrations import context_parallel as _cp

        return getattr(_cp, name)
    raise AttributeError(f"module 'hf_fastpath.parallel' has no attribute {name!r}")
