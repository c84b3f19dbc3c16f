"""Ring-attention benchmark on ONE GPU: what a single device can say about the ring's cost.

    python benchmarks/ring_attention.py              # checks, then timings; JSON to benchmarks/results/
    python benchmarks/ring_attention.py --plot FILE  # PNG from a results JSON (no GPU needed)

Cases: causal, bf16, batch 1, 8 heads x head dim 128, 32k-256k tokens; forward+backward.
- `plain`: hf_fastpath.attention.attention (own Triton kernels) on the whole sequence;
- `ring_w1`: hf_fastpath.ring_attention at world size 1 (the ring's code path, no communication);
- `sdpa_cudnn`: torch SDPA with the cuDNN backend (peer);
- `virtual_w2`: the two ranks of a 2-rank zigzag ring, run one after the other in this process with the K/V and
  dK/dV exchange replaced by a local copy (`simulate_rank_schedule`): same kernels, block shapes, fp32 merges and
  copies as on 2 GPUs, no NCCL. Its efficiency = (plain / 2) / slowest rank: how close the blocked schedule comes
  to a perfect 2-way split of the work;
- `merge`: one fp32 merge of a half-sequence partial (`merge_partials`), what each ring step adds.
Timing: median of CUDA-event timings after a warm-up (do_bench's 5-run estimate costs too much at 256k tokens);
inputs are random normal. Peak memory: torch.cuda.max_memory_allocated during one forward+backward (`peak_gb`, which
includes every tensor alive in the process) and the part above what was allocated before the call
(`peak_above_inputs_gb`: the working memory of the attention, gradients included).
NOT run here (one GPU lent): real multi-GPU rings (NCCL P2P overlap), and torch's context_parallel peer at 2 GPUs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

_REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, _REPO)
try:
    import hf_fastpath  # noqa: F401
except Exception as _e:  # a half-finished integration elsewhere must not stop this benchmark
    import types

    print(f"warning: import hf_fastpath failed ({type(_e).__name__}: {_e}); loading subpackages alone", flush=True)
    _pkg = types.ModuleType("hf_fastpath")
    _pkg.__path__ = [os.path.join(_REPO, "hf_fastpath")]
    sys.modules["hf_fastpath"] = _pkg

SEQS = (32768, 65536, 131072, 262144)
HEADS, HEAD_DIM = 8, 128
RESULTS = os.path.join(_REPO, "benchmarks", "results")


def _log(*a):
    print(*a, flush=True)


def flops_fwd_bwd(s, h=HEADS, d=HEAD_DIM):
    return 3.5 * 4 * h * s * s * d / 2  # causal


def median_ms(fn, reps):
    fn()  # warm-up (and compile)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def peak_gb(fn):
    """(peak, peak above what was allocated before) in GiB during one call."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return peak / 2**30, (peak - before) / 2**30


def fwd_bwd(attn, q, k, v, dout):
    def run():
        for t in (q, k, v):
            t.grad = None
        attn(q, k, v).backward(dout)

    return run


def impls():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    from hf_fastpath.attention import attention
    from hf_fastpath.parallel.ring_attention import ring_attention, simulate_rank_schedule

    def sdpa(q, k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o = scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return o.transpose(1, 2)

    return {
        "plain": lambda q, k, v: attention(q, k, v, causal=True),
        "ring_w1": lambda q, k, v: ring_attention(q, k, v, causal=True),
        "sdpa_cudnn": sdpa,
        "virtual_w2_rank0": lambda q, k, v: simulate_rank_schedule(q, k, v, world=2, rank=0),
        "virtual_w2_rank1": lambda q, k, v: simulate_rank_schedule(q, k, v, world=2, rank=1),
    }


def checks():
    """GPU correctness: ring at world 1 vs SDPA; a two-block fp32 merge vs full attention."""
    from torch.nn.functional import scaled_dot_product_attention

    from hf_fastpath.attention import attention_forward
    from hf_fastpath.parallel.ring_attention import merge_partials, ring_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 8192, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    ref = scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)), is_causal=True).transpose(1, 2)
    out = {}
    out["ring_w1_vs_sdpa_fp32_max_err"] = (ring_attention(q, k, v).float() - ref).abs().max().item()
    # non-causal attention to both halves of K, merged, equals attention to all of K
    o1, l1 = attention_forward(q, k[:, :4096], v[:, :4096], causal=False)
    o2, l2 = attention_forward(q, k[:, 4096:], v[:, 4096:], causal=False)
    merged, _ = merge_partials(o1.float(), l1, o2, l2)
    full = scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v))).transpose(1, 2)
    out["two_block_merge_vs_full_max_err"] = (merged - full).abs().max().item()
    out["plain_bf16_vs_full_max_err"] = (attention_forward(q, k, v)[0].float() - full).abs().max().item()
    out["ok"] = out["ring_w1_vs_sdpa_fp32_max_err"] < 0.03 and out["two_block_merge_vs_full_max_err"] < 0.03
    return out


def run(args):
    from hf_fastpath.parallel.ring_attention import merge_partials

    import triton

    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtype": "bfloat16",
        "heads": HEADS,
        "head_dim": HEAD_DIM,
        "causal": True,
    }
    _log(env)
    result = {"env": env, "method": __doc__.split("Timing:")[1].split("NOT run")[0].strip(),
              "not_run": ["real multi-GPU rings (NCCL P2P overlap): one GPU lent",
                          "torch context_parallel (Accelerate's CP) peer at 2 GPUs: one GPU lent"],
              "flops": "fwd+bwd = 3.5 x 4*H*S^2*D / 2 (causal)"}
    t0 = time.time()
    result["checks"] = checks()
    _log("checks", result["checks"])
    fns = impls()
    cases = []
    for s in SEQS:
        if time.time() - t0 > args.budget_s:
            _log(f"skipping {s} tokens: time budget spent")
            result.setdefault("skipped", []).append(s)
            continue
        reps = 5 if s <= 65536 else (3 if s <= 131072 else 2)
        g = torch.Generator(device="cuda").manual_seed(s)
        q, k, v, dout = (torch.randn(1, s, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
                         for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_(True)
        case = {"tokens": s}
        for name, attn in fns.items():
            if name.startswith("virtual"):
                half = s // 2  # each virtual rank holds half of the tokens (its zigzag shard)
                args_ = [t[:, :half].detach().clone().requires_grad_(True) for t in (q, k, v)]
                fn = fwd_bwd(attn, *args_, dout[:, :half])
            else:
                fn = fwd_bwd(attn, q, k, v, dout)
            try:
                ms = median_ms(fn, reps)
                mem, extra = peak_gb(fn)
            except Exception as e:  # e.g. a backend that refuses this size
                case[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                _log(s, name, case[name])
                continue
            case[name] = {"ms": ms, "ns_per_token": ms * 1e6 / s, "peak_gb": mem, "peak_above_inputs_gb": extra}
            if not name.startswith("virtual"):
                case[name]["tflops"] = flops_fwd_bwd(s) / ms / 1e9
            _log(s, name, case[name])
        half = s // 2
        o = torch.randn(1, half, HEADS, HEAD_DIM, device="cuda")
        lse = torch.randn(1, HEADS, half, device="cuda")
        bo = torch.randn(1, half, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        case["merge"] = {"ms": median_ms(lambda: merge_partials(o, lse, bo, lse), 5)}
        p, r = case.get("plain", {}), case.get("ring_w1", {})
        r0, r1, sd = case.get("virtual_w2_rank0", {}), case.get("virtual_w2_rank1", {}), case.get("sdpa_cudnn", {})
        if "ms" in p and "ms" in r:
            case["ring_w1_over_plain_time"] = r["ms"] / p["ms"]
            case["ring_w1_over_plain_memory"] = r["peak_gb"] / p["peak_gb"]
        if "ms" in p and "ms" in sd:
            case["plain_speedup_vs_sdpa_cudnn"] = sd["ms"] / p["ms"]
        if "ms" in p and "ms" in r0 and "ms" in r1:
            slowest = max(r0["ms"], r1["ms"])
            case["virtual_w2_efficiency"] = (p["ms"] / 2) / slowest
            case["virtual_w2_rank_balance"] = min(r0["ms"], r1["ms"]) / slowest
            case["merge_share_of_rank_time"] = case["merge"]["ms"] / slowest
        _log(s, {k: v for k, v in case.items() if not isinstance(v, dict)})
        cases.append(case)
        del q, k, v, dout
        torch.cuda.empty_cache()
    result["cases"] = cases
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "ring_attention.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    _log("wrote", path)
    _table(result)
    return result


def _table(result):
    _log(f"{'tokens':>8} {'plain ms':>9} {'ring_w1':>8} {'sdpa':>8} {'w2 r0':>8} {'w2 r1':>8} {'eff':>5} "
         f"{'merge ms':>8} {'mem plain/ring GB':>18}")
    for c in result["cases"]:
        ms = lambda n: c.get(n, {}).get("ms", float("nan"))  # noqa: E731
        gb = lambda n: c.get(n, {}).get("peak_gb", float("nan"))  # noqa: E731
        _log(f"{c['tokens']:>8} {ms('plain'):>9.1f} {ms('ring_w1'):>8.1f} {ms('sdpa_cudnn'):>8.1f} "
             f"{ms('virtual_w2_rank0'):>8.1f} {ms('virtual_w2_rank1'):>8.1f} "
             f"{c.get('virtual_w2_efficiency', float('nan')):>5.2f} {c['merge']['ms']:>8.3f} "
             f"{gb('plain'):>8.2f}/{gb('ring_w1'):<8.2f}")


def plot(path, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.load(open(path))
    cases = result["cases"]
    toks = [c["tokens"] // 1024 for c in cases]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    names = {"plain": "hf_fastpath attention", "ring_w1": "ring_attention, world 1", "sdpa_cudnn": "SDPA cuDNN"}
    for n, label in names.items():
        a1.plot(toks, [c.get(n, {}).get("ns_per_token", float("nan")) for c in cases], marker="o", label=label)
    a1.plot(toks, [max(c["virtual_w2_rank0"]["ms"], c["virtual_w2_rank1"]["ms"]) * 1e6 / c["tokens"]
                   for c in cases], marker="s", linestyle="--", label="2-rank ring, slowest rank (simulated)")
    a1.set_xscale("log", base=2)
    a1.set_xlabel("sequence length (k tokens)")
    a1.set_ylabel("fwd+bwd ns per token (whole sequence)")
    a1.set_title(f"Causal fwd+bwd, {result['env']['heads']}x{result['env']['head_dim']}, bf16, {result['env']['gpu']}")
    a1.legend(fontsize=8)
    for n, label in names.items():
        a2.plot(toks, [c.get(n, {}).get("peak_gb", float("nan")) for c in cases], marker="o", label=label)
    a2.set_xscale("log", base=2)
    a2.set_xlabel("sequence length (k tokens)")
    a2.set_ylabel("peak memory (GiB)")
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print("wrote", png)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plot", default=None, help="make the PNG from this results JSON and exit")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or RESULTS)
    p.add_argument("--budget-s", type=float, default=80.0, help="skip larger cases after this many seconds")
    args = p.parse_args()
    if args.plot:
        plot(args.plot, os.path.splitext(args.plot)[0] + ".png")
        return
    if not torch.cuda.is_available():
        sys.exit("This benchmark needs a CUDA GPU (see --plot to draw an existing result).")
    run(args)


if __name__ == "__main__":
    main()
