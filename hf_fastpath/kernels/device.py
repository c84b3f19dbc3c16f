"""Facts about a CUDA device that the kernel wrappers ask on every call, cached: a device query costs
microseconds, and decoding asks once per layer and token; and `on_input_device`, which makes the kernels launch on
their inputs' GPU."""

from __future__ import annotations

import functools
import inspect

import torch
import triton


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA device (the current one for a bare "cuda")."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _properties(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.major, props.multi_processor_count


def compute_major(device: torch.device) -> int:
    """The major compute capability (9 on Hopper)."""
    return _properties(cuda_index(device))[0]


def num_sms(device: torch.device) -> int:
    """The number of streaming multiprocessors."""
    return _properties(cuda_index(device))[1]


def current_stream(index: int) -> int:
    """The current CUDA stream of device `index` as Triton's launcher takes it (torch.cuda.current_stream() costs
    ~8 µs a call)."""
    return triton.runtime.driver.active.get_current_stream(index)


@functools.lru_cache(maxsize=None)
def _several_gpus() -> bool:
    return torch.cuda.device_count() > 1  # fixed for the process (CUDA_VISIBLE_DEVICES is read once)


def on_input_device(fn):
    """Decorator for kernel entry points `fn(x, ...)`: run fn with x's CUDA device current.

    Triton launches on the *current* device and its current stream. A model split over GPUs (`device_map="auto"`)
    hands a layer tensors on cuda:1 while cuda:0 stays current, and a launch there reads the other GPU's memory from
    the wrong device: a crash ("cannot be accessed from Triton") or, worse, silently wrong results. A no-op (one
    index compare) when x's device is already current, off CUDA, and while torch.compile traces (the compiled
    graph's launches carry their own device). With one GPU visible it costs one cached check (~0.2 µs a call)."""

    first = next(iter(inspect.signature(fn).parameters))

    @functools.wraps(fn)
    def run(*args, **kwargs):
        x = args[0] if args else kwargs.get(first)
        if not torch.compiler.is_compiling() and _several_gpus() and isinstance(x, torch.Tensor) and x.is_cuda:
            index = x.get_device()
            if index != torch.cuda.current_device():
                with torch.cuda.device(index):
                    return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    run.on_input_device = True
    return run
