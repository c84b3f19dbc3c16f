"""GPU checks of the Gluon attention kernels at head dims they pad to their next tile width (`ga.tile_dim`: 72-120
run as 128, 136-248 as 256, forward and backward) against float64, with the checks of
`test_gluon_attention_masks_gpu.py` (out, lse, rows that see no key, gradients within 2x our Triton backward's
error). Run on an H200: `TRITON_INTERPRET=0 pytest tests/gpu/test_gluon_attention_head_dims_gpu.py`.

The padded columns come in as zeros through a 3-D TMA descriptor; a wrong box would read the next head's columns
(q [B, S, H, D] memory) and the comparison against float64 catches it, as it catches a store past D."""

from __future__ import annotations

import pytest
import torch

from hf_fastpath.kernels import gluon_attention as ga
from hf_fastpath.kernels.flash_attention import segment_table

from tests.gpu.common import attention_inputs, needs_sm90_gluon
from tests.gpu.test_gluon_attention_masks_gpu import _check, alibi_slopes, key_mask, segment_ids

pytestmark = needs_sm90_gluon(ga.HAS_GLUON)

PADDED = [72, 80, 96, 104, 120, 160, 192]  # 96: GPT-NeoX-20B; 80: Pythia-2.8B / Phi-2; 192: MLA-sized


def test_tile_dims():
    assert [ga.tile_dim(d) for d in PADDED] == [128, 128, 128, 128, 128, 256, 256]
    assert [ga.tile_dim(d) for d in (48, 100, 264)] == [None, None, None]


@pytest.mark.parametrize("d", PADDED)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (16, 4)], ids=["mha", "gqa"])
@pytest.mark.parametrize("sq, sk", [(1, 1), (17, 17), (129, 129), (1000, 1000), (2049, 2049), (17, 1000),
                                    (1000, 129)])
def test_plain(sq, sk, heads, causal, d):
    q, k, v, dout = attention_inputs(2, sq, sk, *heads, d, dout=True, seed=sq + sk + d)
    _check(f"hd{d} sq={sq} sk={sk} h={heads} causal={causal}", q, k, v, dout, causal, {})


@pytest.mark.parametrize("d", [80, 96, 192])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bhsd", [False, True])
def test_dtypes_and_layouts(bhsd, dtype, d):
    # [B, H, S, D] memory (Transformers' transposed views) loads through a [1, B*H*S, D] descriptor
    q, k, v, dout = attention_inputs(2, 300, 333, 8, 2, d, dtype=dtype, bhsd=bhsd, dout=True, seed=d)
    _check(f"hd{d} dtype={dtype} bhsd={bhsd}", q, k, v, dout, True, {})


@pytest.mark.parametrize("d", [96, 104, 192])
def test_features(d):
    # every mask and score feature once at a padded head dim
    b, s = 3, 1000
    q, k, v, dout = attention_inputs(b, s, s, 8, 2, d, dout=True, seed=d + 1)
    for kind in ("right", "holes", "empty"):
        _check(f"hd{d} key_mask {kind}", q, k, v, dout, True, dict(key_mask=key_mask(b, s, kind, seed=2)))
    for kind in ("random", "long", "ones"):
        _check(f"hd{d} segments {kind}", q, k, v, dout, True,
               dict(segments=segment_table(segment_ids(b, s, kind, seed=3))))
    _check(f"hd{d} window", q, k, v, dout, True, dict(window_size=(150, -1)))
    _check(f"hd{d} softcap", q, k, v, dout, False, dict(softcap=5.0))
    _check(f"hd{d} alibi", q, k, v, dout, True, dict(alibi_slopes=alibi_slopes(8)))
    _check(f"hd{d} alibi full", q, k, v, dout, False, dict(alibi_slopes=alibi_slopes(8, b) / 8))
