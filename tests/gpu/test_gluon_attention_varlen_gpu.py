"""GPU checks of the Gluon Hopper attention on varlen inputs whose queries and keys are packed by different offsets
(`cu_seqlens_q` != `cu_seqlens_k`: chunked prefill, a sequence's new queries after its cached keys), forward and
backward, against float64 (run on an H100 / H200: `TRITON_INTERPRET=0 pytest
tests/gpu/test_gluon_attention_varlen_gpu.py`). Skipped without an sm_90 GPU. Packings with empty sequences,
one-token ones, more queries than keys (causal rows that see nothing), tokens outside every sequence; causal,
full, sliding window, soft-cap; head dims 64, 96, 128, 256. Forward: out within 1e-2 (relative), lse within 2e-3,
rows that see no key exactly 0 with lse -inf. Backward: each gradient within 2x our Triton varlen backward's error
(plus a small floor), dq exactly 0 for rows that see no key; a repeat of a call gives the same forward bits.

With HF_FASTPATH_GPU_REPORT=path, every case's errors go to that JSON file as well."""

from __future__ import annotations

import pytest
import torch

from hf_fastpath.attention import reference
from hf_fastpath.kernels import gluon_attention as ga
from hf_fastpath.kernels import gluon_attention_bwd as gb
from hf_fastpath.kernels.flash_attention import flash_attention_backward, flash_attention_forward

from tests.gpu.common import REPORT, attention_inputs, needs_sm90_gluon, rel_error as _rel

pytestmark = needs_sm90_gluon(ga.HAS_GLUON)

# (queries, keys) per sequence
PACKINGS = {
    "chunked": [(512, 2048), (300, 1000), (0, 50), (1, 700), (1000, 1000), (129, 4100)],
    "more_queries": [(300, 100), (64, 1), (200, 0), (130, 129)],
    "short": [(17, 300), (1, 1), (90, 91), (5, 2000)],
    "one": [(1500, 3000)],
}


def _cu(lengths, start=0):
    return torch.tensor([start] + list(lengths), device="cuda").cumsum(0).to(torch.int32)


@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("features", ["causal", "full", "window", "softcap"])
@pytest.mark.parametrize("packing", sorted(PACKINGS))
def test_varlen_packed_differently(packing, features, d):
    seqs = PACKINGS[packing]
    start = 3 if packing == "short" else 0  # tokens before the first offset and after the last: no sequence
    cu_q, cu_k = _cu([s[0] for s in seqs], start), _cu([s[1] for s in seqs], start)
    total_q, total_k = int(cu_q[-1]) + start, int(cu_k[-1]) + start
    q, _, _, dout = (t[0] for t in attention_inputs(1, total_q, total_q, 8, 2, d, dout=True, seed=len(seqs)))
    _, k, v = (t[0] for t in attention_inputs(1, total_k, total_k, 8, 2, d, seed=d))
    kw = dict(causal=features != "full", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
              window_size=(150, -1) if features == "window" else (-1, -1),
              softcap=5.0 if features == "softcap" else 0.0)
    name = f"varlen {packing} {features} d={d}"

    out, lse = ga.gluon_attention_forward(q, k, v, **kw)
    again, _ = ga.gluon_attention_forward(q, k, v, **kw)
    assert torch.equal(out, again), name
    grads = gb.gluon_attention_backward(dout, q, k, v, out, lse, **kw)
    t_out, t_lse = flash_attention_forward(q, k, v, **kw)
    t_grads = flash_attention_backward(dout, q, k, v, t_out, t_lse, **kw)
    x64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference.attention_forward(*x64, **kw)
    ref = torch.autograd.grad(ref_out, x64, dout.double())

    assert lse.shape == ref_lse.shape == (8, total_q) and torch.isfinite(out).all(), name
    seen = torch.isfinite(ref_lse)
    blind = ~seen.any(0)  # rows that see no key in any head
    assert (out[blind] == 0).all() and (lse[~seen] == float("-inf")).all(), name
    assert (grads[0][blind] == 0).all(), name
    out_rel = _rel(out, ref_out)
    lse_err = (lse.double() - ref_lse)[seen].abs().max().item() if seen.any() else 0.0
    scale = ref[2].norm()
    errs = {g: (_rel(a, r, scale), _rel(b, r, scale)) for g, a, b, r in zip(("dq", "dk", "dv"), grads, t_grads, ref)}
    REPORT.append(dict(case=name, out_rel=out_rel, lse_abs=lse_err, **{f"{g}_rel": e[0] for g, e in errs.items()}))
    assert out_rel < 1e-2 and lse_err < 2e-3, (name, out_rel, lse_err)
    for g, (e, e_triton) in errs.items():
        assert e <= 2 * e_triton + 2e-3, (name, g, e, e_triton)


@pytest.mark.parametrize("backend", ["gluon", "auto"])
def test_varlen_packed_differently_through_attention(backend):
    # the public entry point: `attention(..., cu_seqlens_q, cu_seqlens_k)` with the Gluon backend forced, and "auto"
    # (which takes Gluon or Triton by the table), gradients through autograd against float64
    from hf_fastpath.attention import attention

    seqs = PACKINGS["chunked"]
    cu_q, cu_k = _cu([s[0] for s in seqs]), _cu([s[1] for s in seqs])
    q, _, _, dout = (t[0] for t in attention_inputs(1, int(cu_q[-1]), int(cu_q[-1]), 8, 2, 128, dout=True, seed=1))
    _, k, v = (t[0] for t in attention_inputs(1, int(cu_k[-1]), int(cu_k[-1]), 8, 2, 128, seed=2))
    kw = dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1000, max_seqlen_k=4100)
    x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attention(*x, backend=backend, **kw)
    grads = torch.autograd.grad(out, x, dout)
    x64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference.attention_forward(*x64, **kw)
    ref = torch.autograd.grad(ref_out, x64, dout.double())
    assert _rel(out, ref_out) < 1e-2
    for a, r in zip(grads, ref):
        assert _rel(a, r, ref[2].norm()) < 2e-2
