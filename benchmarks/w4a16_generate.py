"""End-to-end greedy decoding: bf16 against W4A16 (RTN, group 128) on a Llama-3-8B-shaped model, eager and with
Transformers' static cache + torch.compile(mode="reduce-overhead") (CUDA graphs: no per-kernel launch cost).

  python benchmarks/w4a16_generate.py [--layers 8] [--new-tokens 64] [--out benchmarks/results/w4a16_generate.json]

Random weights (the speed does not depend on them). Per variant: tokens/s over `--new-tokens` greedy tokens after a
warm-up generate (which also compiles), and for the compiled W4A16 model the largest logit difference against its
eager forward on the same prompt; then the W4A16 model again with `hf_fastpath.fuse_projections` (q/k/v and
gate/up as one launch each). Also host and wall µs per call of one W4A16 layer beside nn.Linear at M = 1, and
`direct_launch.check_w4a16` (the direct launches of `kernels/launch.py` against Triton's own launch path). Needs a
CUDA GPU.
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

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0)


def log(*a):
    print(*a, flush=True)


def tokens_per_s(model, ids, new_tokens, **kw):
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kw)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kw)
    torch.cuda.synchronize()
    return new_tokens / (time.perf_counter() - t0)


def host_time_per_call(layer, x, calls=500):
    """(host µs per call without waiting for the GPU, wall µs per call): eager decoding is host-bound when the first
    is close to the second."""
    from benchmarks.host_time import host_and_wall

    with torch.no_grad():
        return tuple(t * 1e6 for t in host_and_wall(lambda: layer(x), calls, warmup=50))


def run(args):
    import transformers

    import hf_fastpath  # noqa: F401
    from hf_fastpath.quantization.calibrate import quantize_model
    from hf_fastpath.quantization.config import W4A16Config

    config = transformers.LlamaConfig(**LLAMA3_8B, num_hidden_layers=args.layers, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    model.generation_config.pad_token_id = 0
    ids = torch.randint(0, config.vocab_size, (1, args.prompt), device="cuda")
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, transformers=transformers.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(), layers=args.layers,
               prompt=args.prompt, new_tokens=args.new_tokens, shape="Llama-3-8B layers, bf16, batch 1", rows={})

    def variant(name, fn):
        t0 = time.time()
        try:
            res["rows"][name] = dict(tokens_per_s=fn())
        except Exception as exc:  # noqa: BLE001 - keep the other variants
            res["rows"][name] = dict(error=repr(exc)[:500])
        res["rows"][name]["seconds"] = time.time() - t0
        log(name, res["rows"][name])
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    def compiled(m):
        # generate() compiles the forward itself (fullgraph, "reduce-overhead") when the cache is static; compiling
        # model.forward by hand on top of that failed on Transformers 5.17 (CUDA-graph outputs overwritten)
        return tokens_per_s(m, ids, args.new_tokens, cache_implementation="static")

    from direct_launch import check_w4a16

    res["launch_check"] = check_w4a16()
    log("launch check:", res["launch_check"])
    variant("bf16_eager", lambda: tokens_per_s(model, ids, args.new_tokens))
    if args.compile:
        variant("bf16_static_compiled", lambda: compiled(model))
    torch._dynamo.reset()
    quantize_model(model, W4A16Config(method="rtn", bits=4, group_size=128, sym=False))
    torch.cuda.empty_cache()
    with torch.no_grad():
        eager_logits = model(ids).logits.float()
    mlp = model.model.layers[0].mlp
    x1 = torch.randn(1, 1, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    ref_linear = torch.nn.Linear(config.hidden_size, config.intermediate_size, bias=False, device="cuda",
                                 dtype=torch.bfloat16)
    res["host_us_per_call_M1"] = {name: dict(zip(("host", "wall"), host_time_per_call(layer, x1)))
                                  for name, layer in (("w4a16_gate_proj", mlp.gate_proj), ("bf16_nn_linear", ref_linear))}
    log("host time per call (M=1, 4096 -> 14336):", res["host_us_per_call_M1"])
    variant("w4a16_eager", lambda: tokens_per_s(model, ids, args.new_tokens))
    if not args.compile:
        fused_variants(model, ids, eager_logits, res, variant, compiled)
        return finish(res, args)
    variant("w4a16_static_compiled", lambda: compiled(model))
    try:
        from torch._dynamo.utils import counters

        res["graph_breaks_w4a16"] = dict(counters["graph_break"])
        with torch.no_grad():
            logits = model(ids).logits.float()
        res["w4a16_compiled_vs_eager_max_logit_diff"] = (logits - eager_logits).abs().max().item()
        res["w4a16_eager_logit_scale"] = eager_logits.abs().max().item()
    except Exception as exc:  # noqa: BLE001
        res["compiled_check_error"] = repr(exc)[:500]
    fused_variants(model, ids, eager_logits, res, variant, compiled)
    finish(res, args)


def fused_variants(model, ids, eager_logits, res, variant, compiled):
    """The same W4A16 model with `fuse_projections` (q/k/v and gate/up as one launch each), eager and compiled."""
    import hf_fastpath

    torch._dynamo.reset()
    res["fused_groups"] = hf_fastpath.fuse_projections(model)
    with torch.no_grad():
        res["fused_vs_unfused_eager_max_logit_diff"] = (model(ids).logits.float() - eager_logits).abs().max().item()
    variant("w4a16_fused_eager", lambda: tokens_per_s(model, ids, res["new_tokens"]))
    if "bf16_static_compiled" in res["rows"]:
        variant("w4a16_fused_static_compiled", lambda: compiled(model))


def finish(res, args):
    r = res["rows"]
    for a, b in (("w4a16_eager", "bf16_eager"), ("w4a16_static_compiled", "bf16_static_compiled"),
                 ("w4a16_fused_eager", "bf16_eager"), ("w4a16_fused_static_compiled", "bf16_static_compiled"),
                 ("w4a16_fused_eager", "w4a16_eager"), ("w4a16_fused_static_compiled", "w4a16_static_compiled")):
        if "tokens_per_s" in r.get(a, {}) and "tokens_per_s" in r.get(b, {}):
            res[f"speedup_{a}_vs_{b}"] = r[a]["tokens_per_s"] / r[b]["tokens_per_s"]
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    log(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager variants only")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "w4a16_generate.json"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    run(args)


if __name__ == "__main__":
    main()
