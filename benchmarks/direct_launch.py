"""Direct kernel launches (`hf_fastpath/kernels/launch.py`) against Triton's own launch path, on the GPU.

    python benchmarks/direct_launch.py [--out benchmarks/results/direct_launch.json]

Correctness: the W4A16 decode kernel (outputs against the float reference, misaligned inputs included) and the
low-bit KV-cache decode (fp8 / mxfp4 / nvfp4, bit for bit: no atomics there). Host time: µs per call with the
launch cache off and on, without waiting for the GPU (`host`) and with (`wall`); equal figures mean the call is
host-bound. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _host_wall(fn, calls=500):
    from benchmarks.host_time import host_and_wall

    return tuple(round(t * 1e6, 1) for t in host_and_wall(fn, calls, warmup=50))


def check_w4a16():
    """Direct launches against Triton's launch path (LaunchCache disabled) on assorted shapes, 16-byte aligned and
    misaligned activations, split-K and not, group 128 and 32; each case runs the Triton path, then the direct path
    twice (cache miss, then hit). Split-K sums in fp32 atomics, whose order varies from run to run, so the outputs
    are compared with the float reference: a kernel compiled for other argument properties would be far off."""
    from hf_fastpath.kernels import w4a16 as kernels

    cache = kernels._DECODE_LAUNCH
    worst, bad = {}, []
    for k, n, gs in ((4096, 14336, 128), (4096, 4096, 32), (1536, 1000, 128)):
        codes = torch.randint(0, 16, (k, n), device="cuda", dtype=torch.int32)
        qw = kernels.w4a16_pack(codes)
        s = torch.rand(k // gs, n, device="cuda", dtype=torch.bfloat16) / 64
        z = torch.randint(0, 16, (k // gs, n), device="cuda").to(torch.bfloat16)
        w = kernels.w4a16_dequantize(qw, s, z, gs).float()
        for m in (1, 3, 8, 16, 33, 64, 192):
            base = torch.randn(m, k + 8, device="cuda", dtype=torch.bfloat16)
            for x in (base[:, :k], base[:, 1:k + 1]):  # aligned; 2 bytes past alignment with a non-multiple stride
                ref = x.float() @ w
                for path, enabled in (("triton", False), ("direct_miss", True), ("direct_hit", True)):
                    cache.enabled = enabled
                    err = ((kernels.w4a16_matmul(x, qw, s, z, gs).float() - ref).abs().max() / ref.abs().max()).item()
                    worst[path] = max(worst.get(path, 0.0), err)
                    if not err < 1e-2:
                        bad.append(dict(k=k, n=n, group=gs, m=m, aligned=x.data_ptr() % 16 == 0, path=path, err=err))
    cache.enabled = True
    return dict(worst_relative_error=worst, failures=bad, cached_kernels=len(cache._kernels))


def check_lowbit_decode():
    """lowbit_decode with the launch caches off, then on twice (miss, hit): bit-identical outputs and lse, on MHA and
    GQA, 1 to 4097 cached tokens, every format and both FP4 kernels; then host µs per call at 32k tokens."""
    from hf_fastpath.kernels import lowbit_decode as ld
    from hf_fastpath.kernels import lowbit_quant as lq
    from hf_fastpath.kernels import split_kv
    from hf_fastpath.kernels.launch import cache_of

    caches = [cache_of(fn) for fn in (ld._decode_fp4_kernel, ld._decode_split_kernel, split_kv._merge_kernel)]

    def use_cache(on):
        for c in caches:
            c.enabled = on

    def cache_views(b, hkv, s, d, fmt, gen):
        k, v = (torch.randn(b, hkv, s, d, device="cuda", generator=gen) for _ in range(2))
        qk, qv = lq.quantize_rows(k, fmt), lq.quantize_rows(v, fmt)
        return (qk.data, qk.scale, qk.block_scale), (qv.data, qv.scale, qv.block_scale)

    res = dict(cases=0, mismatches=[], host_us_32k={})
    for fmt in ("fp8", "mxfp4", "nvfp4"):
        for kernel in ("rows", "tile") if fmt != "fp8" else ("tile",):
            ld.DECODE_CONFIG_OVERRIDE[fmt] = {"fp4_kernel": kernel}
            for b, hq, hkv, s, d in ((1, 32, 8, 1, 128), (2, 8, 2, 37, 64), (1, 32, 8, 4097, 128),
                                     (3, 16, 4, 1000, 128)):
                gen = torch.Generator(device="cuda").manual_seed(s)
                q = torch.randn(b, hq, d, device="cuda", generator=gen).bfloat16()
                kc, vc = cache_views(b, hkv, s + 5, d, fmt, gen)
                outs = []
                for on in (False, True, True):
                    use_cache(on)
                    outs.append(ld.lowbit_decode(q, kc, vc, s, fmt=fmt, softmax_scale=0.2))
                res["cases"] += 1
                if not all(torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1]) for o in outs[1:]):
                    res["mismatches"].append(dict(fmt=fmt, kernel=kernel, b=b, hq=hq, hkv=hkv, s=s, d=d))
            ld.DECODE_CONFIG_OVERRIDE.pop(fmt)
        gen = torch.Generator(device="cuda").manual_seed(0)
        kc, vc = cache_views(1, 8, 32768, 128, fmt, gen)
        q = torch.randn(1, 32, 128, device="cuda", generator=gen).bfloat16()
        for on in (False, True):
            use_cache(on)
            res["host_us_32k"][f"{fmt}_{'direct' if on else 'triton'}"] = _host_wall(
                lambda: ld.lowbit_decode(q, kc, vc, 32768, fmt=fmt))
    use_cache(True)
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "direct_launch.json"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(), w4a16=check_w4a16(),
               lowbit_decode=check_lowbit_decode())
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
