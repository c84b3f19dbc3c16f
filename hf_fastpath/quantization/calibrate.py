"""`quantize_model(model, config, tokenizer)`: GPTQ, AWQ or RTN over a whole Transformers model, block by block.

The model stays where it is (usually the CPU); one decoder block at a time moves to the calibration device (CUDA when
available), so a model larger than GPU memory still calibrates on one GPU. Calibration inputs of block i are the
outputs of block i-1 after it was quantized (GPTQ; AWQ uses the float outputs as its reference does). Inside a block
GPTQ is "true sequential": linears sharing an input (q/k/v, gate/up) are quantized together, in execution order, each
group's Hessian collected with the earlier groups already quantized. With `gptaq`, a float copy of each block runs
beside it on the float model's hidden states, and each linear is fitted to the float copy's output (`gptq.GPTQ`,
GPTAQ). At the end every quantized linear is replaced by a `W4A16Linear`. `config` is a `W4A16Config` (or anything
with the same attributes).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from typing import NamedTuple

import torch
from torch import nn

from .blocks import (BlockInputs, InputGroup, StopForward, _matches, capture_block_inputs, find_decoder_layers,
                     find_linears, input_groups, is_linear, linear_weight, reason_to_keep_in_float, routed_linears,
                     run_block, set_linear_weight, set_submodule)
from ..integrations.moe_experts import unfuse_experts
from .config import W4A16Config
from .formats import resolve_group_size
from .gptq import GPTQ
from .rtn import QuantizedWeight, rtn_quantize

logger = logging.getLogger(__name__)

DEFAULTS = {"gptq": (128, 2048), "awq": (128, 512), "rtn": (0, 0)}  # (num_samples, seq_len) when not configured


def as_config(config) -> W4A16Config:
    """The `W4A16Config` to calibrate with (a dict of its arguments is accepted: CLI and tests)."""
    return config if isinstance(config, W4A16Config) else W4A16Config(**dict(config))


class _Calibration(NamedTuple):
    """What one calibration run derives from the config and the model."""

    num_samples: int
    seq_len: int
    batch_size: int
    skip: tuple


def _calibration_plan(config: W4A16Config, model) -> _Calibration:
    default_n, default_len = DEFAULTS[config.method]
    seq_len = int(config.seq_len or default_len)
    model_config = getattr(model, "config", None)
    max_pos = getattr(model_config, "max_position_embeddings", None) or getattr(model_config, "n_positions", None)
    if max_pos and seq_len > max_pos:
        logger.info("seq_len %d > the model's %d positions: using %d", seq_len, max_pos, max_pos)
        seq_len = max_pos
    return _Calibration(num_samples=int(config.num_samples or default_n), seq_len=seq_len,
                        batch_size=int(config.batch_size or 0) or max(1, 8192 // max(seq_len, 1)),
                        skip=tuple(config.modules_to_not_convert or ()))


def _default_device(model: nn.Module, device):
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda")
    return next(model.parameters()).device


def _tqdm(iterable, **kw):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, **kw)


@torch.no_grad()
def quantize_model(model: nn.Module, config, tokenizer=None, *, device=None, calibration_ids=None) -> nn.Module:
    """Quantize every linear inside the decoder blocks of `model` in place; returns the model.

    Calibration text comes from `config.dataset` (see `hf_fastpath.quantization.data`; default `"mixed"`: half the
    windows from the Old Testament of the King James Bible, half from the Python language reference that ships with
    CPython, because GPTQ calibrated on one narrow domain can do worse than round-to-nearest on other text), tokenized
    with `tokenizer` (default: the model's own, from `config._name_or_path`). `calibration_ids` (LongTensor
    `[n, seq]`) bypasses text entirely.
    """
    s = as_config(config)
    plan = _calibration_plan(s, model)
    start = time.perf_counter()
    layers_name, layers = find_decoder_layers(model)
    # fused mixture-of-experts weights become per-expert linears, quantized like the others
    unfuse_experts(layers, skip=lambda name: any(_matches(name.partition(".")[2], p) for p in plan.skip),
                   model_type=getattr(getattr(model, "config", None), "model_type", None))
    dev = _default_device(model, device if device is not None else getattr(s, "device", None))
    results: dict[str, QuantizedWeight] = {}
    biases: dict[str, torch.Tensor | None] = {}

    kept: dict[str, str] = {}  # linears kept in 16 bits, as "<layers>.*.<name>" -> why

    def block_linears(layer):
        linears = {}
        for name, m in find_linears(layer, plan.skip).items():
            reason = reason_to_keep_in_float(name, m, s.bits, getattr(model, "config", None))
            if reason is None:
                resolve_group_size(s.group_size, linear_weight(m).shape[1])  # fail early with a clear message
                linears[name] = m
            else:
                kept[f"{layers_name}.*.{name}"] = reason
        return linears

    if s.method == "rtn":
        for i, layer in enumerate(_tqdm(layers, desc="RTN", unit="block")):
            for name, m in block_linears(layer).items():
                full = f"{layers_name}.{i}.{name}"
                results[full] = rtn_quantize(linear_weight(m).to(dev), s.bits, s.group_size, s.sym)
                biases[full] = m.bias
    else:
        ids = calibration_ids if calibration_ids is not None else _calibration_ids(model, s, plan, tokenizer)
        logger.info("%s: %d-bit g%d %s calibration on %d x %d tokens, device %s", s.method.upper(), s.bits,
                    s.group_size, "sym" if s.sym else "asym", ids.shape[0], ids.shape[1], dev)
        was_training = model.training
        model.eval()
        inputs = capture_block_inputs(model, layers[0], ids, plan.batch_size, dev)
        float_hidden = inputs.hidden  # GPTAQ: the float model's hidden states (the same tensors until block 0 ends)
        for i, layer in enumerate(_tqdm(layers, desc=s.method.upper(), unit="block")):
            home = next(layer.parameters()).device
            layer.to(dev)
            linears = block_linears(layer)
            if s.method == "gptq":
                reference = (copy.deepcopy(layer), float_hidden) if s.gptaq else None
                block_results = _gptq_block(layer, inputs, linears, s, reference)
                outputs = run_block(layer, inputs)
                if reference is not None:
                    float_hidden = run_block(reference[0], BlockInputs(hidden=float_hidden, kwargs=inputs.kwargs))
                    del reference
            else:
                from .awq import AWQSettings, awq_block

                report = awq_block(layer, inputs, linears, AWQSettings(
                    bits=s.bits, group_size=s.group_size, duo_scaling=s.awq_duo_scaling,
                    search_tokens=s.awq_search_tokens))
                logger.debug("block %d: %s", i, "; ".join(report))
                outputs = run_block(layer, inputs)  # float (scaled) outputs feed the next block, as in AWQ
                block_results = {n: rtn_quantize(linear_weight(m), s.bits, s.group_size, s.sym)
                                 for n, m in linears.items()}
            for name, q in block_results.items():
                full = f"{layers_name}.{i}.{name}"
                results[full] = q
                biases[full] = linears[name].bias
            inputs = BlockInputs(hidden=outputs, kwargs=inputs.kwargs)
            layer.to(home)
        model.train(was_training)
        del inputs

    _report_unquantized(model, layers_name, layers, results, kept)
    _replace_linears(model, results, biases, s)
    elapsed = time.perf_counter() - start
    model._hf_fastpath_calibration_seconds = elapsed
    logger.info("%s: %d linears quantized in %.1f s", s.method.upper(), len(results), elapsed)
    return model


def _report_unquantized(model, layers_name: str, layers: nn.ModuleList, results, kept: dict[str, str]) -> None:
    """Say which block weights stay in 16 bits: linears kept float (and why), and weights outside any linear (fused
    mixture-of-experts experts are 3-D parameters, not linears: W4A16 leaves them as they are)."""
    for pattern, reason in kept.items():
        logger.info("%s stays in 16 bits: %s", pattern, reason)
    model._hf_fastpath_kept_in_float = sorted(p.partition(".*.")[2] for p in kept)
    outside_linears: dict[str, int] = {}  # module class -> weights it holds outside any linear layer
    for module in layers.modules():
        if not is_linear(module):
            n = sum(p.numel() for p in module.parameters(recurse=False))
            if n:
                outside_linears[type(module).__name__] = outside_linears.get(type(module).__name__, 0) + n
    total = sum(p.numel() for p in layers.parameters())
    if total and sum(outside_linears.values()) > 0.5 * total:
        biggest = max(outside_linears, key=outside_linears.get)
        quantized = sum(q.codes.numel() for q in results.values())
        logger.warning("W4A16 quantizes linear layers only: %.0f%% of the weights in %s are quantized, the rest "
                       "(mostly in %s modules, e.g. fused mixture-of-experts weights) stays in 16 bits",
                       100 * quantized / total, layers_name, biggest)


def _calibration_ids(model, s: W4A16Config, plan: _Calibration, tokenizer) -> torch.Tensor:
    from .data import calibration_windows

    data = s.dataset
    is_ids = isinstance(data, torch.Tensor) or (isinstance(data, (list, tuple)) and data
                                                 and not isinstance(data[0], str))
    if is_ids:
        return calibration_windows(None, data, plan.num_samples, plan.seq_len)
    if tokenizer is None:
        tokenizer = getattr(model.config, "_name_or_path", None) or getattr(model, "name_or_path", None)
        if not tokenizer:
            raise ValueError("calibration needs a tokenizer: pass tokenizer=... (or token ids as the dataset)")
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    return calibration_windows(tokenizer, data, plan.num_samples, plan.seq_len)


def _gptq_block(layer: nn.Module, inputs: BlockInputs, linears: dict[str, nn.Module], s: W4A16Config,
                reference: tuple[nn.Module, list[torch.Tensor]] | None = None):
    """GPTQ every linear of one block; their weights are replaced by the dequantized result as it goes.

    `reference`: GPTAQ's (float copy of the block, the float model's hidden states), whose linears' inputs each
    Hessian is paired with."""
    groups = input_groups(layer, linears, inputs.hidden[0], inputs.kwargs[0])
    routed = routed_linears(layer)
    stages = _stages(groups, routed) if s.true_sequential else [groups]
    device = inputs.hidden[0].device
    float_linears = find_linears(reference[0], ()) if reference is not None else {}
    results = {}
    for stage in stages:
        # Linears that share an input share one Hessian.
        accs = [GPTQ(linear_weight(linears[g.names[0]]).shape[1], device=device) for g in stage]
        pending: set[int] = set()
        float_inputs: dict[int, torch.Tensor] = {}
        # GPTAQ pairs each input row with the float model's: an expert's rows are the tokens routed to it, which
        # differ between the two models, so experts get classic GPTQ
        unpaired: set[int] = {j for j, g in enumerate(stage) if g.names[0] in routed}

        def make_hook(j, acc=None):  # acc None: the float copy's linear, whose input waits for the quantized one's
            def hook(module, args):
                if acc is None:
                    float_inputs[j] = args[0]
                else:
                    x, x_float = args[0], float_inputs.pop(j, None)
                    if reference is not None and j not in unpaired and (x_float is None or x_float.shape != x.shape):
                        # e.g. routed (mixture-of-experts) inputs that differ between the two models: no row pairs
                        logger.warning("GPTAQ: %s sees other inputs in the float model (%s, here %s): it gets "
                                       "classic GPTQ", stage[j].names[0], None if x_float is None
                                       else tuple(x_float.shape), tuple(x.shape))
                        unpaired.add(j)
                        acc.D = None
                    acc.add_batch(x, None if j in unpaired else x_float)
                pending.discard(j)
                if not pending:  # the rest of the block is not needed for this stage
                    raise StopForward
            return hook

        handles = [linears[g.names[0]].register_forward_pre_hook(make_hook(j, acc)) for j, (g, acc)
                   in enumerate(zip(stage, accs))]
        handles += [float_linears[g.names[0]].register_forward_pre_hook(make_hook(j)) for j, g in enumerate(stage)
                    if reference is not None]
        batches = zip(inputs.hidden, inputs.kwargs, reference[1] if reference is not None else inputs.hidden)
        try:
            for hidden, kw, float_hidden in batches:
                runs = ((reference[0], float_hidden), (layer, hidden)) if reference is not None else ((layer, hidden),)
                for block, x in runs:
                    pending.update(range(len(stage)))
                    try:
                        block(x, **kw)
                    except StopForward:
                        pass
        finally:
            for h in handles:
                h.remove()
        idle = []
        for acc, g in zip(accs, stage):
            # GPTQ treats output rows independently given H: one pass over the stacked weights of all linears that
            # share this input (q/k/v, gate/up) gives the same result as one pass each, with a third of the loops.
            weights = [linear_weight(linears[n]).detach() for n in g.names]
            if acc.nsamples == 0 and g.names[0] in routed:  # an expert no calibration token was routed to
                idle.append("+".join(g.names))
                q = rtn_quantize(torch.cat(weights).to(device), s.bits, s.group_size, s.sym)
            else:
                q, loss = acc.quantize(torch.cat(weights), bits=s.bits, group_size=s.group_size, sym=s.sym,
                                       desc_act=s.desc_act, static_groups=s.static_groups,
                                       damp_percent=s.damp_percent, gptaq_alpha=s.gptaq_alpha)
                logger.debug("GPTQ %s: loss %.4g", "+".join(g.names), loss)
            start = 0
            for name, w in zip(g.names, weights):
                part = slice(start, start + w.shape[0])
                start += w.shape[0]
                qn = QuantizedWeight(codes=q.codes[:, part].contiguous(), scales=q.scales[:, part].contiguous(),
                                     zeros=q.zeros[:, part].contiguous(), g_idx=q.g_idx, bits=q.bits,
                                     group_size=q.group_size)
                set_linear_weight(linears[name], qn.dequantize())
                results[name] = qn
        if idle:
            logger.info("GPTQ: no calibration token reached %d expert(s) (e.g. %s): rounded to nearest",
                        len(idle), idle[0])
        del accs
    return results


def _stages(groups: list[InputGroup], routed: dict[str, str]) -> list[list[InputGroup]]:
    """True-sequential GPTQ stages: one per input group, but one for a role of all experts together (every
    expert's gate/up, then every expert's down): they do not feed each other, and a stage costs a pass over the
    calibration data."""
    stages, by_role = [], {}
    for g in groups:
        role = routed.get(g.names[0])
        if role is None:
            stages.append([g])
        elif role in by_role:
            by_role[role].append(g)
        else:
            by_role[role] = [g]
            stages.append(by_role[role])
    return stages


def _replace_linears(model: nn.Module, results: dict[str, QuantizedWeight], biases, s: W4A16Config) -> None:
    from .linear import W4A16Linear

    model_dtype = next(model.parameters()).dtype
    compute_dtype = model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.float16
    for full, q in results.items():
        old = model.get_submodule(full)
        home = linear_weight(old).device
        bias = biases.get(full)
        new = W4A16Linear.from_quantized(
            q.codes.to(home), q.scales.to(home), q.zeros.to(home), q.g_idx.to(home),
            bias=None if bias is None else bias.detach().to(home), bits=q.bits, group_size=q.group_size,
            dtype=model_dtype if model_dtype.is_floating_point else compute_dtype,
            checkpoint_format=s.saved_format,
        )
        new.train(old.training)
        set_submodule(model, full, new)
