"""hf_fastpath: fast attention, W4A16 GPTQ/AWQ kernels, QLoRA and ring attention for Hugging Face Transformers.

`import hf_fastpath` registers the `fastpath*` attention implementations, the W4A16 quantizer (and the GPTQ/AWQ
checkpoint loaders) and the PEFT LoRA mapping with Transformers and PEFT.
"""

from __future__ import annotations

import importlib
import importlib.util

from .attention import attention, attention_backward, attention_forward

__version__ = "0.1.0"

# Registration hooks, one per integration. Each module exposes `register()`; it must be idempotent.
_INTEGRATIONS = (
    "hf_fastpath.integrations.transformers_attention",
    "hf_fastpath.integrations.transformers_quantizer",
    "hf_fastpath.integrations.peft",
)


def _register_integrations() -> None:
    for name in _INTEGRATIONS:
        if importlib.util.find_spec(name) is not None:  # TODO(lead): drop the guard once every module landed
            importlib.import_module(name).register()


_register_integrations()


def __getattr__(name):
    # Heavier parts load on first use.
    if name == "W4A16Config":
        from .quantization.config import W4A16Config

        return W4A16Config
    if name == "ring_attention":
        from .parallel import ring_attention

        return ring_attention
    if name == "parallel":
        return importlib.import_module(".parallel", __name__)
    raise AttributeError(f"module 'hf_fastpath' has no attribute {name!r}")


__all__ = ["attention", "attention_forward", "attention_backward", "W4A16Config", "ring_attention", "__version__"]
