"""The Gluon W4A16 GEMM (`kernels.gluon_w4a16`) compiles for sm_90 and fits its shared memory, checked without a
GPU; its host-side checks behave on the CPU.

Gluon has no interpreter, so nothing else in CI compiles it: `gluon_w4a16_builds.py` builds each variant with
Triton's own compiler in a subprocess (TRITON_INTERPRET=0), for the Triton installed here.
"""

from __future__ import annotations

import pytest
import torch

from hf_fastpath.kernels import gluon_w4a16 as gw
from hf_fastpath.kernels.w4a16_layout import w4a16_pack

from tests.offline_builds import HOPPER_SHARED_BYTES, run_build_script


@pytest.fixture(scope="module")
def builds():
    return run_build_script("gluon_w4a16_builds.py", timeout=1200)


@pytest.mark.skipif(not gw.HAS_GLUON, reason="this Triton has no Gluon Hopper module")
def test_gluon_w4a16_builds_for_sm90(builds):
    failed = [b for b in builds if "error" in b]
    assert not failed, failed
    assert not [b for b in builds if b["shared"] > HOPPER_SHARED_BYTES], builds
    assert not [b for b in builds if b["spills"]], builds  # LLVM-level spills (local. in the PTX)
    assert not [b for b in builds if "ptxas_error" in b], builds  # Triton's wheel ships ptxas: it must report
    assert not [b for b in builds if b["ptxas_spill_bytes"]], builds  # ptxas spills
    # one register-A wgmma group per K tile step: 8 x K=16 wgmmas each, one wait with a group in flight
    assert all(b["wgmma"] % 8 == 0 and b["wgmma_wait_1"] > 0 for b in builds), builds
    # ptxas keeps the wgmmas asynchronous (no C7514/C7515 note, no wait right after each HGMMA): otherwise the
    # dequantization cannot overlap the MMA, the point of this kernel
    assert not [b for b in builds if b.get("serialized") or b.get("ptxas_notes")], builds
    assert not [b for b in builds if b["barrier_overlaps"]], builds  # `offline_builds.barrier_overlaps`
    names = {b["name"] for b in builds}
    tiles = {f"m{bm} s{st}" for bm, st in (gw.config(m) for m in (1, 32, 64, 4096))}  # every row bucket
    assert {f"{t} g128 bf16" for t in tiles} | {f"{t} g128 bf16 tma" for t in tiles} <= names
    big = "m%d s%d" % gw.config(4096)
    assert {f"{big} g64 fp16", f"{big} g128 bf16 plain", f"{big} g128 bf16 split tma"} <= names


def _weights(k, n, gs, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (k, n), generator=g)
    groups = k // gs
    return (w4a16_pack(codes), torch.rand(groups, n, generator=g).to(dtype) * 0.01,
            torch.full((groups, n), 8.0, dtype=dtype))


def test_supported_is_false_off_gpu():
    qw = _weights(256, 64, 128)[0]
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    assert gw.supported(x, qw, 128) is False  # CPU tensors
    assert gw.supported("x", qw, 128) is False
    assert gw.supported(x, qw.float(), 128) is False


def test_config_fits_shared_memory():
    for m in (1, 16, 17, 32, 33, 64, 65, 128, 129, 4096):
        block_m, stages = gw.config(m)
        assert block_m in (16, 32, 64, 128) and block_m >= min(m, 128) and (m <= 16 or block_m < 2 * m)
        # per stage: the x tile, the weight words, and the scales and zeros (scales_by="tma")
        per_stage = block_m * gw.BLOCK_K * 2 + gw.BLOCK_N * 16 * 4 + 2 * gw.BLOCK_N * 2
        assert stages * per_stage <= HOPPER_SHARED_BYTES - 1024


def test_group_sizes():
    assert gw._group_ok(32, 256) and gw._group_ok(64, 256) and gw._group_ok(128, 256) and gw._group_ok(256, 256)
    assert not gw._group_ok(16, 256) and not gw._group_ok(96, 384) and not gw._group_ok(384, 256)


@pytest.mark.skipif(not gw.HAS_GLUON, reason="this Triton has no Gluon Hopper module")
@pytest.mark.parametrize("case, match", [
    ("dtype", "float16 or bfloat16"),
    ("features", "features but qweight holds"),
    ("ragged_k", "multiple of 128"),
    ("group", "group_size 16 is not supported"),
    ("scales_shape", "scales must have shape"),
    ("scales_dtype", "differs from x's"),
    ("qweight_dtype", "int32"),
    ("cpu", "Hopper GPUs only"),
    ("unpack", "unpack must be"),
    ("scales_by", "scales_by must be"),
    ("tma_small_group", "multiples of 128"),
    ("tma_odd_n", "N a multiple of 8"),
])
def test_argument_errors_name_the_problem(case, match):
    k, n, gs = 256, 64, 128
    qw, s, z = _weights(k, n, gs)
    x = torch.randn(2, k, dtype=torch.bfloat16)
    if case == "dtype":
        x = x.float()
    elif case == "features":
        x = torch.randn(2, k + 8, dtype=torch.bfloat16)
    elif case == "ragged_k":
        qw, s, z = _weights(192, n, 64)
        x, gs = torch.randn(2, 192, dtype=torch.bfloat16), 64
    elif case == "group":
        qw, s, z = _weights(k, n, 16)
        gs = 16
    elif case == "scales_shape":
        s = s[:, :-1]
    elif case == "scales_dtype":
        s = s.half()
    elif case == "qweight_dtype":
        qw = qw.to(torch.int64)
    elif case == "tma_small_group":
        qw, s, z = _weights(k, n, 64)
        gs = 64
    elif case == "tma_odd_n":
        qw, s, z = _weights(k, 60, gs)
    scales_by = {"scales_by": "smem", "tma_small_group": "tma", "tma_odd_n": "tma"}.get(case, "load")
    with pytest.raises(ValueError, match=match):
        gw.gluon_w4a16_matmul(x, qw, s, z, gs, unpack="fast" if case == "unpack" else "ptx", scales_by=scales_by)


def test_the_kernels_index_mapping_on_the_cpu():
    """What the kernel assumes about the layout, replayed in torch: the TMA box of K tile t and columns n0... is
    rows t * N + n0... of qweight viewed as [K / 128 * N, 16]; nibble j of word (n, i) is input 128 t + 16 j + i;
    the plane stack join / permute / reshape puts plane j at [:, j, :]; the reshape to [64, 128] makes input
    column 16 j + i."""
    k, n = 384, 72
    codes = torch.randint(0, 16, (k, n), generator=torch.Generator().manual_seed(1))
    qweight = w4a16_pack(codes)
    rows = qweight.view(-1, 16)
    for t in range(k // gw.BLOCK_K):
        words = rows[t * n:(t + 1) * n]  # [n, 16]: the producer's box (BLOCK_N rows, here all of N)
        planes = [(words >> (4 * j)) & 0xF for j in range(8)]  # the asm's outputs $0...$7
        j2 = [torch.stack([planes[2 * c], planes[2 * c + 1]], -1) for c in range(4)]  # gl.join: a new last axis
        j4 = [torch.stack([j2[0], j2[1]], -1), torch.stack([j2[2], j2[3]], -1)]
        q = torch.stack(j4, -1).permute(0, 4, 3, 2, 1).reshape(n, 8, 16)
        a = q.reshape(n, 128)  # the A operand, [n, input in tile]
        assert torch.equal(a.t(), codes[128 * t:128 * (t + 1)].to(a.dtype))


@pytest.mark.parametrize("tiles_m, tiles_n", [(1, 1), (1, 32), (3, 5), (8, 7), (9, 224), (32, 32), (17, 3)])
def test_the_grouped_cta_order_covers_every_tile_once(tiles_m, tiles_n):
    """The kernel's pid -> (row tile, column tile) map (replayed here) is a bijection onto the tile grid."""
    group = gw.GROUP_M
    seen = set()
    for pid in range(tiles_m * tiles_n):
        per_group = group * tiles_n
        first_m = (pid // per_group) * group
        rows = min(tiles_m - first_m, group)
        seen.add((first_m + (pid % per_group) % rows, (pid % per_group) // rows))
    assert seen == {(i, j) for i in range(tiles_m) for j in range(tiles_n)}


@pytest.mark.parametrize("k_tiles", [1, 2, 3, 4, 5, 9, 32, 112, 224])
@pytest.mark.parametrize("splits", [1, 2, 3, 4, 7, 16, 300])
def test_split_k_chunks(k_tiles, splits):
    """Every K tile in exactly one split, no empty split, and an odd tile count only in the last split (the
    kernel's phantom tile for an odd count must lie past K)."""
    chunk = gw._chunk_for(k_tiles, splits)
    n = -(-k_tiles // chunk)
    counts = [min(chunk, k_tiles - s * chunk) for s in range(n)]
    assert sum(counts) == k_tiles and min(counts) >= 1
    assert all(c % 2 == 0 for c in counts[:-1])
    assert n <= max(splits, 1) or chunk == 2


def test_split_k_only_for_few_tiles():
    assert gw._split_chunk(tiles=112, k_tiles=32, n_sms=132) == 32  # 4096 x 14336 at M <= 64: no split
    chunk = gw._split_chunk(tiles=32, k_tiles=32, n_sms=132)  # 4096^2 at M <= 64: 4 splits of 8
    assert chunk == 8 and 32 * (32 // chunk) <= 132
    assert gw._split_chunk(tiles=32, k_tiles=112, n_sms=132) == 28  # 14336 x 4096


# ---- dispatch: w4a16_matmul runs the Gluon kernel for GLUON_MIN_M..GLUON_MAX_M rows where it is supported ----

def test_w4a16_matmul_asks_for_gluon_only_in_its_row_range(monkeypatch):
    # on the CPU _gluon_matmul declines (None) and the Triton path answers; the recorder shows which M asked
    # (as inside a CUDA graph, where the kernel's launch cost does not count)
    from hf_fastpath.kernels import w4a16

    monkeypatch.setattr(w4a16, "_gluon_pays_off", lambda x2: True)
    asked = []
    real = w4a16._gluon_matmul

    def record(x2, *args):
        asked.append(x2.shape[0])
        return real(x2, *args)

    monkeypatch.setattr(w4a16, "_gluon_matmul", record)
    qw, s, z = _weights(256, 64, 128)
    for m in (1, w4a16.GLUON_MIN_M - 1, w4a16.GLUON_MIN_M, w4a16.GLUON_MAX_M, w4a16.GLUON_MAX_M + 1):
        x = torch.randn(m, 256, dtype=torch.bfloat16)
        want = x.double() @ w4a16.w4a16_dequantize(qw, s, z, 128).double()
        torch.testing.assert_close(w4a16.w4a16_matmul(x, qw, s, z, 128).double(), want, atol=2e-2, rtol=2e-2)
    assert asked == [w4a16.GLUON_MIN_M, w4a16.GLUON_MAX_M]


@pytest.mark.parametrize("capturing, eager_too, want", [(False, False, False), (True, False, True),
                                                       (False, True, True)])
def test_gluon_runs_inside_cuda_graphs_or_when_asked(monkeypatch, capturing, eager_too, want):
    """Eager W4A16 forward passes are host-bound, where Gluon's costlier launch loses: Gluon runs while a CUDA
    graph is captured, or eagerly with GLUON_EAGER."""
    from hf_fastpath.kernels import w4a16

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    monkeypatch.setattr(w4a16, "GLUON_EAGER", eager_too)
    assert w4a16._gluon_pays_off(torch.empty(128, 4096)) == want


def _pretend_hopper(monkeypatch, kernel):
    from hf_fastpath.kernels import w4a16

    monkeypatch.setattr(w4a16, "interpreting", lambda: False)
    monkeypatch.setattr(w4a16, "GLUON_BUILD_ERRORS", [])
    monkeypatch.setattr(gw, "supported", lambda x, qweight, group_size: True)
    monkeypatch.setattr(gw, "gluon_w4a16_matmul_rows", kernel)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    return w4a16


def test_gluon_matmul_runs_the_gluon_kernel_where_supported(monkeypatch):
    calls = []

    def kernel(x2, qweight, scales, zeros, group_size, segments=None):
        calls.append((tuple(x2.shape), group_size))
        return x2.new_zeros(x2.shape[0], qweight.shape[1])

    w4a16 = _pretend_hopper(monkeypatch, kernel)
    qw, s, z = _weights(256, 64, 128)
    y = w4a16._gluon_matmul(torch.randn(100, 256, dtype=torch.bfloat16), qw, s, z, 128)
    assert y.shape == (100, 64) and calls == [((100, 256), 128)]
    monkeypatch.setattr(gw, "supported", lambda x, qweight, group_size: False)
    assert w4a16._gluon_matmul(torch.randn(100, 256, dtype=torch.bfloat16), qw, s, z, 128) is None


def test_gluon_w4a16_that_does_not_build_warns_once_and_is_not_tried_again(monkeypatch, caplog):
    import logging

    from triton.compiler.errors import CompilationError

    calls = []

    def does_not_build(*args, **kwargs):
        calls.append(1)
        raise CompilationError(None, None, "'hopper' has no attribute 'warpgroup_mma'")

    from hf_fastpath.kernels import common

    w4a16 = _pretend_hopper(monkeypatch, does_not_build)
    common.WARNED.discard("gluon-w4a16-build")  # the warning is once per process: this test must see it
    qw, s, z = _weights(256, 64, 128)
    x = torch.randn(100, 256, dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="hf_fastpath.kernels.w4a16"):
        assert w4a16._gluon_matmul(x, qw, s, z, 128) is None
        assert w4a16._gluon_matmul(x, qw, s, z, 128) is None
    assert len(calls) == 1 and "warpgroup_mma" in w4a16.GLUON_BUILD_ERRORS[0]
    warnings = [r.getMessage() for r in caplog.records if "Gluon W4A16" in r.getMessage()]
    assert len(warnings) == 1 and "warpgroup_mma" in warnings[0]


def test_fused_projections_ask_gluon_with_their_segments(monkeypatch):
    """w4a16_matmul_concat_rows over back-to-back parts: in Gluon's row range (and where it pays off) it hands the
    kernel one span over all parts plus where each part starts; outside, or with a part that is not whole
    128-column tiles, the Triton kernel's SEGMENTED mode runs."""
    from hf_fastpath.kernels import w4a16

    asked = []

    def kernel(x2, qweight, scales, zeros, group_size, segments=None):
        asked.append((qweight.shape, scales.shape, qweight.data_ptr(), segments))
        return x2.new_zeros(x2.shape[0], qweight.shape[1])

    _pretend_hopper(monkeypatch, kernel)
    monkeypatch.setattr(w4a16, "_gluon_pays_off", lambda x2: True)
    k, ns = 256, (512, 256, 256)  # (multiples of the SEGMENTED mode's 256 columns)
    q, s, z = (torch.cat([t.flatten() for t in ts]) for ts in zip(*(_weights(k, n, 128) for n in ns)))
    parts, off_q, off_s = [], 0, 0
    for n in ns:  # views of one allocation each, as fuse_siblings leaves them
        parts.append((q[off_q:off_q + k // 8 * n].view(k // 8, n), s[off_s:off_s + k // 128 * n].view(k // 128, n),
                      z[off_s:off_s + k // 128 * n].view(k // 128, n)))
        off_q, off_s = off_q + k // 8 * n, off_s + k // 128 * n
    assert w4a16.w4a16_back_to_back(parts)
    x = torch.randn(w4a16.GLUON_MIN_M, k, dtype=torch.bfloat16)
    y = w4a16.w4a16_matmul_concat_rows(x, parts, 128)
    assert y.shape == (w4a16.GLUON_MIN_M, 1024)
    assert asked == [((k // 8, 1024), (k // 128, 1024), parts[0][0].data_ptr(), (512, 768))]
    w4a16.w4a16_matmul_concat_rows(x[:w4a16.GLUON_MIN_M - 1], parts, 128)  # below the range: Triton's kernel
    assert len(asked) == 1
