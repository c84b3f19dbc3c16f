"""Facts about a CUDA device that the kernel wrappers ask on every call, cached: a device query costs
microseconds, and decoding asks once per layer and token."""

from __future__ import annotations

import functools

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
