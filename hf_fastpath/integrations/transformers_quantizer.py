"""Transformers integration of W4A16: GPTQ / AWQ checkpoints load onto `W4A16Linear`, and `W4A16Config` quantizes.

After `import hf_fastpath` (which calls `register()`):
- a checkpoint whose config.json says `quant_method: "gptq"` (formats "gptq" v1 and "gptq_v2"; 2/3/4/8 bits; any
  group size; desc_act) or `"awq"` (version "gemm") loads with a plain `from_pretrained(path)`, with no gptqmodel or
  optimum installed. Its tensors land in `W4A16Linear` layers (nn.Linear, GPT-2 Conv1D and FalconLinear are replaced)
  and AWQ's `...mlp.act.scales` in `ScaledActivation`. `save_pretrained` writes the same format back.
- `from_pretrained(path, quantization_config=hf_fastpath.W4A16Config(...))` quantizes a float model after its weights
  load (GPTQ, AWQ or RTN; `hf_fastpath.quantization.calibrate.quantize_model`) and saves as a standard GPTQ/AWQ model.
  Transformers' own `GPTQConfig(bits=4, dataset=..., tokenizer=...)` / `AwqConfig(...)` on a float model do the same
  (translated to a `W4A16Config`), without optimum or gptqmodel.

Choosing gptqmodel instead, where it is installed: set `HF_FASTPATH_GPTQ_BACKEND=gptqmodel` (or `=fastpath` to force
ours), or pass an explicit kernel backend, e.g. `GPTQConfig(bits=4, backend="marlin")` / `AwqConfig(backend="gemm")`:
any backend other than "auto"/"fastpath" goes to Transformers' own GPTQ/AWQ quantizer when gptqmodel is importable
(and falls back to hf_fastpath with a warning when it is not).

How the load works: before the weights load, each quantized layer becomes `W4A16Linear.for_checkpoint(...)` whose
buffers carry the checkpoint's names, shapes and dtypes (which layers: the `*.qweight` keys of the checkpoint files,
else every linear outside `modules_to_not_convert` and the output embedding). Transformers copies the tensors in as
they are (int32 stays int32); afterwards `finish_loading()` checks every shape and dtype (a wrong one raises an error
naming the tensor and the expected shape) and converts to the kernel layout. No load op is involved, so nothing is
cast to the wrong dtype and `save_pretrained` needs no reverse op: the layers' `state_dict()` is the checkpoint format.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re

import torch
from torch import nn
from transformers.quantizers import auto as quantizer_auto
from transformers.quantizers.base import HfQuantizer

from ..quantization.config import QUANT_METHOD, W4A16Config
from ..quantization.awq import ScaledActivation
from ..quantization.linear import W4A16Linear
from .models import MODELS, facts_for
from .moe_experts import is_fused_experts, unfuse_experts

logger = logging.getLogger(__name__)

BACKEND_ENV = "HF_FASTPATH_GPTQ_BACKEND"
_ORIGINAL_QUANTIZERS: dict[str, type] = {}
_OUR_BACKENDS = (None, "", "auto", "fastpath", "hf_fastpath")


# ---------------------------------------------------------------------------------------------------------------------
# which layers, in which format


def _load_format(config) -> tuple[str, int, int]:
    """(format, bits, group_size) of a checkpoint described by a GPTQConfig / AwqConfig / W4A16Config."""
    method = getattr(config.quant_method, "value", config.quant_method)
    if method == QUANT_METHOD:
        return config.saved_format, config.bits, config.group_size
    if method == "awq":
        fmt = str(getattr(getattr(config, "format", "gemm"), "value", getattr(config, "format", "gemm"))).lower()
        if fmt != "gemm":
            raise NotImplementedError(
                f"AWQ checkpoint version {fmt!r} is not supported by hf_fastpath (only 'gemm'); "
                f"install gptqmodel and set {BACKEND_ENV}=gptqmodel to load it"
            )
        return "awq", config.bits, config.group_size
    fmt = (getattr(config, "format", None) or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise NotImplementedError(
            f"GPTQ checkpoint_format {fmt!r} is not supported by hf_fastpath (only 'gptq' and 'gptq_v2'); "
            f"install gptqmodel and set {BACKEND_ENV}=gptqmodel to load it"
        )
    return fmt, config.bits, config.group_size


def _checkpoint_keys(checkpoint_files) -> set[str] | None:
    """Tensor names in the checkpoint's safetensors files (headers only), or None if they cannot be read."""
    if not checkpoint_files:
        return None
    keys: set[str] = set()
    try:
        from safetensors import safe_open

        for path in checkpoint_files:
            if not str(path).endswith(".safetensors"):
                return None
            with safe_open(str(path), framework="pt") as f:
                keys.update(f.keys())
    except Exception as error:  # unreadable header: fall back to the rule-based choice
        logger.debug("could not list checkpoint keys: %s", error)
        return None
    return keys


def _module_name_for(key_prefix: str, module_names: set[str], base_prefix: str) -> str | None:
    """Match a checkpoint key prefix to a module name, with or without the model's base prefix."""
    if key_prefix in module_names:
        return key_prefix
    if base_prefix and key_prefix.startswith(base_prefix + ".") and key_prefix[len(base_prefix) + 1:] in module_names:
        return key_prefix[len(base_prefix) + 1:]
    if base_prefix and f"{base_prefix}.{key_prefix}" in module_names:
        return f"{base_prefix}.{key_prefix}"
    return None


def _check_unmatched(model: nn.Module, unmatched: list[str], modules: dict, base_prefix: str) -> None:
    """Quantized layers of the checkpoint that match no module: an error where they belong to a module that holds
    weights of its own in another layout (fused mixture-of-experts weights are split per expert before this check,
    `_unfuse_quantized_experts`): those weights would stay random. A warning where nothing in the model takes them
    (e.g. an extra prediction layer the model does not build)."""
    names = set(modules)
    for prefix in unmatched:
        parts = prefix.split(".")
        owner = next((name for n in range(len(parts) - 1, 0, -1)
                      if (name := _module_name_for(".".join(parts[:n]), names, base_prefix)) is not None), None)
        if owner is not None and any(True for _ in modules[owner].parameters(recurse=False)):
            raise ValueError(f"quantized layer '{prefix}' of the checkpoint has no linear in "
                             f"{type(model).__name__}: '{owner}' ({type(modules[owner]).__name__}) stores its weights "
                             "another way, so they would stay unloaded (random).")
    if unmatched:
        logger.warning("%d quantized layer(s) of the checkpoint match no module of %s and stay unloaded, e.g. %s",
                       len(unmatched), type(model).__name__, unmatched[:3])


def _renamed_keys(model: nn.Module, keys: set[str]) -> set[str]:
    """Checkpoint keys under the model's module names: Transformers' renamings for this model applied (Mixtral's
    `block_sparse_moe` -> `mlp`), as its loader applies them."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings
    except ImportError:  # a Transformers without conversion mappings loads keys as they are
        return keys
    renamings = [t for t in get_model_conversion_mapping(model, add_legacy=False) if isinstance(t, WeightRenaming)]
    return {apply_renamings(k, renamings) for k in keys} if renamings else keys


def _unfuse_quantized_experts(model: nn.Module, prefixes: list[str], base_prefix: str) -> list[str]:
    """Fused experts modules (3-D weights) whose experts the checkpoint stores as quantized per-expert linears
    (`...experts.<e>.<proj>`, as gptqmodel, AutoAWQ and `quantize_model` save them) become `UnfusedExperts`, whose
    linears the checkpoint then fills."""
    fused = {name for name, m in model.named_modules() if is_fused_experts(m)}
    wanted = {name for p in prefixes if (name := _module_name_for(p.rsplit(".", 2)[0], fused, base_prefix))}
    return unfuse_experts(model, skip=lambda name: name not in wanted) if wanted else []


def _linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of nn.Linear (FalconLinear included) or GPT-2 Conv1D; None for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight.shape[0], module.weight.shape[1]
    return None


def _matches(name: str, patterns) -> bool:
    """`name` is one of `patterns`, or ends with / starts with one at a dot boundary."""
    for pattern in patterns or ():
        if name == pattern or name.endswith("." + pattern) or name.startswith(pattern + "."):
            return True
        if any(ch in pattern for ch in "*[]()") and re.fullmatch(pattern, name):
            return True
    return False


def _skipped_modules(model, config) -> list[str]:
    skip = list(getattr(config, "modules_to_not_convert", None) or [])
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, module in model.named_modules():
        if output is not None and module is output:
            skip.append(name)
    return skip


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def replace_for_checkpoint(model: nn.Module, config, checkpoint_keys: set[str] | None = None) -> list[str]:
    """Swap the checkpoint's quantized linears for `W4A16Linear.for_checkpoint` (and AWQ activations for
    `ScaledActivation`). Returns the replaced module names."""
    fmt, bits, group_size = _load_format(config)
    modules = dict(model.named_modules())
    base_prefix = getattr(model, "base_model_prefix", "")
    if checkpoint_keys is not None:
        checkpoint_keys = _renamed_keys(model, checkpoint_keys)
        prefixes = [k[: -len(".qweight")] for k in checkpoint_keys if k.endswith(".qweight")]
        if _unfuse_quantized_experts(model, prefixes, base_prefix):
            modules = dict(model.named_modules())
        matched = {p: _module_name_for(p, set(modules), base_prefix) for p in prefixes}
        unmatched = sorted(p for p, name in matched.items() if name is None)
        _check_unmatched(model, unmatched, modules, base_prefix)
        names = {name for name in matched.values() if name is not None}
        with_bias = {_module_name_for(k[: -len(".bias")], set(modules), base_prefix)
                     for k in checkpoint_keys if k.endswith(".bias")}
    else:
        skip = _skipped_modules(model, config)
        names = {n for n, m in modules.items() if _linear_shape(m) is not None and not _matches(n, skip)}
        with_bias = set()
    replaced = []
    for name in sorted(names):
        module = modules[name]
        shape = _linear_shape(module)
        if shape is None:
            raise ValueError(f"checkpoint has quantized tensors for '{name}', which is a {type(module).__name__}, "
                             "not a linear layer")
        in_features, out_features = shape
        reference = module.weight
        layer = W4A16Linear.for_checkpoint(
            in_features, out_features, bits=bits, group_size=group_size,
            bias=getattr(module, "bias", None) is not None or name in with_bias,
            checkpoint_format=fmt, dtype=reference.dtype, device=reference.device,
        )
        layer._hf_fastpath_name = name
        _set_module(model, name, layer)
        replaced.append(name)
    if fmt == "awq":
        _wrap_awq_activations(model, checkpoint_keys)
    return replaced


def _wrap_awq_activations(model: nn.Module, checkpoint_keys: set[str] | None) -> None:
    """Wrap the activations that AWQ scales (`<mlp>.act.scales`) in `ScaledActivation`."""
    modules = dict(model.named_modules())
    base_prefix = getattr(model, "base_model_prefix", "")
    targets: list[str] = []
    if checkpoint_keys is not None:
        # a `.scales` tensor without a `.qweight` next to it belongs to an activation
        for key in sorted(checkpoint_keys):
            prefix = key[: -len(".scales")]
            if key.endswith(".scales") and prefix + ".qweight" not in checkpoint_keys:
                name = _module_name_for(prefix, set(modules), base_prefix)
                if name is not None and not isinstance(modules[name], (W4A16Linear, ScaledActivation)):
                    targets.append(name)
    else:
        mapping = facts_for(model).awq_activation
        if mapping:
            act_name, before = mapping
            targets = [f"{name}.{act_name}" if name else act_name for name, module in modules.items()
                       if hasattr(module, act_name) and hasattr(module, before)]
    for name in targets:
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        before = next((getattr(parent, row.awq_activation[1]) for row in MODELS.values()
                       if row.awq_activation and hasattr(parent, row.awq_activation[1])), None)
        features = getattr(before, "out_features", None)
        if features is None:
            raise ValueError(f"cannot size the AWQ activation scales of '{name}': no up projection next to it")
        dtype = before._compute_dtype_hint if isinstance(before, W4A16Linear) else before.weight.dtype
        wrapped = ScaledActivation(modules[name], features, dtype=dtype, device=before.weight.device)
        wrapped._hf_fastpath_staging = True
        _set_module(model, name, wrapped)


def finish_loading(model: nn.Module) -> None:
    """Check and convert every staged layer; fill activation scales the checkpoint did not supply."""
    for module in model.modules():
        if isinstance(module, W4A16Linear):
            module.finish_loading()
        elif isinstance(module, ScaledActivation) and getattr(module, "_hf_fastpath_staging", False):
            if not getattr(module.scales, "_is_hf_initialized", False):
                module.scales.data.fill_(1.0)
            del module._hf_fastpath_staging


def set_checkpoint_format(model: nn.Module, checkpoint_format: str) -> str:
    """Make every `W4A16Linear` save as `checkpoint_format`; GPTQ v1 falls back to "gptq_v2" (with a warning) when
    some zero point is 0, which v1 cannot store. Returns the format used."""
    layers = [m for m in model.modules() if isinstance(m, W4A16Linear)]
    if checkpoint_format == "gptq" and any(bool((m.zeros < 0.5).any()) for m in layers):
        logger.warning("some zero points are 0, which GPTQ v1 cannot store: saving as checkpoint_format='gptq_v2'")
        checkpoint_format = "gptq_v2"
    for layer in layers:
        layer.checkpoint_format = checkpoint_format
    return checkpoint_format


def as_w4a16_config(config) -> W4A16Config:
    """The `W4A16Config` equivalent of a GPTQConfig / AwqConfig passed to quantize a float model."""
    method = getattr(config.quant_method, "value", config.quant_method)
    if method == QUANT_METHOD:
        return config
    if method == "awq":
        return W4A16Config(method="awq", bits=config.bits, group_size=config.group_size,
                           sym=not getattr(config, "zero_point", True),
                           modules_to_not_convert=getattr(config, "modules_to_not_convert", None))
    fmt = (getattr(config, "format", None) or "gptq").lower()
    return W4A16Config(method="gptq", bits=config.bits, group_size=config.group_size, sym=config.sym,
                       desc_act=config.desc_act, dataset=config.dataset, damp_percent=config.damp_percent,
                       true_sequential=config.true_sequential, seq_len=getattr(config, "model_seqlen", None),
                       checkpoint_format=fmt if fmt in ("gptq", "gptq_v2") else "gptq", tokenizer=config.tokenizer)


def attach_quantization_config(model: nn.Module, config: W4A16Config) -> None:
    """After quantizing `model` in place: make `save_pretrained` write a standard GPTQ/AWQ checkpoint
    (the layers' storage format and a plain `gptq`/`awq` quantization_config in config.json)."""
    fmt = set_checkpoint_format(model, config.saved_format)
    standard = config.standard_config(fmt if fmt != "awq" else None, getattr(model, "_hf_fastpath_kept_in_float", ()))
    model.config.quantization_config = standard
    model.quantization_method = standard.quant_method
    model.is_quantized = True


def _fuse_projections_by_default(model: nn.Module) -> None:
    """q/k/v and gate/up as one W4A16 launch each (`hf_fastpath.fuse_projections`); HF_FASTPATH_FUSE_PROJECTIONS=0
    leaves every layer on its own launch."""
    if os.environ.get("HF_FASTPATH_FUSE_PROJECTIONS", "1") != "0":
        from .fused_projections import fuse_projections

        fuse_projections(model)


# ---------------------------------------------------------------------------------------------------------------------
# the quantizer


class W4A16Quantizer(HfQuantizer):
    """Loads GPTQ / AWQ / fastpath_w4a16 checkpoints onto `W4A16Linear`; quantizes float models with `W4A16Config`."""

    requires_calibration = False

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self._checkpoint_keys: set[str] | None = None

    def validate_environment(self, *args, **kwargs):
        if self.pre_quantized:
            _load_format(self.quantization_config)  # unsupported formats fail before any weight is read

    def update_dtype(self, dtype):
        return dtype

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        # Lets our own check (with a clear message) judge the shapes of the raw checkpoint tensors.
        if not self.pre_quantized:
            return False
        module_name, _, tensor_name = param_name.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            return False
        return isinstance(module, W4A16Linear) and module._staging is not None and tensor_name != "bias"

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        if not self.pre_quantized:
            return model
        keys = _checkpoint_keys(checkpoint_files)
        replaced = replace_for_checkpoint(model, self.quantization_config, keys)
        if not replaced:
            logger.warning("no quantized layer found in this checkpoint: nothing was converted to W4A16Linear")
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        if self.pre_quantized:
            finish_loading(model)
            _fuse_projections_by_default(model)
            return model
        config = as_w4a16_config(self.quantization_config)
        from ..quantization import calibrate

        tokenizer = getattr(config, "tokenizer", None)
        if tokenizer is None and getattr(model, "name_or_path", None) and config.method != "rtn":
            tokenizer = model.name_or_path
        calibrate.quantize_model(model, config, tokenizer=tokenizer)
        attach_quantization_config(model, config)
        _fuse_projections_by_default(model)
        return model

    def _dequantize(self, model, dtype=None):
        """`model.dequantize()`: every `W4A16Linear` becomes an nn.Linear holding its dequantized weight."""
        for name, module in list(model.named_modules()):
            if isinstance(module, W4A16Linear):
                target = dtype if isinstance(dtype, torch.dtype) else module.scales.dtype
                linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                   dtype=target, device=module.qweight.device)
                with torch.no_grad():
                    linear.weight.copy_(module.dequantize(target))
                    if module.bias is not None:
                        linear.bias.copy_(module.bias)
                _set_module(model, name, linear)
        return model

    def is_serializable(self, safe_serialization=None):
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_compileable(self) -> bool:
        # the kernels are registered torch ops (hf_fastpath::w4a16_matmul): generate() with a static cache may
        # compile the forward (fullgraph, CUDA graphs)
        return True


def _wants_gptqmodel(config) -> bool:
    choice = os.environ.get(BACKEND_ENV, "").strip().lower()
    if choice in ("fastpath", "hf_fastpath"):
        return False
    if choice == "gptqmodel":
        return True
    if choice:
        raise ValueError(f"{BACKEND_ENV}={choice!r}: use 'fastpath' or 'gptqmodel'")
    backend = getattr(config, "backend", None)
    backend = getattr(backend, "value", backend)
    if backend in _OUR_BACKENDS:
        return False
    if importlib.util.find_spec("gptqmodel") is None:
        logger.warning("backend=%r needs gptqmodel, which is not installed: loading with hf_fastpath instead", backend)
        return False
    return True


class _GPTQOrAWQQuantizer(W4A16Quantizer):
    """Stands in `AUTO_QUANTIZER_MAPPING["gptq"/"awq"]`: hf_fastpath by default, Transformers' own on request."""

    def __new__(cls, quantization_config, **kwargs):
        method = getattr(quantization_config.quant_method, "value", quantization_config.quant_method)
        original = _ORIGINAL_QUANTIZERS.get(method)
        if original is not None and _wants_gptqmodel(quantization_config):
            return original(quantization_config, **kwargs)
        return super().__new__(cls)


def register() -> None:
    """Install the W4A16 quantizer in Transformers (idempotent)."""
    if QUANT_METHOD not in quantizer_auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
        quantizer_auto.register_quantization_config(QUANT_METHOD)(W4A16Config)
    if QUANT_METHOD not in quantizer_auto.AUTO_QUANTIZER_MAPPING:
        quantizer_auto.register_quantizer(QUANT_METHOD)(W4A16Quantizer)
    for method in ("gptq", "awq"):
        current = quantizer_auto.AUTO_QUANTIZER_MAPPING.get(method)
        if current is not _GPTQOrAWQQuantizer:
            if current is not None:
                _ORIGINAL_QUANTIZERS[method] = current
            quantizer_auto.AUTO_QUANTIZER_MAPPING[method] = _GPTQOrAWQQuantizer
