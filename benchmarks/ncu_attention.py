"""One Gluon attention call between cudaProfilerStart / Stop, for Nsight Compute (the session-14 profiles of the
Gluon backward came from it; docs/attention.md):

  ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \\
      --section SourceCounters --import-source yes -o /tmp/attn -f \\
      python benchmarks/ncu_attention.py --what bwd --b 4 --s 4096 --h 16 --d 128 --causal
  ncu -i /tmp/attn.ncu-rep --page details --csv > details.csv
  ncu -i /tmp/attn.ncu-rep --page source --csv --print-source sass > sass.csv   # stall samples per instruction

--what: fwd (gluon_attention_forward), bwd (gluon_attention_backward, --variant one of its VARIANTS, default by
head dim), cudnn_bwd (SDPA's cuDNN forward + backward through autograd: the peer's kernels). q, k, v, dout
[B, S, H, D] random bf16. Warm-up calls (compilation) run before the profiler starts.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", choices=("fwd", "bwd", "cudnn_bwd"), default="bwd")
    p.add_argument("--variant", help="gluon_attention_bwd variant (default: by head dim)")
    p.add_argument("--b", type=int, default=4)
    p.add_argument("--s", type=int, default=4096)
    p.add_argument("--h", type=int, default=16)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from ncu_w4a16 import profile_once  # benchmarks/ncu_w4a16.py
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hf_fastpath.kernels.gluon_attention import gluon_attention_forward
    from hf_fastpath.kernels.gluon_attention_bwd import gluon_attention_backward

    q, k, v, dout = (torch.randn(args.b, args.s, args.h, args.d, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    out, lse = gluon_attention_forward(q, k, v, causal=args.causal)

    def cudnn_bwd():
        qq, kk, vv = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=args.causal)
        o.backward(dout.transpose(1, 2))

    calls = {
        "fwd": lambda: gluon_attention_forward(q, k, v, causal=args.causal),
        "bwd": lambda: gluon_attention_backward(dout, q, k, v, out, lse, causal=args.causal, variant=args.variant),
        "cudnn_bwd": cudnn_bwd,
    }
    profile_once(calls[args.what])
    print(f"{args.what} {vars(args)}: profiled one call")


if __name__ == "__main__":
    main()
