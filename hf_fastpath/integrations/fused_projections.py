"""`fuse_projections(model)`: the model's q/k/v and gate/up W4A16 layers decode as one launch per group
(`quantization.fusion`; the groups per model type are `shared_input_projections` in `integrations.models`).

Measured on the H200 (`benchmarks/results/w4a16_fused_projections.json`): one launch instead of three or two wins up
to 16 rows, and one eager decoder layer costs less host time with the hook than the launches it saves, so the
quantizer fuses every GPTQ/AWQ/W4A16 model it loads or quantizes (HF_FASTPATH_FUSE_PROJECTIONS=0: not); call it
yourself for layers quantized otherwise (`quantize_model`).
"""

from __future__ import annotations

from torch import nn

from ..quantization.fusion import fuse_groups
from .models import facts_for

__all__ = ["fuse_projections"]


def fuse_projections(model: nn.Module) -> int:
    """Let each group of W4A16 layers that share an input (`shared_input_projections` of the model's row in
    `models.MODELS`) decode as one kernel launch. Returns the number of groups; 0 for other model types. Idempotent."""
    return fuse_groups(model, facts_for(model).shared_input_projections)
