"""QLoRA fine-tuning of a 4-bit model on a text file, with Accelerate (plain loop, default) or the Trainer (--trainer).

    # a GPTQ / AWQ checkpoint (loads onto hf_fastpath's W4A16 kernels, no gptqmodel needed)
    accelerate launch --config_file examples/accelerate_single_gpu.yaml examples/qlora_finetune.py \\
        --model path/to/gptq-model --data corpus.txt --output adapter-out
    # a float model quantized while it loads (RTN: seconds; --quantize gptq / awq calibrate first)
    accelerate launch --config_file examples/accelerate_ddp.yaml examples/qlora_finetune.py \\
        --model path/to/float-model --quantize rtn --data corpus.txt --output adapter-out --trainer
    # CPU smoke run, 2 processes with gloo (`accelerate launch --cpu` starts ONE process without mpirun;
    # --multi_gpu goes through torchrun and the script's --cpu makes Accelerate use the CPU and gloo)
    accelerate launch --multi_gpu --num_processes 2 examples/qlora_finetune.py --cpu --model tiny-float-dir \\
        --data corpus.txt --output /tmp/out --quantize rtn --group-size 32 --dtype float32 --tokenizer bytes \\
        --seq-len 32 --steps 4

Ran on an H200 (torch 2.11, Transformers 5.17; benchmarks/results/qlora_example_h200.json): a random SmolLM2-135M-shaped
Llama saved with `python benchmarks/qlora.py --save-random smollm2-135m DIR`, then
    accelerate launch --config_file examples/accelerate_single_gpu.yaml examples/qlora_finetune.py --model DIR \
        --quantize rtn --group-size 64 --tokenizer bytes --data corpus.txt --seq-len 2048 --steps 20 --output OUT
(group 64: 128 does not divide SmolLM2's 576-wide layers) — loss 11.03 -> 8.17 in 20 steps, 1.42 GiB peak.

The recipe: `hf_fastpath.prepare_model_for_qlora` (gradient checkpointing, input gradients, fp32 norms, packed weights
untouched), `get_peft_model(LoraConfig(target_modules="all-linear"))` (LoRA lands on the W4A16 layers through
hf_fastpath's PEFT mapping), `fastpath` attention, `hf_fastpath.use_chunked_loss` (the loss without the full
logits; `--full-logits` turns it off), and DDP told to leave the 4-bit buffers alone. Only the adapter is
saved; load it with `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), output)`.

FSDP: the 4-bit weights are int32 buffers, which FSDP does not shard; data parallelism with DDP is the supported
multi-GPU mode (each GPU holds the whole 4-bit model: an 8B model is ~5 GB). An FSDP launch stops with an explanation.
(torch's `fully_shard` itself handles a W4A16 + LoRA model correctly: tests/test_qlora.py checks it on gloo.)
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time

import torch

logger = logging.getLogger("qlora_finetune")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint dir (GPTQ/AWQ, or float with --quantize)")
    p.add_argument("--data", required=True, help="a UTF-8 text file")
    p.add_argument("--output", required=True, help="where the adapter (and train_log.json) go")
    p.add_argument("--quantize", choices=["rtn", "gptq", "awq"], help="quantize a float model while loading")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--tokenizer", help="tokenizer path (default: --model); 'bytes' = UTF-8 bytes as token ids")
    p.add_argument("--trainer", action="store_true", help="train with transformers.Trainer instead of a plain loop")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=1, help="sequences per device per micro-step")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--alpha", type=int, default=32)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--dora", action="store_true", help="DoRA instead of LoRA")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--attn", default="fastpath", help="attn_implementation (default: fastpath)")
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--full-logits", action="store_true",
                   help="compute the loss from full logits (Transformers' way) instead of hf_fastpath's chunked loss")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--cpu", action="store_true", help="run on the CPU (gloo between processes): smoke tests")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------------------------
# model and data


def load_model(args, device):
    from transformers import AutoModelForCausalLM

    import hf_fastpath
    from hf_fastpath.quantization.linear import W4A16Linear

    kwargs = {"dtype": getattr(torch, args.dtype), "attn_implementation": args.attn}
    if args.quantize:
        kwargs["quantization_config"] = hf_fastpath.W4A16Config(
            method=args.quantize, bits=args.bits, group_size=args.group_size, tokenizer=args.tokenizer)
    model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs)
    if not any(isinstance(m, W4A16Linear) for m in model.modules()):
        raise SystemExit(f"{args.model} loaded without 4-bit layers: pass a GPTQ/AWQ checkpoint, or --quantize rtn")
    return model.to(device)


class ByteTokenizer:
    """UTF-8 bytes as token ids (for smoke runs on tiny models without a tokenizer; needs vocab_size >= 256)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode("utf-8"))}


def load_tokenizer(args, vocab_size):
    if args.tokenizer == "bytes":
        if vocab_size < 256:
            raise SystemExit(f"--tokenizer bytes needs a vocabulary of at least 256 tokens (the model has {vocab_size})")
        return ByteTokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(args.tokenizer or args.model)


def token_windows(tokenizer, path, seq_len):
    """The file as consecutive `seq_len`-token windows `[n, seq_len]` (the tail shorter than a window is dropped)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    n = ids.numel() // seq_len
    if n == 0:
        raise SystemExit(f"{path} has {ids.numel()} tokens: fewer than one window of --seq-len {seq_len}")
    return ids[: n * seq_len].view(n, seq_len)


def build_peft_model(model, args):
    from peft import LoraConfig, get_peft_model

    from hf_fastpath.integrations.causal_lm_loss import use_chunked_loss
    from hf_fastpath.quantization.training import ignore_quantized_buffers_in_ddp, prepare_model_for_qlora

    prepare_model_for_qlora(model, gradient_checkpointing=not args.no_gradient_checkpointing)
    config = LoraConfig(r=args.r, lora_alpha=args.alpha, lora_dropout=args.dropout, target_modules="all-linear",
                        use_dora=args.dora, task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    ignore_quantized_buffers_in_ddp(model)  # DDP would re-broadcast every 4-bit buffer at every step otherwise
    if not args.full_logits:
        # the loss from the last hidden states chunk by chunk: the [tokens, vocab] logits were most of the peak
        # memory (8B Llama, 8 x 2048 tokens: 13.8 instead of 33.7 GiB on an H200)
        use_chunked_loss(model)
    return model


def refuse_fsdp(accelerator):
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        raise SystemExit(
            "FSDP is not supported by this example: the 4-bit weights are int32 buffers that FSDP does not shard, so "
            "FSDP would only shard the small float parts (embeddings, norms, LoRA) and its state-dict handling "
            "(cpu_ram_efficient_loading, full state dicts) has not been validated on W4A16 layers. Launch with DDP "
            "instead (examples/accelerate_ddp.yaml): each process holds the whole 4-bit model (~5 GB for 8B)."
        )


# ---------------------------------------------------------------------------------------------------------------------
# training


def train_loop(args, accelerator, model, windows):
    from torch.utils.data import DataLoader

    loader = DataLoader(windows, batch_size=args.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(args.seed), drop_last=True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.steps // 10)))
    model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
    args.wrapped_as = type(model).__name__
    model.train()
    log, step, tokens = [], 0, 0
    start = time.perf_counter()
    while step < args.steps:
        for ids in loader:
            with accelerator.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(params, 1.0)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad(set_to_none=True)
            tokens += ids.numel() * accelerator.num_processes
            if not accelerator.sync_gradients:
                continue
            step += 1
            mean_loss = accelerator.reduce(loss.detach(), reduction="mean").item()
            log.append({"step": step, "loss": mean_loss})
            if step % args.log_every == 0 or step == 1 or step == args.steps:
                rate = tokens / (time.perf_counter() - start)
                accelerator.print(f"step {step:5d}  loss {mean_loss:.4f}  {rate:,.0f} tokens/s")
            if step >= args.steps:
                break
    return accelerator.unwrap_model(model), log, tokens / (time.perf_counter() - start)


def train_with_trainer(args, accelerator, model, windows):
    from transformers import Trainer, TrainingArguments

    dataset = [{"input_ids": w, "labels": w} for w in windows]
    training_args = TrainingArguments(
        output_dir=args.output, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, max_steps=args.steps, learning_rate=args.lr,
        warmup_steps=max(1, args.steps // 10), lr_scheduler_type="constant_with_warmup", weight_decay=0.0,
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=args.seed,
        use_cpu=accelerator.device.type == "cpu", gradient_checkpointing=False,  # already on (prepare_model_for_qlora)
        ddp_find_unused_parameters=False, remove_unused_columns=False, dataloader_drop_last=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
    start = time.perf_counter()
    result = trainer.train()
    args.wrapped_as = type(trainer.model_wrapped).__name__
    elapsed = time.perf_counter() - start
    log = [{"step": e["step"], "loss": e["loss"]} for e in trainer.state.log_history if "loss" in e]
    tokens = args.steps * args.grad_accum * args.batch_size * args.seq_len * accelerator.num_processes
    accelerator.print(f"trainer: {result.global_step} steps, final loss {log[-1]['loss'] if log else float('nan'):.4f}")
    return trainer.model, log, tokens / elapsed


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, cpu=args.cpu)
    refuse_fsdp(accelerator)
    set_seed(args.seed)
    model = load_model(args, accelerator.device)
    tokenizer = load_tokenizer(args, model.config.vocab_size)
    windows = token_windows(tokenizer, args.data, args.seq_len)
    accelerator.print(f"{windows.shape[0]} windows of {args.seq_len} tokens; {accelerator.num_processes} process(es) "
                      f"on {accelerator.device}")
    model = build_peft_model(model, args)
    if accelerator.is_main_process:
        model.print_trainable_parameters()
    run = train_with_trainer if args.trainer else train_loop
    model, log, tokens_per_s = run(args, accelerator, model, windows)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        os.makedirs(args.output, exist_ok=True)
        model.save_pretrained(args.output)
        summary = {"args": vars(args), "processes": accelerator.num_processes, "tokens_per_s": tokens_per_s,
                   "losses": log, "max_memory_gib": (torch.cuda.max_memory_allocated() / 2**30
                                                     if torch.cuda.is_available() else None)}
        with open(os.path.join(args.output, "train_log.json"), "w") as f:
            json.dump(summary, f, indent=1)
        final = log[-1]["loss"] if log else math.nan
        accelerator.print(f"adapter saved to {args.output} (final loss {final:.4f}, {tokens_per_s:,.0f} tokens/s)")
    accelerator.end_training()


if __name__ == "__main__":
    main()
