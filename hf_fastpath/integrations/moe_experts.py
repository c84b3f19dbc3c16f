"""Mixture-of-experts experts as per-expert linears, so that W4A16 quantizes them like any other linear.

Transformers 5 stores a mixture of experts' weights as fused 3-D parameters (`experts.gate_up_proj [E, 2I, H]`,
`experts.down_proj [E, H, I]`, transposed in some models) behind `@use_experts_implementation`; checkpoints and
GPTQ / AWQ tools (gptqmodel, AutoAWQ) keep one linear per expert and projection. `unfuse_experts` turns each fused
module into `UnfusedExperts`: a ModuleList of experts, each holding its gate / up / down linears under the names of
the model's own checkpoints (Transformers' conversion mapping: Mixtral's `w1` / `w3` / `w2`, Qwen-MoE's
`gate_proj` / `up_proj` / `down_proj`). GPTQ then sees each expert's linear called on exactly the tokens routed to
it, and a quantized model saves and loads under the per-expert names those tools use.

The forward routes as Transformers' eager experts do: one call per expert that received tokens, gathered rows,
routing weights applied, results summed per token in fp32 (as its grouped_mm path does). The gate's activation is
the fused module's own `_apply_gate` (gpt-oss's clamped, interleaved SwiGLU included); the fused module, its 3-D
weights removed, is kept for that.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

DEFAULT_NAMES = ("gate_proj", "up_proj", "down_proj")
_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
_BIASES = ("gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


def is_fused_experts(module: nn.Module) -> bool:
    """A Transformers experts module whose weights are 3-D parameters: `(gate_)up_proj` and `down_proj`."""
    params = module._parameters
    up = params.get("gate_up_proj", params.get("up_proj"))
    down = params.get("down_proj")
    return up is not None and down is not None and up.dim() == 3 and down.dim() == 3


def expert_linear_names(model_type: str | None) -> tuple[str, str, str]:
    """(gate, up, down) names of one expert's linears in the checkpoints of `model_type`, read from Transformers'
    conversion mapping (the converters that merge `experts.*.<name>.weight` into the fused tensors)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return DEFAULT_NAMES
    names = dict(zip(("gate", "up", "down"), DEFAULT_NAMES))
    for conversion in (get_checkpoint_conversion_mapping(model_type) if model_type else None) or ():
        sources = [s for s in getattr(conversion, "source_patterns", ()) if ".experts.*." in f".{s}"]
        targets = getattr(conversion, "target_patterns", ())
        if not sources or not targets:
            continue
        leaves = [s.split("experts.*.")[1].rpartition(".weight")[0] for s in sources]
        if targets[0].endswith("experts.gate_up_proj") and len(leaves) == 2:
            names["gate"], names["up"] = leaves
        elif targets[0].endswith("experts.up_proj") and len(leaves) == 1:
            names["up"] = leaves[0]
        elif targets[0].endswith("experts.down_proj") and len(leaves) == 1:
            names["down"] = leaves[0]
    return names["gate"], names["up"], names["down"]


class UnfusedExperts(nn.ModuleList):
    """The experts of one mixture-of-experts layer as one module per expert with plain linears; called like the
    fused module it replaces: `(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`."""

    # quantization/blocks.py: calibration treats these linears as routed (each sees only its own tokens), and
    # sets probe_every_expert for the one pass that finds which linears share an input
    routes_tokens = True
    probe_every_expert = False

    def __init__(self, fused: nn.Module, names: tuple[str, str, str] = DEFAULT_NAMES, *, device=None):
        has_gate = "gate_up_proj" in fused._parameters
        names = dict(zip(("gate", "up", "down"), names))
        up, down = fused._parameters["gate_up_proj" if has_gate else "up_proj"], fused._parameters["down_proj"]
        transposed = bool(getattr(fused, "is_transposed", False))  # [E, in, out] instead of nn.Linear's [E, out, in]
        concatenated = bool(getattr(fused, "is_concatenated", True))  # [gate; up], else interleaved rows
        up_bias = fused._parameters.get("gate_up_proj_bias" if has_gate else "up_proj_bias")
        down_bias = fused._parameters.get("down_proj_bias")
        device = up.device if device is None else device
        experts = []
        for e in range(up.shape[0]):
            w_up, w_down = (up[e].t(), down[e].t()) if transposed else (up[e], down[e])
            b_up = None if up_bias is None else up_bias[e]
            expert = nn.Module()
            if has_gate:
                rows = (slice(0, w_up.shape[0] // 2), slice(w_up.shape[0] // 2, None)) if concatenated \
                    else (slice(0, None, 2), slice(1, None, 2))
                for role, part in zip(("gate", "up"), rows):
                    setattr(expert, names[role], _linear(w_up[part], None if b_up is None else b_up[part], device))
            else:
                setattr(expert, names["up"], _linear(w_up, b_up, device))
            setattr(expert, names["down"], _linear(w_down, None if down_bias is None else down_bias[e], device))
            experts.append(expert)
        super().__init__(experts)
        self.has_gate, self.names, self.concatenated = has_gate, names, concatenated
        self.gate_times_up = has_gate and concatenated and _default_gate(fused)
        for name in _WEIGHTS + _BIASES:  # the fused module keeps only what its _apply_gate / act_fn use
            fused._parameters.pop(name, None)
        # not a child: it holds no weights any more, and its name must not appear in the state dict
        object.__setattr__(self, "_fused", fused)

    @property
    def num_experts(self) -> int:
        return len(self)

    def input_linear_names(self) -> list[str]:
        """The linears that read the experts' input (gate and up of every expert), relative to this module."""
        roles = ("gate", "up") if self.has_gate else ("up",)
        return [f"{e}.{self.names[role]}" for e in range(len(self)) for role in roles]

    def scale_partner(self, name: str) -> str | None:
        """For an expert's down projection (`"<e>.<down>"`): its up projection (`"<e>.<up>"`), whose output rows
        AWQ may divide by the scales the down projection's inputs take, as for a dense MLP. Only where down's input
        is act(gate) * up (Transformers' default gate); gpt-oss's clamped (up + 1) * glu(gate) and a gateless
        act(up) are not linear in up."""
        expert, _, leaf = name.partition(".")
        return f"{expert}.{self.names['up']}" if self.gate_times_up and leaf == self.names["down"] else None

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        expert = self[e]
        gate = getattr(expert, self.names["gate"])(x) if self.has_gate else None
        up = getattr(expert, self.names["up"])(x)
        if self.has_gate:
            both = torch.cat((gate, up), -1) if self.concatenated else torch.stack((gate, up), -1).flatten(-2)
            h = self._fused._apply_gate(both)
        else:
            h = self._fused.act_fn(up)
        return getattr(expert, self.names["down"])(h)

    # act-order experts: the grouped path gathers each row's permuted input ([rows, K] int64 indices), so it runs
    # up to this many routed rows (decoding, short prefills); longer calls take one call per expert
    ACT_ORDER_MAX_ROWS = 1024

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        stacks = None
        if not (torch.is_grad_enabled() and hidden_states.requires_grad) and not self.probe_every_expert:
            stacks = self._w4a16_stacks(hidden_states)
        if stacks is not None and stacks["act_order"] and top_k_index.numel() > self.ACT_ORDER_MAX_ROWS:
            stacks = None
        if stacks is not None:
            return self._grouped_forward(stacks, hidden_states, top_k_index, top_k_weights)
        return self._routed_forward(hidden_states, top_k_index, top_k_weights)

    def _routed_forward(self, hidden_states, top_k_index, top_k_weights):
        """One call per expert that received tokens (any linears; training; the reference for the grouped path)."""
        if hidden_states.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "UnfusedExperts: these experts run one call per routed expert, which reads the routing on the host: "
                "a CUDA graph cannot capture that. The grouped path, which can, needs the experts as 4-bit "
                "W4A16Linear layers (group size dividing in_features, no PEFT wrapper) and fp16 / bf16 activations; "
                "else run this model without CUDA graphs.")
        out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
        with torch.no_grad():
            # a column per expert, plus one for the sentinel index E (experts held by another rank)
            routed = F.one_hot(top_k_index.clamp(max=len(self)), num_classes=len(self) + 1)[..., :-1]
            hit = routed.sum(dim=(0, 1)).nonzero().flatten().tolist()
        for e in hit:
            token, slot = torch.where(routed[..., e])
            y = self._expert(e, hidden_states[token])
            out.index_add_(0, token, y.float() * top_k_weights[token, slot, None].float())
        if self.probe_every_expert:  # one token through each idle expert (own tensor: each expert its own input)
            for e in sorted(set(range(len(self))) - set(hit)):
                self._expert(e, hidden_states[:1].clone())
        return out.to(hidden_states.dtype)

    def _w4a16_stacks(self, x: torch.Tensor):
        """The experts' W4A16 weights as stacks for the grouped kernel, or None where it does not run (float or
        PEFT-wrapped linears, activations the kernels do not take): {"in": launches of the input side, each (stacks
        of its first projection, output widths, or [] for one projection), "down": (stacks, []), "group_size",
        "act_order"}. Gate and up are one launch where their widths (and act-order permutations) allow it. Built
        once (eagerly) and rebuilt when the layers' tensors were replaced (`model.to(...)`)."""
        from ..quantization.linear import W4A16Linear, _kernels

        first = getattr(self[0], self.names["up"])
        if type(first) is not W4A16Linear or x.dtype not in (torch.float16, torch.bfloat16) or \
                not first._use_kernel(x.reshape(-1, x.shape[-1])):
            return None
        cached = self.__dict__.get("_stacks")
        if torch.compiler.is_compiling():  # built by an eager call before (generate's prefill, a warm-up)
            return cached[2] if cached is not None and cached[1] == x.dtype else None
        if cached is not None and cached[0] is first._buffers["qweight"] and cached[1] == x.dtype:
            return cached[2]
        from ..quantization.fusion import stack_experts

        layers = {role: [getattr(e, self.names[role]) for e in self] for role in ("gate", "up", "down")
                  if role != "gate" or self.has_gate}
        input_side = [layers[r] for r in ("gate", "up") if r in layers]
        launches = None
        stacked = stack_experts(input_side), stack_experts([layers["down"]])
        if stacked[0] is not None and stacked[1] is not None:
            for stack in (*stacked[0], *stacked[1]):  # the kernel takes scales / zeros in the activations' dtype
                stack["scales"], stack["zeros"] = stack["scales"].to(x.dtype), stack["zeros"].to(x.dtype)
            widths = [m[0].out_features for m in input_side]
            perms = [s["perm"] for s in stacked[0]]
            same_order = all(p is None for p in perms) or all(p is not None and torch.equal(p, perms[0]) for p in perms)
            one_launch = (len(widths) == 2 and self.concatenated and all(s["bias"] is None for s in stacked[0])
                          and not any(w % _kernels().w4a16_segment_columns() for w in widths) and same_order)
            launches = {"in": [(stacked[0][0], widths)] if one_launch else [(s, []) for s in stacked[0]],
                        "down": (stacked[1][0], []), "group_size": first._effective_group_size,
                        "act_order": any(s["perm"] is not None for s in (*stacked[0], *stacked[1]))}
        self.__dict__["_stacks"] = (first._buffers["qweight"], x.dtype, launches)
        return launches

    def _grouped_forward(self, launches, hidden_states, top_k_index, top_k_weights):
        """All experts in one W4A16 launch per projection (gate and up in one where they fit): rows sorted by
        expert, a fixed-size tile table (no host sync, so CUDA graphs and torch.compile fullgraph hold), results
        put back in token order and summed over the top-k with fp32 accumulation (deterministic: no atomics)."""
        from ..kernels import w4a16_ops
        from ..quantization.linear import _kernels

        kernels = _kernels()
        tokens, top_k = top_k_index.shape
        experts = len(self)
        expert_of_row, order = torch.sort(top_k_index.reshape(-1), stable=True)
        gather_expert = expert_of_row.clamp(max=experts - 1)  # index E: another rank's experts (no tile computes it)
        x = hidden_states.index_select(0, order // top_k)
        rows = x.shape[0]
        offsets = torch.searchsorted(expert_of_row, torch.arange(experts + 1, device=x.device))
        per_expert = -(-rows // max(1, min(experts, rows)))
        group_size = launches["group_size"]
        tables = {}

        def project(inputs, stack, widths):
            if stack["perm"] is not None:  # act-order: each row's input in its expert's order
                inputs = inputs.gather(1, stack["perm"].index_select(0, gather_expert))
            n = sum(widths) if widths else stack["qweight"].shape[2]
            block_m = kernels.w4a16_expert_block_m(per_expert, inputs.shape[1], n, group_size)
            if block_m not in tables:
                tables[block_m] = kernels.w4a16_expert_tiles(offsets, rows, block_m)
            args = (inputs, stack["qweight"], stack["scales"], stack["zeros"], group_size, tables[block_m],
                    per_expert, widths)
            y = w4a16_ops.w4a16_experts_op(*args) if torch.compiler.is_compiling() else \
                kernels.w4a16_experts_matmul_rows(*args)
            return y if stack["bias"] is None else y + stack["bias"].index_select(0, gather_expert).to(y.dtype)

        outs = [project(x, stack, widths) for stack, widths in launches["in"]]
        if not self.has_gate:
            h = self._fused.act_fn(outs[0])
        else:
            if len(outs) == 1:  # gate and up side by side: the concatenated layout _apply_gate takes
                both = outs[0]
            else:
                gate, up = outs
                both = torch.cat((gate, up), -1) if self.concatenated else torch.stack((gate, up), -1).flatten(-2)
            h = self._fused._apply_gate(both)
        y = project(h.contiguous(), *launches["down"])
        # Back in token order (a gather by the inverse permutation), rows routed to index E (another rank's experts,
        # under expert parallelism: in no tile, so unwritten) zeroed, then the top-k weighted sum as one [1, k] x
        # [k, H] product per token: fp32 accumulation, deterministic, no fp32 copy of the rows.
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y = y.index_select(0, inverse).view(tokens, top_k, y.shape[-1])
        y = torch.where((top_k_index < experts)[..., None], y, 0)
        return torch.bmm(top_k_weights.to(y.dtype).unsqueeze(1), y).squeeze(1)

    def extra_repr(self) -> str:
        return f"fused={type(self._fused).__name__}, names={tuple(self.names.values())}"


def _default_gate(fused: nn.Module) -> bool:
    """Whether the fused module gates with Transformers' default act_fn(gate) * up (not a model's own)."""
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return False
    return getattr(type(fused), "_apply_gate", None) is _default_apply_gate


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, device) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
    layer.weight = nn.Parameter(_own(weight, device), requires_grad=weight.requires_grad)
    if bias is not None:
        layer.bias = nn.Parameter(_own(bias, device), requires_grad=bias.requires_grad)
    return layer


def _own(t: torch.Tensor, device) -> torch.Tensor:
    """A contiguous copy with storage of its own: a view into the fused tensor would keep all of it alive, and
    safetensors refuses to save tensors that share memory."""
    out = t.detach().to(device).contiguous()
    return out.clone() if out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() else out


def unfuse_experts(model: nn.Module, skip=None, model_type: str | None = None) -> list[str]:
    """Replace every fused experts module of `model` (but those whose name `skip(name)` is true) by
    `UnfusedExperts`: weights moved, the fused 3-D tensors freed. Returns the replaced modules' names. Works on meta
    models too (checkpoint loading). `model_type` (default: `model.config`'s) names the per-expert linears."""
    if model_type is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
    names = expert_linear_names(model_type)
    replaced = []
    for name, module in list(model.named_modules()):
        if not is_fused_experts(module) or (skip is not None and skip(name)):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, UnfusedExperts(module, names))
        replaced.append(name)
    if replaced:
        logger.info("%d fused experts modules split into per-expert linears (%s / %s / %s)", len(replaced), *names)
    return replaced
