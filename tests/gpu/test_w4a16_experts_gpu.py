"""GPU checks of the W4A16 experts launch (the decode kernel's EXPERTS mode, compiled; `UnfusedExperts`' grouped
path), run on the device: `TRITON_INTERPRET=0 pytest tests/gpu/test_w4a16_experts_gpu.py`. Skipped without CUDA.

- the kernel against a float64 reference built from the integer codes, at real layer shapes (Qwen3-30B-A3B's and
  Mixtral's experts, narrowed), routed row counts from decoding to prefill, experts with no rows, split-K, gate and
  up in one launch;
- a Qwen3-MoE-shaped experts module: the grouped path against one W4A16 call per expert, eagerly and replayed from
  a CUDA graph captured under one routing and replayed under another (the tile table is built on the GPU: no host
  sync, so a graph serves any routing)."""

from __future__ import annotations

import os

import pytest
import torch

from hf_fastpath.kernels.w4a16 import (_decode_matmul, w4a16_expert_block_m, w4a16_expert_tiles,
                                       w4a16_experts_matmul_rows)
from hf_fastpath.kernels.w4a16_layout import w4a16_pack

from tests.gpu.common import REPORT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA GPU and TRITON_INTERPRET unset")

TOL = {torch.float16: 4e-3, torch.bfloat16: 2.5e-2}  # as tests/test_w4a16_kernels.py (max error <= tol * max |y|)


def _experts(e, k, n, gs, dtype, seed=0):
    """E packed layers (qweight [E, K / 8, N], scales / zeros [E, G, N]) and their float64 weights [E, K, N]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    codes = torch.randint(0, 16, (e, k, n), device="cuda", generator=g)
    scales = (torch.rand(e, k // gs, n, device="cuda", generator=g) * 0.05 + 0.005).to(dtype)
    zeros = torch.randint(0, 16, (e, k // gs, n), device="cuda", generator=g).to(dtype)
    qweight = torch.stack([w4a16_pack(codes[i].to(torch.int32)) for i in range(e)])
    weight = scales.double().repeat_interleave(gs, 1) * (codes.double() - zeros.double().repeat_interleave(gs, 1))
    return qweight, scales, zeros, weight


def _routed_rows(counts, k, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(sum(counts), k, device="cuda", generator=g).to(dtype)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], device="cuda")
    return x, offsets


def _check(out, ref, dtype, case):
    err = float((out.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-6))
    REPORT.append(dict(case=case, err=err))
    assert torch.isfinite(out).all(), case
    assert err <= TOL[dtype], (case, err)


COUNTS = {  # rows per expert: decode (top-k distinct experts), a short and a long prefill, idle experts included
    "decode": lambda e: [1 if i in (1, 5) else 0 for i in range(e)],
    "batch8": lambda e: [(i * 7) % 5 if i % 3 else 0 for i in range(e)],
    "prefill": lambda e: [(i * 37) % 97 + (0 if i % 4 else 40) for i in range(e)],
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(16, 2048, 768, 128), (16, 768, 2048, 128), (8, 4096, 1024, 32)])
@pytest.mark.parametrize("routing", list(COUNTS))
@pytest.mark.parametrize("split", [None, 1, 4])
def test_experts_launch_matches_float64(shape, routing, dtype, split):
    e, k, n, gs = shape
    qweight, scales, zeros, weight = _experts(e, k, n, gs, dtype)
    counts = COUNTS[routing](e)
    x, offsets = _routed_rows(counts, k, dtype)
    rows = x.shape[0]
    per_expert = -(-rows // max(1, sum(c > 0 for c in counts)))
    tiles = w4a16_expert_tiles(offsets, rows, w4a16_expert_block_m(per_expert, k, n, gs))
    out = torch.full((rows, n), float("nan"), device="cuda", dtype=dtype)
    _decode_matmul(x, qweight, scales, zeros, gs, out, experts=(tiles, per_expert), split_k=split)
    ref = torch.cat([x[offsets[i]:offsets[i + 1]].double() @ weight[i] for i in range(e)])
    _check(out, ref, dtype, f"{shape} {routing} {dtype} split={split}")


@pytest.mark.parametrize("routing", list(COUNTS))
def test_gate_and_up_of_every_expert_in_one_launch(routing):
    """Expert-major storage (gate_e, up_e back to back), as `stack_experts` lays them out; widths [N, N]."""
    e, k, n, gs, dtype = 16, 2048, 768, 128, torch.bfloat16
    gate, up = _experts(e, k, n, gs, dtype, seed=1), _experts(e, k, n, gs, dtype, seed=2)
    stacks = []
    for i in range(3):  # one allocation per tensor kind: [E, 2, ...], the gate's view first
        both = torch.stack([gate[i], up[i]], 1).contiguous()
        stacks.append(both[:, 0])
    counts = COUNTS[routing](e)
    x, offsets = _routed_rows(counts, k, dtype, seed=3)
    rows = x.shape[0]
    per_expert = -(-rows // max(1, sum(c > 0 for c in counts)))
    tiles = w4a16_expert_tiles(offsets, rows, w4a16_expert_block_m(per_expert, k, 2 * n, gs))
    out = w4a16_experts_matmul_rows(x, *stacks, gs, tiles, per_expert, [n, n])
    ref = torch.cat([x[offsets[i]:offsets[i + 1]].double() @ torch.cat([gate[3][i], up[3][i]], 1)
                     for i in range(e)])
    _check(out, ref, dtype, f"gate+up {routing}")


def _qwen3_moe_experts(dtype=torch.bfloat16):
    """A Qwen3-MoE experts module (hidden 1024, 16 experts of 512, top-4) over RTN W4A16 layers, on the GPU."""
    import transformers

    from hf_fastpath.integrations.moe_experts import UnfusedExperts, expert_linear_names
    from hf_fastpath.quantization.linear import W4A16Linear
    from hf_fastpath.quantization.rtn import rtn_quantize

    config = transformers.AutoConfig.for_model(
        "qwen3_moe", num_hidden_layers=1, vocab_size=256, hidden_size=1024, moe_intermediate_size=512,
        num_experts=16, num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=2)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    fused = model.model.layers[0].mlp.experts
    with torch.no_grad():
        for p in fused.parameters():
            p.normal_(0, 0.02)
    experts = UnfusedExperts(fused, expert_linear_names("qwen3_moe"))
    for expert in experts:
        for name, linear in list(expert.named_children()):
            q = rtn_quantize(linear.weight.detach(), 4, 128, False)
            setattr(expert, name, W4A16Linear.from_quantized(q.codes, q.scales, q.zeros, q.g_idx, bits=4,
                                                             group_size=128, dtype=dtype))
    return experts, config


def _routing(tokens, experts, top_k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    index = torch.rand(tokens, experts, device="cuda", generator=g).topk(top_k, dim=1).indices
    weights = torch.softmax(torch.randn(tokens, top_k, device="cuda", generator=g), 1).to(torch.bfloat16)
    x = torch.randn(tokens, 1024, device="cuda", generator=g).to(torch.bfloat16)
    return x, index, weights


@pytest.mark.parametrize("tokens", [1, 3, 64, 700])
def test_grouped_experts_match_one_call_per_expert_eager_and_in_a_cuda_graph(tokens):
    experts, config = _qwen3_moe_experts()
    x, index, weights = _routing(tokens, 16, 4, seed=tokens)
    with torch.no_grad():
        want = experts._routed_forward(x, index, weights).float()
        got = experts(x, index, weights).float()
        launches = experts._stacks[2]
        assert launches is not None and len(launches["in"]) == 1  # grouped, gate and up in one launch
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)

        static = [t.clone() for t in (x, index, weights)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up off the default stream, as CUDA graph capture wants
            experts(*static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = experts(*static)
        for seed in (tokens + 100, tokens + 200):  # other routings through the same graph
            new = _routing(tokens, 16, 4, seed=seed)
            for dst, src in zip(static, new):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out.float(), experts._routed_forward(*new).float(), rtol=2e-2, atol=2e-2)
