"""GPTQ / AWQ checkpoints load with plain `from_pretrained` onto `W4A16Linear`, save back in the same format, and
`W4A16Config` quantizes a float model while it loads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

import hf_fastpath  # noqa: F401  (registers the quantizer)
from hf_fastpath.integrations import transformers_quantizer
from hf_fastpath.quantization import ScaledActivation, W4A16Linear
from tests.checkpoints import QuantSpec, quantized_layer_names, write_quantized_checkpoint
from tests.models import random_batch, tiny_model

transformers_quantizer.register()  # idempotent; the package import normally does it


def logits(model, ids, mask):
    """Logits at the real (unpadded) positions: what a padded position computes is not defined."""
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits[mask.bool()]


def load(path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


def read_safetensors(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


CASES = {
    "llama-gptq-v1-sym": ("llama", QuantSpec("gptq")),
    "llama-gptq-v2-3bit-asym": ("llama", QuantSpec("gptq", bits=3, group_size=-1, sym=False,
                                                   checkpoint_format="gptq_v2")),
    "gpt2-gptq-v2-desc_act-asym": ("gpt2", QuantSpec("gptq", desc_act=True, sym=False, checkpoint_format="gptq_v2")),
    "bigcode-gptq-v1-desc_act-asym": ("gpt_bigcode", QuantSpec("gptq", group_size=64, desc_act=True, sym=False)),
    "falcon-awq": ("falcon", QuantSpec("awq", sym=False)),
    "neox-awq-act-scales": ("gpt_neox", QuantSpec("awq", sym=False, act_scales=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_loads_matches_and_resaves(case, tmp_path):
    family, spec = CASES[case]
    model = tiny_model(family)
    reference = write_quantized_checkpoint(model, tmp_path / "ckpt", spec)
    loaded = load(tmp_path / "ckpt")
    modules = dict(loaded.named_modules())
    names = quantized_layer_names(model)
    assert names and all(isinstance(modules[n], W4A16Linear) for n in names)
    assert not any(p.requires_grad for n in names for p in modules[n].parameters())  # frozen, bias included
    assert not isinstance(loaded.get_output_embeddings(), W4A16Linear)
    if spec.act_scales:
        assert any(isinstance(m, ScaledActivation) for m in loaded.modules())
    ids, mask = random_batch(seq=10, left_pad=(3,))
    expected = logits(reference, ids, mask)
    got = logits(loaded, ids, mask)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    loaded.save_pretrained(tmp_path / "resaved")
    original = read_safetensors(tmp_path / "ckpt" / "model.safetensors")
    resaved = read_safetensors(tmp_path / "resaved" / "model.safetensors")
    for key, tensor in original.items():
        if key.endswith(".act.scales"):  # AWQ activation scales: kept in the model's dtype
            assert torch.equal(resaved[key].to(tensor.dtype), tensor), key
        elif key.rpartition(".")[2] in ("qweight", "qzeros", "scales", "g_idx"):
            assert resaved[key].dtype == tensor.dtype and torch.equal(resaved[key], tensor), key
    config = json.loads((tmp_path / "resaved" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == spec.method and config["bits"] == spec.bits
    assert config["group_size"] == spec.group_size
    if spec.method == "gptq":
        assert config["checkpoint_format"] == spec.checkpoint_format and config["desc_act"] == spec.desc_act
    else:
        assert config["version"] == "gemm"
    again = load(tmp_path / "resaved")
    assert torch.equal(logits(again, ids, mask), got)


def test_modules_to_not_convert_and_missing_g_idx(tmp_path):
    model = tiny_model("llama")
    skip = ("mlp.down_proj",)
    reference = write_quantized_checkpoint(model, tmp_path, QuantSpec("awq", sym=False), modules_to_not_convert=skip)
    loaded = load(tmp_path)
    for name, module in loaded.named_modules():
        if name.endswith("mlp.down_proj") or name == "lm_head":
            assert type(module) is nn.Linear, name
        elif name.endswith("_proj"):
            assert isinstance(module, W4A16Linear), name
    ids, mask = random_batch()
    torch.testing.assert_close(logits(loaded, ids, mask), logits(reference, ids, mask), rtol=1e-4, atol=1e-4)
    loaded.dequantize()  # back to nn.Linear with the dequantized weights
    assert not any(isinstance(m, W4A16Linear) for m in loaded.modules())
    torch.testing.assert_close(logits(loaded, ids, mask), logits(reference, ids, mask), rtol=1e-4, atol=1e-4)

    # a GPTQ checkpoint without g_idx (allowed without desc_act) means the trivial group order, without qzeros
    # (symmetric) the zero point 2**(bits-1)
    reference = write_quantized_checkpoint(model, tmp_path / "no_g_idx", QuantSpec("gptq", sym=True))
    file = tmp_path / "no_g_idx" / "model.safetensors"
    tensors = {k: v for k, v in load_file(str(file)).items() if not k.endswith((".g_idx", "o_proj.qzeros"))}
    save_file(tensors, str(file), metadata={"format": "pt"})
    loaded = load(tmp_path / "no_g_idx")
    torch.testing.assert_close(logits(loaded, ids, mask), logits(reference, ids, mask), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("corruption", ["shape", "dtype"])
def test_bad_checkpoint_tensor_is_named(corruption, tmp_path):
    write_quantized_checkpoint(tiny_model("llama"), tmp_path, QuantSpec("gptq"))
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    key = "model.layers.1.mlp.down_proj.qweight"
    if corruption == "shape":
        tensors[key] = tensors[key][:, :32].contiguous()
        message = r"'qweight' of layer 'model\.layers\.1\.mlp\.down_proj' has shape \(16, 32\), expected \(16, 64\)"
    else:
        tensors[key] = tensors[key].to(torch.int64)
        message = r"'qweight' of layer 'model\.layers\.1\.mlp\.down_proj' has dtype torch\.int64, expected torch\.int32"
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        load(tmp_path)


def test_quantized_layer_the_model_does_not_build_warns(tmp_path, caplog):
    model = tiny_model("llama")
    write_quantized_checkpoint(model, tmp_path, QuantSpec("gptq"))
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    extra = {f"model.layers.7.self_attn.q_proj.{t}": tensors[f"model.layers.0.self_attn.q_proj.{t}"].clone()
             for t in ("qweight", "qzeros", "scales", "g_idx")}  # a layer the model does not build
    save_file({**tensors, **extra}, str(file), metadata={"format": "pt"})
    with caplog.at_level("WARNING"):
        load(tmp_path)
    assert "1 quantized layer(s) of the checkpoint match no module of LlamaForCausalLM" in caplog.text


def test_quantized_layer_where_the_model_keeps_other_weights_is_an_error(tmp_path):
    """A quantized layer whose module holds its own weights another way (here: a norm) would stay random."""
    model = tiny_model("llama")
    write_quantized_checkpoint(model, tmp_path, QuantSpec("gptq"))
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    extra = {f"model.layers.0.input_layernorm.proj.{t}": tensors[f"model.layers.0.self_attn.q_proj.{t}"].clone()
             for t in ("qweight", "qzeros", "scales", "g_idx")}
    save_file({**tensors, **extra}, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.input_layernorm\.proj'.*'model\.layers\.0\."
                                         r"input_layernorm' \(LlamaRMSNorm\) stores its weights another way"):
        load(tmp_path)


@pytest.mark.parametrize("family,method,desc_act", [("mixtral", "gptq", False), ("mixtral", "gptq", True),
                                                    ("mixtral", "awq", False), ("qwen3_moe", "gptq", False),
                                                    ("gpt_oss", "gptq", False)])
def test_per_expert_checkpoint_loads_into_fused_experts(family, method, desc_act, tmp_path):
    """A mixture of experts quantized one linear per expert (gptqmodel's and AutoAWQ's layout; Mixtral's under its
    original `block_sparse_moe.experts.<e>.w1` names; act-order too) loads onto W4A16 linears although Transformers
    5 builds the experts as fused 3-D weights, and computes what the checkpoint says."""
    from hf_fastpath.integrations.moe_experts import UnfusedExperts, unfuse_experts

    model = tiny_model(family)
    unfuse_experts(model)
    reference = write_quantized_checkpoint(model, tmp_path, QuantSpec(method, desc_act=desc_act))
    if family == "mixtral":
        file = tmp_path / "model.safetensors"
        tensors = {k.replace(".mlp.", ".block_sparse_moe."): v for k, v in load_file(str(file)).items()}
        assert "model.layers.1.block_sparse_moe.experts.3.w2.qweight" in tensors
        save_file(tensors, str(file), metadata={"format": "pt"})
    loaded = load(tmp_path)
    experts = loaded.model.layers[1].mlp.experts
    assert isinstance(experts, UnfusedExperts) and len(experts) == 4
    assert all(isinstance(m, W4A16Linear) and (m.perm is not None) == desc_act for e in experts for m in e.children())
    ids, mask = random_batch()
    torch.testing.assert_close(logits(loaded, ids, mask), logits(reference, ids, mask), rtol=1e-4, atol=1e-4)


def test_w4a16_config_quantizes_on_load_and_saves_standard_gptq(tmp_path):
    float_model = tiny_model("gpt2")
    float_model.save_pretrained(tmp_path / "float")
    config = hf_fastpath.W4A16Config(method="rtn", bits=4, group_size=32, sym=False)
    quantized = load(tmp_path / "float", quantization_config=config)
    layers = {n: m for n, m in quantized.named_modules() if isinstance(m, W4A16Linear)}
    assert set(layers) == set(quantized_layer_names(float_model))
    # the quantized model computes exactly what its integer weights say
    reference = tiny_model("gpt2")
    for name, layer in layers.items():
        reference.get_submodule(name).weight.data.copy_(layer.dequantize().t())  # GPT-2 Conv1D: [in, out]
    ids, mask = random_batch()
    got = logits(quantized, ids, mask)
    torch.testing.assert_close(got, logits(reference, ids, mask), rtol=1e-4, atol=1e-4)
    assert (got - logits(float_model, ids, mask)).abs().max() < 0.5  # and stays near the float model

    quantized.save_pretrained(tmp_path / "quantized")
    saved = json.loads((tmp_path / "quantized" / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "gptq" and saved["bits"] == 4 and saved["group_size"] == 32
    assert saved["checkpoint_format"] in ("gptq", "gptq_v2") and saved["sym"] is False
    keys = set(read_safetensors(tmp_path / "quantized" / "model.safetensors"))
    assert "transformer.h.0.attn.c_attn.qzeros" in keys and "transformer.h.0.attn.c_attn.weight" not in keys
    again = load(tmp_path / "quantized")
    assert torch.equal(logits(again, ids, mask), got)


def test_transformers_gptq_config_quantizes_with_hf_fastpath(tmp_path, monkeypatch):
    from transformers import GPTQConfig

    from hf_fastpath.quantization import calibrate

    seen = []
    real = calibrate.quantize_model

    def rtn_instead(model, config, tokenizer=None):  # GPTQ calibration itself is tested with the calibration module
        seen.append(config)
        config = hf_fastpath.W4A16Config(method="rtn", bits=config.bits, group_size=config.group_size, sym=config.sym)
        return real(model, config)

    monkeypatch.setattr(calibrate, "quantize_model", rtn_instead)
    tiny_model("llama").save_pretrained(tmp_path / "float")
    quantized = load(tmp_path / "float", quantization_config=GPTQConfig(bits=4, group_size=32, desc_act=True))
    assert seen[0].method == "gptq" and seen[0].bits == 4 and seen[0].group_size == 32 and seen[0].desc_act
    assert isinstance(quantized.model.layers[0].self_attn.q_proj, W4A16Linear)
    assert quantized.config.quantization_config.quant_method == "gptq"


def test_backend_choice(tmp_path, monkeypatch):
    write_quantized_checkpoint(tiny_model("llama"), tmp_path, QuantSpec("gptq"))
    # asking for Transformers' own GPTQ path hands the load to it (which needs optimum/gptqmodel)
    monkeypatch.setenv(transformers_quantizer.BACKEND_ENV, "gptqmodel")
    original = transformers_quantizer._ORIGINAL_QUANTIZERS["gptq"]
    monkeypatch.setattr(original, "__init__", _refuse)
    with pytest.raises(RuntimeError, match="original quantizer"):
        load(tmp_path)
    monkeypatch.setenv(transformers_quantizer.BACKEND_ENV, "nonsense")
    with pytest.raises(ValueError, match="HF_FASTPATH_GPTQ_BACKEND"):
        load(tmp_path)
    monkeypatch.setenv(transformers_quantizer.BACKEND_ENV, "fastpath")
    assert isinstance(load(tmp_path).model.layers[0].mlp.up_proj, W4A16Linear)


def _refuse(self, *args, **kwargs):
    raise RuntimeError("original quantizer called")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with TRITON_INTERPRET=0)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_checkpoint_runs_on_kernels(dtype, tmp_path):
    from hf_fastpath.quantization import w4a16_backend

    model = tiny_model("llama")
    reference = write_quantized_checkpoint(model, tmp_path, QuantSpec("gptq", desc_act=True, sym=False,
                                                                      checkpoint_format="gptq_v2"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype, device_map="cuda").eval()
    layer = loaded.model.layers[0].mlp.down_proj
    assert isinstance(layer, W4A16Linear) and layer.qweight.is_cuda and layer.scales.dtype == dtype
    ids, mask = random_batch()
    with w4a16_backend("kernel"):  # raises instead of silently falling back
        got = logits(loaded, ids.cuda(), mask.cuda()).float().cpu()
        x = torch.randn(5, layer.in_features, device="cuda", dtype=dtype, requires_grad=True)
        layer(x).float().pow(2).sum().backward()
    expected = logits(reference, ids, mask)
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    w = layer.dequantize().cuda().double()  # [N, K]
    y = x.detach().double() @ w.t()
    if layer.bias is not None:
        y = y + layer.bias.double()
    dx = 2 * y @ w  # d/dx of sum(y**2)
    torch.testing.assert_close(x.grad.double(), dx, rtol=5e-2, atol=5e-2 * dx.abs().max().item())


def test_pytorch_bin_checkpoint_uses_rule_based_layer_choice(tmp_path):
    # without safetensors headers to read, every linear but the output embedding is taken as quantized,
    # and AWQ activations are wrapped by model type
    model = tiny_model("gpt_neox")
    reference = write_quantized_checkpoint(model, tmp_path, QuantSpec("awq", sym=False, act_scales=True))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors").unlink()
    loaded = load(tmp_path)
    assert sum(isinstance(m, ScaledActivation) for m in loaded.modules()) == model.config.num_hidden_layers
    ids, mask = random_batch()
    torch.testing.assert_close(logits(loaded, ids, mask), logits(reference, ids, mask), rtol=1e-4, atol=1e-4)


def test_model_quantized_in_place_saves_standard_awq(tmp_path):
    from hf_fastpath.quantization.calibrate import quantize_model

    model = tiny_model("llama")
    config = hf_fastpath.W4A16Config(method="rtn", group_size=32, sym=False)
    quantize_model(model, config)
    config.method = "awq"  # store the RTN result in AWQ GEMM format
    transformers_quantizer.attach_quantization_config(model, config)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "awq" and saved["version"] == "gemm" and saved["zero_point"] is True
    assert read_safetensors(tmp_path / "model.safetensors")["model.layers.0.mlp.up_proj.qweight"].shape == (64, 16)
    ids, mask = random_batch()
    reloaded = load(tmp_path)
    down, down_again = model.model.layers[1].mlp.down_proj, reloaded.model.layers[1].mlp.down_proj
    assert torch.equal(down_again.dequantize(), down.dequantize())
    # (eager attention here, SDPA in the reloaded model: equal up to rounding)
    torch.testing.assert_close(logits(reloaded, ids, mask), logits(model, ids, mask), rtol=1e-5, atol=1e-5)


def test_quantized_model_forward_compiles_in_one_graph():
    """A quantized Llama's forward compiles with fullgraph=True (what generate() with a static cache asks for) and
    gives the eager logits; the quantizer reports the model as compileable."""
    from hf_fastpath.quantization import W4A16Config, w4a16_backend
    from hf_fastpath.quantization.calibrate import quantize_model

    torch._dynamo.reset()
    model = tiny_model("llama", dtype=torch.float16)
    quantize_model(model, W4A16Config(method="rtn", bits=4, group_size=32, sym=False))
    ids, _ = random_batch(batch=1, seq=8)
    with w4a16_backend("kernel"), torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model.forward, backend="aot_eager", fullgraph=True)
        logits = compiled(input_ids=ids).logits
    torch.testing.assert_close(logits, eager, rtol=0, atol=0)
    assert transformers_quantizer.W4A16Quantizer(W4A16Config()).is_compileable
