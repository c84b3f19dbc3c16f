"""Synthetic GPTQ / AWQ checkpoints of tiny random models, packed here bit by bit (independently of
`hf_fastpath.quantization.formats`) so that tests can check the library against them.

    from tests.checkpoints import QuantSpec, write_quantized_checkpoint
    reference = write_quantized_checkpoint(float_model, tmp_path, QuantSpec("gptq", desc_act=True, sym=False))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)   # must match `reference`, the float model with the
                                                               # dequantized weights (AWQ act scales folded in)
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ word holds column 8c + AWQ_ORDER[j]
# AWQ: model type -> (activation attribute, up projection next to it) for the `<mlp>.act.scales` tensor
AWQ_ACT_SCALES = {"gpt_neox": ("act", "dense_h_to_4h"), "gptj": ("act", "fc_in"), "gpt_bigcode": ("act", "c_fc"),
                  "falcon": ("act", "dense_h_to_4h")}


@dataclass
class QuantSpec:
    method: str = "gptq"  # "gptq" or "awq"
    bits: int = 4
    group_size: int = 32
    sym: bool = True
    desc_act: bool = False
    checkpoint_format: str = "gptq"  # GPTQ only: "gptq" (v1, stores zero - 1) or "gptq_v2"
    act_scales: bool = False  # AWQ: write `...mlp.act.scales` (families in AWQ_ACT_SCALES)

    def quantization_config(self, modules_to_not_convert=None) -> dict:
        if self.method == "awq":
            return {"quant_method": "awq", "bits": self.bits, "group_size": self.group_size, "zero_point": True,
                    "version": "gemm", "modules_to_not_convert": modules_to_not_convert}
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size,
                "desc_act": self.desc_act, "sym": self.sym, "checkpoint_format": self.checkpoint_format,
                "damp_percent": 0.01, "true_sequential": True, "static_groups": False}


# ---------------------------------------------------------------------------------------------------------------------
# reference packers: one bit at a time, vectorised over the other dimension only


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def ref_pack_stream(values: torch.Tensor, bits: int) -> torch.Tensor:
    """values [L, M] -> int32 [L*bits/32, M]: value i occupies bits [bits*i, bits*i + bits) of a little-endian stream
    of 32-bit words (GPTQ's packing along K for qweight; transpose for qzeros)."""
    length, cols = values.shape
    assert (length * bits) % 32 == 0
    words = torch.zeros(length * bits // 32, cols, dtype=torch.int64)
    v = values.to(torch.int64)
    for i in range(length):
        for b in range(bits):
            position = bits * i + b
            words[position // 32] |= ((v[i] >> b) & 1) << (position % 32)
    return _to_int32(words)


def ref_pack_awq(values: torch.Tensor) -> torch.Tensor:
    """values [R, N] (4-bit) -> int32 [R, N/8] in AWQ's interleaved nibble order."""
    rows, cols = values.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    v = values.to(torch.int64)
    for c in range(cols // 8):
        for j, column in enumerate(AWQ_ORDER):
            words[:, c] |= v[:, 8 * c + column] << (4 * j)
    return _to_int32(words)


# ---------------------------------------------------------------------------------------------------------------------
# quantizing a weight (simple min/max grid; what matters here is the storage, not the quality)


def quantize_weight(w: torch.Tensor, spec: QuantSpec, generator: torch.Generator):
    """w [N, K] (nn.Linear layout) -> codes [K, N], scales [G, N] (fp16-exact, float32), zeros [G, N] int, g_idx [K]."""
    n, k = w.shape
    gs = k if spec.group_size == -1 else spec.group_size
    groups = (k + gs - 1) // gs
    maxq = 2**spec.bits - 1
    if spec.desc_act:
        order = torch.randperm(k, generator=generator)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = (torch.arange(k) // gs).to(torch.int32)
    else:
        g_idx = (torch.arange(k) // gs).to(torch.int32)
    wt = w.t().float()  # [K, N]
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    for g in range(groups):
        rows = wt[g_idx == g]
        lo, hi = rows.min(0).values.clamp(max=0), rows.max(0).values.clamp(min=0)
        if spec.sym:
            scale = torch.maximum(lo.abs(), hi) * 2 / maxq
            zero = torch.full((n,), (maxq + 1) // 2, dtype=torch.int64)
        else:
            scale = (hi - lo) / maxq
        scale = torch.where(scale > 0, scale, torch.ones_like(scale)).half().float()
        if not spec.sym:
            lowest = 1 if spec.method == "gptq" and spec.checkpoint_format == "gptq" else 0  # v1 cannot store 0
            zero = torch.round(-lo / scale).clamp(lowest, maxq).to(torch.int64)
        scales[g], zeros[g] = scale, zero
    g = g_idx.long()
    codes = torch.clamp(torch.round(wt / scales[g]) + zeros[g], 0, maxq).to(torch.int64)
    return codes, scales, zeros, g_idx


def dequantize_weight(codes, scales, zeros, g_idx) -> torch.Tensor:
    """[N, K] float32, by the definition W[k, n] = scales[g[k], n] * (codes[k, n] - zeros[g[k], n])."""
    g = g_idx.long()
    return (scales[g] * (codes.float() - zeros[g].float())).t().contiguous()


# ---------------------------------------------------------------------------------------------------------------------
# writing a checkpoint


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def quantized_layer_names(model: nn.Module, modules_to_not_convert=()) -> list[str]:
    output = model.get_output_embeddings()
    return [name for name, m in model.named_modules()
            if _is_linear(m) and m is not output and not any(name.endswith(s) for s in modules_to_not_convert)]


def write_quantized_checkpoint(model: nn.Module, path, spec: QuantSpec, *, modules_to_not_convert=(),
                               seed: int = 0) -> nn.Module:
    """Quantize `model`'s linears (not the output embedding, not `modules_to_not_convert`) and write a GPTQ/AWQ
    checkpoint (model.safetensors + config.json) to `path`. Returns the float model that computes exactly what the
    checkpoint describes."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    reference = copy.deepcopy(model)
    ref_modules = dict(reference.named_modules())
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        for key in list(getattr(model, "all_tied_weights_keys", {}) or {}):
            tensors.pop(key, None)
    for name in quantized_layer_names(model, modules_to_not_convert):
        module = dict(model.named_modules())[name]
        is_conv1d = type(module).__name__ == "Conv1D"
        w = module.weight.detach().float()
        w = w.t() if is_conv1d else w  # [N, K]
        codes, scales, zeros, g_idx = quantize_weight(w, spec, generator)
        tensors.pop(f"{name}.weight")
        if spec.method == "awq":
            tensors[f"{name}.qweight"] = ref_pack_awq(codes)
            tensors[f"{name}.qzeros"] = ref_pack_awq(zeros)
        else:
            stored_zeros = zeros - 1 if spec.checkpoint_format == "gptq" else zeros
            tensors[f"{name}.qweight"] = ref_pack_stream(codes, spec.bits)
            tensors[f"{name}.qzeros"] = ref_pack_stream(stored_zeros.t(), spec.bits).t().contiguous()
            tensors[f"{name}.g_idx"] = g_idx
        tensors[f"{name}.scales"] = scales.half()
        deq = dequantize_weight(codes, scales, zeros, g_idx)
        ref_modules[name].weight.data.copy_(deq.t() if is_conv1d else deq)
    if spec.method == "awq" and spec.act_scales:
        act_name, up_name = AWQ_ACT_SCALES[model.config.model_type]
        for name, module in model.named_modules():
            if hasattr(module, act_name) and hasattr(module, up_name) and name:
                features = getattr(module, up_name).out_features
                s = (torch.rand(features, generator=generator) * 1.5 + 0.5).half().float()
                tensors[f"{name}.{act_name}.scales"] = s.half()
                # down(act(x) / s) == (down with its input columns divided by s)(act(x))
                down = _down_projection(ref_modules[name], up_name)
                down.weight.data.div_(s if type(down).__name__ != "Conv1D" else s[:, None])
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = spec.quantization_config(list(modules_to_not_convert) or None)
    (path / "config.json").write_text(json.dumps(config, indent=2, default=str))
    return reference.eval()


def _down_projection(mlp: nn.Module, up_name: str) -> nn.Module:
    for name in ("dense_4h_to_h", "fc_out", "c_proj", "down_proj"):
        if hasattr(mlp, name) and name != up_name:
            return getattr(mlp, name)
    raise ValueError(f"no down projection found in {type(mlp).__name__}")
