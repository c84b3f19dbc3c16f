"""Tiny random-weight models of every supported family, for tests (no download needed).

    from tests.models import FAMILIES, tiny_config, tiny_model
    model = tiny_model("llama", attn_implementation="fastpath")

Every config: 2 layers, hidden 64, 4 query heads (head dim 16), vocab 128, 64 positions. Families:
`llama` (GQA 4/2), `mistral` (GQA, sliding window 8), `qwen2` (GQA, q/k/v biases), `qwen3` (GQA, q/k norms),
`gemma2` (GQA, soft-capped scores and logits, alternating sliding-window 8 and full layers), `falcon` (rotary +
multi-query), `falcon_gqa` (new_decoder_architecture, 2 KV heads),
`falcon_alibi` (ALiBi, parallel attention), `gpt2` (Conv1D, scale_attn_by_inverse_layer_idx), `gpt_neox` (partial
rotary), `gptj` (partial rotary), `gpt_bigcode` (multi-query), `gemma3_text` ((1 + w) norms, sliding window 8 on
every other layer, logit soft-cap), `phi3` (fused q/k/v and gate/up), `mixtral` (4 experts), `qwen2_moe` (4 experts
and a gated shared expert), `qwen3_moe` (4 experts), `gpt_oss` (attention sinks, sliding window 8 on every other
layer, 4 experts). `overrides` are config keyword arguments, e.g.
`tiny_config("llama", hidden_size=256, intermediate_size=512)` for group-size-128 quantization tests
(`hidden_size` works for every family: GPT-2, GPT-J and GPT-BigCode map it to `n_embd`).
Import as `from models import ...` (pytest puts tests/ on sys.path) or `from tests.models import ...` from the repo root.
"""

from __future__ import annotations

import copy

import torch
import transformers

# Base families (one per modeling file), then the extra Falcon variants.
BASE_FAMILIES = ("llama", "falcon", "gpt2", "gpt_neox", "gptj", "gpt_bigcode", "mistral", "qwen2", "qwen3", "gemma2",
                 "gemma3_text", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")
FAMILIES = BASE_FAMILIES + ("falcon_gqa", "falcon_alibi")

VOCAB = 128
HIDDEN = 64
HEADS = 4
LAYERS = 2
POSITIONS = 64

_CONFIGS = {
    "llama": (
        "LlamaConfig",
        dict(hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=HEADS, num_key_value_heads=2,
             num_hidden_layers=LAYERS, max_position_embeddings=POSITIONS),
    ),
    "falcon": (
        "FalconConfig",
        dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS, multi_query=True,
             new_decoder_architecture=False, parallel_attn=True, alibi=False, bias=False,
             max_position_embeddings=POSITIONS),
    ),
    "falcon_gqa": (
        "FalconConfig",
        dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_kv_heads=2, num_hidden_layers=LAYERS,
             new_decoder_architecture=True, parallel_attn=True, alibi=False, bias=False,
             max_position_embeddings=POSITIONS),
    ),
    "falcon_alibi": (
        "FalconConfig",
        dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS, multi_query=False,
             new_decoder_architecture=False, parallel_attn=False, alibi=True, bias=True,
             max_position_embeddings=POSITIONS),
    ),
    "gpt2": (
        "GPT2Config",
        dict(n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS, n_positions=POSITIONS, scale_attn_by_inverse_layer_idx=True),
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        dict(hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
             max_position_embeddings=POSITIONS),
    ),
    "gptj": (
        "GPTJConfig",
        dict(n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS, n_positions=POSITIONS, rotary_dim=8),
    ),
    "gpt_bigcode": (
        "GPTBigCodeConfig",
        dict(n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS, n_positions=POSITIONS, multi_query=True),
    ),
    "mistral": (  # a sliding window shorter than the test sequences
        "MistralConfig",
        dict(hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=HEADS, num_key_value_heads=2,
             num_hidden_layers=LAYERS, max_position_embeddings=POSITIONS, sliding_window=8),
    ),
    "qwen2": (  # biases on q/k/v
        "Qwen2Config",
        dict(hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=HEADS, num_key_value_heads=2,
             num_hidden_layers=LAYERS, max_position_embeddings=POSITIONS),
    ),
    "qwen3": (  # RMS-normed q/k
        "Qwen3Config",
        dict(hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=HEADS, num_key_value_heads=2,
             head_dim=HIDDEN // HEADS, num_hidden_layers=LAYERS, max_position_embeddings=POSITIONS),
    ),
    "gemma2": (  # soft-capped scores and logits; layers alternate sliding-window (8) and full attention
        "Gemma2Config",
        dict(hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=HEADS, num_key_value_heads=2,
             head_dim=HIDDEN // HEADS, num_hidden_layers=LAYERS, max_position_embeddings=POSITIONS, sliding_window=8,
             attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=HIDDEN // HEADS),
    ),
    "gemma3_text": (  # (1 + weight) norms, q/k norms, sliding-window (8) layers with their own rotary base
        "Gemma3TextConfig",
        dict(hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=HEADS, num_key_value_heads=2,
             head_dim=HIDDEN // HEADS, num_hidden_layers=LAYERS, max_position_embeddings=POSITIONS, sliding_window=8,
             layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=HIDDEN // HEADS,
             final_logit_softcapping=30.0),
    ),
    "phi3": (  # fused qkv_proj and gate_up_proj
        "Phi3Config",
        dict(hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=HEADS, num_key_value_heads=2,
             num_hidden_layers=LAYERS, max_position_embeddings=POSITIONS),
    ),
    "mixtral": (  # a mixture of 4 experts (fused 3-D weights), top-2
        "MixtralConfig",
        dict(hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=HEADS, num_key_value_heads=2,
             num_hidden_layers=LAYERS, max_position_embeddings=POSITIONS, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen2_moe": (  # routed experts plus a gated shared expert (its one-output gate stays float under W4A16)
        "Qwen2MoeConfig",
        dict(hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=HEADS, num_key_value_heads=2,
             num_hidden_layers=LAYERS, max_position_embeddings=POSITIONS, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, shared_expert_intermediate_size=64),
    ),
    "qwen3_moe": (  # q/k norms, 4 experts top-2, no shared expert
        "Qwen3MoeConfig",
        dict(hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=HEADS, num_key_value_heads=2,
             head_dim=HIDDEN // HEADS, num_hidden_layers=LAYERS, max_position_embeddings=POSITIONS, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=32),
    ),
    "gpt_oss": (  # attention sinks, alternating sliding-window (8) and full layers, a mixture of 4 experts
        "GptOssConfig",
        dict(hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=HEADS, num_key_value_heads=2,
             head_dim=HIDDEN // HEADS, num_hidden_layers=LAYERS, max_position_embeddings=POSITIONS, sliding_window=8,
             num_local_experts=4, num_experts_per_tok=2, rope_parameters=dict(rope_type="default", rope_theta=1e4)),
    ),
}

# Token ids 1..VOCAB-1 are "real" text; 0 is the pad/eos id for every family.
_COMMON = dict(vocab_size=VOCAB, pad_token_id=0, eos_token_id=0, bos_token_id=0, tie_word_embeddings=False)


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    """A fresh tiny config for `family` (see `FAMILIES`); `overrides` are config keyword arguments."""
    if family not in _CONFIGS:
        raise ValueError(f"Unknown family {family!r}; choose one of {', '.join(FAMILIES)}.")
    class_name, kwargs = _CONFIGS[family]
    kwargs = {**_COMMON, **copy.deepcopy(kwargs), **overrides}
    # Dropout off: tests compare implementations and gradients exactly.
    for name in ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout",
                 "hidden_dropout_prob"):
        kwargs.setdefault(name, 0.0)
    return getattr(transformers, class_name)(**kwargs)


def tiny_model(family: str, attn_implementation: str = "eager", *, seed: int = 0, dtype=torch.float32,
               config: transformers.PretrainedConfig | None = None, **overrides) -> transformers.PreTrainedModel:
    """A `...ForCausalLM` with seeded random weights, in eval mode. Same `seed` -> same weights, whatever the
    attention implementation, so two models can be compared directly."""
    config = copy.deepcopy(config) if config is not None else tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                          dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".sinks"):  # initialised near 0: make them matter
                p.normal_(0.0, 1.5)
    return model.eval()


def random_batch(batch: int = 2, seq: int = 12, *, left_pad=(), right_pad=(), seed: int = 0):
    """`(input_ids, attention_mask)`; `left_pad`/`right_pad` give per-row pad counts (rows not listed: none)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for row, n in enumerate(left_pad):
        mask[row, :n] = 0
    for row, n in enumerate(right_pad):
        if n:
            mask[row, seq - n:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask
