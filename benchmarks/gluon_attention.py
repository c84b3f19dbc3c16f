"""Forward TFLOP/s of the Gluon Hopper attention (`kernels/gluon_attention.py`) beside SDPA's cuDNN and FLASH
backends and our plain-Triton kernel, all in one process (`triton.testing.do_bench`, median), after a correctness
check against float64. 16k tokens per batch (batch = 16384 / seq); hd64 with 32 heads, hd128 with 16 heads.
FLOPs = 4*B*H*S^2*D, halved when causal.

    python benchmarks/gluon_attention.py            # GPU: writes benchmarks/results/gluon_attention.json
    python benchmarks/gluon_attention.py --variants --json F   # also every opt-in variant (`variants()`)
    python benchmarks/gluon_attention.py --backward --json F   # also the Gluon backward vs Triton's and cuDNN's
    python benchmarks/gluon_attention.py --backward --skip-forward --json F   # the backward rows only
        (every variant of gluon_attention_bwd.VARIANTS as gluon_<variant>, `--bwd-variants` picks some; "gluon" is
        the default per head dim; cuDNN's backward = its forward + backward through autograd - its forward)
    python benchmarks/gluon_attention.py --plot F   # no GPU needed: F (JSON) -> PNG beside it (backward rows when
        the file has no forward rows)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gluon_attention.json")
HEADS = {64: 32, 128: 16, 256: 8}
SEQS = (1024, 2048, 4096, 8192, 16384)
TOKENS = 16384


def _log(*a):
    print(*a, file=sys.stderr, flush=True)


def flops(b, h, s, d, causal):
    from attention import attn_flops  # benchmarks/attention.py: 4*B*H*S^2*D, halved when causal

    return attn_flops(b, h, s, s, d, causal, "fwd")


def implementations():
    from attention import _sdpa  # benchmarks/attention.py: SDPA with one backend forced

    from hf_fastpath.kernels.flash_attention import flash_attention_forward
    from hf_fastpath.kernels.gluon_attention import gluon_attention_forward

    return {
        "gluon": lambda q, k, v, c: gluon_attention_forward(q, k, v, causal=c)[0],
        "sdpa_cudnn": _sdpa("CUDNN_ATTENTION"),
        "sdpa_flash": _sdpa("FLASH_ATTENTION"),
        "triton": lambda q, k, v, c: flash_attention_forward(q, k, v, causal=c)[0],
    }


def check(impls, variants=False):
    """Every implementation (and with `variants` every opt-in Gluon variant) against float64 on a few odd shapes
    (relative Frobenius error of out)."""
    from hf_fastpath.attention import reference
    from hf_fastpath.kernels import gluon_attention as ga

    worst = {}
    for b, sq, sk, hq, hkv, d in ((2, 1000, 1000, 8, 2, 64), (1, 777, 1500, 8, 8, 128), (2, 1500, 777, 4, 4, 128)):
        for causal in (False, True):
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                       for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
            ref = reference.attention_forward(q.double(), k.double(), v.double(), causal=causal)[0]
            fns = dict(impls)
            if variants:
                fns.update({f"gluon_{n}": _variant(cfg) for n, cfg in ga.variants(d, causal).items()})
            for name, fn in fns.items():
                if name.startswith("sdpa") and causal and sq != sk:
                    continue  # SDPA's is_causal is aligned top-left
                out = fn(q, k, v, causal).double()
                err = ((out - ref).norm() / ref.norm()).item()
                worst[name] = max(worst.get(name, 0.0), err)
    _log("max relative error vs float64:", worst)
    return worst


def _variant(cfg):
    from hf_fastpath.kernels.gluon_attention import gluon_attention_forward

    return lambda q, k, v, causal: gluon_attention_forward(q, k, v, causal=causal, variant=cfg)[0]


def _shapes(head_dims, seqs):
    """(head_dim, heads, causal, seq, batch) of every row: 16k tokens a batch, HEADS[head_dim] heads."""
    for d in head_dims:
        for causal in (False, True):
            for s in seqs:
                yield d, HEADS[d], causal, s, max(TOKENS // s, 1)


def _timed(fn, flop):
    """{ms, tflops} of fn() (do_bench median), or {error} when it raises (a peer may be missing here)."""
    from triton.testing import do_bench

    try:
        ms = do_bench(fn, warmup=10, rep=50, return_mode="median")
    except Exception as exc:  # noqa: BLE001 - recorded in the row
        return dict(error=f"{type(exc).__name__}: {exc}"[:300])
    return dict(ms=ms, tflops=flop / ms * 1e-9)


def bench(impls, head_dims, seqs, variants=False):
    rows = []
    for d, h, causal, s, b in _shapes(head_dims, seqs):
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        row = dict(head_dim=d, heads=h, seq=s, batch=b, causal=causal)
        fl = flops(b, h, s, d, causal)
        for name, fn in impls.items():
            row[name] = _timed(lambda: fn(q, k, v, causal), fl)
        if variants:  # every opt-in variant, timed beside the default and cuDNN in this process
            from hf_fastpath.kernels import gluon_attention as ga

            want = impls["sdpa_cudnn"](q, k, v, causal).float()
            for name, cfg in ga.variants(d, causal).items():
                fn = _variant(cfg)
                x = dict(config=cfg._asdict(), **_timed(lambda: fn(q, k, v, causal), fl),
                         max_abs_vs_cudnn=(fn(q, k, v, causal).float() - want).abs().max().item())
                if "ms" in row["sdpa_cudnn"] and "ms" in x:
                    x["vs_cudnn"] = row["sdpa_cudnn"]["ms"] / x["ms"]
                row.setdefault("gluon_variants", {})[name] = x
        if "tflops" in row["gluon"] and "tflops" in row["sdpa_cudnn"]:
            row["gluon_vs_cudnn"] = row["gluon"]["tflops"] / row["sdpa_cudnn"]["tflops"]
        rows.append(row)
        _log(_fmt(row))
    return rows


def _bwd_name(variant):
    return f"gluon_{variant}"


def bench_backward(head_dims, seqs, variants):
    """Backward only: the Gluon backward and our Triton backward on the same out / lse, and SDPA's cuDNN and FLASH
    (FA2) backwards as (forward + backward) - forward through autograd. FLOPs = 2.5x the forward's."""
    from hf_fastpath.kernels.flash_attention import flash_attention_backward
    from hf_fastpath.kernels.gluon_attention import gluon_attention_forward
    from hf_fastpath.kernels.gluon_attention_bwd import DEFAULT_VARIANTS, gluon_attention_backward

    names = [_bwd_name(n) for n in variants]

    sdpa = {name: implementations()[name] for name in ("sdpa_cudnn", "sdpa_flash")}
    rows = []
    for d, h, causal, s, b in _shapes(head_dims, seqs):
        q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        out, lse = gluon_attention_forward(q, k, v, causal=causal)
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        fl = 2.5 * flops(b, h, s, d, causal)
        row = dict(head_dim=d, heads=h, seq=s, batch=b, causal=causal,
                   **{_bwd_name(n): _timed(lambda n=n: gluon_attention_backward(do, q, k, v, out, lse, causal=causal,
                                                                                variant=n), fl) for n in variants},
                   triton=_timed(lambda: flash_attention_backward(do, q, k, v, out, lse, causal=causal), fl))
        for peer, fn in sdpa.items():
            both = _timed(lambda fn=fn: torch.autograd.grad(fn(qg, kg, vg, causal), (qg, kg, vg), do), fl)
            fwd = _timed(lambda fn=fn: fn(q, k, v, causal), fl)
            if "ms" in both and "ms" in fwd:
                ms = both["ms"] - fwd["ms"]
                row[peer] = dict(ms=ms, tflops=fl / ms * 1e-9, fwd_bwd_ms=both["ms"])
            else:
                row[peer] = dict(error=both.get("error") or fwd.get("error"))
        if DEFAULT_VARIANTS[d] in variants:  # "gluon": what gluon_attention_backward runs by default
            row["gluon"] = row[_bwd_name(DEFAULT_VARIANTS[d])]
        for name in names + ["triton"] + (["gluon"] if "gluon" in row else []):
            for peer, short in (("sdpa_cudnn", "cudnn"), ("sdpa_flash", "flash")):
                if "ms" in row[name] and "ms" in row[peer]:
                    row[f"{name}_vs_{short}"] = row[peer]["ms"] / row[name]["ms"]
        rows.append(row)
        _log(f"bwd hd{d} S={s} {'causal' if causal else 'full'} "
             + "  ".join(f"{n} {row[n].get('tflops', float('nan')):6.1f}"
                         for n in names + ["triton", "sdpa_cudnn", "sdpa_flash"])
             + f"  gluon x cuDNN {row.get('gluon_vs_cudnn', float('nan')):.2f}"
             + f"  x FA2 {row.get('gluon_vs_flash', float('nan')):.2f}")
    return rows


def _fmt(r):
    def g(name):
        x = r.get(name, {})
        return f"{x['tflops']:6.1f}" if "tflops" in x else "     -"

    return (f"hd{r['head_dim']:<4} S={r['seq']:<6} {'causal' if r['causal'] else 'full  '} gluon {g('gluon')}  "
            f"cudnn {g('sdpa_cudnn')}  flash {g('sdpa_flash')}  triton {g('triton')}  "
            f"x cuDNN {r.get('gluon_vs_cudnn', float('nan')):.2f}"
            + "".join(f"  {n} {x['tflops']:6.1f} ({x.get('vs_cudnn', float('nan')):.2f}x)"
                      for n, x in r.get("gluon_variants", {}).items()))


def plot(path, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(path))
    backward = not data["rows"]  # a --skip-forward run: draw its backward rows
    rows = data["backward"] if backward else data["rows"]
    combos = [(d, c) for d in sorted({r["head_dim"] for r in rows}) for c in (False, True)]
    fig, axes = plt.subplots(1, len(combos), figsize=(5 * len(combos), 4.2), squeeze=False)
    colors = {"gluon": "tab:red", "sdpa_cudnn": "tab:blue", "sdpa_flash": "tab:green", "triton": "tab:orange"}
    if backward:  # every Gluon variant's column, the default ("gluon") drawn thicker
        extra = sorted({k for r in rows for k in r if k.startswith("gluon_") and isinstance(r[k], dict)})
        colors.update(zip(extra, ("tab:purple", "tab:brown", "tab:pink", "tab:gray", "tab:olive")))
    for ax, (d, c) in zip(axes.flat, combos):
        sel = [r for r in rows if r["head_dim"] == d and r["causal"] == c]
        for name, col in colors.items():
            pts = [(r["seq"], r[name]["tflops"]) for r in sel if "tflops" in r.get(name, {})]
            if pts:
                ax.plot(*zip(*pts), "o-" if name != "gluon" else "o--", color=col, label=name,
                        lw=2.5 if name == "gluon" else 1.2)
        for r in sel:
            if "gluon_vs_cudnn" in r:
                ax.annotate(f"{r['gluon_vs_cudnn']:.2f}x", (r["seq"], r["gluon"]["tflops"]), fontsize=7,
                            textcoords="offset points", xytext=(0, 6), ha="center", color="tab:red")
        ax.set_xscale("log", base=2)
        ax.set_title(f"hd{d} {'causal' if c else 'full'} {'backward' if backward else 'forward'} "
                     f"(label: gluon/cuDNN)")
        ax.set_xlabel("seq (16k tokens per batch)")
        ax.set_ylabel("TFLOP/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    meta = data["meta"]
    fig.suptitle(f"Gluon FA3-style {'backward' if backward else 'forward'} vs SDPA on {meta['gpu']}, bf16, "
                 f"torch {meta['torch']}, triton {meta['triton']}")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(png, dpi=80)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plot", metavar="FILE", help="PNG to draw from the JSON (--json), without a GPU")
    ap.add_argument("--json", default=RESULTS)
    ap.add_argument("--head-dims", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--seqs", type=int, nargs="*", default=list(SEQS))
    ap.add_argument("--variants", action="store_true",
                    help="also check and time every opt-in variant of gluon_attention.variants()")
    ap.add_argument("--backward", action="store_true",
                    help="time the Gluon backward beside our Triton backward and cuDNN's (rows in 'backward')")
    ap.add_argument("--skip-forward", action="store_true", help="with --backward: no forward rows")
    ap.add_argument("--bwd-variants", nargs="*", help="with --backward: the Gluon backward variants to time "
                    "(default: all of gluon_attention_bwd.VARIANTS)")
    args = ap.parse_args()
    if args.plot and not torch.cuda.is_available():
        plot(args.json, args.plot)
        return
    import triton

    from hf_fastpath.kernels import gluon_attention as ga

    t0 = time.time()
    impls = implementations()
    errors = {} if args.skip_forward else check(impls, args.variants)
    rows = [] if args.skip_forward else bench(impls, args.head_dims, args.seqs, args.variants)
    if args.backward:
        from hf_fastpath.kernels.gluon_attention_bwd import VARIANTS

        extra = dict(backward=bench_backward(args.head_dims, args.seqs, args.bwd_variants or list(VARIANTS)))
    else:
        extra = {}
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat(), dtype="bf16", tokens_per_batch=TOKENS,
                seconds=round(time.time() - t0, 1), timing="triton.testing.do_bench median, warmup 10, rep 50",
                config={d: ga.config(d, False)._asdict() for d in args.head_dims})
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(meta=meta, max_rel_error_vs_fp64=errors, rows=rows, **extra), f, indent=1)
    if args.plot:
        plot(args.json, args.plot)


if __name__ == "__main__":
    main()
