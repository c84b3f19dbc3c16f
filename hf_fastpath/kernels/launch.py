"""Direct launches of compiled Triton kernels, for callers whose host time per launch shows (eager decoding).

`JITFunction.run` re-derives on every call what a decode loop already knows: it binds the arguments, specializes
each one (dtype, 16-byte alignment, int == 1 or % 16), builds the cache key and compares every constexpr global the
kernel reads with its value at compile time. On the H200's host that is ~50 µs for the W4A16 decode kernel (15
arguments, 12 constexpr globals) against ~7 µs for the launch itself; a batch-1 decoding step makes 7 such calls per
layer. `LaunchCache` remembers the compiled kernel per specialization key and calls its launcher directly. The
first call of a key goes through Triton's own path, which compiles and launches, and hands back the kernel it used.

The key must cover everything Triton specializes on, or a kernel compiled for other arguments would run: per
tensor its dtype and whether its address is 16-byte aligned, per int whether it is 1, divisible by 16 and fits
in 32 bits, per float its type, per host TMA descriptor its dtype, block shape and shared layout (Gluon's W4A16
GEMM: ~80-120 µs of host time a call through Triton's path on the H200's host); the caller's `meta_key` stands for
the constexprs and launch options, and the key also holds the current device. Arguments of any other type send the
call down Triton's path, as does every call under TRITON_INTERPRET=1, with a launch hook installed (profilers), or
with HF_FASTPATH_DIRECT_LAUNCH=0.
"""

from __future__ import annotations

import os

import torch
import triton
from triton.runtime.jit import JITFunction

from .device import current_stream as _current_stream

__all__ = ["COMPILE_OPTIONS", "LaunchCache", "cache_of", "launch_cached"]

# Compile options every launch of ours pins (`fn[grid](..., **COMPILE_OPTIONS)`). FP contraction: the kernels are
# written for FMAs (the softmax's scale-and-subtract is one), and Triton 3.9 warns on every first compile that its
# default will change; without it they would round differently and run slower.
COMPILE_OPTIONS = {"enable_fp_fusion": True}


def _direct_launch_supported() -> bool:
    # Triton >= 3.4 passes every bound argument, constexprs included, to CompiledKernel.run and keeps its launch
    # hooks in triton.knobs (the convention this module reproduces; checked up to 3.9).
    major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 4) and hasattr(triton, "knobs")


_SUPPORTED = _direct_launch_supported()


def _current_device() -> int:
    return triton.runtime.driver.active.get_current_device()


class _Unkeyed(Exception):
    pass


def _hooked(hook) -> bool:
    # Triton >= 3.5 keeps a HookChain (empty: no hook); older ones None or the hook itself
    return hook is not None and getattr(hook, "calls", True)


def _arg_key(a):
    if isinstance(a, int):  # bool included
        return (a == 1, a % 16 == 0, -(2**31) <= a < 2**31)
    if isinstance(a, float) or a is None:
        return type(a)
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(getattr(a, "base", None), torch.Tensor) and hasattr(a, "block_shape"):
        # a host TMA descriptor (Gluon's or Triton's TensorDescriptor): Triton specializes it on its dtype, block
        # shape and shared layout only; its address, shape and strides go to the launcher, which encodes the
        # CUtensorMap on every call
        return (type(a), a.base.dtype, tuple(a.block_shape), getattr(a, "layout", None), a.padding)
    raise _Unkeyed  # specialized on more than this module knows how to key


class LaunchCache:
    """`cache.launch(grid, args, meta, meta_key)` does `fn[grid](*args, **meta)`.

    args: the kernel's runtime arguments in order (tensors, ints, floats); meta: its constexpr arguments and launch
    options (num_warps, num_stages); meta_key: a hashable value that determines meta (the same meta_key must always
    come with the same meta). The kernel's constexpr parameters must all follow its runtime ones."""

    def __init__(self, fn):
        self.fn = fn
        self.enabled = (_SUPPORTED and isinstance(fn, JITFunction)
                        and os.environ.get("HF_FASTPATH_DIRECT_LAUNCH", "1") != "0")
        self._kernels: dict = {}
        if self.enabled:
            flags = [p.is_constexpr for p in fn.params]
            n_runtime = flags.index(True) if True in flags else len(flags)
            if any(not f for f in flags[n_runtime:]):
                raise ValueError(f"LaunchCache({fn.__name__}): constexpr parameters must follow the runtime ones")
            self._n_runtime = n_runtime
            self._constexpr_params = fn.params[n_runtime:]

    def launch(self, grid, args: tuple, meta: dict, meta_key) -> None:
        if not self.enabled or _hooked(triton.knobs.runtime.launch_enter_hook) or \
                _hooked(triton.knobs.runtime.launch_exit_hook):
            self.fn[grid](*args, **meta, **COMPILE_OPTIONS)
            return
        device = _current_device()
        try:
            key = (meta_key, device, *[_arg_key(a) for a in args])
        except _Unkeyed:
            self.fn[grid](*args, **meta, **COMPILE_OPTIONS)
            return
        entry = self._kernels.get(key)
        if entry is None:
            if len(args) != self._n_runtime:
                raise TypeError(f"{self.fn.__name__}: expected {self._n_runtime} runtime arguments, got {len(args)}")
            # compiles if needed, launches, and returns the kernel it ran
            kernel = self.fn[grid](*args, **meta, **COMPILE_OPTIONS)
            self._kernels[key] = (kernel, tuple(meta[p.name] if p.name in meta else p.default
                                                for p in self._constexpr_params))
            return
        kernel, constexprs = entry
        gx, gy, gz = (*grid, 1, 1)[:3]
        kernel.run(gx, gy, gz, _current_stream(device), kernel.function,
                   kernel.packed_metadata, None, None, None, *args, *constexprs)


_CACHES: dict = {}


def cache_of(fn) -> LaunchCache:
    """`fn`'s own LaunchCache, the one `launch_cached` uses (benchmarks switch it off through `.enabled`)."""
    cache = _CACHES.get(fn)
    if cache is None:
        cache = _CACHES[fn] = LaunchCache(fn)
    return cache


def launch_cached(fn, grid, args: tuple, meta: dict) -> None:
    """`fn[grid](*args, **meta)` through `fn`'s own LaunchCache, keyed by meta's items (hashable values)."""
    cache_of(fn).launch(grid, args, meta, tuple(meta.items()))
