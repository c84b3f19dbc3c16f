"""Models with head dim 128 (and 96, 256) on `attn_implementation="fastpath"` with the Gluon kernels: Llama-shaped for
padded and packed batches, Mistral-shaped (a sliding window), Gemma-2-27B-shaped (sliding-window layers, soft-capped
scores) and Falcon with ALiBi (Falcon-RW, BLOOM's scheme), and GPT-NeoX at head dim 96 (GPT-NeoX-20B's, which the Gluon
kernels pad to 128-wide tiles), and Gemma-2 at head dim 256 (Gemma-2-9B's), against Transformers' eager attention in
float32: logits of the real tokens and every parameter's gradient within 2x the error of Transformers' "sdpa" in
bfloat16 (eager in bfloat16 for Gemma-2: "sdpa" ignores the soft-cap) plus a small floor (run on an H200:
`TRITON_INTERPRET=0 pytest tests/gpu/test_models_gluon_gpu.py`). Skipped without an sm_90 GPU."""

from __future__ import annotations

import pytest
import torch

import hf_fastpath  # noqa: F401 - registers "fastpath"
from hf_fastpath.attention import backends
from hf_fastpath.kernels import gluon_attention as ga

from tests.gpu.common import needs_sm90_gluon

pytestmark = needs_sm90_gluon(ga.HAS_GLUON)


SHAPE = dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=1024,
             num_hidden_layers=2, vocab_size=1000)
CONFIGS = {"llama": ("LlamaConfig", {}), "mistral": ("MistralConfig", dict(sliding_window=64)),
           # a small cap, so that it bends random models' scores (the real one is 50)
           "gemma2": ("Gemma2Config", dict(sliding_window=64, attn_logit_softcapping=5.0, query_pre_attn_scalar=128)),
           # Gemma-2-9B's head dim 256 (the Gluon backward's 64-key, head-dim-split kernel)
           "gemma2_256": ("Gemma2Config", dict(head_dim=256, sliding_window=64, attn_logit_softcapping=5.0,
                                               query_pre_attn_scalar=256)),
           # head dim 512 / 4 = 128 (Falcon derives it; None drops SHAPE's)
           "falcon_alibi": ("FalconConfig", dict(alibi=True, multi_query=False, new_decoder_architecture=False,
                                                 parallel_attn=False, bias=True, head_dim=None)),
           # head dim 384 / 4 = 96, rotary on a quarter of it (GPT-NeoX derives the head dim; None drops SHAPE's)
           "neox96": ("GPTNeoXConfig", dict(hidden_size=384, rotary_pct=0.25, head_dim=None, num_key_value_heads=None))}
PEER = {"llama": "sdpa", "mistral": "sdpa", "gemma2": "eager", "gemma2_256": "eager", "falcon_alibi": "sdpa",
        "neox96": "sdpa"}


def _model(impl, dtype, family):
    import transformers

    name, extra = CONFIGS[family]
    cfg = getattr(transformers, name)(**{k: v for k, v in {**SHAPE, **extra}.items() if v is not None})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=impl)
    return model.to("cuda", dtype).train()  # the same weights in every dtype


def _run(impl, inputs, family, dtype=torch.bfloat16):
    model = _model(impl, dtype, family)
    out = model(**inputs)
    out.loss.backward()
    return out.logits.float(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family, batch", [("llama", "padded"), ("llama", "packed"), ("mistral", "plain"),
                                           ("mistral", "padded"), ("gemma2", "plain"), ("gemma2", "packed"),
                                           ("llama", "collated"), ("gemma2", "collated"), ("falcon_alibi", "plain"),
                                           ("falcon_alibi", "padded"), ("neox96", "padded"), ("neox96", "packed"),
                                           ("gemma2_256", "plain"), ("gemma2_256", "packed")])
def test_fastpath_matches_eager(monkeypatch, family, batch):
    chosen = []
    select = backends.select_backend
    monkeypatch.setattr(backends, "select_backend", lambda *a, **k: chosen.append(select(*a, **k)) or chosen[-1])
    torch.manual_seed(1)
    ids = torch.randint(0, 1000, (2, 300), device="cuda")
    if batch == "padded":
        mask = torch.ones_like(ids)
        mask[0, 211:] = 0  # right padding
        mask[1, :57] = 0  # left padding
        labels = ids.masked_fill(mask == 0, -100)
        # nor the token after a padding token: the loss shifts labels, so padding would predict the first real token
        # (our kernels give a row that sees no key 0, eager an average over the padding: both fine, but unequal)
        labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
        inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
        real = mask.bool()
    elif batch == "plain":
        inputs = dict(input_ids=ids, labels=ids)
        real = torch.ones_like(ids, dtype=torch.bool)
    else:  # packed: restarting positions ("packed"), and DataCollatorWithFlattening's varlen kwargs ("collated")
        ids = ids[:1]
        lengths = (1, 130, 69, 100)
        pos = torch.cat([torch.arange(n) for n in lengths]).cuda()[None]
        inputs = dict(input_ids=ids, position_ids=pos, labels=ids, use_cache=False)
        real = torch.ones_like(ids, dtype=torch.bool)
    ours = dict(inputs)
    if batch == "collated":  # two equal tensors, as the collator makes them; eager sees the packing by positions
        cu = torch.tensor((0,) + lengths, device="cuda").cumsum(0).to(torch.int32)
        ours.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=130, max_length_k=130)
    logits, grads = _run("fastpath", ours, family)
    names = {b.name for b in chosen}
    if family in ("llama", "falcon_alibi") or batch != "plain":
        assert names == {"gluon"}, names  # H200's table: Gluon beats Triton at hd128 / 96 (SDPA takes no masks)
    else:  # plain full-attention layers of 300 tokens run cuDNN through SDPA; the windowed / capped ones Gluon
        assert "gluon" in names, names
    want_logits, want_grads = _run("eager", inputs, family, torch.float32)
    peer_logits, peer_grads = _run(PEER[family], inputs, family)

    def rel(x, ref):
        return ((x - ref).norm() / ref.norm().clamp_min(1e-12)).item()

    err, peer = rel(logits[real], want_logits[real]), rel(peer_logits[real], want_logits[real])
    assert err <= 2 * peer + 1e-3, ("logits", err, peer)
    for n, g in want_grads.items():
        err, peer = rel(grads[n], g), rel(peer_grads[n], g)
        assert err <= 2 * peer + 1e-3, (n, err, peer)
