"""The Gluon W4A16 GEMM (`kernels/gluon_w4a16.py`) beside cuBLAS bf16 (x @ W, W dequantized once outside the
timing), the package's `w4a16_matmul` dispatch (`triton_us`: fused split-K Triton up to 192 rows, dequantize +
cuBLAS above, and on Hopper inside CUDA graphs this Gluon kernel for 24-512 rows), the fused Triton kernel forced
at every M (`fused_us`) and dequantize + cuBLAS timed together (`dequant_cublas_us`), in one process: a
correctness check against float64 first, then CUDA-graph times (`triton.testing.do_bench_cudagraph`, median)
for M in 1...4096 on Llama-3 shapes, group 128, bf16. Weight copies cycle past L2 (>= 64 MB per set) so that small
M reads its weights from HBM, as in decoding.

    python benchmarks/gluon_w4a16.py                 # GPU: writes benchmarks/results/gluon_w4a16.json (+ .png)
    python benchmarks/gluon_w4a16.py --quick         # fewer shapes / M (a first look)
    python benchmarks/gluon_w4a16.py --ms 64 128 256 512 --json F.json   # chosen M (crossover sweeps)
    python benchmarks/gluon_w4a16.py --plot F.json   # no GPU needed: F.json -> F.png
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gluon_w4a16.json")
SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]  # (K, N): Llama-3 8B / 70B linears
MS = (1, 16, 64, 256, 1024, 4096)
GROUP = 128
L2_BYTES = 64 << 20


def _log(*a):
    print(*a, file=sys.stderr, flush=True)


def _layer(k, n, dtype, gen):
    from hf_fastpath.kernels.w4a16_layout import w4a16_pack

    codes = torch.randint(0, 16, (k, n), device="cuda", generator=gen)
    g = k // GROUP
    scales = (torch.rand(g, n, device="cuda", generator=gen) * 0.05 + 0.005).to(dtype)
    zeros = torch.randint(0, 16, (g, n), device="cuda", generator=gen).to(dtype)
    return codes, w4a16_pack(codes), scales, zeros


def check(gen):
    """Max error / max |y| against float64, Gluon and the Triton kernel, on a few shapes (odd N included)."""
    from hf_fastpath.kernels.gluon_w4a16 import gluon_w4a16_matmul
    from hf_fastpath.kernels.w4a16 import w4a16_matmul

    out = []
    for k, n in ((4096, 4096), (512, 1001), (14336, 4096)):
        codes, qw, s, z = _layer(k, n, torch.bfloat16, gen)
        w64 = s.double().repeat_interleave(GROUP, 0) * (codes.double() - z.double().repeat_interleave(GROUP, 0))
        for m in (1, 100, 1000):
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            ref = x.double() @ w64
            scale = ref.abs().max().item()
            row = dict(K=k, N=n, M=m)
            plain = functools.partial(gluon_w4a16_matmul, unpack="plain")
            load = functools.partial(gluon_w4a16_matmul, scales_by="load")
            for name, fn in (("gluon", gluon_w4a16_matmul), ("gluon_plain", plain), ("gluon_load", load),
                             ("triton", w4a16_matmul)):
                try:
                    y = fn(x, qw, s, z, GROUP)
                    row[f"{name}_rel_err"] = (y.double() - ref).abs().max().item() / scale
                except Exception as exc:  # noqa: BLE001 - recorded, the timing goes on
                    row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:500]
            out.append(row)
            _log("check", row)
    return out


def _time(fn):
    import triton

    return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3  # us


def _cycle(call, items):
    """A no-argument call that takes the next of `items` each time (graph replays cycle the weight copies)."""
    state = {"i": 0}

    def fn():
        state["i"] = (state["i"] + 1) % len(items)
        return call(items[state["i"]])
    return fn


def bench(shapes, ms, gen, on_row=lambda rows: None):
    """Rows of times for every (K, N) in shapes and M in ms; `on_row(rows)` after each (the caller saves as it
    goes: a run cut short by a timeout keeps what it measured)."""
    from hf_fastpath.kernels.gluon_w4a16 import gluon_w4a16_matmul
    from hf_fastpath.kernels.w4a16 import _decode_matmul, w4a16_dequantize, w4a16_matmul

    def fused(x, qw, s, z):  # our plain-Triton fused kernel at any M (w4a16_matmul runs it up to DECODE_MAX_M)
        return _decode_matmul(x, qw, s, z, GROUP, x.new_empty(x.shape[0], qw.shape[1]))

    rows = []
    for k, n in shapes:
        copies = max(1, -(-L2_BYTES // (k * n // 2)))  # packed-weight sets to cycle past L2
        layers = [_layer(k, n, torch.bfloat16, gen)[1:] for _ in range(copies)]
        dense = [w4a16_dequantize(qw, s, z, GROUP) for qw, s, z in layers[:max(1, -(-L2_BYTES // (k * n * 2)))]]
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            row = dict(K=k, N=n, M=m)
            cases = {
                "cublas_us": _cycle(lambda w, x=x: x @ w, dense),
                "triton_us": _cycle(lambda L, x=x: w4a16_matmul(x, *L, GROUP), layers),
                "fused_us": _cycle(lambda L, x=x: fused(x, *L), layers),
                "dequant_cublas_us": _cycle(lambda L, x=x: x @ w4a16_dequantize(*L, GROUP), layers),
                "gluon_us": _cycle(lambda L, x=x: gluon_w4a16_matmul(x, *L, GROUP), layers),
                "gluon_plain_us": _cycle(lambda L, x=x: gluon_w4a16_matmul(x, *L, GROUP, unpack="plain"), layers),
                "gluon_load_us": _cycle(lambda L, x=x: gluon_w4a16_matmul(x, *L, GROUP, scales_by="load"), layers),
            }
            for key, fn in cases.items():
                try:
                    fn()
                    torch.cuda.synchronize()
                    row[key] = _time(fn)
                except Exception as exc:  # noqa: BLE001 - recorded per case
                    row[key.replace("_us", "_error")] = f"{type(exc).__name__}: {exc}"[:500]
            if "gluon_us" in row and "cublas_us" in row:
                row["gluon_vs_cublas"] = row["cublas_us"] / row["gluon_us"]
            if "gluon_us" in row and "triton_us" in row:
                row["gluon_vs_triton"] = row["triton_us"] / row["gluon_us"]
            if "triton_us" in row and "cublas_us" in row:
                row["triton_vs_cublas"] = row["cublas_us"] / row["triton_us"]
            if "gluon_load_us" in row and "gluon_us" in row:
                row["gluon_vs_gluon_load"] = row["gluon_load_us"] / row["gluon_us"]
            if "gluon_plain_us" in row and "cublas_us" in row:
                row["gluon_plain_vs_cublas"] = row["cublas_us"] / row["gluon_plain_us"]
            row["gluon_tflops"] = 2 * m * k * n / row["gluon_us"] / 1e6 if "gluon_us" in row else None
            rows.append(row)
            on_row(rows)
            _log(row)
        del layers, dense
        torch.cuda.empty_cache()
    return rows


def plot(json_path, png_path=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from w4a16 import speedup_axis  # benchmarks/w4a16.py: the same panels

    png_path = png_path or os.path.splitext(json_path)[0] + ".png"
    with open(json_path) as f:
        res = json.load(f)
    shapes = sorted({(r["K"], r["N"]) for r in res["rows"]}, key=lambda s: s[0] * s[1])
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 4), sharey=True, squeeze=False)
    for ax, (k, n) in zip(axes[0], shapes):
        rows = [r for r in res["rows"] if (r["K"], r["N"]) == (k, n)]
        for key, style, label in (("gluon_vs_cublas", "o-", "Gluon W4A16"),
                                  ("gluon_plain_vs_cublas", "x:", "Gluon W4A16, fp32 unpack"),
                                  ("triton_vs_cublas", "s--", "w4a16_matmul (package dispatch)")):
            pts = [(r["M"], r[key]) for r in rows if r.get(key)]
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        speedup_axis(ax, k, n)
    axes[0][0].set_ylabel("speed-up over cuBLAS bf16 (x)")
    axes[0][0].legend(fontsize=8)
    meta = res.get("meta", {})
    fig.suptitle(f"W4A16 g{meta.get('group_size')}, {meta.get('gpu')}, torch {meta.get('torch')}, "
                 f"triton {meta.get('triton')} (CUDA graphs)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    return png_path


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plot", metavar="JSON", help="make a PNG from a results file (no GPU needed)")
    p.add_argument("--json", default=RESULTS)
    p.add_argument("--quick", action="store_true", help="two shapes, M = 1, 64, 1024")
    p.add_argument("--ms", type=int, nargs="*", help=f"rows of x to time (default {MS})")
    args = p.parse_args()
    if args.plot:
        print(plot(args.plot))
        return
    import triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    res = dict(meta=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                         date=datetime.date.today().isoformat(), group_size=GROUP, dtype="bfloat16",
                         timing="triton.testing.do_bench_cudagraph, median, weights cycled past L2",
                         note="cublas: x @ W with W dequantized to bf16 outside the timing; triton: w4a16_matmul "
                              "(the package's dispatch); fused: our Triton fused kernel forced at every M; "
                              "dequant_cublas: dequantize + cuBLAS timed together; gluon: gluon_w4a16_matmul "
                              "(defaults: PTX pair unpack, scales and zeros by TMA), gluon_plain: its fp32 unpack, gluon_load: "
                              "scales_by='load' (the consumers load them)"))
    res["check"] = check(gen)
    shapes = SHAPES[:2] if args.quick else SHAPES
    ms = args.ms or ((1, 64, 1024) if args.quick else MS)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)

    def save(rows):
        res["rows"] = rows
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)

    save(bench(shapes, ms, gen, save))
    _log("wrote", args.json, "and", plot(args.json))


if __name__ == "__main__":
    main()
