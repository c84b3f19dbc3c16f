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
