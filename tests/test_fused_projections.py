"""One W4A16 launch for layers that share an input: the kernel's segmented mode (`w4a16_matmul_concat`), the
back-to-back storage of sibling layers (`fuse_siblings`) and the model wiring (`fuse_projections`), against
the float reference and the unfused model, under TRITON_INTERPRET=1."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import transformers
from models import random_batch, tiny_model

import hf_fastpath
from hf_fastpath.integrations.transformers_quantizer import attach_quantization_config
from hf_fastpath.kernels import w4a16 as K
from hf_fastpath.kernels.common import WARNED
from hf_fastpath.quantization import W4A16Config, W4A16Linear, w4a16_backend
from hf_fastpath.quantization import fusion
from hf_fastpath.quantization.calibrate import quantize_model

BF16, F16 = torch.bfloat16, torch.float16


def _parts(k, ns, group, dtype, gen, back_to_back=True):
    """Random (qweight, scales, zeros) per width in ns (one allocation per tensor kind when back_to_back) and
    the float64 weight [K, sum ns]."""
    groups = k // group
    words = [k // 8 * n for n in ns]
    qflat = torch.empty(sum(words), dtype=torch.int32)
    sflat = torch.empty(groups * sum(ns), dtype=dtype)
    zflat = torch.empty_like(sflat)
    parts, refs, w0, g0 = [], [], 0, 0
    for n, size in zip(ns, words):
        codes = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
        q, s, z = qflat[w0:w0 + size].view(k // 8, n), sflat[g0:g0 + groups * n].view(groups, n), \
            zflat[g0:g0 + groups * n].view(groups, n)
        if not back_to_back:
            q, s, z = q.clone(), s.clone(), z.clone()
        q.copy_(K.w4a16_pack(codes))
        s.copy_(torch.rand(groups, n, generator=gen) / 16 + 0.01)
        z.copy_(torch.randint(0, 16, (groups, n), generator=gen).to(dtype))
        parts.append((q, s, z))
        refs.append((codes.double() - z.double().repeat_interleave(group, 0)) * s.double().repeat_interleave(group, 0))
        w0, g0 = w0 + size, g0 + groups * n
    return parts, torch.cat(refs, 1)


@pytest.mark.parametrize("k,ns,group,m,dtype", [
    (256, (128, 64, 64), 128, 1, BF16),  # q/k/v-like, group per K tile
    (384, (64, 128), 64, 5, F16),  # gate/up-like, two groups per K tile (per-plane scales)
    (264, (64, 64, 64), -1, 3, BF16),  # one group over a ragged K
    (256, (64, 192, 64), 32, 16, F16),
])
def test_concat_matches_float_reference(k, ns, group, m, dtype):
    gen = torch.Generator().manual_seed(k + m)
    parts, w = _parts(k, ns, k if group == -1 else group, dtype, gen)
    assert K.w4a16_back_to_back(parts)
    x = torch.randn(1, m, k, generator=gen).to(dtype)
    y = K.w4a16_matmul_concat(x, parts, group)
    ref = x.double() @ w
    assert y.shape == (1, m, sum(ns))
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    x2 = torch.randn(m + 24, k, generator=gen).to(dtype)  # one launch takes more rows too (the default is per part)
    ref2 = x2.double() @ w
    y2 = K.w4a16_matmul_concat_rows(x2, parts, k if group == -1 else group)
    assert ((y2.double() - ref2).abs().max() / ref2.abs().max()).item() < 1e-2


def test_concat_launches_once_only_for_back_to_back_parts(monkeypatch):
    """Separate allocations (or more rows than the fused kernel takes) give the same result, one call per part."""
    gen = torch.Generator().manual_seed(0)
    calls, original = [], K._decode_matmul

    def recorded(*args, **kwargs):
        calls.append(kwargs.get("segments"))
        return original(*args, **kwargs)

    monkeypatch.setattr(K, "_decode_matmul", recorded)
    together, w = _parts(128, (64, 64, 128), 128, BF16, gen)
    apart = [tuple(t.clone() for t in p) for p in together]
    assert not K.w4a16_back_to_back(apart)
    assert not K.w4a16_back_to_back(together[1:] + together[:1])  # back to back, but not in this order
    x = torch.randn(3, 128, generator=gen).to(BF16)
    one = K.w4a16_matmul_concat(x, together, 128)
    assert calls == [(64, 128)]
    calls.clear()
    three = K.w4a16_matmul_concat(x, apart, 128)
    assert calls == [None, None, None]
    torch.testing.assert_close(one, three, rtol=0, atol=0)


def test_concat_rejects_mismatched_parts():
    gen = torch.Generator().manual_seed(1)
    (a, *_), _ = _parts(128, (64,), 128, BF16, gen)
    (b, *_), _ = _parts(256, (64,), 128, BF16, gen)
    x = torch.randn(1, 128).to(BF16)
    with pytest.raises(ValueError, match="same K"):
        K.w4a16_matmul_concat(x, [a, b], 128)
    with pytest.raises(ValueError, match="1 to 3"):
        K.w4a16_matmul_concat(x, [a] * 4, 128)


# ---------------------------------------------------------------------------------------------------------- models


def _quantized(family, **overrides):
    model = tiny_model(family, dtype=F16, hidden_size=128, **overrides)
    quantize_model(model, W4A16Config(method="rtn", bits=4, group_size=32, sym=False))
    return model


@pytest.fixture
def concat_calls(monkeypatch):
    calls = []
    original = K.w4a16_matmul_concat_rows

    def counted(*args, **kwargs):
        calls.append(len(args[1]))
        return original(*args, **kwargs)

    monkeypatch.setattr(K, "w4a16_matmul_concat_rows", counted)
    return calls


@pytest.mark.parametrize("family,groups_per_layer,sizes", [("llama", 2, [3, 2]), ("gptj", 1, [3]),
                                                           ("qwen2", 2, [3, 2]), ("gemma2", 2, [3, 2]),
                                                           ("gpt_oss", 1, [3]), ("qwen2_moe", 2, [3, 2])])
def test_fused_model_matches_unfused(family, groups_per_layer, sizes, concat_calls):
    """Logits (padded batch) and greedy generation equal the unfused model's; each group ran as one launch; no
    layer keeps a handed-over output after the forward. (Qwen2: q/k/v biases; Qwen2-MoE: its shared expert's
    gate/up.)"""
    overrides = dict(intermediate_size=256) if family not in ("gptj", "gpt_oss") else {}
    if family in ("gemma2", "gpt_oss"):  # its head dim is set, not derived: as wide as the others' at hidden 128
        overrides.update(head_dim=32)
    if family == "gemma2":
        overrides.update(query_pre_attn_scalar=32)
    model = _quantized(family, **overrides)
    plain = copy.deepcopy(model)
    assert hf_fastpath.fuse_projections(model) == 2 * groups_per_layer
    ids, mask = random_batch(batch=2, seq=7, left_pad=(0, 3))
    with w4a16_backend("kernel"), torch.no_grad():
        fused_logits = model(ids, attention_mask=mask).logits
        assert concat_calls == sizes * 2  # per layer: q/k/v (3 parts) then gate/up (2; gpt-oss: fused experts)
        torch.testing.assert_close(fused_logits, plain(ids, attention_mask=mask).logits, rtol=1e-3, atol=1e-3)
        if family == "llama":  # (one family is enough for generation: the interpreter is slow)
            out = model.generate(ids[:1, :5], max_new_tokens=3, do_sample=False)
            assert out.tolist() == plain.generate(ids[:1, :5], max_new_tokens=3, do_sample=False).tolist()
    assert all(m._handoff == [None] for m in model.modules() if isinstance(m, W4A16Linear))


def test_fused_layers_keep_their_state_dict_and_grads(tmp_path):
    """Fusing re-stores tensors only: state_dict unchanged, save_pretrained reloads to the same model; with
    autograd each layer runs on its own (gradients as unfused); fuse_projections is idempotent (one hook)."""
    model = _quantized("llama", intermediate_size=256)
    attach_quantization_config(model, W4A16Config(method="rtn", bits=4, group_size=32, sym=False))
    plain = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert hf_fastpath.fuse_projections(model) == 4
    assert hf_fastpath.fuse_projections(model) == 4
    attn = model.model.layers[0].self_attn
    assert len(attn._forward_pre_hooks) == 1
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=F16, attn_implementation="eager")
    layers, again = ([m for m in net.modules() if isinstance(m, W4A16Linear)] for net in (model, reloaded))
    assert len(layers) == len(again) == 14
    assert all(torch.equal(a.dequantize(), b.dequantize()) for a, b in zip(layers, again))
    ids, _ = random_batch(batch=1, seq=6)
    grads = []
    with w4a16_backend("kernel"):
        for m in (model, plain):
            emb = m.get_input_embeddings()(ids).detach().requires_grad_()
            m(inputs_embeds=emb).logits.float().sum().backward()
            grads.append(emb.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-3)


def test_layer_called_with_another_input_computes_itself():
    """A handed-over output is only used for the very tensor it was computed from."""
    model = _quantized("llama", intermediate_size=256)
    hf_fastpath.fuse_projections(model)
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 3, 128).to(F16)
    with w4a16_backend("kernel"), torch.no_grad():
        fused_parts = fusion.ConcatForward()([mlp.gate_proj, mlp.up_proj], x)
        mlp.gate_proj._handoff[0] = (x, fused_parts[0] + 1)  # a wrong output for x ...
        other = x.clone()
        torch.testing.assert_close(mlp.gate_proj(other), fused_parts[0], rtol=0, atol=0)  # ... not used for a clone
        assert torch.equal(mlp.gate_proj(x), fused_parts[0] + 1)  # x itself takes the handed-over output, once
        assert mlp.gate_proj._handoff == [None]


def test_moved_tensors_are_stored_back_to_back_again(concat_calls):
    """After model.to(dtype) re-allocates scales, the layers are no longer back to back: the first call re-stores
    each group (one copy), and from then on each runs as one launch again, with the logits of the unfused model."""
    model = _quantized("llama", intermediate_size=256)
    hf_fastpath.fuse_projections(model)
    model.to(BF16)
    plain = copy.deepcopy(model)
    for m in plain.modules():
        if hasattr(m, fusion._GROUP_ATTR):
            m._forward_pre_hooks.clear()
    attn = model.model.layers[0].self_attn
    assert not K.w4a16_back_to_back([(p.qweight, p.scales, p.zeros) for p in (attn.q_proj, attn.k_proj, attn.v_proj)])
    ids, _ = random_batch(batch=1, seq=5)
    with w4a16_backend("kernel"), torch.inference_mode():
        moved = model(ids).logits
        assert concat_calls == [3, 2, 3, 2]
        assert not any(t.is_inference() for t in model.buffers())  # re-stored outside inference mode
        assert K.w4a16_back_to_back([(p.qweight, p.scales, p.zeros) for p in (attn.q_proj, attn.k_proj, attn.v_proj)])
        torch.testing.assert_close(moved, plain(ids).logits, rtol=1e-2, atol=1e-2)
        model(ids)
    assert len(concat_calls) == 8


def test_group_that_cannot_be_restored_runs_unfused_with_a_warning(caplog, concat_calls):
    """One layer of a group converted to another dtype since fusing: the group cannot be stored back to back again;
    one warning, each layer on its own (the other groups stay fused), same logits as without fusing."""
    model = _quantized("llama", intermediate_size=256)
    plain = copy.deepcopy(model)
    hf_fastpath.fuse_projections(model)
    for m in (model, plain):
        m.model.layers[0].self_attn.k_proj.to(BF16)
    ids, _ = random_batch(batch=1, seq=5)
    WARNED.discard("w4a16:siblings-refused")
    with w4a16_backend("kernel"), torch.no_grad(), caplog.at_level(logging.WARNING):
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-3, atol=1e-3)
    assert "can no longer be stored back to back" in caplog.text
    assert concat_calls == [2, 3, 2]  # layer 0: gate/up only


def test_input_on_another_device_is_left_to_the_layers(concat_calls):
    """An input that is not on the weights' device (a device-map hook inside a layer would move it) gets no
    one-launch result: the layers take it one by one."""
    model = _quantized("llama", intermediate_size=256)
    hf_fastpath.fuse_projections(model)
    attn = model.model.layers[0].self_attn
    layers = [attn.q_proj, attn.k_proj, attn.v_proj]
    group = getattr(attn, fusion._GROUP_ATTR)
    with w4a16_backend("kernel"), torch.no_grad():
        assert group.compute(layers, torch.zeros(1, 2, 128, dtype=F16, device="meta")) is None
        assert group.compute(layers, torch.zeros(1, 2, 128, dtype=F16)) is not None
    assert concat_calls == [3]


def test_quantizer_fuses_what_it_loads(tmp_path, monkeypatch, concat_calls):
    """from_pretrained of a 4-bit Llama checkpoint runs q/k/v and gate/up as one launch each, unless
    HF_FASTPATH_FUSE_PROJECTIONS=0."""
    model = _quantized("llama", intermediate_size=256)
    attach_quantization_config(model, W4A16Config(method="rtn", bits=4, group_size=32, sym=False))
    model.save_pretrained(tmp_path)
    ids, _ = random_batch(batch=1, seq=4)
    logits = []
    for flag in ("1", "0"):
        monkeypatch.setenv("HF_FASTPATH_FUSE_PROJECTIONS", flag)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=F16, attn_implementation="eager")
        fused = [hasattr(m, fusion._GROUP_ATTR) for m in loaded.modules()]
        assert sum(fused) == (4 if flag == "1" else 0)
        with w4a16_backend("kernel"), torch.no_grad():
            logits.append(loaded(ids).logits)
        assert concat_calls == [3, 2, 3, 2]  # the unfused load adds none
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-3, atol=1e-3)


def test_wrapped_layer_disables_its_group(concat_calls):
    """A layer replaced since fusing (PEFT wraps q_proj in a LoRA layer) turns its group off; others stay fused."""
    model = _quantized("llama", intermediate_size=256)
    hf_fastpath.fuse_projections(model)
    attn = model.model.layers[0].self_attn
    attn.q_proj = torch.nn.Sequential(attn.q_proj)
    ids, _ = random_batch(batch=1, seq=4)
    with w4a16_backend("kernel"), torch.no_grad():
        model(ids)
    assert concat_calls == [2, 3, 2]  # layer 0: gate/up only; layer 1: both groups


def test_fused_model_compiles_in_one_graph():
    torch._dynamo.reset()
    model = _quantized("llama", intermediate_size=256)
    hf_fastpath.fuse_projections(model)
    ids, _ = random_batch(batch=1, seq=6)
    with w4a16_backend("kernel"), torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model.forward, backend="aot_eager", fullgraph=True)(input_ids=ids).logits
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_unsupported_groups_are_left_alone():
    """Widths that are not multiples of the column block (hidden 64: k/v 32 wide), other model types."""
    model = tiny_model("llama", dtype=F16, intermediate_size=128)
    quantize_model(model, W4A16Config(method="rtn", bits=4, group_size=32, sym=False))
    assert hf_fastpath.fuse_projections(model) == 2  # gate/up (128 wide) only
    assert not hasattr(model.model.layers[0].self_attn, fusion._GROUP_ATTR)
    gpt2 = _quantized("gpt2")
    assert hf_fastpath.fuse_projections(gpt2) == 0


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_gpu_decode_configs_under_the_interpreter(m):
    """The launch configs the GPU picks for few rows (`_decode_config(..., interpret=False)`: 1-8-row tiles, 128 or
    256 columns), run by the interpreter on one layer, split over K, and on back-to-back parts (segmented): the
    CPU run checks the kernel's indexing at the GPU's tile sizes, which the interpreter's own configs do not use."""
    gen = torch.Generator().manual_seed(m)
    k, ns, group = 512, (256, 256, 512), 128
    n = sum(ns)
    parts, w_parts = _parts(k, ns, group, BF16, gen)
    (one,), w_one = _parts(k, (n,), group, BF16, gen)
    x = torch.randn(m, k, generator=gen).to(BF16)
    for wide in (False, True):  # N < 12288 (q/k/v-like) and N >= 12288 (gate/up-like) configs
        cfg = K._decode_config(m, k, 12288 if wide else n, False, True)
        cfg = {key: v for key, v in cfg.items() if key != "per_sm"}
        for split_k, segments in ((1, None), (2, None), (2, (ns[0], ns[0] + ns[1]))):
            weights, w = (parts[0], w_parts) if segments else (one, w_one)
            out = torch.empty(m, n, dtype=BF16)
            K._decode_matmul(x, *weights, group, out, cfg=cfg, split_k=split_k, segments=segments)
            ref = x.double() @ w
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2, (cfg, split_k, segments, err)
