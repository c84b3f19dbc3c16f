"""One W4A16 launch for layers that share their input (attention q/k/v, MLP gate/up).

Decoding one token, a model's q/k/v are three short kernel calls (k and v too small to fill a GPU) and its gate/up
two; one launch over the concatenated columns reads the same weights with fewer, larger programs. That launch needs
the layers' tensors back to back in memory: `fuse_siblings` re-stores them so (each layer keeps its own buffers, now
views into one allocation per tensor kind, so state_dict, saving and PEFT see nothing new), `ConcatForward`
computes them, and `fuse_groups(model, groups)` registers a forward pre-hook on each parent module that computes its
group in one launch and hands each layer its output for that very input tensor (a layer called with any other
tensor computes as usual, so a forward that transforms its input first stays correct; a hook, not a replaced
forward, keeps deepcopy and torch.compile fullgraph working). Moving the model (`model.to(...)` copies tensor by
tensor) breaks the back-to-back storage; the next decoding call re-stores the group once.

Groups apply to inference with at most `CONCAT_MAX_M` rows on the Triton kernels; anything else (training, prefill,
a layer wrapped by PEFT since) runs each layer on its own. Which layers form groups is a per-model fact
(`integrations.models`, used by `integrations.fused_projections.fuse_projections`).
"""

from __future__ import annotations

import inspect
import logging
import weakref

import torch
from torch import nn

from ..kernels import w4a16_ops
from ..kernels.common import warn_once
from .linear import W4A16Linear, _kernels

logger = logging.getLogger(__name__)

__all__ = ["fuse_siblings", "ConcatForward", "fuse_groups", "stack_experts"]

_GROUP_ATTR = "_hf_fastpath_shared_input"  # on a parent: its _SharedInputGroup


def _warn_once(key: str, message: str) -> None:
    warn_once(__name__, "w4a16:" + key, message)


def fuse_siblings(layers) -> bool:
    """Re-store 2-3 loaded 4-bit `W4A16Linear` layers with the same input back to back in memory. Returns False and
    changes nothing where one launch cannot serve them (other bits or sizes, act-order, meta tensors, widths that
    are not multiples of the kernels' column blocks)."""
    kernels = _kernels()
    first = layers[0] if layers else None
    if kernels is None or not 2 <= len(layers) <= 3 or not all(isinstance(m, W4A16Linear) for m in layers):
        return False
    for m in layers:
        if (m._staging is not None or m.bits != 4 or m.perm is not None or m.qweight.is_meta
                or m.in_features != first.in_features or m._effective_group_size != first._effective_group_size
                or m.scales.dtype != first.scales.dtype or m.qweight.device != first.qweight.device
                or m.in_features % m._effective_group_size != 0
                or m.out_features % kernels.w4a16_segment_columns() != 0):
            return False
    if kernels.w4a16_back_to_back([(m.qweight, m.scales, m.zeros) for m in layers]):
        return True
    for name in ("qweight", "scales", "zeros"):
        _store_back_to_back(layers, name)
    if not kernels.w4a16_back_to_back([(m.qweight, m.scales, m.zeros) for m in layers]):
        raise RuntimeError("fuse_siblings: the re-stored layers are not back to back (a bug)")
    return True


def _store_back_to_back(layers, name: str) -> None:
    """Re-store tensor `name` of each layer (a buffer, or the bias parameter) as consecutive views of one
    allocation, in the layers' order, unless they already lie so."""
    table = "_parameters" if name == "bias" else "_buffers"
    tensors = [getattr(m, table)[name] for m in layers]
    offset, in_place = tensors[0].data_ptr(), True
    for t in tensors:
        in_place = in_place and t.is_contiguous() and t.data_ptr() == offset
        offset += t.numel() * t.element_size()
    if in_place:
        return
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    start = 0
    for m, t in zip(layers, tensors):
        view = flat[start:start + t.numel()].view(t.shape)
        getattr(m, table)[name] = nn.Parameter(view, t.requires_grad) if table == "_parameters" else view
        start += t.numel()


def stack_experts(roles) -> list[dict[str, torch.Tensor]] | None:
    """Projections of every expert of a mixture of experts as stacks for `w4a16_experts_matmul_rows`: `roles` is a
    list of projections (e.g. [gate layers, up layers]), each the E loaded 4-bit `W4A16Linear` layers of one shape.
    Returns per projection {"qweight": [E, K / 8, N], "scales" / "zeros": [E, G, N], "bias": [E, N] or None,
    "perm": [E, K] or None}: views of one allocation per tensor kind, expert by expert and within an expert
    projection by projection (so gate and up of one expert lie back to back, as one segmented launch reads them);
    "perm" (act-order: each expert's input permutation) a stacked copy. Layers not stored so yet are re-stored first
    (each keeps its own tensors, now views: state_dict, saving and PEFT see nothing new). None where one launch
    cannot serve them (other bits or shapes, act-order in some layers of a projection only, meta tensors, dtypes or
    devices that differ)."""
    layers = [m for role in roles for m in role]
    first = layers[0] if layers else None
    if _kernels() is None or not layers or not all(type(m) is W4A16Linear for m in layers) or \
            len({len(role) for role in roles}) != 1:
        return None
    has_bias = first._parameters["bias"] is not None  # all or none: the stacks share one bias allocation
    for role in roles:
        lead = role[0]
        for m in role:
            if (m._staging is not None or m.bits != 4 or (m.perm is None) != (lead.perm is None) or m.qweight.is_meta
                    or (m.in_features, m.out_features) != (lead.in_features, lead.out_features)
                    or m._effective_group_size != first._effective_group_size or m.in_features != first.in_features
                    or (m._parameters["bias"] is not None) != has_bias
                    or any(m._buffers[t].dtype != first._buffers[t].dtype or m._buffers[t].device !=
                           first._buffers[t].device for t in ("qweight", "scales", "zeros"))):
                return None
    experts = len(roles[0])
    order = [role[e] for e in range(experts) for role in roles]  # storage order: expert-major
    stacks = [{} for _ in roles]
    for name in ("qweight", "scales", "zeros", "bias"):
        if name == "bias" and not has_bias:
            for stack in stacks:
                stack[name] = None
            continue
        _store_back_to_back(order, name)
        table = "_parameters" if name == "bias" else "_buffers"
        per_expert = sum(getattr(role[0], table)[name].numel() for role in roles)
        for stack, role in zip(stacks, roles):
            t0 = getattr(role[0], table)[name].detach()
            stack[name] = t0.as_strided((experts, *t0.shape), (per_expert, *t0.stride()), t0.storage_offset())
    for stack, role in zip(stacks, roles):
        stack["perm"] = None if role[0].perm is None else torch.stack([m.perm for m in role])
    return stacks


class ConcatForward:
    """Computes 2-3 sibling layers (`fuse_siblings`) for one input in one kernel launch: `group(layers, x)` returns
    their outputs (views into one [..., sum N] tensor), or None where that does not apply (each layer then runs
    on its own): more than CONCAT_MAX_M rows, autograd, no kernel route, scales of another dtype, or layers that
    can no longer be stored back to back (after `model.to(...)` re-allocated their buffers one by one, the first
    call stores them back to back again). Eager decoding calls it once per group and token, so it remembers (by
    weak reference) the buffers it last found back to back instead of re-checking their addresses every call."""

    def __init__(self):
        self._checked: tuple = ()  # weak references to the 3 buffers of each layer, last found back to back

    def __call__(self, layers, x: torch.Tensor):
        kernels = _kernels()
        first = layers[0]
        if x.requires_grad and torch.is_grad_enabled():
            return None
        x2 = x.reshape(-1, x.shape[-1])
        if not 0 < x2.shape[0] <= kernels.CONCAT_MAX_M or x2.shape[1] != first.in_features \
                or not first._use_kernel(x2):
            return None
        parts = [(m._buffers["qweight"], m._buffers["scales"], m._buffers["zeros"]) for m in layers]
        # (an input not yet on the weights' device, e.g. before a device-map hook inside a layer moves it: the layers
        # take it one by one)
        if parts[0][1].dtype != x2.dtype or parts[0][0].device != x2.device:
            return None
        if torch.compiler.is_compiling():
            y = w4a16_ops.w4a16_concat_op(x2.contiguous(), *map(list, zip(*parts)), first._effective_group_size)
        else:
            parts = self._back_to_back(layers, parts)
            if parts is None:
                return None
            y = kernels.w4a16_matmul_concat_rows(x2.contiguous(), parts, first._effective_group_size)
        outs = y.view(*x.shape[:-1], y.shape[1]).split([m.out_features for m in layers], dim=-1)
        return [out if m._parameters["bias"] is None else out + m._parameters["bias"].to(out.dtype)
                for m, out in zip(layers, outs)]

    def _back_to_back(self, layers, parts):
        """parts, or the parts re-stored back to back (after `model.to(...)`), or None where that is refused."""
        flat = [t for part in parts for t in part]
        if len(flat) == len(self._checked) and all(ref() is t for ref, t in zip(self._checked, flat)):
            return parts
        if not _kernels().w4a16_back_to_back(parts):
            # model.to(...) re-allocated the tensors one by one: store them back to back again (a one-time copy
            # of this group; normal tensors even inside inference_mode, as when the model was loaded).
            with torch.inference_mode(False):
                refused = not fuse_siblings(layers)
            if refused:
                _warn_once("siblings-refused", "W4A16 layers fused for one launch can no longer be stored back to "
                           "back (different devices or formats since): each runs on its own")
                self._checked = ()
                return None
            logger.debug("W4A16 layers re-stored back to back after their tensors moved")
            parts = [(m._buffers["qweight"], m._buffers["scales"], m._buffers["zeros"]) for m in layers]
            flat = [t for part in parts for t in part]
        self._checked = tuple(weakref.ref(t) for t in flat)
        return parts


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


def fuse_groups(model: nn.Module, groups) -> int:
    """For every module named by a group `(parent attribute, layer names)` whose layers can share one launch
    (`fuse_siblings`), register the hook. Returns the number of groups fused; idempotent."""
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
