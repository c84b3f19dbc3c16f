"""Prefill latency of a W4A16 model (Llama-3-8B-shaped layers, RTN g128, bf16) at 48-512 prompt tokens under three
W4A16 dispatch policies, eager and replayed from a CUDA graph: the package's default (the Gluon kernel for its row
range inside CUDA graphs only), the Triton paths only (no Gluon), and Gluon in its row range eagerly too
(`GLUON_EAGER`). Shows what the Gluon kernel's GPU-time lead and its host cost come to end to end.

  python benchmarks/w4a16_prefill.py [--layers 4] [--out benchmarks/results/w4a16_prefill.json]
  python benchmarks/w4a16_prefill.py --plot benchmarks/results/w4a16_prefill.json   # no GPU needed: -> .png

Random weights, batch 1, `model(ids, use_cache=False)` under no_grad; median of 20 timed calls after a warm-up.
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from end_to_end import _sync_time  # noqa: E402
from w4a16_generate import LLAMA3_8B  # noqa: E402

PROMPTS = (48, 128, 256, 512)


def _median_ms(fn):
    return _sync_time(fn, reps=20) * 1e3


def run(args):
    import transformers

    from hf_fastpath.kernels import w4a16
    from hf_fastpath.quantization.calibrate import quantize_model
    from hf_fastpath.quantization.config import W4A16Config

    policies = {"default": {}, "triton_only": dict(GLUON_MIN_M=10**9),
                "gluon_always": dict(GLUON_EAGER=True)}
    config = transformers.LlamaConfig(**LLAMA3_8B, num_hidden_layers=args.layers, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    quantize_model(model, W4A16Config(method="rtn", bits=4, group_size=128, sym=False))
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, transformers=transformers.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(), layers=args.layers,
               shape="Llama-3-8B layers, W4A16 RTN g128, bf16, batch 1, sdpa", rows=[])
    saved = {k: getattr(w4a16, k) for k in ("GLUON_MIN_M", "GLUON_EAGER")}
    for p in PROMPTS:
        ids = torch.randint(0, config.vocab_size, (1, p), device="cuda")
        row = dict(prompt=p)
        for name, patch in policies.items():
            for k, v in {**saved, **patch}.items():
                setattr(w4a16, k, v)
            with torch.no_grad():
                row[f"{name}_eager_ms"] = _median_ms(lambda: model(ids, use_cache=False))
                if name != "gluon_always":  # inside a graph the default already runs Gluon in its range
                    graph = torch.cuda.CUDAGraph()
                    model(ids, use_cache=False)
                    with torch.cuda.graph(graph):
                        model(ids, use_cache=False)
                    row[f"{name}_graph_ms"] = _median_ms(graph.replay)
                    del graph
        for k, v in saved.items():
            setattr(w4a16, k, v)
        for mode in ("eager", "graph"):
            row[f"default_vs_triton_only_{mode}"] = row[f"triton_only_{mode}_ms"] / row[f"default_{mode}_ms"]
        row["gluon_always_vs_triton_only_eager"] = row["triton_only_eager_ms"] / row["gluon_always_eager_ms"]
        res["rows"].append(row)
        print(row, flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


def plot(json_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        res = json.load(f)
    rows = res["rows"]
    prompts = [r["prompt"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, mode in zip(axes, ("eager", "graph")):
        for name, style in (("triton_only", "s--"), ("default", "o-"), ("gluon_always", "x:")):
            key = f"{name}_{mode}_ms"
            pts = [(r["prompt"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(prompts, [str(p) for p in prompts])
        ax.set_xlabel("prompt tokens (batch 1)")
        ax.set_ylabel("forward ms (median)")
        ax.set_title(f"{mode}: {'model(ids) per call' if mode == 'eager' else 'CUDA graph replay'}")
        ax.legend(fontsize=8)
    fig.suptitle(f"W4A16 prefill, {res['layers']} Llama-3-8B layers, {res['gpu']}")
    fig.tight_layout()
    png = os.path.splitext(json_path)[0] + ".png"
    fig.savefig(png, dpi=110)
    return png


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "w4a16_prefill.json"))
    p.add_argument("--plot", metavar="JSON", help="make a PNG from a results file (no GPU needed)")
    args = p.parse_args()
    if args.plot:
        print(plot(args.plot))
        return
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    run(args)


if __name__ == "__main__":
    main()
