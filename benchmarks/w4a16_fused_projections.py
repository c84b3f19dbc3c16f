"""Layers that share an input (q/k/v, gate/up) as one W4A16 launch (`w4a16_matmul_concat`) against one call per
layer, on Llama-3 8B and 70B shapes, group 128, bf16; cuBLAS bf16 over the concatenated weight as the peer.

    python benchmarks/w4a16_fused_projections.py [--out benchmarks/results/w4a16_fused_projections.json]

Every call is timed inside a CUDA graph (no launch overhead), cycling through weight copies larger than L2. Each
case first checks the one-launch output against the float reference. Then host and wall µs of one eager decoder
layer of a quantized Llama-3-8B at one token, without and with `hf_fastpath.fuse_projections` (not yet run: the
session that wrote it had no device time left). Writes JSON and a PNG. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from host_time import host_and_wall  # noqa: E402
from w4a16 import make_weights, time_graph  # noqa: E402

GROUPS = {  # name: (K, widths of the layers that share the input)
    "8B q/k/v": (4096, (4096, 1024, 1024)),
    "8B gate/up": (4096, (14336, 14336)),
    "70B q/k/v": (8192, (8192, 1024, 1024)),
    "70B gate/up": (8192, (28672, 28672)),
}
ROWS = (1, 4, 16, 64, 128)
GROUP_SIZE = 128


def back_to_back(k, widths, gen):
    """Random layers stored as fused layers hold them: one allocation per tensor kind, layers in order."""
    layers = [make_weights(k, n, GROUP_SIZE, torch.bfloat16, "cuda", gen) for n in widths]
    flat = [torch.cat([layer[i].reshape(-1) for layer in layers]) for i in range(3)]
    parts, starts = [], [0, 0, 0]
    for layer in layers:
        views = []
        for i, t in enumerate(layer):
            views.append(flat[i][starts[i]:starts[i] + t.numel()].view(t.shape))
            starts[i] += t.numel()
        parts.append(tuple(views))
    return parts


def run():
    from hf_fastpath.kernels import w4a16 as K

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (k, widths) in GROUPS.items():
        n = sum(widths)
        copies = max(2, min(6, int(1.0e9 // (k * n // 2))))
        weights = [back_to_back(k, widths, gen) for _ in range(copies)]
        assert all(K.w4a16_back_to_back(p) for p in weights)
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        ref_w = torch.cat([K.w4a16_dequantize(*p, GROUP_SIZE).float() for p in weights[0]], 1)
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = K.w4a16_matmul_concat(x, weights[0], GROUP_SIZE)
            ref = x.float() @ ref_w
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            separate = time_graph([lambda p=p: [K.w4a16_matmul_rows(x, *q, GROUP_SIZE) for q in p] for p in weights])
            one = time_graph([lambda p=p: K.w4a16_matmul_concat_rows(x, p, GROUP_SIZE) for p in weights])
            cublas = time_graph([lambda w=w: x @ w.t() for w in dense])
            row = dict(group=name, k=k, widths=widths, m=m, separate_us=separate, one_launch_us=one, cublas_us=cublas,
                       speedup_vs_separate=separate / one, speedup_vs_cublas=cublas / one, max_rel_error=err)
            rows.append(row)
            print(f"{name:12s} M={m:4d} separate {separate:7.2f} one launch {one:7.2f} ({separate / one:.2f}x) "
                  f"cuBLAS {cublas:7.2f} ({cublas / one:.2f}x) err {err:.1e}", flush=True)
        del weights, dense, ref_w
        torch.cuda.empty_cache()
    return rows


def eager_decoder_layer():
    """Host and wall µs per eager call of one Llama-3-8B decoder layer at one token (what eager generate() pays per
    layer), without and with `fuse_projections`, alternating three times: whether the hook costs less host time
    than the launches it saves."""
    import copy

    import transformers

    import hf_fastpath
    from hf_fastpath.quantization.calibrate import quantize_model
    from hf_fastpath.quantization.config import W4A16Config

    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                      num_key_value_heads=8, vocab_size=1024, num_hidden_layers=1)
    with torch.device("cuda"):
        plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    plain.eval()
    quantize_model(plain, W4A16Config(method="rtn", bits=4, group_size=GROUP_SIZE, sym=False))
    fused = copy.deepcopy(plain)
    assert hf_fastpath.fuse_projections(fused) == 2
    x = torch.randn(1, 1, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    position_ids = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    rope = plain.model.rotary_emb(x, position_ids)

    def per_call(model, calls=300):
        layer = model.model.layers[0]
        with torch.no_grad():
            host, wall = host_and_wall(lambda: layer(x, position_embeddings=rope, position_ids=position_ids), calls,
                                       warmup=30)
        return dict(host_us=host * 1e6, wall_us=wall * 1e6)

    runs = [dict(unfused=per_call(plain), fused=per_call(fused)) for _ in range(3)]
    for r in runs:
        print(f"decoder layer, eager, M=1: unfused {r['unfused']['wall_us']:.1f} µs "
              f"(host {r['unfused']['host_us']:.1f}), fused {r['fused']['wall_us']:.1f} µs "
              f"(host {r['fused']['host_us']:.1f})", flush=True)
    return runs


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = list(GROUPS)
    width = 0.8 / len(ROWS)
    for j, m in enumerate(ROWS):
        vals = [next(r["speedup_vs_separate"] for r in rows if r["group"] == g and r["m"] == m) for g in names]
        ax.bar([i + j * width for i in range(len(names))], vals, width, label=f"M={m}")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax.set_ylabel("one launch / one call per layer (speedup)")
    ax.set_title("W4A16 layers sharing an input, one launch (H200, bf16, group 128, CUDA graphs)")
    ax.legend(ncol=len(ROWS), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "w4a16_fused_projections.json"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = run()
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(), group_size=GROUP_SIZE, rows=rows,
               eager_decoder_layer=eager_decoder_layer())
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    plot(rows, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
