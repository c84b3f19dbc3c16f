"""W4A16 Triton kernels (run by the Triton interpreter on the CPU) against a float64 reference built here from the
random 4-bit codes themselves, independent of hf_fastpath.quantization."""

import pytest
import torch

from hf_fastpath.kernels.w4a16 import (
    _decode_grad_input,
    _decode_matmul,
    _split_workspace,
    w4a16_dequantize,
    w4a16_matmul,
    w4a16_matmul_grad_input,
)
from hf_fastpath.kernels.w4a16_layout import k_tile_order, w4a16_pack, w4a16_unpack

# Max error relative to the largest reference entry. The output is rounded to 16 bits once (fp16 2**-11,
# bf16 2**-8) and the dequantized weight once; the interpreter rounds bf16 more coarsely than a GPU does.
TOL = {torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """int codes [K, N] in 0..15 -> int32 words [K // 8, N], row k in word k // 8 at bits 4 * (k % 8)."""
    k, n = q.shape
    words = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        words |= q[j::8].to(torch.int64) << (4 * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def tiled_rows(k):
    """The kernels' K-tiled order, written out independently: nibble j of word row 16 t + i holds input
    128 t + R j + i (R = 16, or the word rows of a ragged last tile)."""
    rows = []
    for t in range((k + 127) // 128):
        r_t = min(16, k // 8 - 16 * t)
        for i in range(r_t):
            rows.extend(128 * t + r_t * j + i for j in range(8))
    return torch.tensor(rows)


def tile_major(words):
    """GPTQ-order words [K // 8, N] -> the kernels' storage: each K tile's [R, N] word rows as an [N, R] block."""
    out = []
    for t in range(0, words.shape[0], 16):
        out.append(words[t:t + 16].t().reshape(-1))
    return torch.cat(out).reshape(words.shape)


def make_layer(k, n, group, dtype, zeros, gen):
    gs = k if group == -1 else group
    g = k // gs
    q = torch.randint(0, 16, (k, n), generator=gen)
    scales = (torch.rand(g, n, generator=gen) * 0.05 + 0.005).to(dtype)
    if zeros == "sym":
        z = torch.full((g, n), 8.0).to(dtype)
    else:
        z = torch.randint(0, 16, (g, n), generator=gen).to(dtype)
    w64 = scales.double().repeat_interleave(gs, 0) * (q.double() - z.double().repeat_interleave(gs, 0))
    return tile_major(pack_codes(q[tiled_rows(k)])), scales, z, w64


def assert_close(out, ref, dtype):
    assert out.dtype == dtype
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= TOL[dtype] * scale, f"max error {err:.3g} vs scale {scale:.3g}"


F16, BF16 = torch.float16, torch.bfloat16
CASES = [
    # M, K, N, group, dtype, zeros: the fused kernel (M <= DECODE_MAX_M) in all its modes, then dequantize + matmul
    (1, 64, 24, 32, F16, "sym"),  # groups smaller than a ragged K tile (8 word rows): a scale vector per plane
    (1, 256, 37, 128, BF16, "random"),  # odd N, one group per K tile: scale applied after the dot
    (3, 192, 40, 64, BF16, "random"),
    (8, 256, 40, 128, F16, "random"),  # a full 8-row tile (M <= 8 with whole-tile groups: 1- and 8-row tiles)
    (3, 256, 72, -1, F16, "sym"),  # one group over all of K
    (2, 264, 24, -1, BF16, "random"),  # K not a multiple of the 128-row K tile: zeroed tail
    (5, 384, 40, 192, BF16, "random"),  # group of 192: not a multiple of the K tile
    (17, 256, 72, 128, F16, "random"),  # second M tile, scale after the dot on a 32-row tile
    (17, 192, 24, 32, BF16, "sym"),
    (64, 256, 40, 64, F16, "random"),  # one full 64-row tile; groups of 64: a scale vector per nibble plane
    (67, 192, 24, 32, F16, "random"),  # several M tiles of the fused kernel
    (67, 256, 37, 128, BF16, "sym"),
    (2, 224, 40, 32, F16, "random"),  # ragged tile of 12 word rows: its planes straddle groups of 32
    (200, 128, 24, 32, BF16, "random"),  # above the fused range: dequantize + matmul
]


@pytest.mark.parametrize("m,k,n,group,dtype,zeros", CASES)
def test_forward_and_grad_input(m, k, n, group, dtype, zeros):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    qweight, scales, z, w64 = make_layer(k, n, group, dtype, zeros, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    assert_close(w4a16_matmul(x, qweight, scales, z, group), x.double() @ w64, dtype)
    dy = torch.randn(m, n, generator=gen).to(dtype)
    assert_close(w4a16_matmul_grad_input(dy, qweight, scales, z, group), dy.double() @ w64.t(), dtype)


def test_packing_matches_the_documented_layout():
    gen = torch.Generator().manual_seed(11)
    for k in (8, 64, 128, 264, 576, 1024):
        order = k_tile_order(k)
        assert torch.equal(order, tiled_rows(k))
        assert torch.equal(order.sort().values, torch.arange(k))  # a permutation
        codes = torch.randint(0, 16, (k, 5), generator=gen, dtype=torch.int32)
        packed = w4a16_pack(codes)
        assert torch.equal(packed, tile_major(pack_codes(codes[tiled_rows(k)])))
        assert torch.equal(w4a16_unpack(packed), codes)
    with pytest.raises(ValueError, match="multiple of 8"):
        k_tile_order(100)


def test_packing_in_chunks_of_k_tiles(monkeypatch):
    import hf_fastpath.kernels.w4a16_layout as kernels

    monkeypatch.setattr(kernels, "_PACK_CHUNK_CODES", 128 * 6)  # one K tile per chunk at N = 6
    codes = torch.randint(0, 16, (456, 6), generator=torch.Generator().manual_seed(4), dtype=torch.int32)
    packed = w4a16_pack(codes)
    assert len(kernels._tile_chunks(456, 6)) == 4
    assert torch.equal(packed, tile_major(pack_codes(codes[tiled_rows(456)])))
    assert torch.equal(w4a16_unpack(packed), codes)


@pytest.mark.parametrize("mode", ["factored", "centered", "dequant"])
@pytest.mark.parametrize("m,k,group,dtype,zeros", [
    (5, 384, 128, BF16, "random"),
    (16, 264, -1, F16, "random"),  # one group over a ragged K
    (3, 256, 256, F16, "sym"),
])
def test_every_scale_mode_of_the_forward(mode, m, k, group, dtype, zeros):
    """Each way of applying scales and zeros to whole-tile groups (the GPU picks one by M), on one config."""
    gen = torch.Generator().manual_seed(m + k)
    n = 40
    qweight, scales, z, w64 = make_layer(k, n, group, dtype, zeros, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1, mode=mode)
    _decode_matmul(x, qweight, scales, z, k if group == -1 else group, out, cfg=cfg, split_k=2)
    assert_close(out, x.double() @ w64, dtype)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_split_k_and_split_n_accumulate(dtype):
    # Several programs add partial sums into one fp32 buffer (what the GPU uses to fill all SMs), over 2 x 2 and
    # 1 x 2 output tiles.
    gen = torch.Generator().manual_seed(7)
    qweight, scales, z, w64 = make_layer(512, 72, 128, dtype, "random", gen)
    for m in (20, 3, 3):  # 2 x 2 tiles, then 1 x 2 tiles (interpreter tiles: BLOCK_M = 16, BLOCK_N = 64)
        x = torch.randn(m, 512, generator=gen).to(dtype)
        out = torch.empty(m, 72, dtype=dtype)
        _decode_matmul(x, qweight, scales, z, 128, out, split_k=4)
        assert_close(out, x.double() @ w64, dtype)
        # The last split of each tile leaves the shared workspace and tickets zeroed for the next call.
        ws, count = _split_workspace(x.device, 1, 1)
        assert not ws.any() and not count.any()
    # A per-call workspace (torch.compile's CUDA-graph pools) gives the same sums and leaves the cache alone.
    import hf_fastpath.kernels.w4a16 as kernels

    cached = dict(kernels._WORKSPACES)
    fresh = torch.empty(m, 72, dtype=dtype)
    _decode_matmul(x, qweight, scales, z, 128, fresh, split_k=4, cache_workspace=False)
    assert torch.equal(fresh, out) and kernels._WORKSPACES.keys() == cached.keys()
    # An output with a row stride wider than N (a view into a bigger buffer) is written only where it belongs.
    big = torch.full((3, 100), 7.0, dtype=dtype)
    _decode_matmul(x, qweight, scales, z, 128, big[:, :72], split_k=2)
    assert_close(big[:, :72], x.double() @ w64, dtype)
    assert (big[:, 72:] == 7).all()
    dy = torch.randn(3, 72, generator=gen).to(dtype)
    dx = torch.empty(3, 512, dtype=dtype)
    _decode_grad_input(dy, qweight, scales, z, 128, dx, cfg=dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1),
                       split_n=3)
    assert_close(dx, dy.double() @ w64.t(), dtype)


def test_dequantize_matches_codes():
    gen = torch.Generator().manual_seed(3)
    qweight, scales, z, w64 = make_layer(128, 72, 32, F16, "random", gen)
    w = w4a16_dequantize(qweight, scales, z, 32)
    assert w.shape == (128, 72) and w.dtype == F16
    assert (w.double() - w64).abs().max().item() <= 2**-10 * w64.abs().max().item() * 2


def test_leading_dims_strided_input_and_empty_batch():
    gen = torch.Generator().manual_seed(5)
    qweight, scales, z, w64 = make_layer(64, 24, 64, BF16, "sym", gen)
    x = torch.randn(2, 3, 64, generator=gen).to(BF16)
    y = w4a16_matmul(x, qweight, scales, z, -1)
    assert y.shape == (2, 3, 24)
    assert_close(y.reshape(6, 24), x.reshape(6, 64).double() @ w64, BF16)
    xt = torch.randn(64, 2, generator=gen).to(BF16).t()  # non-contiguous rows
    assert_close(w4a16_matmul(xt, qweight, scales, z, 64), xt.double() @ w64, BF16)
    assert w4a16_matmul(torch.empty(0, 64, dtype=BF16), qweight, scales, z, 64).shape == (0, 24)
    assert w4a16_matmul_grad_input(torch.empty(0, 24, dtype=BF16), qweight, scales, z, 64).shape == (0, 64)


def test_bad_inputs_raise_clear_errors():
    gen = torch.Generator().manual_seed(0)
    qweight, scales, z, _ = make_layer(64, 24, 32, F16, "sym", gen)
    x = torch.randn(2, 64).to(F16)
    with pytest.raises(ValueError, match="features"):
        w4a16_matmul(torch.randn(2, 60).to(F16), qweight, scales, z, 32)  # K % 8 != 0
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        w4a16_matmul(x.float(), qweight, scales, z, 32)
    with pytest.raises(ValueError, match="int32"):
        w4a16_matmul(x, qweight.to(torch.int64), scales, z, 32)
    with pytest.raises(ValueError, match="dtype"):
        w4a16_matmul(x, qweight, scales.to(BF16), z, 32)
    with pytest.raises(ValueError, match="shape"):
        w4a16_matmul(x, qweight, scales[:1], z[:1], 32)
    with pytest.raises(ValueError, match="multiple of group_size"):
        w4a16_matmul(x, qweight, scales, z, 48)
    with pytest.raises(ValueError, match="multiple of 8"):
        w4a16_matmul(x, qweight, torch.ones(16, 24, dtype=F16), torch.ones(16, 24, dtype=F16), 4)
    with pytest.raises(ValueError, match="features"):
        w4a16_matmul_grad_input(torch.randn(2, 23).to(F16), qweight, scales, z, 32)


EXPERT_CASES = [
    # rows per expert (0: no token routed to it), K, N, group, dtype; rows per expert sets the row tile (1, 8, 16,
    # 64 under the interpreter's configs), uneven counts leave partial tiles, empty experts empty table entries
    ((1, 0, 1), 256, 40, 128, F16),  # decoding: top-2 of 3 experts
    ((3, 5, 0, 1), 192, 24, 64, BF16),  # ragged K tile, per-plane groups
    ((17, 2, 9), 256, 72, 32, F16),  # 16-row tiles, odd N
    ((40, 0, 70), 128, 64, -1, BF16),  # 64-row tiles (centered mode), one group
]


@pytest.mark.parametrize("counts,k,n,group,dtype", EXPERT_CASES)
@pytest.mark.parametrize("split", [None, 2])
def test_experts_matmul_matches_reference(counts, k, n, group, dtype, split):
    """Rows sorted by expert times their expert's weight, in one launch, against per-expert float64 products."""
    from hf_fastpath.kernels.w4a16 import expert_tile_count, w4a16_expert_block_m, w4a16_expert_tiles

    gen = torch.Generator().manual_seed(sum(counts) + k + n)
    layers = [make_layer(k, n, group, dtype, "random", gen) for _ in counts]
    qweight, scales, zeros = (torch.stack([layer[i] for layer in layers]) for i in range(3))
    rows = sum(counts)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    gs = k if group == -1 else group
    per_expert = -(-rows // max(1, sum(c > 0 for c in counts)))
    block_m = w4a16_expert_block_m(per_expert, k, n, gs)
    tiles = w4a16_expert_tiles(offsets, rows, block_m)
    assert tiles.shape == (expert_tile_count(rows, len(counts), per_expert, block_m), 3)
    covered = sorted(r for e, lo, hi in tiles.tolist() for r in range(lo, hi))
    assert covered == list(range(rows))  # every row in exactly one tile, of its own expert
    assert all(offsets[e] <= lo and hi <= offsets[e + 1] and hi - lo <= block_m for e, lo, hi in tiles.tolist()
               if hi > lo)
    out = torch.empty(rows, n, dtype=dtype)
    _decode_matmul(x, qweight, scales, zeros, gs, out, experts=(tiles, per_expert), split_k=split)
    ref = torch.cat([x[offsets[e]:offsets[e + 1]].double() @ layers[e][3] for e in range(len(counts))])
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("counts", [(1, 0, 1), (5, 12, 3)])
def test_experts_matmul_two_weights_per_expert_in_one_launch(counts):
    """Gate and up of each expert stored back to back (expert-major): one launch gives both, side by side."""
    from hf_fastpath.kernels.w4a16 import w4a16_expert_block_m, w4a16_expert_tiles, w4a16_experts_matmul_rows

    gen = torch.Generator().manual_seed(7)
    k, n, gs, dtype = 256, 64, 64, F16  # n: the interpreter's column block, as the segments need
    layers = [[make_layer(k, n, gs, dtype, "random", gen) for _ in range(2)] for _ in counts]
    flat = [torch.cat([layers[e][j][i].reshape(-1) for e in range(len(counts)) for j in range(2)]) for i in range(3)]
    stacks = [f.view(len(counts), 2, -1)[:, 0].unflatten(1, layers[0][0][i].shape) for i, f in enumerate(flat)]
    assert stacks[0].stride(0) == 2 * layers[0][0][0].numel()
    rows = sum(counts)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    per_expert = -(-rows // sum(c > 0 for c in counts))
    tiles = w4a16_expert_tiles(offsets, rows, w4a16_expert_block_m(per_expert, k, 2 * n, gs))
    out = w4a16_experts_matmul_rows(x, *stacks, gs, tiles, per_expert, [n, n])
    ref = torch.cat([x[offsets[e]:offsets[e + 1]].double() @ torch.cat([layers[e][0][3], layers[e][1][3]], 1)
                     for e in range(len(counts))])
    assert_close(out, ref, dtype)
