"""FP8 attention forward on Hopper: the Gluon kernel (`kernels/gluon_lowbit_attention.py`) beside the Triton FP8 kernel
it replaces (same pre-quantized e4m3 inputs), SDPA's cuDNN kernel and our Gluon kernel in bf16, and the whole
`fp8_attention` call (quantizing Q/K/V with the Hadamard rotation, the kernel, the rotation back). 16k tokens a
batch, hd 64 (32 heads) and 128 (32 query / 8 KV heads), causal and not; median of `triton.testing.do_bench`.
TFLOP/s count 4 * B * H * S^2 * D (half when causal). Accuracy beside speed: relative error of each FP8 output
against float64 attention of the bf16 inputs (first sequence, first 4 query heads).

    python benchmarks/gluon_lowbit_attention.py           # GPU: benchmarks/results/gluon_lowbit_attention.json
    python benchmarks/gluon_lowbit_attention.py --plot F  # no GPU needed: PNG beside the JSON F
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gluon_lowbit_attention.json")
TOKENS = 16384
HEADS = {64: (32, 32), 128: (32, 8)}
SEQS = (1024, 4096, 16384)


def _log(*a):
    print(*a, file=sys.stderr, flush=True)


def _rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def run(out_path, head_dims):
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hf_fastpath.attention import lowbit, reference
    from hf_fastpath.kernels import gluon_attention as ga
    from hf_fastpath.kernels import gluon_lowbit_attention as gla
    from hf_fastpath.kernels import lowbit_attention as kla
    from hf_fastpath.kernels import row_quant

    rows = []
    for d in head_dims:
        hq, hkv = HEADS[d]
        for s in SEQS:
            for causal in (False, True):
                b = TOKENS // s
                torch.manual_seed(0)
                q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
                k, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                cu = torch.arange(b + 1, device="cuda", dtype=torch.int32) * s
                q8, qs = row_quant.quantize_e4m3_rows(q, "fp8")
                k8, ks = row_quant.quantize_e4m3_rows(k, "fp8")
                vt8, vs = row_quant.quantize_e4m3_rows(v, "fp8", transpose=True)

                def fp8_kernel(gluon, p_in_regs=True):
                    def f():
                        kla.USE_GLUON = gluon
                        gla.P_IN_REGS = p_in_regs
                        return kla.lowbit_flash_forward(q8, qs, k8, ks, vt8, vs, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                        max_seqlen_q=s, causal=causal)[0].view(b, s, hq, d)
                    return f

                def sdpa_cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(
                            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                            enable_gqa=hq != hkv).transpose(1, 2)

                def fp8_e2e():
                    kla.USE_GLUON = True
                    gla.P_IN_REGS = True
                    return lowbit.fp8_attention(q, k, v, causal=causal)

                variants = {"gluon_fp8": fp8_kernel(True), "gluon_fp8_p_smem": fp8_kernel(True, False),
                            "triton_fp8": fp8_kernel(False), "sdpa_cudnn": sdpa_cudnn,
                            "gluon_bf16": lambda: ga.gluon_attention_forward(q, k, v, causal=causal)[0],
                            "gluon_fp8_e2e": fp8_e2e}
                # float64 reference on the first sequence's first 4 query heads (and their KV heads) only: memory
                hk = max(4 * hkv // hq, 1)
                ref = reference.attention_forward(q[:1, :, :4].double(), k[:1, :, :hk].double(),
                                                  v[:1, :, :hk].double(), causal=causal)[0]
                flops = 4 * b * hq * s * s * d / (2 if causal else 1)
                row = dict(head_dim=d, seq=s, batch=b, heads=hq, kv_heads=hkv, causal=causal, ms={}, tflops={},
                           rel_err={})
                for name, fn in variants.items():
                    with torch.no_grad():
                        row["rel_err"][name] = _rel(fn()[:1, :, :4], ref)
                        ms = triton.testing.do_bench(fn, warmup=50, rep=300)
                    row["ms"][name] = ms
                    row["tflops"][name] = flops / ms / 1e9
                t = row["tflops"]
                row["ratios"] = {"gluon_fp8/sdpa_cudnn": t["gluon_fp8"] / t["sdpa_cudnn"],
                                 "gluon_fp8/triton_fp8": t["gluon_fp8"] / t["triton_fp8"],
                                 "gluon_fp8/gluon_bf16": t["gluon_fp8"] / t["gluon_bf16"],
                                 "gluon_fp8_e2e/sdpa_cudnn": t["gluon_fp8_e2e"] / t["sdpa_cudnn"]}
                _log(f"hd{d} s{s} {'causal' if causal else 'full'}:",
                     {k: round(x, 1) for k, x in t.items()}, {k: round(x, 2) for k, x in row["ratios"].items()},
                     {k: round(x, 4) for k, x in row["rel_err"].items()})
                rows.append(row)
                with open(out_path, "w") as f:  # as it goes: a killed run keeps its rows
                    json.dump(dict(meta=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                             triton=triton.__version__, date=datetime.date.today().isoformat(),
                                             tokens=TOKENS), rows=rows), f, indent=1)
                torch.cuda.empty_cache()
    kla.USE_GLUON = False


def plot(path, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.load(open(path))["rows"]
    names = ("gluon_fp8", "triton_fp8", "gluon_fp8_e2e", "gluon_bf16", "sdpa_cudnn")
    labels = [f"hd{r['head_dim']} {r['seq'] // 1024}k {'c' if r['causal'] else 'f'}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, len(rows)), 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar([x + i * width for x in range(len(rows))], [r["tflops"].get(name, 0) for r in rows], width,
               label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], labels, rotation=30, ha="right")
    ax.set_ylabel("TFLOP/s (forward)")
    ax.set_title("FP8 attention forward, H200, 16k tokens a batch")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=RESULTS)
    ap.add_argument("--plot", metavar="PNG", help="draw the JSON (--json) to this PNG; without a GPU, only that")
    ap.add_argument("--head-dims", type=int, nargs="*", default=[128, 64])
    args = ap.parse_args()
    if args.plot:
        plot(args.json, args.plot)
        return
    run(args.json, args.head_dims)


if __name__ == "__main__":
    main()
