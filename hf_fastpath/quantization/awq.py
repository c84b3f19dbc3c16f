"""AWQ (Lin et al., 2023): activation-aware scaling before round-to-nearest.

For each group of linears that share one input x (q/k/v after a norm; gate/up; v -> o; up -> down), input channel c is
multiplied by s_c in the weights and divided out of the op that produces x, which leaves the float function unchanged
but lets salient channels (large mean |x|) keep more precision after rounding. s = mean|x|^a (or the "duo" form
mean|x|^a / mean|w|^(1-a)), a searched on a grid of 20 points in [0, 1) to minimise the error of the smallest module
that contains the group (attention, MLP, or the linear itself). Then max |w| of each group is clipped (searched
shrink factor) to minimise the linear's output error, and the weights are rounded asymmetrically.

Scales fold into: a norm's weight (+ bias); the previous linear's output rows (v -> o, up -> down); or, after a
non-linear activation (GELU...), a `ScaledActivation` that divides the activation's output (saved as `act.scales`).
A producer whose output also reaches modules outside the group (a mixture-of-experts router beside the experts'
linears) takes the scales only where each such module can take them back in its input channels and compute the
same (checked in float64 on its real input: a linear router or a float linear does; a cosine router does not);
else the group gets the clip search only. Mixture-of-experts experts (`UnfusedExperts`): all experts' gate / up
take one set of scales from the norm before the router (judged at the MoE block's output, as AutoAWQ does, whose
router is left reading scaled inputs); each expert's down takes its own from its up, on its routed tokens.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
from torch import nn

from .blocks import (BlockInputs, InputGroup, StopForward, block_output, input_groups, is_linear, linear_weight,
                     routed_linears, routed_scale_partner, scale_partner, set_linear_weight, set_submodule)
from .formats import resolve_group_size
from .rtn import fake_quantize_grouped, pad_columns

logger = logging.getLogger(__name__)

# Linears whose outputs form attention scores: clipping them hurts (AWQ skips their clip search).
NO_CLIP = ("q_proj", "k_proj", "query", "key", "query_key_value", "c_attn", "qkv_proj", "Wqkv")


@dataclass
class AWQSettings:
    bits: int = 4
    group_size: int = 128
    n_grid: int = 20
    duo_scaling: bool = True  # also try s = x^a / w^(1-a); keep whichever form is better
    max_shrink: float = 0.5
    clip_tokens: int = 512  # input tokens sampled for the clip search
    search_tokens: int | None = None  # cap on tokens used by the scale search (None: all calibration tokens)
    clip: bool = True  # run the clip search after folding the scales


def _lowest_common_parent(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    prefix = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        prefix.append(level[0])
    return ".".join(prefix)


def _inspect_module_name(group: InputGroup) -> str:
    """The smallest module whose output reflects the whole effect of the group's rounding."""
    if len(group.names) == 1:
        name = group.names[0]
        # A single fused qkv after a norm: judge at the attention output (softmax included), like q/k/v.
        if group.producer_kind == "norm" and "." in name:
            return name.rpartition(".")[0]
        return name
    return _lowest_common_parent(group.names)


def _trim(batches: BlockInputs, max_tokens: int | None) -> BlockInputs:
    if max_tokens is None:
        return batches
    out = BlockInputs()
    total = 0
    for h, kw in zip(batches.hidden, batches.kwargs):
        if total >= max_tokens:
            break
        out.hidden.append(h)
        out.kwargs.append(kw)
        total += h.shape[0] * h.shape[1] if h.dim() == 3 else h.shape[0]
    return out


@torch.no_grad()
def _capture_group(block, inputs: BlockInputs, group: InputGroup, inspect_name: str):
    """Per batch: the inspect module's (args, kwargs) and float output; the channel means of |x| (None where the
    group's first module never ran: an expert no token was routed to)."""
    inspect = block.get_submodule(inspect_name) if inspect_name else block
    first = block.get_submodule(group.names[0])  # a linear, or an experts module: its first argument is x
    records, outputs = [], []
    abs_sum, count = None, 0

    def grab_in(module, args, kwargs):
        records.append((args, kwargs))

    def grab_out(module, args, output):
        outputs.append(block_output(output))
        raise StopForward

    def grab_x(module, args):
        nonlocal abs_sum, count
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        s = x.abs().sum(0)
        abs_sum = s if abs_sum is None else abs_sum + s
        count += x.shape[0]

    handles = [first.register_forward_pre_hook(grab_x)]
    if inspect is block:
        records = [((h,), kw) for h, kw in zip(inputs.hidden, inputs.kwargs)]
        for h, kw in zip(inputs.hidden, inputs.kwargs):
            try:
                outputs.append(block_output(block(h, **kw)))
            except StopForward:
                pass
    else:
        handles += [inspect.register_forward_pre_hook(grab_in, with_kwargs=True),
                    inspect.register_forward_hook(grab_out)]
        for h, kw in zip(inputs.hidden, inputs.kwargs):
            try:
                block(h, **kw)
            except StopForward:
                pass
    for handle in handles:
        handle.remove()
    return inspect, records, outputs, None if count == 0 else abs_sum / count


@torch.no_grad()
def _search_scales(inspect, records, outputs, x_mean, linears, names, settings: AWQSettings):
    weights = {n: linear_weight(linears[n]).detach().float().clone() for n in names}
    stacked = torch.cat([weights[n] for n in names])
    gs = resolve_group_size(settings.group_size, stacked.shape[1])
    w_abs = pad_columns(stacked.abs(), gs).reshape(-1, gs)
    w_mean = (w_abs / (w_abs.amax(dim=1, keepdim=True) + 1e-6)).reshape(stacked.shape[0], -1)
    w_mean = w_mean[:, :stacked.shape[1]].mean(0)
    x_mean = x_mean.to(stacked.device)

    def loss_for(scales):
        for n in names:
            w = weights[n] * scales
            set_linear_weight(linears[n], fake_quantize_grouped(w, settings.bits, settings.group_size, False) / scales)
        total = 0.0
        for (args, kwargs), ref in zip(records, outputs):
            out = block_output(inspect(*args, **kwargs))
            total += (out.float() - ref.float()).pow(2).sum().item()
        return total

    forms = ["plain", "duo"] if settings.duo_scaling else ["plain"]
    best = (float("inf"), None, None)
    for form in forms:
        for i in range(settings.n_grid):
            a = i / settings.n_grid
            if form == "duo":
                s = (x_mean.pow(a) / (w_mean.pow(1 - a) + 1e-4)).clamp(min=1e-4)
            else:
                s = x_mean.pow(a).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            loss = loss_for(s)
            if loss < best[0]:
                best = (loss, s.clone(), (form, a))
    for n in names:  # restore the float weights; the caller folds the chosen scales in
        set_linear_weight(linears[n], weights[n])
    logger.debug("AWQ %s: best %s alpha=%.2f", names, *best[2])
    return best[1], best[2]


# Norms whose gain is (1 + weight) (Gemma's RMSNorm): a scale folds into 1 + weight, not into weight
_GAIN_PLUS_ONE_NORMS = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")


@torch.no_grad()
def fold_scales(block: nn.Module, linears: dict[str, nn.Module], names: list[str], producer: str,
                producer_kind: str, scales: torch.Tensor) -> None:
    """Multiply the input channels of linears `names` by `scales` and divide them out of the producer."""
    prod = block.get_submodule(producer)
    if producer_kind == "norm":
        if type(prod).__name__ in _GAIN_PLUS_ONE_NORMS:  # y = norm(x) * (1 + weight)
            prod.weight.copy_(((1.0 + prod.weight.float()) / scales.to(prod.weight.device) - 1.0).to(prod.weight.dtype))
        else:
            prod.weight.div_(scales.to(prod.weight.dtype))
        if getattr(prod, "bias", None) is not None:
            prod.bias.div_(scales.to(prod.bias.dtype))
    elif producer_kind == "linear":
        w = linear_weight(prod)
        set_linear_weight(prod, w.float() / scales[:, None].to(w.device))
        if getattr(prod, "bias", None) is not None:
            prod.bias.div_(scales.to(prod.bias.dtype))
    elif producer_kind == "activation":
        if isinstance(prod, ScaledActivation):
            prod.scales.mul_(scales.to(prod.scales.dtype))
        else:
            dtype = linear_weight(linears[names[0]]).dtype
            wrapped = ScaledActivation(prod, scales.numel(), dtype=dtype, device=scales.device)
            wrapped.scales.copy_(scales.to(dtype))
            set_submodule(block, producer, wrapped)
    else:
        raise ValueError(f"cannot fold AWQ scales into {producer} ({producer_kind})")
    for n in names:
        w = linear_weight(linears[n])
        set_linear_weight(linears[n], w.float() * scales[None, :].to(w.device))


def _scaled_linears(block: nn.Module, names: list[str], linears: dict[str, nn.Module]) -> list[str] | None:
    """The linears whose input channels a group's scales multiply: experts modules stand for all their experts'
    input-side linears. None where some of those are not being quantized (they would read scaled inputs)."""
    out = []
    for name in names:
        module = block.get_submodule(name)
        inner = [f"{name}.{n}" for n in module.input_linear_names()] if getattr(module, "routes_tokens", False) \
            else [name]
        if not all(n in linears for n in inner):
            return None
        out += inner
    return out


def _channel_weight(module: nn.Module, features: int) -> torch.Tensor | None:
    """A module's [out, in] weight that its input channels multiply (a linear's, a linear router's), else None."""
    w = linear_weight(module) if is_linear(module) else getattr(module, "weight", None)
    return w if isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[1] == features else None


@torch.no_grad()
def _compensate_consumers(block: nn.Module, names: list[str], scales: torch.Tensor, hidden: torch.Tensor,
                          kwargs: dict) -> str | None:
    """Let modules that read the producer's output beside the group (a router, a float linear) take the scales
    back: their weight's input channels multiplied by `scales`, once a float64 copy run on the module's real input
    shows it computes the same from input / scales. Returns the name of the first that cannot (nothing changed)."""
    captured = {}
    handles = [block.get_submodule(n).register_forward_pre_hook(
        lambda m, args, kw, n=n: captured.setdefault(n, (args, kw)), with_kwargs=True) for n in names]
    try:
        block(hidden, **kwargs)
    finally:
        for h in handles:
            h.remove()
    for name in names:
        module = block.get_submodule(name)
        if name not in captured or not captured[name][0] or _channel_weight(module, scales.numel()) is None:
            return name  # (the input passed by keyword: not the first argument this check scales)
        args, kw = captured[name]
        probe = copy.deepcopy(module).double()
        x = args[0].double()
        s = scales.to(x.device, torch.float64)
        try:
            before = _tensors(probe(x, *args[1:], **kw))
            w = _channel_weight(probe, s.numel())
            w.copy_(w * s)
            after = _tensors(probe(x / s, *args[1:], **kw))
        except (RuntimeError, TypeError, ValueError):
            return name
        if len(before) != len(after) or not all(
                torch.equal(a, b) if not a.is_floating_point() else torch.allclose(a, b, rtol=1e-9, atol=1e-9)
                for a, b in zip(before, after)):
            return name
    for name in names:
        module = block.get_submodule(name)
        w = _channel_weight(module, scales.numel())
        w.data.copy_((w.float() * scales.to(w.device)).to(w.dtype))
    return None


def _tensors(output) -> list[torch.Tensor]:
    items = output if isinstance(output, (tuple, list)) else (output,)
    return [t for t in items if isinstance(t, torch.Tensor)]


@torch.no_grad()
def _search_clip(weight: torch.Tensor, x: torch.Tensor, settings: AWQSettings) -> torch.Tensor:
    """Per (output row, group): the max |w| that minimises the group's contribution error on sampled inputs."""
    rows, cols = weight.shape
    gs = resolve_group_size(settings.group_size, cols)
    weight = pad_columns(weight, gs)  # zero columns (and zero inputs below) add nothing
    groups = weight.shape[1] // gs
    if x.shape[0] > settings.clip_tokens:
        idx = torch.linspace(0, x.shape[0] - 1, settings.clip_tokens, device=x.device).long()
        x = x[idx]
    xg = pad_columns(x.to(weight.device), gs).reshape(-1, groups, gs)  # [T, G, gs]
    best_max = torch.empty(rows, groups, device=weight.device)
    budget = 2**27 if weight.is_cuda else 2**24  # elements of the [rows, tokens, groups] products per chunk
    chunk = max(1, budget // max(1, xg.shape[0] * groups * gs))
    for r0 in range(0, rows, chunk):
        w = weight[r0:r0 + chunk].reshape(-1, groups, gs)  # [R, G, gs]
        ref = torch.einsum("tgk,rgk->rtg", xg, w)
        org_max = w.abs().amax(dim=-1)  # [R, G]
        best_err = torch.full_like(org_max, float("inf"))
        best = org_max.clone()
        for i in range(int(settings.max_shrink * settings.n_grid)):
            m = org_max * (1 - i / settings.n_grid)
            wc = torch.maximum(torch.minimum(w, m[..., None]), -m[..., None])
            q = fake_quantize_grouped(wc.reshape(w.shape[0], -1), settings.bits, settings.group_size, False)
            err = (torch.einsum("tgk,rgk->rtg", xg, q.reshape(w.shape)) - ref).pow(2).mean(dim=1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, m, best)
        best_max[r0:r0 + chunk] = best
    return best_max


def _apply_clip(weight: torch.Tensor, max_val: torch.Tensor, group_size: int) -> torch.Tensor:
    rows, cols = weight.shape
    gs = resolve_group_size(group_size, cols)
    w = pad_columns(weight, gs).reshape(rows, -1, gs)
    m = max_val[..., None]
    return torch.maximum(torch.minimum(w, m), -m).reshape(rows, -1)[:, :cols]


@torch.no_grad()
def awq_block(block: nn.Module, inputs: BlockInputs, linears: dict[str, nn.Module], settings: AWQSettings) -> list[str]:
    """Search and fold AWQ scales, then clip, for one block (weights stay float; the caller rounds them).

    Returns a short description per group for logging.
    """
    search_inputs = _trim(inputs, settings.search_tokens)
    groups = input_groups(block, linears, inputs.hidden[0], inputs.kwargs[0], experts_as_linears=True)
    routed = routed_linears(block)
    report = []
    # An expert's gate / up read a gather of its routed tokens: their scales come with the experts module's group
    # (the norm's). Its down folds into its up, the scales searched on the expert's own tokens, as AutoAWQ does for
    # Mixtral. Every down's input comes from one pass of the block: no fold changes another group's input (a fold
    # keeps the float function), so one pass serves E experts where one each would cost E passes.
    expert_partners = {}
    for group in groups:
        if group.names[0] in routed and len(group.names) == 1:
            partner = routed_scale_partner(block, group.names[0])
            if partner is not None and partner in linears:
                expert_partners[group.names[0]] = partner
    expert_inputs = None
    for group in groups:
        label = "+".join(group.names)
        producer, kind = group.producer, group.producer_kind
        if group.names[0] in routed:
            if group.names[0] not in expert_partners:
                report.append(f"{label}: routed expert, no scales of its own")
                continue
            if expert_inputs is None:
                expert_inputs = _capture_inputs(block, search_inputs, list(expert_partners))
            x = expert_inputs.pop(group.names[0])
            if x is None:
                report.append(f"{label}: no routed search token, clip only")
                continue
            linear = linears[group.names[0]]
            scales, (form, alpha) = _search_scales(linear, [((x,), {})], [linear(x)], x.float().abs().mean(0),
                                                   linears, group.names, settings)
            fold_scales(block, linears, group.names, expert_partners[group.names[0]], "linear", scales)
            report.append(f"{label} <- {expert_partners[group.names[0]]}: {form} alpha={alpha:.2f}")
            continue
        names = _scaled_linears(block, group.names, linears)
        if names is None:
            report.append(f"{label}: experts not all quantized, clip only")
            continue
        if producer is None and len(group.names) == 1:
            partner = scale_partner(group.names[0], linears)
            if partner is not None:
                producer, kind = partner, "linear"
        if producer is None:
            report.append(f"{label}: no foldable producer, clip only")
            continue
        # dividing the producer's output by the scales changes what other modules reading it compute, unless
        # they take the scales back
        others = group.other_consumers if producer == group.producer else []
        inspect_name = _inspect_module_name(group)
        inspect, records, outputs, x_mean = _capture_group(block, search_inputs, group, inspect_name)
        if x_mean is None:  # the group's first module never ran on the search tokens
            report.append(f"{label}: no search token reached it, clip only")
            continue
        scales, (form, alpha) = _search_scales(inspect, records, outputs, x_mean, linears, names, settings)
        del records, outputs
        refused = others and _compensate_consumers(block, others, scales, inputs.hidden[0], inputs.kwargs[0])
        if refused:
            report.append(f"{label}: {producer} also feeds {refused}, clip only")
            continue
        fold_scales(block, linears, names, producer, kind, scales)
        taken = f" ({', '.join(others)} compensated)" if others else ""
        report.append(f"{label} <- {producer}: {form} alpha={alpha:.2f}{taken}")

    # Clip search on the inputs as they are after every fold, all captured in one pass of the block.
    clipped = []
    for group in groups if settings.clip else ():
        # (an experts module's linears clip in their own experts' groups, on their own tokens)
        names = [n for n in group.names if n in linears and not any(n.rpartition(".")[2] == s for s in NO_CLIP)]
        if names:
            clipped.append((group.names[0], names))
    xs = _capture_inputs(block, _trim(inputs, settings.clip_tokens * 4), [source for source, _ in clipped])
    for source, names in clipped:
        x = xs[source]
        if x is None:  # an expert no calibration token was routed to: plain rounding
            continue
        x = x.float()
        for n in names:
            w = linear_weight(linears[n]).detach().float()
            max_val = _search_clip(w, x, settings)
            set_linear_weight(linears[n], _apply_clip(w, max_val, settings.group_size))
    return report


@torch.no_grad()
def _capture_inputs(block: nn.Module, inputs: BlockInputs, names: list[str]) -> dict[str, torch.Tensor | None]:
    """The first argument of each named module, rows [T, features] over every batch, from one run of the block;
    None for a module that never ran (an expert no token was routed to)."""
    seen = {n: [] for n in names}
    handles = [block.get_submodule(n).register_forward_pre_hook(
        lambda module, args, n=n: seen[n].append(args[0].reshape(-1, args[0].shape[-1]))) for n in seen]
    try:
        for hidden, kwargs in zip(inputs.hidden, inputs.kwargs):
            block(hidden, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return {n: torch.cat(rows) if rows else None for n, rows in seen.items()}


class ScaledActivation(nn.Module):
    """AWQ's activation scaling before a down projection: act(x) / scales (checkpoint key `...mlp.act.scales`)."""

    def __init__(self, act: nn.Module, features: int, dtype: torch.dtype = torch.float16, device=None):
        super().__init__()
        self.act = act
        self.register_buffer("scales", torch.ones(features, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x) / self.scales.to(x.dtype)
