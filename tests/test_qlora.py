"""QLoRA: PEFT LoRA / DoRA over W4A16Linear (hf_fastpath.integrations.peft) and prepare_model_for_qlora.

The reference for every check is the same network with nn.Linear layers holding the dequantized weights (or the
original float weights, for the convergence test), computed in float32.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers import AutoModelForCausalLM

import hf_fastpath  # noqa: F401  (registers the PEFT mapping)
from hf_fastpath.integrations.peft import MERGE_REFUSED, W4A16LoraLinear, merge_and_dequantize, register
from hf_fastpath.quantization.calibrate import quantize_model
from hf_fastpath.quantization.config import W4A16Config
from hf_fastpath.quantization.linear import W4A16Linear, w4a16_backend
from hf_fastpath.quantization.training import ignore_quantized_buffers_in_ddp, prepare_model_for_qlora
from tests.checkpoints import QuantSpec, write_quantized_checkpoint
from tests.models import random_batch, tiny_model

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------------------------------------
# helpers


def random_w4a16(k, n, group_size, dtype=torch.float32, *, act_order=False, bias=True, seed=0) -> W4A16Linear:
    g = torch.Generator().manual_seed(seed)
    groups = k // group_size
    codes = torch.randint(0, 16, (k, n), generator=g)
    scales = (torch.rand(groups, n, generator=g) * 0.05 + 0.02).half().float()
    zeros = torch.randint(0, 16, (groups, n), generator=g)
    g_idx = torch.arange(k) // group_size
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    b = torch.randn(n, generator=g) * 0.1 if bias else None
    return W4A16Linear.from_quantized(codes, scales, zeros, g_idx, bias=b, bits=4, group_size=group_size, dtype=dtype)


def float_twin(layer: W4A16Linear) -> nn.Linear:
    linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    with torch.no_grad():
        linear.weight.copy_(layer.dequantize(torch.float32))
        if layer.bias is not None:
            linear.bias.copy_(layer.bias.float())
    return linear


class MLP(nn.Module):
    """Two stacked layers: LoRA in the lower one needs the input gradient of the upper (4-bit) one."""

    def __init__(self, up: nn.Module, down: nn.Module):
        super().__init__()
        self.up, self.down = up, down

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


def randomize_adapters(model: nn.Module, seed: int = 1) -> None:
    """Non-zero lora_B (and perturbed DoRA magnitudes) so that every gradient is non-trivial; the same values for every
    model with the same adapter names."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "lora_magnitude_vector" in name:
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))


def adapter_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            key = name.replace(".base_layer", "")
            out[key] = p.grad.detach().float().clone()
    return out


def lora_pair(dtype, *, act_order=False, use_dora=False, lora_bias=False):
    up = random_w4a16(64, 40, 32, dtype, act_order=act_order, seed=0)
    down = random_w4a16(40, 24, 8, dtype, bias=False, seed=1)
    quant, ref = MLP(up, down), MLP(float_twin(up), float_twin(down))
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"], use_dora=use_dora, lora_bias=lora_bias)
    torch.manual_seed(0)
    quant = get_peft_model(quant, copy.deepcopy(config))
    torch.manual_seed(0)
    ref = get_peft_model(ref, copy.deepcopy(config))
    randomize_adapters(quant)
    randomize_adapters(ref)
    return quant, ref


def run_pair(quant, ref, dtype):
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(2))
    xq = x.to(dtype).clone().requires_grad_(True)
    xr = x.clone().requires_grad_(True)
    target = torch.randn(2, 5, 24, generator=torch.Generator().manual_seed(3))
    yq, yr = quant(xq), ref(xr)
    ((yq.float() - target) ** 2).sum().backward()
    ((yr - target) ** 2).sum().backward()
    return yq.float(), yr, xq.grad.float(), xr.grad, adapter_grads(quant), adapter_grads(ref)


def assert_close_rel(got, want, rtol, what):
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= rtol * scale + 1e-7, f"{what}: max error {err:.3g} vs max |value| {scale:.3g} (rtol {rtol})"


# ---------------------------------------------------------------------------------------------------------------------
# gradients through W4A16Linear == gradients through the dequantized float layers


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("act_order", [False, True], ids=["sorted", "act_order"])
def test_lora_gradients_match_dequantized_float(act_order, use_dora):
    quant, ref = lora_pair(torch.float32, act_order=act_order, use_dora=use_dora)
    assert isinstance(quant.base_model.model.up, W4A16LoraLinear)
    yq, yr, gxq, gxr, gq, gr = run_pair(quant, ref, torch.float32)
    assert_close_rel(yq, yr, 1e-5, "output")
    assert_close_rel(gxq, gxr, 1e-5, "input gradient")
    assert set(gq) == set(gr) and len(gq) == (6 if use_dora else 4)
    for name in gr:
        assert_close_rel(gq[name], gr[name], 1e-5, name)


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_lora_gradients_through_triton_kernels(monkeypatch, use_dora):
    """fp16 activations on the Triton W4A16 kernels (interpreted on the CPU): forward kernel and input-gradient
    kernel are used, and the results match the float32 reference within fp16 accuracy."""
    from hf_fastpath.kernels import w4a16 as kernels

    calls = {"w4a16_matmul": 0, "w4a16_matmul_grad_input": 0}
    for name in calls:
        original = getattr(kernels, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counted)
    quant, ref = lora_pair(torch.float16, use_dora=use_dora)
    with w4a16_backend("kernel"):
        yq, yr, gxq, gxr, gq, gr = run_pair(quant, ref, torch.float16)
    assert calls["w4a16_matmul_grad_input"] == 2 and calls["w4a16_matmul"] >= 2
    assert_close_rel(yq, yr, 1e-2, "output")
    assert_close_rel(gxq, gxr, 2e-2, "input gradient")
    for name in gr:
        assert_close_rel(gq[name], gr[name], 3e-2, name)


@pytest.mark.parametrize("lora_bias", [False, True], ids=["fused", "lora_bias"])
def test_lora_in_bf16_matches_float32_with_fp32_adapter_grads(lora_bias):
    """bf16 activations: the adapter product runs in bf16 (fused addmm; PEFT's arithmetic when lora_B has a bias), the
    adapter weights and their gradients stay fp32, and output / gradients match the float32 reference."""
    quant, ref = lora_pair(torch.bfloat16, lora_bias=lora_bias)
    adapters = [p for n, p in quant.named_parameters() if p.requires_grad]
    assert adapters and all(p.dtype == torch.float32 for p in adapters)
    yq, yr, gxq, gxr, gq, gr = run_pair(quant, ref, torch.bfloat16)
    assert all(p.grad.dtype == torch.float32 for p in adapters)
    assert_close_rel(yq, yr, 2e-2, "output")
    assert_close_rel(gxq, gxr, 3e-2, "input gradient")
    assert set(gq) == set(gr) and len(gq) == (6 if lora_bias else 4)
    for name in gr:
        assert_close_rel(gq[name], gr[name], 3e-2, name)


# ---------------------------------------------------------------------------------------------------------------------
# models: all-linear, save / reload, merge


@pytest.fixture(scope="module")
def gptq_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("gptq_llama")
    write_quantized_checkpoint(tiny_model("llama"), path, QuantSpec("gptq", group_size=32, sym=False))
    return path


@pytest.mark.parametrize("family", ["llama", "gpt2", "falcon", "mistral", "qwen2", "qwen3", "gemma2", "mixtral",
                                    "qwen3_moe"])
def test_all_linear_targets_the_4bit_layers(tmp_path, family):
    from hf_fastpath.integrations.moe_experts import unfuse_experts

    float_model = tiny_model(family)
    unfuse_experts(float_model)  # mixtures of experts: quantized per expert, as gptqmodel saves them
    write_quantized_checkpoint(float_model, tmp_path, QuantSpec("gptq", group_size=32))
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    quantized = {name for name, m in model.named_modules() if isinstance(m, W4A16Linear)}
    assert quantized, "the checkpoint should load onto W4A16Linear layers"
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules="all-linear", task_type="CAUSAL_LM"))
    wrapped = {name.removeprefix("base_model.model.") for name, m in peft_model.named_modules()
               if isinstance(m, W4A16LoraLinear)}
    assert wrapped == quantized
    assert not isinstance(peft_model.get_output_embeddings(), W4A16LoraLinear)
    ids, mask = random_batch()
    assert torch.isfinite(peft_model(input_ids=ids, attention_mask=mask).logits).all()
    if "moe" in family or family == "mixtral":  # the experts' adapters train (one call per routed expert)
        assert any(".experts.3." in name for name in wrapped)
        peft_model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        grads = [p.grad for name, p in peft_model.named_parameters() if ".experts." in name and "lora_B" in name]
        assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
        assert any(g.abs().sum() > 0 for g in grads)
        with torch.no_grad():  # the adapter saves and reloads under the per-expert names
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
            want = peft_model(input_ids=ids, attention_mask=mask).logits
        peft_model.save_pretrained(tmp_path / "adapter")
        from peft import PeftModel

        again = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path), tmp_path / "adapter")
        with torch.no_grad():
            torch.testing.assert_close(again(input_ids=ids, attention_mask=mask).logits, want)


def test_register_is_idempotent():
    register()
    register()
    config = LoraConfig(r=2, target_modules="all-linear")
    assert config._custom_modules == {W4A16Linear: W4A16LoraLinear}


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_adapter_save_reload_identical(gptq_llama, tmp_path, use_dora):
    model = AutoModelForCausalLM.from_pretrained(gptq_llama)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=use_dora, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    randomize_adapters(peft_model)
    ids, mask = random_batch(left_pad=(3,))
    peft_model.eval()
    with torch.no_grad():
        before = peft_model(input_ids=ids, attention_mask=mask).logits
        base = peft_model.get_base_model()
        with peft_model.disable_adapter():
            plain = base(input_ids=ids, attention_mask=mask).logits
    assert (before - plain).abs().max() > 1e-3, "the adapter should change the output"
    peft_model.save_pretrained(tmp_path / "adapter")

    fresh = AutoModelForCausalLM.from_pretrained(gptq_llama)
    reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter")
    assert any(isinstance(m, W4A16LoraLinear) for m in reloaded.modules())
    reloaded.eval()
    with torch.no_grad():
        after = reloaded(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_merge_is_refused_and_merge_and_dequantize_matches(gptq_llama, use_dora):
    # PEFT refuses merging on a model marked as GPTQ itself; ours refuses for every W4A16 model (AWQ, in-memory RTN)
    gptq = get_peft_model(AutoModelForCausalLM.from_pretrained(gptq_llama), LoraConfig(r=2, target_modules="all-linear"))
    with pytest.raises((ValueError, NotImplementedError), match="gptq quantized|refused"):
        gptq.merge_and_unload()

    model = tiny_model("llama")
    quantize_model(model, W4A16Config(method="rtn", group_size=32))
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", use_dora=use_dora,
                                                  task_type="CAUSAL_LM"))
    randomize_adapters(peft_model)
    with pytest.raises(NotImplementedError, match="refused"):
        peft_model.merge_and_unload()
    with pytest.raises(NotImplementedError, match="merge_and_dequantize"):
        peft_model.merge_adapter()
    assert "re-quantiz" in MERGE_REFUSED
    ids, mask = random_batch()
    peft_model.eval()
    with torch.no_grad():
        want = peft_model(input_ids=ids, attention_mask=mask).logits
        merged = merge_and_dequantize(peft_model)
        got = merged(input_ids=ids, attention_mask=mask).logits
    assert not any(isinstance(m, (W4A16Linear, W4A16LoraLinear)) for m in merged.modules())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_unsupported_lora_options_fail_clearly():
    layer = MLP(random_w4a16(64, 40, 32), random_w4a16(40, 24, 8))
    with pytest.raises(ValueError, match="float base weight"):
        get_peft_model(copy.deepcopy(layer), LoraConfig(r=2, target_modules=["up"], init_lora_weights="pissa"))


# ---------------------------------------------------------------------------------------------------------------------
# prepare_model_for_qlora


def test_prepare_model_for_qlora_keeps_4bit_and_compute_dtype():
    model = tiny_model("llama", dtype=torch.bfloat16)
    quantize_model(model, W4A16Config(method="rtn", group_size=32))
    before = {n: (b.dtype, b.data_ptr()) for n, b in model.named_buffers() if ".mlp." in n or ".self_attn." in n}
    prepare_model_for_qlora(model)
    assert all(not p.requires_grad for p in model.parameters())
    after = {n: (b.dtype, b.data_ptr()) for n, b in model.named_buffers() if n in before}
    assert after == before, "packed weights, scales and zeros must not be touched"
    assert model.model.norm.weight.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.is_gradient_checkpointing and not model.config.use_cache

    seen = []
    for m in model.modules():
        if isinstance(m, W4A16Linear):
            m.register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    peft_model.train()
    ids, mask = random_batch()
    loss = peft_model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    assert seen and set(seen) == {torch.bfloat16}, "4-bit layers must see compute-dtype activations"
    grads = [p.grad for n, p in peft_model.named_parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    # lora_B starts at zero, so lora_A gets no gradient yet; lora_B of the lowest layer does
    assert peft_model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.grad.abs().sum() > 0

    ignored = ignore_quantized_buffers_in_ddp(peft_model)
    assert ignored and all(n.split(".")[-1] in ("qweight", "scales", "zeros", "perm") for n in ignored)
    assert set(ignored) <= set(peft_model._ddp_params_and_buffers_to_ignore)


def test_peft_prepare_model_for_kbit_training_on_a_gptq_checkpoint(gptq_llama):
    """PEFT's own recipe also works: a loaded GPTQ checkpoint is marked quantization_method='gptq', so PEFT leaves
    dtypes alone and turns on gradient checkpointing."""
    from peft import prepare_model_for_kbit_training

    model = AutoModelForCausalLM.from_pretrained(gptq_llama)
    assert getattr(model, "quantization_method", None) == "gptq"
    model = prepare_model_for_kbit_training(model)
    assert model.is_gradient_checkpointing
    assert all(m.qweight.dtype == torch.int32 for m in model.modules() if isinstance(m, W4A16Linear))
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    peft_model.train()
    ids, mask = random_batch()
    peft_model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    grads = [p.grad for p in peft_model.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)


# ---------------------------------------------------------------------------------------------------------------------
# convergence: a 30-step QLoRA run lowers the loss and tracks float LoRA


def _train(model, data, steps=30, lr=1e-2):
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                  task_type="CAUSAL_LM"))
    peft_model.train()
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    losses = []
    for step in range(steps):
        ids = data[step % len(data)]
        loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_qlora_run_lowers_loss_and_tracks_float_lora():
    float_model = tiny_model("llama", hidden_size=64, intermediate_size=128)
    quant_model = copy.deepcopy(float_model)
    quantize_model(quant_model, W4A16Config(method="rtn", group_size=32, sym=False))
    # The same network with dequantized weights: QLoRA must match LoRA on it up to float rounding.
    dequant_model = copy.deepcopy(float_model)
    for name, m in quant_model.named_modules():
        if isinstance(m, W4A16Linear):
            dequant_model.get_submodule(name).weight.data.copy_(m.dequantize())
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(1, 128, (4, 16), generator=g) for _ in range(3)]

    float_losses = _train(float_model, data)
    quant_losses = _train(quant_model, data)
    dequant_losses = _train(dequant_model, data)

    assert sum(quant_losses[-3:]) / 3 < quant_losses[0] - 0.5, quant_losses  # measured: 4.86 -> 4.08
    max_gap_exact = max(abs(a - b) for a, b in zip(quant_losses, dequant_losses))
    assert max_gap_exact < 1e-3, f"QLoRA differs from LoRA on the dequantized weights by {max_gap_exact:.2e}"
    # Tracking float LoRA: the 4-bit grid changes the weights a little, the curve must stay close (stated tolerance:
    # 0.05 nats mean, 0.15 nats max over 30 steps; measured 0.02 / 0.08).
    gaps = [abs(a - b) for a, b in zip(quant_losses, float_losses)]
    assert sum(gaps) / len(gaps) < 0.05 and max(gaps) < 0.15, gaps


# ---------------------------------------------------------------------------------------------------------------------
# the example under `accelerate launch` (CPU, gloo)


@pytest.fixture(scope="module")
def tiny_float_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_float")
    tiny_model("llama", vocab_size=256).save_pretrained(path)
    text = path / "corpus.txt"
    text.write_text("In the beginning God created the heaven and the earth. " * 40, encoding="utf-8")
    return path


def _launch(tiny_float_dir, out, processes, *extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TRITON_INTERPRET", None)
    # `accelerate launch --cpu` starts one process (multi-CPU needs mpirun); --multi_gpu goes through torchrun and
    # the script's --cpu makes Accelerate use the CPU and gloo.
    launcher = ["--multi_gpu", "--num_processes", str(processes)] if processes > 1 else ["--cpu", "--num_processes", "1"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launcher,
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           str(ROOT / "examples" / "qlora_finetune.py"), "--cpu",
           "--model", str(tiny_float_dir), "--quantize", "rtn", "--group-size", "32", "--dtype", "float32",
           "--tokenizer", "bytes", "--data", str(tiny_float_dir / "corpus.txt"), "--output", str(out),
           "--seq-len", "16", "--steps", "3", "--lr", "1e-2", *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = json.loads((out / "train_log.json").read_text())
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    return log


def test_example_accelerate_launch_two_processes(tiny_float_dir, tmp_path):
    log = _launch(tiny_float_dir, tmp_path / "loop", 2)
    assert log["processes"] == 2 and len(log["losses"]) == 3
    assert log["args"]["wrapped_as"] == "DistributedDataParallel"
    assert all(0 < entry["loss"] < 10 for entry in log["losses"])


def test_example_trainer_one_process(tiny_float_dir, tmp_path):
    log = _launch(tiny_float_dir, tmp_path / "trainer", 1, "--trainer", "--dora")
    assert log["processes"] == 1 and log["losses"]
    config = json.loads((tmp_path / "trainer" / "adapter_config.json").read_text())
    assert config["use_dora"] is True


# ---------------------------------------------------------------------------------------------------------------------
# torch FSDP2 (fully_shard) over a W4A16 + LoRA model: the 4-bit buffers stay replicated, LoRA grads are exact


def _fsdp2_worker(rank, world_size, result_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_model("llama")
    quantize_model(model, W4A16Config(method="rtn", group_size=32))
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    randomize_adapters(peft_model)
    reference = copy.deepcopy(peft_model)
    ids, mask = random_batch()
    reference(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in peft_model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(peft_model, mesh=mesh)
    peft_model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    want = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    got = {n: p.grad.full_tensor() for n, p in peft_model.named_parameters() if p.requires_grad}
    worst = max((got[n] - want[n]).abs().max().item() for n in want)
    if rank == 0:
        Path(result_path).write_text(json.dumps({"params": len(got), "expected": len(want), "worst": worst}))


def test_fsdp2_fully_shard_matches_unsharded(tmp_path):
    from hf_fastpath.parallel.launch import run_in_processes

    result = tmp_path / "fsdp2.json"
    run_in_processes(_fsdp2_worker, 2, str(result), env={"TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"})
    out = json.loads(result.read_text())
    assert out["params"] == out["expected"] > 0
    assert out["worst"] < 1e-6, out
