"""GPTQ / AWQ packing and `W4A16Linear`, checked against references written here (bit-by-bit loops)."""

from __future__ import annotations

import pytest
import torch

from hf_fastpath.kernels.w4a16_layout import w4a16_pack, w4a16_unpack
from hf_fastpath.quantization import W4A16Linear, w4a16_backend
from hf_fastpath.quantization import formats as F
from tests.checkpoints import AWQ_ORDER, ref_pack_awq, ref_pack_stream

# ---------------------------------------------------------------------------------------------------------------------
# independent readers: one value at a time, straight from the bit definitions


def ref_read_stream(words: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """Value i of each column = bits [bits*i, bits*i + bits) of the little-endian stream of 32-bit words."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros(length, words.shape[1], dtype=torch.int64)
    for i in range(length):
        for b in range(bits):
            position = bits * i + b
            out[i] |= ((w[position // 32] >> (position % 32)) & 1) << b
    return out


def ref_read_awq(words: torch.Tensor) -> torch.Tensor:
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros(words.shape[0], words.shape[1] * 8, dtype=torch.int64)
    for c in range(words.shape[1]):
        for j, column in enumerate(AWQ_ORDER):
            out[:, 8 * c + column] = (w[:, c] >> (4 * j)) & 0xF
    return out


def ref_dequantize_gptq(t: dict, bits: int, in_features: int, v1: bool) -> torch.Tensor:
    """W [K, N] from GPTQ tensors by explicit loops over rows."""
    codes = ref_read_stream(t["qweight"], bits, in_features)
    zeros = ref_read_stream(t["qzeros"].t(), bits, t["scales"].shape[1]).t() + (1 if v1 else 0)
    w = torch.empty(in_features, t["scales"].shape[1])
    for k in range(in_features):
        g = int(t["g_idx"][k])
        w[k] = t["scales"][g].float() * (codes[k] - zeros[g]).float()
    return w


def random_weight(k, n, bits, group_size, *, act_order=False, min_zero=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gs = k if group_size == -1 else group_size
    groups = -(-k // gs)
    g_idx = (torch.arange(k) // gs).to(torch.int32)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    codes = torch.randint(0, 2**bits, (k, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=gen) * 0.1 + 1e-3).half().float()
    zeros = torch.randint(min_zero, 2**bits, (groups, n), generator=gen, dtype=torch.int32)
    return F.IntWeight(codes, scales, zeros, g_idx)


def expected_w(weight: F.IntWeight) -> torch.Tensor:
    g = weight.g_idx.long()
    return weight.scales[g] * (weight.codes - weight.zeros[g]).float()


# ---------------------------------------------------------------------------------------------------------------------
# formats


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("group_size,act_order", [(32, False), (64, True), (128, False), (-1, False), (32, True)])
def test_gptq_pack_matches_reference(bits, checkpoint_format, group_size, act_order):
    k, n = 128, 64
    v1 = checkpoint_format == "gptq"
    weight = random_weight(k, n, bits, group_size, act_order=act_order, min_zero=1 if v1 else 0,
                           seed=bits * 7 + group_size)
    tensors = F.gptq_pack(weight, bits, checkpoint_format)
    # bit-exact against the reference packer (stored zero is zero - 1 in v1)
    assert torch.equal(tensors["qweight"], ref_pack_stream(weight.codes, bits))
    stored = weight.zeros - 1 if v1 else weight.zeros
    assert torch.equal(tensors["qzeros"], ref_pack_stream(stored.t(), bits).t())
    assert tensors["qweight"].dtype == tensors["qzeros"].dtype == tensors["g_idx"].dtype == torch.int32
    assert tensors["scales"].dtype == torch.float16
    # the loop-based reader sees the weight we packed
    torch.testing.assert_close(ref_dequantize_gptq(tensors, bits, k, v1), expected_w(weight), rtol=0, atol=0)
    # unpack is the exact inverse
    back = F.gptq_unpack(tensors["qweight"], tensors["qzeros"], tensors["scales"].float(), tensors["g_idx"], bits,
                         group_size, checkpoint_format)
    for a, b in zip(back, weight):
        assert torch.equal(a, b)


def test_gptq_v1_zero_points():
    # sym 4-bit v1 stores zero 8 as 7 in every nibble
    weight = random_weight(64, 32, 4, 32)
    weight = weight._replace(zeros=torch.full_like(weight.zeros, 8))
    assert (F.gptq_pack(weight, 4, "gptq")["qzeros"] == 0x77777777).all()
    # a v1 file may say 15 (zero 16): read back as every v1 kernel does, and written back unchanged
    qzeros = torch.full((2, 4), -1, dtype=torch.int32)  # all nibbles 0xF
    back = F.gptq_unpack(F.pack_rows(weight.codes, 4), qzeros, weight.scales, None, 4, 32, "gptq")
    assert (back.zeros == 16).all()
    assert torch.equal(F.gptq_pack(back, 4, "gptq")["qzeros"], qzeros)
    with pytest.raises(ValueError, match="gptq_v2"):
        F.gptq_pack(weight._replace(zeros=torch.zeros_like(weight.zeros)), 4, "gptq")


@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_awq_pack_matches_reference(group_size):
    k, n = 128, 64
    weight = random_weight(k, n, 4, group_size, seed=group_size + 5)
    tensors = F.awq_pack(weight)
    assert torch.equal(tensors["qweight"], ref_pack_awq(weight.codes))
    assert torch.equal(tensors["qzeros"], ref_pack_awq(weight.zeros))
    assert tensors["qweight"].shape == (k, n // 8)
    codes = ref_read_awq(tensors["qweight"])
    zeros = ref_read_awq(tensors["qzeros"])
    gs = k if group_size == -1 else group_size
    w = torch.stack([tensors["scales"][i // gs].float() * (codes[i] - zeros[i // gs]).float() for i in range(k)])
    torch.testing.assert_close(w, expected_w(weight), rtol=0, atol=0)
    back = F.awq_unpack(tensors["qweight"], tensors["qzeros"], tensors["scales"].float(), group_size)
    for a, b in zip(back, weight):
        assert torch.equal(a, b)


def test_awq_nibble_order():
    codes = torch.arange(8, dtype=torch.int32).repeat(2, 1)  # column c holds value c
    word = F.awq_pack(F.IntWeight(codes, torch.ones(1, 8), torch.zeros(1, 8, dtype=torch.int32),
                                  torch.zeros(2, dtype=torch.int32)))["qweight"][0, 0].item()
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.mark.parametrize("bits,act_order", [(4, False), (4, True), (3, True), (2, False), (8, True)])
def test_kernel_layout(bits, act_order):
    k, n, gs = 128, 64, 32
    weight = random_weight(k, n, bits, gs, act_order=act_order, seed=bits)
    kernel = F.to_kernel_layout(weight, bits, gs, torch.float32)
    assert (kernel.perm is not None) == act_order
    # 4-bit codes sit in the kernels' layout (tested against an independent packer with the kernels)
    codes = w4a16_unpack(kernel.qweight) if bits == 4 else ref_read_stream(kernel.qweight, bits, k)
    # rows sorted by group: row k' is in group k' // gs and is original row perm[k']
    w_sorted = torch.stack([kernel.scales[i // gs] * (codes[i] - kernel.zeros[i // gs]).float() for i in range(k)])
    perm = kernel.perm if act_order else torch.arange(k)
    torch.testing.assert_close(w_sorted, expected_w(weight)[perm], rtol=0, atol=0)
    back = F.from_kernel_layout(kernel.qweight, kernel.scales, kernel.zeros, kernel.perm, bits, gs, k)
    for a, b in zip(back, weight):
        assert torch.equal(a, b)
    if bits == 4 and not act_order:  # the contract: the kernels' packing of the codes
        assert torch.equal(kernel.qweight, w4a16_pack(weight.codes))
    # the direct GPTQ <-> kernel conversions agree with going through the integer codes
    gptq = F.gptq_pack(weight, bits, "gptq_v2")
    direct = F.gptq_to_kernel_layout(gptq["qweight"], gptq["qzeros"], gptq["scales"].float(), gptq["g_idx"], bits,
                                     gs, "gptq_v2", torch.float32, k)
    for a, b in zip(direct, kernel):
        assert (a is None and b is None) or torch.equal(a, b)
    back = F.kernel_to_gptq(*kernel, bits, gs, k, "gptq_v2")
    for name in gptq:
        assert torch.equal(back[name], gptq[name]), name


def test_format_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        F.gptq_shapes(48, 64, 3, 16)
    with pytest.raises(ValueError, match="multiple of 8"):
        F.gptq_shapes(64, 12, 4, 32)
    with pytest.raises(ValueError, match="bits=3"):
        F.awq_shapes(64, 64, 32, bits=3)
    bad = torch.tensor([0, 0, 0, 1] * 8, dtype=torch.int32)  # groups of 24 and 8 rows with group_size 16
    with pytest.raises(ValueError, match="group_size=16"):
        F.act_order_perm(bad, 16)
    with pytest.raises(ValueError, match="act-order"):
        F.awq_pack(random_weight(64, 32, 4, 32, act_order=True))


# ---------------------------------------------------------------------------------------------------------------------
# W4A16Linear, reference path


@pytest.mark.parametrize("bits,group_size,act_order,dtype", [
    (4, 32, False, torch.float32), (4, 64, True, torch.float32), (3, 32, True, torch.float32),
    (2, -1, False, torch.float32), (8, 32, False, torch.float32), (4, 32, True, torch.bfloat16),
    (4, 128, False, torch.float16),
])
def test_linear_forward_and_input_grad(bits, group_size, act_order, dtype):
    k, n = 128, 96
    weight = random_weight(k, n, bits, group_size, act_order=act_order, seed=3)
    bias = torch.randn(n)
    layer = W4A16Linear.from_quantized(*weight, bias=bias, bits=bits, group_size=group_size, dtype=dtype)
    w = expected_w(weight._replace(scales=weight.scales.to(dtype).float()))  # [K, N], scales as the layer holds them
    torch.testing.assert_close(layer.dequantize(), w.t(), rtol=0, atol=0)
    x = torch.randn(2, 3, k, dtype=dtype, requires_grad=True)
    with w4a16_backend("reference"):
        y = layer(x)
    assert y.shape == (2, 3, n) and y.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    ref = x.detach().double() @ w.double() + bias.double()
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    dy = torch.randn_like(y)
    y.backward(dy)
    dx_ref = dy.double() @ w.double().t()
    torch.testing.assert_close(x.grad.double(), dx_ref, rtol=tol, atol=tol * dx_ref.abs().max().item())
    assert layer.qweight.grad is None and not layer.bias.requires_grad


def test_linear_state_dict_round_trip():
    weight = random_weight(128, 64, 4, 32, act_order=True, seed=1)
    layer = W4A16Linear.from_quantized(*weight, bias=torch.randn(64), bits=4, group_size=32,
                                       checkpoint_format="gptq_v2")
    state = layer.state_dict()
    assert set(state) == {"qweight", "qzeros", "scales", "g_idx", "bias"}
    assert state["qweight"].shape == (16, 64) and state["g_idx"].dtype == torch.int32
    fresh = W4A16Linear(128, 64, 4, 32, True, checkpoint_format="gptq_v2", dtype=torch.float32)
    fresh.load_state_dict(state)
    x = torch.randn(5, 128)
    assert torch.equal(fresh(x), layer(x))
    awq = W4A16Linear.from_quantized(*random_weight(64, 32, 4, 32), bits=4, group_size=32, checkpoint_format="awq")
    assert set(awq.state_dict()) == {"qweight", "qzeros", "scales"}
    assert awq.state_dict()["qweight"].shape == (64, 4)


def test_linear_weight_placeholder_and_dtype_follow():
    layer = W4A16Linear.from_quantized(*random_weight(64, 32, 4, 32), bits=4, group_size=32, dtype=torch.float32)
    assert layer.weight.shape == (0, 32) and layer.weight.dtype == torch.float32
    layer.to(torch.bfloat16)
    assert layer.scales.dtype == torch.bfloat16 and layer.qweight.dtype == torch.int32
    assert layer.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="last dimension 64"):
        layer(torch.randn(2, 63, dtype=torch.bfloat16))


def test_linear_follows_autocast():
    layer = W4A16Linear.from_quantized(*random_weight(64, 32, 4, 32), bits=4, group_size=32, dtype=torch.float32)
    x = torch.randn(3, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), layer(x), rtol=3e-2, atol=3e-2 * layer(x).abs().max().item())


def test_for_checkpoint_checks_shapes():
    layer = W4A16Linear.for_checkpoint(64, 32, bits=4, group_size=32, bias=False, checkpoint_format="gptq",
                                       dtype=torch.float32)
    assert {n: tuple(b.shape) for n, b in layer.named_buffers()} == {
        "qweight": (8, 32), "qzeros": (2, 4), "scales": (2, 32), "g_idx": (64,)}
    layer.qweight = torch.zeros(8, 16, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"'qweight'.*\(8, 16\), expected \(8, 32\)"):
        layer.finish_loading(loaded={"qweight", "qzeros", "scales", "g_idx"})


# ---------------------------------------------------------------------------------------------------------------------
# W4A16Linear through the Triton kernels (interpreted on the CPU)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,act_order", [(1, True), (17, False)])
def test_linear_kernels_match_reference(dtype, m, act_order):
    k, n, gs = 64, 32, 32
    weight = random_weight(k, n, 4, gs, act_order=act_order, seed=m)
    layer = W4A16Linear.from_quantized(*weight, bias=torch.randn(n), bits=4, group_size=gs, dtype=dtype)
    x = torch.randn(m, k, dtype=dtype, requires_grad=True)
    with w4a16_backend("kernel"):
        y = layer(x)
        dy = torch.randn_like(y)
        y.backward(dy)
    w = layer.dequantize().t().double()  # the weight in the layer's own dtype of scales
    ref = x.detach().double() @ w + layer.bias.double()
    dx_ref = dy.double() @ w.t()
    tol = 1e-2 if dtype == torch.float16 else 4e-2
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    torch.testing.assert_close(x.grad.double(), dx_ref, rtol=tol, atol=tol * dx_ref.abs().max().item())


def test_linear_compiles_without_graph_breaks():
    """torch.compile sees the kernels as opaque ops (fullgraph: no graph break in the launch code), with the same
    forward and input gradient as eager, act-order included."""
    torch._dynamo.reset()
    weight = random_weight(256, 40, 4, 64, act_order=True, seed=5)
    layer = W4A16Linear.from_quantized(*weight, bias=torch.randn(40), bits=4, group_size=64, dtype=torch.float16)
    x = torch.randn(3, 256, dtype=torch.float16, requires_grad=True)
    with w4a16_backend("kernel"):
        y_eager = layer(x)
        (dx_eager,) = torch.autograd.grad(y_eager.float().square().sum(), x)
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        y = compiled(x)
        (dx,) = torch.autograd.grad(y.float().square().sum(), x)
    torch.testing.assert_close(y, y_eager, rtol=0, atol=0)
    torch.testing.assert_close(dx, dx_eager, rtol=0, atol=0)


def test_linear_inference_path_and_backend_switches(monkeypatch):
    """Inference calls go straight to `w4a16_matmul_rows` (no op dispatch, no re-check of the weights); the route
    is cached per dtype, device and backend, so switching the backend still takes effect on the same layer."""
    from hf_fastpath.kernels import w4a16 as kernels

    weight = random_weight(128, 24, 4, 64, act_order=True, seed=2)
    layer = W4A16Linear.from_quantized(*weight, bias=torch.randn(24), bits=4, group_size=64, dtype=torch.bfloat16)
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    calls = []
    rows = kernels.w4a16_matmul_rows
    monkeypatch.setattr(kernels, "w4a16_matmul_rows", lambda *a, **k: calls.append(a[0].shape) or rows(*a, **k))
    with torch.no_grad():
        with w4a16_backend("kernel"):
            y_kernel = layer(x)
            layer(x)
        assert calls == [(6, 128)] * 2
        with w4a16_backend("reference"):
            y_reference = layer(x)
        assert len(calls) == 2  # the reference path dequantizes instead
        with w4a16_backend("kernel"):
            layer(x[0])
        assert calls[-1] == (3, 128)
    assert y_kernel.shape == (2, 3, 24)
    torch.testing.assert_close(y_kernel.float(), y_reference.float(), rtol=4e-2,
                               atol=4e-2 * y_reference.abs().max().item())
