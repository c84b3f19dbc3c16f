"""The cached CUDA device facts the kernel wrappers use to size their grids (`hf_fastpath/kernels/device.py`),
with torch's device queries replaced: one query per device, bare "cuda" meaning the current device."""

from __future__ import annotations

import types

import torch

from hf_fastpath.kernels import device, lowbit_decode, w4a16


def test_facts_are_queried_once_per_device(monkeypatch):
    queries = []

    def properties(index):
        queries.append(index)
        return types.SimpleNamespace(major=9 if index == 0 else 8, multi_processor_count=132 if index == 0 else 108)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    device._properties.cache_clear()
    try:
        cuda0, cuda1, bare = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda")
        assert (device.num_sms(cuda0), device.compute_major(cuda0)) == (132, 9)
        assert (device.num_sms(bare), device.compute_major(bare)) == (108, 8)  # the current device: 1
        assert device.num_sms(cuda1) == 108 and device.num_sms(cuda0) == 132
        assert sorted(queries) == [0, 1]
        # the wrappers size their grids from it (and from nothing on the CPU)
        assert w4a16._num_sms(cuda0) == 132 and w4a16._num_sms(torch.device("cpu")) == 1
        cfg = dict(lowbit_decode.DECODE_CONFIG, waves=2, min_tokens_per_split=1)
        monkeypatch.setattr(lowbit_decode, "interpreting", lambda: False)
        assert lowbit_decode._num_splits(4, 10**6, 64, cuda0, cfg) == 2 * 132 // 4
    finally:
        device._properties.cache_clear()


# ---- on_input_device: kernels launch on their inputs' GPU (models split over GPUs with device_map="auto") ----

def _pretend_cuda(monkeypatch, tensor_device: int, current: int):
    """CPU tensors that say they live on cuda:`tensor_device` while cuda:`current` is current; torch.cuda.device
    switches the pretended current device and records each switch."""
    state = {"current": current, "switches": []}

    class _Device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            self.previous, state["current"] = state["current"], self.index
            state["switches"].append(self.index)

        def __exit__(self, *exc):
            state["current"] = self.previous

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: tensor_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "device", _Device)
    monkeypatch.setattr(device, "_several_gpus", lambda: True)
    return state


def test_kernels_run_with_their_inputs_device_current(monkeypatch):
    seen = []

    @device.on_input_device
    def kernel(x, y, *, scale=1.0):
        seen.append(torch.cuda.current_device())
        return x * y * scale

    x = torch.ones(3)
    state = _pretend_cuda(monkeypatch, tensor_device=1, current=0)
    assert torch.equal(kernel(x, 2.0, scale=3.0), torch.full((3,), 6.0))  # arguments and result pass through
    assert seen == [1] and state["switches"] == [1] and state["current"] == 0  # switched for the call, restored
    assert torch.equal(kernel(y=2.0, x=x), torch.full((3,), 2.0)) and seen == [1, 1]  # x by keyword
    state["current"] = 1
    kernel(x, 2.0)
    assert seen == [1, 1, 1] and state["switches"] == [1, 1]  # already current: no switch


def test_no_device_switch_off_cuda():
    @device.on_input_device
    def kernel(x):
        return x + 1

    assert torch.equal(kernel(torch.zeros(2)), torch.ones(2))  # a CPU tensor: torch.cuda is never asked


def test_every_kernel_entry_point_launches_on_its_inputs_device():
    from hf_fastpath.kernels import (cross_entropy, flash_attention, gluon_attention, gluon_attention_bwd, gluon_w4a16,
                                     lowbit_attention, row_quant)

    entry_points = [flash_attention.flash_attention_forward, flash_attention.flash_attention_backward,
                    gluon_attention.gluon_attention_forward, gluon_attention_bwd.gluon_attention_backward,
                    gluon_w4a16.gluon_w4a16_matmul, w4a16.w4a16_matmul_rows, w4a16.w4a16_matmul_concat_rows,
                    w4a16.w4a16_matmul_grad_input, w4a16.w4a16_dequantize, cross_entropy.cross_entropy_rows_,
                    lowbit_attention.lowbit_flash_forward, lowbit_decode.lowbit_decode, row_quant.quantize_e4m3_rows]
    assert [f.__name__ for f in entry_points if not getattr(f, "on_input_device", False)] == []
