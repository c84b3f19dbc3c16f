"""hf_fastpath: fast attention, W4A16 GPTQ/AWQ kernels, QLoRA and ring attention for Hugging Face Transformers.

`import hf_fastpath` registers, with Transformers and PEFT:
- the attention implementations `fastpath`, `fastpath_triton|fa2|fa3|fa4`, `fastpath_fp8`, `fastpath_fp4` and
  `fastpath_ring` (with their mask functions), and fastpath attention classes for Falcon (and GPT-J on 5.17);
- the W4A16 quantizer (`W4A16Config`) and GPTQ/AWQ checkpoint loading onto `W4A16Linear`;
- the PEFT LoRA mapping for `W4A16Linear`.
"""

from __future__ import annotations

import importlib

from .attention import attention, attention_backward, attention_forward

__version__ = "0.1.0"

# One `register()` per integration; each is idempotent.
_INTEGRATIONS = (
    "hf_fastpath.integrations.transformers_attention",
    "hf_fastpath.integrations.context_parallel",
    "hf_fastpath.integrations.transformers_quantizer",
    "hf_fastpath.integrations.peft",
)
for _name in _INTEGRATIONS:
    importlib.import_module(_name).register()
del _name

# Public names that live in submodules: loaded on first use.
_LAZY = {
    "W4A16Config": "hf_fastpath.quantization.config",
    "W4A16Linear": "hf_fastpath.quantization.linear",
    "ring_attention": "hf_fastpath.parallel.ring_attention",
    "context_parallel": "hf_fastpath.integrations.context_parallel",
    "prepare_model_for_qlora": "hf_fastpath.quantization.training",
    "merge_and_dequantize": "hf_fastpath.integrations.peft",
    "LowBitCache": "hf_fastpath.integrations.lowbit_cache",
    "register_attention_variant": "hf_fastpath.integrations.transformers_attention",
    "describe_backends": "hf_fastpath.attention.backends",
    "fp8_attention": "hf_fastpath.attention.lowbit",
    "fp4_attention": "hf_fastpath.attention.lowbit",
    "use_chunked_loss": "hf_fastpath.integrations.causal_lm_loss",
    "fuse_projections": "hf_fastpath.integrations.fused_projections",
    "chunked_linear_cross_entropy": "hf_fastpath.losses",
}


def __getattr__(name):
    if name == "parallel":
        return importlib.import_module(".parallel", __name__)
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_fastpath' has no attribute {name!r}")


__all__ = ["attention", "attention_forward", "attention_backward", "__version__", *_LAZY]
