"""Where low-bit attention's error comes from, on real SmolLM2-135M activations (CPU, float emulation).

    python benchmarks/lowbit_error_budget.py [--windows 2] [--seq 384]

Every layer's attention is computed exactly (the model keeps running on it) and again with one source of rounding
at a time, after the Hadamard rotation the kernels use: Q, K or V quantized per token (FP8 e4m3, or MXFP4/NVFP4
blocks), P rounded to e4m3 as the kernel does, or all of them; plus "smoothed" Q/K: a per-channel bias b removed
before quantization and added back exactly (q.(k - b) + q.b), with b the mean of all tokens in earlier 64-token
blocks (causally safe: a later token never changes an earlier output) or, as an upper bound, of the whole sequence.
Reports per-layer cosine similarity and relative error against exact attention, min/mean over layers.
Writes benchmarks/results/lowbit_error_budget.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # plain torch emulation
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from hf_fastpath.kernels import lowbit_quant as lq  # noqa: E402
from hf_fastpath.kernels.lowbit_attention import P_SCALE  # noqa: E402

BLOCK = 64  # key/query block of the causally safe smoothing bias


def fp8(x):
    q, s = lq.quantize_fp8(x, check=False)
    return q.float() * s[..., None]


def fp4(fmt):
    return lambda x: lq.dequantize_rows(lq.quantize_rows(x, fmt, check=False)).float()


def p_e4m3(p):
    return (p * P_SCALE).to(torch.float8_e4m3fn).float() / P_SCALE


def bias_prefix_blocks(x):
    """Per token: the mean of all tokens in earlier BLOCK-token blocks (zero in the first block)."""
    b = torch.zeros_like(x)
    csum = torch.cumsum(x, 0)
    for start in range(BLOCK, x.shape[0], BLOCK):
        b[start:start + BLOCK] = csum[start - 1] / start
    return b


def bias_whole(x):
    return x.mean(0, keepdim=True).expand_as(x)


def smoothed(quant, bias):
    return lambda x: quant(x - bias(x)) + bias(x)


def variants():
    ident = None
    out = {}
    for name, quant in (("fp8", fp8), ("mxfp4", fp4("mxfp4")), ("nvfp4", fp4("nvfp4"))):
        out[f"{name}_q"] = (quant, ident, ident, False)
        out[f"{name}_k"] = (ident, quant, ident, False)
        out[f"{name}_v"] = (ident, ident, quant, False)
        out[f"{name}_all"] = (quant, quant, quant, True)
        out[f"{name}_all_smooth_prefix"] = (smoothed(quant, bias_prefix_blocks), smoothed(quant, bias_prefix_blocks),
                                            quant, True)
        out[f"{name}_all_smooth_whole"] = (smoothed(quant, bias_whole), smoothed(quant, bias_whole), quant, True)
    out["p_e4m3"] = (ident, ident, ident, True)
    return out


def attend(q, k, v, scale, round_p):
    """q [S, H, D], k/v [S, Hkv, D] fp32, causal -> [S, H, D]."""
    s_len, h, _ = q.shape
    rep = h // k.shape[1]
    qf, kf, vf = q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(rep, 0), v.transpose(0, 1).repeat_interleave(
        rep, 0)
    s = torch.einsum("hqd,hkd->hqk", qf, kf) * scale
    visible = torch.arange(s_len)[None, :] <= torch.arange(s_len)[:, None]
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    norm = p.sum(-1, keepdim=True)
    if round_p:
        p = p_e4m3(p)
    return (torch.einsum("hqk,hkd->hqd", p, vf) / norm).transpose(0, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--seq", type=int, default=384)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    import lowbit_accuracy

    from hf_fastpath.attention.lowbit import hadamard
    from hf_fastpath.integrations.smollm2 import load_smollm2
    from hf_fastpath.quantization.data import load_texts, tokenize_stream

    cases = variants()
    stats = {name: [] for name in cases}

    def probe(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        q, k, v = (x.transpose(1, 2).float()[0] for x in (query, key, value))
        exact = attend(q, k, v, scaling, False)
        rot = hadamard(q.shape[-1], q.device, torch.float32)
        qr, kr, vr = q @ rot, k @ rot, v @ rot
        for name, (fq, fk, fv, round_p) in cases.items():
            got = attend(fq(qr) if fq else qr, fk(kr) if fk else kr, fv(vr) if fv else vr, scaling, round_p) @ rot.t()
            cos = torch.nn.functional.cosine_similarity(got.flatten(), exact.flatten(), 0).item()
            stats[name].append((cos, ((got - exact).norm() / exact.norm()).item()))
        return exact[None].to(query.dtype), None

    model, tok = load_smollm2(dtype=torch.float32)
    stream = tokenize_stream(tok, load_texts("bible-eval"), max_tokens=args.windows * args.seq)
    lowbit_accuracy._register("error_budget", probe)
    model.set_attn_implementation("error_budget")
    with torch.no_grad():
        for i in range(args.windows):
            model(stream[i * args.seq:(i + 1) * args.seq][None])
    table = {}
    for name, rows in stats.items():
        cos = [c for c, _ in rows]
        rel = [r for _, r in rows]
        table[name] = dict(min_cos=min(cos), mean_cos=sum(cos) / len(cos), mean_rel=sum(rel) / len(rel))
        print(f"{name:26s} cos min {table[name]['min_cos']:.5f} mean {table[name]['mean_cos']:.5f} "
              f"rel {table[name]['mean_rel']:.4f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "lowbit_error_budget.json"), "w") as f:
        json.dump(dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       model="SmolLM2-135M-Instruct (GGUF, fp32)", text="KJV New Testament", windows=args.windows,
                       seq=args.seq, smoothing_block=BLOCK, note=__doc__.split("\n\n")[1], variants=table), f, indent=1)


if __name__ == "__main__":
    main()
