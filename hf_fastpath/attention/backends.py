"""Which attention implementation runs: FA3 > FA4 > FA2 when installed; else, on CUDA, our Triton kernel or torch
SDPA's cuDNN / FLASH kernels, whichever measured fastest for this kind of call (`dispatch.py`); the reference on
the CPU.

A backend is one class: `name`; `missing()`, why it cannot run on this machine at all; `unsupported(request)`, why
it cannot serve one call (`Request`: the features and shape of the call); `run(q, k, v, params, dropout_p,
return_lse)`, the call itself, differentiable, `(out, lse or None)`, with the options in `params.AttentionParams`
(`reference.py` semantics, `[B, S, H, D]` or varlen `[T, H, D]`). Under "auto" an unsupported request falls back to
the Triton kernel (with a one-time warning for an installed FlashAttention); a forced backend raises instead.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import NamedTuple

import torch

from . import dispatch
from .params import AttentionParams
from ..kernels.common import derived_once, interpret_requested, warn_once

logger = logging.getLogger(__name__)

__all__ = ["BACKEND_NAMES", "BackendUnavailable", "Request", "clear_choices", "describe_backends", "select_backend"]

BACKEND_NAMES = ("auto", "fa3", "fa4", "fa2", "triton", "gluon", "sdpa", "reference")


class BackendUnavailable(RuntimeError):
    """A forced backend is missing or cannot serve the request; the message says why and what to install."""


def _warn_once(msg: str) -> None:
    warn_once(__name__, msg, msg)


_CAPABILITIES: dict[int, tuple] = {}  # a dict, not lru_cache: torch.compile reads it as a constant


def cuda_capability(t: torch.Tensor | None = None):
    """(major, minor) of the tensor's CUDA device, or None off CUDA. Tests replace this to exercise FA adapters."""
    if t is not None and not t.is_cuda:
        return None
    if not torch.cuda.is_available():
        return None
    index = t.device.index if t is not None and t.device.index is not None else torch.cuda.current_device()
    cap = _CAPABILITIES.get(index)
    if cap is None:
        cap = _CAPABILITIES[index] = tuple(torch.cuda.get_device_capability(index))
    return cap


class Request(NamedTuple):
    """What one attention call needs from a backend: the features it uses and its shape (for `dispatch`). A named
    tuple: built on every call, a frozen dataclass cost several µs of host time."""

    dtype: torch.dtype
    head_dim: int
    head_dim_v: int
    varlen: bool
    window: bool
    softcap: bool
    alibi: int  # 0: none; slopes per head (1) or per batch row and head (2)
    dropout: bool
    capability: tuple | None  # None: not on CUDA
    causal: bool = False
    key_mask: bool = False  # a padding mask over the keys, or packed segments
    seqused: bool = False  # a static cache: keys in the first seqused_k[b] slots
    train: bool = False  # a backward will follow
    lse: bool = False  # the caller wants the LSE
    batch: int = 1
    q_len: int = 1  # per sequence (max_seqlen for varlen)
    kv_len: int = 1
    heads: int = 1
    kv_heads: int = 1
    one_packing: bool = False  # varlen with one cu_seqlens tensor for queries and keys (packed self-attention)
    q_tokens: int = 1  # all the call's queries (varlen: T)

    @classmethod
    def of(cls, q, k, v, params: AttentionParams, dropout_p=0.0, return_lse=False):
        if params.varlen:
            batch = params.cu_seqlens_q.shape[0] - 1
            q_len, kv_len = params.max_seqlen_q or q.shape[0], params.max_seqlen_k or k.shape[0]
        else:
            batch, q_len, kv_len = q.shape[0], q.shape[1], k.shape[1]
        return cls(q.dtype, q.shape[-1], v.shape[-1], params.varlen, params.has_window, bool(params.softcap),
                   _alibi_dims(params), dropout_p > 0, cuda_capability(q), params.causal,
                   params.key_mask is not None or params.segments is not None, params.seqused_k is not None,
                   torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad), return_lse,
                   batch, q_len, kv_len, q.shape[-2], k.shape[-2],
                   params.varlen and params.cu_seqlens_q is params.cu_seqlens_k and q.shape[0] == k.shape[0],
                   q.shape[0] if params.varlen else batch * q_len)


def _alibi_dims(params: AttentionParams) -> int:
    return 0 if params.alibi_slopes is None else params.alibi_slopes.dim()


_MISSING: set[str] = set()


def _import(module: str):
    """The module or None; failed imports are remembered (a failing import costs ~0.1 ms on every call)."""
    if module in sys.modules:
        return sys.modules[module]  # None when marked missing
    if module in _MISSING:
        return None
    try:
        return importlib.import_module(module)
    except Exception:  # ImportError, or a broken install raising at import time
        _MISSING.add(module)
        return None


@torch.compiler.assume_constant_result
def _deterministic() -> bool:
    # torch.use_deterministic_algorithms(True) (Transformers' enable_full_determinism sets it): FlashAttention's
    # backward then runs its deterministic variant; so does our Gluon backward where it still wins (hd128 tiles and
    # soft-capped calls up to hd128), else it hands over to the Triton one (`ops._gluon_backward`)
    return torch.are_deterministic_algorithms_enabled()


@torch.compiler.assume_constant_result
def _importable(module: str) -> bool:
    # Dynamo cannot trace an import (a graph break); a constant-result function runs in Python at trace time
    return _import(module) is not None


def _as_tuple(result):
    return result if isinstance(result, tuple) else (result,)


# ----------------------------------------------------------------------------------------------------------------
# FlashAttention adapters
# ----------------------------------------------------------------------------------------------------------------


class _FlashBackend:
    name = ""
    takes_masks = False  # varlen only: `attention` unpads key masks, static caches and packed segments for it
    module = ""
    install = ""

    def load(self):
        return _import(self.module)

    def missing(self) -> str | None:
        """Why this backend cannot run on this machine at all (None if it can)."""
        if not _importable(self.module):
            return f"not installed ({self.install})"
        return None

    def unsupported(self, req: Request) -> str | None:
        """Why this request cannot run here (None if it can)."""
        return dispatch.cuda_half_unsupported(req)


class FA2Backend(_FlashBackend):
    name = "fa2"
    module = "flash_attn"
    install = "pip install flash-attn --no-build-isolation"

    def unsupported(self, req):
        why = super().unsupported(req)
        if why:
            return why
        if req.capability < (8, 0):
            return f"needs sm_80 or newer, this GPU is sm_{req.capability[0]}{req.capability[1]}"
        if req.head_dim > 256:
            return f"supports head dims up to 256, got {req.head_dim}"
        return None

    def run(self, q, k, v, p: AttentionParams, dropout_p, return_lse):
        fa = self.load()
        common = dict(dropout_p=dropout_p, softmax_scale=p.softmax_scale, causal=p.causal,
                      window_size=tuple(p.window_size), softcap=p.softcap,
                      alibi_slopes=None if p.alibi_slopes is None else p.alibi_slopes.float(),
                      deterministic=_deterministic(), return_attn_probs=return_lse)
        if p.varlen:
            res = fa.flash_attn_varlen_func(q, k, v, p.cu_seqlens_q.to(torch.int32), p.cu_seqlens_k.to(torch.int32),
                                            _max_len(p, "q"), _max_len(p, "k"), **common)
        else:
            res = fa.flash_attn_func(q, k, v, **common)
        res = _as_tuple(res)
        return res[0], (res[1] if return_lse else None)  # (out, softmax_lse, S_dmask) with return_attn_probs


class FA3Backend(_FlashBackend):
    name = "fa3"
    module = "flash_attn_interface"
    install = "build flash-attention's hopper/ package: cd flash-attention/hopper && python setup.py install"

    def unsupported(self, req):
        why = super().unsupported(req)
        if why:
            return why
        if req.capability[0] != 9:
            return f"needs a Hopper GPU (sm_90), this GPU is sm_{req.capability[0]}{req.capability[1]}"
        if req.head_dim > 256 or req.head_dim % 8:
            return f"supports head dims that are multiples of 8 up to 256, got {req.head_dim}"
        if req.alibi:
            return "has no ALiBi"
        if req.dropout:
            return "has no dropout"
        return None

    def run(self, q, k, v, p: AttentionParams, dropout_p, return_lse):
        fa = self.load()
        common = dict(softmax_scale=p.softmax_scale, causal=p.causal, window_size=tuple(p.window_size),
                      softcap=p.softcap)
        if _deterministic():  # only when asked: older FA3 builds have no such argument
            common["deterministic"] = True
        if p.varlen:
            res = fa.flash_attn_varlen_func(q, k, v, p.cu_seqlens_q.to(torch.int32), p.cu_seqlens_k.to(torch.int32),
                                            _max_len(p, "q"), _max_len(p, "k"), return_attn_probs=return_lse,
                                            **common)
        else:
            res = fa.flash_attn_func(q, k, v, return_attn_probs=return_lse, **common)
        res = _as_tuple(res)  # older FA3 builds always return (out, lse)
        return res[0], (res[1] if return_lse else None)


class FA4Backend(_FlashBackend):
    name = "fa4"
    module = "flash_attn.cute"
    install = "pip install flash-attn-4"

    def unsupported(self, req):
        why = super().unsupported(req)
        if why:
            return why
        if req.capability[0] not in (9, 10, 11):
            return f"needs sm_90/sm_100, this GPU is sm_{req.capability[0]}{req.capability[1]}"
        if req.head_dim > 128 or req.head_dim % 8:
            return f"supports head dims that are multiples of 8 up to 128, got {req.head_dim}"
        if req.alibi:
            return "has no ALiBi"
        if req.dropout:
            return "has no dropout"
        if req.softcap and req.varlen:
            return "has no softcap backward for varlen inputs"
        return None

    def run(self, q, k, v, p: AttentionParams, dropout_p, return_lse):
        fa = self.load()
        left, right = p.window_size
        common = dict(softmax_scale=p.softmax_scale, causal=p.causal,
                      window_size=(None if left < 0 else left, None if right < 0 else right),
                      softcap=p.softcap, return_lse=return_lse)
        if _deterministic():
            common["deterministic"] = True
        if p.varlen:
            res = fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=p.cu_seqlens_q.to(torch.int32),
                                            cu_seqlens_k=p.cu_seqlens_k.to(torch.int32),
                                            max_seqlen_q=_max_len(p, "q"), max_seqlen_k=_max_len(p, "k"), **common)
        else:
            res = fa.flash_attn_func(q, k, v, **common)
        res = _as_tuple(res)
        return res[0], (res[1] if return_lse and len(res) > 1 else None)


def _max_len(p: AttentionParams, which):
    given = getattr(p, f"max_seqlen_{which}")
    if given is not None:
        return int(given)
    cu = getattr(p, f"cu_seqlens_{which}")
    return int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0


# ----------------------------------------------------------------------------------------------------------------
# own kernels
# ----------------------------------------------------------------------------------------------------------------


class TritonBackend:
    name = "triton"
    takes_masks = True  # key_mask / seqused_k / segments as they are

    def missing(self) -> str | None:
        if not _importable("triton"):
            return "not installed (pip install triton)"
        if interpret_requested():
            return None
        cap = cuda_capability()
        if cap is None:
            return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on the CPU, slowly)"
        if cap < (8, 0):
            return f"needs sm_80 or newer, this GPU is sm_{cap[0]}{cap[1]}"
        return None

    def unsupported(self, req: Request) -> str | None:
        from .triton_backend import MAX_HEAD_DIM, SUPPORTED_DTYPES

        if req.capability is None and not interpret_requested():
            return "needs a CUDA device (or TRITON_INTERPRET=1)"
        if req.dtype not in SUPPORTED_DTYPES:
            return f"supports float16/bfloat16/float32, got {req.dtype}"
        if max(req.head_dim, req.head_dim_v) > MAX_HEAD_DIM:
            return f"supports head dims up to {MAX_HEAD_DIM}"
        if req.dropout:
            return "has no dropout"
        return None

    def run(self, q, k, v, p: AttentionParams, dropout_p, return_lse):
        from .ops import flash_attn

        return flash_attn(q, k, v, p)


class SDPABackend:
    """torch's `scaled_dot_product_attention`, called as Transformers' "sdpa" calls it (torch picks cuDNN, FLASH or
    memory-efficient; GQA by `enable_gqa`). Only plain calls (`dispatch.sdpa_unsupported`); "auto" runs it where
    the measured table says it beats our kernel."""

    name = "sdpa"
    takes_masks = False  # plain calls only (`unsupported` says so)

    def missing(self):
        return None if torch.cuda.is_available() else "no CUDA device"

    def unsupported(self, req):
        from .dispatch import sdpa_unsupported

        return sdpa_unsupported(req)

    @staticmethod
    def attend(query, key, value, causal: bool, scale: float):
        """SDPA on `[B, H, S, D]` tensors (the layout Transformers hands attention functions) -> `[B, Hq, Sq, D]`."""
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=causal and query.shape[2] > 1, scale=scale,
            enable_gqa=query.shape[1] != key.shape[1])

    def run(self, q, k, v, p: AttentionParams, dropout_p, return_lse):
        out = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), p.causal, p.softmax_scale)
        return out.transpose(1, 2), None


@torch.compiler.assume_constant_result
def _gluon_importable() -> bool:
    try:  # a Triton whose Gluon module lacks a name the kernel module binds at import must not break dispatch
        from ..kernels.gluon_attention import HAS_GLUON
    except Exception:  # noqa: BLE001
        return False
    return HAS_GLUON


# varlen calls with queries and keys packed differently and fewer queries a sequence than this (decode-like chunks)
# stay on Triton, whose programs take one sequence each: a Gluon query tile (128 rows) spans several sequences. 64 is
# the shortest chunk measured (`gluon_attention_varlen.json`, 2k keys: Gluon 1.10-1.29x Triton fwd, 1.30-2.14x
# fwd+bwd); below it is unmeasured
GLUON_VARLEN_MIN_QUERIES = 64


class GluonBackend:
    """Our Gluon FlashAttention for Hopper (`kernels/gluon_attention.py` and `gluon_attention_bwd.py`: warp-specialized,
    TMA, wgmma): dense calls at head dim 64, 128 or 256, or a multiple of 8 between them run at the next of those
    (`tile_dim`), causal or not, with or without a padding mask or packed segments, a sliding window, a soft-cap or
    ALiBi, and varlen calls: queries and keys sharing one cu_seqlens tensor as packed segments, packed differently
    (chunked prefill) through `varlen_spans`, without ALiBi and with sequences of GLUON_VARLEN_MIN_QUERIES queries
    or more on average; "auto" runs it
    where the measured table says it beats SDPA and our Triton kernel. Under `torch.use_deterministic_algorithms(True)`
    its backward adds dQ in a fixed order at hd128 tiles or with a soft-cap, and is the Triton one otherwise (faster
    there, or past hd128 the only deterministic one: `ops._gluon_backward`)."""

    name = "gluon"
    takes_masks = True  # key_mask / segments as they are (no static caches: `unsupported`)

    def missing(self):
        if not _gluon_importable():
            return "this Triton has no Gluon Hopper module (needs triton >= 3.6)"
        from .ops import GLUON_BUILD_ERRORS

        if GLUON_BUILD_ERRORS:
            return f"does not build with this Triton ({GLUON_BUILD_ERRORS[0]})"
        cap = cuda_capability()
        if cap is None:
            return "no CUDA device"
        if cap != (9, 0):
            return f"needs a Hopper GPU (sm_90), this GPU is sm_{cap[0]}{cap[1]}"
        return None

    def unsupported(self, req):
        from ..kernels.gluon_attention import HEAD_DIMS, tile_dim

        why = dispatch.cuda_half_unsupported(req)
        if why:
            return why
        if req.capability != (9, 0):
            return f"needs a Hopper GPU (sm_90), this GPU is sm_{req.capability[0]}{req.capability[1]}"
        if tile_dim(req.head_dim) is None:
            return (f"supports head dims {', '.join(map(str, HEAD_DIMS))} and multiples of 8 between them, got "
                    f"{req.head_dim}")
        if req.varlen and not req.one_packing:
            if req.alibi:
                return ("takes ALiBi in varlen calls only with queries and keys packed alike: pass one tensor as "
                        "both cu_seqlens_q and cu_seqlens_k")
            if req.q_tokens < GLUON_VARLEN_MIN_QUERIES * req.batch:
                # a query tile then spans several sequences and loads all of their keys
                return (f"leaves varlen calls with fewer than {GLUON_VARLEN_MIN_QUERIES} queries a sequence on "
                        f"average (queries and keys packed differently) to the Triton kernel")
        if req.varlen and req.alibi == 2:
            return ("takes per-sequence ALiBi slopes ([batch, heads]) only in dense calls; pass slopes per head "
                    "([heads])")
        for used, what in ((req.dropout, "dropout"), (req.seqused, "static-cache lengths")):
            if used:
                return f"has no {what}"
        return None

    def run(self, q, k, v, p: AttentionParams, dropout_p, return_lse):
        from .ops import gluon_attn

        if p.varlen and p.cu_seqlens_q is p.cu_seqlens_k and q.shape[0] == k.shape[0]:  # one row of segments
            out, lse = gluon_attn(q[None], k[None], v[None], _as_segments(p, q.shape[0]))
            return out[0], (lse[0] if return_lse else None)
        out, lse = gluon_attn(q, k, v, p)
        return out, (lse if return_lse else None)


_SEGMENTS_OF_CU: dict = {}  # segment tables per cu_seqlens tensor (`derived_once`): every layer passes the same one


def _as_segments(p: AttentionParams, total: int) -> AttentionParams:
    """Varlen parameters whose queries and keys share `cu_seqlens` -> the same call on one `[1, total]` row of
    packed segments (`segment_table`): causal masks, windows and soft-caps mean the same there, since each sequence
    has as many queries as keys. The table is made on the device (no sync), once per cu_seqlens tensor."""
    from ..kernels.flash_attention import cu_seqlens_segment_ids, segment_table

    cu = p.cu_seqlens_k
    table = derived_once(_SEGMENTS_OF_CU, cu, total, lambda: segment_table(cu_seqlens_segment_ids(cu, total)[None]))
    return p._replace(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, segments=table)


class ReferenceBackend:
    name = "reference"
    takes_masks = True  # key_mask / seqused_k / segments as they are

    def missing(self):
        return None

    def unsupported(self, req):
        return "has no dropout" if req.dropout else None

    def run(self, q, k, v, p: AttentionParams, dropout_p, return_lse):
        from . import reference
        from .interface import _Attention

        return _Attention.apply(q, k, v, p, reference)


_FLASH = {"fa3": FA3Backend(), "fa4": FA4Backend(), "fa2": FA2Backend()}
_OWN = {"triton": TritonBackend(), "gluon": GluonBackend(), "sdpa": SDPABackend(), "reference": ReferenceBackend()}
BACKENDS = {**_FLASH, **_OWN}


_SELECTED: dict = {}  # "auto" choices by call signature (decoding asks once per layer and token)


def _signature(q, k, v, p: AttentionParams, dropout_p, return_lse):
    """What "auto"'s choice depends on, cheaply: the key length only by power of two (as `dispatch` looks it up)."""
    sk = k.shape[-3]
    return (q.dtype, q.device, q.shape, k.shape[:-3], 1 << max(sk - 1, 0).bit_length(), q.shape[-3] == sk,
            k.shape[-2], k.shape[-1], v.shape[-1], p.causal, p.window_size, bool(p.softcap),
            _alibi_dims(p), None if p.cu_seqlens_q is None else p.cu_seqlens_q.shape[0], p.max_seqlen_q,
            p.max_seqlen_k, p.seqused_k is None,
            p.cu_seqlens_q is p.cu_seqlens_k, p.key_mask is None, p.segments is None, dropout_p > 0, return_lse,
            torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))


def select_backend(name: str, q, k, v, params: AttentionParams, dropout_p: float = 0.0, return_lse: bool = False):
    """The backend object for this call. Forced names raise BackendUnavailable / NotImplementedError with the reason;
    "auto" walks FA3 > FA4 > FA2 > (Triton, Gluon or SDPA, by `dispatch`) on CUDA, Triton under the interpreter, else the
    reference (remembered per call signature: `clear_choices()` after installing a package)."""
    # (not while compiling: Dynamo runs this once per graph anyway, and a cache filled inside a traced function
    # changes a global the graph's guards watch, so the next call would compile again)
    if name == "auto" and not torch.compiler.is_compiling():
        key = _signature(q, k, v, params, dropout_p, return_lse)
        chosen = _SELECTED.get(key)
        if chosen is None:
            chosen = _SELECTED[key] = _select(name, q, k, v, params, dropout_p, return_lse)
        return chosen
    return _select(name, q, k, v, params, dropout_p, return_lse)


def clear_choices() -> None:
    """Forget the remembered "auto" choices (after FlashAttention was installed in a running process, or in tests)."""
    _SELECTED.clear()
    dispatch._CHOICES.clear()


def _select(name, q, k, v, params, dropout_p, return_lse):
    if name not in BACKEND_NAMES:
        raise ValueError(f"Unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}.")
    req = Request.of(q, k, v, params, dropout_p, return_lse)
    if name != "auto":
        backend = BACKENDS[name]
        why = backend.missing() or backend.unsupported(req)
        if why:
            if req.dropout and why == "has no dropout":
                raise NotImplementedError(f"attention backend {name!r} has no dropout; pass dropout_p=0.0 or use "
                                          f"backend='fa2' (flash-attn) for attention dropout.")
            raise BackendUnavailable(f"attention backend {name!r}: {why}.")
        return backend
    on_cuda = req.capability is not None
    if on_cuda:
        for fb in _FLASH.values():
            if fb.missing():
                continue
            why = fb.unsupported(req)
            if why is None:
                return fb
            _warn_once(f"{fb.name} {why}: using hf_fastpath's Triton kernel for these calls instead.")
        # our Triton kernel, or a faster one the measured table knows for this kind of call
        others = tuple(n for n in ("sdpa", "gluon") if _OWN[n].missing() is None and _OWN[n].unsupported(req) is None)
        choice = dispatch.choose(req, others) if others else "triton"
        if choice != "triton":
            return _OWN[choice]
    interp = interpret_requested()
    own = _OWN["triton"] if (on_cuda or interp) and _OWN["triton"].missing() is None else _OWN["reference"]
    why = own.unsupported(req)
    if why and own.name == "triton" and not req.dropout:
        own = _OWN["reference"]  # e.g. float64 or huge heads: the reference still computes it
        why = own.unsupported(req)
    if why:
        raise NotImplementedError(
            f"No available attention backend supports this call ({own.name} {why}). "
            + ("Attention dropout needs flash-attn (backend='fa2'); pass dropout_p=0.0 otherwise." if req.dropout
               else ""))
    return own


def describe_backends() -> list[dict]:
    """One dict per backend: name, available, reason (for `hf-fastpath env`)."""
    rows = []
    cap = cuda_capability()
    for name, backend in BACKENDS.items():
        why = backend.missing()
        if why is None and name in _FLASH:
            if cap is None:
                why = "installed, but no CUDA device"
            else:
                probe = Request(torch.bfloat16, 128, 128, False, False, False, False, False, cap)
                why = backend.unsupported(probe)
        if why is None:
            if name == "reference":
                reason = "ok (plain PyTorch, any device; slow, materialises scores)"
            elif name == "sdpa":
                has_table = dispatch.table_for(cap) is not None
                where = "the measured table says it is faster" if has_table else "... none: no table for this GPU"
                reason = f"ok (sm_{cap[0]}{cap[1]}): 'fastpath' runs it for the plain calls where {where}"
            elif name == "triton" and cap is None:
                reason = "ok (TRITON_INTERPRET=1: interpreted on the CPU, slow)"
            else:
                reason = f"ok (sm_{cap[0]}{cap[1]})" if cap else "ok"
            rows.append(dict(name=name, available=True, reason=reason))
        else:
            rows.append(dict(name=name, available=False, reason=why))
    return rows
