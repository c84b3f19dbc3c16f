"""Low-precision attention benchmark: FP8 / FP4 prefill forward and FP8 / FP4 KV-cache decode, against SDPA and
hf_fastpath's bf16 kernels, measured in the same process with `triton.testing.do_bench` (median).

    python benchmarks/lowbit_attention.py                # GPU checks + every case; JSON to benchmarks/results
    python benchmarks/lowbit_attention.py --plot FILE    # PNG from a results JSON (no GPU needed)
    python benchmarks/lowbit_attention.py --backward-only  # backward: bf16 vs FP8 P/dS products vs SDPA cuDNN

Prefill: 16k tokens per batch (batch = 16384 / seq), seq 4k and 16k, hd 128 (16 heads) / 256 (8 heads), causal and not.
TFLOP/s with fwd = 4*B*H*S^2*D (half when causal). Variants: SDPA cuDNN and FLASH (bf16), ours bf16
(`kernels.flash_attention`), and the low-bit kernel in bf16 mode, fp8, mxfp4 (P fp8), mxfp4 (P fp4), nvfp4;
"kernel" times take pre-quantized inputs, "e2e" adds the fused quantization of Q/K/V. Accuracy beside speed: cosine
and relative error against SDPA FLASH bf16 on the same (random normal) inputs.
Decode: 1 query per sequence, GQA 32/8, hd 128, batch 1, KV 8k-128k: SDPA bf16 vs our split-KV decode on bf16, fp8,
mxfp4 and nvfp4 caches; microseconds per token per layer and bytes of cache read per second.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TOKENS = 16384
SEQS = (4096, 16384)
HEADS = {128: 16, 256: 8}
DECODE_KV = (8192, 16384, 32768, 65536, 131072)
# the session-2 FP4 decode (every value scaled in registers) with its own launch settings, timed beside the new one
DECODE_TILE = {"fp4_kernel": "tile", "block_n": None, "num_warps": 4, "num_stages": 3, "waves": 2}


def _log(*a):
    print(*a, flush=True)


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), 0).item()


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _bench(fn):
    import triton

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def _env():
    import triton
    import transformers

    return dict(gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                torch=torch.__version__, cuda=torch.version.cuda, triton=triton.__version__,
                transformers=transformers.__version__, python=platform.python_version(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def gpu_checks():
    """Small correctness checks on the GPU (the CI runs the same kernels only under the interpreter)."""
    from hf_fastpath.attention import lowbit
    from hf_fastpath.kernels import lowbit_attention as kla
    from hf_fastpath.kernels import row_quant

    out = {}
    torch.manual_seed(0)
    for fmt, p_fp4 in (("fp8", False), ("mxfp4", False), ("nvfp4", False), ("mxfp4", True)):
        for causal in (False, True):
            key = f"fwd_{fmt}{'_pfp4' if p_fp4 else ''}_{'causal' if causal else 'full'}"
            try:
                q, k, v = (torch.randn(1, 300, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                kv = (k[:, :, :2], v[:, :, :2])
                got = lowbit.lowbit_attention(q, *kv, fmt=fmt, p_format="fp4" if p_fp4 else "fp8", causal=causal,
                                              rotate=False)
                emu, _ = kla.lowbit_attention_emulated(q[0].float(), kv[0][0].float(), kv[1][0].float(), fmt=fmt,
                                                       causal=causal, p_fp4=p_fp4)
                ref = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2).float(), kv[0].transpose(1, 2).float().repeat_interleave(2, 1),
                    kv[1].transpose(1, 2).float().repeat_interleave(2, 1), is_causal=causal).transpose(1, 2)
                # quantizer on GPU equals the CPU reference bit for bit
                y, s = row_quant.quantize_e4m3_rows(q, fmt)
                y_ref, s_ref = lowbit.quantize_for_attention(q.reshape(-1, 4, 128).cpu(), fmt)
                same = bool(torch.equal(y.view(torch.uint8).cpu(), y_ref.view(torch.uint8))
                            and torch.equal(s.cpu(), s_ref))
                rot = lowbit.lowbit_attention(q, *kv, fmt=fmt, p_format="fp4" if p_fp4 else "fp8", causal=causal)
                out[key] = dict(cos_vs_emulation=_cos(got[0].float(), emu), cos_vs_fp32=_cos(got.float(), ref),
                                rel_vs_fp32=_rel(got.float(), ref), quantizer_bit_exact=same,
                                rotated_cos_vs_fp32=_cos(rot.float(), ref))
            except Exception as e:  # keep going: the report says what failed
                out[key] = dict(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-1500:])
            _log(key, out[key])
    out.update(decode_checks())
    return out


# name -> (decode settings, FP4 byte layout of the cache)
DECODE_FP4_VARIANTS = {"rows": ({"fp4_kernel": "rows", "unpack": 1}, "decode"),
                       "rows_intops": ({"fp4_kernel": "rows", "unpack": 0}, "decode"),
                       "rows_nibbles": ({"fp4_kernel": "rows", "unpack": 1}, "nibbles"),
                       "rows_nibbles_intops": ({"fp4_kernel": "rows", "unpack": 0}, "nibbles"),
                       "tile": (DECODE_TILE, "nibbles")}


def _in_layout(cache, layout):
    """(data, row, block) of an FP4 cache with its bytes in `layout` ("nibbles" as quantized, or "decode")."""
    from hf_fastpath.kernels import lowbit_quant as lq

    return cache if layout == "nibbles" else (lq.recode_for_decode(cache[0]),) + tuple(cache[1:])


def _with_decode_config(cfg_fmt, over, fn, *args, **kwargs):
    """Call fn with decode settings `over` layered on the current ones for `cfg_fmt` (restored afterwards)."""
    from hf_fastpath.kernels import lowbit_decode as ld

    prev = ld.DECODE_CONFIG_OVERRIDE.get(cfg_fmt)
    ld.DECODE_CONFIG_OVERRIDE[cfg_fmt] = {**(prev or {}), **over}
    try:
        return fn(*args, **kwargs)
    finally:
        if prev is None:
            ld.DECODE_CONFIG_OVERRIDE.pop(cfg_fmt, None)
        else:
            ld.DECODE_CONFIG_OVERRIDE[cfg_fmt] = prev


def decode_checks(head_dims=(128, 64)):
    """Every decode kernel variant against SDPA in fp32 on the dequantized cache (GQA 32/8, hd 128 and GQA 8/8 hd 64,
    odd length)."""
    from hf_fastpath.kernels import lowbit_decode as ld
    from hf_fastpath.kernels import lowbit_quant as lq

    out = {}
    for hq, hkv, d in ((32, 8, 128), (8, 8, 64)):
        if d not in head_dims:
            continue
        torch.manual_seed(0)
        q = torch.randn(2, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, hkv, 5000, d, device="cuda") for _ in range(2))
        for fmt in ("bf16", "fp8", "mxfp4", "nvfp4"):
            if fmt == "bf16":
                kc, vc, kd, vd = (k.bfloat16(), None, None), (v.bfloat16(), None, None), k.bfloat16(), v.bfloat16()
            else:
                qk, qv = lq.quantize_rows(k, fmt), lq.quantize_rows(v, fmt)
                kc, vc = (qk.data, qk.scale, qk.block_scale), (qv.data, qv.scale, qv.block_scale)
                kd, vd = lq.dequantize_rows(qk), lq.dequantize_rows(qv)
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[:, :, None].float(), kd[:, :, :4999].float().repeat_interleave(hq // hkv, 1),
                vd[:, :, :4999].float().repeat_interleave(hq // hkv, 1))[:, :, 0]
            for name, (over, layout) in (DECODE_FP4_VARIANTS.items() if fmt in ("mxfp4", "nvfp4")
                                         else [("", ({}, "nibbles"))]):
                key = f"decode_{fmt}{'_' + name if name else ''}_hd{d}"
                try:
                    kc_, vc_ = _in_layout(kc, layout), _in_layout(vc, layout)
                    o, _ = _with_decode_config(fmt, over, ld.lowbit_decode, q, kc_, vc_, 4999, fmt=fmt,
                                               code_layout=layout)
                    out[key] = dict(cos_vs_dequantized_fp32=_cos(o.float(), ref), rel=_rel(o.float(), ref))
                except Exception as e:
                    out[key] = dict(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-1500:])
                _log(key, out[key])
    return out


def prefill_cases(quick=False, only=None, time_it=True):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hf_fastpath.attention import lowbit
    from hf_fastpath.kernels import lowbit_attention as kla
    from hf_fastpath.kernels import row_quant

    try:
        from hf_fastpath.kernels.flash_attention import flash_attention_forward
    except Exception:  # the bf16 kernel is another module; measure without it if it is missing
        flash_attention_forward = None
    rows = []
    for d in (128, 256):
        for s in (SEQS[:1] if quick else SEQS if d == 128 else SEQS[-1:]):
            for causal in (False, True):
                if only is not None and (d, causal) != tuple(only):
                    continue
                b, h = TOKENS // s, HEADS[d]
                torch.manual_seed(0)
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                row = dict(head_dim=d, seq=s, batch=b, heads=h, causal=causal, tflops={}, ms={}, cos={}, rel={})

                def sdpa(backend):
                    def f():
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
                    return f

                cu = torch.arange(b + 1, device="cuda", dtype=torch.int32) * s
                pre = {}
                for fmt in ("fp8", "mxfp4", "nvfp4"):
                    q8, qs = row_quant.quantize_e4m3_rows(q, fmt)
                    k8, ks = row_quant.quantize_e4m3_rows(k, fmt)
                    v8, vs = row_quant.quantize_e4m3_rows(v, fmt, transpose=True)
                    pre[fmt] = (q8, qs, k8, ks, v8, vs)
                vt_bf16 = kla.transpose_v(v.reshape(-1, h, d))

                def kern(fmt, p_fp4=False):
                    def f():
                        if fmt == "bf16":
                            args = (q.reshape(-1, h, d), None, k.reshape(-1, h, d), None, vt_bf16, None)
                        else:
                            args = pre[fmt]
                        return kla.lowbit_flash_forward(*args, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s,
                                                        causal=causal, p_fp4=p_fp4,
                                                        key_starts_aligned=True)[0].view(b, s, h, d)
                    return f

                def e2e(fmt, p_format="fp8"):
                    return lambda: lowbit.lowbit_attention(q, k, v, fmt=fmt, p_format=p_format, causal=causal)

                variants = {"sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
                            "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION)}
                if flash_attention_forward is not None:
                    variants["ours_bf16"] = lambda: flash_attention_forward(q, k, v, causal=causal)[0]
                variants.update({"lowbit_kernel_bf16_mode": kern("bf16"), "fp8_kernel": kern("fp8"),
                                 "fp8_e2e": e2e("fp8"), "mxfp4_kernel": kern("mxfp4"), "mxfp4_e2e": e2e("mxfp4"),
                                 "mxfp4_pfp4_kernel": kern("mxfp4", True), "nvfp4_e2e": e2e("nvfp4")})
                if not time_it:  # precompiling: one call each
                    for name, fn in variants.items():
                        try:
                            with torch.no_grad():
                                fn()
                        except Exception:
                            pass
                    continue
                ref = None
                try:
                    with torch.no_grad():
                        ref = variants["sdpa_flash"]().float()
                except Exception as e:
                    row["ref_error"] = str(e)
                for name, fn in variants.items():
                    try:
                        with torch.no_grad():
                            o = fn()
                            if ref is not None:
                                row["cos"][name] = _cos(o.float(), ref)
                                row["rel"][name] = _rel(o.float(), ref)
                            ms = _bench(fn)
                        row["ms"][name] = ms
                        row["tflops"][name] = flops / ms / 1e9
                    except Exception as e:
                        row.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:400]}"
                t = row["tflops"]
                ratios = {}
                for num, den in (("fp8_kernel", "ours_bf16"), ("fp8_e2e", "ours_bf16"), ("fp8_kernel", "sdpa_cudnn"),
                                 ("fp8_kernel", "lowbit_kernel_bf16_mode"), ("mxfp4_kernel", "fp8_kernel"),
                                 ("mxfp4_e2e", "fp8_e2e"), ("mxfp4_pfp4_kernel", "fp8_kernel")):
                    if num in t and den in t:
                        ratios[f"{num}/{den}"] = t[num] / t[den]
                row["ratios"] = ratios
                _log(json.dumps({k: row[k] for k in ("head_dim", "seq", "causal")}),
                     {k: round(x, 1) for k, x in t.items()}, {k: round(x, 2) for k, x in ratios.items()},
                     {k: round(x, 5) for k, x in row["cos"].items()}, row.get("errors", ""))
                rows.append(row)
                del q, k, v, qt, kt, vt, pre, vt_bf16, ref
                torch.cuda.empty_cache()
    return rows


# earlier sweeps (results/lowbit_attention.json "sweep" rows of 2026-11-29) settled the tile shapes; this one
# compares the two TMA ways of loading the scales
SWEEP_CFGS = {128: [(64, 128, 4, 3)], 256: [(64, 64, 4, 2)]}
SCALE_MODES = ("tma", "tma_pair")
DECODE_SWEEP = []
# FP4 rows kernel launch settings timed by --decode-sweep (the winner per format is used by the decode table)
DECODE_FP4_SWEEP = [dict(fp4_kernel="rows", block_n=bn, num_warps=w, num_stages=st, waves=wv)
                    for bn, w, waves in ((64, 2, (4, 8)), (64, 4, (2, 4)), (128, 4, (2, 4)), (128, 8, (2, 4)))
                    for st in (2, 3) for wv in waves]


def _sweep_variants():
    """Every prefill variant the sweep times (hd 128: 16k tokens, 16 heads; hd 256: 16k, 8 heads): launch configs
    x ways of loading the per-token scales, causal and not; unit scales (no scale work) as the ceiling."""
    out = []
    for d, cfgs in SWEEP_CFGS.items():
        for cfg in cfgs:
            for mode in SCALE_MODES:
                for causal in (False, True):
                    out.append(dict(d=d, kind="fp8", cfg=tuple(cfg) + (mode,), tma=True, causal=causal))
        out.append(dict(d=d, kind="fp8_unit_scales", cfg=cfgs[0], tma=True, causal=False))
        out.append(dict(d=d, kind="ours_bf16", cfg=None, tma=True, causal=False))
    return out


def _run_variant(v, time_it=True):
    """One sweep variant; returns TFLOP/s (or an error string). Without time_it: one call (compiles)."""
    from hf_fastpath.kernels import flash_attention as fa
    from hf_fastpath.kernels import lowbit_attention as kla
    from hf_fastpath.kernels import row_quant

    d, s = v["d"], 16384
    h, b = HEADS[d], 1
    torch.manual_seed(0)
    q, k, v_ = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.arange(b + 1, device="cuda", dtype=torch.int32) * s
    kla.USE_TMA = v["tma"]
    fa.USE_TMA = "auto" if v["tma"] else False
    try:
        if v["kind"] == "ours_bf16":
            fn = lambda: fa.flash_attention_forward(q, k, v_, causal=v["causal"])  # noqa: E731
        else:
            lowp = v["kind"] != "bf16"
            kla.CONFIG_OVERRIDE[(d, lowp, False)] = tuple(v["cfg"])
            if lowp:
                (q8, qs), (k8, ks), (vt8, vs) = (row_quant.quantize_e4m3_rows(x, "fp8", transpose=i == 2)
                                                 for i, x in enumerate((q, k, v_)))
                if v["kind"] == "fp8_unit_scales":
                    qs = ks = vs = None
                args = (q8, qs, k8, ks, vt8, vs)
            else:
                args = (q.reshape(-1, h, d), None, k.reshape(-1, h, d), None, kla.transpose_v(v_.reshape(-1, h, d)),
                        None)
            fn = lambda: kla._launch(*args, cu, cu, s, v["causal"], None, False, torch.bfloat16)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        if not time_it:
            return None
        ms = _bench(fn)
        return 4 * b * h * s * s * d / (2 if v["causal"] else 1) / ms / 1e9
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        kla.CONFIG_OVERRIDE.clear()
        kla.USE_TMA = "auto"
        fa.USE_TMA = "auto"


def e2e_breakdown(quick=False):
    """Where the time of `lowbit_attention` goes besides the kernel (hd 128, 16 heads, 16k tokens, seq 4k)."""
    from hf_fastpath.attention import lowbit
    from hf_fastpath.kernels import lowbit_attention as kla
    from hf_fastpath.kernels import row_quant

    out = {}
    b, s, h, d = 4, 4096, 16, 128
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    hm = lowbit.hadamard(d, q.device, q.dtype)
    cu = torch.arange(b + 1, device="cuda", dtype=torch.int32) * s
    pre = [row_quant.quantize_e4m3_rows(x, "fp8", transpose=i == 2) for i, x in enumerate((q, k, v))]
    args = (pre[0][0], pre[0][1], pre[1][0], pre[1][1], pre[2][0], pre[2][1])
    for causal in (False, True):
        with torch.no_grad():
            parts = {"rotate_qkv_and_out": lambda: [x @ hm for x in (q, k, v, q)],
                     "quantize_qkv": lambda: [row_quant.quantize_e4m3_rows(x, "fp8", transpose=i == 2)
                                              for i, x in enumerate((q, k, v))],
                     "kernel": lambda: kla.lowbit_flash_forward(*args, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                                max_seqlen_q=s, causal=causal,
                                                                key_starts_aligned=True),
                     "e2e": lambda: lowbit.lowbit_attention(q, k, v, fmt="fp8", causal=causal),
                     "e2e_no_rotation": lambda: lowbit.lowbit_attention(q, k, v, fmt="fp8", causal=causal,
                                                                        rotate=False)}
            out["causal" if causal else "full"] = {name: _bench(fn) for name, fn in parts.items()}
        _log("e2e breakdown ms", causal, {k_: round(x, 3) for k_, x in out["causal" if causal else "full"].items()})
    return out


def _decode_variants(fp4_only=False):
    if fp4_only:
        return [dict(fmt=fmt, n=n, cfg=cfg) for cfg in DECODE_FP4_SWEEP for fmt in ("mxfp4", "nvfp4")
                for n in (32768, 131072)]
    return [dict(fmt=fmt, n=n, cfg=cfg) for fmt in ("fp8", "mxfp4", "nvfp4") for cfg in DECODE_SWEEP
            for n in (32768, 131072)]


def decode_sweep():
    """Time the FP4 rows kernel's launch settings at 32k and 128k cached tokens; the winner per format (least total
    time) is used by the rest of the run."""
    from hf_fastpath.kernels import lowbit_decode as ld

    dvariants = _decode_variants(fp4_only=True)
    if not PRECOMPILED:
        precompile([("decode_variant", v, {}) for v in dvariants])
    import time

    drows, winners = [], {}
    for v in dvariants:
        if time.time() > SWEEP_DEADLINE:  # keep device time for the table
            drows.append(dict(v, us_cudagraph="skipped: time budget"))
            continue
        drows.append(dict(v, us_cudagraph=_run_decode_variant(v)))
        _log("decode sweep", drows[-1])
    for fmt in ("mxfp4", "nvfp4"):
        score = {}
        for r in drows:
            if r["fmt"] == fmt and isinstance(r["us_cudagraph"], float):
                key = json.dumps(r["cfg"], sort_keys=True)
                score.setdefault(key, []).append(r["us_cudagraph"])
        score = {k_: sum(x) for k_, x in score.items() if len(x) == 2}
        if score:
            best = min(score, key=score.get)
            winners[fmt] = json.loads(best)
            ld.DECODE_CONFIG_OVERRIDE[fmt] = json.loads(best)
    _log("decode sweep winners", winners)
    return dict(rows=drows, winners=winners)


def _run_decode_variant(v, time_it=True):
    import triton

    from hf_fastpath.kernels import lowbit_decode as ld
    from hf_fastpath.kernels import lowbit_quant as lq

    hq, hkv, d, b, n = 32, 8, 128, 1, v["n"]
    torch.manual_seed(0)
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    k, vv = (torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    qk, qv = lq.quantize_rows(k, v["fmt"], check=False), lq.quantize_rows(vv, v["fmt"], check=False)
    del k, vv
    kc = _in_layout((qk.data, qk.scale, qk.block_scale), "decode")
    vc = _in_layout((qv.data, qv.scale, qv.block_scale), "decode")
    ld.DECODE_CONFIG_OVERRIDE[v["fmt"]] = dict(v["cfg"])
    try:
        fn = lambda: ld.lowbit_decode(q, kc, vc, n, fmt=v["fmt"], code_layout="decode")  # noqa: E731
        fn()
        torch.cuda.synchronize()
        if not time_it:
            return None
        return triton.testing.do_bench_cudagraph(fn, rep=25, return_mode="median") * 1e3
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        ld.DECODE_CONFIG_OVERRIDE.clear()


def _precompile_task(task):
    """Runs in a worker process: compile (and run once) without timing; Triton's disk cache keeps the binaries."""
    name, arg, overrides = task
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    try:
        from hf_fastpath.kernels import lowbit_attention as kla
        from hf_fastpath.kernels import lowbit_decode as ld

        kla.CONFIG_OVERRIDE.update(overrides.get("prefill", {}))
        ld.DECODE_CONFIG_OVERRIDE.update(overrides.get("decode", {}))
        if name == "variant":
            return _run_variant(arg, time_it=False)
        if name == "decode_variant":
            return _run_decode_variant(arg, time_it=False)
        if name == "prefill":
            prefill_cases(only=arg, time_it=False)
        elif name == "decode":
            decode_cases(time_it=False)
        elif name == "checks":
            gpu_checks()
        elif name == "decode_checks":
            decode_checks(*([arg] if arg else []))
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:300]}"


PRECOMPILED = False  # main() compiled everything up front
SWEEP_DEADLINE = float("inf")  # time.time() after which the decode sweep stops timing


def precompile(tasks, workers=12):
    """Compile the kernels of `tasks` in parallel processes first: compiling one by one would take most of the
    (scarce) GPU time of a benchmark run."""
    import multiprocessing as mp
    import time

    t0 = time.time()
    with mp.get_context("spawn").Pool(min(workers, len(tasks), os.cpu_count() or 4)) as pool:
        res = pool.map(_precompile_task, tasks, chunksize=1)
    errs = [(t[0], t[1], r) for t, r in zip(tasks, res) if r]
    _log(f"precompiled {len(tasks)} tasks in {time.time() - t0:.0f} s", errs[:5])
    return errs


def sweep():
    """Time launch configs / TMA / scale work of the prefill kernel and the decode launch settings; the winners
    (best causal + non-causal sum) are used by the rest of the run."""
    from hf_fastpath.kernels import lowbit_attention as kla
    from hf_fastpath.kernels import lowbit_decode as ld

    variants, dvariants = _sweep_variants(), _decode_variants()
    if not PRECOMPILED:
        precompile([("variant", v, {}) for v in variants] + [("decode_variant", v, {}) for v in dvariants])
    rows = []
    for v in variants:
        rows.append(dict(v, tflops=_run_variant(v)))
        _log("sweep", rows[-1])
    winners = {}
    for d in SWEEP_CFGS:
        for kind in ("fp8",):
            score = {}
            for r in rows:
                if (r["d"] == d and r["kind"] == kind and r["tma"] and not r.get("stma") and not r.get("pipe")
                        and isinstance(r["tflops"], float)):
                    score[tuple(r["cfg"])] = score.get(tuple(r["cfg"]), 0.0) + r["tflops"]
            if score:
                best = max(score, key=score.get)
                winners[f"{d},{kind}"] = best
                kla.CONFIG_OVERRIDE[(d, kind == "fp8", False)] = best
                if kind == "fp8":
                    kla.CONFIG_OVERRIDE[(d, True, True)] = best
    drows = []
    for v in dvariants:
        drows.append(dict(v, us_cudagraph=_run_decode_variant(v)))
        _log("decode sweep", drows[-1])
    for fmt in ("fp8", "mxfp4", "nvfp4"):
        score = {}
        for r in drows:
            if r["fmt"] == fmt and isinstance(r["us_cudagraph"], float):
                key = json.dumps(r["cfg"], sort_keys=True)
                score[key] = score.get(key, 0.0) + r["us_cudagraph"]
        if score:
            best = min(score, key=score.get)
            winners[f"decode,{fmt}"] = json.loads(best)
            ld.DECODE_CONFIG_OVERRIDE[fmt] = json.loads(best)
    _log("sweep winners", winners)
    return dict(rows=rows, decode_rows=drows, winners=winners)


def decode_cases(quick=False, time_it=True):
    import torch.nn.functional as F

    from hf_fastpath.kernels import lowbit_decode as ld
    from hf_fastpath.kernels import lowbit_quant as lq

    try:
        from hf_fastpath.kernels.flash_attention import flash_attention_forward
    except Exception:
        flash_attention_forward = None
    rows = []
    hq, hkv, d, b = 32, 8, 128, 1
    for n in (DECODE_KV[2:3] if quick else DECODE_KV):
        torch.manual_seed(0)
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        row = dict(kv_len=n, batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, us={}, us_cudagraph={}, gbps={}, cos={})
        caches = {"bf16": ((k, None, None), (v, None, None), 2.0 * d)}
        for fmt in ("fp8", "mxfp4", "nvfp4"):
            qk, qv = lq.quantize_rows(k, fmt, check=False), lq.quantize_rows(v, fmt, check=False)
            bytes_per_tok = qk.data[0, 0, 0].numel() * qk.data.element_size()
            bytes_per_tok += 0 if qk.scale is None else 4
            bytes_per_tok += 0 if qk.block_scale is None else qk.block_scale[0, 0, 0].numel()
            caches[fmt] = ((qk.data, qk.scale, qk.block_scale), (qv.data, qv.scale, qv.block_scale), bytes_per_tok)

        def sdpa():
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        variants = {"sdpa_bf16": (sdpa, 2.0 * d)}
        if flash_attention_forward is not None:
            qs_, ks_, vs_ = (x.transpose(1, 2) for x in (q, k, v))
            variants["ours_bf16_flash_splitkv"] = (lambda: flash_attention_forward(qs_, ks_, vs_)[0].transpose(1, 2),
                                                   2.0 * d)
        for fmt, (kc, vc, bpt) in caches.items():
            if fmt not in ("mxfp4", "nvfp4"):
                variants[f"decode_{fmt}"] = ((lambda kc=kc, vc=vc, fmt=fmt:
                                              ld.lowbit_decode(q[:, :, 0], kc, vc, n, fmt=fmt)[0][:, :, None]), bpt)
                continue
            # shipped: the cache's decode byte layout (what LowBitCache(packed_decode=True) stores), rows kernel
            kd_, vd_ = _in_layout(kc, "decode"), _in_layout(vc, "decode")
            variants[f"decode_{fmt}"] = ((lambda kc=kd_, vc=vd_, fmt=fmt: ld.lowbit_decode(
                q[:, :, 0], kc, vc, n, fmt=fmt, code_layout="decode")[0][:, :, None]), bpt)
            # rows kernel on the standard nibbles; the session-2 kernel (every value scaled in registers)
            for name, over in (("nibbles", {"fp4_kernel": "rows"}), ("tile", DECODE_TILE)):
                variants[f"decode_{fmt}_{name}"] = (
                    (lambda kc=kc, vc=vc, fmt=fmt, over=over: _with_decode_config(
                        fmt, over, ld.lowbit_decode, q[:, :, 0], kc, vc, n, fmt=fmt)[0][:, :, None]), bpt)
        if not time_it:
            for fn, _ in variants.values():
                try:
                    fn()
                except Exception:
                    pass
            continue
        ref = None
        try:
            ref = sdpa().float()
        except Exception as e:
            row["ref_error"] = str(e)
            ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(4, 1),
                                                 v.float().repeat_interleave(4, 1))
        for name, (fn, bpt) in variants.items():
            try:
                o = fn()
                row["cos"][name] = _cos(o.float(), ref)
                ms = _bench(fn)
                row["us"][name] = ms * 1e3
                import triton

                ms_g = triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")
                row["us_cudagraph"][name] = ms_g * 1e3
                row["gbps"][name] = 2 * b * hkv * n * bpt / (min(ms, ms_g) * 1e-3) / 1e9
            except Exception as e:
                row.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:400]}"
        base = row["us"].get("sdpa_bf16")
        row["speedup_vs_sdpa"] = {k: base / x for k, x in row["us"].items()} if base else {}
        base = row["us_cudagraph"].get("sdpa_bf16")
        row["speedup_vs_sdpa_cudagraph"] = {k: base / x for k, x in row["us_cudagraph"].items()} if base else {}
        _log(n, {k: round(x, 1) for k, x in row["us"].items()}, {k: round(x, 1) for k, x in
                                                                  row["us_cudagraph"].items()},
             {k: round(x, 2) for k, x in row["speedup_vs_sdpa_cudagraph"].items()},
             {k: round(x, 0) for k, x in row["gbps"].items()}, row.get("errors", ""))
        rows.append(row)
        del k, v, caches
        torch.cuda.empty_cache()
    return rows


def plot(path, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.load(open(path))
    fig, axes = plt.subplots(1, 2, figsize=(15, 5))
    ax = axes[0]
    rows = res["prefill"]
    names = ["sdpa_cudnn", "ours_bf16", "fp8_kernel", "fp8_e2e", "mxfp4_kernel", "mxfp4_e2e", "mxfp4_pfp4_kernel"]
    labels = [f"d{r['head_dim']} {r['seq'] // 1024}k {'c' if r['causal'] else 'f'}" for r in rows]
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        ax.bar([x + i * width for x in range(len(rows))], [r["tflops"].get(n, 0) for r in rows], width, label=n)
    ax.set_xticks([x + 0.4 for x in range(len(rows))], labels, rotation=60, fontsize=8)
    ax.set_ylabel("forward TFLOP/s")
    ax.set_title(f"prefill forward, 16k tokens/batch ({res['env']['gpu']})")
    ax.legend(fontsize=7, loc="lower left", ncol=2)
    ax = axes[1]
    rows = res["decode"]
    for n in rows[0]["us_cudagraph"]:
        ax.plot([r["kv_len"] for r in rows], [r["us_cudagraph"].get(n) for r in rows], marker="o", label=n)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cached tokens")
    ax.set_ylabel("us per decode step, one layer (CUDA graph)")
    ax.set_title("decode, GQA 32/8, hd 128, batch 1")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def decode_only(args):
    """One GPU call for the decode side: compile everything in parallel, check every variant, sweep the FP4 launch
    settings, then the decode table with the winners."""
    global PRECOMPILED, SWEEP_DEADLINE
    import time

    t0 = time.time()
    res = dict(env=_env())
    path = os.path.join(args.out, "lowbit_decode.json")
    seen, tasks = set(), []
    for v in _decode_variants(fp4_only=True):  # one task per distinct kernel (waves and length do not compile)
        key = (v["fmt"], json.dumps({k_: x for k_, x in v["cfg"].items() if k_ != "waves"}, sort_keys=True))
        if key not in seen:
            seen.add(key)
            tasks.append(("decode_variant", dict(v, n=8192), {}))
    tasks += [("decode_checks", (128,), {}), ("decode_checks", (64,), {}), ("decode", None, {})]
    res["precompile_errors"] = precompile(tasks)
    PRECOMPILED = True
    SWEEP_DEADLINE = t0 + args.sweep_budget
    from hf_fastpath.kernels import lowbit_decode as ld

    for name, fn in (("decode_checks", decode_checks), ("decode_sweep", decode_sweep),
                     ("decode", lambda: decode_cases(args.quick))):
        try:
            res[name] = fn()
        except Exception:
            res[name + "_error"] = traceback.format_exc()
            _log(res[name + "_error"])
        if name == "decode_checks":  # the PTX unpack must be exact on this stack, else time the integer-op one
            bad = [k_ for k_, r in res.get(name, {}).items() if ("_rows_hd" in k_ or "_rows_nibbles_hd" in k_)
                   and not r.get("cos_vs_dequantized_fp32", 0) > 0.999]
            if bad:
                ld.DECODE_CONFIG["unpack"] = 0
                res["unpack_fallback"] = bad
                _log("PTX unpack rejected by the checks, using unpack=0:", bad)
        json.dump(res, open(path, "w"), indent=1)
    if res.get("decode_sweep", {}).get("winners"):  # the table ran with the winners: compile them too next time
        res["decode_config_used"] = res["decode_sweep"]["winners"]
        json.dump(res, open(path, "w"), indent=1)
    _log("wrote", path)


def backward_cases(quick=False):
    """Attention backward (dQ, dK, dV from out and lse), 16k tokens per batch: SDPA cuDNN (bf16), ours bf16, ours with
    the P and dS products in e4m3 (`fp8_products`, what `fastpath_fp4` trains with). TFLOP/s with
    bwd = 2.5 * fwd = 10*B*H*S^2*D (half when causal). Accuracy: gradients of a 2k-token case against float64."""
    from hf_fastpath.attention import reference
    from hf_fastpath.kernels import flash_attention as fa

    res = dict(accuracy=[], speed=[])
    torch.manual_seed(0)
    for d, h in ((128, 8), (64, 8)):
        for causal in (False, True):
            q, k, v, g = (torch.randn(1, 2048, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            out, lse = fa.flash_attention_forward(q, k, v, causal=causal)
            ro, rl = reference.attention_forward(q.double(), k.double(), v.double(), causal=causal)
            exact = reference.attention_backward(g.double(), q.double(), k.double(), v.double(), ro, rl, causal=causal)
            row = dict(head_dim=d, causal=causal, tokens=2048)
            for name, fp8 in (("ours_bf16", False), ("ours_fp8_products", True)):
                got = fa.flash_attention_backward(g, q, k, v, out, lse, causal=causal, fp8_products=fp8)
                row[name] = {n: dict(rel=_rel(x.float(), e), cos=_cos(x.float(), e),
                                     finite=bool(torch.isfinite(x).all())) for n, x, e in zip("qkv", got, exact)}
            _log("backward accuracy", row)
            res["accuracy"].append(row)
    for d in HEADS:
        h = HEADS[d]
        for seq in SEQS[:1] if quick else SEQS:
            b = TOKENS // seq
            for causal in (False, True):
                q, k, v, g = (torch.randn(b, seq, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                out, lse = fa.flash_attention_forward(q, k, v, causal=causal)
                flops = 10 * b * h * seq * seq * d / (2 if causal else 1)
                row = dict(head_dim=d, seq=seq, batch=b, heads=h, causal=causal, ms={})
                row["ms"]["ours_bf16"] = _bench(
                    lambda: fa.flash_attention_backward(g, q, k, v, out, lse, causal=causal))
                row["ms"]["ours_fp8_products"] = _bench(
                    lambda: fa.flash_attention_backward(g, q, k, v, out, lse, causal=causal, fp8_products=True))
                qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
                from torch.nn.attention import SDPBackend, sdpa_kernel

                try:
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                        gt = g.transpose(1, 2)
                        row["ms"]["sdpa_cudnn"] = _bench(lambda: torch.autograd.grad(o, (qt, kt, vt), gt,
                                                                                     retain_graph=True))
                except Exception as e:  # noqa: BLE001
                    row["sdpa_cudnn_error"] = repr(e)[:300]
                row["tflops"] = {n: flops / (ms * 1e-3) / 1e12 for n, ms in row["ms"].items()}
                row["fp8_vs_bf16"] = row["ms"]["ours_bf16"] / row["ms"]["ours_fp8_products"]
                _log("backward", {k_: (round(x, 1) if isinstance(x, float) else x) for k_, x in row.items()
                                  if k_ not in ("ms",)})
                res["speed"].append(row)
                del q, k, v, g, out, lse, qt, kt, vt
                torch.cuda.empty_cache()
    return res


def plot_backward(path, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.load(open(path))
    rows = res["backward"]["speed"]
    names = ["sdpa_cudnn", "ours_bf16", "ours_fp8_products"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        ax.bar([x + i * width for x in range(len(rows))], [r["tflops"].get(n, 0) for r in rows], width, label=n)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))],
                  [f"d{r['head_dim']} {r['seq'] // 1024}k {'c' if r['causal'] else 'f'}" for r in rows])
    ax.set_ylabel("backward TFLOP/s")
    ax.set_title(f"attention backward, 16k tokens/batch, bf16 inputs ({res['env']['gpu']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plot", help="make the PNG from this results JSON and exit")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="first time candidate kernel configs; the run uses the best")
    ap.add_argument("--no-precompile", action="store_true", help="compile in the timing process only")
    ap.add_argument("--one-precompile", action="store_true", help="compile sweep and tables in one stage")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--sweep-budget", type=float, default=190.0,
                    help="--decode-only: seconds from the start after which the launch sweep stops timing")
    ap.add_argument("--decode-only", action="store_true",
                    help="decode checks, FP4 decode launch sweep and the decode table only (lowbit_decode.json)")
    ap.add_argument("--backward-only", action="store_true",
                    help="the attention backward table only, bf16 vs FP8 products (lowbit_attention_backward.json)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if args.plot:
        (plot_backward if "backward" in os.path.basename(args.plot) else plot)(
            args.plot, os.path.splitext(args.plot)[0] + ".png")
        return
    os.makedirs(args.out, exist_ok=True)
    res = dict(env=_env())
    _log(res["env"])
    if args.decode_only:
        return decode_only(args)
    if args.backward_only:
        res["backward"] = backward_cases(args.quick)
        path = os.path.join(args.out, "lowbit_attention_backward.json")
        json.dump(res, open(path, "w"), indent=1)
        plot_backward(path, os.path.splitext(path)[0] + ".png")
        return
    path = os.path.join(args.out, "lowbit_attention.json")
    steps = [("checks", gpu_checks), ("prefill", prefill_cases), ("e2e_breakdown", e2e_breakdown)]
    if not args.skip_decode:
        steps.append(("decode", decode_cases))
    if args.sweep:
        steps.insert(0, ("sweep", sweep))
    if args.one_precompile and not args.no_precompile:  # everything in one parallel stage (default configs)
        global PRECOMPILED
        tasks = [("variant", v, {}) for v in (_sweep_variants() if args.sweep else [])]
        tasks += [("checks", None, {})] + [("prefill", (d, c), {}) for d in HEADS for c in (False, True)]
        res["precompile_errors"] = precompile(tasks + ([] if args.skip_decode else [("decode", None, {})]))
        PRECOMPILED = True
    for name, fn in steps:
        if name == "checks" and not args.no_precompile and not PRECOMPILED:  # compile with the sweep winners
            from hf_fastpath.kernels import lowbit_attention as kla
            from hf_fastpath.kernels import lowbit_decode as ld

            over = dict(prefill=dict(kla.CONFIG_OVERRIDE), decode=dict(ld.DECODE_CONFIG_OVERRIDE))
            tasks = [("checks", None, over), ("decode", None, over)]
            tasks += [("prefill", (d, c), over) for d in HEADS for c in (False, True)]
            res["precompile_errors"] = precompile(tasks)
        try:
            res[name] = fn() if name in ("checks", "sweep") else fn(args.quick)
        except Exception as e:
            res[name + "_error"] = traceback.format_exc()
            _log(res[name + "_error"])
        json.dump(res, open(path, "w"), indent=1)
    _log("wrote", path)


if __name__ == "__main__":
    main()
