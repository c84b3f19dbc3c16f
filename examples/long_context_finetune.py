"""Long-context causal-LM fine-tuning with hf_fastpath ring attention (context parallelism) under `accelerate launch`.

Every `--cp-size` consecutive ranks share one sample, each holding a zigzag shard of its tokens; K/V travel a ring
inside that group. The remaining factor (num_processes / cp_size) is ordinary data parallelism. DDP and FSDP2 work as
Accelerate sets them up (gradients averaged over ALL ranks; `context_parallel_loss` is normalised so that this
average is the one-GPU gradient).

    # CPU smoke test (gloo), 2 processes, one CP group of 2. (`accelerate launch --cpu` starts ONE process unless
    # mpirun is set up; `--multi_gpu` launches through torchrun, and `--cpu` below makes Accelerate use gloo.)
    accelerate launch --multi_gpu --num_processes 2 examples/long_context_finetune.py --cpu --tiny --cp-size 2
    # 8 GPUs: 2 data-parallel replicas x CP 4, DDP or FSDP2
    accelerate launch --config_file examples/accelerate_cp.yaml examples/long_context_finetune.py \\
        --model path/to/llama --cp-size 4 --seq-len 131072 --text corpus.txt --bf16 --gradient-checkpointing
    accelerate launch --config_file examples/accelerate_cp_fsdp2.yaml examples/long_context_finetune.py ...

`--packed` packs several documents per sample with `transformers.DataCollatorWithFlattening` (no padding, no
attention across documents); each document is padded at its end to a multiple of 2 x cp_size.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.utils.data import DataLoader, DistributedSampler

import hf_fastpath  # noqa: F401  (registers the attention implementations)
from hf_fastpath.parallel import (
    build_context_parallel_groups,
    context_parallel,
    context_parallel_loss,
    shard_causal_lm_batch,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory or Hub name (Llama-style causal LM)")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama (smoke tests)")
    p.add_argument("--cp-size", type=int, default=1, help="context-parallel group size (divides num_processes)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sample (the whole, unsharded sequence)")
    p.add_argument("--packed", action="store_true", help="pack several documents per sample")
    p.add_argument("--docs-per-sample", type=int, default=4)
    p.add_argument("--text", default=None, help="UTF-8 text file to train on (default: synthetic token patterns)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--bf16", action="store_true", help="bf16 weights (otherwise fp32)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="run on CPU with gloo (smoke tests)")
    p.add_argument("--out", default=None, help="write a JSON log of the losses here (rank 0)")
    return p.parse_args(argv)


def build_model(args):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if args.tiny or args.model is None:
        torch.manual_seed(args.seed)  # same initial weights on every rank
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(args.seq_len, 64),
                          use_cache=False)
        return LlamaForCausalLM(cfg).to(dtype), None
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    return model, AutoTokenizer.from_pretrained(args.model)


def build_samples(args, tokenizer, vocab_size: int, n: int) -> list[dict]:
    """`n` token sequences: documents of a text file, or synthetic arithmetic patterns a model can learn."""
    g = torch.Generator().manual_seed(args.seed)
    doc_len = args.seq_len // args.docs_per_sample if args.packed else args.seq_len
    if args.text:
        ids = tokenizer(open(args.text, encoding="utf-8").read(), return_tensors="pt").input_ids[0]
        reps = math.ceil(n * doc_len / max(len(ids), 1))
        ids = ids.repeat(reps)
        return [{"input_ids": ids[i * doc_len : (i + 1) * doc_len].tolist()} for i in range(n)]
    out = []
    for _ in range(n):
        lo = max(doc_len // 2, 2)
        length = int(torch.randint(lo, doc_len + 1, (1,), generator=g)) if args.packed else doc_len
        a, b = (int(x) for x in torch.randint(1, vocab_size, (2,), generator=g))
        out.append({"input_ids": [(a + b * t) % vocab_size for t in range(length)]})
    return out


def main(argv=None):
    args = parse_args(argv)
    accelerator = Accelerator(cpu=args.cpu)
    groups = build_context_parallel_groups(args.cp_size, accelerator)
    model, tokenizer = build_model(args)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    vocab_size = model.config.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)

    # The data is sharded over the DATA-parallel ranks only: all ranks of a CP group load the same samples.
    per_sample = args.docs_per_sample if args.packed else 1
    samples = build_samples(args, tokenizer, vocab_size, n=max(args.steps * groups.dp_size * per_sample, per_sample))
    sampler = DistributedSampler(samples, num_replicas=groups.dp_size, rank=groups.dp_rank, shuffle=True,
                                 seed=args.seed)
    if args.packed:
        from transformers import DataCollatorWithFlattening

        collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
    else:
        def collate(batch):
            ids = torch.tensor([b["input_ids"] for b in batch])
            return {"input_ids": ids, "labels": ids.clone()}
    loader = DataLoader(samples, batch_size=per_sample, sampler=sampler, collate_fn=collate)

    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    losses, tokens, start = [], 0, time.perf_counter()
    model.train()
    with context_parallel(model, groups.cp_group):
        for step, batch in enumerate(loader):
            if step >= args.steps:
                break
            batch = {k: (v.to(accelerator.device) if torch.is_tensor(v) else v) for k, v in batch.items()}
            shard = shard_causal_lm_batch(batch, groups.cp_group, pad_token_id=pad_id)
            labels = shard.pop("shift_labels")
            logits = model(**shard).logits
            loss = context_parallel_loss(logits, labels, groups.cp_group)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            # for the log: mean over all ranks = mean over DP replicas of each sample's one-GPU loss
            logged = loss.detach().float().clone()
            if dist.is_initialized():
                dist.all_reduce(logged)
                logged /= dist.get_world_size()
            losses.append(logged.item())
            tokens += batch["input_ids"].numel() * groups.dp_size
            accelerator.print(f"step {step}: loss {losses[-1]:.4f}")
    elapsed = time.perf_counter() - start
    accelerator.print(f"{tokens / elapsed:.0f} tokens/s over {accelerator.num_processes} processes "
                      f"(cp {groups.cp_size} x dp {groups.dp_size})")
    if args.out and accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "cp_size": groups.cp_size, "dp_size": groups.dp_size,
                       "tokens_per_s": tokens / elapsed, "seq_len": args.seq_len, "packed": args.packed,
                       "distributed_type": str(accelerator.distributed_type), "model_class": type(model).__name__},
                      f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
