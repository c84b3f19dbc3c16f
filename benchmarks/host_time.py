"""Host time of a GPU call: how long the host takes to enqueue it, beside how long the GPU takes to finish it."""

from __future__ import annotations

import time

import torch


def host_and_wall(fn, calls: int, warmup: int = 0) -> tuple[float, float]:
    """Seconds per call of `fn` over `calls` back-to-back calls (after `warmup` untimed ones): to enqueue them (the
    GPU not awaited), and until the GPU has finished them. Equal figures: the call is host-bound."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return host, (time.perf_counter() - start) / calls
