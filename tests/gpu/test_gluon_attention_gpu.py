"""GPU checks of the Gluon Hopper attention forward against float64 (run on an H200:
`TRITON_INTERPRET=0 pytest tests/gpu/test_gluon_attention_gpu.py`). Skipped without an sm_90 GPU. Every check runs
for the default configuration and for each opt-in variant of `gluon_attention.variants` (`-k default` for the
default alone, `-k persistent` etc. for one variant).

With HF_FASTPATH_GPU_REPORT=path, every case's errors go to that JSON file as well."""

from __future__ import annotations

import pytest
import torch

from hf_fastpath.attention import reference
from hf_fastpath.kernels import gluon_attention as ga

from tests.gpu.common import REPORT, attention_inputs, needs_sm90_gluon

pytestmark = needs_sm90_gluon(ga.HAS_GLUON)


def _cfg(variant, d, causal):
    """The configuration a test id names: "default" or a key of `ga.variants`."""
    return None if variant == "default" else ga.variants(d, causal)[variant]


def _check(name, q, k, v, causal, tol=1e-2, variant="default"):
    out, lse = ga.gluon_attention_forward(q, k, v, causal=causal, variant=_cfg(variant, q.shape[-1], causal))
    ref_out, ref_lse = reference.attention_forward(q.double(), k.double(), v.double(), causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert torch.isfinite(out).all(), "out has NaN/inf"
    rel = ((out.double() - ref_out).norm() / ref_out.norm().clamp_min(1e-30)).item()
    empty = ref_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), "lse -inf rows differ from the reference"
    assert not torch.isnan(lse).any()
    lse_err = (lse.double() - ref_lse)[~empty].abs().max().item() if (~empty).any() else 0.0
    if empty.any():  # rows that see no key: exactly zero output
        rows = empty.transpose(1, 2)  # [B, Sq, H]
        assert (out[rows] == 0).all()
    REPORT.append(dict(case=name, variant=variant, out_rel=rel, lse_abs=lse_err))
    assert rel < tol, (name, rel)
    assert lse_err < 2e-3, (name, lse_err)


SHAPES = [  # b, sq, sk, hq, hkv
    (1, 1, 1, 4, 4), (2, 17, 17, 4, 1), (1, 127, 129, 8, 2), (3, 129, 127, 4, 4), (1, 1000, 1000, 32, 8),
    (2, 2049, 2049, 4, 4), (1, 1000, 2049, 8, 8), (2, 2049, 1000, 8, 2), (1, 17, 2049, 4, 4), (1, 256, 256, 4, 4),
]


def _variants(d):
    """"default" and the opt-in variants of head dim d (both causal modes have the same ones; hd128 has one more)."""
    names = set(ga.variants(d, False)) & set(ga.variants(d, True)) if ga.HAS_GLUON else set()
    return ["default"] + sorted(names)


@pytest.mark.parametrize("d, variant", [(d, v) for d in (64, 128, 256) for v in _variants(d)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_reference(shape, causal, d, variant):
    b, sq, sk, hq, hkv = shape
    _check(f"{shape} causal={causal} d={d}", *attention_inputs(b, sq, sk, hq, hkv, d), causal, variant=variant)


@pytest.mark.parametrize("variant", _variants(128))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bhsd", [False, True])
def test_dtypes_and_layouts(dtype, bhsd, variant):
    _check(f"dtype={dtype} bhsd={bhsd}", *attention_inputs(2, 300, 333, 8, 2, 128, dtype=dtype, bhsd=bhsd), True,
           variant=variant)


@pytest.mark.parametrize("variant", _variants(64))
def test_fully_masked_rows_are_zero_with_lse_minus_inf(variant):
    # causal with Sq > Sk: the first Sq - Sk queries see no key (whole query tiles without a key tile among them)
    _check("sq>sk causal", *attention_inputs(2, 700, 130, 4, 2, 64), True, variant=variant)


@pytest.mark.parametrize("variant", _variants(64))
def test_many_work_items_per_cta(variant):
    """More work items than SMs, so a persistent CTA runs several (the ring and Q phases carry across items);
    causal with Sq > Sk mixes items without key tiles among them."""
    _check("many items full", *attention_inputs(4, 1000, 1000, 40, 8, 64, seed=1), False, variant=variant)
    _check("many items causal sq>sk", *attention_inputs(3, 1500, 700, 48, 16, 64, seed=2), True, variant=variant)


@pytest.mark.parametrize("variant", _variants(128))
def test_repeat_runs_are_bitwise_equal(variant):
    q, k, v = attention_inputs(2, 2049, 2049, 16, 4, 128, seed=3)
    for causal in (False, True):
        cfg = _cfg(variant, 128, causal)
        first = ga.gluon_attention_forward(q, k, v, causal=causal, variant=cfg)
        for _ in range(4):
            again = ga.gluon_attention_forward(q, k, v, causal=causal, variant=cfg)
            assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@pytest.mark.parametrize("variant", _variants(128)[1:])
def test_variant_matches_the_default_bitwise(variant):
    """A variant changes scheduling and the store only, not arithmetic: its outputs equal the default's (a
    variant with fewer K/V stages too: the key-tile order and the math are the same)."""
    q, k, v = attention_inputs(2, 1111, 1234, 16, 4, 128, seed=4)
    for causal in (False, True):
        want = ga.gluon_attention_forward(q, k, v, causal=causal)
        got = ga.gluon_attention_forward(q, k, v, causal=causal, variant=_cfg(variant, 128, causal))
        diff = ((want[0].float() - got[0].float()).abs().max().item(), (want[1] - got[1]).abs().max().item())
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), (variant, causal, diff)


def test_rejects_unsupported_inputs_with_a_clear_error():
    q, k, v = attention_inputs(1, 16, 16, 4, 4, 64)
    with pytest.raises(ValueError, match="head dim"):
        ga.gluon_attention_forward(q[..., :48], k[..., :48], v[..., :48])
    with pytest.raises(ValueError, match="multiple"):
        ga.gluon_attention_forward(q[:, :, :3], k[:, :, :2], v[:, :, :2])
    assert ga.supported(q, k, v) and not ga.supported(q.float(), k.float(), v.float())
