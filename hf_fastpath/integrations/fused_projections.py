"""One W4A16 launch for the projections that share an input: attention q/k/v and MLP gate/up.

Decoding one token, Llama-3-8B's q/k/v are three short kernel calls (the k/v ones too small to fill an H200) and its
gate/up two. One launch over the concatenated columns: q/k/v 11.5 µs instead of 23.6, gate/up 25.3 instead of 32.8
(H200, CUDA graphs, batch 1; 1.03-2.14x on Llama-3 8B/70B groups up to 16 rows,
benchmarks/results/w4a16_fused_projections.json). One eager 8B decoder layer at one token: 931-951 µs against
1018-1033 unfused (1.07-1.10x; the hook costs less host time than the two launches it saves). Compiled static-cache
generate() of a 32-layer 8B-shaped model: 176 tokens/s against 150 unfused (1.18x; 1.67x bf16) in one run. So the
quantizer fuses every GPTQ/AWQ/W4A16 model it loads or quantizes (HF_FASTPATH_FUSE_PROJECTIONS=0: not); call
`fuse_projections(model)` yourself for layers quantized otherwise (`quantize_model`).

`fuse_projections(model)` re-stores each group's layers back to back in memory (`quantization.linear.fuse_siblings`:
the layers keep their own buffers, as views, so state_dict, saving and PEFT see nothing new) and registers a
forward pre-hook on the parent module: it computes the group in one launch (`ConcatForward`) and hands each layer
its output for that very input tensor; a layer called with any other tensor computes as usual, so a forward that
transforms its input first stays correct. Moving the model (`model.to(...)` copies tensor by tensor) breaks the
back-to-back storage; the next decoding call re-stores the group once. The parent's own forward code is
untouched: nothing here depends on how a Transformers version writes it. A hook (not a replaced forward) keeps deepcopy and torch.compile (fullgraph)
working.

Groups apply to inference with at most `CONCAT_MAX_M` rows on the Triton kernels; anything else (training,
prefill, a layer wrapped by PEFT since) runs each layer on its own.
"""

from __future__ import annotations

import inspect
import logging

from torch import nn

from ..quantization.linear import ConcatForward, W4A16Linear, fuse_siblings
from .models import facts_for

logger = logging.getLogger(__name__)

# (the groups per model type: `models.MODELS[...].shared_input_projections`; GPT-2, GPT-NeoX, GPT-BigCode and Falcon
# store q/k/v as one layer already and have no gate/up pair)

_GROUP_ATTR = "_hf_fastpath_shared_input"  # on a parent: its _SharedInputGroup


class _SharedInputGroup:
    def __init__(self, input_name: str, names: tuple[str, ...]):
        self.input_name = input_name  # the parent forward's first argument
        self.names = names  # the layers that read it
        self.compute = ConcatForward()


def _provide_outputs(module: nn.Module, args, kwargs):
    """Forward pre-hook of a parent: its layers' outputs for its input, from one launch. Outputs nobody consumed
    (a layer that was not called) are dropped at the next call."""
    group = getattr(module, _GROUP_ATTR)
    x = args[0] if args else kwargs.get(group.input_name)
    layers = [module._modules.get(n) for n in group.names]
    outs = None
    if x is not None and all(type(m) is W4A16Linear for m in layers):  # (PEFT may have wrapped one since)
        outs = group.compute(layers, x)
    for i, m in enumerate(layers):
        if type(m) is W4A16Linear:
            m._handoff[0] = None if outs is None else (x, outs[i])
    return None


def fuse_projections(model: nn.Module) -> int:
    """Let each group of W4A16 layers that share an input (`shared_input_projections` of the model's row in
    `models.MODELS`) decode as one kernel launch. Returns the number of groups; 0 for other model types. Idempotent.
    The quantizer calls it for every model it loads or quantizes."""
    groups = facts_for(model).shared_input_projections
    fused = 0
    for name, module in model.named_modules():
        for parent_attr, names in groups:
            if name.rsplit(".", 1)[-1] != parent_attr:
                continue
            layers = [module._modules.get(n) for n in names]
            if not fuse_siblings(layers):
                continue
            fused += 1
            if hasattr(module, _GROUP_ATTR):
                continue  # hook already there
            input_name = next(iter(inspect.signature(module.forward).parameters))
            setattr(module, _GROUP_ATTR, _SharedInputGroup(input_name, names))
            module.register_forward_pre_hook(_provide_outputs, with_kwargs=True)
    if fused:
        logger.info("hf_fastpath: %d groups of W4A16 projections decode as one launch each", fused)
    return fused
