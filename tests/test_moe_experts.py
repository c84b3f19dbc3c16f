"""Mixture-of-experts experts as per-expert linears (`integrations.moe_experts`): the same model as Transformers'
fused experts, quantized per expert by GPTQ / AWQ / RTN, and all experts of a projection in one W4A16 launch."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_fastpath.integrations.moe_experts import UnfusedExperts, expert_linear_names, unfuse_experts
from hf_fastpath.quantization import W4A16Config, w4a16_backend
from hf_fastpath.quantization.calibrate import _stages, quantize_model
from hf_fastpath.quantization.awq import AWQSettings, awq_block
from hf_fastpath.quantization.blocks import (BlockInputs, InputGroup, capture_block_inputs, find_decoder_layers,
                                             find_linears, run_block)
from hf_fastpath.quantization.linear import W4A16Linear
from models import random_batch, tiny_model

MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"]
# (gate, up, down): Mixtral's checkpoints name them w1 / w3 / w2; gpt-oss's (fused on the Hub) take the defaults
NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
         "qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "gpt_oss": ("gate_proj", "up_proj", "down_proj")}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_unfused_experts_compute_what_the_fused_ones_do(family):
    """Logits and gradients equal to the fused model's (gpt-oss: interleaved gate/up, biases, transposed weights)."""
    fused = tiny_model(family)
    model = tiny_model(family)
    assert expert_linear_names(model.config.model_type) == NAMES[family]
    assert len(unfuse_experts(model)) == model.config.num_hidden_layers
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, UnfusedExperts) and len(experts) == 4
    gate, up, down = NAMES[family]
    assert {f"model.layers.1.mlp.experts.3.{n}.weight" for n in (gate, up, down)} <= set(model.state_dict())
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in model.state_dict())
    ids, mask = random_batch(2, 12, left_pad=(3,))
    for m in (fused, model):
        m.train()
        m(ids, attention_mask=mask, labels=ids).loss.backward()
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, fused(ids, attention_mask=mask).logits,
                               rtol=1e-5, atol=1e-5)
    fused_gate_up = fused.model.layers[1].mlp.experts.gate_up_proj.grad[2]
    if family == "gpt_oss":  # [in, 2 * out], gate and up interleaved
        fused_gate = fused_gate_up[:, ::2].t()
    else:  # [2 * out, in], gate first
        fused_gate = fused_gate_up[: fused_gate_up.shape[0] // 2]
    torch.testing.assert_close(getattr(experts[2], gate).weight.grad, fused_gate, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(model.model.embed_tokens.weight.grad, fused.model.embed_tokens.weight.grad,
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family,act_order", [(f, False) for f in MOE_FAMILIES] + [("mixtral", True)])
def test_grouped_w4a16_experts_match_one_call_per_expert(family, act_order):
    """The grouped launch (rows sorted by expert, a tile table) against each expert's own W4A16 layer, prefill and
    one-token decode, in the model; act-order experts (GPTQ desc_act: each row's input gathered in its expert's
    order) too."""
    model = tiny_model(family, dtype=torch.bfloat16)
    if act_order:
        quantize_model(model, W4A16Config(method="gptq", bits=4, group_size=32, desc_act=True),
                       calibration_ids=torch.randint(1, 100, (4, 16), generator=torch.Generator().manual_seed(0)))
    else:
        quantize_model(model, W4A16Config(method="rtn", bits=4, group_size=32))
    experts = model.model.layers[0].mlp.experts
    assert all(isinstance(linear, W4A16Linear) for expert in experts for linear in expert.children())
    assert all((linear.perm is not None) == act_order for expert in experts for linear in expert.children())
    ids, mask = random_batch(2, 12, left_pad=(3,))
    with torch.no_grad(), w4a16_backend("kernel"):
        for batch in ((ids, mask), (ids[:, :1], None)):
            got = model(batch[0], attention_mask=batch[1]).logits.float()
            assert experts._stacks[2] is not None and experts._stacks[2]["act_order"] == act_order  # grouped ran
            per_expert = experts._routed_forward
            experts.forward = per_expert  # one W4A16 call per expert instead
            try:
                want = model(batch[0], attention_mask=batch[1]).logits.float()
            finally:
                del experts.forward
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_grouped_experts_drop_rows_routed_to_another_ranks_experts(monkeypatch):
    """Under expert parallelism Transformers routes to index E for experts held elsewhere: those rows add nothing
    (the launch leaves rows no tile covers unwritten: NaN here), as in the per-expert path."""
    from hf_fastpath.kernels import w4a16

    launch = w4a16.w4a16_experts_matmul_rows

    def unwritten_as_nan(x2, qweight, scales, zeros, group_size, tiles, *args, **kwargs):
        out = launch(x2, qweight, scales, zeros, group_size, tiles, *args, **kwargs)
        covered = torch.zeros(out.shape[0], dtype=torch.bool)
        for _, lo, hi in tiles.tolist():
            covered[lo:hi] = True
        return out.masked_fill(~covered[:, None], float("nan"))

    monkeypatch.setattr(w4a16, "w4a16_experts_matmul_rows", unwritten_as_nan)
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    quantize_model(model, W4A16Config(method="rtn", bits=4, group_size=32))
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, model.config.hidden_size, generator=gen).to(torch.bfloat16)
    index = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(6)])
    index[::2, 1] = len(experts)  # every other token's second expert lives on another rank
    weights = torch.softmax(torch.randn(6, 2, generator=gen), 1).to(torch.bfloat16)
    with torch.no_grad(), w4a16_backend("kernel"):
        got = experts(x, index, weights).float()
        assert experts._stacks[2] is not None
        want = experts._routed_forward(x, index, weights).float()
        assert experts(x[:0], index[:0], weights[:0]).shape == (0, x.shape[1])  # no token at all
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_true_sequential_gptq_takes_one_stage_per_expert_role():
    groups = [InputGroup(["self_attn.q_proj", "self_attn.k_proj"]), InputGroup(["self_attn.o_proj"]),
              *[g for e in range(3) for g in (InputGroup([f"mlp.experts.{e}.w1", f"mlp.experts.{e}.w3"]),
                                              InputGroup([f"mlp.experts.{e}.w2"]))]]
    routed = {f"mlp.experts.{e}.{n}": f"mlp.experts.*.{n}" for e in range(3) for n in ("w1", "w3", "w2")}
    stages = _stages(groups, routed)
    assert [[g.names[0] for g in s] for s in stages] == [
        ["self_attn.q_proj"], ["self_attn.o_proj"], [f"mlp.experts.{e}.w1" for e in range(3)],
        [f"mlp.experts.{e}.w2" for e in range(3)]]


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_experts_without_calibration_tokens_are_rounded(method, caplog):
    """An expert no calibration token reaches still gets quantized (round to nearest) instead of failing the run;
    GPTQ beats plain rounding on the experts that do get tokens."""
    model = tiny_model("mixtral", hidden_size=128, intermediate_size=256)
    rtn = tiny_model("mixtral", hidden_size=128, intermediate_size=256)
    ids = torch.randint(1, 100, (4, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = model(ids).logits
    unfuse_experts(model)
    for layer in model.model.layers:  # route expert 3's tokens to expert 0
        layer.mlp.experts.register_forward_pre_hook(lambda m, args: (args[0], args[1].masked_fill(args[1] == 3, 0),
                                                                     args[2]))
    for layer in rtn.model.layers:
        layer.mlp.experts.register_forward_pre_hook(lambda m, args: (args[0], args[1].masked_fill(args[1] == 3, 0),
                                                                     args[2]))
    with torch.no_grad():
        rerouted = model(ids).logits
    calibration = torch.randint(1, 100, (8, 32), generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.INFO, logger="hf_fastpath.quantization.calibrate"):
        quantize_model(model, dict(method=method, bits=3, group_size=32), calibration_ids=calibration)
    assert isinstance(model.model.layers[1].mlp.experts[3].w2, W4A16Linear)
    if method == "gptq":
        assert "no calibration token reached 1 expert(s) (e.g. mlp.experts.3.w1+mlp.experts.3.w3): rounded" in \
            caplog.text
        assert "(e.g. mlp.experts.3.w2)" in caplog.text
        quantize_model(rtn, dict(method="rtn", bits=3, group_size=32))
        with torch.no_grad():
            errors = {name: float((m(ids).logits - rerouted).norm()) for name, m in (("gptq", model), ("rtn", rtn))}
        assert errors["gptq"] < errors["rtn"], errors
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    assert not torch.equal(rerouted, reference)  # the reroute did change the model (expert 3 was in use)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_awq_scales_experts_from_the_norm_and_each_down_from_its_up(family):
    """AWQ on unfused experts, the float function kept: all experts' gate / up (and a shared expert's) take one set
    of scales from the norm before the router, the router taking them back; each expert's down folds into its own
    up, searched on its own tokens (AutoAWQ's Mixtral treatment), but
    not where down's input is not linear in up (gpt-oss's clamped (up + 1) * glu(gate))."""
    model = tiny_model(family)
    unfuse_experts(model)
    ids, _ = random_batch(2, 16)
    with torch.no_grad():
        reference = model(ids).logits
    _, layers = find_decoder_layers(model)
    inputs = capture_block_inputs(model, layers[0], torch.randint(1, 100, (4, 16)), 4, "cpu")
    gate, up, down = NAMES[family]
    downs_before = [getattr(layers[0].mlp.experts[e], down).weight.detach().clone() for e in range(4)]
    reports = []
    for layer in layers:
        reports.append(awq_block(layer, inputs, find_linears(layer), AWQSettings(group_size=32, n_grid=6, clip=False)))
        inputs = BlockInputs(run_block(layer, inputs), inputs.kwargs)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference, rtol=1e-5, atol=2e-5)
    router = "mlp.router" if family == "gpt_oss" else "mlp.gate"
    for report in reports:
        norm_fold = [r for r in report if " <- post_attention_layernorm: " in r]
        assert len(norm_fold) == 1 and "mlp.experts" in norm_fold[0].split(" <- ")[0], report
        assert norm_fold[0].endswith(" compensated)") and router in norm_fold[0], norm_fold
        if family == "qwen2_moe":  # the shared expert and its one-output gate read the same input
            assert norm_fold[0].startswith("mlp.shared_expert.gate_proj+mlp.shared_expert.up_proj+mlp.experts+"
                                           "mlp.shared_expert_gate <-"), norm_fold
        downs = [r for r in report if r.startswith("mlp.experts.") and f".{down}" in r.split(":")[0].split(" ")[0]]
        assert len(downs) == 4, report
        if family == "gpt_oss":
            assert all(r.endswith("routed expert, no scales of its own") for r in downs), downs
            continue
        folded = [r for r in downs if " <- " in r]
        assert len(folded) >= 3, downs  # 64 tokens, top-2 of 4 experts: an expert with no token is unlikely
        for r in folded:
            expert = r.split(".")[2]
            assert r.startswith(f"mlp.experts.{expert}.{down} <- mlp.experts.{expert}.{up}: "), r
    changed = [e for e in range(4) if not torch.equal(getattr(layers[0].mlp.experts[e], down).weight,
                                                      downs_before[e])]
    assert (changed == []) == (family == "gpt_oss"), changed


def test_saving_after_the_grouped_launch_reloads_exactly(tmp_path):
    """The grouped launch re-stores every expert's tensors as views of one allocation per kind; save_pretrained
    must still write each expert's own tensors (no shared-memory refusal, nothing lost) and reload them."""
    import transformers

    import hf_fastpath

    tiny_model("qwen3_moe").save_pretrained(tmp_path / "fp")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp", dtype=torch.bfloat16, quantization_config=hf_fastpath.W4A16Config(method="rtn", group_size=32))
    ids, mask = random_batch(2, 12)
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad(), w4a16_backend("kernel"):
        logits = model(ids, attention_mask=mask).logits
        assert experts._stacks[2] is not None
        storages = {getattr(e, n).qweight.untyped_storage().data_ptr() for e in experts
                    for n in ("gate_proj", "up_proj")}
        assert len(storages) == 1  # one allocation behind every expert's gate / up
        model.save_pretrained(tmp_path / "q")
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.bfloat16)
        assert isinstance(reloaded.model.layers[0].mlp.experts, UnfusedExperts)
        assert torch.equal(reloaded(ids, attention_mask=mask).logits, logits)


def test_per_expert_path_under_cuda_graph_capture_is_a_clear_error(monkeypatch):
    """One call per expert reads the routing on the host (`.tolist()`): inside a CUDA graph capture that would fail
    with a bare CUDA error; it says what to change instead."""
    model = tiny_model("mixtral")
    unfuse_experts(model)
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(3, model.config.hidden_size)
    index, weights = torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.full((3, 2), 0.5)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA graph cannot capture that.*W4A16Linear"):
        experts(x, index, weights)
