"""GPU checks of the Gluon W4A16 GEMM (`kernels.gluon_w4a16`) against a float64 reference (run on an H200:
`TRITON_INTERPRET=0 pytest tests/gpu/test_gluon_w4a16_gpu.py`). Skipped without an sm_90 GPU.

The reference is built from the integer codes (packed with `w4a16_pack`, so the kernel's reading of the layout is
checked too) and the 16-bit scales/zeros, in float64: y = x @ (s * (q - z)). The kernel rounds W to 16 bits
once (as `w4a16_matmul` does) and accumulates in fp32; the tolerance is the CPU W4A16 tests' (max error <= tol *
max |y|). With HF_FASTPATH_GPU_REPORT=path, every case's error goes to that JSON file as well."""

from __future__ import annotations

import pytest
import torch

from hf_fastpath.kernels import gluon_w4a16 as gw
from hf_fastpath.kernels.w4a16_layout import w4a16_pack, w4a16_unpack

from tests.gpu.common import REPORT, needs_sm90_gluon

pytestmark = needs_sm90_gluon(gw.HAS_GLUON)

TOL = {torch.float16: 4e-3, torch.bfloat16: 2.5e-2}  # as tests/test_w4a16_kernels.py


_LAYERS: dict = {}


def _layer(k, n, gs, dtype, zeros="asym"):
    """(qweight, scales, zeros, W in float64 on the GPU), cached per shape: the big layers take a while to pack."""
    key = (k, n, gs, dtype, zeros)
    if key not in _LAYERS:
        if len(_LAYERS) > 4:
            _LAYERS.clear()
        g = torch.Generator(device="cuda").manual_seed(k * 7 + n + gs)
        codes = torch.randint(0, 16, (k, n), device="cuda", generator=g)
        groups = k // gs
        scales = (torch.rand(groups, n, device="cuda", generator=g) * 0.05 + 0.005).to(dtype)
        if zeros == "sym":
            z = torch.full((groups, n), 8.0, device="cuda").to(dtype)
        else:
            z = torch.randint(0, 16, (groups, n), device="cuda", generator=g).to(dtype)
        qweight = w4a16_pack(codes)
        assert torch.equal(w4a16_unpack(qweight), codes.to(torch.int32))
        w64 = scales.double().repeat_interleave(gs, 0) * (codes.double() - z.double().repeat_interleave(gs, 0))
        _LAYERS[key] = (qweight, scales, z, w64)
    return _LAYERS[key]


def _check(name, m, k, n, gs, dtype, zeros="asym", seed=0, unpack="ptx", scales_by="auto"):
    qweight, scales, z, w64 = _layer(k, n, gs, dtype, zeros)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    assert gw.supported(x, qweight, gs)
    y = gw.gluon_w4a16_matmul(x, qweight, scales, z, gs, unpack=unpack, scales_by=scales_by)
    torch.cuda.synchronize()
    ref = x.double() @ w64
    assert y.shape == (m, n) and y.dtype == dtype
    assert torch.isfinite(y).all(), f"{name}: NaN/inf"
    err = (y.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    REPORT.append(dict(case=f"{name} {unpack}", max_err=err, scale=scale, rel=err / max(scale, 1e-30)))
    assert err <= TOL[dtype] * scale, f"{name}: max error {err:.3g} vs scale {scale:.3g}"
    return y


MS = [1, 7, 16, 63, 64, 100, 128, 256, 1000, 4096]
SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (512, 384), (512, 1001), (384, 200)]  # (K, N); odd N; K / 128 odd


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("kn", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_g128_bf16_matches_float64(kn, m):
    k, n = kn
    _check(f"bf16 g128 M={m} K={k} N={n}", m, k, n, 128, torch.bfloat16)


@pytest.mark.parametrize("m", [1, 64, 100, 1000])
@pytest.mark.parametrize("kn", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_g128_fp16_matches_float64(kn, m):
    k, n = kn
    _check(f"fp16 g128 M={m} K={k} N={n}", m, k, n, 128, torch.float16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 63, 100, 1000])
@pytest.mark.parametrize("kn", [(4096, 4096), (512, 1001), (384, 200)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_plain_unpack_matches_float64(kn, m, dtype):
    k, n = kn
    _check(f"{dtype} g128 M={m} K={k} N={n}", m, k, n, 128, dtype, unpack="plain")


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
@pytest.mark.parametrize("m", [1, 64, 300])
@pytest.mark.parametrize("kn", [(4096, 4096), (1152, 1001), (384, 200)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_split_k_matches_float64(kn, m, splits):
    """Explicit K splits (9 and 3 K tiles: odd counts, the last split with a phantom tile), fp32 partial sums."""
    k, n = kn
    qweight, scales, z, w64 = _layer(k, n, 128, torch.bfloat16)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    y = gw.gluon_w4a16_matmul(x, qweight, scales, z, 128, splits=splits)
    ref = x.double() @ w64
    err = (y.double() - ref).abs().max().item()
    REPORT.append(dict(case=f"split {splits} M={m} K={k} N={n}", max_err=err, scale=ref.abs().max().item()))
    assert err <= TOL[torch.bfloat16] * ref.abs().max().item()


@pytest.mark.parametrize("gs", [32, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_unpack_paths_are_bitwise_equal(dtype, gs):
    """Both paths round s * (q - z) (exact for integer zero points) once to 16 bits, so their A operands and
    hence their outputs are identical bit for bit; a difference means one path mis-reads the layout or scales."""
    qweight, scales, z, _ = _layer(4096, 4096, gs, dtype)
    x = torch.randn(200, 4096, device="cuda").to(dtype)
    a = gw.gluon_w4a16_matmul(x, qweight, scales, z, gs, unpack="ptx")
    b = gw.gluon_w4a16_matmul(x, qweight, scales, z, gs, unpack="plain")
    diff = (a.double() - b.double()).abs().max().item()
    REPORT.append(dict(case=f"ptx vs plain {dtype} g{gs}", max_abs_diff=diff))
    assert torch.equal(a, b), f"max |ptx - plain| = {diff}"


@pytest.mark.parametrize("gs", [32, 64, 256, -1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 63, 128, 1000])
@pytest.mark.parametrize("kn", [(4096, 4096), (512, 1001)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_other_groups_match_float64(kn, m, dtype, gs):
    k, n = kn
    eff = k if gs == -1 else gs
    _check(f"{dtype} g{gs} M={m} K={k} N={n}", m, k, n, eff, dtype)


@pytest.mark.parametrize("m", [1, 16, 100, 1000])
@pytest.mark.parametrize("kng", [(4096, 4096, 128), (4096, 14336, 128), (512, 1000, 128), (384, 200, 128),
                                 (4096, 4096, 256), (512, 1000, 256), (4096, 4096, -1), (384, 200, -1)],
                         ids=lambda s: f"{s[0]}x{s[1]}g{s[2]}")
def test_scales_by_tma_is_bitwise_the_loads(kng, m):
    """scales_by="tma" (scales and zeros through the producer's TMA ring) reads the same values as the consumers'
    loads, so the outputs are equal bit for bit; N not a multiple of 128 (boxes running past N and off the end), an
    odd K-tile count (a phantom tile), split-K (the small M) and one group (gs = -1) included. (N = 1001, whose
    boxes start off 16-byte boundaries, raised an illegal-instruction fault on the H200: refused since.)"""
    k, n, gs = kng
    eff = k if gs == -1 else gs
    y = _check(f"bf16 g{gs} M={m} K={k} N={n} tma", m, k, n, eff, torch.bfloat16, scales_by="tma")
    qweight, scales, z, _ = _layer(k, n, eff, torch.bfloat16)
    x = torch.randn(m, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(y, gw.gluon_w4a16_matmul(x, qweight, scales, z, eff, scales_by="load"))


def test_symmetric_zeros_and_leading_dims():
    qweight, scales, z, w64 = _layer(1024, 512, 128, torch.bfloat16, "sym")
    x = torch.randn(2, 3, 50, 1024, device="cuda").to(torch.bfloat16)
    y = gw.gluon_w4a16_matmul(x, qweight, scales, z, 128)
    ref = x.double() @ w64
    assert y.shape == (2, 3, 50, 512)
    assert (y.double() - ref).abs().max().item() <= TOL[torch.bfloat16] * ref.abs().max().item()


def test_misaligned_and_strided_x():
    qweight, scales, z, w64 = _layer(512, 384, 128, torch.bfloat16)
    base = torch.randn(65 * 512 + 1, device="cuda").to(torch.bfloat16)
    x = base[1:].view(65, 512)  # 2-byte offset: not 16-byte aligned for TMA
    y = gw.gluon_w4a16_matmul(x, qweight, scales, z, 128)
    ref = x.double() @ w64
    assert (y.double() - ref).abs().max().item() <= TOL[torch.bfloat16] * ref.abs().max().item()
    xt = torch.randn(512, 70, device="cuda").to(torch.bfloat16).t()  # column-major
    y = gw.gluon_w4a16_matmul(xt, qweight, scales, z, 128)
    ref = xt.double() @ w64
    assert (y.double() - ref).abs().max().item() <= TOL[torch.bfloat16] * ref.abs().max().item()


def test_matches_the_triton_kernel():
    """Same inputs as `w4a16_matmul`: the two agree to the bf16 tolerance (both round W once to 16 bits)."""
    from hf_fastpath.kernels.w4a16 import w4a16_matmul

    qweight, scales, z, w64 = _layer(4096, 4096, 128, torch.bfloat16)
    for m in (16, 300):
        x = torch.randn(m, 4096, device="cuda").to(torch.bfloat16)
        a = gw.gluon_w4a16_matmul(x, qweight, scales, z, 128).double()
        b = w4a16_matmul(x, qweight, scales, z, 128).double()
        assert (a - b).abs().max().item() <= TOL[torch.bfloat16] * b.abs().max().item()


@pytest.mark.parametrize("unpack", ["ptx", "plain"])
@pytest.mark.parametrize("m", [1, 64, 1000])
def test_repeat_runs_are_bitwise_identical(m, unpack):
    """No atomics (split-K partials are summed by torch): a race (a slot reused before its wgmma finished, A
    registers rewritten while a wgmma reads them) shows as run-to-run differences. 200 calls, each compared bit
    for bit with the first. 14336 x 4096 has 32 column tiles, so M = 1 and 64 also take the split-K path."""
    qweight, scales, z, _ = _layer(14336, 4096, 128, torch.bfloat16)  # 32 column tiles: M <= 64 splits K
    x = torch.randn(m, 14336, device="cuda").to(torch.bfloat16)
    first = gw.gluon_w4a16_matmul(x, qweight, scales, z, 128, unpack=unpack)
    bad = 0
    for _ in range(200):
        bad += int(not torch.equal(gw.gluon_w4a16_matmul(x, qweight, scales, z, 128, unpack=unpack), first))
    REPORT.append(dict(case=f"repeat M={m} {unpack}", mismatching_calls=bad))
    assert bad == 0, f"{bad}/200 calls differ from the first"


def test_empty_inputs():
    qweight, scales, z, _ = _layer(512, 384, 128, torch.bfloat16)
    y = gw.gluon_w4a16_matmul(torch.empty(0, 512, device="cuda", dtype=torch.bfloat16), qweight, scales, z, 128)
    assert y.shape == (0, 384)


@pytest.mark.parametrize("m", [23, 24, 300, 512, 513])
def test_w4a16_matmul_dispatches_to_gluon_in_its_row_range(m):
    """The package's entry point inside a CUDA graph: Gluon for GLUON_MIN_M..GLUON_MAX_M rows (bitwise its output),
    the Triton paths outside. Eagerly this layer (4096 x 1024, a few GFLOP) is too short to hide Gluon's launch:
    the Triton paths run at every M."""
    from hf_fastpath.kernels import w4a16

    qweight, scales, z, w64 = _layer(4096, 1024, 128, torch.bfloat16)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ w64
    gluon = gw.gluon_w4a16_matmul(x, qweight, scales, z, 128)  # compiled before the capture
    eager = w4a16.w4a16_matmul(x, qweight, scales, z, 128)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w4a16.w4a16_matmul(x, qweight, scales, z, 128)
    graph.replay()
    torch.cuda.synchronize()
    for out in (y, eager):
        assert (out.double() - ref).abs().max().item() <= TOL[torch.bfloat16] * ref.abs().max().item()
    assert torch.equal(y, gluon) == (w4a16.GLUON_MIN_M <= m <= w4a16.GLUON_MAX_M)
    assert not torch.equal(eager, gluon)


def _back_to_back(k, ns, gs, dtype=torch.bfloat16):
    """Parts packed each on its own and stored back to back in one allocation per tensor kind (as
    `fuse_siblings` leaves q/k/v or gate/up), with the float64 reference of [W_0 | W_1 | ...]."""
    layers = []
    for j, n in enumerate(ns):  # each part its own random weights (equal parts would hide a part read twice)
        g = torch.Generator(device="cuda").manual_seed(1000 + j)
        codes = torch.randint(0, 16, (k, n), device="cuda", generator=g)
        sc = (torch.rand(k // gs, n, device="cuda", generator=g) * 0.05 + 0.005).to(dtype)
        zz = torch.randint(0, 16, (k // gs, n), device="cuda", generator=g).to(dtype)
        w64 = sc.double().repeat_interleave(gs, 0) * (codes.double() - zz.double().repeat_interleave(gs, 0))
        layers.append((w4a16_pack(codes), sc, zz, w64))
    q, s, z = (torch.cat([t.flatten() for t in ts]) for ts in zip(*(layer[:3] for layer in layers)))
    parts, off_q, off_s = [], 0, 0
    for n in ns:
        g = k // gs
        parts.append((q[off_q:off_q + k // 8 * n].view(k // 8, n), s[off_s:off_s + g * n].view(g, n),
                      z[off_s:off_s + g * n].view(g, n)))
        off_q, off_s = off_q + k // 8 * n, off_s + g * n
    return parts, torch.cat([layer[3] for layer in layers], 1)


@pytest.mark.parametrize("m", [1, 16, 64, 300])
@pytest.mark.parametrize("ns", [(4096, 1024, 1024), (1024, 512), (14336, 14336)], ids=lambda s: "+".join(map(str, s)))
def test_segments_match_float64(ns, m):
    """Up to three weights packed on their own and stored back to back, as one launch (`segments`): q/k/v and
    gate/up shapes, split-K (small M), 128-row tiles (300)."""
    from hf_fastpath.kernels import w4a16

    k = 4096
    parts, w64 = _back_to_back(k, ns, 128)
    n = sum(ns)
    segments = (ns[0], ns[0] + ns[1] if len(ns) == 3 else n)
    x = torch.randn(m, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(m)).to(torch.bfloat16)
    y = gw.gluon_w4a16_matmul_rows(x, *w4a16._spanning(parts, n), 128, segments=segments)
    torch.cuda.synchronize()
    ref = x.double() @ w64
    err, scale = (y.double() - ref).abs().max().item(), ref.abs().max().item()
    REPORT.append(dict(case=f"segments {ns} M={m}", max_err=err, scale=scale, rel=err / scale))
    assert y.shape == (m, n) and err <= TOL[torch.bfloat16] * scale


def test_fused_projections_run_gluon_segments_inside_cuda_graphs(monkeypatch):
    """w4a16_matmul_concat_rows captured in a CUDA graph with Gluon's row range lowered to cover it: bitwise the
    direct segmented call."""
    from hf_fastpath.kernels import w4a16

    parts, w64 = _back_to_back(4096, (4096, 1024, 1024), 128)
    x = torch.randn(4, 4096, device="cuda").to(torch.bfloat16)
    direct = gw.gluon_w4a16_matmul_rows(x, *w4a16._spanning(parts, 6144), 128, segments=(4096, 5120))
    monkeypatch.setattr(w4a16, "GLUON_MIN_M", 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w4a16.w4a16_matmul_concat_rows(x, parts, 128)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, direct)
    ref = x.double() @ w64
    assert (y.double() - ref).abs().max().item() <= TOL[torch.bfloat16] * ref.abs().max().item()
