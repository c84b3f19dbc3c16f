"""QLoRA training benchmark (GPU): tokens/s and peak memory of one LoRA training step at sequence 2048.

    python benchmarks/qlora.py                    # -> benchmarks/results/qlora.json and qlora.png
    python benchmarks/qlora.py --plot FILE.json   # redraw the PNG (no GPU needed)

Three ways to fine-tune the same randomly initialised Llama-shaped model (random weights: same shapes, same speed),
all with PEFT LoRA r=16 on every linear, gradient checkpointing, AdamW, batch 1 x 2048 tokens, bf16:
  bf16_lora       peer: bf16 base weights, SDPA attention (plain LoRA)
  dequant_qlora   peer: 4-bit base weights dequantized for every matmul, forward and again in backward (the way
                  bitsandbytes / gptqmodel train; the dequantization itself uses hf_fastpath's fast Triton kernel and
                  the matmul cuBLAS), SDPA attention
  fastpath_qlora  hf_fastpath: W4A16Linear on the Triton W4A16 kernels (forward, input gradient), W4A16LoraLinear,
                  `fastpath` attention
The 4-bit weights come from RTN (group 128) of the bf16 model, on the GPU. Models: SmolLM2-135M shape and Llama-3-8B
shape. Step time: median of `triton.testing.do_bench` over whole training steps (forward, backward, optimizer).
Peak memory: torch.cuda.max_memory_allocated over one step, the model included. Correctness: the two QLoRA variants
compute the same loss and LoRA gradients (checked before timing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results")

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         num_hidden_layers=30, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      num_hidden_layers=32, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
    # a CPU dry run of this script (TRITON_INTERPRET=1 python benchmarks/qlora.py --dry-run)
    "tiny": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=2, vocab_size=256, tie_word_embeddings=False),
}
DEVICE = "cuda"
GROUP = 128


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# the dequantize-then-matmul peer


class _DequantMatmul(torch.autograd.Function):
    """y = x @ dequant(W); backward dequantizes again (nothing but the packed weight is kept between the two)."""

    @staticmethod
    def forward(ctx, x, layer):
        from hf_fastpath.kernels.w4a16 import w4a16_dequantize

        ctx.layer = layer
        w = w4a16_dequantize(layer.qweight, layer.scales, layer.zeros, layer._effective_group_size)
        return x @ w

    @staticmethod
    def backward(ctx, dy):
        from hf_fastpath.kernels.w4a16 import w4a16_dequantize

        layer = ctx.layer
        w = w4a16_dequantize(layer.qweight, layer.scales, layer.zeros, layer._effective_group_size)
        return dy @ w.t(), None


def dequant_forward(self, x):
    lead = x.shape[:-1]
    y = _DequantMatmul.apply(x.reshape(-1, self.in_features), self)
    if self.bias is not None:
        y = y + self.bias
    return y.reshape(*lead, self.out_features)


# ---------------------------------------------------------------------------------------------------------------------
# one configuration


def set_attention(model, name):
    try:
        model.set_attn_implementation(name)
    except Exception:  # older Transformers
        model.config._attn_implementation = name


def make_peft(model, seed=0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def train_step_fn(model, ids):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def measure(model, ids, label, rep_ms):
    import triton

    step = train_step_fn(model, ids)
    step()  # compile / autotune outside the timing
    if DEVICE == "cpu":  # dry run: check that everything runs
        t0 = time.perf_counter()
        step()
        ms = (time.perf_counter() - t0) * 1e3
        log(f"  {label:15s} {ms:8.1f} ms/step (CPU dry run)")
        return {"step_ms": ms, "tokens_per_s": ids.numel() / ms * 1e3, "peak_gib": 1.0}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    ms = triton.testing.do_bench(step, warmup=max(200, rep_ms // 4), rep=rep_ms, return_mode="median")
    tokens = ids.numel()
    out = {"step_ms": ms, "tokens_per_s": tokens / ms * 1e3, "peak_gib": peak}
    log(f"  {label:15s} {ms:8.1f} ms/step  {out['tokens_per_s']:10,.0f} tokens/s  peak {peak:6.2f} GiB")
    return out


def lora_grads(model):
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def check_same(model, ids, use_peer):
    """Loss and LoRA gradients of the fastpath QLoRA vs the dequantize peer on the same model and adapter."""
    from hf_fastpath.quantization.linear import W4A16Linear

    results = []
    original = W4A16Linear.forward
    for peer in (True, False):
        if peer:
            W4A16Linear.forward = dequant_forward
        try:
            use_peer(peer)
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            results.append((loss.item(), lora_grads(model)))
        finally:
            W4A16Linear.forward = original
    model.zero_grad(set_to_none=True)
    (l_peer, g_peer), (l_fast, g_fast) = results
    rel = max(((g_fast[n] - g_peer[n]).norm() / g_peer[n].norm().clamp_min(1e-30)).item() for n in g_peer)
    return {"loss_peer": l_peer, "loss_fastpath": l_fast, "max_rel_grad_diff": rel}


def bench_shape(name, seq, rep_ms):
    import transformers

    from hf_fastpath.quantization.calibrate import quantize_model
    from hf_fastpath.quantization.config import W4A16Config
    from hf_fastpath.quantization.linear import W4A16Linear
    from hf_fastpath.quantization.training import prepare_model_for_qlora

    config = transformers.LlamaConfig(**SHAPES[name], max_position_embeddings=max(4096, seq))
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(DEVICE):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    params = sum(p.numel() for p in model.parameters())
    log(f"{name}: {params / 1e9:.2f}B parameters, built in {time.perf_counter() - t0:.1f} s")
    g = torch.Generator(device=DEVICE).manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, seq), device=DEVICE, generator=g)
    result = {"parameters": params, "seq_len": seq, "batch": 1}

    prepare_model_for_qlora(model)
    peft_model = make_peft(model)
    result["bf16_lora"] = measure(peft_model, ids, "bf16_lora", rep_ms)
    model = peft_model.unload()
    del peft_model
    torch.cuda.empty_cache()

    t0 = time.perf_counter()
    quantize_model(model, W4A16Config(method="rtn", bits=4, group_size=GROUP, sym=False))
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    result["rtn_seconds"] = time.perf_counter() - t0
    result["quantized_linears"] = sum(isinstance(m, W4A16Linear) for m in model.modules())
    torch.cuda.empty_cache()
    peft_model = make_peft(model)
    peft_model.train()

    def use_peer(peer):
        set_attention(peft_model.get_base_model(), "sdpa" if peer else "fastpath")

    result["check"] = check_same(peft_model, ids, use_peer)
    log(f"  check: {result['check']}")
    original = W4A16Linear.forward
    W4A16Linear.forward = dequant_forward
    try:
        use_peer(True)
        result["dequant_qlora"] = measure(peft_model, ids, "dequant_qlora", rep_ms)
    finally:
        W4A16Linear.forward = original
    use_peer(False)
    result["fastpath_qlora"] = measure(peft_model, ids, "fastpath_qlora", rep_ms)
    f, d, b = result["fastpath_qlora"], result["dequant_qlora"], result["bf16_lora"]
    result["ratios"] = {
        "throughput_vs_dequant_qlora": f["tokens_per_s"] / d["tokens_per_s"],
        "throughput_vs_bf16_lora": f["tokens_per_s"] / b["tokens_per_s"],
        "memory_vs_bf16_lora": f["peak_gib"] / b["peak_gib"],
        "memory_vs_dequant_qlora": f["peak_gib"] / d["peak_gib"],
    }
    log(f"  ratios: {result['ratios']}")
    del peft_model, model
    torch.cuda.empty_cache()
    return result


def run(args):
    import peft
    import transformers
    import triton

    results = {
        "what": "LoRA training step (r=16, all-linear, grad checkpointing, AdamW), batch 1 x seq tokens, bf16",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU dry run",
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__, "python": platform.python_version(), "cuda": torch.version.cuda},
        "targets": {"memory_vs_bf16_lora_large": "<= 0.35", "throughput_vs_dequant_qlora": ">= 1.5",
                    "throughput_vs_bf16_lora": ">= 1.0"},
        "shapes": {},
    }
    out_dir = os.environ.get("OUT") or RESULTS
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "qlora.json")
    for name in args.shapes:
        try:
            results["shapes"][name] = bench_shape(name, args.seq, args.rep_ms)
        except Exception as error:  # keep the other shape's figures
            import traceback

            traceback.print_exc()
            results["shapes"][name] = {"error": f"{type(error).__name__}: {error}"}
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    log(f"wrote {path}")
    plot(results, os.path.join(out_dir, "qlora.png"))


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = [s for s, r in results["shapes"].items() if "error" not in r]
    variants = [("bf16_lora", "bf16 LoRA + SDPA (peer)", "tab:gray"),
                ("dequant_qlora", "QLoRA dequantize+matmul (peer)", "tab:orange"),
                ("fastpath_qlora", "hf_fastpath QLoRA", "tab:blue")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.27
    for ax, key, title in ((axes[0], "tokens_per_s", "training throughput (tokens/s, higher is better)"),
                           (axes[1], "peak_gib", "peak GPU memory (GiB, lower is better)")):
        for i, (v, label, color) in enumerate(variants):
            vals = [results["shapes"][s][v][key] for s in shapes]
            # normalised to the bf16 LoRA peer so both shapes share an axis; absolute figures on the bars
            rel = [val / results["shapes"][s]["bf16_lora"][key] for val, s in zip(vals, shapes)]
            bars = ax.bar([x + (i - 1) * width for x in range(len(shapes))], rel, width, label=label, color=color)
            for bar, val in zip(bars, vals):
                ax.annotate(f"{val:,.0f}" if key == "tokens_per_s" else f"{val:.1f}", (bar.get_x() + width / 2,
                            bar.get_height()), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes)
        ax.set_ylabel("relative to bf16 LoRA")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle(f"QLoRA step, seq {results['shapes'][shapes[0]]['seq_len'] if shapes else '?'}, {results['gpu']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama3-8b"], choices=list(SHAPES))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--rep-ms", type=int, default=2000, help="do_bench repetition time per variant")
    p.add_argument("--plot", metavar="JSON", help="only redraw the PNG from a result file")
    p.add_argument("--dry-run", action="store_true", help="tiny shape on the CPU (with TRITON_INTERPRET=1)")
    args = p.parse_args()
    if args.dry_run:
        global DEVICE
        DEVICE = "cpu"
        args.shapes, args.seq = ["tiny"], 32
        os.environ.setdefault("OUT", "/tmp/qlora_dry_run")
        run(args)
        return
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), os.path.splitext(args.plot)[0] + ".png")
        return
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/qlora.py needs a CUDA GPU (see benchmarks/qlora_convergence.py for the CPU run)")
    run(args)


if __name__ == "__main__":
    main()
