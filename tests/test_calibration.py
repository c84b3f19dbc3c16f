"""GPTQ, AWQ and RTN calibration: the algorithms on single linears, AWQ's scale folding on every family, and whole tiny
models of every family quantized, saved and reloaded."""

from __future__ import annotations

import pytest
import torch

from hf_fastpath.quantization.awq import AWQSettings, awq_block
from hf_fastpath.quantization.blocks import (BlockInputs, capture_block_inputs, find_decoder_layers, find_linears,
                                             run_block)
from hf_fastpath.quantization.calibrate import quantize_model
from hf_fastpath.quantization.gptq import GPTQ
from hf_fastpath.quantization.rtn import rtn_quantize
from tests.models import BASE_FAMILIES, FAMILIES, VOCAB, random_batch, tiny_model


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # These tests run thousands of tiny ops: thread hand-offs cost more than they save (badly so on a shared CPU).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def correlated_inputs(m: int, k: int, seed: int = 0) -> torch.Tensor:
    """Activations with correlated channels, a few outlier channels and a non-zero mean, like a real layer's."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5
    x = torch.randn(m, k, generator=g) @ mix + 0.3 * torch.randn(k, generator=g)
    x[:, torch.randperm(k, generator=g)[: k // 16]] *= 6
    return x


def output_error(x, w, w_hat) -> float:
    return float(((x @ w.t() - x @ w_hat.t()) ** 2).sum())


# ------------------------------------------------------------------------------------------------ single linears


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("desc_act,static_groups", [(False, False), (True, False), (True, True), (False, True)])
def test_gptq_beats_rtn_on_layer_output(bits, sym, desc_act, static_groups):
    k, n, gs = 160, 48, 32
    x = correlated_inputs(1024, k)
    w = torch.randn(n, k) * 0.02
    gptq = GPTQ(k)
    for chunk in x.split(300):  # several batches: the running Hessian mean must equal one big batch
        gptq.add_batch(chunk)
    torch.testing.assert_close(gptq.H, 2 * x.t() @ x / x.shape[0], rtol=1e-4, atol=1e-4)
    q, _ = gptq.quantize(w, bits=bits, group_size=gs, sym=sym, desc_act=desc_act, static_groups=static_groups)
    rtn = rtn_quantize(w, bits=bits, group_size=gs, sym=sym)
    ratio = output_error(x, w, q.dequantize()) / output_error(x, w, rtn.dequantize())
    assert ratio < 0.75, f"GPTQ/RTN output error ratio {ratio:.3f}"
    assert q.codes.min() >= 0 and q.codes.max() < 2**bits
    assert q.scales.shape == (k // gs, n) and q.g_idx.shape == (k,)
    if desc_act and not static_groups:
        # act-order: groups follow the permuted order, so g_idx is not monotonic but every group keeps gs members
        assert (q.g_idx[1:] < q.g_idx[:-1]).any()
        assert torch.bincount(q.g_idx.long()).tolist() == [gs] * (k // gs)
    else:
        assert torch.equal(q.g_idx, torch.arange(k, dtype=torch.int32) // gs)


def test_gptq_group_size_not_dividing_and_dead_inputs():
    k, n, gs = 200, 40, 64  # 4 groups, the last one 8 wide
    x = correlated_inputs(512, k)
    x[:, 5] = 0  # an input that is always zero
    w = torch.randn(n, k)
    gptq = GPTQ(k)
    gptq.add_batch(x)
    q, _ = gptq.quantize(w, bits=4, group_size=gs, sym=False)
    assert q.scales.shape == (4, n)
    assert torch.all(q.dequantize()[:, 5] == 0)
    rtn = rtn_quantize(w, bits=4, group_size=gs, sym=False)
    assert output_error(x, w, q.dequantize()) < 0.75 * output_error(x, w, rtn.dequantize())


def test_gptq_without_calibration_input_raises():
    with pytest.raises(RuntimeError, match="add_batch"):
        GPTQ(8).quantize(torch.randn(4, 8))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_rtn_error_is_within_half_a_step(bits, sym, group_size):
    w = torch.randn(24, 128) * torch.rand(24, 1)
    q = rtn_quantize(w, bits=bits, group_size=group_size, sym=sym)
    step = q.scales[q.g_idx.long()].t()  # [N, K]
    # (the scale is rounded to fp16: at the clamped end the error may exceed half a step by maxq fp16 ulps)
    assert torch.all((q.dequantize() - w).abs() <= step * (0.5 + 2**bits * 2**-11) + 1e-6)
    assert q.scales.shape[0] == (1 if group_size == -1 else 128 // group_size)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [32, -1])
def test_rtn_asym_recovers_weights_already_on_the_grid(bits, group_size):
    k, n = 128, 24
    gs = k if group_size == -1 else group_size
    maxq = 2**bits - 1
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, maxq + 1, (k, n), generator=g)
    codes[::gs] = maxq  # every group spans the whole grid, so RTN must find the same scale and zero
    codes[1::gs] = 0
    scales = (torch.rand(k // gs, n, generator=g) + 0.5).half().float()
    zeros = torch.randint(1, maxq, (k // gs, n), generator=g)
    gi = torch.arange(k) // gs
    w = (scales[gi] * (codes - zeros[gi])).t()
    q = rtn_quantize(w, bits=bits, group_size=group_size, sym=False)
    assert torch.equal(q.codes, codes.int()) and torch.equal(q.zeros, zeros.int())
    torch.testing.assert_close(q.dequantize(), w, rtol=0, atol=1e-6)


def test_rtn_rejects_unsupported_bits():
    with pytest.raises(ValueError, match="bits"):
        rtn_quantize(torch.randn(4, 8), bits=5)


# ------------------------------------------------------------------------------------------------ AWQ folding


@pytest.mark.parametrize("family", FAMILIES)
def test_awq_scale_folding_keeps_the_float_function(family):
    model = tiny_model(family)
    ids, _ = random_batch(2, 16)
    with torch.no_grad():
        reference = model(ids).logits
    name, layers = find_decoder_layers(model)
    inputs = capture_block_inputs(model, layers[0], torch.randint(1, VOCAB, (4, 16)), 4, "cpu")
    folded = []
    for layer in layers:
        report = awq_block(layer, inputs, find_linears(layer), AWQSettings(group_size=32, n_grid=6, clip=False))
        folded += [r for r in report if "<-" in r]
        inputs = BlockInputs(run_block(layer, inputs), inputs.kwargs)
    with torch.no_grad():
        out = model(ids).logits
    # Every family folds into its norms (and MLP activations): scales really moved somewhere.
    assert len(folded) >= 2 * len(layers), folded
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=2e-5)


# ------------------------------------------------------------------------------------------------ whole models


@pytest.fixture(scope="module")
def calibration_ids():
    return torch.randint(1, VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", BASE_FAMILIES)
@pytest.mark.parametrize("method", ["gptq", "awq", "rtn"])
def test_tiny_model_quantizes_and_reloads(family, method, calibration_ids, tmp_path):
    from transformers import AutoModelForCausalLM

    import hf_fastpath
    from hf_fastpath.quantization.linear import W4A16Linear

    model = tiny_model(family)
    model.save_pretrained(tmp_path / "fp")
    ids, _ = random_batch(2, 12)
    with torch.no_grad():
        fp_logits = model(ids).logits
    config = hf_fastpath.W4A16Config(method=method, bits=4, group_size=32, dataset=calibration_ids.tolist(),
                                     num_samples=8, seq_len=32, desc_act=(method == "gptq" and family == "llama"))
    quantized = AutoModelForCausalLM.from_pretrained(tmp_path / "fp", quantization_config=config, dtype=torch.float32)
    layers = [m for m in quantized.modules() if isinstance(m, W4A16Linear)]
    assert len(layers) == len([m for m in model.modules() if m is not model.get_output_embeddings()
                               and (isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D")])
    with torch.no_grad():
        q_logits = quantized(ids).logits
    rel = float((q_logits - fp_logits).norm() / fp_logits.norm())
    assert 0 < rel < 0.3, f"quantized model drifted too far from the float one: {rel:.3f}"

    quantized.save_pretrained(tmp_path / "q")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32)
    saved = reloaded.config.quantization_config
    saved = saved["quant_method"] if isinstance(saved, dict) else saved.quant_method
    assert getattr(saved, "value", saved) == ("awq" if method == "awq" else "gptq")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, q_logits, rtol=1e-5, atol=1e-5)


def test_gptq_true_sequential_beats_rtn_on_a_model(calibration_ids):
    ids = torch.randint(1, VOCAB, (4, 32), generator=torch.Generator().manual_seed(2))
    errors = {}
    for method in ("rtn", "gptq"):
        model = tiny_model("llama", hidden_size=128, intermediate_size=256)
        with torch.no_grad():
            reference = model(ids).logits
        quantize_model(model, dict(method=method, bits=3, group_size=32), calibration_ids=calibration_ids)
        with torch.no_grad():
            errors[method] = float((model(ids).logits - reference).norm())
    assert errors["gptq"] < errors["rtn"], errors


def test_unknown_method_is_a_clear_error():
    with pytest.raises(ValueError, match="method"):
        quantize_model(tiny_model("llama"), dict(method="smoothquant"))
