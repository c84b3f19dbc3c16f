"""PEFT integration: LoRA (and DoRA) adapters on hf_fastpath's 4-bit `W4A16Linear` layers.

After `import hf_fastpath` (which calls `register()`), the usual PEFT code works on a W4A16 model unchanged:

    model = AutoModelForCausalLM.from_pretrained(gptq_dir, attn_implementation="fastpath")   # or W4A16Config(...)
    model = hf_fastpath.prepare_model_for_qlora(model)           # checkpointing, input grads, fp32 norms
    model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    ...train...; model.save_pretrained(out)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(gptq_dir), out)

What `register()` changes in PEFT (idempotent, nothing else is touched):
- every `LoraConfig` (built by the user or read back by `PeftModel.from_pretrained`) maps `W4A16Linear` to
  `W4A16LoraLinear` through PEFT's custom-module API (`LoraConfig._register_custom_module`); a mapping the user
  registers for `W4A16Linear` wins;
- `target_modules="all-linear"` also selects `W4A16Linear` layers (PEFT only looks for nn.Linear / Conv1D); the
  output embedding stays excluded, as PEFT does for nn.Linear.

The LoRA path: y = W4A16Linear(x) + scaling * B(A(dropout(x))). The base layer runs the Triton W4A16 kernel forward
and its input-gradient kernel backward (dx = dy @ W^T from the packed weight), so no dequantized weight is ever kept
between forward and backward. Its input is cast to the layer's compute dtype (fp16/bf16), so fp32 activations (e.g.
from PEFT's `prepare_model_for_kbit_training`, which up-casts AWQ models) still reach the kernel. The adapter product
runs in that compute dtype too, accumulated onto the base output in one GEMM (`_add_lora`); the adapter weights and
their gradients keep PEFT's dtype (fp32).

DoRA (`use_dora=True`) is supported without dequantizing per step: the row norms ||W + s·B·A|| come from
||W||² (computed once per layer), the 4-bit matmul A @ W (r rows through the same kernel) and B·(A·Aᵀ)·Bᵀ.

Merging into 4-bit weights is refused (`merge`, `merge_and_unload`): W + s·B·A is off the 4-bit grid, and
re-quantizing would erase most of the adapter. `merge_and_dequantize(model)` instead returns the model with
nn.Linear layers holding the dequantized weight plus the adapter (re-quantize it with `W4A16Config` if needed).
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

import torch
from torch import nn

from peft.tuners.lora import LoraLayer
from peft.tuners.lora.layer import LoraVariant

from ..quantization.linear import W4A16Linear

logger = logging.getLogger(__name__)

__all__ = ["W4A16LoraLinear", "register", "merge_and_dequantize"]

MERGE_REFUSED = (
    "Merging a LoRA adapter into 4-bit W4A16 weights is refused: W + scaling*B@A is not on the 4-bit grid, and "
    "re-quantizing it would erase most of the adapter. Keep the adapter separate (save it with save_pretrained, load it "
    "with PeftModel.from_pretrained onto the 4-bit model), or call "
    "hf_fastpath.integrations.peft.merge_and_dequantize(model) for a float model with the adapter merged in (and "
    "re-quantize that with hf_fastpath.W4A16Config if you need 4 bits again)."
)


# ---------------------------------------------------------------------------------------------------------------------
# DoRA on a 4-bit base


def _base_matmul(base: W4A16Linear, x: torch.Tensor) -> torch.Tensor:
    """x @ W for the layer's weight (no bias), in the layer's compute dtype."""
    y = base(x.to(base.weight.dtype))
    if base.bias is not None:
        y = y - base.bias.to(y.dtype)
    return y


@torch.no_grad()
def _dora_row_norm(module, adapter_name: str, base_norm_sq: torch.Tensor) -> torch.Tensor:
    """||W[n] + s·(B·A)[n]|| for every output row n, in fp32, from ||W||², A @ W and A·Aᵀ (no dequantized W)."""
    base = module.get_base_layer()
    a = module.lora_A[adapter_name].weight.float()  # [r, K]
    b = module.lora_B[adapter_name].weight.float()  # [N, r]
    s = module.scaling[adapter_name]
    aw = _base_matmul(base, a).float()  # [r, N] = A @ W_kn, i.e. (W · Aᵀ)ᵀ
    cross = (b * aw.t()).sum(1)  # <W[n], (B·A)[n]>
    lora_sq = ((b @ (a @ a.t())) * b).sum(1)  # ||(B·A)[n]||²
    return (base_norm_sq.float() + 2 * s * cross + s * s * lora_sq).clamp_min(0).sqrt()


class _DoraMagnitude(nn.Module):
    """Holds the DoRA magnitude as `weight` (PEFT's checkpoint key `lora_magnitude_vector.<adapter>.weight`).

    The base layer's squared row norms stay a plain fp32 tensor (not a buffer: not saved, never cast to bf16 by
    `model.to(dtype)`); they follow the magnitude's device on use."""

    def __init__(self, magnitude: torch.Tensor, base_norm_sq: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(magnitude, requires_grad=True)
        self._base_norm_sq = base_norm_sq.float()

    def base_norm_sq(self) -> torch.Tensor:
        if self._base_norm_sq.device != self.weight.device:
            self._base_norm_sq = self._base_norm_sq.to(self.weight.device)
        return self._base_norm_sq


class W4A16DoraVariant(LoraVariant):
    """DoRA for `W4A16LoraLinear`: out = m / ||W + s·B·A|| * (x·W + s·B·A·x) + bias (the norm detached, as in
    the DoRA paper and PEFT)."""

    @staticmethod
    def init(module, adapter_name: str, **kwargs: Any) -> None:
        if "lora_magnitude_vector" not in module.adapter_layer_names:
            module.adapter_layer_names = module.adapter_layer_names[:] + ("lora_magnitude_vector",)
        base = module.get_base_layer()
        base_norm_sq = base.dequantize(torch.float32).pow(2).sum(1)  # once per layer
        magnitude = _dora_row_norm(module, adapter_name, base_norm_sq)
        dtype = module.lora_A[adapter_name].weight.dtype
        module.lora_magnitude_vector[adapter_name] = _DoraMagnitude(magnitude.to(dtype), base_norm_sq)

    @staticmethod
    def merge_safe(module, active_adapter, orig_weight):
        raise NotImplementedError(MERGE_REFUSED)

    @staticmethod
    def merge_unsafe(module, active_adapter, orig_weight):
        raise NotImplementedError(MERGE_REFUSED)

    @staticmethod
    def unmerge(module, active_adapter, orig_weight):
        raise NotImplementedError(MERGE_REFUSED)

    @staticmethod
    def forward(module, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs) -> torch.Tensor:
        lora_A = module.lora_A[active_adapter]
        lora_B = module.lora_B[active_adapter]
        dropout = module.lora_dropout[active_adapter]
        scaling = module.scaling[active_adapter]
        holder = module.lora_magnitude_vector[active_adapter]
        base = module.get_base_layer()
        norm = _dora_row_norm(module, active_adapter, holder.base_norm_sq())
        scale = (holder.weight.float() / norm).to(x.dtype)
        if isinstance(dropout, nn.Identity) or not module.training:
            base_out = result if base.bias is None else result - base.bias.to(result.dtype)
        else:
            x = dropout(x)
            base_out = _base_matmul(base, x)
        lora_out = lora_B(lora_A(x)) * scaling
        return result + (scale - 1) * base_out.to(x.dtype) + scale * lora_out



# ---------------------------------------------------------------------------------------------------------------------
# the LoRA layer


def _add_lora(result: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dropout: nn.Module,
              scaling: float) -> torch.Tensor:
    """result + scaling * dropout(x) @ a.T @ b.T, in result's dtype (the activations' 16-bit dtype in training).

    PEFT's own arithmetic runs in the adapter dtype (fp32 by default): it casts x to fp32, writes the [M, N] LoRA
    output in fp32, scales it, adds it (promoting the sum to fp32) and casts back — about 28 bytes of memory traffic
    per output element, as much as the 4-bit matmul itself at training sizes. Here the adapter weights are cast
    instead (r x (K + N) values), `scaling` multiplies the [M, r] rank-r product, and the B product accumulates onto
    `result` inside one GEMM (addmm): ~8 bytes per output element. The adapter weights and their gradients stay in
    their own dtype (fp32): the same arithmetic as training under bf16 autocast. (Not in place: the base output can be
    a view made inside the W4A16 autograd function, which autograd forbids modifying in place.)
    """
    dtype = result.dtype
    x = dropout(x if x.dtype == dtype else x.to(dtype))
    h = nn.functional.linear(x, a.to(dtype)) * scaling  # [..., r]
    out_features = result.shape[-1]
    out = torch.addmm(result.reshape(-1, out_features), h.reshape(-1, h.shape[-1]), b.to(dtype).t())
    return out.view(result.shape)


class W4A16LoraLinear(nn.Module, LoraLayer):
    """LoRA adapters around a frozen `W4A16Linear` (see the module docstring)."""

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, r: int = 0, lora_alpha: int = 1,
                 **kwargs):
        super().__init__()
        LoraLayer.__init__(self, base_layer, ephemeral_gpu_offload=kwargs.get("ephemeral_gpu_offload", False))
        self.fan_in_fan_out = False
        self._active_adapter = adapter_name
        kwargs = {k: v for k, v in kwargs.items() if k == "target_name"}
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    def _get_in_out_features(self, module: nn.Module):
        return module.in_features, module.out_features

    def resolve_lora_variant(self, *, config, **kwargs):
        unsupported = [name for name in ("use_qalora", "use_alora", "use_bdlora", "use_gralora")
                       if getattr(config, name, None)]
        if getattr(config, "velora_config", None) is not None:
            unsupported.append("velora_config")
        if unsupported:
            raise ValueError(f"LoRA on W4A16Linear supports plain LoRA and DoRA (use_dora=True), not "
                             f"{', '.join(unsupported)}; set {'/'.join(unsupported)} off in the LoraConfig")
        return W4A16DoraVariant() if config.use_dora else None

    def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs):
        init = config.init_lora_weights
        if isinstance(init, str) and init.lower() not in ("gaussian",):
            raise ValueError(
                f"init_lora_weights={init!r} needs the float base weight, which a W4A16Linear does not hold; use "
                "init_lora_weights=True or 'gaussian' (or initialise on the float model and quantize afterwards)"
            )
        super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    # -------------------------------------------------------------------------------------------- merging

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        raise NotImplementedError(MERGE_REFUSED)

    def unmerge(self) -> None:
        if self.merged_adapters:
            raise NotImplementedError(MERGE_REFUSED)

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """scaling · B @ A, `[out_features, in_features]`, fp32 (plain LoRA; DoRA see `merge_and_dequantize`)."""
        a = self.lora_A[adapter].weight.float()
        b = self.lora_B[adapter].weight.float()
        return (b @ a) * self.scaling[adapter]

    # -------------------------------------------------------------------------------------------- forward

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        if kwargs.pop("adapter_names", None) is not None:
            raise ValueError("mixed-adapter batches (adapter_names=...) are not supported on W4A16Linear")
        base = self.get_base_layer()
        compute_dtype = base.weight.dtype
        result = base(x if x.dtype == compute_dtype else x.to(compute_dtype))
        if self.disable_adapters:
            return result
        result_dtype = result.dtype
        for adapter in self.active_adapters:
            if adapter not in self.lora_A:
                continue
            lora_A, lora_B = self.lora_A[adapter], self.lora_B[adapter]
            dropout, scaling = self.lora_dropout[adapter], self.scaling[adapter]
            if adapter in self.lora_variant:
                x_lora = self._cast_input_dtype(x, lora_A.weight.dtype)
                result = self.lora_variant[adapter].forward(self, active_adapter=adapter, x=x_lora, result=result)
            elif lora_B.bias is None and isinstance(lora_A, nn.Linear) and isinstance(lora_B, nn.Linear):
                result = _add_lora(result, x, lora_A.weight, lora_B.weight, dropout, scaling)
            else:  # lora_bias=True: PEFT's arithmetic
                x_lora = self._cast_input_dtype(x, lora_A.weight.dtype)
                result = result + lora_B(lora_A(dropout(x_lora))) * scaling
        return result.to(result_dtype)

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


# ---------------------------------------------------------------------------------------------------------------------
# merging (to float)


@torch.no_grad()
def merge_and_dequantize(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every LoRA-wrapped `W4A16Linear` by an `nn.Linear` holding dequantize(W) merged with the active
    adapters (LoRA or DoRA); other LoRA layers are merged by PEFT. Returns the unwrapped base model
    (like PEFT's `merge_and_unload`). `dtype`: dtype of the new layers (default: the layer's compute dtype)."""
    base_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    targets = [(name, m) for name, m in base_model.named_modules() if isinstance(m, W4A16LoraLinear)]
    for name, module in targets:
        base = module.get_base_layer()
        weight = base.dequantize(torch.float32)
        for adapter in module.active_adapters:
            if adapter not in module.lora_A:
                continue
            delta = module.get_delta_weight(adapter)
            if adapter in module.lora_variant:  # DoRA: m / ||W + ΔW|| * (W + ΔW)
                merged = weight + delta
                magnitude = module.lora_magnitude_vector[adapter].weight.float()
                weight = merged * (magnitude / merged.norm(dim=1)).unsqueeze(1)
            else:
                weight = weight + delta
        out_dtype = dtype or base.weight.dtype
        linear = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None,
                           device=weight.device, dtype=out_dtype)
        linear.weight.copy_(weight)
        if base.bias is not None:
            linear.bias.copy_(base.bias)
        linear.requires_grad_(False)
        parent_name, _, child = name.rpartition(".")
        setattr(base_model.get_submodule(parent_name) if parent_name else base_model, child, linear)
    if hasattr(model, "merge_and_unload") and any(True for _ in _lora_layers(base_model)):
        return model.merge_and_unload()
    if hasattr(model, "unload"):
        return model.unload()
    return base_model


def _lora_layers(model: nn.Module):
    return (m for m in model.modules() if isinstance(m, LoraLayer))


# ---------------------------------------------------------------------------------------------------------------------
# registration


def _register_custom_module(config) -> None:
    custom = getattr(config, "_custom_modules", None) or {}
    if W4A16Linear not in custom:
        config._register_custom_module({W4A16Linear: W4A16LoraLinear})


def _wrap_post_init(original):
    def __post_init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _register_custom_module(self)

    __post_init__._hf_fastpath_original = original
    return __post_init__


def _output_embedding_names(model: nn.Module) -> set[str]:
    get = getattr(model, "get_output_embeddings", None)
    output = get() if callable(get) else None
    return {name for name, m in model.named_modules() if output is not None and m is output}


def _wrap_all_linear(original):
    def _maybe_include_all_linear_layers(peft_config, model):
        target = getattr(peft_config, "target_modules", None)
        wants_all = isinstance(target, str) and target.lower() == "all-linear"
        peft_config = original(peft_config, model)
        if wants_all:
            from peft.tuners.tuners_utils import BaseTunerLayer

            inside_adapters = {f"{prefix}.{suffix}" for prefix, m in model.named_modules()
                               if isinstance(m, BaseTunerLayer) for suffix, _ in m.named_modules() if suffix}
            excluded = _output_embedding_names(model) | inside_adapters
            extra = {name for name, m in model.named_modules() if isinstance(m, W4A16Linear)} - excluded
            if extra:
                peft_config.target_modules = set(peft_config.target_modules or ()) | extra
        return peft_config

    _maybe_include_all_linear_layers._hf_fastpath_original = original
    return _maybe_include_all_linear_layers


def _unless_experts_unfused(original, passthrough: str | None):
    """PEFT maps adapters between Transformers 4's per-expert MoE linears and Transformers 5's fused experts
    (targets `w1` become the parameter `gate_up_proj`, adapter keys are merged). A model whose experts
    `quantize_model` or a per-expert checkpoint unfused (`UnfusedExperts`) has the per-expert linears again: the
    mapping would drop them from the targets, so it is skipped there (returning `passthrough`'s argument)."""
    import inspect

    signature = inspect.signature(original)

    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        model = bound.arguments.get("model")
        if model is not None and any(getattr(m, "routes_tokens", False) for m in model.modules()):
            return None if passthrough is None else bound.arguments[passthrough]
        return original(*args, **kwargs)

    wrapper._hf_fastpath_original = original
    return wrapper


def _hook_moe_conversion() -> None:
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:  # a PEFT without Transformers-5 conversions
        return
    for name, passthrough in (("convert_peft_config_for_transformers", None),
                              ("convert_peft_adapter_state_dict_for_transformers", "adapter_state_dict")):
        current = getattr(conversion, name, None)
        if current is not None and not hasattr(current, "_hf_fastpath_original"):
            setattr(conversion, name, _unless_experts_unfused(current, passthrough))


def register() -> None:
    """Teach PEFT about `W4A16Linear` (idempotent; a no-op with a debug message when PEFT is not installed)."""
    try:
        from peft import LoraConfig
        from peft.tuners import tuners_utils
    except ImportError:
        logger.debug("peft is not installed: LoRA on W4A16Linear is not registered")
        return
    if not hasattr(LoraConfig.__post_init__, "_hf_fastpath_original"):
        LoraConfig.__post_init__ = _wrap_post_init(LoraConfig.__post_init__)
    _hook_moe_conversion()

    original = tuners_utils._maybe_include_all_linear_layers
    original = getattr(original, "_hf_fastpath_original", original)
    wrapped = None
    try:  # Transformers' own adapter loading resolves "all-linear" through this module too
        import peft.utils.transformers_weight_conversion  # noqa: F401
    except ImportError:
        pass
    for name, module in list(sys.modules.items()):
        if not name.startswith("peft") or module is None:
            continue
        current = getattr(module, "_maybe_include_all_linear_layers", None)
        if current is original:
            wrapped = wrapped or _wrap_all_linear(original)
            module._maybe_include_all_linear_layers = wrapped
    if wrapped is None and not hasattr(tuners_utils._maybe_include_all_linear_layers, "_hf_fastpath_original"):
        warnings.warn("hf_fastpath could not hook PEFT's 'all-linear' resolution: name W4A16Linear layers in "
                      "target_modules explicitly", stacklevel=2)
