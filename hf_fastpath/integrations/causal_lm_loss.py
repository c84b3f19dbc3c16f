"""A Transformers causal LM's training loss without the full [tokens, vocab] logits: `use_chunked_loss(model)`.

    model = hf_fastpath.prepare_model_for_qlora(model)
    model = get_peft_model(model, LoraConfig(...))
    hf_fastpath.use_chunked_loss(model)              # the PeftModel or the Transformers model; returns it
    loss = model(input_ids=ids, labels=ids).loss     # Trainer, accelerate loops: unchanged

What changes, and only in training mode (`model.training`) when `labels` are passed: the LM head is not applied to
the whole sequence; the loss comes from `hf_fastpath.losses.chunked_linear_cross_entropy` on the last hidden states
and the head's weight (and bias), chunk by chunk, with the gradients of the hidden states (and of the head when it is
trainable). The output's `loss` is the same as Transformers' `ForCausalLMLoss` computes (labels shifted by one,
-100 ignored, fp32 softmax, mean over the targets, or sum / `num_items_in_batch` under gradient accumulation;
`shift_labels` taken as given, so packed sequences with -100 at the document boundaries work as in Transformers);
its `logits` is None (they are never computed: that is the point). With `return_dict=False` the tuple is
`(loss, ...)` without logits, as Transformers drops None fields. Without labels, or in eval mode (`model.eval()`,
e.g. Trainer's evaluation with `compute_metrics`), the model runs exactly as before and returns logits.

How: the model instance's `forward` is replaced by a method wrapping the original (its signature kept, so Trainer
still passes `num_items_in_batch` and keeps the dataset columns; a deep copy of the model stays patched and correct).
With labels in training mode, the wrapper calls the original forward with `labels=None` while the head module's
forward returns its input, so the "logits" it computes are the (sliced) last hidden states; the loss is computed
from them. Every supported model's forward does `logits = head(hidden_states)`, at most soft-caps them (Gemma-2:
the row's `final_logit_softcap`; we switch it off for the call and apply it in the loss), and then the loss, plus,
for a mixture of experts with `output_router_logits`, `router_aux_loss_coef` times the router loss it returns as
`aux_loss` (added here the same way) — that is what a `causal_lm` in `models.MODELS` asserts (check a new model's
forward before adding it).

Limits (each raises or is documented): the head must be a plain `nn.Linear` (not wrapped by PEFT: no LoRA or
`modules_to_save` on `lm_head`) and unsharded (FSDP's sharded parameters of the head are not gathered outside its
forward); `loss_function` must be Transformers' `ForCausalLMLoss` (a custom loss would be silently bypassed); a second
backward through the same loss (`retain_graph=True`) is refused, since the gradients are computed in the forward.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import types

import torch.nn.functional as F
from torch import nn

from ..losses import chunked_linear_cross_entropy
from .models import MODELS, facts_for

logger = logging.getLogger(__name__)

__all__ = ["use_chunked_loss", "CHUNKED_LOSS_MODELS"]

# model_type -> the causal-LM class whose forward was checked (Transformers 5.17 and 5.24) to compute
# `logits = <output embeddings>(hidden_states)` and then `self.loss_function(logits, labels, ...)`, nothing else (but a
# final soft-cap). Other heads of the same model type (GPT2DoubleHeadsModel, ...) have their own losses: refused.
CHUNKED_LOSS_MODELS = {model_type: row.causal_lm for model_type, row in MODELS.items() if row.causal_lm}

_MARK = "_hf_fastpath_chunked_loss"  # on the patched forward: the original (unbound) forward function
_CHUNK_ROWS = "_hf_fastpath_chunk_rows"  # on the model


def _transformers_model(model: nn.Module) -> nn.Module:
    """The Transformers model inside a PeftModel (or the model itself)."""
    if hasattr(model, "get_base_model") and callable(model.get_base_model):
        model = model.get_base_model()
    return model


def _check_supported(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in CHUNKED_LOSS_MODELS:
        raise ValueError(
            f"use_chunked_loss: model type {model_type!r} ({type(model).__name__}) is not supported; supported: "
            f"{', '.join(sorted(CHUNKED_LOSS_MODELS))}. Train it without use_chunked_loss (the plain Transformers "
            "loss), or give the model type a causal_lm in hf_fastpath.integrations.models.MODELS after checking "
            "that its forward applies the LM head and then self.loss_function with nothing in between.")
    expected = CHUNKED_LOSS_MODELS[model_type]
    if expected not in (cls.__name__ for cls in type(model).__mro__):
        raise ValueError(f"use_chunked_loss: {type(model).__name__} is not a {expected} (the causal-LM class of "
                         f"model type {model_type!r}); other heads compute other losses")
    loss_function = getattr(model, "loss_function", None)
    if getattr(loss_function, "__name__", None) != "ForCausalLMLoss":
        raise ValueError(f"use_chunked_loss: {type(model).__name__}.loss_function is {loss_function!r}, not "
                         "Transformers' ForCausalLMLoss; the chunked loss would silently replace it")
    _head(model)


def _head(model: nn.Module) -> nn.Linear:
    head = model.get_output_embeddings()
    if type(head).forward is not nn.Linear.forward or getattr(head, "weight", None) is None:
        raise ValueError(
            f"use_chunked_loss: the output layer of {type(model).__name__} is a {type(head).__name__}, not a plain "
            "nn.Linear (is lm_head adapted by PEFT, e.g. LoRA target_modules or modules_to_save containing lm_head, "
            "or quantized?). The chunked loss reads the head's weight directly; keep lm_head a plain nn.Linear "
            "(trainable or frozen), or train without use_chunked_loss.")
    if type(head.weight).__name__ == "DTensor":
        raise ValueError("use_chunked_loss: the LM head's weight is sharded (a DTensor: FSDP2 or tensor parallelism); "
                         "the chunked loss needs the whole [vocab, hidden] weight. Leave lm_head out of the sharding "
                         "(or shard the whole model as one unit), or train without use_chunked_loss.")
    return head


@contextlib.contextmanager
def _head_returns_its_input(head: nn.Module):
    """For the duration, head(x) is x (its hooks still run). An instance-level `forward` someone else set (e.g.
    Accelerate's hooks) is restored afterwards."""
    saved = head.__dict__.get("forward")
    head.forward = lambda hidden_states, *args, **kwargs: hidden_states
    try:
        yield
    finally:
        if saved is None:
            del head.forward
        else:
            head.forward = saved


@contextlib.contextmanager
def _no_final_softcap(model: nn.Module):
    """For the duration, the model does not soft-cap its "logits" (here: the hidden states); yields the cap (None if
    the model has none), which the loss then applies to the real logits."""
    attr = facts_for(model).final_logit_softcap
    cap = getattr(model.config, attr, None) if attr else None
    if cap is None:
        yield None
        return
    setattr(model.config, attr, None)
    try:
        yield float(cap)
    finally:
        setattr(model.config, attr, cap)


def _split_output(output):
    """(the "logits" the head let through, a mixture of experts' router loss or None) of the original forward's
    output. A tuple (return_dict=False) drops the None loss: `(logits, ...)`, or `(aux_loss, logits, ...)`."""
    if isinstance(output, tuple):
        return (output[1], output[0]) if output[0].dim() == 0 else (output[0], None)
    return output.logits, getattr(output, "aux_loss", None)


def _without_logits(output, loss):
    if isinstance(output, tuple):  # the reference's tuple, (loss, [aux_loss,] logits, ...), without the logits
        return (loss, output[0], *output[2:]) if output[0].dim() == 0 else (loss, *output[1:])
    fields = {key: value for key, value in output.items() if key not in ("loss", "logits")}
    return type(output)(loss=loss, **fields)


def _wrap_forward(original_func):
    """A forward function for `types.MethodType(..., model)`: the original (unbound) forward with the chunked loss.

    It closes over nothing of the model (chunk_rows is read from the model): a deep copy of the model rebinds the
    method to the copy and keeps working."""
    signature = inspect.signature(original_func)  # (self, input_ids, ..., **kwargs)
    var_kwargs = next((p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD),
                      None)

    @functools.wraps(original_func)  # inspect.signature follows __wrapped__: Trainer sees the model's parameters
    def forward(self, *args, **kwargs):
        if not self.training:
            return original_func(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        labels = bound.arguments.get("labels")
        if labels is None:
            return original_func(self, *args, **kwargs)
        # Loss-only keyword arguments (ForCausalLMLoss's); the base model never reads them.
        extra = bound.arguments.get(var_kwargs, {}) if var_kwargs else {}
        shift_labels = extra.pop("shift_labels", None)
        num_items_in_batch = extra.pop("num_items_in_batch", None)
        ignore_index = extra.pop("ignore_index", -100)
        bound.arguments["labels"] = None
        head = _head(self)
        with _head_returns_its_input(head), _no_final_softcap(self) as softcap:
            output = original_func(*bound.args, **bound.kwargs)
        hidden, router_loss = _split_output(output)
        if shift_labels is None:  # as ForCausalLMLoss: tokens < n predict n; the last position has no target
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        loss = chunked_linear_cross_entropy(
            hidden, head.weight, shift_labels.to(hidden.device), head.bias, ignore_index=ignore_index,
            num_items_in_batch=num_items_in_batch, softcap=softcap, chunk_rows=getattr(self, _CHUNK_ROWS, None))
        if router_loss is not None:  # output_router_logits: added as the model adds it when it has labels
            loss = loss + self.router_aux_loss_coef * router_loss.to(loss.device)
        return _without_logits(output, loss)

    forward.__dict__[_MARK] = original_func
    return forward


def use_chunked_loss(model: nn.Module, *, chunk_rows: int | None = None, enabled: bool = True) -> nn.Module:
    """Make `model` (a supported Transformers causal LM, or a PeftModel around one) compute its training loss with
    `chunked_linear_cross_entropy`: same loss and gradients, no [tokens, vocab] logits in memory. Returns `model`.

    Call it before wrapping the model in DDP / `accelerator.prepare` (before or after `get_peft_model`; it patches
    the Transformers model inside). `chunk_rows`: tokens per chunk (default: ~1 GiB of fp32 logits, 2048 tokens at
    Llama-3's vocabulary). `enabled=False` restores the original forward. Calling it again only updates
    `chunk_rows`. See the module docstring for what changes (training mode with labels only; `logits` is None)."""
    target = _transformers_model(model)
    original_func = getattr(target.forward, _MARK, None)
    if not enabled:
        if original_func is not None:
            if original_func is type(target).forward:
                del target.forward  # the instance attribute goes: the class's forward is back
            else:
                target.forward = types.MethodType(original_func, target)  # an instance-level forward from before
        return model
    _check_supported(target)
    if original_func is None:
        original = target.forward
        if getattr(original, "__self__", None) is not target:
            raise ValueError(
                f"use_chunked_loss: {type(target).__name__}.forward was replaced by {original!r}, not a method of the "
                "model (an Accelerate hook or another wrapper?). Call use_chunked_loss before accelerator.prepare / "
                "dispatching the model.")
        original_func = original.__func__
    setattr(target, _CHUNK_ROWS, chunk_rows)
    target.forward = types.MethodType(_wrap_forward(original_func), target)
    logger.info("%s: training loss through hf_fastpath's chunked linear + cross-entropy (chunk_rows=%s)",
                type(target).__name__, chunk_rows or "auto")
    return model
