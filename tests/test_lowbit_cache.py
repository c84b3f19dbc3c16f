"""Low-bit KV cache (Transformers Cache subclass) and the packed split-KV decode kernel."""

import inspect

import pytest
import torch
from transformers import DynamicCache

from hf_fastpath.attention import lowbit, reference
from hf_fastpath.integrations.lowbit_cache import LowBitCache, PackedKV
from hf_fastpath.kernels import lowbit_decode as ld
from hf_fastpath.kernels import lowbit_quant as lq
from tests.models import tiny_model

# worst-case relative error of one cached value against its token's max |x| (see test_lowbit_quant)
REL = {"fp8": 2 ** -4, "mxfp4": 1 / 3, "nvfp4": (1 + 2 ** -4) / 6}


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
def test_update_and_read_equal_bf16_cache_within_format_error(fmt):
    cache, ref = LowBitCache(fmt), DynamicCache()
    chunks = [torch.randn(2, 2, n, 32, dtype=torch.bfloat16) for n in (7, 1, 1, 70)]
    for i, c in enumerate(chunks):
        k, v = cache.update(c, -c, 0)
        rk, rv = ref.update(c, -c, 0)
        assert k.shape == rk.shape and k.dtype == rk.dtype
        bound = rk.float().abs().amax(-1, keepdim=True) * REL[fmt] * 1.01
        assert bool(((k.float() - rk.float()).abs() <= bound).all())
        assert bool(((v.float() - rv.float()).abs() <= bound).all())
    assert cache.get_seq_length() == 79
    # tokens are quantized once: reading again after more appends gives the same numbers for old tokens
    k_again, _ = cache.update(chunks[0][:, :, :1], chunks[0][:, :, :1], 0)
    assert torch.equal(k_again[:, :, :79], k)
    cache.crop(-5)
    assert cache.get_seq_length() == 75


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4", "nvfp4"])
def test_decode_kernel_matches_reference(fmt):
    b, hq, hkv, s, d = 2, 8, 2, 75, 64
    q = torch.randn(b, hq, d, dtype=torch.bfloat16)
    k, v = torch.randn(b, hkv, s + 13, d), torch.randn(b, hkv, s + 13, d)  # capacity beyond the valid length
    if fmt == "bf16":
        kc, vc = (k.bfloat16(), None, None), (v.bfloat16(), None, None)
        kd, vd = k.bfloat16().float(), v.bfloat16().float()
    else:
        qk, qv = lq.quantize_rows(k, fmt), lq.quantize_rows(v, fmt)
        kc, vc = (qk.data, qk.scale, qk.block_scale), (qv.data, qv.scale, qv.block_scale)
        kd, vd = lq.dequantize_rows(qk), lq.dequantize_rows(qv)
    out, lse = ld.lowbit_decode(q, kc, vc, s, fmt=fmt, softmax_scale=0.3)
    ro, rl = reference.attention_forward(q.float()[:, None], kd[:, :, :s].transpose(1, 2),
                                         vd[:, :, :s].transpose(1, 2), softmax_scale=0.3)
    torch.testing.assert_close(lse, rl[:, :, 0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.float(), ro[:, 0], atol=1e-2, rtol=1e-2)  # bf16 P and output rounding


def test_packed_kv_stand_in_is_safe():
    cache = LowBitCache("mxfp4", packed_decode=True)
    x = torch.randn(1, 2, 9, 32)
    cache.update(x, x, 0)
    k, v = cache.update(x[:, :, :1], x[:, :, :1], 0)
    assert isinstance(k, PackedKV) and k.shape == (1, 2, 10, 32)
    kt = k.transpose(1, 2)
    assert isinstance(kt, PackedKV) and kt.shape == (1, 10, 2, 32)
    full = cache.layers[0].k_store.dequantize(torch.float32)
    torch.testing.assert_close(k * 1.0, full)  # any other op dequantizes
    torch.testing.assert_close(kt.sum(), full.sum())


def _cache_keyword(model) -> str:
    """How forward and generate take a KV cache: `cache` since Transformers 5.24, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@pytest.mark.parametrize("fmt,attn,packed", [("fp8", "eager", False), ("mxfp4", "fastpath_fp4", True),
                                             ("fp8", "fastpath_fp8", True)])
def test_decode_steps_with_lowbit_cache(fmt, attn, packed, monkeypatch):
    """Prefill then teacher-forced decode steps: logits close to eager attention on a bf16-exact cache."""
    import hf_fastpath  # noqa: F401  (registers the attention names)

    calls = []
    real = lowbit._packed_decode
    monkeypatch.setattr(lowbit, "_packed_decode", lambda *a: calls.append(1) or real(*a))
    ids = torch.randint(1, 128, (2, 12))
    steps = torch.randint(1, 128, (2, 3))
    ref_model = tiny_model("llama", "eager", hidden_size=128)
    model = tiny_model("llama", attn, hidden_size=128)
    ref_cache, cache = DynamicCache(), LowBitCache(fmt, packed_decode=packed)
    with torch.no_grad():
        kw = _cache_keyword(model)
        ref = [ref_model(ids, **{kw: ref_cache}).logits[:, -1]]
        got = [model(ids, **{kw: cache}).logits[:, -1]]
        for t in range(steps.shape[1]):
            ref.append(ref_model(steps[:, t:t + 1], **{kw: ref_cache}).logits[:, -1])
            got.append(model(steps[:, t:t + 1], **{kw: cache}).logits[:, -1])
    assert cache.get_seq_length() == 15
    assert len(calls) == (3 * 2 if packed else 0)  # every decode step of both layers read the packed cache
    for a, b in zip(ref, got):
        cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), 0)
        assert cos > (0.999 if fmt == "fp8" else 0.99), cos


def test_generate_accepts_lowbit_cache():
    import hf_fastpath  # noqa: F401

    model = tiny_model("llama", "fastpath_fp8", hidden_size=128)
    cache = LowBitCache("nvfp4", packed_decode=True)
    out = model.generate(torch.randint(1, 128, (1, 6)), max_new_tokens=4, do_sample=False,
                         **{_cache_keyword(model): cache})
    assert out.shape == (1, 10) and cache.get_seq_length() == 9


def test_bad_format():
    with pytest.raises(ValueError, match="unknown KV cache format"):
        LowBitCache("int4")
