"""Every per-model fact the integrations need, one row per Transformers `model_type`.

A new family is a new row (checked against the installed Transformers by `tests/test_models_table.py`) plus the
family's tiny config in `tests/models.py`, which puts it through the model test matrix. The modules that read a row:

- `causal_lm_loss` (`use_chunked_loss`): `causal_lm`, the causal-LM class whose forward was checked to compute
  `logits = <output embeddings>(hidden_states)`, then (only) `final_logit_softcap`'s soft-capping, then
  `self.loss_function(logits, labels, ...)` (plus `router_aux_loss_coef * aux_loss` for a mixture of experts).
  None: not supported.
- `fused_projections` (W4A16 decoding): `shared_input_projections`, groups `(parent attribute, layer names)` of
  linears that read the parent's input and run as one W4A16 launch.
- `transformers_quantizer` (AWQ checkpoints): `awq_activation`, `(activation attribute, the linear before it)` of an
  MLP whose activation AWQ scales (checkpoint key `<mlp>.<activation>.scales`).
- `falcon` (attention by class name): `attention_class_table`, `(modeling module, class table)` of a model that picks
  its attention class by name instead of calling `ALL_ATTENTION_FUNCTIONS` (where the installed Transformers still
  has that table).
- `context_parallel`: `ring_attention`, whether the model's attention can run as ring attention (through
  `AttentionInterface`, no sliding window).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelFacts", "MODELS", "facts_for"]

_LLAMA_PROJECTIONS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


@dataclass(frozen=True)
class ModelFacts:
    causal_lm: str | None = None
    final_logit_softcap: str | None = None  # config attribute of a final logit soft-cap applied before the loss
    shared_input_projections: tuple = ()
    awq_activation: tuple[str, str] | None = None
    attention_class_table: tuple[str, str] | None = None
    ring_attention: bool = False


MODELS: dict[str, ModelFacts] = {
    "llama": ModelFacts("LlamaForCausalLM", shared_input_projections=_LLAMA_PROJECTIONS, ring_attention=True),
    "mistral": ModelFacts("MistralForCausalLM", shared_input_projections=_LLAMA_PROJECTIONS, ring_attention=True),
    "qwen2": ModelFacts("Qwen2ForCausalLM", shared_input_projections=_LLAMA_PROJECTIONS, ring_attention=True),
    "qwen3": ModelFacts("Qwen3ForCausalLM", shared_input_projections=_LLAMA_PROJECTIONS, ring_attention=True),
    # Gemma-2: soft-capped attention scores and logits, sliding-window layers (no ring attention for those)
    "gemma2": ModelFacts("Gemma2ForCausalLM", final_logit_softcap="final_logit_softcapping",
                         shared_input_projections=_LLAMA_PROJECTIONS),
    "gemma3_text": ModelFacts("Gemma3ForCausalLM", final_logit_softcap="final_logit_softcapping",
                              shared_input_projections=_LLAMA_PROJECTIONS),
    "phi3": ModelFacts("Phi3ForCausalLM", ring_attention=True),  # q/k/v and gate/up are one linear each already
    # mixtures of experts: fused 3-D expert weights (not linears), the router's loss added to the LM loss
    "mixtral": ModelFacts("MixtralForCausalLM", shared_input_projections=_LLAMA_PROJECTIONS[:1], ring_attention=True),
    "qwen2_moe": ModelFacts("Qwen2MoeForCausalLM", ring_attention=True, shared_input_projections=(
        _LLAMA_PROJECTIONS[0], ("shared_expert", ("gate_proj", "up_proj")))),
    "qwen3_moe": ModelFacts("Qwen3MoeForCausalLM", shared_input_projections=_LLAMA_PROJECTIONS[:1],
                            ring_attention=True),
    "falcon": ModelFacts("FalconForCausalLM", awq_activation=("act", "dense_h_to_4h"),
                         attention_class_table=("falcon", "FALCON_ATTENTION_CLASSES")),
    "gpt2": ModelFacts("GPT2LMHeadModel", ring_attention=True),
    "gpt_neox": ModelFacts("GPTNeoXForCausalLM", awq_activation=("act", "dense_h_to_4h"), ring_attention=True),
    "gptj": ModelFacts("GPTJForCausalLM", shared_input_projections=(("attn", ("q_proj", "k_proj", "v_proj")),),
                       awq_activation=("act", "fc_in"), attention_class_table=("gptj", "GPTJ_ATTENTION_CLASSES"),
                       ring_attention=True),
    "gpt_bigcode": ModelFacts("GPTBigCodeForCausalLM", awq_activation=("act", "c_fc"), ring_attention=True),
    # gpt-oss: attention sinks, sliding-window layers, a mixture of experts (fused 3-D weights, not linears)
    "gpt_oss": ModelFacts("GptOssForCausalLM", shared_input_projections=_LLAMA_PROJECTIONS[:1]),
    # AWQ checkpoints of these load onto our kernels; nothing else is wired for them
    "RefinedWebModel": ModelFacts(awq_activation=("act", "dense_h_to_4h")),
    "starcoder2": ModelFacts(awq_activation=("act", "c_fc")),
    "mpt": ModelFacts(awq_activation=("act", "up_proj")),
}

_NONE = ModelFacts()


def facts_for(model_or_config) -> ModelFacts:
    """The row of a model (or config; a PEFT model's base model) by `model_type`; an empty row if it has none."""
    config = getattr(model_or_config, "config", model_or_config)
    return MODELS.get(getattr(config, "model_type", None), _NONE)
