"""Preparing a W4A16 model for QLoRA training: `prepare_model_for_qlora(model)`.

It plays the part of PEFT's `prepare_model_for_kbit_training`, which knows only some quantization methods and, for
any other (AWQ, or a model quantized in memory), casts every fp16/bf16 parameter — embeddings and LM head included —
to fp32. Here:
- every parameter is frozen (LoRA adds the trainable ones afterwards);
- the packed weights, scales and zero points (buffers) and the activations stay in the compute dtype;
- normalisation layers compute in fp32: their weights become fp32 and their input is up-cast, their output is cast
  back to the input's dtype, so the next 4-bit layer still gets fp16/bf16 activations (its Triton kernel) and plain
  nn.Linear layers (the LM head) still see their own dtype;
- gradient checkpointing is on (non-reentrant by default) with input gradients enabled, and the KV cache is off.

`ignore_quantized_buffers_in_ddp(model)` keeps DistributedDataParallel from broadcasting the (frozen, identical)
4-bit buffers from rank 0 at every forward (DDP's `broadcast_buffers=True` default).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .awq import ScaledActivation
from .linear import W4A16Linear

logger = logging.getLogger(__name__)

__all__ = ["prepare_model_for_qlora", "ignore_quantized_buffers_in_ddp", "is_norm_layer"]

_NORM_MARK = "_hf_fastpath_fp32_norm"


def is_norm_layer(module: nn.Module) -> bool:
    """LayerNorm / RMSNorm / GroupNorm and the models' own *Norm classes (LlamaRMSNorm, ...)."""
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or type(module).__name__ == "RMSNorm":
        return True
    name = type(module).__name__
    return name.endswith(("LayerNorm", "RMSNorm", "Norm")) and not list(module.children())


def _to_fp32_input(module, args, kwargs):
    if args and torch.is_tensor(args[0]) and args[0].is_floating_point():
        module._hf_fastpath_input_dtype = args[0].dtype
        if args[0].dtype != torch.float32:
            args = (args[0].float(), *args[1:])
    return args, kwargs


def _to_input_dtype(module, args, output):
    dtype = getattr(module, "_hf_fastpath_input_dtype", None)
    if dtype is not None and torch.is_tensor(output) and output.dtype != dtype:
        return output.to(dtype)
    return output


def _fp32_norms(model: nn.Module) -> int:
    count = 0
    for module in model.modules():
        if not is_norm_layer(module) or getattr(module, _NORM_MARK, False):
            continue
        for param in module.parameters(recurse=False):
            if param.dtype in (torch.float16, torch.bfloat16):
                param.data = param.data.float()
        module.register_forward_pre_hook(_to_fp32_input, with_kwargs=True)
        module.register_forward_hook(_to_input_dtype)
        setattr(module, _NORM_MARK, True)
        count += 1
    return count


def prepare_model_for_qlora(model: nn.Module, gradient_checkpointing: bool = True,
                            gradient_checkpointing_kwargs: dict | None = None, norms_in_fp32: bool = True) -> nn.Module:
    """Get a (4-bit) Transformers model ready for LoRA training; returns the same model (modified in place).

    Call it before `get_peft_model`. `gradient_checkpointing_kwargs` default to `{"use_reentrant": False}`.
    Works on any model: float layers stay as they are (frozen).
    """
    for param in model.parameters():
        param.requires_grad_(False)
    quantized = sum(isinstance(m, W4A16Linear) for m in model.modules())
    if quantized == 0:
        logger.warning("prepare_model_for_qlora: the model has no W4A16Linear layer (is it quantized?)")
    if norms_in_fp32:
        _fp32_norms(model)
    if gradient_checkpointing:
        kwargs = {"use_reentrant": False, **(gradient_checkpointing_kwargs or {})}
        if hasattr(model, "activation_checkpointing_enable"):  # Transformers >= 5.2x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        elif hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        else:
            raise TypeError(f"{type(model).__name__} cannot enable gradient checkpointing: pass a Transformers "
                            "model, or gradient_checkpointing=False")
        # Reentrant checkpointing drops gradients unless some input requires grad; harmless otherwise.
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
        config = getattr(model, "config", None)
        if config is not None and getattr(config, "use_cache", False):
            config.use_cache = False  # the cache is useless in training and conflicts with checkpointing
    return model


def ignore_quantized_buffers_in_ddp(model: nn.Module) -> list[str]:
    """Tell DDP to leave the 4-bit layers' buffers (and AWQ activation scales) alone: they are frozen and equal on
    every rank, and DDP's default `broadcast_buffers=True` would otherwise copy them from rank 0 at every forward.

    Call it on the module you hand to DDP / `accelerator.prepare` (e.g. the PeftModel). Returns the ignored names."""
    names = []
    for module_name, module in model.named_modules():
        if isinstance(module, (W4A16Linear, ScaledActivation)):
            prefix = f"{module_name}." if module_name else ""
            names.extend(prefix + name for name, buf in module.named_buffers(recurse=False) if buf is not None)
    existing = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []) or [])
    model._ddp_params_and_buffers_to_ignore = sorted(set(existing) | set(names))
    return names
