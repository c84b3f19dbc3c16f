"""AWQ on mixture-of-experts experts, CPU sanity check (synthetic: no real MoE model ships with a package).

A tiny random Mixtral (hidden 256, 4 experts, top-2, 2 layers) with 8 outlier channels in each norm (x8, as trained
LLMs have), quantized to 3 bits, group 32, calibrated on 16 x 64 random tokens; relative logits error against the
float model on 8 x 64 held-out tokens, three seeds. Rows:
- `experts_scaled`: AWQ as shipped (experts' gate / up scaled from the norm, router compensated; down from up);
- `clip_only`: the same with the experts' scale folds turned off (session 36's behaviour: experts clip only);
- `rtn`: round to nearest.

    python benchmarks/awq_moe_cpu.py   # ~1 min on 2 cores; writes benchmarks/results/awq_moe_cpu.json
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests")]

import hf_fastpath.quantization.awq as awq  # noqa: E402
from hf_fastpath.quantization.calibrate import quantize_model  # noqa: E402
from models import tiny_model  # noqa: E402  (tests/models.py: the test suite's tiny configs)


def build(seed: int):
    torch.manual_seed(seed)
    model = tiny_model("mixtral", hidden_size=256, intermediate_size=512)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            outliers = torch.randperm(256, generator=gen)[:8]
            layer.input_layernorm.weight[outliers] *= 8
            layer.post_attention_layernorm.weight[outliers] *= 8
    return model


def quantize(model, variant: str, calibration):
    if variant == "rtn":
        return quantize_model(model, dict(method="rtn", bits=3, group_size=32))
    saved = awq._compensate_consumers, awq.routed_scale_partner
    if variant == "clip_only":  # refuse every compensation (no norm fold past a router) and every down <- up fold
        awq._compensate_consumers = lambda block, names, *args: names[0]
        awq.routed_scale_partner = lambda *args: None
    try:
        quantize_model(model, dict(method="awq", bits=3, group_size=32), calibration_ids=calibration)
    finally:
        awq._compensate_consumers, awq.routed_scale_partner = saved


def main():
    rows = []
    for seed in range(3):
        base = build(seed)
        calibration = torch.randint(1, 100, (16, 64), generator=torch.Generator().manual_seed(10 + seed))
        held_out = torch.randint(1, 100, (8, 64), generator=torch.Generator().manual_seed(20 + seed))
        with torch.no_grad():
            reference = base(held_out).logits
        row = dict(seed=seed)
        for variant in ("experts_scaled", "clip_only", "rtn"):
            model = copy.deepcopy(base)
            quantize(model, variant, calibration)
            with torch.no_grad():
                row[variant] = float((model(held_out).logits - reference).norm() / reference.norm())
        print(json.dumps(row), flush=True)
        rows.append(row)
    out = dict(meta=dict(date=datetime.date.today().isoformat(), torch=torch.__version__,
                         note="relative logits error vs float, lower is better; synthetic tiny Mixtral"), rows=rows)
    path = os.path.join(HERE, "results", "awq_moe_cpu.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    plot(rows, path.replace(".json", ".png"))


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = ("experts_scaled", "clip_only", "rtn")
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        ax.bar([r["seed"] + i * width for r in rows], [r[variant] for r in rows], width, label=variant)
    ax.set_xticks([r["seed"] + width for r in rows], [f"seed {r['seed']}" for r in rows])
    ax.set_ylabel("relative logits error (lower is better)")
    ax.set_title("3-bit g32 tiny Mixtral: AWQ on experts")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
