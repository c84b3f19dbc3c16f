"""chunked_linear_cross_entropy (hf_fastpath.losses) against torch's cross_entropy on full float64 logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_fastpath.losses import chunked_linear_cross_entropy, default_chunk_rows


def make(tokens, vocab, hidden, *, dtype=torch.float64, bias=False, ignored=0.0, seed=0, lead=None):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*(lead or (tokens,)), hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / hidden**0.5 * 3
    b = torch.randn(vocab, generator=g, dtype=torch.float64) if bias else None
    labels = torch.randint(0, vocab, h.shape[:-1], generator=g)
    if ignored:
        labels[torch.rand(labels.shape, generator=g) < ignored] = -100
        if ignored < 1:  # keep one target (all-ignored has its own test)
            labels.view(-1)[0] = 1
    return h.to(dtype), w.to(dtype), (b.to(dtype) if b is not None else None), labels


def leaves(*tensors, grad=(True, True, True)):
    return [None if t is None else t.detach().clone().requires_grad_(r) for t, r in zip(tensors, grad)]


def reference(h, w, b, labels, *, num_items=None, softcap=None):
    """torch's cross_entropy on the full logits, computed in float64 from the same (possibly rounded) inputs."""
    logits = F.linear(h.double(), w.double(), None if b is None else b.double())
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits, labels = logits.reshape(-1, w.shape[0]), labels.reshape(-1)
    if num_items is None:
        return F.cross_entropy(logits, labels, ignore_index=-100)
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / num_items


def loss_and_grads(fn, h, w, b, labels, **kw):
    loss = fn(h, w, labels, b, **kw) if fn is chunked_linear_cross_entropy else fn(h, w, b, labels, **kw)
    loss.backward()
    return loss.detach(), [None if t is None or t.grad is None else t.grad.clone() for t in (h, w, b)]


def check(tokens, vocab, hidden, chunk_rows, *, bias=False, ignored=0.0, grad=(True, True, True), seed=0, lead=None,
          softcap=None, num_items=None):
    h, w, b, labels = make(tokens, vocab, hidden, bias=bias, ignored=ignored, seed=seed, lead=lead)
    ours = loss_and_grads(chunked_linear_cross_entropy, *leaves(h, w, b, grad=grad), labels, chunk_rows=chunk_rows,
                          softcap=softcap, num_items_in_batch=num_items)
    ref_kw = dict(softcap=softcap, num_items=num_items)
    want = loss_and_grads(reference, *leaves(h, w, b, grad=grad), labels, **ref_kw)
    assert ours[0].dtype == torch.float64
    torch.testing.assert_close(ours[0], want[0], rtol=1e-12, atol=1e-12)
    for name, got, ref, needed in zip(("hidden", "weight", "bias"), ours[1], want[1], grad):
        if ref is None:
            assert got is None, f"{name} must get no gradient"
            continue
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("tokens,vocab,hidden,chunk_rows", [
    (1, 2, 1, None), (7, 11, 5, 3), (33, 97, 13, 8), (33, 97, 13, 33), (33, 97, 13, 1000), (64, 256, 32, 17),
    (50, 129, 31, 49),
])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_cross_entropy_on_full_logits(tokens, vocab, hidden, chunk_rows, bias):
    check(tokens, vocab, hidden, chunk_rows, bias=bias, ignored=0.3)


@pytest.mark.parametrize("grad", [(True, False, False), (False, True, False), (True, False, True), (False, False, True)])
def test_only_requested_gradients(grad):
    check(21, 40, 9, 6, bias=True, grad=grad)


def test_leading_dimensions_and_sum_over_num_items_in_batch():
    check(None, 50, 12, 5, lead=(3, 7), ignored=0.2, num_items=torch.tensor(17))
    check(None, 50, 12, 4, lead=(2, 9), num_items=30)


def test_softcap():
    check(29, 61, 8, 6, bias=True, softcap=2.5, ignored=0.2)


def test_all_ignored_gives_zero_loss_and_zero_grads():
    h, w, b, labels = leaves(*make(9, 13, 4, bias=True)[:3]) + [torch.full((9,), -100)]
    for num_items in (None, 5):
        loss = chunked_linear_cross_entropy(h, w, labels, b, chunk_rows=4, num_items_in_batch=num_items)
        loss.backward()
        assert loss.item() == 0.0
        for t in (h, w, b):
            assert torch.equal(t.grad, torch.zeros_like(t))
            t.grad = None


def test_backward_scales_by_the_incoming_gradient():
    h, w, b, labels = make(15, 23, 6, bias=True, ignored=0.2)
    ours = leaves(h, w, b)
    (chunked_linear_cross_entropy(ours[0], ours[1], labels, ours[2], chunk_rows=4) * -2.5).backward()
    ref = leaves(h, w, b)
    (reference(*ref, labels) * -2.5).backward()
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_inputs_within_tolerance(dtype):
    """bf16/fp16 hidden and weight: logits rounded to that dtype per chunk, fp32 softmax; compared with the fp64
    cross-entropy of the same rounded inputs."""
    h, w, b, labels = make(70, 300, 48, dtype=dtype, bias=True, ignored=0.1)
    ours = leaves(h, w, b)
    loss, grads = loss_and_grads(chunked_linear_cross_entropy, *ours, labels, chunk_rows=16)
    ref = leaves(h, w, b)
    want, want_grads = loss_and_grads(reference, *ref, labels)
    assert loss.dtype == torch.float32 and all(g.dtype == dtype for g in grads)
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}[dtype]
    assert abs(loss.item() - want.item()) <= tol * abs(want.item())
    for got, ref_grad in zip(grads, want_grads):
        err = (got.double() - ref_grad.double()).norm() / ref_grad.double().norm()
        assert err <= 4 * tol, (dtype, err.item())


def test_autocast_computes_in_the_autocast_dtype():
    h, w, b, labels = make(20, 64, 16, dtype=torch.float32)
    h, w = leaves(h, w)[:2]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_linear_cross_entropy(h, w, labels, chunk_rows=8)
    loss.backward()
    # what nn.Linear under autocast followed by Transformers' fp32 cross-entropy computes
    want = F.cross_entropy(F.linear(h.detach().bfloat16(), w.detach().bfloat16()).double(), labels)
    full_precision = reference(h.detach(), w.detach(), None, labels)
    assert abs(loss.item() - want.item()) < 1e-5 * want.item(), "logits should come from bf16 operands"
    assert abs(loss.item() - full_precision.item()) > 1e-4, "the fp32 loss should differ (bf16 rounding)"
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


def test_no_grad_and_inference_compute_the_loss_only():
    h, w, b, labels = make(13, 17, 5, bias=True)
    want = reference(h, w, b, labels)
    h, w, b = leaves(h, w, b)
    with torch.no_grad():
        loss = chunked_linear_cross_entropy(h, w, labels, b, chunk_rows=4)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=0)


def test_second_backward_fails_clearly():
    h, w, _, labels = leaves(*make(5, 7, 3)[:2], None) + [make(5, 7, 3)[3]]
    loss = chunked_linear_cross_entropy(h, w, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_bad_input_is_named():
    h, w, b, labels = make(6, 10, 4, bias=True)
    with pytest.raises(IndexError, match="outside the vocabulary"):
        chunked_linear_cross_entropy(h, w, torch.tensor([1, 2, 10, 3, -100, 0]))
    with pytest.raises(IndexError, match="outside the vocabulary"):
        chunked_linear_cross_entropy(h, w, torch.tensor([1, 2, -5, 3, -100, 0]))
    with pytest.raises(ValueError, match="weight must be"):
        chunked_linear_cross_entropy(h, w.t(), labels)
    with pytest.raises(ValueError, match="leading shape"):
        chunked_linear_cross_entropy(h, w, labels[:-1])
    with pytest.raises(ValueError, match="bias"):
        chunked_linear_cross_entropy(h, w, labels, b[:-1])
    with pytest.raises(TypeError, match="integer"):
        chunked_linear_cross_entropy(h, w, labels.double())
    # a custom ignore_index: -100 is then an ordinary (out-of-range) label
    check_h, check_w = leaves(h, w)[:2]
    lab = labels.clone()
    lab[0] = 3
    lab[1] = 3
    loss = chunked_linear_cross_entropy(check_h, check_w, lab, ignore_index=3)
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(h, w), lab, ignore_index=3), rtol=1e-12, atol=0)


def test_default_chunk_rows_bounds_fp32_logits():
    assert default_chunk_rows(128256) == 2048  # Llama-3: 2048 x 128256 x 4 B = 1.0 GB
    assert default_chunk_rows(49152) * 49152 * 4 <= 1 << 30
    assert default_chunk_rows(1 << 40) == 1
    assert default_chunk_rows(10, chunk_bytes=4 * 10 * 50) == 50


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 40), vocab=st.integers(2, 70), hidden=st.integers(1, 20), chunk=st.integers(1, 45),
       bias=st.booleans(), ignored=st.sampled_from([0.0, 0.5, 1.0]), seed=st.integers(0, 2**16))
def test_random_shapes(tokens, vocab, hidden, chunk, bias, ignored, seed):
    h, w, b, labels = make(tokens, vocab, hidden, bias=bias, ignored=ignored, seed=seed)
    ours = loss_and_grads(chunked_linear_cross_entropy, *leaves(h, w, b), labels, chunk_rows=chunk)
    if (labels == -100).all():
        assert ours[0].item() == 0.0 and all(g is None or not g.any() for g in ours[1])
        return
    want = loss_and_grads(reference, *leaves(h, w, b), labels)
    torch.testing.assert_close(ours[0], want[0], rtol=1e-12, atol=1e-12)
    for got, ref in zip(ours[1], want[1]):
        if ref is not None:
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernels_match_float64(path, softcap, dtype):
    """Both per-chunk implementations (Triton: CUDA and the interpreter; torch: CPU without the interpreter), on one
    chunk of logits, against the float64 loss and gradient of the same logits (vocab not a power of two, wider than
    the kernel's block)."""
    from hf_fastpath import losses

    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(9, 700, generator=g) * 4).to(dtype)
    target = torch.randint(0, 700, (9,), generator=g)
    scale = torch.tensor([0.37])
    ref_logits = logits.double().requires_grad_(True)
    capped = ref_logits if softcap is None else softcap * torch.tanh(ref_logits / softcap)
    want = F.cross_entropy(capped, target, reduction="none")
    (want.sum() * 0.37).backward()
    fn = losses._rows_loss_and_grad_torch if path == "torch" else _triton_rows
    loss, grad = fn(logits.clone(), target, scale, softcap, True)
    loss_only, none = fn(logits.clone(), target, scale, softcap, False)
    assert none is None and grad.dtype == dtype and loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_only, loss, rtol=0, atol=0)
    tol = 1e-6 if dtype == torch.float32 else 8e-3 * 0.37
    torch.testing.assert_close(grad.double(), ref_logits.grad, rtol=1e-2 if dtype != torch.float32 else 1e-5,
                               atol=tol)


def _triton_rows(logits, target, scale, softcap, need_grad):
    from hf_fastpath.kernels.cross_entropy import cross_entropy_rows_

    return cross_entropy_rows_(logits, target, scale, softcap, need_grad), (logits if need_grad else None)


def test_cpu_path_without_the_interpreter(monkeypatch):
    """What CPU users get (no TRITON_INTERPRET): the torch per-chunk path, fp64 with softcap and fp32."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    check(31, 77, 10, 8, bias=True, ignored=0.3, softcap=4.0)  # fp64
    h, w, b, labels = make(31, 77, 10, dtype=torch.float32, bias=True, ignored=0.3)
    loss, grads = loss_and_grads(chunked_linear_cross_entropy, *leaves(h, w, b), labels, chunk_rows=8)
    want, want_grads = loss_and_grads(reference, *leaves(h, w, b), labels)
    torch.testing.assert_close(loss.double(), want, rtol=1e-6, atol=1e-6)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got.double(), ref.double(), rtol=1e-5, atol=1e-6)
