"""Plumbing shared by the calibrated methods: find the decoder blocks and their linears, capture block inputs, run a
block on captured inputs, and find which module produced a linear's input (for AWQ's scale folding).

Model-family knowledge is kept to what cannot be discovered by running the block (see `SCALE_PARTNERS`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from .formats import pack_unit

logger = logging.getLogger(__name__)


class StopForward(Exception):
    """Raised from a hook to end a forward pass once the wanted activations are captured."""


# ------------------------------------------------------------------------------------------------ linears


def is_linear(module: nn.Module) -> bool:
    """nn.Linear (FalconLinear included) or GPT-2's Conv1D (weight stored transposed)."""
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The weight in nn.Linear layout `[out, in]` (a view for nn.Linear, a transposed view for Conv1D)."""
    return module.weight.t() if _is_conv1d(module) else module.weight


def set_linear_weight(module: nn.Module, weight: torch.Tensor) -> None:
    """Overwrite the weight in place from an nn.Linear-layout `[out, in]` tensor."""
    linear_weight(module).data.copy_(weight.to(module.weight.dtype))


def linear_features(module: nn.Module) -> tuple[int, int]:
    w = linear_weight(module)
    return w.shape[1], w.shape[0]


def find_linears(block: nn.Module, skip=()) -> dict[str, nn.Module]:
    """Quantizable linears inside a block, by name relative to the block, minus names matching `skip`."""
    out = {}
    for name, module in block.named_modules():
        if name and is_linear(module) and not any(_matches(name, s) for s in skip):
            out[name] = module
    return out


# config attributes that count a mixture-of-experts layer's routed experts (the router's output size)
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def reason_to_keep_in_float(name: str, module: nn.Module, bits: int, model_config=None) -> str | None:
    """Why a linear found in a decoder block stays in 16 bits, or None when it is quantized.

    A mixture-of-experts router stays float (gptqmodel and AutoAWQ skip them too): it is a tiny share of the
    weights, and rounding it moves tokens to other experts. So does a linear whose shape the packed format cannot
    hold (e.g. Qwen2-MoE's one-output `shared_expert_gate`)."""
    in_features, out_features = linear_features(module)
    unit = pack_unit(bits)
    if in_features % unit or out_features % unit:
        return f"{in_features} inputs x {out_features} outputs do not pack at {bits} bits (multiples of {unit})"
    experts = {getattr(model_config, a, None) for a in _EXPERT_COUNTS} - {None}
    if "Router" in type(module).__name__ or (name.rpartition(".")[2] in ("gate", "router") and out_features in experts):
        return "a mixture-of-experts router"
    return None


def _matches(name: str, pattern: str) -> bool:
    return name == pattern or name.endswith("." + pattern) or ("." + pattern + ".") in ("." + name + ".")


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The ModuleList of repeated decoder blocks: the longest ModuleList whose children share one class (not a
    mixture of experts' list of experts, which can be longer)."""
    best = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and not getattr(module, "routes_tokens", False):
            kinds = {type(m) for m in module}
            if len(kinds) == 1 and any(is_linear(m) for m in module[0].modules()):
                if best is None or len(module) > len(best[1]):
                    best = (name, module)
    if best is None:
        raise ValueError(f"{type(model).__name__}: no list of decoder blocks with linear layers was found")
    return best


def set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)


# ------------------------------------------------------------------------------------------------ block inputs


@dataclass
class BlockInputs:
    """The calibration batches as a block sees them: hidden states plus the keyword arguments the model passed."""

    hidden: list[torch.Tensor] = field(default_factory=list)
    kwargs: list[dict] = field(default_factory=list)

    def __len__(self):
        return len(self.hidden)


# what a block is not replayed with: the KV cache (`cache` since Transformers 5.24, `past_key_values` before) and flags
_DROPPED_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past", "use_cache", "output_attentions")


def _move(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_move(o, device) for o in obj)
    if isinstance(obj, list):
        return [_move(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    return obj


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return False


@torch.no_grad()
def capture_block_inputs(model: nn.Module, first_block: nn.Module, input_ids: torch.Tensor, batch_size: int,
                         device) -> BlockInputs:
    """Run the model up to its first decoder block for each batch of `input_ids`; keep what the block receives."""
    captured = BlockInputs()

    def grab(module, args, kwargs):
        kw = dict(kwargs)
        hidden = args[0] if args else kw.pop("hidden_states")
        for k in _DROPPED_KWARGS:
            kw.pop(k, None)
        kw = {k: _move(v, device) for k, v in kw.items()}
        if captured.kwargs:  # equal masks / rotary tables across batches: keep one copy
            previous = captured.kwargs[-1]
            kw = {k: previous[k] if k in previous and _same(previous[k], v) else v for k, v in kw.items()}
        captured.hidden.append(hidden.to(device))
        captured.kwargs.append(kw)
        raise StopForward

    handle = first_block.register_forward_pre_hook(grab, with_kwargs=True)
    embed_device = model.get_input_embeddings().weight.device
    try:
        for start in range(0, input_ids.shape[0], batch_size):
            batch = input_ids[start:start + batch_size].to(embed_device)
            try:
                model(input_ids=batch, use_cache=False)
            except StopForward:
                pass
    finally:
        handle.remove()
    return captured


def block_output(out):
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def run_block(block: nn.Module, inputs: BlockInputs, stop_ok: bool = False) -> list[torch.Tensor]:
    """The block's output hidden states for every captured batch (nothing kept when hooks stop the forward early)."""
    outs = []
    for hidden, kw in zip(inputs.hidden, inputs.kwargs):
        try:
            outs.append(block_output(block(hidden, **kw)))
        except StopForward:
            if not stop_ok:
                raise
    return outs


# ------------------------------------------------------------------------------------------------ input groups


@dataclass
class InputGroup:
    """Linears that receive the very same input tensor (q/k/v; gate/up; ...), in the order the block runs them."""

    names: list[str]
    producer: str | None = None  # name (in the block) of the module whose output is that input, if any
    producer_kind: str | None = None  # "norm", "linear", "activation" or None
    # modules outside the group that read the same input (not counting the group's ancestors, which pass it on):
    # e.g. a mixture-of-experts router beside a shared expert's gate/up. AWQ cannot fold scales into its producer.
    other_consumers: list[str] = field(default_factory=list)


def _is_norm(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return "norm" in type(module).__name__.lower() and isinstance(w, torch.Tensor) and w.dim() == 1


def _is_activation(module: nn.Module) -> bool:
    passthrough = (nn.Dropout, nn.Identity)
    return (not isinstance(module, passthrough) and not list(module.parameters(recurse=True))
            and not list(module.children()))


@torch.no_grad()
def input_groups(block: nn.Module, linears: dict[str, nn.Module], hidden: torch.Tensor, kwargs: dict,
                 experts_as_linears: bool = False) -> list[InputGroup]:
    """Run the block once and group its linears by identical input tensor (or a view of it: a mixture of experts
    reshapes the norm's output before its router and experts); name the module that produced it.
    experts_as_linears: each mixture-of-experts experts module (`routes_tokens`) also joins the group of its input,
    under its own name, standing for its experts' input-side linears (which see only gathers of that input)."""
    seen_inputs: list[torch.Tensor] = []  # keeps tensors alive so that ids stay unique during the pass
    order: list[tuple[int, str]] = []
    produced: dict[int, list[str]] = {}
    handles = []
    name_of = {id(m): n for n, m in block.named_modules()}

    def pre_hook(module, args):
        x = args[0]
        seen_inputs.append(x)
        order.append((id(x), name_of[id(module)]))

    def out_hook(module, args, output):
        if isinstance(output, torch.Tensor):
            seen_inputs.append(output)
            produced.setdefault(id(output), []).append(name_of[id(module)])

    def receive_hook(module, args, kwargs):
        for x in (*args, *kwargs.values()):
            if isinstance(x, torch.Tensor):
                seen_inputs.append(x)
                received.setdefault(id(x), []).append(name_of[id(module)])

    received: dict[int, list[str]] = {}
    experts = [m for m in block.modules() if getattr(m, "routes_tokens", False)]
    for m in experts:  # every expert runs in this pass, also those no token of this batch is routed to
        m.probe_every_expert = True
    for name, m in block.named_modules():
        if not name:
            continue
        if name in linears or (experts_as_linears and getattr(m, "routes_tokens", False)):
            handles.append(m.register_forward_pre_hook(pre_hook))
        handles.append(m.register_forward_pre_hook(receive_hook, with_kwargs=True))
        handles.append(m.register_forward_hook(out_hook))
    try:
        block(hidden, **kwargs)
    finally:
        for h in handles:
            h.remove()
        for m in experts:
            m.probe_every_expert = False

    groups: dict[int, InputGroup] = {}
    for key, name in order:
        if key not in groups:
            groups[key] = InputGroup(names=[])
        if name not in groups[key].names:
            groups[key].names.append(name)
    missing = set(linears) - {n for g in groups.values() for n in g.names}
    if missing:
        logger.warning("linears never called during calibration (left unquantized): %s", sorted(missing))
    tensors = {id(t): t for t in seen_inputs}

    def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:  # b is a view of a, rows regrouped, features kept
        return (a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.dtype == b.dtype
                and a.shape[-1] == b.shape[-1] and a.is_contiguous() and b.is_contiguous())

    for key, group in groups.items():
        aliases = [key] + [k for k, t in tensors.items() if k != key and same_memory(t, tensors[key])]
        consumers = [n for k in aliases for n in received.get(k, [])]
        group.other_consumers = [n for n in dict.fromkeys(consumers) if n not in group.names
                                 and not any(g.startswith(n + ".") for g in group.names)]
        for cand in (n for k in aliases for n in produced.get(k, [])):
            module = block.get_submodule(cand)
            kind = ("linear" if cand in linears else "norm" if _is_norm(module)
                    else "activation" if _is_activation(module) else None)
            if kind is not None:
                group.producer, group.producer_kind = cand, kind
                break
    return list(groups.values())


def routed_linears(block: nn.Module) -> dict[str, str]:
    """Linears of mixture-of-experts experts (inside a module with `routes_tokens`, e.g. `UnfusedExperts`), each
    called on the tokens routed to its expert only: name -> the same name with the expert index as `*` (the
    linears one role of every expert share, e.g. `mlp.experts.*.w1`)."""
    out = {}
    for name, module in block.named_modules():
        if getattr(module, "routes_tokens", False):
            for sub, linear in module.named_modules():
                if sub and is_linear(linear):
                    expert, _, leaf = sub.partition(".")
                    out[f"{name}.{sub}" if name else sub] = f"{name}.*.{leaf}" if name else f"*.{leaf}"
    return out


def routed_scale_partner(block: nn.Module, name: str) -> str | None:
    """The linear whose output rows can take AWQ's division for routed linear `name` (an expert's up for its down:
    the experts module's `scale_partner`), or None."""
    for prefix, module in block.named_modules():
        if getattr(module, "routes_tokens", False) and name.startswith(f"{prefix}."):
            partner = module.scale_partner(name[len(prefix) + 1:])
            return None if partner is None else f"{prefix}.{partner}"
    return None


# Producers that cannot be seen by tensor identity (the tensor goes through a reshape or a product first):
# consumer suffix -> producer sibling suffix, valid only when the producer's outputs map 1:1 onto the consumer's
# inputs (same size; checked by the caller). v -> o holds for plain multi-head attention (not GQA);
# up -> down holds for gated MLPs, act(gate) * up being linear in up.
SCALE_PARTNERS = {"o_proj": "v_proj", "out_proj": "v_proj", "down_proj": "up_proj"}


def scale_partner(name: str, linears: dict[str, nn.Module]) -> str | None:
    parent, _, leaf = name.rpartition(".")
    partner_leaf = SCALE_PARTNERS.get(leaf)
    if partner_leaf is None:
        return None
    partner = f"{parent}.{partner_leaf}" if parent else partner_leaf
    if partner not in linears:
        return None
    if linear_features(linears[partner])[1] != linear_features(linears[name])[0]:
        return None  # e.g. GQA: v has fewer outputs than o has inputs
    return partner
