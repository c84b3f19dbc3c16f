"""`fastpath*` attention under torch.compile: no graph break, no recompilation across decode steps.

The suite's TRITON_INTERPRET=1 puts the interpreted Triton kernels behind our custom ops: Dynamo traces the model
with the ops' fake implementations, then the compiled graph runs the real (interpreted) kernels, so the outputs
are checked against the eager model too. `fullgraph=True` turns any graph break into an error; a counting backend
sees every compilation (one per distinct graph).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import StaticCache

import hf_fastpath  # noqa: F401  (registers the attention names)
from models import random_batch, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VARIANTS = ["fastpath", "fastpath_fp8", "fastpath_fp4"]


class CountingBackend:
    """A torch.compile backend that runs the traced graph as is and counts compilations."""

    def __init__(self, inner="eager"):
        self.graphs = 0
        self.inner = inner

    def __deepcopy__(self, memo):  # Transformers deep-copies its CompileConfig: keep one counter
        return self

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        if self.inner == "aot_eager":
            from functorch.compile import make_boxed_func
            from torch._dynamo.backends.common import aot_autograd

            boxed = lambda g, _: make_boxed_func(g.forward)  # noqa: E731
            return aot_autograd(fw_compiler=boxed, bw_compiler=boxed)(gm, example_inputs)
        return gm.forward


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


TRAINING = [(impl, "plain") for impl in VARIANTS] + [("fastpath", "padded")]


@pytest.mark.parametrize("impl,batch", TRAINING + [("fastpath_fp8", "padded")])
def test_training_step_compiles(impl, batch):
    """One graph for forward and backward (`fullgraph`). The low-bit kernels take no key mask: with padding they
    drop the padded keys first, a host sync, so that case compiles with a graph break (documented)."""
    torch.manual_seed(0)
    model = tiny_model("llama", impl)
    ids, mask = random_batch(2, 12, left_pad=(0, 3) if batch == "padded" else (), seed=3)
    labels = ids.masked_fill(mask == 0, -100)
    backend = CountingBackend("aot_eager")
    whole = (impl, batch) in TRAINING
    compiled = torch.compile(model, fullgraph=whole, backend=backend)
    loss = compiled(ids, attention_mask=mask if batch == "padded" else None, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want = model(ids, attention_mask=mask if batch == "padded" else None, labels=labels).loss
    want.backward()
    assert backend.graphs == 1 if whole else backend.graphs > 1
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")


def test_attention_sinks_training_step_and_static_generate_compile_whole():
    """gpt-oss: sinks (with their gradient) and sliding-window layers in one graph; static-cache decoding compiles
    as often as with eager attention: twice, the second when the sliding layers' cache fills (Transformers' guard
    on its length)."""
    torch.manual_seed(0)
    model = tiny_model("gpt_oss", "fastpath")
    ids, mask = random_batch(2, 12, seed=3)
    backend = CountingBackend("aot_eager")
    loss = torch.compile(model, fullgraph=True, backend=backend)(ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    assert backend.graphs == 1 and any(n.endswith(".sinks") for n in grads)
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[n], p.grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")

    ids, mask = random_batch(2, 7, left_pad=(0, 2), seed=4)  # the window (8) moves past the padding
    graphs = {}
    for impl in ("fastpath", "eager"):
        torch._dynamo.reset()
        model.set_attn_implementation(impl)
        backend = CountingBackend()
        config = transformers.CompileConfig(fullgraph=True, backend=backend, mode=None)
        config._compile_all_devices = True
        kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            got = model.eval().generate(ids, cache_implementation="static", compile_config=config, **kw)
            want = model.generate(ids, cache_implementation="static", disable_compile=True, **kw)
        assert torch.equal(got, want)
        graphs[impl] = backend.graphs
    assert graphs["fastpath"] == graphs["eager"] <= 2, graphs


def test_packed_training_step_compiles_whole():
    # restarting position_ids, no attention mask and no cache: Transformers' mask marks the packed sequences; the
    # segment table reaches the kernel without a host sync
    torch.manual_seed(0)
    model = tiny_model("llama", "fastpath")
    lengths = (5, 7, 4)
    ids = torch.randint(1, 128, (1, sum(lengths)))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    backend = CountingBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    out = compiled(ids, position_ids=position_ids, use_cache=False).logits
    out.sum().backward()
    assert backend.graphs == 1
    start = 0
    for n in lengths:  # each packed sequence equals that sequence alone
        alone = model(ids[:, start:start + n], use_cache=False).logits
        torch.testing.assert_close(out[:, start:start + n], alone, atol=2e-5, rtol=1e-4)
        start += n


def test_varlen_with_tokens_outside_every_sequence_compiles_whole():
    # our varlen custom op (the gap fill included) in one graph with its backward; tokens outside every sequence
    # come back as zeros in out and every gradient
    from hf_fastpath.attention import attention

    cu_q, cu_k = torch.tensor([2, 12, 20], dtype=torch.int32), torch.tensor([1, 15, 30], dtype=torch.int32)
    x = [torch.randn(n, h, 32, requires_grad=True) for n, h in ((24, 2), (33, 1), (33, 1))]
    backend = CountingBackend("aot_eager")

    def step(q, k, v):
        return attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=10,
                         max_seqlen_k=15, backend="triton")

    out = torch.compile(step, backend=backend, fullgraph=True)(*x)
    out.float().pow(2).sum().backward()
    assert backend.graphs == 1
    assert torch.isfinite(out).all() and out[:2].eq(0).all() and out[20:].eq(0).all()
    dq, dk, dv = (t.grad for t in x)
    assert dq[:2].eq(0).all() and dq[20:].eq(0).all() and dq[2:20].abs().sum() > 0
    for g in (dk, dv):
        assert g[:1].eq(0).all() and g[30:].eq(0).all() and torch.isfinite(g).all()


@pytest.mark.parametrize("impl", VARIANTS)
@pytest.mark.parametrize("batch", ["plain", "padded"])
def test_static_cache_generate_compiles_once(impl, batch):
    torch.manual_seed(0)
    model = tiny_model("llama", impl).eval()
    ids, mask = random_batch(2, 7, left_pad=(0, 2) if batch == "padded" else (), seed=4)
    backend = CountingBackend()
    config = transformers.CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True  # Transformers compiles on CUDA only unless told (its testing flag)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
              output_logits=True)
    got = model.generate(ids, cache_implementation="static", compile_config=config, **kw)
    want = model.generate(ids, cache_implementation="static", disable_compile=True, **kw)
    assert backend.graphs == 1  # the first decode step compiled; the other 4 reused it
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_static_cache_forward_has_no_graph_break_or_recompile():
    # the model's own forward, compiled by hand: prefill and decode steps into one static cache
    torch.manual_seed(0)
    model = tiny_model("llama", "fastpath").eval()
    cache = StaticCache(config=model.config, max_cache_len=24)
    ref_cache = StaticCache(config=model.config, max_cache_len=24)
    backend = CountingBackend()
    step = torch.compile(model, fullgraph=True, backend=backend)
    ids = torch.randint(1, 128, (1, 5))
    cache_kw = "cache" if "cache" in model.forward.__wrapped__.__code__.co_varnames else "past_key_values"
    with torch.no_grad():
        logits = step(ids, **{cache_kw: cache}).logits
        ref = model(ids, **{cache_kw: ref_cache}).logits
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
        graphs_after_prefill = backend.graphs
        token = logits[:, -1:].argmax(-1)
        for _ in range(4):
            logits = step(token, **{cache_kw: cache}).logits
            ref = model(token, **{cache_kw: ref_cache}).logits
            torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
            token = logits[:, -1:].argmax(-1)
    assert graphs_after_prefill == 1 and backend.graphs == 2  # one prefill graph, one decode graph


def test_w4a16_model_static_cache_generate_compiles_once():
    """A W4A16 model (q/k/v and gate/up fused) with `fastpath` attention: one decode graph for every step."""
    from hf_fastpath.quantization import W4A16Config, w4a16_backend
    from hf_fastpath.quantization.calibrate import quantize_model

    model = tiny_model("llama", "fastpath", dtype=torch.float16, hidden_size=128, intermediate_size=256)
    quantize_model(model, W4A16Config(method="rtn", bits=4, group_size=32, sym=False))
    assert hf_fastpath.fuse_projections(model) == 4
    with w4a16_backend("kernel"):
        _assert_static_generate_compiles_once(model, max_new_tokens=5)


def _assert_static_generate_compiles_once(model, max_new_tokens, after_compiled=lambda: None):
    """Compiled `generate(cache_implementation="static")` in one graph, with eager generate's tokens and logits."""
    ids, mask = random_batch(2, 5, left_pad=(0, 1), seed=5)
    backend = CountingBackend()
    config = transformers.CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True
    kw = dict(attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True, cache_implementation="static")
    got = model.generate(ids, compile_config=config, **kw)
    after_compiled()
    want = model.generate(ids, disable_compile=True, **kw)
    assert backend.graphs == 1
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


def test_dispatch_to_sdpa_compiles_once(monkeypatch):
    """On a (pretend) H200 plain calls go to SDPA by the measured table; choosing must not change anything the
    compiled graph's guards watch (a cache filled while tracing did, and cost a recompilation)."""
    from hf_fastpath.attention import backends

    monkeypatch.setattr(backends, "cuda_capability", lambda t=None: (9, 0))
    monkeypatch.setattr(backends.SDPABackend, "missing", lambda self: None)
    backends.clear_choices()
    model = tiny_model("llama", "fastpath", dtype=torch.bfloat16)
    backend = CountingBackend()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    calls = []
    monkeypatch.setattr(backends.SDPABackend, "attend", staticmethod(
        lambda *a, f=backends.SDPABackend.attend: calls.append(1) or f(*a)))
    with torch.no_grad():
        for seed in (1, 2, 3):
            ids, _ = random_batch(2, 12, seed=seed)
            got = compiled(ids, use_cache=False).logits
            torch.testing.assert_close(got, model(ids, use_cache=False).logits, atol=2e-2, rtol=2e-2)
    assert backend.graphs == 1 and calls  # traced through SDPA once, no recompilation
    backends.clear_choices()


def test_w4a16_mixture_of_experts_static_cache_generate_compiles_once():
    """W4A16 experts (all experts of a projection in one launch, a fixed-size tile table: no host sync) decode in
    one graph too."""
    from hf_fastpath.quantization import W4A16Config, w4a16_backend
    from hf_fastpath.quantization.calibrate import quantize_model

    model = tiny_model("qwen3_moe", "fastpath", dtype=torch.float16)
    quantize_model(model, W4A16Config(method="rtn", bits=4, group_size=32, sym=False))

    def grouped_launch_ran():
        assert model.model.layers[0].mlp.experts._stacks[2] is not None

    with w4a16_backend("kernel"):
        _assert_static_generate_compiles_once(model, max_new_tokens=4, after_compiled=grouped_launch_ran)
