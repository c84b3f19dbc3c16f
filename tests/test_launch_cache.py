"""`kernels.launch.LaunchCache`: which calls reuse a compiled kernel and what they hand its launcher.

CI has no GPU, so the kernel is a real `JITFunction` whose compile-and-launch path (`run`) and compiled kernel are
stand-ins that record their calls; `benchmarks/direct_launch.py` checks the real launches against Triton's own path
on the GPU.
"""

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from hf_fastpath.kernels import launch


def _kernel(X, Y, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = 3):
    pass


def _bad_order(X, BLOCK: tl.constexpr, n):
    pass


class _Compiled:
    function = "fn-handle"
    packed_metadata = "meta"

    def __init__(self):
        self.calls = []

    def run(self, *a):
        self.calls.append(a)


@pytest.fixture
def cache(monkeypatch):
    if not launch._SUPPORTED:
        pytest.skip(f"direct launches are off on Triton {triton.__version__}")
    monkeypatch.delenv("HF_FASTPATH_DIRECT_LAUNCH", raising=False)
    fn = JITFunction(_kernel)
    compiled = _Compiled()
    slow = []

    def run(*args, grid, warmup, **kwargs):  # Triton's path: (compile), launch, return the kernel
        slow.append((grid, args, kwargs))
        return compiled

    monkeypatch.setattr(fn, "run", run)
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "_current_stream", lambda device: 1234)
    c = launch.LaunchCache(fn)
    assert c.enabled
    return c, slow, compiled.calls


def _args(x=None, n=64):
    x = torch.zeros(64) if x is None else x
    return (x, torch.zeros(64, dtype=torch.int32), n, 0.5)


def test_second_call_launches_the_compiled_kernel_with_all_arguments(cache):
    c, slow, fast = cache
    meta = dict(BLOCK=32, num_warps=4)
    args = _args()
    c.launch((3, 2), args, meta, "k")
    # Triton's path compiles with the options every launch pins (FP contraction: Triton 3.9's default may change)
    assert len(slow) == 1 and slow[0][0] == (3, 2) and slow[0][2] == {**meta, "enable_fp_fusion": True} and not fast
    c.launch((5, 1, 2), args, meta, "k")
    assert len(slow) == 1 and len(fast) == 1
    # grid padded to 3-D, the current stream, the kernel's handles, no launch metadata or hooks, then every
    # parameter in order: the runtime arguments, BLOCK from meta and FLAG's default
    assert fast[0] == (5, 1, 2, 1234, "fn-handle", "meta", None, None, None, *args, 32, 3)


@pytest.mark.parametrize("change", ["misaligned", "dtype", "int_one", "int_div16", "int64", "meta_key"])
def test_a_different_specialization_takes_tritons_path(cache, change):
    c, slow, fast = cache
    base = torch.zeros(80)
    c.launch((1,), _args(base[:64]), dict(BLOCK=32), "k")
    args, key = _args(base[:64]), "k"
    if change == "misaligned":
        args = _args(base[1:65])  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        args = _args(base[:64].half())
    elif change == "int_one":
        args = _args(base[:64], n=1)
    elif change == "int_div16":
        args = _args(base[:64], n=65)
    elif change == "int64":
        args = _args(base[:64], n=2**33)
    else:
        key = "other"
    c.launch((1,), args, dict(BLOCK=32), key)
    assert len(slow) == 2 and not fast
    c.launch((1,), args, dict(BLOCK=32), key)  # and is cached in turn
    assert len(slow) == 2 and len(fast) == 1


def test_arguments_it_cannot_key_take_tritons_path(cache):
    c, slow, fast = cache
    args = (object(), *_args()[1:])  # e.g. a TMA descriptor
    for _ in range(2):
        c.launch((1,), args, dict(BLOCK=32), "k")
    assert len(slow) == 2 and not fast and all(kw["enable_fp_fusion"] is True for _, _, kw in slow)


def test_tma_descriptors_are_keyed_by_dtype_block_and_layout(cache):
    """A host TMA descriptor specializes the kernel on its dtype, block shape and layout only (Triton's own key);
    another address or shape reuses the kernel, another block or dtype compiles anew."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    c, slow, fast = cache

    def call(t, block):
        c.launch((1,), (TensorDescriptor.from_tensor(t, block), *_args()[1:]), dict(BLOCK=32), "k")

    call(torch.zeros(64, 64), [16, 32])
    call(torch.zeros(128, 32), [16, 32])  # other address and shape: same kernel
    assert len(slow) == 1 and len(fast) == 1 and fast[0][9].base.shape == (128, 32)
    call(torch.zeros(64, 64), [32, 32])
    call(torch.zeros(64, 64, dtype=torch.float16), [16, 32])
    assert len(slow) == 3 and len(fast) == 1


def test_values_with_the_same_specialization_share_a_kernel(cache):
    c, slow, fast = cache
    c.launch((1,), _args(n=17), dict(BLOCK=32), "k")
    c.launch((1,), _args(n=33), dict(BLOCK=32), "k")  # neither is 1 nor a multiple of 16
    c.launch((1,), _args(torch.zeros(128)[16:80], n=49), dict(BLOCK=32), "k")  # 64 bytes in: still aligned
    assert len(slow) == 1 and len(fast) == 2
    assert fast[0][9 + 2] == 33 and fast[1][9 + 2] == 49


def _record_launch(metadata):
    pass


def test_launch_hooks_and_the_switch_keep_tritons_path(cache, monkeypatch):
    c, slow, fast = cache
    hook = triton.knobs.runtime.launch_enter_hook
    if hasattr(hook, "calls"):  # a HookChain
        monkeypatch.setattr(hook, "calls", [_record_launch])
    else:
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", _record_launch)
    for _ in range(3):
        c.launch((1,), _args(), dict(BLOCK=32), "k")
    assert len(slow) == 3 and not fast and all(kw["enable_fp_fusion"] is True for _, _, kw in slow)
    monkeypatch.setenv("HF_FASTPATH_DIRECT_LAUNCH", "0")
    assert not launch.LaunchCache(c.fn).enabled


def test_constexpr_parameters_must_come_last():
    if not launch._SUPPORTED:
        pytest.skip(f"direct launches are off on Triton {triton.__version__}")
    with pytest.raises(ValueError, match="constexpr parameters must follow"):
        launch.LaunchCache(JITFunction(_bad_order))


def test_interpreted_kernels_always_take_tritons_path():
    fn = triton.jit(_kernel)  # an InterpretedFunction under TRITON_INTERPRET=1 (the CPU test suite)
    assert not launch.LaunchCache(fn).enabled


def test_launch_cached_keeps_a_cache_per_kernel_keyed_by_meta(cache, monkeypatch):
    # the attention launchers' entry point: fn's cache, meta's items as the key, so other constexprs compile anew
    c, slow, fast = cache
    monkeypatch.setattr(launch, "_CACHES", {c.fn: c})
    for block in (32, 32, 64, 64):
        launch.launch_cached(c.fn, (1,), _args(), dict(BLOCK=block, num_warps=4))
    assert len(slow) == 2 and [f[-2] for f in fast] == [32, 64]
    other = JITFunction(_kernel)
    monkeypatch.setattr(other, "run", lambda *a, grid, warmup, **kw: slow.append(grid))
    launch.launch_cached(other, (7,), _args(), dict(BLOCK=32))
    assert slow[-1] == (7,) and isinstance(launch._CACHES[other], launch.LaunchCache)
