"""FP8 / FP4 quantizers against brute-force exact references."""

import itertools

import pytest
import torch

from hf_fastpath.kernels import lowbit_quant as lq

GRID = torch.tensor(lq.E2M1_VALUES)


def _nearest_e2m1_bruteforce(y: torch.Tensor) -> torch.Tensor:
    """Nearest signed E2M1 value, ties to the code with an even mantissa bit (code index even)."""
    a = y.abs().clamp(max=6.0)
    dist = (a[:, None] - GRID[None, :]).abs()
    best = dist.min(1, keepdim=True).values
    cand = dist == best
    idx = torch.arange(8)[None, :].expand_as(cand)
    # among tied candidates prefer an even code index (mantissa bit 0)
    score = torch.where(cand, (idx % 2) * 100 + idx, torch.full_like(idx, 10_000))
    mag = GRID[score.argmin(1)]
    return torch.where(y < 0, -mag, mag)


def test_all_16_codes_roundtrip():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = lq.e2m1_decode(codes)
    expect = torch.tensor(lq.E2M1_VALUES + tuple(-v for v in lq.E2M1_VALUES))
    assert torch.equal(vals, expect)
    re = lq.e2m1_encode(vals)
    # -0 (code 8) encodes back to the canonical +0 code
    assert torch.equal(re, torch.where(codes == 8, torch.zeros_like(codes), codes))


def test_e2m1_rounding_matches_bruteforce_including_ties():
    mids = [(a + b) / 2 for a, b in zip(lq.E2M1_VALUES, lq.E2M1_VALUES[1:])]
    y = torch.tensor(list(lq.E2M1_VALUES) + mids + [7.0, 100.0, 1e-9])
    y = torch.cat([y, -y, torch.randn(5000) * 3])
    ref = _nearest_e2m1_bruteforce(y)
    assert torch.equal(lq.round_to_e2m1(y), ref)
    assert torch.equal(lq.e2m1_decode(lq.e2m1_encode(y)), ref.abs() * torch.where(ref < 0, -1.0, 1.0))


def test_pack_unpack():
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    packed = lq.pack_nibbles(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(packed[0, 0, 0] & 0xF, codes[0, 0, 0])
    assert torch.equal(lq.unpack_nibbles(packed), codes)


def test_ceil_pow2_exact():
    y = torch.tensor([0.0, 1.0, 1.5, 2.0, 3.0, 2.0 ** -100, 0.75, 5e30])
    out = lq.ceil_pow2(y)
    for yi, oi in zip(y.tolist(), out.tolist()):
        if yi == 0:
            assert oi == 0
        else:
            assert oi >= yi and oi / 2 < yi
            assert oi == 2.0 ** round(torch.log2(torch.tensor(oi, dtype=torch.float64)).item())
    # fp32 subnormals round up to the smallest normal power of two
    assert lq.ceil_pow2(torch.tensor([1e-40])).item() == 2.0 ** -126


@pytest.mark.parametrize("fmt", lq.FORMATS)
def test_roundtrip_error_bounds(fmt):
    x = torch.randn(4, 7, 3, 64) * torch.logspace(-3, 3, 7)[None, :, None, None]
    qr = lq.quantize_rows(x, fmt)
    back = lq.dequantize_rows(qr)
    assert back.shape == x.shape
    err = (back - x).abs()
    if fmt == "fp8":
        # e4m3: half-ulp relative error 2**-4 of each value, plus subnormal floor relative to the row max
        bound = x.abs() * 2 ** -4 + x.abs().amax(-1, keepdim=True) / 448 * 2 ** -10
    else:
        block = lq.BLOCK[fmt]
        xb = x.reshape(*x.shape[:-1], -1, block)
        amax_b = xb.abs().amax(-1, keepdim=True).expand_as(xb).reshape_as(x)
        # half the top E2M1 step (2) is one scale: amax/6 for nvfp4 (+2**-4 from its e4m3 scale), up to amax/3
        # for mxfp4 (scale rounded up to a power of two)
        bound = amax_b * (1 / 3 if fmt == "mxfp4" else (1 + 2 ** -4) / 6) * 1.0001 + 1e-30
    assert bool((err <= bound).all()), (err / bound).max()


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_matches_exact_reference(fmt):
    """Values equal the brute-force nearest E2M1 of x/scale times the documented scale."""
    block = lq.BLOCK[fmt]
    x = torch.randn(6, 4 * block) * 3
    qr = lq.quantize_rows(x, fmt)
    xb = x.reshape(6, 4, block)
    amax_b = xb.abs().amax(-1)
    if fmt == "mxfp4":
        e = torch.ceil(torch.log2(amax_b.double() / 6))
        scale = (2.0 ** e).float()
        assert torch.equal(qr.block_scale.long() - 127, e.long())
    else:
        row = x.abs().amax(-1) / (6 * 448)
        torch.testing.assert_close(qr.scale, row)
        scale = (amax_b / 6 / row[:, None]).to(torch.float8_e4m3fn).float() * row[:, None]
    ref = _nearest_e2m1_bruteforce((xb / scale[..., None]).flatten()).reshape_as(xb) * scale[..., None]
    assert torch.equal(lq.dequantize_rows(qr), ref.reshape_as(x))


def test_zero_rows_and_tiny_values():
    x = torch.zeros(2, 64)
    x[1, 5] = 1e-35
    for fmt in lq.FORMATS:
        qr = lq.quantize_rows(x, fmt)
        back = lq.dequantize_rows(qr)
        assert torch.isfinite(back).all()
        assert torch.equal(back[0], torch.zeros(64))


def test_mxfp4_scale_edges():
    # exact powers of two: amax/6 == 2**k exactly -> no rounding up, top code 6 is hit exactly
    x = torch.zeros(1, 32)
    x[0, 0] = 6 * 2.0 ** -3
    x[0, 1] = -0.5 * 2.0 ** -3
    qr = lq.quantize_rows(x, "mxfp4")
    assert int(qr.block_scale[0, 0]) == 127 - 3
    assert torch.equal(lq.dequantize_rows(qr), x)


@pytest.mark.parametrize("fmt", lq.FORMATS)
def test_nonfinite_inputs(fmt):
    x = torch.randn(2, 64)
    x[0, 3] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        lq.quantize_rows(x, fmt)
    x[0, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        lq.quantize_rows(x, fmt)
    # documented saturation: +-inf -> largest value, the other row is unaffected
    x[0, 3] = float("-inf")
    back = lq.dequantize_rows(lq.quantize_rows(x, fmt, check=False))
    assert torch.isfinite(back[1]).all() and back[0, 3] < 0 and not torch.isnan(back[0, 3])


def test_bad_head_dim_and_format():
    with pytest.raises(ValueError, match="multiple of the FP4 scale block"):
        lq.quantize_rows(torch.randn(2, 40), "mxfp4")
    with pytest.raises(ValueError, match="unknown low-bit format"):
        lq.quantize_rows(torch.randn(2, 32), "int4")


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_to_e4m3_container(fmt):
    x = torch.randn(5, 3, 128)
    qr = lq.quantize_rows(x, fmt)
    e4, row = lq.fp4_rows_to_e4m3(qr)
    back = e4.float() * row[..., None]
    exact = lq.dequantize_rows(qr)
    if fmt == "mxfp4":
        assert torch.equal(back, exact)
    else:
        assert bool(((back - exact).abs() <= exact.abs() * 2 ** -4 + 1e-12).all())


def test_rows_are_independent():
    """Quantizing a row never depends on another row (the causal-safety property)."""
    x = torch.randn(10, 64)
    for fmt in lq.FORMATS:
        a = lq.dequantize_rows(lq.quantize_rows(x, fmt))
        y = x.clone()
        y[5:] *= 1000
        b = lq.dequantize_rows(lq.quantize_rows(y, fmt))
        assert torch.equal(a[:5], b[:5])


def test_fp8_matches_torch_cast():
    x = torch.randn(3, 4, 32)
    q, s = lq.quantize_fp8(x)
    for i, j in itertools.product(range(3), range(4)):
        ref = (x[i, j] / (x[i, j].abs().max() / 448)).to(torch.float8_e4m3fn)
        assert torch.equal(q[i, j].view(torch.uint8), ref.view(torch.uint8))
