"""`hf-fastpath env`: what this machine can run, and why not the rest."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect() -> dict:
    """Versions, device, attention backends and quantization backends, as plain data."""
    import torch

    info = {
        "python": platform.python_version(),
        "packages": {
            name: _version(name)
            for name in ("hf-fastpath", "torch", "triton", "transformers", "accelerate", "peft", "flash-attn",
                         "flash-attn-3", "flash-attn-4", "gptqmodel", "optimum")
        },
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
    }
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        info["device"] = f"{torch.cuda.get_device_name()} (sm_{major}{minor}), {torch.cuda.device_count()} visible"
    else:
        info["device"] = "no CUDA device: attention runs the PyTorch reference path, W4A16 dequantizes on the fly"
    from .attention.backends import describe_backends

    info["attention"] = describe_backends()
    if torch.cuda.is_available():
        from .attention.dispatch import explain

        info["fastpath_dispatch"] = explain(tuple(torch.cuda.get_device_capability()))
    info["distributed"] = {
        "nccl": torch.distributed.is_available() and torch.distributed.is_nccl_available(),
        "gloo": torch.distributed.is_available() and torch.distributed.is_gloo_available(),
    }
    has_gptqmodel = importlib.util.find_spec("gptqmodel") is not None
    info["w4a16"] = {
        "kernels": "triton (CUDA)" if torch.cuda.is_available() else "reference (dequantize + matmul)",
        "gptq/awq checkpoints": "load onto hf_fastpath W4A16Linear"
        + (" (gptqmodel is installed: set HF_FASTPATH_GPTQ_BACKEND=gptqmodel to use it instead)" if has_gptqmodel
           else ""),
    }
    return info


def main(args=None) -> int:
    info = collect()
    print(f"python {info['python']}  " + "  ".join(f"{k} {v}" for k, v in info["packages"].items() if v))
    missing = [k for k, v in info["packages"].items() if not v]
    if missing:
        print("not installed: " + ", ".join(missing))
    print(f"device: {info['device']}" + ("  [TRITON_INTERPRET=1]" if info["triton_interpret"] else ""))
    print("attention backends:")
    for b in info["attention"]:
        print(f"  {'ok ' if b['available'] else ' - '} {b['name']:<10} {b['reason']}")
    if "fastpath_dispatch" in info:
        print("'fastpath' for plain calls (no padding mask, static cache, window, softcap, ALiBi or varlen, which "
              "always run hf_fastpath's kernels), by measured kind of call:")
        for line in info["fastpath_dispatch"]:
            print("   ", line)
    print("w4a16: " + "; ".join(f"{k}: {v}" for k, v in info["w4a16"].items()))
    print("distributed: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in info["distributed"].items()))
    return 0
