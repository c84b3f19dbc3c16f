"""W4A16 mixture-of-experts experts (one launch per projection for all experts) against Transformers' bf16 experts.

    python benchmarks/w4a16_moe.py [--models qwen3-30b-a3b,mixtral-8x7b,gpt-oss-20b] [--tokens 1,8,64,512,4096]
    python benchmarks/w4a16_moe.py --plot benchmarks/results/w4a16_moe.json

One experts module of each model's shape (random weights, bf16; W4A16: RTN, group 128 (gpt-oss: 32), asym), called
the way the MoE block calls it: (hidden [T, H], top-k expert indices [T, k], routing weights [T, k]), each token routed to k
distinct experts drawn uniformly. Columns (µs per call):
- `bf16 grouped_mm`: Transformers' fused experts with `experts_implementation="grouped_mm"` (torch._grouped_mm);
  the peer, also what a user gets by default on Hopper;
- `w4a16 grouped`: ours (`UnfusedExperts` over `W4A16Linear`s, EXPERTS mode of the W4A16 decode kernel);
- `w4a16 per expert`: the same layers, one W4A16 call per routed expert (our fallback path; eager only).
GPU time inside a CUDA graph (`graph_*`; what compiled `generate(cache_implementation="static")` pays) and eager
wall time (`eager_*`, host time included: what eager `generate()` pays). Bytes: weights of the experts routed to
(expected number of distinct experts hit), 4-bit + fp16 scales / zeros; `w4a16_gbps` is those bytes over the graph
time, against the H200's ~4.8 TB/s.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
RESULTS = os.path.join(HERE, "results", "w4a16_moe.json")

MODELS = {  # model_type, shape (hidden, expert intermediate, experts, top-k); W4A16 group size: GROUPS or 128
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                        num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4)),
    "mixtral-8x7b": ("mixtral", dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                                     num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8)),
    "gpt-oss-20b": ("gpt_oss", dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                                    num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8,
                                    head_dim=64)),
}


# gpt-oss's 2880 inputs are no multiple of 128 (the W4A16 kernels need the group to divide K); its own checkpoints
# quantize in blocks of 32 (MXFP4)
GROUPS = {"gpt_oss": 32}


def _timers():
    spec = importlib.util.spec_from_file_location("w4a16_bench", os.path.join(HERE, "w4a16.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.time_graph, module.time_eager


def build(model_type: str, shape: dict):
    """(bf16 fused experts, W4A16 UnfusedExperts, hidden size, experts, top-k) of one layer of the model."""
    import transformers

    from hf_fastpath.integrations.moe_experts import UnfusedExperts, expert_linear_names
    from hf_fastpath.quantization.linear import W4A16Linear
    from hf_fastpath.quantization.rtn import rtn_quantize

    config = transformers.AutoConfig.for_model(model_type, num_hidden_layers=1, vocab_size=1024, **shape)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fused = model.model.layers[0].mlp.experts
    with torch.no_grad():
        for p in fused.parameters():
            p.normal_(0, 0.02)
    quantized = UnfusedExperts(copy.deepcopy(fused), expert_linear_names(model_type))
    group = GROUPS.get(model_type, 128)
    for expert in quantized:
        for name, linear in list(expert.named_children()):
            q = rtn_quantize(linear.weight.detach(), 4, group, False)
            setattr(expert, name, W4A16Linear.from_quantized(
                q.codes, q.scales, q.zeros, q.g_idx, bias=linear.bias, bits=4, group_size=group,
                dtype=torch.bfloat16))
    experts = len(quantized)
    return fused, quantized, config.hidden_size, experts, config.num_experts_per_tok


def routing(tokens: int, experts: int, top_k: int, gen):
    index = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=1).indices
    weights = torch.softmax(torch.randn(tokens, top_k, device="cuda", generator=gen), dim=1).to(torch.bfloat16)
    return index, weights


def weight_bytes(quantized, tokens: int, top_k: int) -> float:
    """4-bit weights + fp16 scales / zeros of the experts a call is expected to touch."""
    experts = len(quantized)
    hit = experts * (1 - (1 - top_k / experts) ** tokens)
    per_expert = sum(m.in_features * m.out_features * (0.5 + 4 / m._effective_group_size)
                     for m in quantized[0].children())
    return hit * per_expert


def run(args) -> dict:
    time_graph, time_eager = _timers()
    res = dict(meta=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=datetime.date.today()
                         .isoformat(), note="µs per experts call; graph_* inside a CUDA graph, eager_* wall"), rows=[])
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.models.split(","):
        model_type, shape = MODELS[name]
        fused, quantized, hidden, experts, top_k = build(model_type, shape)
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
            index, weights = routing(tokens, experts, top_k, gen)
            with torch.no_grad():
                ref = fused(x, index, weights).float()
                got = quantized(x, index, weights).float()
                if quantized._stacks[2] is None:  # the per-expert path syncs with the host: no CUDA graph
                    raise SystemExit(f"{name}: the grouped W4A16 path does not run on these layers")
                routed = quantized._routed_forward(x, index, weights).float()
            row = dict(model=name, tokens=tokens, experts=experts, top_k=top_k,
                       err_vs_bf16=float((got - ref).norm() / ref.norm()),
                       err_grouped_vs_per_expert=float((got - routed).abs().max() / routed.abs().max()))
            calls = {"bf16": lambda: fused(x, index, weights), "w4a16": lambda: quantized(x, index, weights)}
            with torch.no_grad():
                for key, fn in calls.items():
                    row[f"graph_{key}"] = time_graph([fn])
                    row[f"eager_{key}"] = time_eager([fn], calls=50 if tokens > 512 else 200)
                row["eager_w4a16_per_expert"] = time_eager(
                    [lambda: quantized._routed_forward(x, index, weights)], calls=50)
            row["graph_speedup"] = row["graph_bf16"] / row["graph_w4a16"]
            row["eager_speedup"] = row["eager_bf16"] / row["eager_w4a16"]
            row["w4a16_gbps"] = weight_bytes(quantized, tokens, top_k) / row["graph_w4a16"] / 1e3
            print(json.dumps(row), flush=True)
            res["rows"].append(row)
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        fused = quantized = calls = None  # free this model before the next
        torch.cuda.empty_cache()
    return res


def plot(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.load(open(path))["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        tokens = [r["tokens"] for r in mine]
        ax.plot(tokens, [r["graph_speedup"] for r in mine], "o-", label="CUDA graph (GPU time)")
        ax.plot(tokens, [r["eager_speedup"] for r in mine], "s--", label="eager (wall)")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model}: W4A16 ÷ bf16 grouped_mm")
        ax.set_xlabel("tokens")
        ax.set_ylabel("speedup (higher is better)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path.replace(".json", ".png"), dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default="1,8,64,512,4096")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--plot")
    args = ap.parse_args()
    if args.plot:
        return plot(args.plot)
    run(args)
    plot(args.out)


if __name__ == "__main__":
    main()
