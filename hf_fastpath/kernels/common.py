"""Small helpers every layer of the package uses (kernels sit at the bottom, so they live here)."""

from __future__ import annotations

import functools
import logging
import os
import weakref

import torch

__all__ = ["interpreting", "interpret_requested", "triton_runs_on", "cdiv", "next_pow2", "warn_once", "WARNED",
           "nvmma_layout", "gluon_build_failed", "derived_once"]

WARNED: set[str] = set()  # keys of the one-time warnings given so far (tests may discard keys to see them again)


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once, as triton.jit does when it decorates a kernel


def interpreting() -> bool:
    """Whether the Triton kernels run under the CPU interpreter (TRITON_INTERPRET=1 when they were decorated; an
    environment lookup per call showed in the decode step's host time). Backend *choice* reads the variable per call
    (`attention.backends`), so tests can pretend a plain CPU machine."""
    return _INTERPRET


def interpret_requested() -> bool:
    """TRITON_INTERPRET=1 in the environment now (read per call: backend choice follows it)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_runs_on(t: torch.Tensor) -> bool:
    """Whether our Triton kernels can take `t`: a CUDA tensor, or a CPU tensor under the interpreter (CI)."""
    return t.is_cuda or (t.device.type == "cpu" and interpret_requested())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv is a jit function: ~40 us per call from Python


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.lru_cache(maxsize=None)
def nvmma_layout(block: tuple, dtype):
    """Gluon's `NVMMASharedLayout.get_default_for(block, dtype)`, cached: it costs ~6 µs a call on the host, and
    every Gluon launch builds two or three TMA descriptors (block: a tuple; dtype: a gl dtype)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


@torch.compiler.assume_constant_result
def _emit(logger_name: str, message: str) -> bool:
    # torch.compile cannot trace a logging call (a graph break); a constant-result function runs once, in Python,
    # while Dynamo traces, so the warning is given then and the compiled graph stays whole
    logging.getLogger(logger_name).warning(message)
    return True


def warn_once(logger_name: str, key: str, message: str) -> None:
    """Log `message` as a warning of logger `logger_name` (pass `__name__`) the first time `key` is seen in this
    process, also from code that torch.compile traces."""
    if key not in WARNED:
        WARNED.add(key)
        _emit(logger_name, message)


def gluon_build_failed(errors: list, exc: Exception, logger_name: str, key: str, what: str, fallback: str) -> None:
    """A Gluon kernel did not build with this Triton (its Gluon API differs from the 3.6 and 3.9 we build against):
    record why in `errors` (the caller's module list, which its dispatch reads so as not to try again) and warn
    once that `fallback` runs instead."""
    errors.append(f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}")
    warn_once(logger_name, key, f"hf_fastpath's {what} does not build with this Triton ({errors[0]}); running "
                                f"{fallback} instead.")


def derived_once(cache: dict, tensor: torch.Tensor, key, make):
    """`make()`, computed once per `tensor` (and `key`) for as long as the tensor lives unchanged: the masks and
    packing tables a model's layers all share. Not while compiling (traced code recomputes it) or while capturing a
    CUDA graph (a tensor made there must stay out of later eager calls); entries go with their tensor."""
    if torch.compiler.is_compiling() or (tensor.is_cuda and torch.cuda.is_current_stream_capturing()):
        return make()
    slot = id(tensor)
    hit = cache.get(slot)
    if hit is not None and hit[0]() is tensor and hit[1] == (tensor._version, key):
        return hit[2]
    if hit is None or hit[0]() is not tensor:
        weakref.finalize(tensor, cache.pop, slot, None)
    value = make()
    cache[slot] = (weakref.ref(tensor), (tensor._version, key), value)
    return value
