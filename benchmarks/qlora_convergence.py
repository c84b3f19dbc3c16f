"""QLoRA convergence on a real model: SmolLM2-135M-Instruct, LoRA on the float model vs LoRA on its 4-bit version.

    python benchmarks/qlora_convergence.py              # CPU: 40 steps x 64 tokens, ~18 minutes on one busy core
    python benchmarks/qlora_convergence.py --plot       # redraw the PNG from the JSON
    python benchmarks/qlora_convergence.py --packed build/smollm2_a build/smollm2_b --steps 300 --batch 8 --seq 512
        # GPU (bf16, Triton kernels): the model and tokens from `quant_quality.py pack` (the GPU machine has no
        # tokenizer or GGUF; see that script for the two-call carry); writes qlora_convergence_gpu.json/.png

Both runs start from the same LoRA initialisation (same seed) and see the same King James Bible windows in the same
order; the only difference is the base weights: float (the peer: plain LoRA) or RTN 4-bit, group size 64 (hf_fastpath
QLoRA: W4A16Linear + W4A16LoraLinear; on the CPU the 4-bit layer dequantizes per call, on a GPU the Triton kernels
run — same arithmetic). Output: benchmarks/results/qlora_convergence.json and .png.
"""

from __future__ import annotations

import argparse
import copy
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
JSON_PATH = os.path.join(RESULTS, "qlora_convergence.json")
PNG_PATH = os.path.join(RESULTS, "qlora_convergence.png")


def log(*a):
    print(*a, flush=True)


def windows(tokenizer, steps, batch, seq, seed=0):
    from hf_fastpath.quantization.data import load_texts, tokenize_stream

    stream = tokenize_stream(tokenizer, load_texts("bible-eval"), max_tokens=steps * batch * seq * 4)
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - seq, (steps * batch,), generator=g)
    return torch.stack([stream[s:s + seq] for s in starts.tolist()]).view(steps, batch, seq)


def train(model, data, lr, seed, label):
    from peft import LoraConfig, get_peft_model

    from hf_fastpath.quantization.training import prepare_model_for_qlora

    prepare_model_for_qlora(model, gradient_checkpointing=False)
    torch.manual_seed(seed)  # same LoRA init for both runs
    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    losses = []
    start = time.perf_counter()
    for step, ids in enumerate(data):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ids.is_cuda):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 10 == 0 or step == len(data) - 1:
            log(f"{label}: step {step:3d} loss {losses[-1]:.4f} ({time.perf_counter() - start:.0f} s)")
    return losses, time.perf_counter() - start


def run(args):
    import transformers

    from hf_fastpath.integrations.smollm2 import load_smollm2
    from hf_fastpath.quantization.calibrate import quantize_model
    from hf_fastpath.quantization.config import W4A16Config

    torch.set_num_threads(args.threads)
    if args.packed:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from pathlib import Path

        from quant_quality import build_model, load_packed

        state, config, tokens = load_packed([Path(p) for p in args.packed])
        float_model = build_model(state, config, args.device, torch.bfloat16 if args.device == "cuda" else torch.float32)
        stream = tokens["bible-eval"]
        g = torch.Generator().manual_seed(args.seed)
        starts = torch.randint(0, stream.numel() - args.seq, (args.steps * args.batch,), generator=g)
        data = torch.stack([stream[i:i + args.seq] for i in starts.tolist()]).view(args.steps, args.batch, args.seq)
        data = data.to(args.device)
    else:
        float_model, tokenizer = load_smollm2(dtype=torch.float32)
        data = windows(tokenizer, args.steps, args.batch, args.seq)
    quant_model = copy.deepcopy(float_model)
    quantize_model(quant_model, W4A16Config(method="rtn", bits=4, group_size=64, sym=False))  # 576 = 9 x 64 (128 does not divide it)
    float_losses, float_s = train(float_model, data, args.lr, args.seed, "float LoRA")
    quant_losses, quant_s = train(quant_model, data, args.lr, args.seed, "4-bit QLoRA")
    diff = [q - f for q, f in zip(quant_losses, float_losses)]
    result = {
        "what": "LoRA (r=16, alpha=32, all-linear, AdamW) on SmolLM2-135M-Instruct: float base vs RTN 4-bit g64 base",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": (torch.cuda.get_device_name() + ", bf16") if args.packed and args.device == "cuda" else
                  f"CPU ({platform.processor() or platform.machine()}, {args.threads} threads)",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "peft": __import__("peft").__version__, "python": platform.python_version()},
        "data": f"King James Bible (New Testament) windows, {args.steps} steps x {args.batch} x {args.seq} tokens",
        "lr": args.lr, "seed": args.seed,
        "float_lora_loss": float_losses, "qlora_loss": quant_losses,
        "seconds": {"float_lora": float_s, "qlora": quant_s},
        "summary": {
            "first_loss": {"float": float_losses[0], "qlora": quant_losses[0]},
            "mean_last10": {"float": sum(float_losses[-10:]) / 10, "qlora": sum(quant_losses[-10:]) / 10},
            "mean_abs_gap": sum(abs(d) for d in diff) / len(diff),
            "max_abs_gap": max(abs(d) for d in diff),
            "gap_before_training": diff[0],
            "mean_gap_last10": sum(diff[-10:]) / 10,
        },
    }
    out_dir = args.out or RESULTS
    os.makedirs(out_dir, exist_ok=True)
    stem = "qlora_convergence_gpu" if args.packed else "qlora_convergence"
    with open(os.path.join(out_dir, stem + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    log(json.dumps(result["summary"], indent=1))
    plot(result, os.path.join(out_dir, stem + ".png"))


def plot(result, png_path=PNG_PATH):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(xs, k=5):
        return [sum(xs[max(0, i - k + 1):i + 1]) / len(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]

    fig, (ax, gap_ax) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for key, label, color in (("float_lora_loss", "LoRA on float SmolLM2 (peer)", "tab:gray"),
                              ("qlora_loss", "hf_fastpath QLoRA (4-bit RTN g64)", "tab:blue")):
        ys = result[key]
        ax.plot(ys, color=color, alpha=0.25, linewidth=1)
        ax.plot(smooth(ys), color=color, label=label + ", 5-step mean", linewidth=2)
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(f"SmolLM2-135M, LoRA r=16 all-linear: same init, same batches\n{result['device']}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    # Both runs see the same batch at each step, so the per-step gap is far less noisy than either curve.
    gap = [q - f for q, f in zip(result["qlora_loss"], result["float_lora_loss"])]
    gap_ax.plot(gap, color="tab:blue", alpha=0.35, linewidth=1)
    gap_ax.plot(smooth(gap), color="tab:blue", linewidth=2, label="QLoRA - float LoRA, 5-step mean")
    gap_ax.axhline(gap[0], color="tab:red", linestyle="--", linewidth=1,
                   label=f"4-bit quantization gap before training ({gap[0]:.2f})")
    gap_ax.set_xlabel("step")
    gap_ax.set_ylabel("loss gap (nats)")
    gap_ax.legend(fontsize=8)
    gap_ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    log("wrote", png_path)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--plot", action="store_true", help="only redraw the PNG from the JSON")
    p.add_argument("--packed", nargs=2, metavar="PART", help="GPU run on the packed model (quant_quality.py pack)")
    p.add_argument("--out", help="output folder (default benchmarks/results)")
    p.add_argument("--device", default="cuda", help="with --packed: cuda (bf16 autocast) or cpu (a smoke run)")
    args = p.parse_args()
    if args.plot:
        with open(JSON_PATH) as f:
            plot(json.load(f))
    else:
        run(args)


if __name__ == "__main__":
    main()
