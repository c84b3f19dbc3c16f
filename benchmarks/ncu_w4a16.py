"""One W4A16 GEMM call between cudaProfilerStart / Stop, for Nsight Compute (works on the lent H200: docs/w4a16.md):

  ncu --clock-control none --profile-from-start off --set full --import-source yes -o /tmp/w4 -f \\
      python benchmarks/ncu_w4a16.py --kernel gluon --m 1 --k 4096 --n 14336
  ncu -i /tmp/w4.ncu-rep --page details --csv > details.csv   # the ~40 MB report does not come back: export CSVs
  ncu -i /tmp/w4.ncu-rep --page source --csv --print-source sass > sass.csv   # stall samples per instruction

--kernel: gluon (the Gluon GEMM as dispatched: scales by TMA where it applies), gluon_load (its scales loaded by the
consumers), fused (the plain-Triton fused kernel), cublas (x @ W with W dequantized to 16 bits beforehand).
Random weights, group 128, bf16. Warm-up calls (compilation) run before the profiler starts.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

GROUP = 128


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", choices=("gluon", "gluon_load", "fused", "cublas"), default="gluon")
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=14336)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from hf_fastpath.kernels.gluon_w4a16 import gluon_w4a16_matmul
    from hf_fastpath.kernels.w4a16 import _decode_matmul, w4a16_dequantize
    from hf_fastpath.kernels.w4a16_layout import w4a16_pack

    k, n, m = args.k, args.n, args.m
    qweight = w4a16_pack(torch.randint(0, 16, (k, n), device="cuda"))
    scales = (torch.rand(k // GROUP, n, device="cuda") * 0.05 + 0.005).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (k // GROUP, n), device="cuda").to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    dense = w4a16_dequantize(qweight, scales, zeros, GROUP)
    calls = {
        "gluon": lambda: gluon_w4a16_matmul(x, qweight, scales, zeros, GROUP),
        "gluon_load": lambda: gluon_w4a16_matmul(x, qweight, scales, zeros, GROUP, scales_by="load"),
        "fused": lambda: _decode_matmul(x, qweight, scales, zeros, GROUP, x.new_empty(m, n)),
        "cublas": lambda: x @ dense,
    }
    profile_once(calls[args.kernel])
    print(f"{args.kernel} M={m} K={k} N={n}: profiled one call")


def profile_once(call, warmup=3):
    """Warm-up calls (compilation), then one call between cudaProfilerStart / Stop (ncu --profile-from-start off)."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
