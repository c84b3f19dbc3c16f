"""Measures, per kind of attention call, our Triton kernel against torch SDPA's kernels on this GPU: the table that
`fastpath` dispatches from (`hf_fastpath/attention/dispatch.py`).

    python benchmarks/attention_dispatch.py            # GPU: time every case, write the JSON (and the package table)
    python benchmarks/attention_dispatch.py --plot F   # PNG from a results JSON (no GPU needed)
    python benchmarks/attention_dispatch.py --write-table F   # the package's table from F, plus the masked rows of
        benchmarks/results/gluon_attention_masked.json (padded / packed batches: Triton and Gluon) and the windowed
        rows of gluon_attention_window*.json (sliding windows, soft-caps) and the alibi rows of
        gluon_attention_alibi.json
    python benchmarks/attention_dispatch.py --only prefill --head-dims 256 --out F   # a subset (merge it by hand)

Calls are made the way each runs inside a model:
- `ours`: `hf_fastpath.attention.ops.flash_attn` (the custom op the `fastpath` adapter calls);
- `gluon`: `hf_fastpath.attention.ops.gluon_attn` (the Gluon forward and backward, Hopper only);
- `sdpa`: `F.scaled_dot_product_attention` as Transformers' "sdpa" calls it (`enable_gqa=True` without a mask,
  K/V repeated with one), torch choosing the kernel;
- `sdpa_cudnn`, `sdpa_flash`: the same call with one SDPA kernel forced (as `fastpath`'s SDPA backends run it).
Phases: `prefill` (forward), `train` (forward + backward), 16k tokens a batch; `decode` (1 query; K/V of `kv`
tokens, `static`: a static cache twice that long with `seqused_k` / a boolean key mask for SDPA), timed as CUDA
graph replays (what compiled generate runs) and, for ours and sdpa, also eagerly (host time included).
Prefill / train rows also keep `host_ms`, each call's host time (enqueue only): where it nears `ms`, the row is
host-bound (the log marks it "!").
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "attention_dispatch.json")
TOKENS = 16384
PREFILL = [  # (head dim, query heads, kv heads, seq lens)
    (128, 32, 8, (512, 1024, 2048, 4096, 8192, 16384)),
    (128, 32, 32, (1024, 4096, 16384)),
    (64, 16, 16, (1024, 4096, 16384)),
    (256, 16, 8, (1024, 4096, 16384)),
    (96, 32, 32, (1024, 4096, 16384)),  # GPT-NeoX-20B's head dim: the Gluon kernels pad it to 128
    (80, 32, 32, (1024, 4096, 16384)),  # Pythia-2.8B's (GPT-NeoX), padded to 128 too
]
DECODE = [  # (head dim, query heads, kv heads)
    (128, 32, 8), (128, 32, 32), (64, 16, 16), (256, 16, 8),
]
DECODE_BATCH = (1, 8, 32)
DECODE_KV = (1024, 4096, 16384, 65536, 131072)
DECODE_MAX_BYTES = 12 << 30  # skip decode cases whose K/V (static cache included) exceed this


def _log(*a):
    print(*a, flush=True)


def _sdpa_call(kernel):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v, causal, mask=None):
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        gqa = qh.shape[1] != kh.shape[1]
        if gqa and mask is not None:  # Transformers repeats K/V when a mask is given
            rep = qh.shape[1] // kh.shape[1]
            kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
            gqa = False
        kwargs = dict(attn_mask=mask, is_causal=causal and mask is None and q.shape[1] > 1, enable_gqa=gqa)
        if kernel is None:
            return F.scaled_dot_product_attention(qh, kh, vh, **kwargs).transpose(1, 2)
        with sdpa_kernel([getattr(SDPBackend, kernel)]):
            return F.scaled_dot_product_attention(qh, kh, vh, **kwargs).transpose(1, 2)

    return run


def _ours(q, k, v, causal, seqused=None):
    from hf_fastpath.attention.ops import flash_attn

    return flash_attn(q, k, v, causal=causal, softmax_scale=q.shape[-1] ** -0.5, seqused_k=seqused)[0]


def _gluon(q, k, v, causal):
    from hf_fastpath.attention.ops import gluon_attn
    from hf_fastpath.attention.params import make_params

    return gluon_attn(q, k, v, make_params(q, k, v, causal=causal, softmax_scale=q.shape[-1] ** -0.5))[0]


IMPLS = {"ours": _ours, "gluon": _gluon, "sdpa": _sdpa_call(None), "sdpa_cudnn": _sdpa_call("CUDNN_ATTENTION"),
         "sdpa_flash": _sdpa_call("FLASH_ATTENTION"), "sdpa_efficient": _sdpa_call("EFFICIENT_ATTENTION")}


def _time(fn, graph=False):
    from triton.testing import do_bench, do_bench_cudagraph

    fn()  # compile / select; raises if the variant cannot run this call
    torch.cuda.synchronize()
    if graph:
        return do_bench_cudagraph(fn, rep=50, return_mode="median")
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def _host_ms(fn, calls=20):
    """Host time a call takes to enqueue its work (the GPU not awaited). Near the row's timed ms, the row measures
    the host (Python, launches, or a hidden sync), not the kernels."""
    from benchmarks.host_time import host_and_wall

    return host_and_wall(fn, calls)[0] * 1e3


def _try(label, fn, graph=False):
    try:
        return _time(fn, graph)
    except Exception as e:  # a forced SDPA kernel that does not take this call
        _log(f"    {label}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        return None


def bench_prefill(rows, head_dims=None):
    for d, hq, hkv, seqs in PREFILL:
        if head_dims and d not in head_dims:
            continue
        for s in seqs:
            b = max(1, TOKENS // s)
            for causal in (True, False):
                q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
                flops = 4 * b * hq * s * s * d / (2 if causal else 1)
                for phase in ("prefill", "train"):
                    row = dict(phase=phase, head_dim=d, heads=hq, kv_heads=hkv, batch=b, q_len=s, kv_len=s,
                               causal=causal, ms={})
                    for name in ("ours", "gluon", "sdpa", "sdpa_cudnn", "sdpa_flash"):
                        impl = IMPLS[name]
                        if phase == "prefill":
                            fn = lambda impl=impl: impl(q, k, v, causal)  # noqa: E731
                        else:
                            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                            g = torch.randn_like(q)

                            def fn(impl=impl, qg=qg, kg=kg, vg=vg, g=g):
                                impl(qg, kg, vg, causal).backward(g)
                        row["ms"][name] = _try(f"{phase} d{d} s{s} c{int(causal)} {name}", fn)
                        if row["ms"][name] is not None:
                            row.setdefault("host_ms", {})[name] = _host_ms(fn)
                    mult = 3.5 if phase == "train" else 1.0
                    row["tflops"] = {n: (flops * mult / (t * 1e-3) / 1e12 if t else None) for n, t in row["ms"].items()}
                    rows.append(row)
                    _log(_fmt(row))


def bench_decode(rows):
    for d, hq, hkv in DECODE:
        for kv in DECODE_KV:
            for b in DECODE_BATCH:
                cache = 2 * kv  # static cache: twice the tokens it holds
                nbytes = 2 * b * cache * hkv * d * 2 * (1 if hq == hkv else 1 + hq // hkv)  # + repeated K/V
                if nbytes > DECODE_MAX_BYTES:
                    continue
                q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(b, cache, hkv, d, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(b, cache, hkv, d, device="cuda", dtype=torch.bfloat16)
                kd, vd = k[:, :kv], v[:, :kv]  # a dynamic cache of kv tokens (strided views)
                used = torch.full((b,), kv, device="cuda", dtype=torch.int32)
                mask = (torch.arange(cache, device="cuda") < kv)[None, None, None, :].expand(b, 1, 1, cache)
                row = dict(phase="decode", head_dim=d, heads=hq, kv_heads=hkv, batch=b, q_len=1, kv_len=kv,
                           causal=True, ms={}, ms_eager={})
                cases = {
                    "ours": lambda: _ours(q, kd, vd, True),
                    "ours_static": lambda: _ours(q, k, v, True, used),
                    "sdpa": lambda: IMPLS["sdpa"](q, kd, vd, True),
                    "sdpa_static": lambda: IMPLS["sdpa"](q, k, v, True, mask),
                    "sdpa_cudnn": lambda: IMPLS["sdpa_cudnn"](q, kd, vd, True),
                    "sdpa_flash": lambda: IMPLS["sdpa_flash"](q, kd, vd, True),
                    "sdpa_cudnn_static": lambda: IMPLS["sdpa_cudnn"](q, k, v, True, mask),
                    "sdpa_efficient_static": lambda: IMPLS["sdpa_efficient"](q, k, v, True, mask),
                }
                for name, fn in cases.items():
                    row["ms"][name] = _try(f"decode d{d} b{b} kv{kv} {name}", fn, graph=True)
                for name in ("ours", "ours_static", "sdpa", "sdpa_static"):
                    row["ms_eager"][name] = _try(f"decode eager {name}", cases[name])
                kv_bytes = 2 * b * kv * hkv * d * 2
                row["tbps"] = {n: (kv_bytes / (t * 1e-3) / 1e12 if t else None) for n, t in row["ms"].items()}
                rows.append(row)
                _log(_fmt(row))


def sweep_decode_configs(rows):
    """Decode tiles (BLOCK_M, BLOCK_N, warps, stages) and split counts for our kernel, CUDA graph times."""
    from hf_fastpath.kernels import flash_attention as fa

    configs = {128: [(16, 128, 4, 3), (16, 64, 4, 3), (16, 128, 4, 4), (16, 64, 2, 4), (16, 256, 8, 2)],
               256: [(16, 64, 4, 2), (16, 64, 4, 3), (16, 32, 4, 3), (16, 32, 4, 4), (16, 128, 8, 1)]}
    for d, tiles in configs.items():
        for b in (1, 8):
            for kv in (4096, 32768):
                q = torch.randn(b, 1, 32, d, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(b, kv, 8, d, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(b, kv, 8, d, device="cuda", dtype=torch.bfloat16)
                row = dict(phase="decode_config", head_dim=d, batch=b, kv_len=kv, ms={})
                for tile in tiles:
                    for split_mult in (0.5, 1, 2):
                        bn = tile[1]
                        programs = 8 * b
                        base = fa._num_splits(programs, kv, bn, q.device)
                        splits = max(1, int(base * split_mult))
                        fa.CONFIG_OVERRIDE["fwd"] = tile
                        try:
                            t = _try(f"cfg {tile} x{split_mult}", lambda: fa.flash_attention_forward(
                                q, k, v, causal=True, num_splits=splits), graph=True)
                        finally:
                            fa.CONFIG_OVERRIDE.pop("fwd", None)
                        row["ms"][f"{tile}/s{splits}"] = t
                rows.append(row)
                best = min(((t, n) for n, t in row["ms"].items() if t), default=None)
                _log(f"decode cfg d{d} b{b} kv{kv}: best {best}")


def _fmt(row):
    host = row.get("host_ms", {})
    # "!": the host takes most of the timed time, so the row says little about the kernels
    ms = " ".join((f"{n}={t:.3f}" + ("!" if host.get(n, 0) > 0.8 * t else "")) if t else f"{n}=--"
                  for n, t in row["ms"].items())
    return (f"{row['phase']:7s} d{row['head_dim']} h{row['heads']}/{row['kv_heads']} b{row['batch']} "
            f"kv{row['kv_len']} c{int(row['causal'])}: {ms}")


class _SavedRows(list):
    """A list of result rows written to disk after every append (a run cut off by its time limit keeps its rows)."""

    def __init__(self, path):
        super().__init__()
        self.path, self.meta = path, {}

    def append(self, row):
        super().append(row)
        self.save()

    def save(self):
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(dict(meta=self.meta, rows=list(self)), f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plot", help="PNG from this results JSON")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--only", choices=("prefill", "decode"))
    ap.add_argument("--head-dims", type=int, nargs="*", help="prefill / train rows of these head dims only")
    ap.add_argument("--write-table", metavar="RESULTS", help="write the package's dispatch table from this JSON")
    args = ap.parse_args()
    if args.plot:
        plot(args.plot, os.path.splitext(args.plot)[0] + ".png")
        return
    if args.write_table:
        write_table(args.write_table)
        return
    import triton
    import transformers

    rows = _SavedRows(args.out)
    meta = dict(gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
                python=platform.python_version(), date=datetime.date.today().isoformat())
    _log(meta)
    rows.meta = meta
    try:
        if args.only != "decode":
            bench_prefill(rows, args.head_dims)
        if args.only != "prefill":
            bench_decode(rows)
            sweep_decode_configs(rows)
    finally:
        rows.save()
        _log("wrote", args.out)


def _gluon_rows(path, kind):
    """Table rows (`kind`: True) from a `gluon_attention_masked.py` results file: Triton and Gluon times per phase."""
    rows = []
    for r in json.load(open(path))["rows"]:
        for phase, times in (("prefill", r["fwd"]), ("train", r["fwd_bwd"])):
            if "ms" in times["triton"] and "ms" in times["gluon"]:
                ms = {f"{n}_ms": round(times[n]["ms"], 5) for n in ("triton", "gluon")}
                rows.append(dict(phase=phase, head_dim=r["head_dim"], gqa=r["heads"] > r["kv_heads"],
                                 causal=r["causal"], batch=r["batch"], kv_len=r["seq"], **{kind: True}, **ms))
    return rows


def write_table(path):
    """hf_fastpath/attention/dispatch_smXY.json: per measured call our time and SDPA's, the way fastpath calls them
    (prefill/train: dense SDPA as Transformers calls it; decode: a dense cache of kv_len tokens)."""
    data = json.load(open(path))
    cap = data["meta"]["capability"]
    rows = []
    for r in data["rows"]:
        if r["phase"] not in ("prefill", "train", "decode"):
            continue
        base = dict(head_dim=r["head_dim"], gqa=r["heads"] > r["kv_heads"], causal=r["causal"], batch=r["batch"],
                    kv_len=r["kv_len"])
        timings = [(r["phase"], r["ms"])]
        if r["phase"] == "decode":
            timings.append(("decode_eager", r["ms_eager"]))
        for phase, ms in timings:
            if ms.get("ours") and ms.get("sdpa"):
                row = dict(phase=phase, **base, triton_ms=round(ms["ours"], 5), sdpa_ms=round(ms["sdpa"], 5))
                if ms.get("gluon"):
                    row["gluon_ms"] = round(ms["gluon"], 5)
                rows.append(row)
    meta = {k: data["meta"][k] for k in ("gpu", "torch", "triton", "date")}
    meta["source"] = "benchmarks/results/" + os.path.basename(path)
    here = os.path.dirname(os.path.abspath(path))
    # calls SDPA does not serve, timed for Triton and Gluon: padded / packed batches ("masked" rows), sliding windows
    # and soft-caps ("windowed" rows: Mistral, Gemma-2), ALiBi ("alibi" rows: BLOOM, Falcon-RW, MPT)
    for name, kind in (("gluon_attention_masked.json", "masked"), ("gluon_attention_window.json", "windowed"),
                       ("gluon_attention_window_hd256.json", "windowed"), ("gluon_attention_alibi.json", "alibi")):
        if os.path.exists(os.path.join(here, name)):
            rows += _gluon_rows(os.path.join(here, name), kind)
            meta.setdefault(f"{kind}_sources", []).append("benchmarks/results/" + name)
    if os.path.exists(os.path.join(here, "gluon_attention_varlen.json")):  # queries and keys packed differently
        from gluon_attention_varlen import varlen_rows

        rows += varlen_rows(os.path.join(here, "gluon_attention_varlen.json"))
        meta["varlen_sources"] = ["benchmarks/results/gluon_attention_varlen.json"]
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "hf_fastpath", "attention",
                       f"dispatch_sm{cap[0]}{cap[1]}.json")
    with open(out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=0)
    print(f"wrote {out}: {len(rows)} rows")


def plot(path, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.load(open(path))["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    for ax, phase in zip(axes, ("prefill", "train", "decode")):
        sel = [r for r in rows if r["phase"] == phase]
        labels, ratios, gluon = [], [], []
        for r in sel:
            ours = r["ms"].get("ours_static" if phase == "decode" else "ours")
            peer = r["ms"].get("sdpa_static" if phase == "decode" else "sdpa")
            if ours and peer:
                labels.append(f"d{r['head_dim']} {r['heads']}/{r['kv_heads']} b{r['batch']} {r['kv_len']}"
                              + ("" if phase == "decode" else f" c{int(r['causal'])}"))
                ratios.append(peer / ours)
                gluon.append(peer / r["ms"]["gluon"] if r["ms"].get("gluon") else 0.0)
        y = list(range(len(ratios)))
        height = 0.4 if any(gluon) else 0.8
        ax.barh(y, ratios, height=height, color=["tab:green" if x >= 1 else "tab:red" for x in ratios],
                label="our Triton kernel")
        if any(gluon):
            ax.barh([i + height for i in y], gluon, height=height, color="tab:blue", label="our Gluon forward")
            ax.legend(fontsize=6)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_yticks(y)
        ax.set_yticklabels(labels, fontsize=5)
        ax.set_title(f"{phase}: SDPA time / our time (>1: ours faster)")
    fig.tight_layout()
    fig.savefig(png, dpi=130)
    print("wrote", png)


if __name__ == "__main__":
    main()
