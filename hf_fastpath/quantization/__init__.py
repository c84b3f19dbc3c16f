"""W4A16 weight-only quantization: checkpoint formats, the `W4A16Linear` layer, `W4A16Config`, calibration."""

from .awq import ScaledActivation
from .linear import W4A16Linear, w4a16_backend

__all__ = ["W4A16Linear", "ScaledActivation", "w4a16_backend", "W4A16Config"]


def __getattr__(name):
    if name == "W4A16Config":  # imports Transformers: load on first use
        from .config import W4A16Config

        return W4A16Config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
