"""Run a function on several local processes with torch.distributed initialised (gloo on CPU): tests, smoke runs."""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_in_processes"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, backend, env, fn, args):
    os.environ.update(env)
    torch.set_num_threads(1)  # several processes share few cores
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Done and torn down: leave without the interpreter's shutdown. In ~5-12% of runs (CPU, gloo, torch 2.13) a
    # C++ thread still joinable at static destruction aborted a process here ("terminate called without an active
    # exception", SIGABRT) after both ranks had finished cleanly. Errors above still propagate (and are reported).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_in_processes(fn, world_size: int, *args, backend: str = "gloo", env: dict | None = None) -> None:
    """`fn(rank, world_size, *args)` on `world_size` spawned processes; an exception in any of them is re-raised.
    `fn` must be importable (module level). `env` is applied in each child before `fn` runs."""
    mp.spawn(_worker, args=(world_size, free_port(), backend, dict(env or {}), fn, args), nprocs=world_size,
             join=True)
