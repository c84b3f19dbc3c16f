"""`quantize_model(model, config, tokenizer)`: GPTQ, AWQ or RTN over a whole Transformers model, block by block.

The model stays where it is (usually the CPU); one decoder block at a time moves to the calibration device (CUDA when
available), so a model larger than GPU memory still calibrates on one GPU. Calibration inputs of block i are the
outputs of block i-1 after it was quantized (GPTQ; AWQ uses the float outputs as its reference does). Inside a block
GPTQ is "true sequential": linears sharing an input (q/k/v, gate/up) are quantized together, in execution order, each
group's Hessian collected with the earlier groups already quantized. At the end every quantized linear is replaced by
a `W4A16Linear`. `config` is a `W4A16Config` (or anything with the same attributes).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
from torch import nn

from .blocks import (BlockInputs, StopForward, capture_block_inputs, find_decoder_layers, find_linears,
                     input_groups, linear_weight, run_block, set_linear_weight, set_submodule)
from .gptq import GPTQ
from .rtn import QuantizedWeight, check_bits, resolve_group_size, rtn_quantize

logger = logging.getLogger(__name__)

METHODS = ("gptq", "awq", "rtn")
DEFAULTS = {"gptq": (128, 2048), "awq": (128, 512), "rtn": (0, 0)}  # (num_samples, seq_len)


@dataclass
class Settings:
    method: str
    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    static_groups: bool
    true_sequential: bool
    damp_percent: float
    num_samples: int
    seq_len: int
    dataset: object
    skip: tuple
    checkpoint_format: str
    batch_size: int
    awq_duo_scaling: bool
    awq_search_tokens: int | None


def _get(config, name, default):
    value = config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)
    return default if value is None else value


def settings_from_config(config, model=None) -> Settings:
    method = str(_get(config, "method", "gptq")).lower()
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; choose one of {METHODS}")
    bits = int(_get(config, "bits", 4))
    check_bits(bits)
    default_n, default_len = DEFAULTS[method]
    seq_len = int(_get(config, "seq_len", default_len))
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None) or \
        getattr(getattr(model, "config", None), "n_positions", None)
    if max_pos and seq_len > max_pos:
        logger.info("seq_len %d > the model's %d positions: using %d", seq_len, max_pos, max_pos)
        seq_len = max_pos
    # AWQ's scale folding needs a zero point (asymmetric); GPTQ and RTN default to symmetric.
    sym = bool(_get(config, "sym", method != "awq"))
    desc_act = bool(_get(config, "desc_act", False))
    if method != "gptq" and desc_act:
        raise ValueError("desc_act (act-order) is a GPTQ option; use method='gptq' or desc_act=False")
    if method == "awq" and bits == 4:
        fmt = "awq"  # AWQ GEMM storage (4-bit only)
    else:
        fmt = _get(config, "checkpoint_format", "gptq")
        fmt = "gptq" if fmt in ("auto", "awq") else fmt
    skip = tuple(_get(config, "modules_to_not_convert", ()) or ())
    return Settings(
        method=method, bits=bits, group_size=int(_get(config, "group_size", 128)), sym=sym, desc_act=desc_act,
        static_groups=bool(_get(config, "static_groups", False)),
        true_sequential=bool(_get(config, "true_sequential", True)),
        damp_percent=float(_get(config, "damp_percent", 0.01)),
        num_samples=int(_get(config, "num_samples", default_n)), seq_len=seq_len,
        dataset=_get(config, "dataset", None), skip=skip, checkpoint_format=str(fmt),
        batch_size=int(_get(config, "batch_size", 0)) or max(1, 8192 // max(seq_len, 1)),
        awq_duo_scaling=bool(_get(config, "awq_duo_scaling", True)),
        awq_search_tokens=_get(config, "awq_search_tokens", None),
    )


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
    s = settings_from_config(config, model)
    start = time.perf_counter()
    layers_name, layers = find_decoder_layers(model)
    dev = _default_device(model, device if device is not None else _get(config, "device", None))
    results: dict[str, QuantizedWeight] = {}
    biases: dict[str, torch.Tensor | None] = {}

    if s.method == "rtn":
        for i, layer in enumerate(_tqdm(layers, desc="RTN", unit="block")):
            for name, m in find_linears(layer, s.skip).items():
                full = f"{layers_name}.{i}.{name}"
                results[full] = rtn_quantize(linear_weight(m).to(dev), s.bits, s.group_size, s.sym)
                biases[full] = m.bias
    else:
        ids = calibration_ids if calibration_ids is not None else _calibration_ids(model, s, tokenizer)
        logger.info("%s: %d-bit g%d %s calibration on %d x %d tokens, device %s", s.method.upper(), s.bits,
                    s.group_size, "sym" if s.sym else "asym", ids.shape[0], ids.shape[1], dev)
        was_training = model.training
        model.eval()
        inputs = capture_block_inputs(model, layers[0], ids, s.batch_size, dev)
        for i, layer in enumerate(_tqdm(layers, desc=s.method.upper(), unit="block")):
            home = next(layer.parameters()).device
            layer.to(dev)
            linears = find_linears(layer, s.skip)
            for name, m in linears.items():
                resolve_group_size(s.group_size, linear_weight(m).shape[1])  # fail early with a clear message
            if s.method == "gptq":
                block_results = _gptq_block(layer, inputs, linears, s)
                outputs = run_block(layer, inputs)
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

    _replace_linears(model, results, biases, s)
    elapsed = time.perf_counter() - start
    model._hf_fastpath_calibration_seconds = elapsed
    logger.info("%s: %d linears quantized in %.1f s", s.method.upper(), len(results), elapsed)
    return model


def _calibration_ids(model, s: Settings, tokenizer) -> torch.Tensor:
    from .data import calibration_windows

    data = s.dataset
    is_ids = isinstance(data, torch.Tensor) or (isinstance(data, (list, tuple)) and data
                                                 and not isinstance(data[0], str))
    if is_ids:
        return calibration_windows(None, data, s.num_samples, s.seq_len)
    if tokenizer is None:
        tokenizer = getattr(model.config, "_name_or_path", None) or getattr(model, "name_or_path", None)
        if not tokenizer:
            raise ValueError("calibration needs a tokenizer: pass tokenizer=... (or token ids as the dataset)")
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    return calibration_windows(tokenizer, data, s.num_samples, s.seq_len)


def _gptq_block(layer: nn.Module, inputs: BlockInputs, linears: dict[str, nn.Module], s: Settings):
    """GPTQ every linear of one block; their weights are replaced by the dequantized result as it goes."""
    groups = input_groups(layer, linears, inputs.hidden[0], inputs.kwargs[0])
    stages = [[g] for g in groups] if s.true_sequential else [groups]
    device = inputs.hidden[0].device
    results = {}
    for stage in stages:
        # Linears that share an input share one Hessian.
        accs = [GPTQ(linear_weight(linears[g.names[0]]).shape[1], device=device) for g in stage]
        pending: set[int] = set()

        def make_hook(j):
            def hook(module, args):
                accs[j].add_batch(args[0])
                pending.discard(j)
                if not pending:  # the rest of the block is not needed for this stage
                    raise StopForward
            return hook

        handles = [linears[g.names[0]].register_forward_pre_hook(make_hook(j)) for j, g in enumerate(stage)]
        try:
            for hidden, kw in zip(inputs.hidden, inputs.kwargs):
                pending.update(range(len(stage)))
                try:
                    layer(hidden, **kw)
                except StopForward:
                    pass
        finally:
            for h in handles:
                h.remove()
        for acc, g in zip(accs, stage):
            # GPTQ treats output rows independently given H: one pass over the stacked weights of all linears that
            # share this input (q/k/v, gate/up) gives the same result as one pass each, with a third of the loops.
            weights = [linear_weight(linears[n]).detach() for n in g.names]
            q, loss = acc.quantize(torch.cat(weights), bits=s.bits, group_size=s.group_size, sym=s.sym,
                                   desc_act=s.desc_act, static_groups=s.static_groups, damp_percent=s.damp_percent)
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
        del accs
    return results


def _replace_linears(model: nn.Module, results: dict[str, QuantizedWeight], biases, s: Settings) -> None:
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
            checkpoint_format=s.checkpoint_format,
        )
        new.train(old.training)
        set_submodule(model, full, new)
