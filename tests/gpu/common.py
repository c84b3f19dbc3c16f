"""What the GPU tests share: the error report, the Hopper + Gluon skip, random attention inputs.

With HF_FASTPATH_GPU_REPORT=path every case's errors are written there, a JSON line per test as it ends
(`conftest.py`; one file per pytest-xdist worker: path.gw0, path.gw1, ...)."""

from __future__ import annotations

import os

import pytest
import torch

REPORT: list = []


def report_path() -> str | None:
    """HF_FASTPATH_GPU_REPORT, with this pytest-xdist worker's suffix (path.gw0, ...) when there is one."""
    path = os.environ.get("HF_FASTPATH_GPU_REPORT")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return f"{path}.{worker}" if path and worker else path


def nonfinite_where(tensors: dict) -> dict:
    """Where the NaN / inf values of each tensor sit: {name: {count, shape, dim0: first 16 indices holding one,
    dim1: ...}}, for the tensors that have any."""
    where = {}
    for k, x in tensors.items():
        m = ~torch.isfinite(x)
        if m.any():
            idx = m.nonzero().tolist()
            where[k] = dict(count=len(idx), shape=list(m.shape),
                            **{f"dim{i}": sorted({row[i] for row in idx})[:16] for i in range(m.dim())})
    return where


def check_finite(name: str, tensors: dict, **inputs) -> None:
    """Asserts that every tensor of `tensors` is finite. A failure first goes to the report: where the non-finite
    values sit (their count and, per dimension, the first 16 indices holding one), and, with HF_FASTPATH_GPU_REPORT
    set, the bad tensors and `inputs` are saved beside it (path.nan-<pid>-<n>.pt): sessions 25-31's rare tile-256
    NaN came only inside `-n 8` runs (session 32 found it with `stress_backward.py`)."""
    where = nonfinite_where(tensors)
    if not where:
        return
    record = dict(case=name, nonfinite=where)
    path = report_path()
    if path:
        record["saved"] = f"{path}.nan-{os.getpid()}-{len(REPORT)}.pt"
        keep = {**inputs, **{k: tensors[k] for k in where}}
        torch.save({k: t.detach().cpu() if isinstance(t, torch.Tensor) else t for k, t in keep.items()},
                   record["saved"])
    REPORT.append(record)
    raise AssertionError(f"{name}: {', '.join(where)} has NaN/inf: {where}")


def needs_sm90_gluon(has_gluon: bool):
    """Skip unless an sm_90 GPU runs compiled kernels (not the interpreter) and this Triton has Gluon's Hopper
    module."""
    return pytest.mark.skipif(
        not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1" or not has_gluon
        or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU, Gluon, and TRITON_INTERPRET unset")


def attention_inputs(b, sq, sk, hq, hkv, d, dtype=torch.bfloat16, bhsd=False, seed=0, dout=False):
    """Random q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D] (and dout like q) on the GPU; `bhsd`: [B, H, S, D] memory
    seen through a transpose, as Transformers hands them over."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def make(s, h):
        shape = (b, h, s, d) if bhsd else (b, s, h, d)
        t = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
        return t.transpose(1, 2) if bhsd else t

    tensors = (make(sq, hq), make(sk, hkv), make(sk, hkv))
    return tensors + (make(sq, hq),) if dout else tensors


def rel_error(x, ref, scale=0.0) -> float:
    """Relative Frobenius error of x against ref (float64), in units of at least 1e-3 * scale: a gradient that is zero
    in exact arithmetic (one key: dS = 0, so dQ = dK = 0) is then compared by its rounding noise against the
    gradients' scale, not against 0."""
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-3 * float(scale)).clamp_min(1e-30)).item()
