"""W4A16 benchmark: hf_fastpath's 4-bit kernels against cuBLAS bf16, torch's int4 tinygemm and GemLite (a
pure-Triton low-bit GEMM library; timed when importable), same process.

  python benchmarks/w4a16.py                 # correctness check, then timings -> benchmarks/results/w4a16.json
  python benchmarks/w4a16.py --sweep         # launch-config sweep used to pick the kernel heuristics
  python benchmarks/w4a16.py --plot FILE     # render the PNG from a result JSON (no GPU needed)

Timing: every call is captured in a CUDA graph (no launch overhead), cycling through enough copies of the weights
that they do not fit in L2 (50 MB on an H200), so the figures are what a decode step sees. Median of 7 replays.
At M = 1 also eager back-to-back calls (`ours_eager_us`, `cublas_bf16_eager_us`): host time per call included.
Shapes: Llama-3 8B / 70B linears, group size 128, bf16 activations, random asymmetric 4-bit weights.
GemLite on a machine without internet: `pip download gemlite --no-deps` here, unpack the sdist into a folder that
travels with the tree and put it on PYTHONPATH there (it needs numpy and tqdm); on an H200 its H100 configs are loaded
(it picks none for an H200 name, and would autotune inside the timing's warm-up instead).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]  # (K, N) = (in_features, out_features)
MS = [1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096]
GROUP = 128
L2_BYTES = 50 * 2**20


def load_kernels():
    from hf_fastpath.kernels import w4a16

    return w4a16


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Weights and references (plain torch, independent of the kernels)
# ---------------------------------------------------------------------------------------------------------------


def make_weights(k, n, group, dtype, device, gen):
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), device=device, dtype=torch.int32, generator=gen)
    g = k // group
    scales = (torch.rand(g, n, device=device, generator=gen) * 0.02 + 0.002).to(dtype)
    zeros = torch.randint(0, 16, (g, n), device=device, generator=gen).to(dtype)
    return qweight, scales, zeros


def unpack_reference(qweight, scales, zeros, group):
    """W [K, N] in float32 from the kernels' packed layout (their own unpacker, tested against an independent
    packer in tests/test_w4a16_kernels.py)."""
    q = load_kernels().w4a16_unpack(qweight).float()
    s = scales.float().repeat_interleave(group, 0)
    z = zeros.float().repeat_interleave(group, 0)
    return (q - z) * s


def tinygemm_pack(w_kn_f32, group):
    """torch's int4 tinygemm operands for the same W: uint8 [N, K/2] (even k in the high nibble), and
    scale/zero [K/group, N, 2] with W = (q - 8) * scale + zero."""
    k, n = w_kn_f32.shape
    wt = w_kn_f32.t().reshape(n, k // group, group)
    lo = wt.amin(-1, keepdim=True)
    hi = wt.amax(-1, keepdim=True)
    scale = ((hi - lo).clamp(min=1e-6) / 15)
    q = ((wt - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + scale * 8
    packed_u8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8.contiguous(), 8)
    sz = torch.cat([scale.reshape(n, -1, 1), zero.reshape(n, -1, 1)], 2).transpose(0, 1).contiguous()
    w_tg = ((q.reshape(n, k // group, group).float() - 8) * scale + zero).reshape(n, k).t()
    return packed, sz.to(torch.bfloat16), w_tg


# ---------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------


def time_graph(fns, target_ms=3.0, replays=7):
    """Median time (µs) per call of fns[i % len(fns)]() captured back-to-back in one CUDA graph."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for f in fns:
        f()
    torch.cuda.synchronize()
    est_ms = max((time.perf_counter() - t0) * 1e3 / len(fns), 1e-3)
    calls = max(len(fns), min(2000, int(target_ms / est_ms)))
    calls = math.ceil(calls / len(fns)) * len(fns)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    del graph
    return statistics.median(times)


def time_eager(fns, calls=400):
    """µs per call of back-to-back eager calls (no CUDA graph): what an eager decode step pays, host time included."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(calls):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def copy_bandwidth():
    src = torch.randn(2**28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    us = time_graph([lambda: dst.copy_(src)], target_ms=20)
    return 2 * src.numel() * 4 / (us * 1e-6) / 1e9


# ---------------------------------------------------------------------------------------------------------------
# Benchmark
# ---------------------------------------------------------------------------------------------------------------


class Layer:
    """Enough copies of one layer's weights (ours, bf16, tinygemm) to defeat L2 when cycled."""

    def __init__(self, k, n, gen, with_peers=True):
        self.k, self.n = k, n
        int4_bytes = k * n // 2
        self.copies = max(2, math.ceil(3 * L2_BYTES / int4_bytes))
        self.quant, self.w_bf16, self.tiny = [], [], []
        for i in range(self.copies):
            qw, s, z = make_weights(k, n, GROUP, torch.bfloat16, "cuda", gen)
            self.quant.append((qw, s, z))
            if with_peers:
                w = unpack_reference(qw, s, z, GROUP)
                self.w_bf16.append(w.t().contiguous().to(torch.bfloat16))  # nn.Linear layout [N, K]
                if i == 0:
                    packed, sz, w_tg = tinygemm_pack(w, GROUP)
                    self.tiny_ref = w_tg
                else:
                    packed, sz = torch.ops.aten._convert_weight_to_int4pack(
                        torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8, generator=gen), 8), sz
                self.tiny.append((packed, sz))
                del w

    def bytes_int4(self, m):
        return self.k * self.n // 2 + 2 * (self.k // GROUP) * self.n * 2 + m * (self.k + self.n) * 2


def gemlite_layers(K, quant, k, n):
    """GemLite A16W4 layers holding the same weights as `quant` (HQQ order, W = (q - z) * s), or None when gemlite
    is not importable. GemLite packs [N, K] codes, scales and zeros [N, K / group]."""
    try:
        import gemlite
    except Exception as exc:  # noqa: BLE001 - not installed, or not importable with this torch / Triton
        log(f"GemLite not timed: {exc!r}"[:300])
        return None
    if "H200" in torch.cuda.get_device_name() and not getattr(gemlite_layers, "configured", False):
        gemlite.GemLiteLinear.load_config(os.path.join(os.path.dirname(gemlite.__file__), "configs", "h100.json"))
        gemlite_layers.configured = True
    layers = []
    for qw, s, z in quant:
        lin = gemlite.GemLiteLinear(4, group_size=GROUP, in_features=k, out_features=n,
                                    input_dtype=gemlite.DType.BF16, output_dtype=gemlite.DType.BF16)
        lin.pack(K.w4a16_unpack(qw).t().contiguous().to(torch.uint8), s.t().contiguous(), z.t().contiguous(), None)
        layers.append(lin)
    return layers


def rel_err(y, ref):
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def check_odd_shapes(K, gen):
    """The GPU kernels (not the interpreter) on ragged shapes, every group layout and both dtypes."""
    rows = []
    for (k, n, group) in [(512, 72, 128), (1024, 1000, 64), (384, 264, 32), (640, 136, 640), (4096, 576, 128)]:
        for dtype in (torch.bfloat16, torch.float16):
            qw, s, z = make_weights(k, n, group, dtype, "cuda", gen)
            w_ref = unpack_reference(qw, s, z, group)
            gs = -1 if group == k else group
            for m in (1, 3, 17, 33, 64, 65, 300):
                x = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
                dy = torch.randn(m, n, device="cuda", dtype=dtype, generator=gen)
                err = max(rel_err(K.w4a16_matmul(x, qw, s, z, gs), x.float() @ w_ref),
                          rel_err(K.w4a16_matmul(x, qw, s, z, gs), x.float() @ w_ref))  # twice: split-K state reset
                err_b = rel_err(K.w4a16_matmul_grad_input(dy, qw, s, z, gs), dy.float() @ w_ref.t())
                rows.append(dict(K=k, N=n, group=gs, dtype=str(dtype), M=m, err=err, err_grad_input=err_b))
    worst = max(max(r["err"], r["err_grad_input"]) for r in rows)
    log(f"odd-shape check: {len(rows)} cases, worst relative error {worst:.2e}")
    if worst > 1.5e-2:
        raise SystemExit(f"odd-shape check FAILED: {[r for r in rows if max(r['err'], r['err_grad_input']) > 1.5e-2]}")
    return rows


def check_split_race(K, gen, iters=300):
    """Split-K stress: many eager calls per shape and row count, counting outputs off the reference (a partial sum
    lost between the split programs shows as a large error). results/w4a16_split_race.json also has the
    session-3 kernel (commit 6ec6d6d, before the fix), run at commit 2935d1a."""
    rows = []
    mods = [("current", K)]
    for (k, n) in ((8192, 28672), (4096, 14336), (4096, 4096)):
        qw, s, z = make_weights(k, n, GROUP, torch.bfloat16, "cuda", gen)
        w_ref = unpack_reference(qw, s, z, GROUP)
        for m in (1, 2, 4, 8, 16, 32, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = x.float() @ w_ref
            scale = ref.abs().max()
            for name, mod in mods:
                errs = torch.stack([(mod.w4a16_matmul(x, qw, s, z, GROUP).float() - ref).abs().max() / scale
                                    for _ in range(iters)])
                rows.append(dict(kernel=name, K=k, N=n, M=m, calls=iters, bad_calls=int((errs > 2e-2).sum()),
                                 worst=float(errs.max())))
    bad = [r for r in rows if r["kernel"] == "current" and r["bad_calls"]]
    log(f"split-K stress: {sum(r['calls'] for r in rows if r['kernel'] == 'current')} calls, "
        f"{sum(r['bad_calls'] for r in bad)} off the reference")
    if bad:
        raise SystemExit(f"split-K stress FAILED: {bad}")
    return rows


def load_module(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("w4a16_other", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_main(args):
    K = load_kernels()

    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    res = dict(
        gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        torch=torch.__version__, triton=__import__("triton").__version__, cuda=torch.version.cuda,
        python=platform.python_version(), group_size=GROUP, dtype="bfloat16",
        timing="CUDA graph of back-to-back calls cycling weight copies (> L2), median of 7 replays, µs per call",
        shapes=[], copy_bandwidth_GBps=None,
    )
    res["odd_shape_check"] = check_odd_shapes(K, gen)
    res["split_k_stress"] = check_split_race(K, gen, iters=50)
    bw = copy_bandwidth()
    res["copy_bandwidth_GBps"] = bw
    log(f"device copy bandwidth: {bw:.0f} GB/s")
    ms = args.ms or MS
    for (k, n) in (args.shapes or SHAPES):
        layer = Layer(k, n, gen)
        entry = dict(K=k, N=n, rows=[])
        qw, s, z = layer.quant[0]
        w_ref = unpack_reference(qw, s, z, GROUP)
        gemlite = gemlite_layers(K, layer.quant, k, n)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = x.float() @ w_ref
            try:
                err = rel_err(K.w4a16_matmul(x, qw, s, z, GROUP), ref)
                err_bwd = rel_err(K.w4a16_matmul_grad_input(dy, qw, s, z, GROUP), dy.float() @ w_ref.t())
            except Exception as exc:  # noqa: BLE001 - keep measuring the other shapes
                log(f"K={k} N={n} M={m}: ERROR {exc!r}"[:2000])
                entry["rows"].append(dict(M=m, error=repr(exc)[:2000]))
                continue
            err_tiny = rel_err(torch.ops.aten._weight_int4pack_mm(x, layer.tiny[0][0], GROUP, layer.tiny[0][1]),
                               x.float() @ layer.tiny_ref)
            row = dict(M=m, err_fwd=err, err_grad_input=err_bwd, err_tinygemm=err_tiny)
            row["ours_us"] = time_graph([lambda q=q: K.w4a16_matmul(x, *q, GROUP) for q in layer.quant])
            row["cublas_bf16_us"] = time_graph([lambda w=w: x @ w.t() for w in layer.w_bf16])
            row["tinygemm_us"] = time_graph(
                [lambda t=t: torch.ops.aten._weight_int4pack_mm(x, t[0], GROUP, t[1]) for t in layer.tiny])
            row["grad_input_us"] = time_graph(
                [lambda q=q: K.w4a16_matmul_grad_input(dy, *q, GROUP) for q in layer.quant])
            row["dequant_cublas_grad_input_us"] = time_graph(
                [lambda q=q: dy @ K.w4a16_dequantize(*q, GROUP).t() for q in layer.quant])
            if gemlite is not None:
                try:
                    row["err_gemlite"] = rel_err(gemlite[0](x), ref)
                    row["gemlite_us"] = time_graph([lambda g=g: g(x) for g in gemlite])
                    row["speedup_vs_gemlite"] = row["gemlite_us"] / row["ours_us"]
                except Exception as exc:  # noqa: BLE001 - a peer's failure is recorded, ours goes on
                    row["gemlite_error"] = repr(exc)[:500]
            if m == 1:  # host-bound without CUDA graphs? (eager decoding)
                row["ours_eager_us"] = time_eager([lambda q=q: K.w4a16_matmul(x, *q, GROUP) for q in layer.quant])
                row["cublas_bf16_eager_us"] = time_eager([lambda w=w: x @ w.t() for w in layer.w_bf16])
            row["speedup_vs_cublas"] = row["cublas_bf16_us"] / row["ours_us"]
            row["tinygemm_speedup_vs_cublas"] = row["cublas_bf16_us"] / row["tinygemm_us"]
            row["speedup_vs_tinygemm"] = row["tinygemm_us"] / row["ours_us"]
            row["grad_input_vs_dequant_cublas"] = row["dequant_cublas_grad_input_us"] / row["grad_input_us"]
            row["ours_GBps"] = layer.bytes_int4(m) / (row["ours_us"] * 1e-6) / 1e9
            row["ours_frac_of_copy_bw"] = row["ours_GBps"] / bw
            row["ours_TFLOPs"] = 2 * m * k * n / (row["ours_us"] * 1e-6) / 1e12
            row["cublas_TFLOPs"] = 2 * m * k * n / (row["cublas_bf16_us"] * 1e-6) / 1e12
            entry["rows"].append(row)
            log(f"K={k:5d} N={n:5d} M={m:4d}  ours {row['ours_us']:8.1f}us  cublas {row['cublas_bf16_us']:8.1f}us "
                f"({row['speedup_vs_cublas']:.2f}x)  tinygemm {row['tinygemm_us']:8.1f}us  "
                f"bwd {row['grad_input_us']:8.1f} vs {row['dequant_cublas_grad_input_us']:8.1f}us  "
                f"{row['ours_GBps']:.0f} GB/s  err {err:.1e}/{err_bwd:.1e}")
        res["shapes"].append(entry)
        res["ptx_unpack_verified"] = {str(key): ok for key, ok in K._PTX_OK.items()}
        del layer
        torch.cuda.empty_cache()
        save(res, args.out)
    print_table(res)
    return res


def save(res, out):
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


def print_table(res):
    log(f"\n{res['gpu']}  torch {res['torch']}  triton {res['triton']}  copy {res['copy_bandwidth_GBps']:.0f} GB/s")
    log("K x N          M   ours_us  x cuBLAS  x tinygemm  GB/s(M=1)  bwd x dequant+cuBLAS")
    for e in res["shapes"]:
        for r in e["rows"]:
            if "error" in r:
                log(f"{e['K']:5d}x{e['N']:<6d} {r['M']:5d}  ERROR")
                continue
            gb = f"{r['ours_GBps']:6.0f}" if r["M"] == 1 else "      "
            log(f"{e['K']:5d}x{e['N']:<6d} {r['M']:5d} {r['ours_us']:9.1f} {r['speedup_vs_cublas']:8.2f} "
                f"{r['speedup_vs_tinygemm']:10.2f}  {gb}     {r['grad_input_vs_dequant_cublas']:6.2f}")


# ---------------------------------------------------------------------------------------------------------------
# Sweep (used once to choose the heuristics in hf_fastpath/kernels/w4a16.py)
# ---------------------------------------------------------------------------------------------------------------


# Sweep candidates per row count: (BLOCK_M, BLOCK_N, warps, stages, scale mode). A BLOCK_M below M means
# several M tiles (the weights are read once per M tile).
SWEEP = {
    1: [(1, 128, 2, 4, "factored"), (1, 256, 4, 3, "factored"), (8, 128, 2, 4, "factored")],
    8: [(8, 256, 4, 3, "factored"), (8, 128, 2, 4, "factored"), (8, 256, 4, 3, "centered")],
    16: [(16, 256, 4, 3, "factored"), (16, 256, 8, 3, "factored"), (16, 256, 4, 3, "centered"),
         (16, 256, 8, 3, "centered"), (16, 128, 4, 3, "factored"), (16, 512, 8, 3, "factored"),
         (8, 256, 4, 3, "factored")],
    32: [(32, 256, 4, 3, "dequant"), (32, 256, 8, 3, "centered"), (32, 256, 8, 3, "factored"),
         (32, 256, 4, 3, "centered"), (32, 128, 4, 3, "centered"), (32, 256, 8, 3, "dequant"),
         (16, 256, 8, 3, "factored")],
    64: [(64, 128, 4, 3, "dequant"), (64, 128, 8, 3, "dequant"), (64, 128, 8, 3, "centered"),
         (64, 256, 8, 3, "centered"), (64, 256, 8, 3, "dequant"), (64, 128, 4, 3, "centered"),
         (32, 256, 8, 3, "centered")],
}


def run_sweep(args):
    """Launch configurations of the decode kernel (tile, warps, stages, scale mode, split-K), timed like the main
    benchmark. With --baseline FILE, the same shapes are also timed with that (older) kernel module's own
    heuristics (timing only: an older module may expect another weight layout)."""
    K = load_kernels()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)
    out = dict(gpu=torch.cuda.get_device_name(), triton=__import__("triton").__version__, results=[])
    per_sms = (1, 2)
    base = None
    if args.baseline:
        base = load_module(args.baseline)
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    t_start = time.time()

    def record(entry, us_fn, y, r):
        if time.time() - t_start > args.budget_s:
            return False
        try:
            us_fn(None)
            entry["err"] = rel_err(y, r)
            entry["us"] = us_fn("time")
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile is data too
            entry["error"] = repr(exc)[:300]
        out["results"].append(entry)
        log(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in entry.items()))
        return True

    for (k, n) in (args.shapes or SHAPES):
        layer = Layer(k, n, gen, with_peers=False)
        qw, s, z = layer.quant[0]
        w_ref = unpack_reference(qw, s, z, GROUP)
        for m in (args.ms or sorted(SWEEP)):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = x.float() @ w_ref
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            if base is not None:
                def fn(mode, base=base):
                    if mode is None:
                        y.copy_(base.w4a16_matmul(x, qw, s, z, GROUP))
                        return None
                    return time_graph([lambda q=q: base.w4a16_matmul(x, *q, GROUP) for q in layer.quant], replays=5)
                if not record(dict(K=k, N=n, M=m, kind="baseline"), fn, y, ref):
                    return out
            for (bm, bn, nw, ns, mode) in SWEEP.get(m, SWEEP[max(v for v in SWEEP if v <= m)]):
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=nw, num_stages=ns, mode=mode)
                n_tiles = -(-n // bn) * -(-m // bm)
                k_steps = -(-k // 128)
                for per_sm in per_sms:
                    split = 1
                    while n_tiles * split < per_sm * n_sms and k_steps // (split * 2) >= 1:
                        split *= 2
                    def fn(what, cfg=cfg, split=split):
                        if what is None:
                            K._decode_matmul(x, qw, s, z, GROUP, y, cfg, split_k=split)
                            return None
                        return time_graph([lambda q=q: K._decode_matmul(x, *q, GROUP, y, cfg, split_k=split)
                                           for q in layer.quant], replays=5)
                    entry = dict(K=k, N=n, M=m, kind="fwd", bm=bm, bn=bn, warps=nw, stages=ns, mode=mode,
                                 per_sm=per_sm, split=split)
                    if not record(entry, fn, y, ref):
                        return out
            if args.out:
                save(out, args.out)
        if base is not None:  # the dequantize kernel (prefill path) and the input gradient, old against new
            for name, mod in (("dequant_new", K), ("dequant_baseline", base)):
                us = time_graph([lambda q=q: mod._dequantize(*q, GROUP, torch.bfloat16) for q in layer.quant],
                                replays=5)
                out["results"].append(dict(K=k, N=n, kind=name, us=us))
                log(f"K={k} N={n} {name} {us:.1f} us")
            for m in (1, 16):
                dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=gen)
                for name, mod in (("grad_new", K), ("grad_baseline", base)):
                    us = time_graph([lambda q=q: mod.w4a16_matmul_grad_input(dy, *q, GROUP) for q in layer.quant],
                                    replays=5)
                    out["results"].append(dict(K=k, N=n, M=m, kind=name, us=us))
                    log(f"K={k} N={n} M={m} {name} {us:.1f} us")
        del layer
        torch.cuda.empty_cache()
    if args.out:
        save(out, args.out)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------------------------------------------


def speedup_axis(ax, k, n):
    """One layer's panel of a speed-up-over-cuBLAS plot against M: log-log axes, the 1.0 line, labels."""
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_title(f"K={k} N={n}")
    ax.set_xlabel("M (tokens)")
    ax.grid(True, which="both", alpha=0.3)


def plot(json_path, png_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        res = json.load(f)
    shapes = res["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 4), sharey=True)
    for ax, e in zip(axes if len(shapes) > 1 else [axes], shapes):
        rows = [r for r in e["rows"] if "error" not in r]
        ms = [r["M"] for r in rows]
        ax.plot(ms, [r["speedup_vs_cublas"] for r in rows], "o-", label="hf_fastpath W4A16")
        ax.plot(ms, [r["tinygemm_speedup_vs_cublas"] for r in rows], "s--", label="torch int4 tinygemm")
        pts = [(r["M"], r["cublas_bf16_us"] / r["gemlite_us"]) for r in rows if "gemlite_us" in r]
        if pts:
            ax.plot(*zip(*pts), "d-.", label="GemLite A16W4")
        ax.plot(ms, [r["grad_input_vs_dequant_cublas"] for r in rows], "^:",
                label="grad_input / (dequant + cuBLAS)")
        speedup_axis(ax, e["K"], e["N"])
    (axes[0] if len(shapes) > 1 else axes).set_ylabel("speed-up over cuBLAS bf16 (x)")
    (axes[0] if len(shapes) > 1 else axes).legend(fontsize=8)
    fig.suptitle(f"W4A16 group {res['group_size']}, {res['gpu']}, torch {res['torch']}, triton {res['triton']}")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--plot", metavar="JSON")
    p.add_argument("--out", default=None)
    p.add_argument("--ms", type=int, nargs="*")
    p.add_argument("--shapes", type=lambda s: tuple(int(v) for v in s.split("x")), nargs="*")
    p.add_argument("--budget-s", type=float, default=1e9)
    p.add_argument("--then-sweep", metavar="JSON", help="after the benchmark, run the sweep into JSON")
    p.add_argument("--baseline", metavar="PY", help="sweep: also time this older copy of kernels/w4a16.py")
    p.add_argument("--race", metavar="JSON", help="only the split-K stress check (300 calls a case) into JSON")
    p.add_argument("--group", type=int, default=GROUP, help="quantization group size (default %(default)s)")
    args = p.parse_args()
    globals()["GROUP"] = args.group  # every layer, reference and call below uses this group size
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    if args.plot:
        plot(args.plot, args.out or os.path.join(here, "w4a16.png"))
        return
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    if args.race:
        gen = torch.Generator(device="cuda").manual_seed(2)
        save(dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  rows=check_split_race(load_kernels(), gen)), args.race)
        return
    if args.sweep:
        args.out = args.out or os.path.join(here, "w4a16_sweep.json" if GROUP == 128 else f"w4a16_sweep_g{GROUP}.json")
        run_sweep(args)
    else:
        args.out = args.out or os.path.join(here, "w4a16.json" if GROUP == 128 else f"w4a16_g{GROUP}.json")
        run_main(args)
        if args.then_sweep:
            args.out = args.then_sweep
            args.shapes = args.ms = None
            run_sweep(args)


if __name__ == "__main__":
    main()
