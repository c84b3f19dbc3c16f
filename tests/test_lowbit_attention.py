"""FP8 / FP4 attention kernels (TRITON_INTERPRET=1 on CPU) against the float emulation and exact attention."""

import logging
import types

import pytest
import torch

from hf_fastpath.attention import attention, lowbit, reference
from hf_fastpath.kernels import lowbit_attention as kla
from hf_fastpath.kernels import row_quant
from hf_fastpath.kernels import lowbit_quant as lq
from hf_fastpath.kernels.common import WARNED

CASES = [("fp8", False), ("mxfp4", False), ("nvfp4", False), ("mxfp4", True)]


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), 0).item()


def _kernel(q, k, v, fmt, p_fp4, causal, scale=None):
    """One sequence through the Triton kernel: q `[Sq,H,D]`, k/v `[Sk,Hkv,D]`."""
    (q8, qs), (k8, ks), (v8, vs) = (lowbit.quantize_for_attention(x, fmt) for x in (q, k, v))
    cq = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    ck = torch.tensor([0, k.shape[0]], dtype=torch.int32)
    return kla.lowbit_flash_forward(q8, qs, k8, ks, kla.transpose_v(v8), vs, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                    max_seqlen_q=q.shape[0], causal=causal, softmax_scale=scale, p_fp4=p_fp4,
                                    out_dtype=torch.float32)


@pytest.mark.parametrize("fmt,p_fp4", CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_single_block_equals_emulation(fmt, p_fp4, causal):
    """With one key block the kernel's running maxima are the final ones: same arithmetic as the emulation."""
    q, k, v = torch.randn(29, 4, 64), torch.randn(32, 2, 64), torch.randn(32, 2, 64) * 3
    out, lse = _kernel(q, k, v, fmt, p_fp4, causal, scale=0.2)
    eo, el = kla.lowbit_attention_emulated(q, k, v, fmt=fmt, causal=causal, softmax_scale=0.2, p_fp4=p_fp4)
    torch.testing.assert_close(lse, el, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out, eo, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fmt,p_fp4", CASES)
@pytest.mark.parametrize("causal,sq,sk,h,hkv,d", [(True, 70, 70, 2, 1, 64), (False, 33, 90, 2, 2, 32),
                                                  (True, 20, 77, 4, 2, 96)])
def test_kernel_against_emulation_and_exact(fmt, p_fp4, causal, sq, sk, h, hkv, d):
    assert d % lq.BLOCK.get(fmt, 1) == 0, "every head dim above is a multiple of the FP4 blocks"
    q, k, v = torch.randn(sq, h, d), torch.randn(sk, hkv, d), torch.randn(sk, hkv, d)
    out, lse = _kernel(q, k, v, fmt, p_fp4, causal)
    eo, el = kla.lowbit_attention_emulated(q, k, v, fmt=fmt, causal=causal, p_fp4=p_fp4)
    ro, rl = reference.attention_forward(q[None].double(), k[None].double(), v[None].double(), causal=causal)
    torch.testing.assert_close(lse, el, atol=1e-4, rtol=1e-5)
    # the kernel rounds P against running maxima, the emulation against final ones: one P rounding apart
    assert _cos(out, eo) > (0.999 if not p_fp4 else 0.99)
    # random Gaussian q/k/v are the hardest case (no dominant keys); real activations do better (see benchmarks)
    assert _cos(out, ro[0]) > {"fp8": 0.997, "mxfp4": 0.97, "nvfp4": 0.975}[fmt] - (0.01 if p_fp4 else 0)
    assert (lse - rl[0].float()).abs().max() < (0.05 if fmt == "fp8" else 0.3)


def test_empty_rows_give_zero_and_neg_inf():
    # causal with more queries than keys: the first rows see no key at all
    q, k, v = torch.randn(40, 2, 32), torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    out, lse = _kernel(q, k, v, "fp8", False, True)
    assert torch.isfinite(out).all()
    assert torch.equal(out[:32], torch.zeros_like(out[:32]))
    assert torch.isinf(lse[:, :32]).all() and (lse[:, :32] < 0).all()
    assert torch.isfinite(lse[:, 32:]).all()


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_later_tokens_never_change_earlier_outputs(fmt):
    x = [torch.randn(1, 50, 2, 32) for _ in range(3)]
    out1 = lowbit.lowbit_attention(*x, fmt=fmt, causal=True)
    y = [t.clone() for t in x]
    for t in y:
        t[:, 30:] = torch.randn_like(t[:, 30:]) * 100  # wildly different later tokens (and their scales)
    out2 = lowbit.lowbit_attention(*y, fmt=fmt, causal=True)
    assert torch.equal(out1[:, :30], out2[:, :30])


def test_decode_reads_a_16_bit_cache_as_is():
    # one query against a 16-bit KV cache: the 16-bit kernel (quantizing the whole cache each step costs more);
    # the FP8 prefill agrees with it to FP8 rounding
    q, k, v = torch.randn(1, 45, 4, 32), torch.randn(1, 45, 2, 32), torch.randn(1, 45, 2, 32)
    full = lowbit.fp8_attention(q, k, v, causal=True)
    for t in (1, 17, 44):
        step = lowbit.fp8_attention(q[:, t:t + 1], k[:, :t + 1], v[:, :t + 1], causal=True)
        assert torch.equal(step, attention(q[:, t:t + 1], k[:, :t + 1], v[:, :t + 1], causal=True))
        assert _cos(step, full[:, t:t + 1]) > 0.998


def test_varlen_matches_dense():
    lens = [19, 40, 5]
    seqs = [[torch.randn(n, 2, 32) for _ in range(3)] for n in lens]
    cu = torch.tensor([0, 19, 59, 64], dtype=torch.int32)
    q, k, v = (torch.cat([s[i] for s in seqs]) for i in range(3))
    out, lse = lowbit.fp8_attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=40,
                                    max_seqlen_k=40, return_lse=True, rotate=False)
    for (a, b), s in zip(zip(cu[:-1].tolist(), cu[1:].tolist()), seqs):
        o, l = lowbit.fp8_attention(*(t[None] for t in s), causal=True, return_lse=True, rotate=False)
        assert torch.equal(out[a:b], o[0]) and torch.equal(lse[:, a:b], l[0])


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_backward_straight_through(fmt):
    """Both backwards (P and dS products in the 16-bit dtype, or in e4m3) give the exact gradients up to the
    forward's quantization; the e4m3 one really is another computation."""
    q, k, v = (torch.randn(2, 24, 2, 32) for _ in range(3))
    g = torch.randn(2, 24, 2, 32)
    grads = {}
    for backward in ("bf16", "fp8"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        lowbit.lowbit_attention(*leaves, fmt=fmt, causal=True, backward=backward).backward(g)
        grads[backward] = [t.grad for t in leaves]
    ro, rl = reference.attention_forward(q, k, v, causal=True)
    exact = reference.attention_backward(g, q, k, v, ro, rl, causal=True)
    for backward, got in grads.items():
        for a, ref in zip(got, exact):
            assert torch.isfinite(a).all()
            assert _cos(a, ref) > (0.99 if fmt == "fp8" else 0.95), backward
    assert not any(torch.equal(a, b) for a, b in zip(grads["bf16"], grads["fp8"]))
    with pytest.raises(ValueError, match="backward must be"):
        lowbit.lowbit_attention(q, k, v, fmt=fmt, backward="fp16")


def test_fp8_backward_without_triton_runs_in_full_precision_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(lowbit.interface, "use_triton", lambda t: False)  # a CPU without TRITON_INTERPRET=1
    WARNED.discard("lowbit:fp8-backward-cpu")
    q, k, v = (torch.randn(1, 9, 2, 16) for _ in range(3))
    grads = []
    for backward in ("bf16", "fp8"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with caplog.at_level(logging.WARNING):
            lowbit.lowbit_attention(*leaves, fmt="fp8", causal=True, backward=backward).sum().backward()
        grads.append([t.grad for t in leaves])
    assert "needs the Triton kernels" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_unsupported_features_fall_back_to_bf16(caplog):
    q, k, v = torch.randn(1, 16, 2, 32), torch.randn(1, 16, 2, 32), torch.randn(1, 16, 2, 32)
    with caplog.at_level(logging.WARNING):
        out = lowbit.fp8_attention(q, k, v, causal=True, softcap=5.0)
    assert "softcap" in caplog.text
    ref, _ = reference.attention_forward(q, k, v, causal=True, softcap=5.0)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_bad_arguments():
    q = torch.randn(1, 8, 2, 32)
    with pytest.raises(ValueError, match="unknown low-bit format"):
        lowbit.lowbit_attention(q, q, q, fmt="int8")
    with pytest.raises(ValueError, match="mxfp4"):
        lowbit.fp4_attention(q, q, q, fmt="fp8")
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        lowbit.fp8_attention(torch.randn(1, 8, 3, 32), q, q)
    with pytest.raises(ValueError, match="p_format"):
        lowbit.fp8_attention(q, q, q, p_format="int4")


def test_bf16_mode_of_the_kernel_is_exact_attention():
    q, k, v = torch.randn(37, 4, 64), torch.randn(50, 2, 64), torch.randn(50, 2, 64)
    cq, ck = torch.tensor([0, 37], dtype=torch.int32), torch.tensor([0, 50], dtype=torch.int32)
    out, lse = kla.lowbit_flash_forward(q, None, k, None, kla.transpose_v(v), None, cu_seqlens_q=cq,
                                        cu_seqlens_k=ck, max_seqlen_q=37, causal=True, out_dtype=torch.float32)
    ro, rl = reference.attention_forward(q[None], k[None], v[None], causal=True)
    torch.testing.assert_close(out, ro[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, rl[0], atol=1e-4, rtol=1e-5)


def test_queries_outside_every_sequence_are_zero(nan_empty):
    # queries before cu_seqlens_q[0] and from cu_seqlens_q[-1] on get no program: out 0 and lse -inf, whatever the
    # memory held
    q, k, v = torch.randn(45, 4, 64), torch.randn(50, 2, 64), torch.randn(50, 2, 64)
    cq, ck = torch.tensor([3, 20, 40], dtype=torch.int32), torch.tensor([0, 30, 50], dtype=torch.int32)
    out, lse = kla.lowbit_flash_forward(q, None, k, None, kla.transpose_v(v), None, cu_seqlens_q=cq,
                                        cu_seqlens_k=ck, max_seqlen_q=20, causal=True, out_dtype=torch.float32)
    outside = torch.ones(45, dtype=torch.bool)
    outside[3:40] = False
    assert torch.all(out[outside] == 0) and torch.all(torch.isneginf(lse[:, outside]))
    for a, b, c, d in ((3, 20, 0, 30), (20, 40, 30, 50)):
        ro, rl = reference.attention_forward(q[None, a:b], k[None, c:d], v[None, c:d], causal=True)
        torch.testing.assert_close(out[a:b], ro[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse[:, a:b], rl[0], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
def test_fused_quantizer_matches_torch_reference(fmt):
    x = torch.randn(2, 2, 40, 3, 64).mul(torch.logspace(-2, 2, 40)[None, None, :, None, None])[:, 0]  # strided
    x = x.transpose(1, 2).transpose(1, 2)  # [B, S, H, D] with non-trivial strides
    x[0, 3, 1] = 0.0  # a zero row
    ref8, refs = lowbit.quantize_for_attention(x.reshape(-1, 3, 64), fmt)
    y, s = row_quant.quantize_e4m3_rows(x, fmt)
    assert torch.equal(s, refs)
    assert torch.equal(y.view(torch.uint8), ref8.view(torch.uint8))
    yt, st = row_quant.quantize_e4m3_rows(x, fmt, transpose=True)
    assert yt.shape == (3, 64, 80) and torch.equal(st, refs)
    assert torch.equal(yt.view(torch.uint8), kla.transpose_v(ref8).view(torch.uint8))


def test_hadamard_rotation_is_exact_and_helps_with_outlier_channels():
    h = lowbit.hadamard(64, "cpu", torch.float64)
    torch.testing.assert_close(h @ h.t(), torch.eye(64, dtype=torch.float64))
    q, k, v = (torch.randn(1, 40, 2, 64) for _ in range(3))
    k[..., 3] += 30.0  # an outlier channel, as real keys have
    ref, _ = reference.attention_forward(q.double(), k.double(), v.double(), causal=True)
    plain = lowbit.fp4_attention(q, k, v, causal=True, rotate=False)
    rotated = lowbit.fp4_attention(q, k, v, causal=True)
    assert _cos(rotated, ref) > _cos(plain, ref)
    # the rotation is per token: still causally safe
    k2 = k.clone()
    k2[:, 20:] *= 50
    assert torch.equal(lowbit.fp4_attention(q, k2, v, causal=True)[:, :20], rotated[:, :20])


@pytest.mark.parametrize("mode", ["load", "regs"])
def test_scale_loading_variants_agree(mode, monkeypatch):
    """The ways of loading per-token scales compute the same numbers (the TMA ones need a GPU)."""
    q, k, v = torch.randn(1, 100, 2, 32), torch.randn(1, 130, 2, 32), torch.randn(1, 130, 2, 32)
    for causal in (False, True):
        ref = lowbit.fp8_attention(q, k, v, causal=causal)
        monkeypatch.setattr(kla, "SCALE_LOAD", mode)
        got = lowbit.fp8_attention(q, k, v, causal=causal)
        monkeypatch.undo()
        assert torch.equal(got, ref)


def test_qk_format_quantizes_q_and_k_separately():
    """fp4_attention(qk_format="fp8"): Q/K in FP8, V in FP4; the kernel matches the emulation of that mix and sits
    between all-FP8 and all-FP4 in accuracy."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 40, 2, 64), torch.randn(1, 40, 2, 64), torch.randn(1, 40, 2, 64)
    ref, _ = reference.attention_forward(q.double(), k.double(), v.double(), causal=True)
    mixed = lowbit.fp4_attention(q, k, v, causal=True, rotate=False, qk_format="fp8")
    emu, _ = kla.lowbit_attention_emulated(q[0], k[0], v[0], fmt="mxfp4", causal=True, qk_fmt="fp8")
    assert _cos(mixed[0], emu) > 0.9995
    fp4 = lowbit.fp4_attention(q, k, v, causal=True, rotate=False)
    fp8 = lowbit.fp8_attention(q, k, v, causal=True, rotate=False)
    assert _cos(fp8, ref) > _cos(mixed, ref) > _cos(fp4, ref)
    with pytest.raises(ValueError, match="qk_format"):
        lowbit.fp4_attention(q, k, v, qk_format="int8")


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_fused_rotation_in_the_quantizer(fmt):
    """quantize_e4m3_rows(rotate=True) quantizes x @ H (orthonormal Hadamard) without a separate pass."""
    x = torch.randn(1, 40, 3, 64)
    x[..., 5] += 20.0  # an outlier channel
    h = lowbit.hadamard(64, "cpu", torch.float64)
    ref8, refs = lowbit.quantize_for_attention((x.double() @ h).float().reshape(-1, 3, 64), fmt)
    y, s = row_quant.quantize_e4m3_rows(x, fmt, rotate=True)
    torch.testing.assert_close(s, refs, rtol=1e-5, atol=0)
    # fp32 sums in another order: a rare value next to a rounding boundary flips to the neighbouring code
    assert (y.view(torch.uint8) == ref8.view(torch.uint8)).float().mean() > 0.99
    torch.testing.assert_close(y.float() * s[..., None], ref8.float() * refs[..., None], rtol=0.13, atol=1e-6)
    with pytest.raises(ValueError, match="power-of-two"):
        row_quant.quantize_e4m3_rows(torch.randn(1, 4, 2, 48), fmt, rotate=True)


def test_kernel_rotates_its_output_back():
    """With `rotate` the kernel returns the output in the original basis: equal to rotating the rotated-basis
    output by the same (self-inverse) orthonormal Hadamard matrix."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(37, 4, 64).to(torch.bfloat16) for _ in range(3))
    q[..., 7] += 12.0  # an outlier channel
    cu = torch.tensor([0, 37], dtype=torch.int32)
    (q8, qs), (k8, ks), (vt8, vs) = (row_quant.quantize_e4m3_rows(q, "fp8", rotate=True),
                                     row_quant.quantize_e4m3_rows(k, "fp8", rotate=True),
                                     row_quant.quantize_e4m3_rows(v, "fp8", transpose=True, rotate=True))
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=37, causal=True, out_dtype=torch.float32)
    back, lse = kla.lowbit_flash_forward(q8, qs, k8, ks, vt8, vs, rotate=True, **kw)
    rotated, lse_rotated = kla.lowbit_flash_forward(q8, qs, k8, ks, vt8, vs, **kw)
    torch.testing.assert_close(lse, lse_rotated, rtol=0, atol=0)
    torch.testing.assert_close(back, rotated @ lowbit.hadamard(64, "cpu", torch.float32), rtol=0,
                               atol=1e-5 * rotated.abs().max().item())
    x48 = torch.randn(5, 4, 48)
    cu5 = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="power-of-two"):
        kla.lowbit_flash_forward(*row_quant.quantize_e4m3_rows(x48, "fp8"), *row_quant.quantize_e4m3_rows(x48, "fp8"),
                                 *row_quant.quantize_e4m3_rows(x48, "fp8", transpose=True), rotate=True,
                                 cu_seqlens_q=cu5, cu_seqlens_k=cu5, max_seqlen_q=5)


# Native FP4 Q.K^T: packed MXFP4 codes through `tl.dot_scaled` (FP4 tensor cores on sm_100+)


def _mx_inputs(q, k, v):
    (qc, qb), (kc, kb) = (row_quant.quantize_e4m3_rows(x, "mxfp4_packed") for x in (q, k))
    vt8, vs = row_quant.quantize_e4m3_rows(v, "mxfp4", transpose=True)
    return qc, qb, kc, kb, vt8, vs


@pytest.mark.parametrize("rotate", [False, True])
def test_fused_quantizer_packs_mxfp4_like_the_reference(rotate):
    x = torch.randn(2, 40, 3, 64).mul(torch.logspace(-3, 3, 40)[None, :, None, None])
    x[0, 3, 1] = 0.0  # a zero row: smallest exponent, all codes 0
    x[1, 5, 2, :7] = -0.0  # negative zeros encode as code 0
    codes, exps = row_quant.quantize_e4m3_rows(x, "mxfp4_packed", rotate=rotate)
    ref_in = (x.double() @ lowbit.hadamard(64, "cpu", torch.float64)).float() if rotate else x
    ref = lq.quantize_rows(ref_in.reshape(-1, 3, 64), "mxfp4")
    assert torch.equal(exps, ref.block_scale)
    # rotated: fp32 sums in another order can move a value across a rounding boundary
    assert (codes == ref.data).float().mean() >= (0.995 if rotate else 1.0)
    with pytest.raises(ValueError, match="power-of-two"):
        row_quant.quantize_e4m3_rows(torch.randn(4, 2, 96), "mxfp4_packed")


@pytest.mark.parametrize("causal,sq,sk,h,hkv,d", [(True, 70, 70, 2, 1, 64), (False, 33, 90, 2, 2, 32),
                                                  (True, 20, 77, 4, 2, 128), (True, 50, 9, 2, 1, 32)])
def test_native_fp4_scores_equal_the_fp8_container_path(causal, sq, sk, h, hkv, d):
    """The block-scaled FP4 dot and the e4m3 containers hold the same values: the same attention, rows that see
    no key (more queries than keys, causal) included."""
    torch.manual_seed(sq + d)
    q, k, v = torch.randn(sq, h, d), torch.randn(sk, hkv, d), torch.randn(sk, hkv, d)
    cq, ck = torch.tensor([0, sq], dtype=torch.int32), torch.tensor([0, sk], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=sq, causal=causal, out_dtype=torch.float32)
    qc, qb, kc, kb, vt8, vs = _mx_inputs(q, k, v)
    out, lse = kla.lowbit_flash_forward(qc, qb, kc, kb, vt8, vs, **kw)
    (q8, qs), (k8, ks) = (lowbit.quantize_for_attention(x, "mxfp4") for x in (q, k))
    ref, ref_lse = kla.lowbit_flash_forward(q8, qs, k8, ks, vt8, vs, **kw)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)
    if causal and sq > sk:
        assert torch.equal(out[:sq - sk], torch.zeros_like(out[:sq - sk]))
        assert torch.isinf(lse[:, :sq - sk]).all()


def test_native_fp4_keeps_blocks_far_below_the_row_maximum():
    """E4M3 containers lose a block 2**-8 below the row's largest; the block-scaled dot keeps it: its scores equal
    the dequantized codes' exact products."""
    torch.manual_seed(0)
    q, k, v = torch.randn(16, 1, 64), torch.randn(40, 1, 64), torch.randn(40, 1, 64)
    k[:, :, 32:] *= 1e-4  # the second block of every key
    q[:, :, :32] = 0.0  # only that block contributes to the scores
    cu_q, cu_k = torch.tensor([0, 16], dtype=torch.int32), torch.tensor([0, 40], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=16, causal=False, out_dtype=torch.float32,
              softmax_scale=2e4)
    _, lse = kla.lowbit_flash_forward(*_mx_inputs(q, k, v), **kw)
    (q8, qs), (k8, ks), (vt8, vs) = (*(lowbit.quantize_for_attention(x, "mxfp4") for x in (q, k)),
                                     row_quant.quantize_e4m3_rows(v, "mxfp4", transpose=True))
    _, lse_containers = kla.lowbit_flash_forward(q8, qs, k8, ks, vt8, vs, **kw)
    exact = [lq.dequantize_rows(lq.quantize_rows(x, "mxfp4")).double()[:, 0] for x in (q, k)]
    s = exact[0] @ exact[1].t() * 2e4
    torch.testing.assert_close(lse[0].double(), torch.logsumexp(s, -1), atol=1e-5, rtol=1e-6)
    assert (lse_containers[0].double() - torch.logsumexp(s, -1)).abs().max() > 1e-2


def test_fp4_mma_choices(caplog):
    """`fp4_mma`: "native" and "fp8" agree through the public API (rotation, GQA, batches); "auto" is "fp8" on a CPU;
    formats without a native path warn and run on FP8 tensor cores."""
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 30, 4, 64), torch.randn(2, 30, 2, 64), torch.randn(2, 30, 2, 64)
    native = lowbit.fp4_attention(q, k, v, causal=True, fp4_mma="native")
    fp8 = lowbit.fp4_attention(q, k, v, causal=True, fp4_mma="fp8")
    torch.testing.assert_close(native, fp8, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lowbit.fp4_attention(q, k, v, causal=True), fp8, atol=0, rtol=0)
    assert not lowbit._native_fp4_qk("auto", "mxfp4", q)
    WARNED.clear()
    with caplog.at_level(logging.WARNING):
        nv = lowbit.fp4_attention(q, k, v, fmt="nvfp4", causal=True, fp4_mma="native")
    assert "built for MXFP4 Q/K" in caplog.text
    assert torch.equal(nv, lowbit.fp4_attention(q, k, v, fmt="nvfp4", causal=True))
    with pytest.raises(ValueError, match="fp4_mma"):
        lowbit.fp4_attention(q, k, v, fp4_mma="fp4")
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        kla.lowbit_flash_forward(*_mx_inputs(*(torch.randn(4, 1, 96) for _ in range(3))), cu_seqlens_q=cu,
                                 cu_seqlens_k=cu, max_seqlen_q=4)
    qc, qb, kc, kb, vt8, vs = _mx_inputs(*(torch.randn(4, 1, 64) for _ in range(3)))
    with pytest.raises(ValueError, match="block scales"):
        kla.lowbit_flash_forward(qc, qb[..., :1], kc, kb, vt8, vs, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4)


def test_native_fp4_falls_back_on_gpus_without_fp4_tensor_cores(monkeypatch, caplog):
    """Only the device and head dim of q matter for the choice: a stand-in for a CUDA tensor."""
    cuda_q = types.SimpleNamespace(device=torch.device("cuda", 0), shape=(1, 4, 2, 64))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    WARNED.clear()
    with caplog.at_level(logging.WARNING):
        assert not lowbit._native_fp4_qk("native", "mxfp4", cuda_q)
        assert not lowbit._native_fp4_qk("auto", "mxfp4", cuda_q)
    assert "no FP4 tensor cores" in caplog.text
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert lowbit._native_fp4_qk("auto", "mxfp4", cuda_q)
    assert not lowbit._native_fp4_qk("auto", "nvfp4", cuda_q) and not lowbit._native_fp4_qk("fp8", "mxfp4", cuda_q)
