"""GPU checks of the Gluon FP8 attention forward (`kernels/gluon_lowbit_attention.py`) against the Triton FP8 kernel it
stands in for (same quantized inputs, same numerics) and float64 attention of the dequantized inputs: its error within
1.5x the Triton kernel's plus a small floor, lse within 2e-3 of float64's, rows that see no key exactly 0 with lse
-inf. Varlen batches with empty and one-token sequences, GQA, causal and not, hd 64 and 128. Run on an H200:
`TRITON_INTERPRET=0 pytest tests/gpu/test_gluon_lowbit_attention_gpu.py`; skipped without an sm_90 GPU.

With HF_FASTPATH_GPU_REPORT=path, every case's errors go to that JSON file as well."""

from __future__ import annotations

import math

import pytest
import torch

from hf_fastpath.attention import lowbit, reference
from hf_fastpath.kernels import gluon_attention as ga
from hf_fastpath.kernels import gluon_lowbit_attention as gla
from hf_fastpath.kernels import lowbit_attention as kla
from hf_fastpath.kernels import row_quant

from tests.gpu.common import REPORT, needs_sm90_gluon, rel_error

pytestmark = needs_sm90_gluon(ga.HAS_GLUON)

LENGTHS = {"dense": [1000, 1000], "mixed": [700, 0, 1, 129, 2000, 1, 63], "short": [1] * 9 + [5],
           "long": [4500]}


def _inputs(lengths, hq, hkv, d, seed, kv_lengths=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv_lengths = kv_lengths or lengths
    tq, tk = sum(lengths), sum(kv_lengths)
    q = torch.randn(tq, hq, d, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(tk, hkv, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    v = v * torch.rand(tk, hkv, 1, device="cuda", generator=g) * 4  # V scales that differ per token
    cu = lambda ls: torch.tensor([0] + ls, device="cuda").cumsum(0).to(torch.int32)  # noqa: E731
    return q, k, v, cu(lengths), cu(kv_lengths)


def _check(name, q, k, v, cu_q, cu_k, causal, monkeypatch):
    q8, qs = row_quant.quantize_e4m3_rows(q, "fp8")
    k8, ks = row_quant.quantize_e4m3_rows(k, "fp8")
    vt8, vs = row_quant.quantize_e4m3_rows(v, "fp8", transpose=True)
    max_q = int(torch.diff(cu_q).max())
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, causal=causal)
    monkeypatch.setattr(kla, "USE_GLUON", False)
    want_out, want_lse = kla.lowbit_flash_forward(q8, qs, k8, ks, vt8, vs, **kw)
    monkeypatch.setattr(kla, "USE_GLUON", True)
    assert gla.supported(q8, k8, vt8, qs)
    out, lse = kla.lowbit_flash_forward(q8, qs, k8, ks, vt8, vs, **kw)
    # float64 attention of exactly the values the kernels saw
    deq = lambda x8, s: x8.double() * s.double()[..., None]  # noqa: E731
    v_rows = vt8[:, :, :k.shape[0]].permute(2, 0, 1)
    ref_out, ref_lse = reference.attention_forward(deq(q8, qs), deq(k8, ks), deq(v_rows, vs), causal=causal,
                                                   cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                                   max_seqlen_k=int(torch.diff(cu_k).max()),
                                                   softmax_scale=1 / math.sqrt(q.shape[-1]))
    assert out.shape == want_out.shape and lse.shape == want_lse.shape and torch.isfinite(out).all(), name
    empty = ref_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), f"{name}: lse -inf rows differ from the reference"
    assert (out.transpose(0, 1)[empty] == 0).all(), f"{name}: a row that sees no key is not 0"
    err, err_triton = rel_error(out, ref_out), rel_error(want_out, ref_out)
    lse_err = (lse.double() - ref_lse)[~empty].abs().max().item() if (~empty).any() else 0.0
    REPORT.append(dict(case=name, out_rel=err, out_rel_triton=err_triton, lse_abs=lse_err,
                       vs_triton=rel_error(out, want_out)))
    assert err <= 1.5 * err_triton + 1e-3 and lse_err < 2e-3, (name, err, err_triton, lse_err)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(8, 8), (16, 4)], ids=lambda h: f"h{h[0]}-{h[1]}")
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_matches_triton_fp8_and_float64(lengths, heads, causal, d, monkeypatch):
    q, k, v, cu_q, cu_k = _inputs(LENGTHS[lengths], *heads, d, seed=len(LENGTHS[lengths]))
    _check(f"{lengths} h{heads} causal={causal} d={d}", q, k, v, cu_q, cu_k, causal, monkeypatch)


@pytest.mark.parametrize("causal", [False, True])
def test_more_keys_than_queries_and_the_reverse(causal, monkeypatch):
    # bottom-right causal alignment per sequence: prefill after a cache (more keys), and rows with no key (fewer)
    q, k, v, cu_q, cu_k = _inputs([300, 17, 1], 8, 2, 128, seed=5, kv_lengths=[1000, 5, 200])
    _check(f"q<k causal={causal}", q, k, v, cu_q, cu_k, causal, monkeypatch)
    q, k, v, cu_q, cu_k = _inputs([500, 64], 8, 2, 128, seed=6, kv_lengths=[100, 60])
    _check(f"q>k causal={causal}", q, k, v, cu_q, cu_k, causal, monkeypatch)


@pytest.mark.parametrize("d", [64, 128])
def test_p_through_shared_memory(d, monkeypatch):
    # the variant that stages P' in shared memory instead of registers
    monkeypatch.setattr(gla, "P_IN_REGS", False)
    q, k, v, cu_q, cu_k = _inputs(LENGTHS["mixed"], 16, 4, d, seed=7)
    _check(f"p in shared memory d={d}", q, k, v, cu_q, cu_k, True, monkeypatch)


def test_lowbit_attention_end_to_end_with_rotation(monkeypatch):
    # the public path (`fp8_attention`, Hadamard rotation on): the Gluon kernel's output rotated back matches the
    # Triton kernel's fused epilogue
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 777, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    monkeypatch.setattr(kla, "USE_GLUON", False)
    want = lowbit.fp8_attention(q, k, v, causal=True)
    monkeypatch.setattr(kla, "USE_GLUON", True)
    got = lowbit.fp8_attention(q, k, v, causal=True)
    assert rel_error(got, want) < 1e-2


def test_repeat_runs_are_bitwise_equal(monkeypatch):
    monkeypatch.setattr(kla, "USE_GLUON", True)
    q, k, v, cu_q, cu_k = _inputs(LENGTHS["mixed"], 16, 4, 128, seed=9)
    q8, qs = row_quant.quantize_e4m3_rows(q, "fp8")
    k8, ks = row_quant.quantize_e4m3_rows(k, "fp8")
    vt8, vs = row_quant.quantize_e4m3_rows(v, "fp8", transpose=True)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=2000, causal=True)
    first = kla.lowbit_flash_forward(q8, qs, k8, ks, vt8, vs, **kw)
    for _ in range(3):
        again = kla.lowbit_flash_forward(q8, qs, k8, ks, vt8, vs, **kw)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
