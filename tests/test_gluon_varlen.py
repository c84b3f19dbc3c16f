"""`gluon_attention.varlen_spans`: varlen calls whose queries and keys are packed by different offsets run on the
Gluon kernels as packed-segment masks, with causality and the window folded into two bounds per query (forward)
and per key (backward). The kernels read nothing else of the mask, and their tile plans assume the bounds never
decrease along the rows: both are checked here against the mask spelled out from cu_seqlens, over random packings
with empty sequences, sequences with more queries than keys, and tokens outside every sequence. The kernels
themselves run on a Hopper GPU (tests/gpu/test_gluon_attention_varlen_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_fastpath.kernels import gluon_attention as ga


def _mask(cu_q, cu_k, total_q, total_k, causal, window):
    """[total_q, total_k] bool: which keys each query sees, one sequence at a time (flash-attn's conventions)."""
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    mask = torch.zeros(total_q, total_k, dtype=torch.bool)
    for i in range(len(cu_q) - 1):
        lq, lk = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        for qp in range(lq):
            for kp in range(lk):
                diag = qp + lk - lq
                ok = (left < 0 or kp >= diag - left) and (right < 0 or kp <= diag + right)
                mask[cu_q[i] + qp, cu_k[i] + kp] = ok
    return mask


@st.composite
def _packings(draw):
    n = draw(st.integers(0, 5))
    lq = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    lk = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    start_q, start_k = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    cu_q = [start_q] + [start_q + sum(lq[:i + 1]) for i in range(n)]
    cu_k = [start_k] + [start_k + sum(lk[:i + 1]) for i in range(n)]
    return cu_q, cu_k, cu_q[-1] + draw(st.integers(0, 2)), cu_k[-1] + draw(st.integers(0, 2))


@settings(max_examples=150, deadline=None)
@given(_packings(), st.booleans(), st.sampled_from([(-1, -1), (2, -1), (0, 0), (3, 1), (-1, 2)]))
def test_spans_are_the_mask(packing, causal, window):
    cu_q, cu_k, total_q, total_k = packing
    per_query, per_key = ga.varlen_spans(torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k), total_q, total_k,
                                         causal, window)
    assert per_query.shape == (3, 1, total_q) and per_key.shape == (3, 1, total_k)
    assert per_query.dtype == per_key.dtype == torch.int32 and per_query.is_contiguous() and per_key.is_contiguous()
    want = _mask(cu_q, cu_k, total_q, total_k, causal, window)
    keys, rows = torch.arange(total_k), torch.arange(total_q)
    lo, hi = per_query[1, 0, :, None], per_query[2, 0, :, None]
    assert torch.equal((keys >= lo) & (keys < hi), want)  # forward: each query's keys, lo..hi-1
    q_lo, q_hi = per_key[1, 0, :, None], per_key[2, 0, :, None]
    assert torch.equal(((rows >= q_lo) & (rows < q_hi)).T, want)  # backward: each key's queries
    for bounds in (per_query[1:], per_key[1:]):  # the tile plans take a tile's first / last row as its extremes
        assert (bounds[..., 1:] >= bounds[..., :-1]).all()
    assert ((per_query[1] >= 0) & (per_query[2] <= total_k)).all()
    assert ((per_key[1] >= 0) & (per_key[2] <= total_q)).all()


def test_spans_made_once_per_cu_seqlens_pair():
    # every layer passes the same cu_seqlens tensors: the ~20 small ops run once; a new key offsets tensor (or a
    # changed one) gets tables of its own
    cu_q, cu_k = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 6, 14], dtype=torch.int32)
    first = ga._spans_of(cu_q, cu_k, 9, 14, True, (-1, -1))
    assert ga._spans_of(cu_q, cu_k, 9, 14, True, (-1, -1)) is first
    assert ga._spans_of(cu_q, cu_k, 9, 14, False, (-1, -1)) is not first
    other = torch.tensor([0, 7, 14], dtype=torch.int32)
    assert not torch.equal(ga._spans_of(cu_q, other, 9, 14, True, (-1, -1))[0], first[0])
    cu_k[1] = 7
    assert torch.equal(ga._spans_of(cu_q, cu_k, 9, 14, True, (-1, -1))[0], ga.varlen_spans(cu_q, cu_k, 9, 14, True)[0])


@pytest.mark.skipif(not ga.HAS_GLUON, reason="needs Triton's Gluon (triton >= 3.6)")
def test_varlen_errors_name_the_fix():
    from hf_fastpath.kernels import gluon_attention_bwd as gb

    q, k = torch.empty(9, 4, 64, dtype=torch.bfloat16), torch.empty(14, 2, 64, dtype=torch.bfloat16)
    cu_q, cu_k = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 6, 14], dtype=torch.int32)
    with pytest.raises(ValueError, match="ALiBi.*flash_attention"):
        ga.gluon_attention_forward(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, alibi_slopes=torch.ones(4))
    with pytest.raises(ValueError, match="together"):
        ga.gluon_attention_forward(q, k, k, cu_seqlens_q=cu_q)
    with pytest.raises(ValueError, match="same length"):
        ga.gluon_attention_forward(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k[:2])
    with pytest.raises(ValueError, match=r"\[total_tokens, heads, head_dim\]"):
        ga.gluon_attention_forward(q[None], k[None], k[None], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="key_mask and segments"):
        ga.gluon_attention_forward(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, key_mask=torch.ones(1, 14))
    with pytest.raises(ValueError, match="deterministic.*flash_attention_backward"):
        gb.gluon_attention_backward(q, q, k, k, q, torch.zeros(4, 9), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                    deterministic=True)
