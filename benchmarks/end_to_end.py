"""The scoreboard: `attn_implementation="fastpath"` against Transformers' default `"sdpa"` on whole models, the
workflows a user runs, both in one process on the same weights.

    python benchmarks/end_to_end.py [--layers 4] [--only train,packed,prefill,eager,compiled]  # GPU; JSON
    python benchmarks/end_to_end.py --plot benchmarks/results/end_to_end.json         # PNG (no GPU needed)
    python benchmarks/end_to_end.py --readme benchmarks/results/end_to_end.json       # the README's table

Model (`--model`): Llama-3-8B-shaped (hidden 4096, 32/8 heads, head dim 128, MLP 14336, vocab 128256; the default)
or Gemma-2-9B-shaped (head dim 256, soft caps, sliding window; results to `end_to_end_gemma2-9b.json`), or
Mistral-7B-shaped (Llama-3-8B's attention with a 4096-token sliding window; `end_to_end_mistral-7b.json`), or
Falcon-RW-7B-shaped (ALiBi, 64 heads of 64: Transformers' "sdpa" adds a [B, H, S, S] float bias, fastpath passes the
slopes to its kernels; `end_to_end_falcon-rw-7b.json`), or gpt-oss-20b-shaped (attention sinks; Transformers has no
"sdpa" for it, so the peer is its default "eager"; `end_to_end_gpt-oss-20b.json`), or the mixtures of experts
Mixtral-8x7B and Qwen3-30B-A3B (`end_to_end_mixtral-8x7b.json`, `end_to_end_qwen3-30b-a3b.json`), `--layers`
decoder layers, random bf16 weights, and the same model quantized to W4A16 (RTN, group 128, q/k/v and gate/up fused;
a mixture of experts' experts too, one launch per projection for all experts).
Rows (each: sdpa, fastpath, fastpath / sdpa; higher is better everywhere):
- train: forward + backward (all parameters, loss on every token), tokens/s, 1 x 8192 tokens, and the same tokens
  as 4 packed sequences of 2048 (restarting position_ids, no cache, as a padding-free collator gives them; and with
  the collator's varlen kwargs `cu_seq_lens_q/k` too, which sdpa ignores: "collated");
- prefill: forward of 1 x {1k, 8k, 32k} tokens, reported as tokens/s;
- generate eager / generate compiled: `generate()` with a dynamic cache, and with `cache_implementation="static"`
  (Transformers compiles the decode step: fullgraph, CUDA graphs), batch {1, 8} x prompt {512, 4096}, 32 new
  tokens, tokens/s (batch x new tokens / time). Compiled rows also count Dynamo's graph breaks and graphs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "end_to_end.json")
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=40960)
# head dim 256, soft-capped scores (Transformers' "sdpa" ignores the cap; fastpath applies it) and logits, layers
# alternating a 4096-token sliding window and full attention
GEMMA2_9B = dict(hidden_size=3584, intermediate_size=14336, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                 vocab_size=256000, sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                 query_pre_attn_scalar=256, max_position_embeddings=40960)
# head dim 128, GQA 32/8, every layer a 4096-token sliding window (Mistral-7B-v0.1)
MISTRAL_7B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                  vocab_size=32000, sliding_window=4096, rope_theta=10000.0, max_position_embeddings=40960)
# ALiBi (no rotary), 64 heads of 64, sequential attention and MLP (Falcon-RW-7B: tiiuae/falcon-rw-7b)
FALCON_RW_7B = dict(hidden_size=4096, num_attention_heads=64, alibi=True, multi_query=False,
                    new_decoder_architecture=False, parallel_attn=False, bias=True, vocab_size=65024)
# head dim 96 (padded to 128 tiles by the Gluon kernels), 64 heads, rotary on a quarter of each head, parallel
# attention and MLP (EleutherAI/gpt-neox-20b)
NEOX_20B = dict(hidden_size=6144, intermediate_size=24576, num_attention_heads=64, rotary_pct=0.25,
                use_parallel_residual=True, vocab_size=50432, max_position_embeddings=40960)
# head dim 64 (32 heads of 64, MHA): the small Llamas (HuggingFaceTB/SmolLM2-1.7B)
SMOLLM2_1_7B = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=32,
                    vocab_size=49152, tie_word_embeddings=True, rope_theta=130000.0, max_position_embeddings=40960)
# attention sinks, 64 heads of 64 over 8 KV heads, every other layer a 128-token window, 32 experts top-4
# (openai/gpt-oss-20b). Transformers has no sdpa for it: the peer is its default, eager.
GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                   head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128, vocab_size=201088,
                   max_position_embeddings=40960)
# mixtures of experts: 8 experts of 14336, top-2 (mistralai/Mixtral-8x7B-v0.1); 128 experts of 768, top-8, 32/4
# heads of 128 (Qwen/Qwen3-30B-A3B)
MIXTRAL_8X7B = dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, rope_theta=1e6,
                    max_position_embeddings=40960)
QWEN3_30B_A3B = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                     rope_theta=1e6, max_position_embeddings=40960)
MODELS = {"llama3-8b": ("llama", LLAMA3_8B, "Llama-3-8B shape, random weights"),
          "smollm2-1.7b": ("llama", SMOLLM2_1_7B, "SmolLM2-1.7B shape (head dim 64), random weights"),
          "neox-20b": ("gpt_neox", NEOX_20B, "GPT-NeoX-20B shape (head dim 96), random weights"),
          "gemma2-9b": ("gemma2", GEMMA2_9B, "Gemma-2-9B shape, random weights"),
          "mistral-7b": ("mistral", MISTRAL_7B, "Mistral-7B shape (sliding window 4096), random weights"),
          "falcon-rw-7b": ("falcon", FALCON_RW_7B, "Falcon-RW-7B shape (ALiBi, head dim 64), random weights"),
          "gpt-oss-20b": ("gpt_oss", GPT_OSS_20B, "gpt-oss-20b shape (sinks, window 128, 32 experts), random weights"),
          "mixtral-8x7b": ("mixtral", MIXTRAL_8X7B, "Mixtral-8x7B shape (8 experts, top-2), random weights"),
          "qwen3-30b-a3b": ("qwen3_moe", QWEN3_30B_A3B, "Qwen3-30B-A3B shape (128 experts, top-8), random weights")}
# the attention each model is timed against: what Transformers gives it by default
PEERS = {"gpt-oss-20b": "eager"}
IMPLS = ("sdpa", "fastpath")  # (peer, ours): main() sets the peer from --model
# --control: the peer against itself under the name "fastpath", to show how far apart the harness puts two runs of
# the very same kernels (the noise any ratio here carries)
NEW_TOKENS = 32


def log(*a):
    print(*a, flush=True)


def _sync_time(fn, reps=3):
    """Median seconds of fn() over `reps` runs after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def train_rows(model, packing=None):
    """Training tokens/s on 1 x 8192 tokens; `packing`: "positions" (4 sequences of 2048 by restarting
    position_ids) or "collated" (the same, plus the collator's varlen kwargs)."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, 8192), device="cuda")
    kw = dict(labels=ids)
    if packing:
        kw.update(position_ids=torch.arange(2048, device="cuda").repeat(4)[None], use_cache=False)
    if packing == "collated":  # DataCollatorWithFlattening(return_flash_attn_kwargs=True): two equal offset tensors
        cu = torch.arange(0, 8193, 2048, dtype=torch.int32, device="cuda")
        kw.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=2048, max_length_k=2048)

    def step():
        model(ids, **kw).loss.backward()
        model.zero_grad(set_to_none=True)

    return 8192 / _sync_time(step)


def prefill_rows(model, tokens):
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device="cuda")

    def fwd():
        with torch.no_grad():
            model(ids, use_cache=False, logits_to_keep=1)

    return tokens / _sync_time(fwd)


def generate_rows(model, batch, prompt, compiled):
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), device="cuda")
    kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    if compiled:
        kw["cache_implementation"] = "static"
    else:
        kw["disable_compile"] = True
    return batch * NEW_TOKENS / _sync_time(lambda: model.generate(ids, **kw), reps=3)


def profile_generate(model, batch, prompt, compiled=True):
    """Where a decode step's time goes, per implementation: the CUDA kernels of one generate() (static cache and
    compiled, after a warm-up that compiles; or eager) and the CUDA-graph launches (compiled: 0 means inductor did
    not use CUDA graphs)."""
    import logging

    from torch.profiler import ProfilerActivity, profile

    logging.getLogger("torch._inductor.cudagraph_trees").setLevel(logging.DEBUG)
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), device="cuda")
    kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    kw.update(cache_implementation="static") if compiled else kw.update(disable_compile=True)
    for impl in IMPLS:
        model.set_attn_implementation(impl)
        torch._dynamo.reset()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model.generate(ids, **kw)
            torch.cuda.synchronize()
        events = prof.key_averages()
        launches = sum(e.count for e in events if "cudaGraphLaunch" in e.key)
        log(f"== {impl}: cudaGraphLaunch x{launches}")
        log(events.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
        if not compiled:
            log(events.table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=60))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--only", default="train,packed,prefill,eager,compiled")
    ap.add_argument("--dtypes", default="bf16,w4a16")
    ap.add_argument("--compiled-shapes", default="1x512,8x4096")
    ap.add_argument("--out", help=f"results JSON (default {RESULTS}, or end_to_end_<model>.json beside it)")
    ap.add_argument("--plot")
    ap.add_argument("--profile", metavar="BxP",
                    help="profile compiled generate at this batch x prompt (first of --dtypes) and stop")
    ap.add_argument("--control", action="store_true",
                    help="null control: time sdpa against sdpa (results to end_to_end_control.json by default)")
    ap.add_argument("--profile-eager", action="store_true", help="with --profile: eager generate instead")
    ap.add_argument("--readme", metavar="RESULTS", help="print the README's table from this results JSON")
    args = ap.parse_args()
    if args.plot:
        return plot(args.plot)
    if args.readme:
        return print(readme_table(json.load(open(args.readme))["rows"]))
    import transformers

    import hf_fastpath  # noqa: F401
    from hf_fastpath.quantization.calibrate import quantize_model
    from hf_fastpath.quantization.config import W4A16Config

    only, dtypes = set(args.only.split(",")), args.dtypes.split(",")
    model_type, shape, described = MODELS[args.model]
    global IMPLS
    peer = PEERS.get(args.model, "sdpa")
    IMPLS = (peer, "fastpath")
    if args.out is None:
        args.out = RESULTS if args.model == "llama3-8b" else RESULTS.replace(".json", f"_{args.model}.json")
        args.out = args.out.replace(".json", "_control.json") if args.control else args.out
    res = dict(meta=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                         transformers=transformers.__version__, date=datetime.date.today().isoformat(),
                         layers=args.layers, model=described, new_tokens=NEW_TOKENS,
                         peer=peer,
                         control=f"{peer} timed against itself (the 'fastpath' column is {peer})" if args.control
                         else None),
               rows=[])
    if os.path.exists(args.out):  # runs split over several calls add their rows to one file
        old = json.load(open(args.out))
        keys = {"train": "train", "train packed": "packed", "prefill": "prefill", "generate eager": "eager",
                "generate compiled": "compiled"}
        res["rows"] = [r for r in old.get("rows", []) if keys[r["workflow"]] not in only or r["dtype"] not in dtypes]

    def record(workflow, dtype, shape, unit, fn, rounds):
        """Both implementations, alternating `rounds` times (the host's speed drifts: eager decoding is host-bound),
        which goes first swapping every round (the second of two back-to-back runs can meet a hotter, slower GPU);
        each keeps its best round; every round's figures and per-round ratios are kept to show the noise."""
        row = dict(workflow=workflow, dtype=dtype, shape=shape, unit=unit)
        for round_ in range(rounds):
            for impl in (IMPLS if round_ % 2 == 0 else IMPLS[::-1]):
                model.set_attn_implementation(peer if args.control else impl)
                torch._dynamo.reset()
                from torch._dynamo.utils import counters

                counters.clear()
                try:
                    row.setdefault(f"{impl}_rounds", []).append(fn())
                    row[impl] = max(row[f"{impl}_rounds"])
                except Exception as exc:  # noqa: BLE001 - keep the other rows
                    row[impl] = None
                    row[f"{impl}_error"] = repr(exc)[:300]
                if workflow == "generate compiled":  # one decode graph when nothing breaks or recompiles
                    row[f"{impl}_graph_breaks"] = sum(counters["graph_break"].values())
                    row[f"{impl}_graphs"] = counters["stats"]["unique_graphs"]
                torch.cuda.empty_cache()
        if row.get(peer) and row.get("fastpath"):
            row["ratio"] = row["fastpath"] / row[peer]
            # the noise beside it: fastpath / peer of each round's pair (same round, adjacent in time)
            pairs = [f / s for f, s in zip(row.get("fastpath_rounds", []), row.get(f"{peer}_rounds", []))]
            row["ratio_rounds"] = [round(x, 3) for x in pairs]
        res["rows"].append(row)
        res["rows"].sort(key=row_order)  # rows kept from an earlier run and new ones, in the table's order
        log(json.dumps(row))
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    config = transformers.AutoConfig.for_model(model_type, **shape, num_hidden_layers=args.layers)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=peer)
    model.generation_config.pad_token_id = 0
    for dtype in dtypes:
        if dtype == "w4a16":
            model.eval()
            quantize_model(model, W4A16Config(method="rtn", bits=4, group_size=128, sym=False))
            hf_fastpath.fuse_projections(model)
            torch.cuda.empty_cache()
        if args.profile:  # the first of --dtypes
            model.eval()
            return profile_generate(model, *(int(x) for x in args.profile.split("x")), compiled=not args.profile_eager)
        if dtype == "bf16" and only & {"train", "packed"}:
            model.train()
            if "train" in only:
                record("train", dtype, "1x8192", "tokens/s", lambda: train_rows(model), 2)
            if "packed" in only:
                record("train packed", dtype, "4x2048 packed", "tokens/s", lambda: train_rows(model, "positions"), 2)
                record("train packed", dtype, "4x2048 collated", "tokens/s",
                       lambda: train_rows(model, "collated"), 2)
        model.eval()
        if "prefill" in only:
            for tokens in (1024, 8192, 32768):
                record("prefill", dtype, f"1x{tokens}", "tokens/s", lambda t=tokens: prefill_rows(model, t), 3)
        if "eager" in only:
            for batch in (1, 8):
                for prompt in (512, 4096):
                    record("generate eager", dtype, f"{batch}x{prompt}", "tokens/s",
                           lambda b=batch, p=prompt: generate_rows(model, b, p, compiled=False), 3)
        if "compiled" in only:
            for shape in args.compiled_shapes.split(","):
                batch, prompt = (int(x) for x in shape.split("x"))
                record("generate compiled", dtype, shape, "tokens/s",
                       lambda b=batch, p=prompt: generate_rows(model, b, p, compiled=True), 2)
    log("wrote", args.out)


WORKFLOWS = ("train", "train packed", "prefill", "generate eager", "generate compiled")


def row_order(row):
    """Workflow, then dtype (bf16 first), then shape by its numbers ("1x8192", "4x2048 packed")."""
    numbers = tuple(int(x) for x in row["shape"].split()[0].split("x"))
    return WORKFLOWS.index(row["workflow"]), row["dtype"] != "bf16", row["dtype"], numbers, row["shape"]


def readme_table(rows) -> str:
    """The README's end-to-end table (markdown) from the result rows: `tests/test_readme_figures.py` checks that the
    README carries exactly this."""
    ratio = {(r["workflow"], r["dtype"], r["shape"]): r.get("ratio") for r in rows}

    def one(workflow, dtype, shape):
        value = ratio.get((workflow, dtype, shape))
        return "—" if value is None else f"{value:.2f}×"

    def span(workflow, dtype):
        values = [v for (w, d, _), v in ratio.items() if w == workflow and d == dtype and v is not None]
        return "—" if not values else f"{min(values):.2f}–{max(values):.2f}×"

    lines = ["| workflow | bf16 | W4A16 |", "|---|---|---|"]
    lines.append("| training step, 1 × 8192 tokens / 4 packed sequences of 2048 | "
                 f"{one('train', 'bf16', '1x8192')} / {one('train packed', 'bf16', '4x2048 packed')} | — |")
    lines.append("| prefill 1k / 8k / 32k | " + " | ".join(
        " / ".join(one("prefill", d, f"1x{t}") for t in (1024, 8192, 32768)) for d in ("bf16", "w4a16")) + " |")
    lines.append("| generate eager, batch 1 and 8, prompt 512 and 4096 | "
                 f"{span('generate eager', 'bf16')} | {span('generate eager', 'w4a16')} |")
    lines.append("| generate static + compile, batch 1 × 512 / 8 × 4096 | " + " | ".join(
        " / ".join(one("generate compiled", d, s) for s in ("1x512", "8x4096")) for d in ("bf16", "w4a16")) + " |")
    return "\n".join(lines)


def plot(path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(path))
    rows = [r for r in data["rows"] if r.get("ratio")]
    labels = [f"{r['workflow']} {r['dtype']} {r['shape']}" for r in rows]
    ratios = [r["ratio"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(rows) + 1.5))
    ax.barh(range(len(rows)), ratios, color=["tab:green" if x >= 1 else "tab:red" for x in ratios])
    # each row's per-round ratios (the same round's pair), min to max: how far the harness's noise reaches
    spread = [(r, min(r["ratio_rounds"]), max(r["ratio_rounds"])) for r in rows if r.get("ratio_rounds")]
    ax.hlines([rows.index(r) for r, _, _ in spread], [lo for _, lo, _ in spread], [hi for _, _, hi in spread],
              color="k", lw=1.2, label="per-round ratios (min-max)")
    if spread:
        ax.legend(loc="lower right", fontsize=7)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"fastpath / {data['meta'].get('peer', 'sdpa')} (throughput; > 1: fastpath faster)")
    ax.set_title(f"End to end, {data['meta'].get('model', 'Llama-3-8B shape').split(',')[0]}, "
                 f"{data['meta'].get('layers', 4)} layers, H200")
    fig.tight_layout()
    png = os.path.splitext(path)[0] + ".png"
    fig.savefig(png, dpi=130)
    print("wrote", png)


if __name__ == "__main__":
    main()
