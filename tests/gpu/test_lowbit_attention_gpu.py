"""GPU checks of the Triton FP8 attention forward (`kernels/lowbit_attention.py`) on batches whose sequences start
anywhere: varlen offsets that are not multiples of 16 tokens and dense batches of odd lengths (the TMA loads of V^T
need 16-token aligned starts; such calls hit an illegal instruction on the H200 before session 19), and the aligned
dense batches that keep TMA. Against the float emulation of the same quantized arithmetic, per sequence (cosine >
0.999, lse within 1e-3) and float64 attention (cosine > 0.997). Run on an H200: `TRITON_INTERPRET=0 pytest
tests/gpu/test_lowbit_attention_gpu.py`; skipped without a Hopper GPU."""

from __future__ import annotations

import os

import pytest
import torch

from hf_fastpath.attention import lowbit, reference
from hf_fastpath.kernels import lowbit_attention as kla

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a Hopper GPU (the TMA path) and TRITON_INTERPRET unset")


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), 0).item()


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [[1000, 1000], [777, 5, 1, 300], [1008, 16, 1024]], ids=str)
def test_varlen_starts_anywhere(lengths, causal, d):
    g = torch.Generator(device="cuda").manual_seed(len(lengths))
    t = sum(lengths)
    q = torch.randn(t, 8, d, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(t, 2, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    out, lse = lowbit.fp8_attention(q, k, v, causal=causal, rotate=False, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                    max_seqlen_q=max(lengths), max_seqlen_k=max(lengths), return_lse=True)
    torch.cuda.synchronize()
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        emu, emu_lse = kla.lowbit_attention_emulated(*(x[a:b].float() for x in (q, k, v)), causal=causal)
        assert _cos(out[a:b], emu) > 0.999, (a, b)
        assert (lse[:, a:b] - emu_lse).abs().max() < 1e-3, (a, b)


@pytest.mark.parametrize("s, aligned", [(777, False), (1024, True)])
def test_dense_batches(s, aligned, monkeypatch):
    # the public dense path: odd lengths load by pointers, lengths of 16k tokens by TMA (which is what is timed)
    seen = []
    launch = kla._launch
    monkeypatch.setattr(kla, "_launch", lambda *a: seen.append(a[-1]) or launch(*a))
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, s, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = lowbit.fp8_attention(q, k, v, causal=True)
    ref = reference.attention_forward(q[:1].double(), k[:1].double(), v[:1].double(), causal=True)[0]
    assert seen == [aligned] and _cos(out[:1], ref) > 0.997
