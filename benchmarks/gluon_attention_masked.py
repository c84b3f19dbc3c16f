"""Padded, packed, sliding-window, soft-capped and ALiBi attention on Hopper: the Gluon kernels
(`gluon_attention_forward` / `_backward` with `key_mask`, `segments`, `window_size`, `softcap` or `alibi_slopes`) beside
our plain-Triton kernels on the same calls, SDPA with the boolean mask Transformers' "sdpa" builds for such batches
(ALiBi: the float bias BLOOM / Falcon build; torch picks the kernel: efficient attention; it has no soft-cap, so
those rows time it without one), and cuDNN on the same tokens without any mask
(what an unpadded, unpacked, unwindowed batch would cost: a bound, not a peer). Forward and forward + backward,
median of `triton.testing.do_bench`, after a check of each against float64 on a small case. FLOPs count the visible
(query, key) pairs: 4 * H * D * pairs forward, 2.5x that backward.

    python benchmarks/gluon_attention_masked.py           # GPU: writes benchmarks/results/gluon_attention_masked.json
    python benchmarks/gluon_attention_masked.py --kinds window softcap \
        --json benchmarks/results/gluon_attention_window.json    # the sliding-window / soft-cap rows
    python benchmarks/gluon_attention_masked.py --kinds alibi --json benchmarks/results/gluon_attention_alibi.json
    python benchmarks/gluon_attention_masked.py --plot F     # no GPU needed: PNG beside the JSON F
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

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gluon_attention_masked.json")
HEADS = {64: (32, 32), 96: (32, 32), 128: (32, 8), 256: (16, 8)}  # (query heads, kv heads): GPT-2-like MHA,
# GPT-NeoX-20B-like (head dim 96, padded to 128 by the Gluon kernels), Llama-3-8B, Gemma-2-9B
TOKENS = 16384
KINDS = ("packed", "padded", "window", "softcap", "alibi")
WINDOW = 4095  # keys before the query: Mistral's and Gemma-2's sliding window of 4096
SOFTCAP = 50.0  # Gemma-2's attention soft-cap


def _log(*a):
    print(*a, file=sys.stderr, flush=True)


def cases(kinds=KINDS):
    """(kind, batch, seq, mean document length, causal): packed rows of documents averaging `mean` tokens (causal, as
    packed training runs), padded batches with random lengths from half to all of `seq` (causal and not), causal
    sliding windows of 4096 keys from 8k tokens (with and without Gemma-2's soft-cap), and soft-capped causal
    attention, and ALiBi (causal as BLOOM / Falcon-RW / MPT train, and not)."""
    if "packed" in kinds:
        for s, mean in ((4096, 512), (8192, 2048)):
            yield "packed", TOKENS // s, s, mean, True
    if "padded" in kinds:
        for s in (1024, 4096):
            for causal in (True, False):
                yield "padded", TOKENS // s, s, None, causal
    if "window" in kinds:
        for s in (8192, 16384):
            yield "window", TOKENS // s, s, None, True
        yield "window_softcap", TOKENS // 8192, 8192, None, True
    if "softcap" in kinds:
        for s in (1024, 4096):
            yield "softcap", TOKENS // s, s, None, True
    if "alibi" in kinds:
        for s in (1024, 4096):
            for causal in (True, False):
                yield "alibi", TOKENS // s, s, None, causal


def alibi_slopes(heads):
    """ALiBi's slopes 2^(-8 i / heads), i = 1..heads."""
    return 2.0 ** (-8.0 * torch.arange(1, heads + 1, device="cuda") / heads)


def masks(kind, b, s, mean, seed=0, heads=1, causal=True):
    """(kwargs for our kernels, the [B, 1, S, S] boolean mask for SDPA (ALiBi: the [1, heads, S, S] bf16 bias, the
    causal mask folded in), visible (query, key) pairs before causality as [B, S or 1, S])."""
    from hf_fastpath.kernels.flash_attention import segment_table

    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(s)
    if kind == "alibi":
        slopes = alibi_slopes(heads)
        p = pos.cuda()
        bias = -slopes[:, None, None] * (p[:, None] - p[None, :]).abs()
        if causal:
            bias = bias.masked_fill(p[None, :] > p[:, None], float("-inf"))
        band = torch.ones(s, s, dtype=torch.bool, device="cuda")
        return dict(alibi_slopes=slopes), bias[None].to(torch.bfloat16), band[None].expand(b, s, s)
    if kind in ("window", "window_softcap", "softcap"):
        kw = dict(softcap=SOFTCAP) if kind.endswith("softcap") else {}
        if kind.startswith("window"):
            kw["window_size"] = (WINDOW, -1)
            p = pos.cuda()
            band = (p[:, None] - p[None, :]) <= WINDOW  # with causality (`_sdpa_mask`, `_pairs`): the window
        else:
            band = torch.ones(s, s, dtype=torch.bool, device="cuda")
        return kw, band[None, None].expand(b, 1, s, s), band[None].expand(b, s, s)
    if kind == "packed":
        ids = []
        for _ in range(b):  # document lengths: exponential around `mean`, at least 1 token
            lengths = (-torch.log(torch.rand(4 * s // mean + 8, generator=g)) * mean).long().clamp_min(1)
            ids.append(torch.repeat_interleave(torch.arange(len(lengths)), lengths)[:s])
        ids = torch.stack(ids).cuda()
        same = ids[:, :, None] == ids[:, None, :]
        return dict(segments=segment_table(ids)), same[:, None], same
    lengths = torch.randint(s // 2, s + 1, (b,), generator=g)
    keep = (pos[None] < lengths[:, None]).cuda()
    return dict(key_mask=keep.to(torch.int64)), keep[:, None, None, :].expand(b, 1, s, s), keep[:, None, :]


def _sdpa_mask(mask, causal):
    if mask.dtype != torch.bool:  # a float bias (ALiBi) comes with causality folded in
        return mask
    s = mask.shape[-1]
    return mask & torch.ones(s, s, dtype=torch.bool, device=mask.device).tril() if causal else mask


def _pairs(visible, causal):
    s = visible.shape[-1]
    if causal:
        visible = visible & torch.ones(s, s, dtype=torch.bool, device=visible.device).tril()
    return int(visible.expand(-1, s, s).sum())


def implementations():
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hf_fastpath.kernels.flash_attention import flash_attention_backward, flash_attention_forward
    from hf_fastpath.kernels.gluon_attention import gluon_attention_forward
    from hf_fastpath.kernels.gluon_attention_bwd import gluon_attention_backward

    def ours(fwd, bwd):
        def run(q, k, v, causal, kw, sdpa_mask, backward, do):
            out, lse = fwd(q, k, v, causal=causal, **kw)[:2]
            if backward:
                bwd(do, q, k, v, out, lse, causal=causal, **kw)
            return out
        return run

    def sdpa(q, k, v, causal, kw, sdpa_mask, backward, do):
        # as Transformers' sdpa path runs a masked batch: K/V repeated, one boolean mask (built once per forward,
        # causality folded in: `_sdpa_mask`)
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        rep = qh.shape[1] // kh.shape[1]
        kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
        if backward:
            qh, kh, vh = (t.detach().requires_grad_() for t in (qh, kh, vh))
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=sdpa_mask).transpose(1, 2)
        if backward:
            out.backward(do)
        return out

    def cudnn_dense(q, k, v, causal, kw, sdpa_mask, backward, do):
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        if backward:
            qh, kh, vh = (t.detach().requires_grad_() for t in (qh, kh, vh))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=True).transpose(1, 2)
        if backward:
            out.backward(do)
        return out

    return {"gluon": ours(gluon_attention_forward, gluon_attention_backward),
            "triton": ours(flash_attention_forward, flash_attention_backward),
            "sdpa_masked": sdpa, "cudnn_no_mask": cudnn_dense}


def check(impls):
    """Forward of each masked implementation against float64 on a small odd case (relative error)."""
    from hf_fastpath.attention import reference

    errors = {}
    for kind, causal in (("packed", True), ("padded", True), ("padded", False), ("window", True),
                         ("window_softcap", True), ("alibi", True), ("alibi", False)):
        b, s, (hq, hkv), d = 2, 777, HEADS[128], 128
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv))
        kw, sdpa_mask, _ = masks(kind, b, s, 100, heads=hq, causal=causal)
        if "window_size" in kw:
            kw["window_size"] = (300, -1)  # inside the 777 tokens
            p = torch.arange(s, device="cuda")
            sdpa_mask = ((p[:, None] - p[None, :]) <= 300)[None, None].expand(b, 1, s, s)
        sdpa_mask = _sdpa_mask(sdpa_mask, causal)
        ref = reference.attention_forward(q.double(), k.double(), v.double(), causal=causal, **kw)[0]
        for name in ("gluon", "triton") + (() if "softcap" in kw else ("sdpa_masked", )):
            out = impls[name](q, k, v, causal, kw, sdpa_mask, False, None).double()
            # rows that see no key: ours give 0, SDPA NaN; compare the rest
            ok = ~torch.isnan(out)
            errors[f"{name} {kind} {'causal' if causal else 'full'}"] = \
                ((out - ref)[ok].norm() / ref[ok].norm()).item()
    _log("relative error vs float64:", errors)
    return errors


def bench(impls, head_dims, kinds=KINDS):
    from gluon_attention import _timed  # benchmarks/gluon_attention.py: {ms, tflops} by do_bench, or {error}

    rows = []
    for d in head_dims:
        hq, hkv = HEADS[d]
        for kind, b, s, mean, causal in cases(kinds):
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv))
            do = torch.randn_like(q)
            kw, sdpa_mask, visible = masks(kind, b, s, mean, heads=hq, causal=causal)
            sdpa_mask = _sdpa_mask(sdpa_mask, causal)
            fl = 4 * hq * d * _pairs(visible, causal)
            row = dict(kind=kind, head_dim=d, heads=hq, kv_heads=hkv, batch=b, seq=s, mean_doc=mean, causal=causal)
            for phase, backward, mult in (("fwd", False, 1.0), ("fwd_bwd", True, 3.5)):
                row[phase] = {name: _timed(lambda fn=fn: fn(q, k, v, causal, kw, sdpa_mask, backward, do), fl * mult)
                              for name, fn in impls.items()}
                t = {n: x.get("ms") for n, x in row[phase].items()}
                for peer in ("triton", "sdpa_masked", "cudnn_no_mask"):
                    if t["gluon"] and t[peer]:
                        row[phase][f"gluon_vs_{peer}"] = t[peer] / t["gluon"]
            rows.append(row)
            _log(f"{kind} hd{d} b{b} s{s} {'causal' if causal else 'full'}: "
                 + "  ".join(f"{ph} " + " ".join(f"{n} {row[ph][n].get('ms', float('nan')):.3f}" for n in impls)
                             + f" (gluon x triton {row[ph].get('gluon_vs_triton', float('nan')):.2f})"
                             for ph in ("fwd", "fwd_bwd")))
    return rows


def plot_phases(data, png, names, colors, label, title):
    """Forward and forward + backward TFLOP/s side by side, a bar per implementation in `names` (colors: name ->
    color) and row (`label(row)` names it), each Gluon bar annotated with its ratio to Triton; shared by the
    masked and varlen benchmarks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.5 * len(rows) + 2))
    for ax, phase in zip(axes, ("fwd", "fwd_bwd")):
        h = 0.8 / len(names)
        for i, n in enumerate(names):
            vals = [r[phase].get(n, {}).get("tflops", 0.0) for r in rows]
            ax.barh([y + i * h for y in range(len(rows))], vals, height=h, color=colors[n], label=n)
        for y, r in enumerate(rows):
            if "gluon_vs_triton" in r[phase]:
                ax.annotate(f"{r[phase]['gluon_vs_triton']:.2f}x triton", (r[phase]["gluon"]["tflops"], y),
                            fontsize=6, xytext=(3, -3), textcoords="offset points")
        ax.set_yticks([y + 0.4 - h / 2 for y in range(len(rows))])
        ax.set_yticklabels([label(r) for r in rows], fontsize=7)
        ax.set_xlabel("TFLOP/s of visible (query, key) pairs")
        ax.set_title(phase.replace("_", " + "))
        ax.legend(fontsize=7)
        ax.grid(axis="x", alpha=0.3)
    meta = data["meta"]
    fig.suptitle(f"{title}, {meta['gpu']}, bf16, torch {meta['torch']}, triton {meta['triton']}")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(png, dpi=90)


def plot(path, png):
    names = ("gluon", "triton", "sdpa_masked", "cudnn_no_mask")
    colors = dict(zip(names, ("tab:red", "tab:orange", "tab:green", "tab:blue")))

    def label(r):
        return f"{r['kind']} hd{r['head_dim']} b{r['batch']}x{r['seq']} {'causal' if r['causal'] else 'full'}"

    plot_phases(json.load(open(path)), png, names, colors, label,
                "Padded / packed / windowed / soft-capped / ALiBi attention")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=RESULTS)
    ap.add_argument("--plot", metavar="PNG", help="draw the JSON (--json) to this PNG; without a GPU, only that")
    ap.add_argument("--head-dims", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--kinds", nargs="*", default=["packed", "padded"], choices=KINDS)
    args = ap.parse_args()
    if args.plot and not torch.cuda.is_available():
        plot(args.json, args.plot)
        return
    import triton

    t0 = time.time()
    impls = implementations()
    errors = check(impls)
    rows = bench(impls, args.head_dims, args.kinds)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat(), dtype="bf16", tokens_per_batch=TOKENS,
                seconds=round(time.time() - t0, 1), timing="triton.testing.do_bench median, warmup 10, rep 50")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(meta=meta, rel_error_vs_fp64=errors, rows=rows), f, indent=1)
    if args.plot:
        plot(args.json, args.plot)


if __name__ == "__main__":
    main()
