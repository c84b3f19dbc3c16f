"""A Llama-shaped model (head dim 128) on `attn_implementation="fastpath"` with the Gluon kernels for padded and packed
batches, against Transformers' eager attention in float32: logits of the real tokens and every parameter's gradient
within 2x the error of Transformers' "sdpa" in bfloat16 (plus a small floor) (run on an H200:
`TRITON_INTERPRET=0 pytest tests/gpu/test_models_gluon_gpu.py`). Skipped without an sm_90 GPU."""

from __future__ import annotations

import pytest
import torch

import hf_fastpath  # noqa: F401 - registers "fastpath"
from hf_fastpath.attention import backends
from hf_fastpath.kernels import gluon_attention as ga

from tests.gpu.common import needs_sm90_gluon

pytestmark = needs_sm90_gluon(ga.HAS_GLUON)


def _model(impl, dtype):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                   intermediate_size=1024, num_hidden_layers=2, vocab_size=1000)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=impl)
    return model.to("cuda", dtype).train()  # the same weights in every dtype


def _run(impl, inputs, dtype=torch.bfloat16):
    model = _model(impl, dtype)
    out = model(**inputs)
    out.loss.backward()
    return out.logits.float(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("batch", ["padded", "packed"])
def test_fastpath_matches_eager(monkeypatch, batch):
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
    else:
        ids = ids[:1]
        pos = torch.cat([torch.arange(n) for n in (1, 130, 69, 100)]).cuda()[None]
        inputs = dict(input_ids=ids, position_ids=pos, labels=ids, use_cache=False)
        real = torch.ones_like(ids, dtype=torch.bool)
    logits, grads = _run("fastpath", inputs)
    names = {b.name for b in chosen}
    assert names == {"gluon"}, names  # H200's table: Gluon beats Triton at hd128 (SDPA takes no masks)
    want_logits, want_grads = _run("eager", inputs, torch.float32)
    peer_logits, peer_grads = _run("sdpa", inputs)

    def rel(x, ref):
        return ((x - ref).norm() / ref.norm().clamp_min(1e-12)).item()

    err, peer = rel(logits[real], want_logits[real]), rel(peer_logits[real], want_logits[real])
    assert err <= 2 * peer + 1e-3, ("logits", err, peer)
    for n, g in want_grads.items():
        err, peer = rel(grads[n], g), rel(peer_grads[n], g)
        assert err <= 2 * peer + 1e-3, (n, err, peer)
