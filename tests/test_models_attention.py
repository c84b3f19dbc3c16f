"""`fastpath` attention inside real Transformers models (tiny random configs of the six families, fp32).

Reference: `eager`, except ALiBi Falcon, whose eager path in Transformers 5.x adds the ALiBi bias twice (once in the
scores, once folded into the 4-D mask); there we compare with `sdpa`, which (like the original Falcon code) adds it
once. Under the test suite's TRITON_INTERPRET=1 the real Triton kernels run (interpreted).
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import transformers

import hf_fastpath  # noqa: F401  (registers the attention names)
from hf_fastpath.attention import attention, reference
from hf_fastpath.integrations import transformers_attention as ta
from hf_fastpath.kernels.common import WARNED
from models import FAMILIES, random_batch, tiny_config, tiny_model

ATOL = 2e-5


@pytest.fixture
def reference_kernel():
    """Run `fastpath` on the reference kernel: the wiring is what these tests check, and the interpreted Triton
    kernels are too slow for the whole model matrix on CI's two cores (the `real_kernel` tests below run them)."""
    ta.register_attention_variant("fastpath", functools.partial(attention, backend="reference"))
    yield
    ta.register_attention_variant("fastpath", ta._builtin_kernel("auto"))


def _reference_impl(family: str) -> str:
    return "sdpa" if family == "falcon_alibi" else "eager"


def _attention_modules(model):
    return [m for name, m in model.named_modules() if name.endswith(("self_attention", ".attn", "self_attn",
                                                                     ".attention"))]


# ---------------------------------------------------------------------------------------------------------------
# Model level


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_logits_and_grads_match_reference(reference_kernel, family):
    _check_padded_batch(family)


def _check_padded_batch(family):
    ref = tiny_model(family, _reference_impl(family))
    fast = tiny_model(family, "fastpath")
    ids, mask = random_batch(3, 11, left_pad=(3, 0, 0), right_pad=(0, 4, 0), seed=1)
    real = mask.bool()
    weights = torch.randn(3, 11, ref.config.vocab_size)
    results = []
    for model in (ref, fast):
        logits = model(ids, attention_mask=mask).logits
        (logits * weights)[real].sum().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l_ref, g_ref), (l_fast, g_fast) = results
    torch.testing.assert_close(l_fast[real], l_ref[real], atol=ATOL, rtol=1e-4)
    assert g_ref.keys() == g_fast.keys()
    for name in g_ref:
        if g_ref[name] is None:
            assert g_fast[name] is None, name
            continue
        torch.testing.assert_close(g_fast[name], g_ref[name], atol=1e-4, rtol=1e-3, msg=lambda m: f"{name}: {m}")


def _packed_inputs(lengths=(5, 7, 4), seed=2):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, 128, (n,), generator=g) for n in lengths]
    ids = torch.cat(seqs)[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return seqs, ids, position_ids, cu, max(lengths)


@pytest.mark.parametrize("family", ["llama", "falcon"])
def test_packed_training_batch_with_a_cache_is_kept_apart(reference_kernel, family):
    # use_cache is on by default: Transformers' mask does not look at position_ids then, the adapter does (training)
    model = tiny_model(family, "fastpath").train()
    seqs, ids, position_ids, _, _ = _packed_inputs()
    packed = model(ids, position_ids=position_ids).logits[0]
    with torch.no_grad():
        alone = torch.cat([model(s[None]).logits[0] for s in seqs])
    torch.testing.assert_close(packed.detach(), alone, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_batch_equals_sequences_one_by_one(reference_kernel, family):
    _check_packed_batch(family)


def _check_packed_batch(family):
    model = tiny_model(family, "fastpath")
    seqs, ids, position_ids, cu, longest = _packed_inputs()
    with torch.no_grad():
        alone = torch.cat([model(s[None]).logits[0] for s in seqs])
        # padding-free training batch (no KV cache: GPT-BigCode's attention never sees position_ids, so its packing
        # is detected by Transformers' mask preparation, which only looks when there is no cache)
        by_positions = model(ids, position_ids=position_ids, use_cache=False).logits[0]
        collated = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")(
            [{"input_ids": s.tolist()} for s in seqs])
        assert torch.equal(collated["cu_seq_lens_q"], cu) and torch.equal(collated["position_ids"], position_ids)
        by_cu_seqlens = model(**collated, use_cache=False).logits[0]  # (inference with a cache: as Transformers)
    if family != "gpt_oss":  # its model builds masks without position_ids: Transformers (eager too) sees one sequence
        torch.testing.assert_close(by_positions, alone, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(by_cu_seqlens, alone, atol=ATOL, rtol=1e-4)


def _generate(model, ids, mask, max_new_tokens=4, **kw):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_matches_reference(reference_kernel, family, cache):
    ref = tiny_model(family, _reference_impl(family))
    fast = tiny_model(family, "fastpath")
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    # Transformers' own ALiBi Falcon cannot generate with a static cache (build_alibi_tensor gets a 4-D mask):
    # compare with its dynamic-cache run, which must give the same tokens anyway.
    ref_kw = {} if family == "falcon_alibi" else kw
    left_padded = random_batch(2, 7, left_pad=(3, 0), seed=3)
    no_padding = random_batch(1, 6, seed=4)
    for ids, mask in (left_padded, no_padding):
        seq_ref, logits_ref = _generate(ref, ids, mask, **ref_kw)
        seq_fast, logits_fast = _generate(fast, ids, mask, **kw)
        torch.testing.assert_close(logits_fast, logits_ref, atol=ATOL, rtol=1e-4)
        assert torch.equal(seq_fast, seq_ref)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_sliding_window_static_cache_with_padding_matches_eager(reference_kernel, family):
    # past the window (8) a full sliding layer keeps the last positions: slot j holds position kv_offset + j, and
    # the padding of a left-padded row must follow its positions, not its slots
    ref, fast = tiny_model(family, "eager"), tiny_model(family, "fastpath")
    ids, mask = random_batch(2, 7, left_pad=(3, 0), seed=3)
    seq_ref, logits_ref = _generate(ref, ids, mask, max_new_tokens=8, cache_implementation="static")
    seq_fast, logits_fast = _generate(fast, ids, mask, max_new_tokens=8, cache_implementation="static")
    torch.testing.assert_close(logits_fast, logits_ref, atol=ATOL, rtol=1e-4)
    assert torch.equal(seq_fast, seq_ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_set_attn_implementation_on_loaded_model(reference_kernel, family):
    fast = tiny_model(family, "fastpath")
    model = tiny_model(family, "eager")
    ids, mask = random_batch(2, 9, left_pad=(2,), seed=5)
    calls = []

    def counting_kernel(q, k, v, sinks=None, **kw):
        calls.append(q.shape)
        return attention(q, k, v, backend="reference", sinks=sinks, **kw)

    model.set_attn_implementation("fastpath")
    assert model.config._attn_implementation == "fastpath"
    ta.register_attention_variant("fastpath", counting_kernel)  # the fixture restores the real one
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
    ta.register_attention_variant("fastpath", functools.partial(attention, backend="reference"))
    assert len(calls) == model.config.num_hidden_layers
    with torch.no_grad():
        want = fast(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=1e-4)
    # and back: the eager implementation is restored (Falcon swaps its attention classes back)
    model.set_attn_implementation(_reference_impl(family))
    ref = tiny_model(family, _reference_impl(family))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).logits[real],
                                   ref(ids, attention_mask=mask).logits[real], atol=ATOL, rtol=1e-4)


def test_falcon_alibi_eager_is_ours(reference_kernel, monkeypatch):
    """Pins down why ALiBi Falcon is compared with SDPA: Transformers 5.17-5.24 eager adds the ALiBi bias to the
    scores AND folds it into the 4-D mask; doubling our slopes reproduces it exactly (padding included), so
    everything else (slope values, bf16 rounding, scaling before 1/sqrt(d), positions counted from the first real
    token) matches. From 5.25 (attention interface, the bias only in the mask) eager is ours as it is."""
    from transformers.models.falcon import modeling_falcon

    from hf_fastpath.integrations import falcon

    eager = tiny_model("falcon_alibi", "eager")
    fast = tiny_model("falcon_alibi", "fastpath")
    ids, mask = random_batch(3, 10, left_pad=(4, 0, 0), right_pad=(0, 3, 0), seed=12)
    real = mask.bool()
    single = falcon.falcon_alibi_slopes
    with torch.no_grad():
        want = eager(ids, attention_mask=mask).logits
        if hasattr(modeling_falcon, "FALCON_ATTENTION_CLASSES"):
            ours = fast(ids, attention_mask=mask).logits
            assert (ours[real] - want[real]).abs().max() > 1e-3  # the bias really is doubled there
            monkeypatch.setattr(falcon, "falcon_alibi_slopes", lambda n, device=None: 2 * single(n, device))
            for module in fast.modules():  # each module keeps the slopes it made (`alibi_slopes_of`)
                module.__dict__.pop("_fastpath_alibi_slopes", None)
        ours = fast(ids, attention_mask=mask).logits
    torch.testing.assert_close(ours[real], want[real], atol=ATOL, rtol=1e-4)


def test_falcon_alibi_slopes_match_transformers():
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    from hf_fastpath.integrations.falcon import falcon_alibi_slopes

    for heads in (1, 3, 4, 6, 16, 71):
        alibi = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), heads, torch.float32)  # [H, 1, 2]
        torch.testing.assert_close(falcon_alibi_slopes(heads), alibi[:, 0, 1], atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# The same through the real Triton kernels (interpreted on CI's CPU: a few cases only)


@pytest.mark.parametrize("family", ["llama", "falcon_alibi", "gpt_bigcode", "gpt_oss"])
def test_real_kernel_padded_batch_logits_and_grads(family):
    _check_padded_batch(family)


def test_real_kernel_packed_batch():
    _check_packed_batch("falcon_gqa")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_real_kernel_half_precision_padded_forward(dtype):
    ref = tiny_model("llama", "eager")
    fast = tiny_model("llama", "fastpath", dtype=dtype)
    ids, mask = random_batch(2, 9, left_pad=(3, 0), right_pad=(0, 2), seed=13)
    real = mask.bool()
    with torch.no_grad():
        got = fast(ids, attention_mask=mask).logits
        want = ref(ids, attention_mask=mask).logits
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got[real].float(), want[real], atol=3e-2, rtol=3e-2)


def test_real_kernel_static_cache_generate():
    ref, fast = tiny_model("gpt_neox", "eager"), tiny_model("gpt_neox", "fastpath")
    for ids, mask in (random_batch(2, 6, left_pad=(2, 0), seed=10), random_batch(1, 5, seed=11)):
        seq_ref, logits_ref = _generate(ref, ids, mask, cache_implementation="static", max_new_tokens=2)
        seq_fast, logits_fast = _generate(fast, ids, mask, cache_implementation="static", max_new_tokens=2)
        torch.testing.assert_close(logits_fast, logits_ref, atol=ATOL, rtol=1e-4)
        assert torch.equal(seq_fast, seq_ref)


# ---------------------------------------------------------------------------------------------------------------
# Registration and plug-in variants


def test_register_is_idempotent_and_registers_masks():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.models.falcon import modeling_falcon

    from hf_fastpath.integrations import falcon

    ta.register()
    ta.register()
    for name in ("fastpath", "fastpath_triton", "fastpath_fa2", "fastpath_fa3", "fastpath_fa4"):
        assert name in AttentionInterface._global_mapping
        assert AttentionMaskInterface._global_mapping[name] is ta.fastpath_mask
        if hasattr(modeling_falcon, "FALCON_ATTENTION_CLASSES"):  # class-based Falcon (Transformers <= 5.24)
            assert name in modeling_falcon.FALCON_ATTENTION_CLASSES
        else:  # ALiBi goes to the kernel as slopes under our names (falcon.py)
            assert name in falcon._OUR_NAMES and isinstance(vars(modeling_falcon.FalconModel)["use_alibi"], property)


@pytest.mark.parametrize("bad", ["my_flash_attn", "org/kernel", "fastpath:x", "sdpa_fast"])
def test_variant_names_transformers_treats_specially_are_refused(bad):
    with pytest.raises(ValueError, match="Pick another name"):
        ta.register_attention_variant(bad, reference.attention_forward)


def _recording_kernel(calls):
    def kernel(q, k, v, *, causal, softmax_scale, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
               max_seqlen_k=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0):
        calls.append(dict(q=q, k=k, causal=causal, varlen=cu_seqlens_q is not None, dropout_p=dropout_p,
                          alibi=alibi_slopes is not None))
        out, _ = reference.attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                             cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                             window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
        return out

    return kernel


@pytest.mark.parametrize("family", ["llama", "falcon_gqa", "falcon_alibi", "gpt_bigcode"])
def test_plugin_variant_gets_unrepeated_strided_views(family):
    calls = []
    ta.register_attention_variant("fastpath_test_plugin", _recording_kernel(calls))
    model = tiny_model(family, "fastpath_test_plugin")
    ids, _ = random_batch(2, 8, seed=6)
    with torch.no_grad():
        model(ids)
    assert len(calls) == model.config.num_hidden_layers
    cfg = model.config
    expected_kv = {"llama": 2, "falcon_gqa": 2, "falcon_alibi": 4, "gpt_bigcode": 1}[family]
    for call in calls:
        assert call["k"].shape[2] == expected_kv  # GQA / MQA heads not repeated
        assert call["causal"] and not call["varlen"] and call["dropout_p"] == 0.0
        assert call["alibi"] == (family == "falcon_alibi")
        assert call["q"].shape == (2, 8, cfg.num_attention_heads, 16)


def test_dropout_goes_to_kernels_that_have_it():
    calls = []
    ta.register_attention_variant("fastpath_test_dropout", _recording_kernel(calls))
    model = tiny_model("llama", "fastpath_test_dropout", attention_dropout=0.25).train()
    ids, mask = random_batch(2, 6, left_pad=(2,), seed=7)
    model(ids, attention_mask=mask)
    assert [c["dropout_p"] for c in calls] == [0.25, 0.25]
    assert all(c["varlen"] for c in calls)


def test_dropout_without_kernel_support_falls_back_to_sdpa_with_one_warning(caplog):
    def no_dropout_kernel(q, k, v, *, dropout_p=0.0, **kw):
        if dropout_p:
            raise NotImplementedError("no dropout here")
        return reference.attention_forward(q, k, v, **kw)[0]

    ta.register_attention_variant("fastpath_test_nodropout", no_dropout_kernel)
    WARNED.discard("adapter:dropout:fastpath_test_nodropout")
    model = tiny_model("llama", "fastpath_test_nodropout", attention_dropout=0.3).train()
    ids, mask = random_batch(2, 6, left_pad=(2,), seed=8)
    with caplog.at_level(logging.WARNING, logger=ta.__name__):
        for _ in range(2):
            logits = model(ids, attention_mask=mask).logits
            logits[mask.bool()].sum().backward()
    assert sum("no dropout" in r.getMessage() for r in caplog.records) == 1
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # dropout 0 in training, or eval mode: the kernel itself, same numbers as eager
    model.eval()
    eager = tiny_model("llama", "eager", attention_dropout=0.3)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).logits[mask.bool()],
                                   eager(ids, attention_mask=mask).logits[mask.bool()], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "falcon_alibi"])
def test_training_with_attention_dropout_on_fastpath(reference_kernel, family):
    """Our kernels have no dropout: `fastpath` falls back to SDPA for those training steps (warned once); the
    dropout really is applied there (two steps differ), and eval mode is deterministic and equals the reference."""
    dropout = {"attention_dropout": 0.5}
    model = tiny_model(family, "fastpath", **dropout).train()
    ids, mask = random_batch(2, 8, left_pad=(2,), seed=14)
    real = mask.bool()
    first = model(ids, attention_mask=mask).logits[real]
    second = model(ids, attention_mask=mask).logits[real]
    assert not torch.allclose(first, second)
    second.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    ref = tiny_model(family, _reference_impl(family), **dropout)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).logits[real],
                                   ref(ids, attention_mask=mask).logits[real], atol=ATOL, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# The adapter alone, against a dense masked reference


class _Module(torch.nn.Module):
    is_causal = True


def _dense_reference(q, k, v, keep, scale, softcap=0.0):
    """q `[B,Hq,Sq,D]`, k/v `[B,Hkv,Skv,D]`, keep `[B,Sq,Skv]` bool -> `[B,Sq,Hq,D]` (zeros where nothing is seen)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~keep[:, None], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bhkd->bqhd", p, v).float()


class _CrossModule(torch.nn.Module):
    is_causal = False


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sq,skv", [(9, 9), (1, 9), (3, 9)])
def test_adapter_padding_decode_window_softcap(sq, skv, causal):
    g = torch.Generator().manual_seed(9)
    b, hq, hkv, d = 3, 4, 2, 16
    q = torch.randn(b, hq, sq, d, generator=g)
    k, v = torch.randn(b, hkv, skv, d, generator=g), torch.randn(b, hkv, skv, d, generator=g)
    pad = torch.ones(b, skv, dtype=torch.bool)
    pad[0, :3] = False  # left padding
    pad[1, :1] = False
    i = torch.arange(sq)[:, None] + skv - sq
    j = torch.arange(skv)[None]
    module = _Module() if causal else _CrossModule()  # non-causal with sq != skv: cross-attention
    for window, softcap in ((None, 0.0), (4, 0.0), (None, 5.0)):
        keep = ((j <= i) if causal else torch.ones(sq, skv, dtype=torch.bool))[None] & pad[:, None, :]
        if window is not None:
            keep = keep & (j > i - window)[None]
            if not causal:
                keep = keep & (j < i + window)[None]
        kwargs = {"sliding_window": window} if window else {}
        out, weights = ta.VARIANTS["fastpath"](module, q, k, v, pad, scaling=0.3, softcap=softcap or None, **kwargs)
        assert weights is None and out.shape == (b, sq, hq, d)
        want = _dense_reference(q, k, v, keep, 0.3, softcap)
        # padded query rows are unspecified (self-attention); cross-attention keeps every query row
        rows = pad[:, -sq:] if (causal or sq == skv) else torch.ones(b, sq, dtype=torch.bool)
        torch.testing.assert_close(out[rows], want[rows], atol=ATOL, rtol=1e-4)
        assert torch.isfinite(out).all()


def test_static_cache_mask_is_one_shape_for_every_step():
    # prefill of 5 tokens into a 16-slot static cache, no padding: 1 = a token, -1 = a slot not reached yet
    mask = ta.fastpath_mask(batch_size=2, q_length=5, kv_length=16, q_offset=torch.tensor(0), kv_offset=0,
                            attention_mask=None, device=torch.device("cpu"))
    assert mask.dtype == torch.int8 and mask.shape == (2, 16)
    assert mask[:, :5].eq(1).all() and mask[:, 5:].eq(-1).all()
    # decode step 3 tokens later, first row left-padded by 2: 0 = padding; same shape (no recompilation)
    pad = torch.ones(2, 8, dtype=torch.bool)
    pad[0, :2] = False
    mask = ta.fastpath_mask(batch_size=2, q_length=1, kv_length=16, q_offset=torch.tensor(7), kv_offset=0,
                            attention_mask=pad)
    assert mask.shape == (2, 16)
    assert mask[0].tolist() == [0, 0] + [1] * 6 + [-1] * 8 and mask[1].tolist() == [1] * 8 + [-1] * 8
    # the adapter hands the kernel the padding and the keys in use, computed on the device
    args = ta._static_cache_args(mask)
    assert args["seqused_k"].tolist() == [8, 8] and args["key_mask"] is mask
    # dynamic cache / no cache: nothing to mask
    assert ta.fastpath_mask(batch_size=2, q_length=1, kv_length=8, q_offset=7, attention_mask=None) is None
    assert ta.fastpath_mask(batch_size=2, q_length=8, kv_length=8, attention_mask=torch.ones(2, 8, dtype=bool)) is None


def test_mask_arguments_are_reused_per_mask_and_die_with_it():
    # every layer of one forward gets the same derived tensors; none outlives the mask (a tensor kept across
    # generate() calls moves the next static cache, and CUDA graphs then re-record every call)
    import gc
    import weakref

    mask = ta.fastpath_mask(batch_size=1, q_length=1, kv_length=8, q_offset=torch.tensor(3), kv_offset=0,
                            attention_mask=None, device=torch.device("cpu"))
    first = ta._static_cache_args(mask)
    assert ta._static_cache_args(mask)["seqused_k"] is first["seqused_k"]
    seqused = weakref.ref(first["seqused_k"])
    slot = id(mask)
    del mask, first
    gc.collect()
    assert seqused() is None and slot not in ta._SEQUSED


def test_equal_cu_seq_lens_reach_the_kernel_as_one_tensor_once_per_forward(monkeypatch):
    # DataCollatorWithFlattening hands over cu_seq_lens_q and _k as two equal tensors; kernels that need queries and
    # keys packed alike (Gluon) see one tensor. Proving it reads them once (one sync) for all layers of a forward.
    reads = []
    real_equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: reads.append(1) or real_equal(a, b))
    q = torch.zeros(1, 9, 2, 16)
    cu_q, cu_k = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    for _ in range(3):  # three layers
        plan = ta._plan("fastpath", None, q, q, dict(cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=5,
                                                     max_length_k=5))
        assert plan["cu_seqlens_q"] is plan["cu_seqlens_k"] and plan["cu_seqlens_q"].tolist() == [0, 4, 9]
    assert len(reads) == 1
    other = torch.tensor([0, 5, 9], dtype=torch.int32)
    plan = ta._plan("fastpath", None, q, q, dict(cu_seq_lens_q=cu_q, cu_seq_lens_k=other))
    assert plan["cu_seqlens_q"] is not plan["cu_seqlens_k"] and plan["cu_seqlens_k"].tolist() == [0, 5, 9]
    plan = ta._plan("fastpath", None, q, q, dict(cu_seq_lens_q=cu_q.long()))  # one given: both, int32
    assert plan["cu_seqlens_q"] is plan["cu_seqlens_k"] and plan["cu_seqlens_q"].dtype == torch.int32


# ---------------------------------------------------------------------------------------------------------------
# Bad input


def test_float64_model_is_refused_with_a_hint():
    model = tiny_model("llama", "fastpath", dtype=torch.float64)
    with pytest.raises(TypeError, match="float16, bfloat16 and float32.*model.to"):
        model(torch.ones(1, 4, dtype=torch.long))


def test_head_dim_over_256_is_refused():
    model = tiny_model("gpt_neox", "fastpath", hidden_size=288, num_attention_heads=1, intermediate_size=32)
    with pytest.raises(ValueError, match="head dims up to 256.*sdpa"):
        model(torch.ones(1, 4, dtype=torch.long))


def test_unsupported_device_and_custom_4d_float_mask_are_refused():
    fn = ta.VARIANTS["fastpath"]
    q = torch.randn(1, 2, 4, 16, device="meta")
    with pytest.raises(RuntimeError, match="CUDA GPUs.*sdpa"):
        fn(_Module(), q, q, q, None)
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="2-D padding mask.*4-D"):
        fn(_Module(), q, q, q, torch.zeros(1, 1, 4, 4))
    with pytest.raises(NotImplementedError, match="per-token attention sinks"):  # Inkling's; gpt-oss's are s_aux
        fn(_Module(), q, q, q, None, sinks=torch.zeros(1, 2, 4, 1))


def test_dense_bool_masks_run_our_kernel_where_they_can_and_sdpa_elsewhere(reference_kernel, caplog):
    """A [B, 1, Sq, Skv] bool mask (an overlay model's, e.g. Gemma-3's image blocks, or a user's): causal + padding
    becomes our kernel's padding mask; anything else (a bidirectional block) runs through SDPA with one warning,
    matching the dense definition either way."""
    fn = ta.VARIANTS["fastpath"]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 9, 16, generator=g) for h in (4, 2, 2))
    real = torch.ones(2, 9, dtype=torch.bool)
    real[1, :3] = False
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    plain = causal[None] & real[:, None, :]
    overlay = plain.clone()
    overlay[:, 4:7, 4:7] = True  # one bidirectional block (an image)
    overlay[1, 4:7, :3] = False
    WARNED.discard("adapter:dense-mask:fastpath")
    for keep, warned in ((plain, False), (overlay, True)):
        caplog.clear()
        with caplog.at_level("WARNING"):
            out, _ = fn(_Module(), q, k, v, keep[:, None], scaling=0.25)
        assert ("run through PyTorch SDPA" in caplog.text) == warned
        want = _dense_reference(q, k, v, keep, 0.25)
        torch.testing.assert_close(out[real], want[real], atol=ATOL, rtol=1e-4)
    WARNED.discard("adapter:dense-mask:fastpath")


def _tiny_gemma3_vlm(impl):
    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, num_hidden_layers=2, max_position_embeddings=128, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=4)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=299, boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    model.set_attn_implementation(impl)
    return model


def test_gemma3_image_tokens_keep_their_bidirectional_attention(reference_kernel, caplog):
    """Gemma-3's image tokens see their whole image (an overlay on the causal mask): those layers' calls go to SDPA
    (one warning) instead of silently running causal; text-only calls stay on our kernel."""
    WARNED.discard("adapter:dense-mask:fastpath")
    ids = torch.tensor([[5, 6, 297, 299, 299, 299, 299, 298, 7, 8, 9, 10],
                        [0, 0, 11, 297, 299, 299, 299, 299, 298, 12, 13, 14]])  # left padding in row 1
    mask = (ids != 0).long()
    kw = dict(input_ids=ids, attention_mask=mask, token_type_ids=(ids == 299).long(),
              pixel_values=torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)))
    ref, fast = _tiny_gemma3_vlm("eager"), _tiny_gemma3_vlm("fastpath")
    with torch.no_grad(), caplog.at_level("WARNING"):
        text_only = fast(input_ids=ids[:, :3], attention_mask=mask[:, :3]).logits
        assert "run through PyTorch SDPA" not in caplog.text
        got = fast(**kw).logits
        assert "run through PyTorch SDPA" in caplog.text
        want = ref(**kw).logits
        text_ref = ref(input_ids=ids[:, :3], attention_mask=mask[:, :3]).logits
        torch.testing.assert_close(text_only[:, 2:], text_ref[:, 2:], atol=ATOL, rtol=1e-4)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=1e-4)
    WARNED.discard("adapter:dense-mask:fastpath")


def test_sliding_window_taken_from_the_layer_when_not_passed(reference_kernel):
    """Qwen2-MoE's attention does not pass `sliding_window` to the attention function; its sliding layers keep it
    as an attribute (the mask function alone would have given them full causal attention)."""
    overrides = dict(use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    ref, fast = tiny_model("qwen2_moe", "eager", **overrides), tiny_model("qwen2_moe", "fastpath", **overrides)
    ids, mask = random_batch(2, 12, left_pad=(3, 0), seed=2)
    with torch.no_grad():
        got, want = fast(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_llama4_chunked_attention_matches_eager(reference_kernel, cache):
    """Llama-4's chunked layers (4-token chunks here): past the first chunk a query sees only its own chunk; those
    calls (prefill and decode) run on the mask through SDPA instead of silently attending causally."""
    config = transformers.Llama4TextConfig(vocab_size=128, pad_token_id=0, eos_token_id=0, bos_token_id=0,
                                           hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           num_hidden_layers=2, max_position_embeddings=64, num_local_experts=2,
                                           attention_chunk_size=4, tie_word_embeddings=False)
    ref, fast = (tiny_model("llama", impl, config=config) for impl in ("eager", "fastpath"))
    ids, mask = random_batch(2, 11, left_pad=(3, 0), seed=3)
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    seq_ref, logits_ref = _generate(ref, ids, mask, **kw)
    seq_fast, logits_fast = _generate(fast, ids, mask, **kw)
    torch.testing.assert_close(logits_fast, logits_ref, atol=ATOL, rtol=1e-4)
    assert torch.equal(seq_fast, seq_ref)
    WARNED.discard("adapter:dense-mask:fastpath")


def test_models_that_compute_attention_themselves_refuse_our_names():
    """Bloom adds its own ALiBi scores to the mask: with our name it used to fail on our 2-D mask deep inside its
    attention (other such models silently ran their own eager code). Now the choice itself is refused."""
    config = transformers.BloomConfig(vocab_size=128, hidden_size=64, n_head=4, n_layer=2)
    with pytest.raises(ValueError, match=r"BloomForCausalLM computes attention in its own code.*'sdpa' or 'eager'"):
        transformers.AutoModelForCausalLM.from_config(config, attn_implementation="fastpath")
    # (set_attn_implementation on such a model warns and keeps its attention: Transformers' own check)
    assert ta.uses_attention_interface(tiny_model("llama")) and ta.uses_attention_interface(tiny_model("falcon"))


def test_missing_forced_backend_fails_clearly():
    """`fastpath_fa3` on a machine without FA3 must name what is missing, not silently run something else."""
    pytest.importorskip("transformers")
    try:
        import flash_attn_interface  # noqa: F401

        pytest.skip("FA3 is installed here")
    except ImportError:
        pass
    model = tiny_model("llama", "fastpath_fa3")
    with pytest.raises((ImportError, RuntimeError, NotImplementedError, ValueError), match="(?i)fa3|flash"):
        model(torch.ones(1, 4, dtype=torch.long))


def test_attention_sinks_on_a_variant_without_them_fail_clearly():
    model = tiny_model("gpt_oss", "fastpath_fp8")
    with pytest.raises(NotImplementedError, match=r"fastpath_fp8 attention has no attention sinks \(`s_aux`\)"):
        model(torch.ones(1, 4, dtype=torch.long))


def test_tiny_configs_are_what_the_docs_say():
    for family in FAMILIES:
        cfg = tiny_config(family)
        assert cfg.vocab_size == 128 and cfg.num_hidden_layers == 2
        assert isinstance(cfg, transformers.PretrainedConfig)


def test_fp4_attention_with_fp8_backward_as_a_registered_variant():
    """The README's recipe: a model trains through FP4 attention whose backward runs its P/dS products in e4m3;
    gradients close to the bf16 backward's (same forward), but not equal."""
    hf_fastpath.register_attention_variant("fastpath_fp4_fp8bwd",
                                           functools.partial(hf_fastpath.fp4_attention, backward="fp8"))
    ids, mask = random_batch(batch=1, seq=10)
    grads = []
    for name in ("fastpath_fp4", "fastpath_fp4_fp8bwd"):
        model = tiny_model("llama", name)
        model(ids, attention_mask=mask, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.isfinite(grads[1]).all() and not torch.equal(*grads)
    assert torch.nn.functional.cosine_similarity(*grads, 0) > 0.99
