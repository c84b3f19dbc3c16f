"""`hf-fastpath quantize` and `hf-fastpath eval`, and the one perplexity protocol every method is judged by.

Perplexity protocol: the evaluation text (documents joined by blank lines) is tokenized once, cut into consecutive
non-overlapping windows of `seq_len` tokens (stride = seq_len; a last shorter window counts too), and
ppl = exp(mean negative log-likelihood of every token after the first of its window). No BOS is added, so the same
token stream is scored for every model and method.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")


def pick_device(device=None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@torch.no_grad()
def perplexity(model, token_ids: torch.Tensor, seq_len: int = 512, batch_size: int = 8, device=None) -> float:
    """Perplexity of `model` over a 1-D token stream, by the protocol in the module docstring."""
    if token_ids.dim() != 1 or token_ids.numel() < 2:
        raise ValueError("perplexity needs a 1-D token stream of at least 2 tokens")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    windows = list(torch.split(token_ids, seq_len))
    if windows[-1].numel() < 2:
        windows = windows[:-1]
    total_nll, total_count = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(windows), batch_size):
            chunk = windows[start:start + batch_size]
            by_len: dict[int, list[torch.Tensor]] = {}
            for w in chunk:  # the short last window goes alone: no padding anywhere
                by_len.setdefault(w.numel(), []).append(w)
            for group in by_len.values():
                ids = torch.stack(group).to(device)
                logits = model(input_ids=ids, use_cache=False).logits.float()
                nll = torch.nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
                total_nll += float(nll)
                total_count += ids[:, 1:].numel()
    finally:
        model.train(was_training)
    return math.exp(total_nll / total_count)


def eval_tokens(tokenizer, source, max_tokens: int | None = None, default: str = "bible-eval") -> torch.Tensor:
    from .data import load_texts, tokenize_stream

    return tokenize_stream(tokenizer, load_texts(source, default), max_tokens=max_tokens)


def _load_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _load_model(model_dir, device, attn_implementation=None, dtype=None, **kwargs):
    from transformers import AutoModelForCausalLM

    import hf_fastpath  # noqa: F401  (registers the fastpath attention and the GPTQ/AWQ loaders)

    if dtype is None:
        dtype = torch.float16 if device.type == "cuda" else torch.float32
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs)
    return model


def quantize_command(args) -> int:
    """`hf-fastpath quantize MODEL_DIR OUT_DIR ...`: calibrate, then save a GPTQ/AWQ checkpoint with tokenizer files."""
    from hf_fastpath.quantization.config import W4A16Config

    device = pick_device(args.device)
    config = W4A16Config(
        method=args.method, bits=args.bits, group_size=args.group_size, sym=not args.asym if args.asym else None,
        desc_act=args.desc_act, gptaq=args.gptaq, dataset=args.dataset, num_samples=args.num_samples,
        seq_len=args.seq_len, device=str(device),
    )
    start = time.perf_counter()
    # The float model stays on the CPU; calibration moves one block at a time to `device`.
    model = _load_model(args.model_dir, torch.device("cpu"), dtype=torch.float16 if device.type == "cuda" else None,
                        quantization_config=config)
    elapsed = time.perf_counter() - start
    out = Path(args.out_dir)
    model.save_pretrained(out)
    copied = copy_tokenizer_files(args.model_dir, out)
    print(f"quantized {args.model_dir} with {args.method.upper()} {args.bits}-bit g{args.group_size}"
          f"{' act-order' if args.desc_act else ''}{' GPTAQ' if config.gptaq else ''} in {elapsed:.1f} s -> {out} "
          f"(tokenizer files: {', '.join(copied) or 'none found'})")
    return 0


def copy_tokenizer_files(src, dst) -> list[str]:
    src, dst = Path(src), Path(dst)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and not (dst / name).exists():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def eval_command(args) -> int:
    """`hf-fastpath eval MODEL_DIR --dataset ...`: perplexity by the module's protocol; prints one JSON line."""
    device = pick_device(args.device)
    try:
        model = _load_model(args.model_dir, device, attn_implementation=args.attn_implementation)
    except (ValueError, KeyError) as e:
        logger.warning("attn_implementation=%r failed (%s); evaluating with the default attention",
                       args.attn_implementation, e)
        model = _load_model(args.model_dir, device)
    model.to(device)
    tokenizer = _load_tokenizer(args.model_dir)
    ids = eval_tokens(tokenizer, args.dataset, args.max_tokens)
    start = time.perf_counter()
    ppl = perplexity(model, ids, seq_len=args.seq_len, device=device)
    result = {"model": str(args.model_dir), "dataset": args.dataset or "bible-eval", "tokens": int(ids.numel()),
              "seq_len": args.seq_len, "perplexity": round(ppl, 4),
              "seconds": round(time.perf_counter() - start, 2), "device": str(device)}
    print(json.dumps(result))
    return 0
