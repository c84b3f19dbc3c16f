"""Varlen attention with queries and keys packed differently on Hopper (chunked prefill: each sequence's new chunk of
queries after its cached keys, causal bottom-right; and a non-causal cross-attention row): the Gluon kernels
(`gluon_attention_forward` / `_backward` with `cu_seqlens_q` != `cu_seqlens_k`, masks from `varlen_spans`) beside
our plain-Triton varlen kernels, flex_attention (compiled, a BlockMask of the same documents; hd128 rows: its
compiles are slow) and FlashAttention-2's `flash_attn_varlen_func` where installed. Forward and forward + backward,
median of `triton.testing.do_bench`, after a check of each against float64 on a small case. FLOPs count the visible
(query, key) pairs: 4 * H * D * pairs forward, 3.5x that forward + backward.

    python benchmarks/gluon_attention_varlen.py           # GPU: writes benchmarks/results/gluon_attention_varlen.json
    python benchmarks/gluon_attention_varlen.py --plot F  # no GPU needed: PNG beside the JSON F
    python benchmarks/gluon_attention_varlen.py --write-table hf_fastpath/attention/dispatch_sm90.json  # its rows
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

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gluon_attention_varlen.json")
HEADS = {64: (32, 32), 128: (32, 8)}  # (query heads, kv heads): GPT-2-like MHA, Llama-3-8B


def _log(*a):
    print(*a, file=sys.stderr, flush=True)


def cases():
    """(name, [(queries, keys) per sequence], causal): chunks of 1k / 2k queries after 3k / 14k cached keys, mixed
    chunks and prefixes, short chunks at and below the Gluon backend's GLUON_VARLEN_MIN_QUERIES (64), and a
    non-causal cross-attention batch."""
    g = torch.Generator().manual_seed(0)
    mixed = []
    for _ in range(8):
        lq = int(torch.randint(256, 2049, (1,), generator=g))
        mixed.append((lq, lq + int(torch.randint(0, 6145, (1,), generator=g))))
    yield "chunk1k_ctx4k", [(1024, 4096)] * 8, True
    yield "chunk2k_ctx16k", [(2048, 16384)] * 2, True
    yield "mixed", mixed, True
    yield "chunk128_ctx2k", [(128, 2048)] * 32, True
    yield "chunk64_ctx2k", [(64, 2048)] * 32, True
    yield "cross512_2k", [(512, 2048)] * 8, False


def _cu(lengths):
    return torch.tensor([0] + list(lengths), device="cuda").cumsum(0).to(torch.int32)


def _pairs(seqs, causal):
    if not causal:
        return sum(lq * lk for lq, lk in seqs)
    # query i of lq sees min(lk, i + 1 + lk - lq) keys (none while that is <= 0)
    return sum(sum(max(0, min(lk, i + 1 + lk - lq)) for i in range(lq)) for lq, lk in seqs)


def implementations(flex: bool):
    from hf_fastpath.kernels.flash_attention import flash_attention_backward, flash_attention_forward
    from hf_fastpath.kernels.gluon_attention import gluon_attention_forward
    from hf_fastpath.kernels.gluon_attention_bwd import gluon_attention_backward

    def ours(fwd, bwd):
        def run(q, k, v, kw, backward, do, extra):
            out, lse = fwd(q, k, v, **kw)[:2]
            if backward:
                bwd(do, q, k, v, out, lse, **kw)
            return out
        return run

    impls = {"gluon": ours(gluon_attention_forward, gluon_attention_backward),
             "triton": ours(flash_attention_forward, flash_attention_backward)}
    try:
        from flash_attn import flash_attn_varlen_func

        def fa2(q, k, v, kw, backward, do, extra):
            x = [t.detach().requires_grad_() for t in (q, k, v)] if backward else (q, k, v)
            out = flash_attn_varlen_func(*x, kw["cu_seqlens_q"], kw["cu_seqlens_k"], extra["max_q"], extra["max_k"],
                                         causal=kw["causal"])
            if backward:
                out.backward(do)
            return out
        impls["fa2"] = fa2
    except ImportError:
        pass
    if flex:
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.cache_size_limit = 64  # one compile per row's shapes
        compiled = torch.compile(flex_attention)

        def flex_run(q, k, v, kw, backward, do, extra):
            if extra.get("block_mask") is None:
                raise RuntimeError("no flex block mask for this row (hd128 rows only)")
            x = [t.detach().requires_grad_() for t in (q, k, v)] if backward else (q, k, v)
            qh, kh, vh = (t.transpose(0, 1)[None] for t in x)
            out = compiled(qh, kh, vh, block_mask=extra["block_mask"], enable_gqa=True)[0].transpose(0, 1)
            if backward:
                out.backward(do)
            return out
        impls["flex"] = flex_run
    return impls


def flex_block_mask(seqs, causal):
    """flex_attention's BlockMask for the packed documents: same document, and causal bottom-right within it."""
    from torch.nn.attention.flex_attention import create_block_mask

    q_doc = torch.cat([torch.full((lq,), i) for i, (lq, _) in enumerate(seqs)]).cuda()
    k_doc = torch.cat([torch.full((lk,), i) for i, (_, lk) in enumerate(seqs)]).cuda()
    cu_q, cu_k = _cu([s[0] for s in seqs]).long(), _cu([s[1] for s in seqs]).long()
    # the key aligned with each query: r + k_end - q_end of its document
    q_diag = torch.arange(q_doc.numel(), device="cuda") + cu_k[q_doc + 1] - cu_q[q_doc + 1]

    def mask_mod(b, h, q_idx, kv_idx):
        same = q_doc[q_idx] == k_doc[kv_idx]
        return same & (kv_idx <= q_diag[q_idx]) if causal else same

    return create_block_mask(mask_mod, None, None, q_doc.numel(), k_doc.numel(), device="cuda")


def check(impls):
    """Forward of each implementation against float64 on a small odd case (relative error)."""
    from hf_fastpath.attention import reference

    errors = {}
    seqs = [(100, 333), (0, 20), (77, 77), (300, 50), (1, 129)]
    hq, hkv = HEADS[128]
    for causal in (True, False):
        q = torch.randn(sum(s[0] for s in seqs), hq, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(sum(s[1] for s in seqs), hkv, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        kw = dict(causal=causal, cu_seqlens_q=_cu([s[0] for s in seqs]), cu_seqlens_k=_cu([s[1] for s in seqs]))
        extra = dict(max_q=300, max_k=333, block_mask=flex_block_mask(seqs, causal) if "flex" in impls else None)
        ref = reference.attention_forward(q.double(), k.double(), v.double(), **kw)[0]
        for name, fn in impls.items():
            try:
                out = fn(q, k, v, kw, False, None, extra).double()
            except Exception as exc:  # noqa: BLE001 - recorded
                errors[f"{name} {'causal' if causal else 'full'}"] = f"{type(exc).__name__}: {exc}"[:200]
                continue
            seen = ref.abs().sum(-1) > 0  # rows that see a key (others: 0 for ours, NaN or 0 for peers)
            errors[f"{name} {'causal' if causal else 'full'}"] = \
                ((out - ref)[seen].norm() / ref[seen].norm()).item()
    _log("relative error vs float64:", errors)
    return errors


def bench(impls, head_dims, save):
    from gluon_attention import _timed  # benchmarks/gluon_attention.py: {ms, tflops} by do_bench, or {error}

    rows = []
    for d in head_dims:
        hq, hkv = HEADS[d]
        for name, seqs, causal in cases():
            total_q, total_k = sum(s[0] for s in seqs), sum(s[1] for s in seqs)
            q = torch.randn(total_q, hq, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(total_k, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
            do = torch.randn_like(q)
            kw = dict(causal=causal, cu_seqlens_q=_cu([s[0] for s in seqs]), cu_seqlens_k=_cu([s[1] for s in seqs]))
            extra = dict(max_q=max(s[0] for s in seqs), max_k=max(s[1] for s in seqs), block_mask=None)
            if "flex" in impls and d == 128:
                extra["block_mask"] = flex_block_mask(seqs, causal)
            fl = 4 * hq * d * _pairs(seqs, causal)
            row = dict(case=name, head_dim=d, heads=hq, kv_heads=hkv, sequences=len(seqs), queries=total_q,
                       keys=total_k, max_keys=extra["max_k"], causal=causal)
            for phase, backward, mult in (("fwd", False, 1.0), ("fwd_bwd", True, 3.5)):
                row[phase] = {n: _timed(lambda fn=fn: fn(q, k, v, kw, backward, do, extra), fl * mult)
                              for n, fn in impls.items()}
                t = {n: x.get("ms") for n, x in row[phase].items()}
                for peer in impls:
                    if peer != "gluon" and t["gluon"] and t[peer]:
                        row[phase][f"gluon_vs_{peer}"] = t[peer] / t["gluon"]
            rows.append(row)
            save(rows)  # as it goes: a run cut short keeps its rows
            _log(f"{name} hd{d}: " + "  ".join(
                f"{ph} " + " ".join(f"{n} {row[ph][n].get('ms', float('nan')):.3f}" for n in impls)
                + f" (gluon x triton {row[ph].get('gluon_vs_triton', float('nan')):.2f})" for ph in ("fwd", "fwd_bwd")))
    return rows


def varlen_rows(path):
    """The `varlen` rows of the dispatch table (`attention/dispatch.py`) from a results JSON: per row and phase the
    Gluon and Triton medians, keyed as `fastpath` looks calls up (batch: sequences, kv_len: the longest sequence's
    keys). Rows whose chunks average fewer queries than GLUON_VARLEN_MIN_QUERIES never reach the table (the Gluon
    backend leaves them to Triton) and are left out."""
    from hf_fastpath.attention.backends import GLUON_VARLEN_MIN_QUERIES

    rows = []
    for r in json.load(open(path))["rows"]:
        if r["queries"] < GLUON_VARLEN_MIN_QUERIES * r["sequences"]:
            continue
        for phase, key in (("prefill", "fwd"), ("train", "fwd_bwd")):
            t = {n: r[key].get(n, {}).get("ms") for n in ("gluon", "triton")}
            if None not in t.values():
                rows.append(dict(phase=phase, head_dim=r["head_dim"], gqa=r["heads"] > r["kv_heads"],
                                 causal=r["causal"], batch=r["sequences"], kv_len=r["max_keys"], varlen=True,
                                 triton_ms=round(t["triton"], 5), gluon_ms=round(t["gluon"], 5)))
    return rows


def write_table(path, table):
    """Replace the dispatch table's `varlen` rows by `varlen_rows(path)` (`attention_dispatch.py`, which rewrites
    the whole table, takes them from the same file)."""
    rows = varlen_rows(path)
    old = json.load(open(table))
    old["rows"] = [r for r in old["rows"] if not r.get("varlen")] + rows
    old["meta"]["varlen_sources"] = [os.path.relpath(path, os.path.join(os.path.dirname(table), "..", ".."))]
    with open(table, "w") as f:
        json.dump(old, f, indent=0)  # the table's own formatting (attention_dispatch.py)
    _log(f"{len(rows)} varlen rows -> {table}")


def plot(path, png):
    from gluon_attention_masked import plot_phases

    data = json.load(open(path))
    names = [n for n in ("gluon", "triton", "fa2", "flex") if any(n in r["fwd"] for r in data["rows"])]
    colors = dict(gluon="tab:red", triton="tab:orange", fa2="tab:purple", flex="tab:green")
    plot_phases(data, png, names, colors,
                lambda r: f"{r['case']} hd{r['head_dim']} {'causal' if r['causal'] else 'full'}",
                "Varlen attention, queries and keys packed differently")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=RESULTS)
    ap.add_argument("--plot", metavar="PNG", help="draw the JSON (--json) to this PNG; without a GPU, only that")
    ap.add_argument("--head-dims", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--no-flex", action="store_true", help="skip flex_attention (its compiles take minutes)")
    ap.add_argument("--write-table", metavar="TABLE", help="no GPU needed: put the JSON's rows into this dispatch "
                    "table (hf_fastpath/attention/dispatch_sm90.json) as its `varlen` rows")
    args = ap.parse_args()
    if args.write_table:
        write_table(args.json, args.write_table)
        return
    if args.plot and not torch.cuda.is_available():
        plot(args.json, args.plot)
        return
    import triton

    t0 = time.time()
    impls = implementations(flex=not args.no_flex)
    errors = check(impls)

    def save(rows):
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    date=datetime.date.today().isoformat(), dtype="bf16", seconds=round(time.time() - t0, 1),
                    timing="triton.testing.do_bench median, warmup 10, rep 50")
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rel_error_vs_fp64=errors, rows=rows), f, indent=1)

    bench(impls, args.head_dims, save)
    if args.plot:
        plot(args.json, args.plot)


if __name__ == "__main__":
    main()
