"""QLoRA training benchmark (GPU): tokens/s and peak memory of one LoRA training step at sequence 2048.

    python benchmarks/qlora.py                    # -> benchmarks/results/qlora.json and qlora.png ($OUT if set)
    python benchmarks/qlora.py --plot FILE.json   # redraw the PNG (no GPU needed)
    TRITON_INTERPRET=1 python benchmarks/qlora.py --smoke   # the whole flow on the CPU, tiny shape (~2 minutes)
    python benchmarks/qlora.py --save-random smollm2-135m DIR  # a random model for examples/qlora_finetune.py

Before the models, `loss_op` (skip with --no-loss-op) compares the LM head + loss alone at the 8B shape (16384 tokens,
4096 -> 128256, bf16, forward + backward): hf_fastpath's chunked op vs F.linear + Transformers' ForCausalLMLoss,
extra peak memory, time and error against fp32.

The same randomly initialised Llama-shaped model (random weights: same shapes, same speed) is fine-tuned five ways,
all with PEFT LoRA r=16 alpha=32 on every linear (same seed, same initial adapters), gradient checkpointing
(non-reentrant, through `prepare_model_for_qlora`, so fp32 norms everywhere), AdamW, batch 1 (--batch) x 2048
tokens, bf16:
  bf16_lora           peer: bf16 base weights, PEFT's LoRA layer, SDPA attention
  dequant_qlora       peer: 4-bit base weights dequantized for every matmul, in the forward and again in the
                      backward (the way bitsandbytes / gptqmodel train; the dequantization itself is hf_fastpath's
                      Triton kernel, the matmul cuBLAS), PEFT's GPTQ LoRA arithmetic, SDPA attention
  fastpath_qlora      hf_fastpath: W4A16Linear (Triton W4A16 kernels; at training sizes they dequantize into a
                      scratch tile and call cuBLAS), W4A16LoraLinear, `fastpath` attention, and the chunked
                      linear + cross-entropy loss (`hf_fastpath.use_chunked_loss`: no [tokens, vocab] logits)
  fastpath_qlora_sdpa the same with SDPA attention (ablation: the linear layers and the loss alone)
  fastpath_qlora_full_logits  fastpath_qlora with Transformers' default loss (ablation: what the chunked loss saves)
The peers compute the loss as users run them: Transformers' `ForCausalLMLoss` on the full logits, up-cast to fp32.
Two precision modes, each variant in both: `autocast` (forward and loss under torch.autocast(bfloat16), what
`Trainer(bf16=True)` does; the peers' LoRA products then run in bf16) and `plain` (no autocast, like
examples/qlora_finetune.py; PEFT's LoRA products run in the fp32 adapter dtype). The headline is `autocast`.
The 4-bit weights come from RTN of the bf16 model on the GPU (asymmetric; group 128, group 64 for SmolLM2's 576-wide
layers, which 128 does not divide). Models: SmolLM2-135M shape and Llama-3-8B shape (bf16 LoRA needs ~20 GiB there).
Step time: median of `triton.testing.do_bench` over whole training steps (forward, backward, optimizer), after an
untimed warm-up step. Peak memory: torch.cuda.max_memory_allocated over one step after a reset, model, adapters and
AdamW state included; `resident_gib` is what stays allocated between steps. Correctness: the 4-bit variants compute
the same loss and LoRA gradients (checked before timing, reported as relative differences).
"""

from __future__ import annotations

import argparse
import contextlib
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
    # --smoke: the whole flow on the CPU (TRITON_INTERPRET=1)
    "tiny": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=2, vocab_size=256, tie_word_embeddings=False),
}
GROUP_SIZE = {"smollm2-135m": 64, "llama3-8b": 128, "tiny": 64}  # must divide every in_features (kernel path)
VARIANTS = ("bf16_lora", "dequant_qlora", "fastpath_qlora", "fastpath_qlora_sdpa", "fastpath_qlora_full_logits")
CHUNKED_LOSS_VARIANTS = ("fastpath_qlora", "fastpath_qlora_sdpa")
MODES = ("autocast", "plain")
HEADLINE_MODE = "autocast"
DEVICE = "cuda"


def log(*a):
    print(*a, flush=True)


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------------------------
# the dequantize-then-matmul peer


class _DequantMatmul(torch.autograd.Function):
    """y = x @ dequant(W); backward dequantizes again (nothing but the packed weight is kept between the two)."""

    @staticmethod
    def forward(ctx, x, layer):
        from hf_fastpath.kernels.w4a16 import w4a16_dequantize

        ctx.layer = layer
        w = w4a16_dequantize(layer.qweight, layer.scales, layer.zeros, layer._effective_group_size, x.dtype)
        return x @ w

    @staticmethod
    def backward(ctx, dy):
        from hf_fastpath.kernels.w4a16 import w4a16_dequantize

        layer = ctx.layer
        w = w4a16_dequantize(layer.qweight, layer.scales, layer.zeros, layer._effective_group_size, dy.dtype)
        return dy @ w.t(), None


def dequant_forward(self, x):
    """W4A16Linear.forward of the peer (sorted-group layers, as RTN makes them)."""
    lead = x.shape[:-1]
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    y = _DequantMatmul.apply(x.reshape(-1, self.in_features), self)
    if self.bias is not None:
        y = y + self.bias
    return y.reshape(*lead, self.out_features)


def peft_gptq_lora_forward(self, x, *args, **kwargs):
    """PEFT's LoRA arithmetic for GPTQ layers (peft/tuners/lora/gptq.py): x cast to the adapter dtype, the [M, N]
    adapter output computed, scaled and added in that dtype, the sum cast back."""
    result = self.base_layer(x)
    for adapter in self.active_adapters:
        if adapter not in self.lora_A:
            continue
        result_dtype = result.dtype
        lora_A, lora_B = self.lora_A[adapter], self.lora_B[adapter]
        x = self._cast_input_dtype(x, lora_A.weight.dtype)
        result = result + lora_B(lora_A(self.lora_dropout[adapter](x))) * self.scaling[adapter]
        result = result.to(result_dtype)
    return result


@contextlib.contextmanager
def variant_code(variant):
    """Swap in the peer's layer code for the block (the fastpath variants run the library as it is)."""
    from hf_fastpath.integrations.peft import W4A16LoraLinear
    from hf_fastpath.quantization.linear import W4A16Linear

    if variant != "dequant_qlora":
        yield
        return
    saved = W4A16Linear.forward, W4A16LoraLinear.forward
    W4A16Linear.forward, W4A16LoraLinear.forward = dequant_forward, peft_gptq_lora_forward
    try:
        yield
    finally:
        W4A16Linear.forward, W4A16LoraLinear.forward = saved


# ---------------------------------------------------------------------------------------------------------------------
# one configuration


def set_attention(model, name):
    try:
        model.set_attn_implementation(name)
    except Exception:  # older Transformers
        model.config._attn_implementation = name


def attention_of(variant):
    return "fastpath" if variant in ("fastpath_qlora", "fastpath_qlora_full_logits") else "sdpa"


def set_variant(peft_model, variant):
    """Attention and loss of `variant` on the (shared) 4-bit PEFT model."""
    from hf_fastpath.integrations.causal_lm_loss import use_chunked_loss

    set_attention(peft_model.get_base_model(), attention_of(variant))
    use_chunked_loss(peft_model, enabled=variant in CHUNKED_LOSS_VARIANTS)


def make_peft(model, seed=0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def loss_of(model, ids, mode):
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=mode == "autocast"):
        return model(input_ids=ids, labels=ids).loss


def train_step_fn(model, ids, mode):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)

    def step():
        loss = loss_of(model, ids, mode)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, opt


def measure(model, ids, label, mode, rep_ms):
    import triton

    step, opt = train_step_fn(model, ids, mode)
    step()  # kernels compiled / autotuned, AdamW state allocated: outside the timing
    if DEVICE == "cpu":  # smoke run: everything runs; the figures mean nothing
        t0 = time.perf_counter()
        loss = step()
        ms = (time.perf_counter() - t0) * 1e3
        log(f"  {label:26s} {mode:8s} {ms:8.1f} ms/step (CPU smoke run), loss {loss.item():.3f}")
        return {"step_ms": ms, "tokens_per_s": ids.numel() / ms * 1e3, "peak_gib": 0.0, "resident_gib": 0.0,
                "loss": loss.item()}
    sync()
    torch.cuda.empty_cache()
    resident = torch.cuda.memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    loss = step()
    host_ms = (time.perf_counter() - t0) * 1e3  # time to enqueue the step: close to step_ms = host-bound
    sync()
    peak = torch.cuda.max_memory_allocated() / 2**30
    ms = triton.testing.do_bench(step, warmup=max(200, rep_ms // 4), rep=rep_ms, return_mode="median")
    out = {"step_ms": ms, "tokens_per_s": ids.numel() / ms * 1e3, "peak_gib": peak, "resident_gib": resident,
           "host_ms": host_ms, "loss": loss.item()}
    log(f"  {label:26s} {mode:8s} {ms:8.1f} ms/step  {out['tokens_per_s']:10,.0f} tokens/s  peak {peak:6.2f} GiB"
        f"  resident {resident:6.2f} GiB  host {host_ms:6.1f} ms")
    del step, opt
    return out


def lora_grads(model):
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None}


def check_same(peft_model, ids, mode):
    """Loss and LoRA gradients of every 4-bit variant vs the dequantize peer (same model, same adapters)."""
    results = {}
    for variant in VARIANTS[1:]:
        set_variant(peft_model, variant)
        with variant_code(variant):
            peft_model.zero_grad(set_to_none=True)
            loss = loss_of(peft_model, ids, mode)
            loss.backward()
            results[variant] = (loss.item(), lora_grads(peft_model))
    peft_model.zero_grad(set_to_none=True)
    loss_ref, g_ref = results["dequant_qlora"]
    out = {"loss_dequant_qlora": loss_ref}
    for variant in VARIANTS[2:]:
        loss, g = results[variant]
        rel = max(((g[n] - g_ref[n]).norm() / g_ref[n].norm().clamp_min(1e-30)).item() for n in g_ref)
        out[f"loss_{variant}"] = loss
        out[f"max_rel_grad_diff_{variant}"] = rel
    return out


def dequantize_time(model, rep_ms):
    """ms to dequantize every 4-bit layer once (layer 0's linears timed, times the number of layers): what the
    dequantize-then-matmul path pays per pass (forward, recomputed forward, backward)."""
    import triton

    from hf_fastpath.kernels.w4a16 import w4a16_dequantize
    from hf_fastpath.quantization.linear import W4A16Linear

    layers = model.model.layers
    linears = [m for m in layers[0].modules() if isinstance(m, W4A16Linear)]

    def one_layer():
        for m in linears:
            w4a16_dequantize(m.qweight, m.scales, m.zeros, m._effective_group_size)

    return triton.testing.do_bench(one_layer, rep=max(100, rep_ms // 10), return_mode="median") * len(layers)


def quiet(logger_name):
    import logging

    logging.getLogger(logger_name).setLevel(logging.ERROR)


def bench_shape(name, seq, rep_ms, modes, batch=1):
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
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=DEVICE, generator=g)
    result = {"parameters": params, "seq_len": seq, "batch": batch, "group_size": GROUP_SIZE[name],
              **{mode: {} for mode in modes}}

    quiet("hf_fastpath.quantization.training")  # "no W4A16Linear layer": expected for the bf16 peer
    prepare_model_for_qlora(model)  # the same checkpointing and fp32 norms for every variant
    peft_model = make_peft(model)
    for mode in modes:
        result[mode]["bf16_lora"] = measure(peft_model, ids, "bf16_lora", mode, rep_ms)
    model = peft_model.unload()
    del peft_model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()

    t0 = time.perf_counter()
    quantize_model(model, W4A16Config(method="rtn", bits=4, group_size=GROUP_SIZE[name], sym=False))
    sync()
    result["rtn_seconds"] = time.perf_counter() - t0
    result["quantized_linears"] = sum(isinstance(m, W4A16Linear) for m in model.modules())
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        result["allocated_after_rtn_gib"] = torch.cuda.memory_allocated() / 2**30
        result["dequantize_all_layers_ms"] = dequantize_time(model, rep_ms)
        log(f"  RTN {result['rtn_seconds']:.1f} s; allocated {result['allocated_after_rtn_gib']:.2f} GiB; one "
            f"dequantization of every 4-bit layer {result['dequantize_all_layers_ms']:.2f} ms")
    peft_model = make_peft(model)
    peft_model.train()
    result["check"] = check_same(peft_model, ids, modes[0])
    log(f"  check ({modes[0]}): {result['check']}")
    for mode in modes:
        for variant in VARIANTS[1:]:
            set_variant(peft_model, variant)
            with variant_code(variant):
                result[mode][variant] = measure(peft_model, ids, variant, mode, rep_ms)
        r = result[mode]
        f, d, b = r["fastpath_qlora"], r["dequant_qlora"], r["bf16_lora"]
        r["ratios"] = {
            "throughput_vs_dequant_qlora": f["tokens_per_s"] / d["tokens_per_s"],
            "throughput_vs_bf16_lora": f["tokens_per_s"] / b["tokens_per_s"],
            "memory_vs_bf16_lora": f["peak_gib"] / max(b["peak_gib"], 1e-9),
            "memory_vs_dequant_qlora": f["peak_gib"] / max(d["peak_gib"], 1e-9),
            "sdpa_ablation_throughput_vs_dequant_qlora": r["fastpath_qlora_sdpa"]["tokens_per_s"] / d["tokens_per_s"],
            # the chunked loss alone: same model, same kernels, Transformers' loss on the full logits instead
            "chunked_loss_memory_vs_full_logits": f["peak_gib"] / max(r["fastpath_qlora_full_logits"]["peak_gib"], 1e-9),
            "chunked_loss_throughput_vs_full_logits":
                f["tokens_per_s"] / r["fastpath_qlora_full_logits"]["tokens_per_s"],
        }
        log(f"  ratios ({mode}): " + ", ".join(f"{k} {v:.3f}" for k, v in r["ratios"].items()))
    del peft_model, model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------------------------------------------------------------
# the loss alone: chunked linear + cross-entropy vs Transformers' loss on the full logits


def loss_op_bench(tokens, hidden, vocab, rep_ms):
    """LM head + loss, forward and backward, on the same bf16 inputs: hf_fastpath's chunked op vs `F.linear` followed
    by Transformers' ForCausalLMLoss (what every peer variant runs). Extra peak memory over the inputs, median time,
    and both against an fp32 computation (fp32 matmul, no TF32). Also the Triton row kernel against the torch path
    on one chunk, with and without soft-capping (bf16 logits, fp64 reference)."""
    import torch.nn.functional as F
    import triton
    from transformers.loss.loss_utils import ForCausalLMLoss

    from hf_fastpath import losses
    from hf_fastpath.kernels.cross_entropy import cross_entropy_rows_

    g = torch.Generator(device=DEVICE).manual_seed(3)
    h = (torch.randn(tokens, hidden, device=DEVICE, generator=g) * 1.5).bfloat16().requires_grad_(True)
    w = (torch.randn(vocab, hidden, device=DEVICE, generator=g) / hidden**0.5).bfloat16()
    labels = torch.randint(0, vocab, (tokens,), device=DEVICE, generator=g)
    labels[::97] = -100  # some tokens without a target (and a target count that no chunk size divides)

    def peer():
        return ForCausalLMLoss(F.linear(h, w)[None], labels[None], vocab, shift_labels=labels[None])

    def ours():
        return losses.chunked_linear_cross_entropy(h, w, labels)

    out = {"tokens": tokens, "hidden": hidden, "vocab": vocab, "chunk_rows": losses.default_chunk_rows(vocab)}
    with torch.no_grad():  # fp32 reference, chunked by hand so it fits beside the rest
        allow = torch.backends.cuda.matmul.allow_tf32 if DEVICE == "cuda" else False
        if DEVICE == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
        ref_grad = torch.zeros(tokens, hidden, device=DEVICE)
        ref_loss = torch.zeros((), device=DEVICE, dtype=torch.float64)
        n = (labels != -100).sum()
        for s in range(0, tokens, 2048):
            z = F.linear(h[s:s + 2048].float(), w.float())
            lab = labels[s:s + 2048]
            ref_loss += F.cross_entropy(z, lab, reduction="sum").double()
            p = z.softmax(1)
            ok = lab != -100
            p[ok, lab[ok]] -= 1
            p[~ok] = 0
            ref_grad[s:s + 2048] = (p @ w.float()) / n
            del z, p
        ref_loss = (ref_loss / n).float()
        if DEVICE == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = allow
    for name, fn in (("transformers_loss", peer), ("chunked_loss", ours)):
        h.grad = None
        loss = fn()
        loss.backward()
        out[name] = {"loss_abs_err_vs_fp32": abs(loss.item() - ref_loss.item()),
                     "grad_rel_err_vs_fp32": ((h.grad.float() - ref_grad).norm() / ref_grad.norm()).item()}
        del loss
        if DEVICE == "cuda":
            h.grad = None
            sync()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn().backward()
            sync()
            out[name]["extra_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30

            def step(fn=fn):
                fn().backward()

            out[name]["fwd_bwd_ms"] = triton.testing.do_bench(step, grad_to_none=[h], rep=max(200, rep_ms // 4),
                                                               return_mode="median")
    if DEVICE == "cuda":
        out["memory_ratio"] = out["chunked_loss"]["extra_peak_gib"] / out["transformers_loss"]["extra_peak_gib"]
        out["speed_ratio"] = out["transformers_loss"]["fwd_bwd_ms"] / out["chunked_loss"]["fwd_bwd_ms"]
    # the Triton row kernel (on the GPU) vs the torch path, one chunk of bf16 logits, fp64 reference
    rows = torch.randn(64, vocab, device=DEVICE, generator=g).mul_(5).bfloat16()
    target = torch.randint(0, vocab, (64,), device=DEVICE, generator=g)
    scale = torch.tensor([1 / 64], device=DEVICE)
    for cap in (None, 30.0):
        ref = rows.double().requires_grad_(True)
        z = ref if cap is None else cap * torch.tanh(ref / cap)
        (F.cross_entropy(z, target, reduction="sum") / 64).backward()
        want_loss = F.cross_entropy(z.detach(), target, reduction="none")
        for path in ("triton", "torch"):
            if path == "triton":
                grad = rows.clone()
                loss_rows = cross_entropy_rows_(grad, target, scale, cap, True)
            else:
                loss_rows, grad = losses._rows_loss_and_grad_torch(rows.clone(), target, scale, cap, True)
            out[f"rows_{path}_softcap_{cap}"] = {
                "loss_max_abs_err": (loss_rows.double() - want_loss).abs().max().item(),
                "grad_max_abs_err": (grad.double() - ref.grad).abs().max().item(),
                "grad_max_abs": ref.grad.abs().max().item()}
    log(f"  loss op ({tokens} x {hidden} -> {vocab}): {json.dumps(out)}")
    return out


def run(args):
    import peft
    import transformers
    import triton

    import hf_fastpath  # noqa: F401  (registers the attention and the PEFT mapping)

    results = {
        "what": "LoRA training step (r=16, all-linear, grad checkpointing, AdamW), batch x seq tokens, bf16",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU smoke run",
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__, "python": platform.python_version(), "cuda": torch.version.cuda},
        "targets": {"memory_vs_bf16_lora_large": "<= 0.35", "throughput_vs_dequant_qlora": ">= 1.5",
                    "throughput_vs_bf16_lora": ">= 1.0"},
        "modes": list(args.modes), "headline_mode": args.modes[0], "variants": list(VARIANTS),
        "loss": {"chunked (hf_fastpath.use_chunked_loss)": list(CHUNKED_LOSS_VARIANTS),
                 "Transformers ForCausalLMLoss on full fp32 logits": [v for v in VARIANTS
                                                                      if v not in CHUNKED_LOSS_VARIANTS]},
        "shapes": {},
    }
    out_dir = os.environ.get("OUT") or RESULTS
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "qlora.json")
    if args.loss_op:
        tokens, hidden, vocab = (16384, 4096, 128256) if DEVICE == "cuda" else (300, 64, 1000)
        try:
            results["loss_op"] = loss_op_bench(tokens, hidden, vocab, args.rep_ms)
        except Exception as error:  # keep the model figures
            import traceback

            traceback.print_exc()
            results["loss_op"] = {"error": f"{type(error).__name__}: {error}"}
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    for name in args.shapes:
        try:
            results["shapes"][name] = bench_shape(name, args.seq, args.rep_ms, args.modes, args.batch)
        except Exception as error:  # keep the other shape's figures
            import traceback

            traceback.print_exc()
            results["shapes"][name] = {"error": f"{type(error).__name__}: {error}"}
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    log(f"wrote {path}")
    plot(results, os.path.join(out_dir, "qlora.png"))


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mode = results.get("headline_mode", HEADLINE_MODE)
    shapes = [s for s, r in results["shapes"].items() if "error" not in r and mode in r]
    labels = {"bf16_lora": ("bf16 LoRA + SDPA (peer)", "tab:gray"),
              "dequant_qlora": ("QLoRA dequantize+matmul + SDPA (peer)", "tab:orange"),
              "fastpath_qlora": ("hf_fastpath QLoRA", "tab:blue"),
              "fastpath_qlora_sdpa": ("hf_fastpath QLoRA, SDPA attention", "tab:cyan"),
              "fastpath_qlora_full_logits": ("hf_fastpath QLoRA, full-logits loss", "tab:purple")}
    variants = [v for v in results.get("variants", VARIANTS) if v in labels]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(variants)
    for ax, key, title in ((axes[0], "tokens_per_s", "training throughput (higher is better)"),
                           (axes[1], "peak_gib", "peak GPU memory (lower is better)")):
        for i, v in enumerate(variants):
            label, color = labels[v]
            vals = [results["shapes"][s][mode][v][key] for s in shapes]
            # normalised to the bf16 LoRA peer so both shapes share an axis; absolute figures on the bars
            rel = [val / max(results["shapes"][s][mode]["bf16_lora"][key], 1e-9) for val, s in zip(vals, shapes)]
            xs = [x + (i - (len(variants) - 1) / 2) * width for x in range(len(shapes))]
            bars = ax.bar(xs, rel, width, label=label, color=color)
            for bar, val in zip(bars, vals):
                text = f"{val / 1e3:,.1f}k" if key == "tokens_per_s" else f"{val:.1f}"
                ax.annotate(text, (bar.get_x() + width / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes)
        ax.set_ylabel("relative to bf16 LoRA" + (" (labels: tokens/s)" if key == "tokens_per_s" else " (labels: GiB)"))
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(variants), fontsize=8, frameon=False)
    first = results["shapes"][shapes[0]] if shapes else {}
    seq, batch = first.get("seq_len", "?"), first.get("batch", 1)
    fig.suptitle(f"LoRA r=16 training step, batch {batch} x {seq} tokens, grad checkpointing, {mode} bf16, {results['gpu']}",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


def save_random(name, path):
    """A randomly initialised Llama of shape `name`, saved in bf16 (for examples/qlora_finetune.py on a machine
    without the pretrained weights; same shapes, same speed)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPES[name], max_position_embeddings=4096)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    log(f"saved a random {name}-shaped Llama ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters) "
        f"to {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama3-8b"], choices=list(SHAPES))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1, help="sequences per step (more work per step: less host-bound)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                   help="precision modes; the first is the headline (plot)")
    p.add_argument("--rep-ms", type=int, default=2000, help="do_bench repetition time per variant")
    p.add_argument("--no-loss-op", dest="loss_op", action="store_false",
                   help="skip the LM-head + loss comparison (chunked vs Transformers, 16k x 4096 -> 128256)")
    p.add_argument("--plot", metavar="JSON", help="only redraw the PNG from a result file")
    p.add_argument("--smoke", "--dry-run", action="store_true", help="tiny shape on the CPU (with TRITON_INTERPRET=1)")
    p.add_argument("--save-random", nargs=2, metavar=("SHAPE", "DIR"), help="only save a random model of SHAPE to DIR")
    args = p.parse_args()
    if args.save_random:
        save_random(*args.save_random)
        return
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), os.path.splitext(args.plot)[0] + ".png")
        return
    if args.smoke:
        global DEVICE
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke runs the Triton kernels on the CPU: set TRITON_INTERPRET=1")
        DEVICE = "cpu"
        args.shapes, args.seq = ["tiny"], 32
        os.environ.setdefault("OUT", "/tmp/qlora_smoke")
        run(args)
        return
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/qlora.py needs a CUDA GPU (--smoke runs a tiny shape on the CPU)")
    run(args)


if __name__ == "__main__":
    main()
