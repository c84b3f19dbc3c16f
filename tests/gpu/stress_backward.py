"""Stress check of the Gluon attention forward + backward for rare non-finite results (a GPU script, not collected
by pytest). Several processes share the GPU, each doing what a pytest worker of the GPU tests does: the Gluon
forward, now and then the float64 reference (its memory churn), the Gluon backward and the Triton backward, and
checks out, dq, dk and dv for NaN / inf. On a failure it reports where the bad values sit, whether a rerun of the
forward is bitwise equal, and how many of 20 backward reruns on the same out / lse fail again.

    TRITON_INTERPRET=0 python tests/gpu/stress_backward.py --seconds 190 --processes 4 --head-dims 160 256

Session 32 found the tile-256 NaN of sessions 25-31 this way: 123 failures in 10,065 calls of one process (hd160 and
hd256, causal), none in the pytest runs of most sessions; 0 in 20,441 calls after the fix. One JSON line per
failure and one summary line per process."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

SHAPES = [(1, 2049, 32, 8, True), (1, 2049, 4, 4, True), (1, 1000, 32, 8, True), (1, 2049, 32, 8, False),
          (2, 129, 32, 8, True), (1, 1000, 4, 4, False)]  # (batch, length, query heads, kv heads, causal)


def worker(seconds: float, seed: int, head_dims: list[int]) -> None:
    from hf_fastpath.attention import reference
    from hf_fastpath.kernels import gluon_attention as ga
    from hf_fastpath.kernels import gluon_attention_bwd as gb
    from hf_fastpath.kernels.flash_attention import flash_attention_backward

    from tests.gpu.common import attention_inputs, nonfinite_where

    t0, n, fails = time.time(), 0, 0
    while time.time() - t0 < seconds:
        b, s, hq, hkv, causal = SHAPES[n % len(SHAPES)]
        d = head_dims[(n // len(SHAPES)) % len(head_dims)]
        q, k, v, do = attention_inputs(b, s, s, hq, hkv, d, seed=seed * 1_000_003 + n, dout=True)
        out, lse = ga.gluon_attention_forward(q, k, v, causal=causal)
        if n % 4 == 0:
            d64 = [t.double() for t in (q, k, v, do)]
            ref_out, ref_lse = reference.attention_forward(*d64[:3], causal=causal)
            reference.attention_backward(d64[3], *d64[:3], ref_out, ref_lse, causal=causal)
            del d64, ref_out, ref_lse
        dq, dk, dv = gb.gluon_attention_backward(do, q, k, v, out, lse, causal=causal)
        flash_attention_backward(do, q, k, v, out, lse, causal=causal)
        n += 1
        where = nonfinite_where(dict(out=out, dq=dq, dk=dk, dv=dv))  # [B, S, H, D]: dim1 rows, dim2 heads
        if not where:
            continue
        fails += 1
        rec = dict(call=n, shape=dict(batch=b, seq=s, heads=[hq, hkv], head_dim=d, causal=causal), nonfinite=where)
        out2, lse2 = ga.gluon_attention_forward(q, k, v, causal=causal)
        rec["forward_rerun_equal"] = bool(torch.equal(out2, out) and torch.equal(lse2, lse))
        rec["backward_reruns_failing"] = sum(
            bool(nonfinite_where(dict(zip("qkv", gb.gluon_attention_backward(do, q, k, v, out, lse, causal=causal)))))
            for _ in range(20))
        print(json.dumps(rec), flush=True)
    print(json.dumps(dict(seed=seed, calls=n, failures=fails, seconds=round(time.time() - t0))), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=190)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[160, 256])
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # the seed of one worker process
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.seconds, args.worker, args.head_dims)
        return
    cmd = [sys.executable, os.path.abspath(__file__), "--seconds", str(args.seconds), "--head-dims",
           *map(str, args.head_dims)]
    procs = [subprocess.Popen([*cmd, "--worker", str(seed)]) for seed in range(1, args.processes + 1)]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
