"""The Gluon launchers' host side on the CPU: everything `gluon_attention_forward` / `_backward` and
`gluon_w4a16_matmul_rows` do before the launch (views, TMA descriptors, grids, argument lists) runs on CPU tensors,
with the Hopper check bypassed and the kernel replaced by a recorder. The offline builds (test_gluon_builds.py and
the like) compile the kernels from signatures of their own; these tests check what the launchers really pass: every
kernel parameter bound, descriptors over the caller's memory with boxes of the right rank and size. (Session 24's
last refactor gave [B, S, H, D] inputs a 3-D box over a 2-D view; only a GPU run noticed.)"""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from hf_fastpath.kernels import gluon_attention as ga
from hf_fastpath.kernels import gluon_attention_bwd as gb
from hf_fastpath.kernels.launch import COMPILE_OPTIONS

pytestmark = pytest.mark.skipif(not ga.HAS_GLUON, reason="needs Triton's Gluon (triton >= 3.6)")


class _Recorder:
    """Stands in for a Gluon kernel: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


@pytest.fixture
def launches(monkeypatch):
    """The recorded launches of both kernels. `check_inputs` is off: its first check wants a Hopper GPU (the input
    checks have tests of their own)."""
    recorded = []

    def recording(kernel_args):
        def wrapped(*a, **kw):
            kernel, meta = kernel_args(*a, **kw)
            recorded.append(_Recorder(kernel))
            return recorded[-1], meta
        return wrapped

    monkeypatch.setattr(ga, "check_inputs", lambda *a, **kw: None)
    monkeypatch.setattr(ga, "kernel_args", recording(ga.kernel_args))
    monkeypatch.setattr(gb, "kernel_args", recording(gb.kernel_args))
    monkeypatch.setattr(ga, "_sm_count", lambda device: 132)
    return recorded


def _bound(recorder):
    """The one recorded launch, bound to the kernel's parameters (launch and compile options dropped, the pinned
    compile options checked first)."""
    assert len(recorder.calls) == 1
    grid, args, kwargs = recorder.calls[0]
    assert {k: kwargs.get(k) for k in COMPILE_OPTIONS} == COMPILE_OPTIONS
    kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "maxnreg", *COMPILE_OPTIONS)}
    bound = inspect.signature(recorder.kernel.fn).bind(*args, **kwargs)  # TypeError if one is missing or extra
    bound.apply_defaults()
    assert all(g > 0 for g in grid)
    return bound.arguments


def _check_descriptor(desc, source, rows, tile, padded):
    assert list(desc.block_shape) == ([1, rows, tile] if padded else [rows, tile])  # spelled out, not tile_box
    assert len(desc.block_shape) == len(desc.shape) == desc.base.dim() == (3 if padded else 2)
    assert desc.base.data_ptr() == source.data_ptr()  # a view of the caller's memory, no copy
    assert desc.strides[-1] == 1 and all(s * source.element_size() % 16 == 0 for s in desc.strides[:-1])


def _inputs(d, bhsd, b=2, sq=70, sk=70, hq=4, hkv=2):
    def make(s, h):
        return torch.randn(b, h, s, d).to(torch.bfloat16).transpose(1, 2) if bhsd else \
            torch.randn(b, s, h, d).to(torch.bfloat16)

    return make(sq, hq), make(sk, hkv), make(sk, hkv)


KINDS = ["none", "key_mask", "segments", "window", "softcap", "alibi"]


def _mask_kwargs(kind, b, s, hq):
    if kind == "key_mask":
        km = torch.ones(b, s, dtype=torch.bool)
        km[0, :5] = False
        return dict(key_mask=km)
    if kind == "segments":
        from hf_fastpath.kernels.flash_attention import segment_table

        return dict(segments=segment_table(torch.arange(s).div(20, rounding_mode="floor").expand(b, s)))
    if kind == "alibi":
        return dict(alibi_slopes=torch.rand(hq))
    return {"none": {}, "window": dict(window_size=(16, 0)), "softcap": dict(softcap=30.0)}[kind]


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("bhsd", [False, True], ids=["bshd", "bhsd"])
@pytest.mark.parametrize("kind", KINDS)
def test_forward_launch(launches, d, bhsd, kind):
    q, k, v = _inputs(d, bhsd)
    out, lse = ga.gluon_attention_forward(q, k, v, causal=True, **_mask_kwargs(kind, 2, 70, 4))
    assert out.shape == q.shape and lse.shape == (2, 4, 70)
    tile = ga.tile_dim(d)
    args = _bound(launches[-1])
    padded = tile != d
    cfg = ga.config(tile, True, padded=padded, key_mask=kind == "key_mask", packed=kind == "segments", seq_k=70)
    _check_descriptor(args["q_desc"], q, ga.ROWS_PER_WARPGROUP, tile, padded)
    for name, t in (("k_desc", k), ("v_desc", v)):
        _check_descriptor(args[name], t, cfg.block_n, tile, padded)
    assert args["HEAD_DIM"] == tile and args["DIM"] == (d if padded else 0)
    assert args["out_ptr"] is out and args["lse_ptr"] is lse
    # O leaves by TMA where the default says so, never with padded columns (a box would write the next head's)
    assert args["TMA_STORE"] == cfg.tma_store == (d in (64, 128) and kind != "key_mask")
    assert (args["out_desc"] is not None) == cfg.tma_store
    if args["TMA_STORE"]:
        box = list(args["out_desc"].block_shape)
        assert box == [1, ga.ROWS_PER_WARPGROUP, tile] and args["out_desc"].base.data_ptr() == out.data_ptr()
    assert args["Q_REGS"] == cfg.q_regs


@pytest.mark.parametrize("causal, sk, kind, consumers", [
    (False, 70, "none", 3), (True, 70, "none", 2), (True, ga.WG3_MIN_CAUSAL_KEYS, "none", 3),
    (True, ga.WG3_MIN_CAUSAL_KEYS, "alibi", 3), (True, ga.WG3_MIN_CAUSAL_KEYS, "segments", 2),
    (False, 300, "key_mask", 2)])
def test_forward_consumers(launches, causal, sk, kind, consumers):
    """hd64: three consumer warpgroups (192-row tiles) without a causal mask or from WG3_MIN_CAUSAL_KEYS keys, not
    with a key mask or packed segments; the grid, the register split and the constexprs follow."""
    q, k, v = _inputs(64, False, b=1, sq=sk, sk=sk)
    ga.gluon_attention_forward(q, k, v, causal=causal, **_mask_kwargs(kind, 1, sk, 4))
    grid, _, kwargs = launches[-1].calls[0]
    args = _bound(launches[-1])
    assert args["CONSUMERS"] == consumers and args["Q_REGS"] == (consumers == 2 and kind != "key_mask")
    assert args["MASK_MODE"] == {"key_mask": 1, "segments": 2}.get(kind, 0)
    assert grid == ((sk + 64 * consumers - 1) // (64 * consumers), 4)
    assert kwargs["maxnreg"] == (ga.MAXNREG3 if consumers == 3 else ga.MAXNREG)
    assert 4 * 128 * ga.MAXNREG3 <= 65536 and ga.MAXNREG3 * 4 - sum(ga.WORKER_REGS3) >= ga.WORKER_REGS3[0]


@pytest.mark.parametrize("d", [64, 128])
def test_forward_variant_launches(launches, d):
    q, k, v = _inputs(d, False)
    for name, cfg in ga.variants(d, False).items():
        ga.gluon_attention_forward(q, k, v, variant=cfg)
        args = _bound(launches[-1])
        _check_descriptor(args["q_desc"], q, ga.ROWS_PER_WARPGROUP, d, False)
        assert (args["out_desc"] is not None) == cfg.tma_store, name


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("bhsd", [False, True], ids=["bshd", "bhsd"])
@pytest.mark.parametrize("kind", ["none", "key_mask", "segments", "softcap", "deterministic"])
def test_backward_launch(launches, d, bhsd, kind):
    q, k, v = _inputs(d, bhsd)
    dout = torch.randn_like(q)
    out = torch.randn(q.shape).to(q.dtype)
    lse = torch.randn(2, 4, 70)
    tile = ga.tile_dim(d, gb.HEAD_DIMS)
    kw = dict(deterministic=True) if kind == "deterministic" else _mask_kwargs(kind, 2, 70, 4)
    if kind == "deterministic" and tile == 256:  # (each consumer adds its own dQ columns there)
        with pytest.raises(ValueError, match="deterministic"):
            gb.gluon_attention_backward(dout, q, k, v, out, lse, causal=True, **kw)
        return
    dq, dk, dv = gb.gluon_attention_backward(dout, q, k, v, out, lse, causal=True, **kw)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    args = _bound(launches[-1])
    cfg = gb.launch(gb.DEFAULT_VARIANTS[tile])
    padded = tile != d
    for name, t in (("q_desc", q), ("do_desc", dout)):
        _check_descriptor(args[name], t, cfg.block_m[tile], tile, padded)
    for name, t in (("k_desc", k), ("v_desc", v)):
        _check_descriptor(args[name], t, gb.block_n(tile), tile, padded)
    assert args["dk_ptr"] is dk and args["dv_ptr"] is dv
    assert args["dq_ptr"].shape == q.shape and args["dq_ptr"].dtype == torch.float32
    assert (args["dq_turns"] is not None) == (kind == "deterministic")


@pytest.mark.parametrize("variant", sorted(gb.VARIANTS))
@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_variant_launches(launches, d, variant):
    q, k, v = _inputs(d, False)
    dout, out, lse = torch.randn_like(q), torch.randn_like(q), torch.randn(2, 4, 70)
    gb.gluon_attention_backward(dout, q, k, v, out, lse, causal=True, variant=variant)
    args = _bound(launches[-1])
    cfg = gb.launch(variant)
    assert args["STAGES"] == cfg.stages[d] and args["KV_REGS"] == (d in cfg.kv_in_registers)
    _check_descriptor(args["q_desc"], q, cfg.block_m[d], d, False)


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_launches(launches, d, causal):
    # queries and keys packed differently: one [1, T] row of packed segments whose bounds carry causality and the
    # window (`varlen_spans`), the per-query table in the forward, the per-key table in the backward
    cu_q, cu_k = torch.tensor([0, 40, 40, 90], dtype=torch.int32), torch.tensor([0, 100, 130, 230], dtype=torch.int32)
    q = torch.randn(90, 4, d).to(torch.bfloat16)
    k, v = (torch.randn(230, 2, d).to(torch.bfloat16) for _ in range(2))
    kw = dict(causal=causal, window_size=(64, -1), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse = ga.gluon_attention_forward(q, k, v, **kw)
    assert out.shape == q.shape and lse.shape == (4, 90)
    per_query, per_key = ga.varlen_spans(cu_q, cu_k, 90, 230, causal, (64, -1))
    args = _bound(launches[-1])
    tile = ga.tile_dim(d)
    assert (args["MASK_MODE"], args["CAUSAL"], args["WINDOW"], args["seq_q"], args["seq_k"]) == (2, False, False,
                                                                                                 90, 230)
    assert torch.equal(args["km_ptr"], per_query) and args["km_plane"] == per_query.stride(0)
    _check_descriptor(args["q_desc"], q, ga.ROWS_PER_WARPGROUP, tile, tile != d)
    _check_descriptor(args["k_desc"], k, ga.config(tile, False, packed=True).block_n, tile, tile != d)

    dq, dk, dv = gb.gluon_attention_backward(torch.randn_like(q), q, k, v, out, lse, **kw)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    args = _bound(launches[-1])
    assert (args["MASK_MODE"], args["CAUSAL"], args["WINDOW"], args["seq_q"], args["seq_k"]) == (2, False, False,
                                                                                                 90, 230)
    assert torch.equal(args["km_ptr"], per_key) and args["km_plane"] == per_key.stride(0)
    assert args["dk_ptr"].data_ptr() == dk.data_ptr() and args["dq_turns"] is None


@pytest.mark.parametrize("m", [1, 20, 50, 130])
@pytest.mark.parametrize("group_size", [32, 128, 256])
@pytest.mark.parametrize("n", [256, 264])
def test_w4a16_launch(monkeypatch, m, group_size, n):
    # gluon_w4a16_matmul_rows launches through a LaunchCache (Triton's argument binding skipped): its argument
    # tuple must still bind to the kernel, the x box follow config(m), scales by TMA only where scales_by_tma says
    from hf_fastpath.kernels import gluon_w4a16 as gw

    calls = []
    monkeypatch.setattr(gw, "_LAUNCH", types.SimpleNamespace(launch=lambda *a: calls.append(a)))
    monkeypatch.setattr(gw, "_num_sms", lambda device: 132)
    k = 512
    x = torch.randn(m, k).to(torch.bfloat16)
    qweight = torch.zeros(k // 8, n, dtype=torch.int32)
    scales = zeros = torch.ones(k // group_size, n, dtype=torch.bfloat16)
    y = gw.gluon_w4a16_matmul_rows(x, qweight, scales, zeros, group_size)
    assert y.shape == (m, n) and len(calls) == 1
    grid, args, kwargs, _ = calls[0]
    kwargs = {key: v for key, v in kwargs.items() if key not in ("num_warps", "maxnreg")}
    bound = inspect.signature(gw._w4a16_kernel.fn).bind(*args, **kwargs).arguments
    block_m, stages = gw.config(m)
    x_desc, w_desc = bound["x_desc"], bound["w_desc"]
    assert list(x_desc.block_shape) == [block_m, gw.BLOCK_K] and x_desc.base.data_ptr() == x.data_ptr()
    assert list(w_desc.block_shape) == [gw.BLOCK_N, 16] and w_desc.base.data_ptr() == qweight.data_ptr()
    assert (bound["s_desc"] is not None) == bound["SCALES_TMA"] == gw.scales_by_tma(n, group_size)
    assert bound["STAGES"] == stages and bound["PLANE_GROUPS"] == (group_size in gw.PLANE_GROUP_SIZES)
    splits = bound["y_ptr"].shape[0] if bound["y_ptr"].dim() == 3 else 1  # fp32 partials per K split
    assert grid[0] == -(-n // gw.BLOCK_N) * -(-m // block_m) * splits
