"""What bitwise-repeatable gradients cost: the Gluon attention backward with its dQ adds in arrival order (the
default), with `deterministic=True` (the key blocks add in a fixed order per query tile), and our plain-Triton
backward (deterministic by construction: dQ from its own kernel; what `fastpath` ran under
`torch.use_deterministic_algorithms(True)` before the Gluon mode existed). Backward only, on the forward's out / lse,
median of `triton.testing.do_bench`; plain causal / full calls at 16k tokens a batch and the masked / windowed calls
of `gluon_attention_masked.py`. FLOPs: 2.5 x 4 * H * D * visible (query, key) pairs.

    python benchmarks/gluon_attention_deterministic.py   # GPU: benchmarks/results/gluon_attention_deterministic.json
    python benchmarks/gluon_attention_deterministic.py --plot F  # no GPU needed: PNG beside the JSON F
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gluon_attention_deterministic.json")
NAMES = ("gluon", "gluon_deterministic", "triton")


def _log(*a):
    print(*a, file=sys.stderr, flush=True)


def cases():
    """(kind, batch, seq, mean document length, causal): plain at 1k / 4k / 16k, then the packed and windowed rows of
    `gluon_attention_masked.cases`."""
    from gluon_attention_masked import TOKENS, cases as masked_cases

    for s in (1024, 4096, 16384):
        for causal in (True, False):
            yield "plain", TOKENS // s, s, None, causal
    yield from masked_cases(("packed", "window"))


def bench(head_dims):
    from gluon_attention import _timed  # {ms, tflops} by do_bench, or {error}
    from gluon_attention_masked import HEADS, _pairs, masks

    from hf_fastpath.kernels.flash_attention import flash_attention_backward
    from hf_fastpath.kernels.gluon_attention import gluon_attention_forward
    from hf_fastpath.kernels.gluon_attention_bwd import gluon_attention_backward

    impls = {"gluon": gluon_attention_backward,
             "gluon_deterministic": lambda *a, **kw: gluon_attention_backward(*a, deterministic=True, **kw),
             "triton": flash_attention_backward}
    rows = []
    for d in head_dims:
        hq, hkv = HEADS[d]
        for kind, b, s, mean, causal in cases():
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv))
            do = torch.randn_like(q)
            if kind == "plain":
                kw, visible = {}, torch.ones(1, s, s, dtype=torch.bool, device="cuda")
            else:
                kw, _, visible = masks(kind, b, s, mean, heads=hq, causal=causal)
            out, lse = gluon_attention_forward(q, k, v, causal=causal, **kw)
            fl = 2.5 * 4 * hq * d * _pairs(visible, causal) * (b if kind == "plain" else 1)
            row = dict(kind=kind, head_dim=d, heads=hq, kv_heads=hkv, batch=b, seq=s, mean_doc=mean, causal=causal,
                       bwd={name: _timed(lambda fn=fn: fn(do, q, k, v, out, lse, causal=causal, **kw), fl)
                            for name, fn in impls.items()})
            t = {n: x.get("ms") for n, x in row["bwd"].items()}
            if t["gluon_deterministic"]:
                for peer in ("gluon", "triton"):
                    if t[peer]:
                        row["bwd"][f"deterministic_vs_{peer}"] = t[peer] / t["gluon_deterministic"]
            rows.append(row)
            _log(f"{kind} hd{d} b{b} s{s} {'causal' if causal else 'full'}: "
                 + " ".join(f"{n} {row['bwd'][n].get('ms', float('nan')):.3f}" for n in NAMES)
                 + "  det x gluon {:.2f}, x triton {:.2f}".format(row["bwd"].get("deterministic_vs_gluon", 0.0),
                                                                   row["bwd"].get("deterministic_vs_triton", 0.0)))
    return rows


def plot(path, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(path))
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 2))
    labels = [f"{r['kind']} hd{r['head_dim']} b{r['batch']}x{r['seq']} {'causal' if r['causal'] else 'full'}"
              for r in rows]
    h = 0.8 / len(NAMES)
    for i, (n, c) in enumerate(zip(NAMES, ("tab:red", "tab:purple", "tab:orange"))):
        ax.barh([y + i * h for y in range(len(rows))], [r["bwd"][n].get("tflops", 0.0) for r in rows], height=h,
                color=c, label=n)
    for y, r in enumerate(rows):
        if "deterministic_vs_triton" in r["bwd"]:
            ax.annotate(f"{r['bwd']['deterministic_vs_gluon']:.2f}x gluon, {r['bwd']['deterministic_vs_triton']:.2f}x "
                        "triton", (r["bwd"]["gluon_deterministic"]["tflops"], y + h), fontsize=6, xytext=(3, -3),
                        textcoords="offset points")
    ax.set_yticks([y + 0.4 - h / 2 for y in range(len(rows))])
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("backward TFLOP/s of visible (query, key) pairs")
    ax.legend(fontsize=7)
    ax.grid(axis="x", alpha=0.3)
    meta = data["meta"]
    ax.set_title(f"Attention backward, deterministic or not, {meta['gpu']}, bf16, triton {meta['triton']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=RESULTS)
    ap.add_argument("--plot", metavar="PNG", help="draw the JSON (--json) to this PNG; without a GPU, only that")
    ap.add_argument("--head-dims", type=int, nargs="*", default=[64, 128])
    args = ap.parse_args()
    if args.plot:
        plot(args.json, args.plot)
        return
    import triton

    rows = bench(args.head_dims)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat())
    with open(args.json, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    plot(args.json, os.path.splitext(args.json)[0] + ".png")


if __name__ == "__main__":
    main()
