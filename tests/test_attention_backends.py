"""Backend choice and the FA2/FA3/FA4 adapters.

None of flash-attn 2/3/4 installs here, so each test injects a stand-in module into `sys.modules` whose functions
follow that package's real signature and return convention but compute `reference.attention_forward` from the
arguments they receive: a wrong argument mapping (layout, window, softcap, ALiBi, varlen, lse) gives wrong numbers.
"""

import logging
import sys
import types

import pytest
import torch

from hf_fastpath.attention import attention, attention_forward, backends, reference
from hf_fastpath.attention.backends import BackendUnavailable, describe_backends, select_backend
from hf_fastpath.attention.params import AttentionParams, make_params
from hf_fastpath.kernels.common import WARNED
from hf_fastpath.kernels.flash_attention import segment_table

CALLS = []


def _ref(q, k, v, *, softmax_scale, causal, window_size, softcap, alibi_slopes=None, cu_seqlens_q=None,
         cu_seqlens_k=None):
    return reference.attention_forward(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                       window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)


def _fa2_module():
    m = types.ModuleType("flash_attn")

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, deterministic=False, return_attn_probs=False):
        CALLS.append(("fa2", dict(dropout_p=dropout_p, window_size=window_size, alibi=alibi_slopes is not None)))
        out, lse = _ref(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                        softcap=softcap, alibi_slopes=alibi_slopes)
        return (out, lse, None) if return_attn_probs else out

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        CALLS.append(("fa2_varlen", dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)))
        assert cu_seqlens_q.dtype == torch.int32 and isinstance(max_seqlen_q, int)
        out, lse = _ref(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                        softcap=softcap, alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                        cu_seqlens_k=cu_seqlens_k)
        return (out, lse, None) if return_attn_probs else out

    m.flash_attn_func, m.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    return m


def _fa3_module():
    m = types.ModuleType("flash_attn_interface")

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                        v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                        pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
        CALLS.append(("fa3", dict(window_size=window_size)))
        out, lse = _ref(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                        softcap=softcap)
        return (out, lse) if return_attn_probs else out

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                               seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                               k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                               softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                               return_attn_probs=False):
        CALLS.append(("fa3_varlen", {}))
        out, lse = _ref(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                        softcap=softcap, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
        return (out, lse) if return_attn_probs else out

    m.flash_attn_func, m.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    return m


def _fa4_module():
    m = types.ModuleType("flash_attn.cute")

    def _window(window_size):
        assert all(w is None or w >= 0 for w in window_size), "FA4 spells 'unbounded' as None"
        return tuple(-1 if w is None else w for w in window_size)

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None,
                        softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, mask_mod=None,
                        full_block_cnt=None, full_block_idx=None, mask_block_cnt=None, mask_block_idx=None,
                        block_size=None, return_lse=False):
        CALLS.append(("fa4", dict(window_size=window_size)))
        out, lse = _ref(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=_window(window_size),
                        softcap=softcap)
        return out, (lse if return_lse else None)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                               seqused_q=None, seqused_k=None, page_table=None, softmax_scale=None, causal=False,
                               window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1,
                               pack_gqa=None, deterministic=False, score_mod=None, mask_mod=None,
                               block_sparse_tensors=None, cu_total_m_blocks=None, cu_total_n_blocks=None,
                               aux_tensors=None, return_lse=False):
        CALLS.append(("fa4_varlen", {}))
        out, lse = _ref(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=_window(window_size),
                        softcap=softcap, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
        return out, (lse if return_lse else None)

    m.flash_attn_func, m.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    return m


FACTORIES = {"fa2": ("flash_attn", _fa2_module), "fa3": ("flash_attn_interface", _fa3_module),
             "fa4": ("flash_attn.cute", _fa4_module)}


@pytest.fixture
def install(monkeypatch):
    """install(*names, capability=(9, 0)): inject stand-ins, pretend the tensors sit on that GPU."""
    for mod in ("flash_attn", "flash_attn_interface", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, mod, None)  # None in sys.modules makes the import fail: "not installed"
    CALLS.clear()
    WARNED.clear()
    backends.clear_choices()

    def _install(*names, capability=(9, 0)):
        for n in names:
            mod, make = FACTORIES[n]
            monkeypatch.setitem(sys.modules, mod, make())
        monkeypatch.setattr(backends, "cuda_capability", lambda t=None: capability)
        backends.clear_choices()

    return _install


def _qkv(b=2, s=12, hq=4, hkv=2, d=16, dtype=torch.bfloat16, grad=True):
    mk = lambda h: torch.randn(b, s, h, d).to(dtype).requires_grad_(grad)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv)


def _check_against_reference(backend, q, k, v, **kw):
    out, lse = attention(q, k, v, backend=backend, return_lse=True, **kw)
    want, want_lse = reference.attention_forward(q.detach().double(), k.detach().double(), v.detach().double(),
                                                 **{x: y for x, y in kw.items() if x != "dropout_p"})
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    assert lse.shape == want_lse.shape
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[fin], want_lse[fin], atol=1e-2, rtol=1e-2)
    out.float().sum().backward()  # gradients flow through the backend's own autograd
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("name", ["fa2", "fa3", "fa4"])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(3, 2)), dict(causal=True, softcap=2.0),
                                dict(causal=True, window_size=(4, -1), softmax_scale=0.2)],
                         ids=["causal", "window", "softcap", "left_window_scale"])
def test_adapter_dense(install, name, kw):
    install(name)
    _check_against_reference(name, *_qkv(), **kw)
    assert CALLS and CALLS[-1][0] == name


@pytest.mark.parametrize("name", ["fa2", "fa3", "fa4"])
def test_adapter_varlen(install, name):
    install(name)
    cu = torch.tensor([0, 5, 5, 12, 13], dtype=torch.int32)
    mk = lambda h: torch.randn(13, h, 16).to(torch.bfloat16).requires_grad_()  # noqa: E731
    q, k, v = mk(4), mk(2), mk(2)
    _check_against_reference(name, q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert CALLS[-1][0] == f"{name}_varlen"


def test_fa2_gets_alibi_and_dropout(install):
    install("fa2")
    q, k, v = _qkv()
    _check_against_reference("fa2", q, k, v, causal=True, alibi_slopes=torch.rand(4))
    assert CALLS[-1][1]["alibi"]
    attention(q, k, v, causal=True, dropout_p=0.1)  # auto picks FA2: the only backend with dropout
    assert CALLS[-1] == ("fa2", dict(dropout_p=0.1, window_size=(-1, -1), alibi=False))


def test_auto_order_fa3_fa4_fa2(install):
    q, k, v = _qkv(grad=False)
    kw = dict(causal=True, softmax_scale=0.25, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              cu_seqlens_q=None, cu_seqlens_k=None)
    install("fa2", "fa3", "fa4")
    assert select_backend("auto", q, k, v, AttentionParams(**kw)).name == "fa3"
    install("fa2", "fa4", capability=(10, 0))  # FA3 is Hopper only
    assert select_backend("auto", q, k, v, AttentionParams(**kw)).name == "fa4"
    install("fa2", capability=(8, 0))
    assert select_backend("auto", q, k, v, AttentionParams(**kw)).name == "fa2"


def test_auto_falls_back_to_triton_with_one_warning(install, caplog):
    install("fa3")
    q, k, v = _qkv(grad=False)
    kw = dict(causal=True, softmax_scale=0.25, window_size=(-1, -1), softcap=0.0, alibi_slopes=torch.rand(4),
              cu_seqlens_q=None, cu_seqlens_k=None)
    with caplog.at_level(logging.WARNING, logger="hf_fastpath.attention.backends"):
        assert select_backend("auto", q, k, v, AttentionParams(**kw)).name == "triton"
        assert select_backend("auto", q, k, v, AttentionParams(**kw)).name == "triton"
    msgs = [r.getMessage() for r in caplog.records if "ALiBi" in r.getMessage()]
    assert len(msgs) == 1 and "fa3" in msgs[0] and "Triton" in msgs[0]


def test_forced_backend_errors_name_the_problem(install):
    q, k, v = _qkv(grad=False)
    install()
    with pytest.raises(BackendUnavailable, match="fa2.*pip install flash-attn"):
        attention(q, k, v, backend="fa2")
    with pytest.raises(BackendUnavailable, match="fa4.*flash-attn-4"):
        attention(q, k, v, backend="fa4")
    install("fa3")
    with pytest.raises(BackendUnavailable, match="fa3.*ALiBi"):
        attention(q, k, v, backend="fa3", alibi_slopes=torch.rand(4))
    install("fa3", capability=(8, 0))
    with pytest.raises(BackendUnavailable, match="Hopper"):
        attention(q, k, v, backend="fa3")
    with pytest.raises(ValueError, match="Unknown attention backend 'fa5'"):
        attention(q, k, v, backend="fa5")


def test_dropout_without_fa2_is_not_implemented(install):
    install()
    q, k, v = _qkv(grad=False)
    with pytest.raises(NotImplementedError, match="dropout"):
        attention(q, k, v, dropout_p=0.1, backend="triton")
    with pytest.raises(NotImplementedError, match="dropout"):
        attention(q, k, v, dropout_p=0.1)


def test_fa_not_used_for_float32_or_cpu(install):
    q, k, v = _qkv(dtype=torch.float32, grad=False)
    kw = dict(causal=False, softmax_scale=0.25, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              cu_seqlens_q=None, cu_seqlens_k=None)
    install("fa2")
    assert select_backend("auto", q, k, v, AttentionParams(**kw)).name == "triton"
    install("fa2", capability=None)  # tensors not on CUDA
    with pytest.raises(BackendUnavailable, match="CUDA"):
        select_backend("fa2", q.bfloat16(), k.bfloat16(), v.bfloat16(), AttentionParams(**kw))


def test_cpu_without_interpreter_uses_reference(install, monkeypatch):
    install(capability=None)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = _qkv(dtype=torch.float32, grad=False)
    kw = dict(causal=True, softmax_scale=0.25, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              cu_seqlens_q=None, cu_seqlens_k=None)
    assert select_backend("auto", q, k, v, AttentionParams(**kw)).name == "reference"
    with pytest.raises(BackendUnavailable, match="triton.*no CUDA device"):
        select_backend("triton", q, k, v, AttentionParams(**kw))


def test_float64_raw_halves_use_reference():
    q, k, v = (t.double() for t in _qkv(grad=False))
    out, lse = attention_forward(q, k, v, causal=True)
    assert out.dtype == torch.float64
    want, _ = reference.attention_forward(q, k, v, causal=True)
    torch.testing.assert_close(out, want)


def test_describe_backends(install):
    install("fa3", "fa2")
    rows = {r["name"]: r for r in describe_backends()}
    assert list(rows) == ["fa3", "fa4", "fa2", "triton", "gluon", "sdpa", "reference"]
    assert rows["fa3"]["available"] and rows["fa3"]["reason"] == "ok (sm_90)"
    assert not rows["fa4"]["available"] and "pip install flash-attn-4" in rows["fa4"]["reason"]
    assert rows["reference"]["available"]
    install("fa3", capability=(8, 0))
    rows = {r["name"]: r for r in describe_backends()}
    assert not rows["fa3"]["available"] and "Hopper" in rows["fa3"]["reason"]


# ----------------------------------------------------------------------------------------------------------------
# The Gluon kernels (Hopper): which calls they take, and where "auto" runs them


def _table(monkeypatch, rows):
    from hf_fastpath.attention import dispatch

    monkeypatch.setitem(dispatch._TABLES, "dispatch_sm90.json", rows)
    backends.clear_choices()


PREFILL_ROW = dict(phase="prefill", head_dim=64, gqa=True, causal=True, batch=2, kv_len=16)


def test_gluon_backend_takes_dense_hopper_calls_only(install, monkeypatch):
    install()
    monkeypatch.setattr(backends, "_gluon_importable", lambda: True)
    gluon = backends.BACKENDS["gluon"]
    q, k, v = _qkv(d=64, grad=False)
    plain = AttentionParams(causal=True, softmax_scale=0.25)
    assert gluon.missing() is None and gluon.unsupported(backends.Request.of(q, k, v, plain)) is None
    why = lambda q, k, v, p=plain: gluon.unsupported(backends.Request.of(q, k, v, p))  # noqa: E731
    assert "head dims 64, 128" in why(*_qkv(d=16, grad=False))
    assert "float16/bfloat16" in why(q.float(), k.float(), v.float())
    assert why(q, k, v, plain._replace(window_size=(4, 0))) is None  # sliding window
    assert why(q, k, v, plain._replace(key_mask=torch.ones(2, 12))) is None  # padding
    assert why(q, k, v, plain._replace(segments=segment_table(torch.zeros(2, 12, dtype=torch.int32)))) is None
    assert why(q, k, v, plain._replace(softcap=30.0)) is None
    assert why(q, k, v, plain._replace(alibi_slopes=torch.ones(4))) is None
    assert why(q, k, v, plain._replace(alibi_slopes=torch.ones(2, 4))) is None
    assert "static-cache" in why(q, k, v, plain._replace(seqused_k=torch.full((2,), 12)))
    # varlen: packed alike (one cu_seqlens tensor for both) as packed segments; packed differently with sequences of
    # GLUON_VARLEN_MIN_QUERIES queries on average (test_gluon_varlen_packed_differently_limits)
    flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    cu = torch.tensor([0, 5, 24], dtype=torch.int32)
    assert why(*flat, plain._replace(cu_seqlens_q=cu, cu_seqlens_k=cu)) is None
    # one packed row has one slope per head: per-sequence slopes need the dense layout
    assert why(*flat, plain._replace(cu_seqlens_q=cu, cu_seqlens_k=cu, alibi_slopes=torch.ones(4))) is None
    assert "per-sequence ALiBi" in why(*flat, plain._replace(cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                            alibi_slopes=torch.ones(2, 4)))
    assert "fewer than" in why(*flat, plain._replace(cu_seqlens_q=cu, cu_seqlens_k=cu.clone()))
    install(capability=(8, 0))
    assert "Hopper" in gluon.missing()
    with pytest.raises(BackendUnavailable, match="gluon.*Hopper"):
        attention(q, k, v, backend="gluon")
    monkeypatch.setattr(backends, "_gluon_importable", lambda: False)
    assert "Gluon" in gluon.missing()


def test_auto_runs_gluon_only_where_it_measured_fastest(install, monkeypatch):
    from hf_fastpath.attention import dispatch

    install()
    monkeypatch.setattr(backends, "_gluon_importable", lambda: True)
    monkeypatch.setattr(backends.SDPABackend, "missing", lambda self: None)  # as on a GPU
    q, k, v = _qkv(b=2, s=16, hq=4, hkv=2, d=64, grad=False)
    plain = AttentionParams(causal=True, softmax_scale=0.25)
    _table(monkeypatch, [dict(PREFILL_ROW, triton_ms=1.0, sdpa_ms=0.8, gluon_ms=0.7)])
    assert select_backend("auto", q, k, v, plain).name == "gluon"
    assert "gluon" in dispatch.explain((9, 0))[0] and "gluon 0.700 ms" in dispatch.explain((9, 0))[0]
    _table(monkeypatch, [dict(PREFILL_ROW, triton_ms=1.0, sdpa_ms=0.8, gluon_ms=0.9)])
    assert select_backend("auto", q, k, v, plain).name == "sdpa"
    _table(monkeypatch, [dict(PREFILL_ROW, triton_ms=1.0, sdpa_ms=1.2)])  # not measured: never picked
    assert select_backend("auto", q, k, v, plain).name == "triton"
    # a padded or packed call (hd128): SDPA does not take it; Gluon where the plain call's row says it is faster
    q, k, v = _qkv(b=2, s=16, hq=4, hkv=2, d=128, grad=False)
    for masked in (plain._replace(key_mask=torch.ones(2, 16)),
                   plain._replace(segments=segment_table(torch.zeros(2, 16, dtype=torch.int32)))):
        _table(monkeypatch, [dict(PREFILL_ROW, triton_ms=1.0, sdpa_ms=0.5, gluon_ms=0.7)])
        assert select_backend("auto", q, k, v, masked).name == "gluon"
        _table(monkeypatch, [dict(PREFILL_ROW, triton_ms=1.0, sdpa_ms=0.5, gluon_ms=1.1)])
        assert select_backend("auto", q, k, v, masked).name == "triton"
    # a sliding window or soft-cap (Mistral, Gemma-2): SDPA does not take it; Gluon where the row says it is faster
    for capped in (plain._replace(window_size=(7, 0)), plain._replace(softcap=30.0)):
        _table(monkeypatch, [dict(PREFILL_ROW, triton_ms=1.0, sdpa_ms=0.5, gluon_ms=0.7)])
        assert select_backend("auto", q, k, v, capped).name == "gluon"
        _table(monkeypatch, [dict(PREFILL_ROW, triton_ms=1.0, sdpa_ms=0.5, gluon_ms=1.1)])
        assert select_backend("auto", q, k, v, capped).name == "triton"
    # rows measured with a window / soft-cap decide such calls where the table has them (then masked, then plain)
    _table(monkeypatch, [dict(PREFILL_ROW, triton_ms=1.0, sdpa_ms=0.5, gluon_ms=0.7),
                         dict(PREFILL_ROW, masked=True, triton_ms=1.0, gluon_ms=1.2)])
    assert select_backend("auto", q, k, v, plain._replace(softcap=30.0)).name == "triton"  # the masked row
    _table(monkeypatch, [dict(PREFILL_ROW, triton_ms=1.0, sdpa_ms=0.5, gluon_ms=0.7),
                         dict(PREFILL_ROW, masked=True, triton_ms=1.0, gluon_ms=1.2),
                         dict(PREFILL_ROW, windowed=True, triton_ms=1.0, gluon_ms=0.8)])
    assert select_backend("auto", q, k, v, plain._replace(softcap=30.0)).name == "gluon"
    assert select_backend("auto", q, k, v, plain._replace(key_mask=torch.ones(2, 16))).name == "triton"
    # ALiBi (BLOOM, Falcon-RW): its own rows where measured, else the masked ones, then the plain ones
    alibi = plain._replace(alibi_slopes=torch.ones(4))
    assert select_backend("auto", q, k, v, alibi).name == "triton"  # the masked row
    _table(monkeypatch, [dict(PREFILL_ROW, masked=True, triton_ms=1.0, gluon_ms=1.2),
                         dict(PREFILL_ROW, windowed=True, triton_ms=1.0, gluon_ms=1.3),
                         dict(PREFILL_ROW, alibi=True, triton_ms=1.0, gluon_ms=0.8)])
    assert select_backend("auto", q, k, v, alibi).name == "gluon"
    assert select_backend("auto", q, k, v, plain._replace(softcap=30.0)).name == "triton"
    assert "alibi hd64" in dispatch.explain((9, 0))[2]
    # rows measured with masks decide masked calls where the table has them (the plain rows, plain calls)
    q64, k64, v64 = _qkv(b=2, s=16, hq=4, hkv=2, d=64, grad=False)
    _table(monkeypatch, [dict(PREFILL_ROW, triton_ms=1.0, sdpa_ms=0.8, gluon_ms=0.7),
                         dict(PREFILL_ROW, masked=True, triton_ms=1.0, gluon_ms=1.2)])
    assert select_backend("auto", q64, k64, v64, plain).name == "gluon"
    assert select_backend("auto", q64, k64, v64, plain._replace(key_mask=torch.ones(2, 16))).name == "triton"
    # and `attention` hands Gluon the masks as they are (not unpadded into varlen rows, as for FlashAttention)
    seen = []

    def run(self, q, k, v, p, dropout_p, return_lse):
        seen.append((q.shape, p.varlen, p.key_mask is not None, p.segments is not None))
        return reference.attention_forward(q, k, v, **p.kernel_kwargs())[0], None

    monkeypatch.setattr(backends.GluonBackend, "run", run)
    _table(monkeypatch, [dict(PREFILL_ROW, triton_ms=1.0, sdpa_ms=0.5, gluon_ms=0.7)])
    attention(q, k, v, causal=True, key_mask=torch.ones(2, 16))
    attention(q, k, v, causal=True, segments=segment_table(torch.zeros(2, 16, dtype=torch.int32)))
    assert seen == [(q.shape, False, True, False), (q.shape, False, False, True)]


def _triton_as_gluon_forward(q, k, v, key_mask, segments, cu_q, cu_k, slopes, causal, scale, left, right, cap):
    """`ops._gluon_forward`'s stand-in off-GPU: the interpreted Triton forward on the same arguments."""
    from hf_fastpath.kernels.flash_attention import flash_attention_forward

    return flash_attention_forward(q, k, v, causal=causal, softmax_scale=scale, key_mask=key_mask, segments=segments,
                                   cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, window_size=(left, right), softcap=cap,
                                   alibi_slopes=slopes)


@pytest.mark.parametrize("path", ["eager", "op"])
@pytest.mark.parametrize("mask", ["none", "key_mask", "segments", "window_softcap", "alibi_key_mask"])
def test_gluon_op_shapes_and_gradients(monkeypatch, mask, path):
    # the custom ops' fake shapes, and gradients with the masks, window, soft-cap and ALiBi passed through to the
    # backward: eagerly through `ops._EagerAttention`, and through the ops' registered autograd (what compiled graphs
    # run). The Gluon kernels need a Hopper GPU (tests/gpu); here the interpreted Triton forward stands in for the
    # Gluon forward, and the backward falls back to the Triton backward by itself (`gluon_attention_bwd.supported`:
    # no GPU).
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hf_fastpath.attention import ops

    with FakeTensorMode():
        q, k = torch.empty(2, 5, 4, 64, dtype=torch.bfloat16), torch.empty(2, 7, 2, 64, dtype=torch.bfloat16)
        out, lse = torch.ops.hf_fastpath.gluon_attn_forward(q, k, k, None, None, None, None, None, True, 0.125, 3,
                                                            -1, 0.0)
        dq, dk, dv = torch.ops.hf_fastpath.gluon_attn_backward(q, q, k, k, q, lse, None, None, None, None, None, True,
                                                               0.125, 3, -1, 0.0)
        cu = torch.empty(3, dtype=torch.int32)
        q3, k3 = q.flatten(0, 1), k.flatten(0, 1)
        out3, lse3 = torch.ops.hf_fastpath.gluon_attn_forward(q3, k3, k3, None, None, cu, cu, None, True, 0.125, 3,
                                                              -1, 0.0)
    assert out.shape == q.shape and lse.shape == (2, 4, 5) and lse.dtype == torch.float32
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
    assert out3.shape == q3.shape and lse3.shape == (4, 10)  # varlen: lse [H, T]

    monkeypatch.setattr(ops, "_gluon_forward", _triton_as_gluon_forward)
    q, k, v = (t.float().detach().requires_grad_() for t in _qkv(b=2, s=9, hq=4, hkv=2, d=32))
    masks = {"none": {}, "key_mask": dict(key_mask=torch.tensor([[1] * 9, [0] * 3 + [1] * 6])),
             "segments": dict(segments=segment_table(torch.tensor([[0] * 4 + [1] * 5, [0] + [1] * 7 + [2]]))),
             "window_softcap": dict(window_size=(3, -1), softcap=1.5),
             "alibi_key_mask": dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]),
                                    key_mask=torch.tensor([[1] * 9, [0] * 3 + [1] * 6]))}[mask]
    params = AttentionParams(causal=True, softmax_scale=0.3, **masks)
    if path == "eager":
        out, _ = ops.gluon_attn(q, k, v, params)
        assert type(out.grad_fn).__name__ == "_EagerAttentionBackward"
    else:
        left, right = params.window_size
        out, _ = ops.gluon_attn_forward(q, k, v, params.key_mask, params.segments, None, None, params.alibi_slopes,
                                        True, 0.3, left, right, float(params.softcap))
        assert "_EagerAttention" not in type(out.grad_fn).__name__
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want_out, _ = reference.attention_forward(q64, k64, v64, causal=True, softmax_scale=0.3, **masks)
    want = torch.autograd.grad(want_out, (q64, k64, v64), g.double())
    torch.testing.assert_close(out.double(), want_out, atol=2e-3, rtol=2e-3)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=2e-3, rtol=2e-3)


def test_cu_seqlens_segment_ids():
    from hf_fastpath.kernels.flash_attention import cu_seqlens_segment_ids

    ids = lambda cu, total: cu_seqlens_segment_ids(torch.tensor(cu, dtype=torch.int32), total).tolist()  # noqa: E731
    assert ids([0, 3, 4, 4, 7], 7) == [0, 0, 0, 1, 2, 2, 2]  # an empty sequence takes no id
    assert ids([2, 4], 6) == [0, 0, 1, 1, 2, 2]  # tokens outside the offsets are sequences of their own
    assert ids([0, 6], 6) == [0] * 6 and ids([0], 0) == []


@pytest.mark.parametrize("features", [dict(causal=True), dict(causal=False), dict(causal=True, window_size=(2, 0)),
                                      dict(causal=True, softcap=1.5)])
def test_gluon_runs_one_packing_varlen_as_packed_segments(monkeypatch, features):
    # varlen inputs whose queries and keys share cu_seqlens run as one row of packed segments, forward and backward,
    # with empty and one-token sequences; the LSE comes back in the varlen layout [H, T]. The interpreted Triton
    # kernels stand in for the Gluon ones (which need a Hopper GPU: tests/gpu)
    from hf_fastpath.attention import ops

    monkeypatch.setattr(ops, "_gluon_forward", _triton_as_gluon_forward)
    cu = torch.tensor([0, 5, 5, 6, 13, 20], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(20, h, 32, generator=g).requires_grad_() for h in (4, 2, 2))
    params = make_params(q, k, v, softmax_scale=0.3, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7,
                         max_seqlen_k=7, **features)
    out, lse = backends.GluonBackend().run(q, k, v, params, 0.0, True)
    dout = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want_out, want_lse = reference.attention_forward(q64, k64, v64, **params.kernel_kwargs())
    want = torch.autograd.grad(want_out, (q64, k64, v64), dout.double())
    assert lse.shape == want_lse.shape == (4, 20)
    torch.testing.assert_close(out.double(), want_out, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=2e-3)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=2e-3, rtol=2e-3)
    # the packed table is made once per cu_seqlens tensor (every layer passes the same one)
    assert backends._as_segments(params, 20).segments is backends._as_segments(params, 20).segments


@pytest.mark.parametrize("features", [dict(causal=True), dict(causal=False), dict(causal=True, window_size=(3, 0)),
                                      dict(causal=False, window_size=(2, 1), softcap=1.5)])
def test_gluon_runs_varlen_packed_differently(monkeypatch, features):
    # queries and keys packed by different offsets (chunked prefill: each sequence's new queries after its cached
    # keys; an empty sequence, one with more queries than keys, one with no key) reach the Gluon kernels with their
    # cu_seqlens, forward and backward; the LSE comes back as [H, T]. The interpreted Triton kernels stand in for the
    # Gluon ones (tests/gpu runs those; tests/test_gluon_varlen.py checks the masks they are given)
    from hf_fastpath.attention import ops

    monkeypatch.setattr(ops, "_gluon_forward", _triton_as_gluon_forward)
    cu_q = torch.tensor([0, 3, 3, 8, 10, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 11, 14, 14, 20], dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(12, 4, 32, generator=g).requires_grad_()
    k, v = (torch.randn(20, 2, 32, generator=g).requires_grad_() for _ in range(2))
    params = make_params(q, k, v, softmax_scale=0.3, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5,
                         max_seqlen_k=9, **features)
    req = backends.Request.of(q, k, v, params)
    assert not req.one_packing and req.q_tokens == 12
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want_out, want_lse = reference.attention_forward(q64, k64, v64, **params.kernel_kwargs())
    dout = torch.randn(want_out.shape, generator=g)
    want = torch.autograd.grad(want_out, (q64, k64, v64), dout.double())
    left, right = params.window_size
    op_args = (None, None, cu_q, cu_k, None, params.causal, 0.3, left, right, params.softcap)
    for path in ("eager", "op"):  # through `_EagerAttention`, and the custom op's autograd (compiled graphs)
        if path == "eager":
            out, lse = backends.GluonBackend().run(q, k, v, params, 0.0, True)
        else:
            out, lse = ops.gluon_attn_forward(q, k, v, *op_args)
        got = torch.autograd.grad(out, (q, k, v), dout)
        assert lse.shape == want_lse.shape == (4, 12)
        torch.testing.assert_close(out.double(), want_out, atol=2e-3, rtol=2e-3)
        seen = want_lse.isfinite()
        torch.testing.assert_close(lse.double()[seen], want_lse[seen], atol=2e-3, rtol=2e-3)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b, atol=2e-3, rtol=2e-3)


def test_auto_takes_gluon_for_differently_packed_varlen_only_where_measured(install, monkeypatch):
    # varlen calls whose queries and keys are packed differently read only the table's `varlen` rows (the masked
    # rows time packed segments, another kernel plan): without such rows our Triton kernel; with them, the faster
    install()
    monkeypatch.setattr(backends, "_gluon_importable", lambda: True)
    q = torch.empty(4 * 200, 4, 128, dtype=torch.bfloat16)
    k = torch.empty(4 * 300, 2, 128, dtype=torch.bfloat16)
    cu_q, cu_k = torch.arange(5, dtype=torch.int32) * 200, torch.arange(5, dtype=torch.int32) * 300
    p = make_params(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=200, max_seqlen_k=300, causal=True)
    row = dict(PREFILL_ROW, head_dim=128, batch=4, kv_len=256)
    _table(monkeypatch, [dict(row, triton_ms=1.0, gluon_ms=0.5, masked=True)])
    assert select_backend("auto", q, k, k, p).name == "triton"
    _table(monkeypatch, [dict(row, triton_ms=1.0, gluon_ms=0.5, masked=True), dict(row, triton_ms=1.0, gluon_ms=1.2,
                                                                                   varlen=True)])
    assert select_backend("auto", q, k, k, p).name == "triton"
    _table(monkeypatch, [dict(row, triton_ms=1.0, gluon_ms=0.8, varlen=True)])
    assert select_backend("auto", q, k, k, p).name == "gluon"
    from hf_fastpath.attention import dispatch

    assert "varlen" in dispatch.explain((9, 0))[0]


def test_gluon_varlen_packed_differently_limits():
    # differently packed varlen calls: not with ALiBi (distances shift per sequence), not with short query chunks on
    # average (a 128-row query tile would load the keys of every sequence it spans); packed alike: both fine
    q, k = torch.empty(4 * 200, 4, 64, dtype=torch.bfloat16), torch.empty(4 * 300, 2, 64, dtype=torch.bfloat16)
    cu_q, cu_k = torch.arange(5, dtype=torch.int32) * 200, torch.arange(5, dtype=torch.int32) * 300

    def why(q, cu_q, **kw):
        p = make_params(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, **kw)
        req = backends.Request.of(q, k, k, p)._replace(capability=(9, 0))
        return backends.GluonBackend().unsupported(req)

    assert why(q, cu_q) is None
    assert "ALiBi" in why(q, cu_q, alibi_slopes=torch.rand(4))
    n = backends.GLUON_VARLEN_MIN_QUERIES // 2
    assert str(backends.GLUON_VARLEN_MIN_QUERIES) in why(q[:4 * n], torch.arange(5, dtype=torch.int32) * n)


@pytest.fixture
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) for the test (Transformers' enable_full_determinism sets it)."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def _recorded_gluon_backward(monkeypatch):
    """The interpreted Triton forward in place of the Gluon one, and a recorder (of its `deterministic` argument,
    returning zero gradients) in place of the Gluon backward: both need a Hopper GPU (tests/gpu)."""
    from hf_fastpath.attention import ops
    from hf_fastpath.kernels import gluon_attention_bwd as gb

    monkeypatch.setattr(ops, "_gluon_forward", _triton_as_gluon_forward)
    ran = []
    monkeypatch.setattr(gb, "supported", lambda *a: True)
    monkeypatch.setattr(gb, "gluon_attention_backward", lambda dout, q, k, v, *a, deterministic, **kw: ran.append(
        deterministic) or (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)))
    return ran


def test_gluon_backward_hands_over_to_triton_when_torch_asks_for_determinism(monkeypatch, request):
    # under torch.use_deterministic_algorithms(True) the Gluon backward's ordered dQ adds lose to the (atomic-free)
    # Triton backward at hd64 tiles without a soft-cap: Triton runs, on the Gluon forward's out and lse
    from hf_fastpath.attention import ops

    ran = _recorded_gluon_backward(monkeypatch)
    q, k, v = (t.float().detach().requires_grad_() for t in _qkv(b=1, s=9, hq=4, hkv=2, d=32))
    params = AttentionParams(causal=True, softmax_scale=0.3)

    def grads():
        out, _ = ops.gluon_attn(q, k, v, params)
        return torch.autograd.grad(out.sum(), (q, k, v))

    assert all((g == 0).all() for g in grads()) and ran == [False]  # the (recorded) Gluon backward
    request.getfixturevalue("deterministic_algorithms")
    got = grads()
    assert ran == [False]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(reference.attention_forward(q64, k64, v64, causal=True, softmax_scale=0.3)[0].sum(),
                               (q64, k64, v64))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("d, softcap", [(64, 20.0), (72, 0.0)])
def test_gluon_backward_runs_deterministic_when_torch_asks(monkeypatch, request, d, softcap):
    # with a soft-cap, or past hd64 (hd128 tiles), the Gluon backward in its deterministic mode beats the Triton one:
    # it runs, asked for it
    from hf_fastpath.attention import ops

    ran = _recorded_gluon_backward(monkeypatch)
    q, k, v = (t.float().detach().requires_grad_() for t in _qkv(b=1, s=9, hq=4, hkv=2, d=d))
    params = AttentionParams(causal=True, softmax_scale=0.3, softcap=softcap)
    for _ in range(2):
        out, _ = ops.gluon_attn(q, k, v, params)
        assert all((g == 0).all() for g in torch.autograd.grad(out.sum(), (q, k, v)))
        request.getfixturevalue("deterministic_algorithms")
    assert ran == [False, True]


@pytest.mark.parametrize("name", ["fa2", "fa3", "fa4"])
def test_flash_attention_is_asked_for_determinism_when_torch_is(install, monkeypatch, request, name):
    install(name)
    module = sys.modules[FACTORIES[name][0]]
    seen, real = [], module.flash_attn_func
    monkeypatch.setattr(module, "flash_attn_func", lambda *a, deterministic=False, **kw: seen.append(deterministic)
                        or real(*a, **kw))
    q, k, v = _qkv(d=64, grad=False)
    attention(q, k, v, causal=True, backend=name)
    request.getfixturevalue("deterministic_algorithms")
    attention(q, k, v, causal=True, backend=name)
    assert seen == [False, True]


def test_gluon_that_does_not_build_falls_back_to_triton(install, monkeypatch, caplog):
    # a Triton whose Gluon API differs from the versions we build against: the call still returns the right
    # answer (our Triton kernel), one warning says why, and "auto" stops choosing Gluon
    from triton.compiler.errors import CompilationError

    from hf_fastpath.attention import ops
    from hf_fastpath.kernels import gluon_attention as ga

    def does_not_build(*args, **kwargs):
        raise CompilationError(None, None, "'tma' has no attribute 'async_copy_global_to_shared'")

    monkeypatch.setattr(ga, "gluon_attention_forward", does_not_build)
    monkeypatch.setattr(ops, "GLUON_BUILD_ERRORS", [])
    install()
    monkeypatch.setattr(backends, "_gluon_importable", lambda: True)
    q, k, v = (t.float() for t in _qkv(b=1, s=9, hq=4, hkv=2, d=64, grad=False))
    with caplog.at_level(logging.WARNING, logger="hf_fastpath.attention.ops"):
        out, lse = ops.gluon_attn(q, k, v, AttentionParams(causal=True, softmax_scale=0.3))
        ops.gluon_attn(q, k, v, AttentionParams(causal=True, softmax_scale=0.3))
    want, want_lse = reference.attention_forward(q.double(), k.double(), v.double(), causal=True, softmax_scale=0.3)
    torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)
    warnings = [r.getMessage() for r in caplog.records if "Gluon" in r.getMessage()]
    assert len(warnings) == 1 and "async_copy_global_to_shared" in warnings[0]
    assert "does not build" in backends.BACKENDS["gluon"].missing()
