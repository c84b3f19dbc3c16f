"""Transformers wiring of the `fastpath*` attention implementations.

`register()` (called by `import hf_fastpath`; idempotent) registers, with both `AttentionInterface` and
`AttentionMaskInterface`:

- `fastpath`: the fastest backend this machine has for each call (FA3 > FA4 > FA2 when installed, else our Triton
  kernel or torch SDPA by the measured table in `attention/dispatch.py`; the reference on the CPU);
- `fastpath_triton`, `fastpath_gluon`, `fastpath_fa2`, `fastpath_fa3`, `fastpath_fa4`: one backend forced (clear
  error if missing or unable to serve a call).

Use them as any Transformers attention: `from_pretrained(..., attn_implementation="fastpath")` or
`model.set_attn_implementation("fastpath")`. Llama, GPT-2, GPT-NeoX, GPT-J and GPT-BigCode go through Transformers'
attention interface; Falcon (and GPT-J on Transformers 5.17, which still picks attention classes by name) get their own
attention classes from `hf_fastpath.integrations.falcon`.

Other attention kernels plug in through the same adapter:

    from hf_fastpath.integrations.transformers_attention import register_attention_variant
    register_attention_variant("fastpath_fp8", fp8_attention)

where `fp8_attention(q, k, v, *, causal, softmax_scale, window_size, softcap, alibi_slopes, [cu_seqlens_q,
cu_seqlens_k, max_seqlen_q, max_seqlen_k | key_mask, seqused_k | segments], [dropout_p])` has the signature of
`hf_fastpath.attention.attention` (q `[B,S,H,D]`, or `[T,H,D]` with cu_seqlens). The adapter does everything
model-specific: layout, GQA without repeating K/V, padding (`key_mask`), static caches (`seqused_k`), packed batches
(`segments`, or `cu_seqlens` from `cu_seq_lens_q/k` kwargs), `is_causal`, `sliding_window`, `softcap`, dropout
(fallback to PyTorch SDPA with a one-time warning when the kernel has none).

torch.compile: nothing on this path reads a tensor's value on the host while compiling (the mask function and the
kernel arguments are derived on the device; our kernels are custom ops), so compiled training, prefill and static-cache
decoding run without graph breaks. Eagerly, one host check per forward drops padding masks that mask nothing, and in
training finds packed sequences from restarting `position_ids` that Transformers' mask did not look at.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math

import torch

from ..attention import attention
from ..attention.backends import select_backend
from ..attention.interface import _unpadded
from ..attention.params import AttentionParams
from ..attention.reference import visible_mask
from ..kernels.common import derived_once, warn_once
from ..kernels.flash_attention import cu_seqlens_segment_ids, segment_table
from .falcon import alibi_slopes_of

logger = logging.getLogger(__name__)

__all__ = [
    "register",
    "register_attention_variant",
    "make_attention_function",
    "fastpath_mask",
    "VARIANTS",
]

# name -> backend of `hf_fastpath.attention.attention`
_BUILTIN_VARIANTS = {
    "fastpath": "auto",
    "fastpath_triton": "triton",
    "fastpath_gluon": "gluon",
    "fastpath_fa2": "fa2",
    "fastpath_fa3": "fa3",
    "fastpath_fa4": "fa4",
}
# Names registered so far (built-in and plug-ins) -> attention function handed to Transformers.
VARIANTS: dict[str, callable] = {}

_MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _warn_once(key: str, message: str) -> None:
    warn_once(__name__, "adapter:" + key, message)


# ----------------------------------------------------------------------------------------------------------------
# Mask function


def fastpath_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, **kwargs):
    """Mask function registered for every `fastpath*` name. Returns one of
    - None: every key in `[0, kv_length)` is real (plain causal attention);
    - a bool `[B, kv_length]` padding mask (True: a real token);
    - an int8 `[B, kv_length]` static-cache table: 1 a real token, 0 padding, -1 a slot no token has reached yet
      (static caches hand the attention all `max_cache_len` slots; `q_offset` is then a tensor);
    - an int32 `[3, B, S]` packed-sequence table (`kernels.flash_attention.segment_table`), when Transformers'
      mask function keeps packed sequences apart (restarting `position_ids` in a padding-free batch);
    - a bool `[B, 1, Sq, Skv]` mask, when the model lays an overlay over the causal mask (`or_mask_function`, e.g.
      Gemma-3's bidirectional image tokens) or attends in chunks (Llama-4) past its first chunk: the adapter runs
      our kernels where it amounts to causal (or full) attention + padding, PyTorch SDPA on the mask elsewhere
      (one-time warning).
    While compiling nothing reads tensor values on the host (a mask is returned even when all its keys are real);
    eagerly, one check per forward drops masks that mask nothing, unless Transformers says the mask may not be
    skipped (`allow_is_causal_skip=False`: a static cache, whose compiled decode step generate() hands masks made
    outside the graph; a None there, once a sliding window has moved past the padding, recompiled it)."""
    device = kwargs.get("device")
    if attention_mask is not None:
        device = attention_mask.device
    elif isinstance(q_offset, torch.Tensor):
        device = q_offset.device
    overlay = q_length > 1 and (kwargs.get("use_vmap") or getattr(mask_function, "__name__", None) == "or_mask")
    local_size = kwargs.get("local_size")  # a sliding window's or a chunk's size (Llama-4's chunked layers)
    chunked = local_size is not None and local_size == getattr(kwargs.get("config"), "attention_chunk_size", None) \
        and (isinstance(q_offset, torch.Tensor) or kv_offset + kv_length > local_size)
    if overlay or chunked:
        # an overlay on the causal mask (Gemma-3's bidirectional image blocks, a bidirectional encoder's all-true
        # one) or chunked attention past its first chunk: the whole mask, for the adapter to check against what the
        # kernels express (`_as_padding_mask`)
        from transformers.masking_utils import sdpa_mask

        return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                         local_size=local_size, allow_is_causal_skip=False, use_vmap=True,
                         device=device)
    compiling = _compiling()
    if isinstance(q_offset, torch.Tensor) or kv_offset + kv_length > q_offset + q_length:  # static cache
        filled = (torch.arange(kv_length, device=device) + kv_offset) < (q_offset + q_length)
        if attention_mask is None:
            return torch.where(filled, 1, -1).to(torch.int8)[None].expand(batch_size, kv_length)
        # slot j holds position kv_offset + j (a sliding-window layer that is full keeps the last positions)
        real = attention_mask.bool()
        end = kv_offset + kv_length
        if real.shape[1] < end:
            real = torch.nn.functional.pad(real, (0, end - real.shape[1]))
        return torch.where(filled[None], real[:, kv_offset:end].to(torch.int8), -1).to(torch.int8)
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:].bool()
        if (not compiling and kwargs.get("allow_is_causal_skip", True) and attention_mask.shape[1] == kv_length
                and attention_mask.all()):
            return None
        return attention_mask
    if mask_function is not None and mask_function is not _causal_mask_function() and q_length == kv_length > 1:
        return _packed_segments(mask_function, batch_size, q_length, device, compiling)
    return None


def _causal_mask_function():
    from transformers.masking_utils import causal_mask_function

    return causal_mask_function


def _packed_segments(mask_function, batch_size, length, device, compiling):
    """The packed-sequence table where query i may not see key i-1, i.e. where a packed sequence starts (eagerly:
    None when there is no such boundary). Only sequence boundaries are taken from `mask_function`."""
    bidx = torch.arange(batch_size, device=device)[:, None]
    qidx = torch.arange(1, length, device=device)[None, :]
    sees_previous = mask_function(bidx, torch.zeros_like(bidx), qidx, qidx - 1).expand(batch_size, length - 1)
    if not compiling and bool(sees_previous.all()):
        return None
    starts = (~sees_previous).to(torch.int32)
    ids = torch.cat([starts.new_zeros(batch_size, 1), starts.cumsum(-1, dtype=torch.int32)], dim=1)
    return segment_table(ids)


# ----------------------------------------------------------------------------------------------------------------
# What the kernel is told about the keys: derived on the device, never read on the host while compiling. Eagerly,
# the few derived tensors are computed by the first layer and reused by the others (all layers share one mask).

# One cache per kind, per tensor (`kernels.common.derived_once`): an entry goes with its tensor, since a tensor kept
# past its forward would shift where the next `generate()` allocates its static cache (CUDA graphs then re-record).
_SEQUSED: dict = {}
_POSITION_SEGMENTS: dict = {}
_PACKINGS: dict = {}
_DENSE_MASKS: dict = {}


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _static_cache_args(codes: torch.Tensor) -> dict:
    """Kernel arguments for the int8 static-cache table: the keys in use per row, and the padding."""
    seqused = derived_once(_SEQUSED, codes, None, lambda: (codes >= 0).sum(-1, dtype=torch.int32))
    return {"key_mask": codes, "seqused_k": seqused}


def _position_segments(position_ids: torch.Tensor):
    """Eagerly: the packed-sequence table of a `[1, T]` batch whose positions restart (a new sequence wherever the
    position does not grow by one, as Transformers' masks define it), or None for one plain sequence."""

    def make():
        starts = torch.diff(position_ids.reshape(1, -1), dim=-1) != 1
        if not bool(starts.any()):  # one host sync per forward
            return None
        ids = torch.cat([starts.new_zeros(1, 1, dtype=torch.int32), starts.cumsum(-1, dtype=torch.int32)], dim=1)
        return segment_table(ids)

    return derived_once(_POSITION_SEGMENTS, position_ids, None, make)


def _packing(cu_q: torch.Tensor, cu_k: torch.Tensor, device) -> tuple:
    """int32 `(cu_seqlens_q, cu_seqlens_k)` on `device`: one tensor for both when they hold the same offsets, as in
    packed self-attention (`DataCollatorWithFlattening` hands over two equal tensors), so that kernels which need
    queries and keys packed alike (Gluon) can tell without reading them. Eagerly that costs one host sync per
    forward (the result is remembered for the other layers); while compiling nothing is read and the two stay
    apart unless they are one tensor already."""
    as_int = lambda t: t.to(device=device, dtype=torch.int32)  # noqa: E731
    if cu_q is cu_k:
        return (as_int(cu_q),) * 2

    def make():
        pair = (as_int(cu_q), as_int(cu_k))
        if not _compiling() and pair[0].shape == pair[1].shape and torch.equal(*pair):
            pair = (pair[0],) * 2
        return cu_k, pair  # cu_k lives as long as the entry: its id in the key cannot be reused meanwhile

    return derived_once(_PACKINGS, cu_q, (id(cu_k), cu_k._version), make)[1]


def _as_padding_mask(mask: torch.Tensor, causal: bool, window) -> torch.Tensor | None:
    """A dense bool `[B, 1, Sq, Skv]` mask -> the `[B, Skv]` padding mask it amounts to for a kernel call with this
    causality and window, or None where it is something else (keys visible beyond them: bidirectional image
    blocks) or cannot be checked (while compiling). One host sync per mask (the model's layers share it)."""
    def reduce():
        keep = mask[:, 0]
        key_ok = keep.any(dim=1)  # a real key is seen by some query
        visible = visible_mask(keep.shape[1], keep.shape[2], causal, window, keep.device)
        expected = key_ok[:, None, :] if visible is None else key_ok[:, None, :] & visible
        return key_ok if torch.equal(keep, expected) else None

    return None if _compiling() else derived_once(_DENSE_MASKS, mask, (causal, tuple(window)), reduce)


def _dense_mask_fallback(name, q, k, v, mask, kw, dropout, sinks):
    """Attention on a dense mask our kernels cannot express, through PyTorch SDPA (one-time warning)."""
    if kw["softcap"] or kw["alibi_slopes"] is not None or sinks is not None:
        raise NotImplementedError(f"{name}: this model's mask has parts a FlashAttention kernel cannot express (e.g. "
                                  "bidirectional image tokens, chunked attention) and its attention also needs a "
                                  "soft-cap, ALiBi or sinks, which the SDPA fallback lacks. Use "
                                  "attn_implementation='eager'.")
    _warn_once(f"dense-mask:{name}", f"{name}: this model's mask has parts our kernels cannot express (queries that "
                                     "see other keys than the causal / sliding-window pattern gives them, e.g. "
                                     "Gemma-3's bidirectional image tokens, Llama-4's chunked attention); those "
                                     "calls run through PyTorch SDPA.")
    return _sdpa_on_mask(q, k, v, mask, kw["softmax_scale"], dropout)


def _plan(name, attention_mask, q, k, kwargs, training=False) -> dict:
    """Keyword arguments for the kernel describing which keys each query sees: nothing (dense), `key_mask`,
    `key_mask` + `seqused_k` (static cache), `segments` (packed) or varlen `cu_seqlens_q/k` (packed, given by
    `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`).
    Transformers' mask keeps packed sequences apart only when the model made no cache (`use_cache=False`); in
    training (gradients on), eagerly, restarting `position_ids` are also found here, at one host sync per forward
    (a model with a cache, `use_cache` being on by default). Inference keeps Transformers' semantics: the sync
    would stall every prefill (0.84x SDPA at 1k tokens on the H200), and a generate() prefill is never packed."""
    b, sq, skv = q.shape[0], q.shape[1], k.shape[1]
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if b != 1:
            raise ValueError(f"{name}: cu_seq_lens_q/k describe one packed row, got a batch of {b}.")
        cu_q, cu_k = _packing(cu_k if cu_q is None else cu_q, cu_q if cu_k is None else cu_k, q.device)
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        max_q = int(torch.diff(cu_q).max()) if max_q is None else max_q  # host sync only when not given
        max_k = int(torch.diff(cu_k).max()) if max_k is None else max_k
        return dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
    if attention_mask is None:
        position_ids = kwargs.get("position_ids")
        if (training and not _compiling() and b == 1 and sq > 1 and sq == skv and position_ids is not None
                and position_ids.shape[-1] == sq):  # restarting positions that Transformers' mask did not see
            segments = _position_segments(position_ids)
            if segments is not None:
                return dict(segments=segments)
        return {}
    if attention_mask.dim() == 3 and attention_mask.dtype == torch.int32:  # packed-sequence table
        return dict(segments=attention_mask)
    if attention_mask.dim() != 2:
        raise ValueError(
            f"{name} attention takes a 2-D padding mask (or None), got a {attention_mask.dim()}-D mask "
            f"{tuple(attention_mask.shape)}: a custom 4-D mask cannot be honoured by a FlashAttention kernel. "
            "Pass a 2-D attention_mask, or use attn_implementation='sdpa' for custom masks.")
    if attention_mask.shape[1] != skv:
        raise ValueError(f"{name}: the padding mask covers {attention_mask.shape[1]} keys but {skv} keys were given.")
    if attention_mask.dtype == torch.int8:
        return _static_cache_args(attention_mask)
    return dict(key_mask=attention_mask)


# ----------------------------------------------------------------------------------------------------------------
# Checks and the dropout fallback


def _check_inputs(name: str, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> None:
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(f"{name}: expected query/key/value shaped [batch, heads, seq, head_dim], got "
                         f"{tuple(query.shape)} and {tuple(key.shape)}.")
    if query.dtype not in _DTYPES:
        raise TypeError(f"{name} attention supports float16, bfloat16 and float32, got {query.dtype}. Cast the model "
                        "(e.g. `model.to(torch.bfloat16)`) or load it with attn_implementation='eager'.")
    if query.device.type not in ("cuda", "cpu"):
        raise RuntimeError(f"{name} attention runs on CUDA GPUs (and on the CPU through its reference path), not on "
                           f"{query.device.type!r}. Use attn_implementation='sdpa' on this device.")
    if query.shape[-1] > _MAX_HEAD_DIM:
        raise ValueError(f"{name} attention supports head dims up to {_MAX_HEAD_DIM}, this model has "
                         f"{query.shape[-1]}. Use attn_implementation='sdpa' for it.")
    if query.shape[1] % key.shape[1] != 0:
        raise ValueError(f"{name}: {query.shape[1]} query heads are not a multiple of {key.shape[1]} key/value heads.")
    if kwargs.get("sinks") is not None:  # Inkling: per-token sink logits from a projection (ours: per head, s_aux)
        raise NotImplementedError(f"{name} attention has no per-token attention sinks (`sinks`); this model needs "
                                  "them. Use attn_implementation='eager' for it.")
    if kwargs.get("output_attentions"):
        _warn_once("output_attentions", f"{name} attention does not return attention weights "
                                        "(output_attentions=True); use attn_implementation='eager' to get them.")


def _kernel_takes(kernel_fn, arg: str, by_name: bool = False) -> bool:
    """Whether kernel_fn accepts `arg`; `by_name`: only as a named parameter, not through **kwargs (sinks: a kernel
    that passed them on or dropped them would give a wrong answer instead of an error)."""
    try:
        params = inspect.signature(kernel_fn).parameters
    except (TypeError, ValueError):
        return False
    return arg in params or (not by_name and any(p.kind is p.VAR_KEYWORD for p in params.values()))


def _sdpa_fallback(q, k, v, *, causal, scale, dropout_p, window, alibi_slopes, softcap, pad_mask, seg_ids):
    """Attention with dropout through PyTorch SDPA on a dense boolean mask (training fallback for kernels without
    dropout). q `[B,Sq,H,D]`, k/v `[B,Skv,Hkv,D]`; `pad_mask` `[B,Skv]` bool or None; `seg_ids` `[B,S]` packed
    sequence ids or None. Rows that see no key give zeros."""
    b, sq, hq, _ = q.shape
    skv = k.shape[1]
    if softcap:
        raise NotImplementedError("The dropout fallback has no softcap; train with dropout=0 or use 'eager'.")
    i = torch.arange(sq, device=q.device)[:, None] + (skv - sq)
    j = torch.arange(skv, device=q.device)[None, :]
    keep = torch.ones(sq, skv, dtype=torch.bool, device=q.device)
    left, right = window
    if causal:
        keep &= j <= i
    if right >= 0:
        keep &= j <= i + right
    if left >= 0:
        keep &= j >= i - left
    keep = keep[None, None].expand(b, 1, sq, skv)
    if pad_mask is not None:
        keep = keep & pad_mask[:, None, None, :]
    if seg_ids is not None:
        keep = keep & (seg_ids[:, None, -sq:, None] == seg_ids[:, None, None, :])
    alibi = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(q.dtype).reshape(-1 if alibi_slopes.dim() == 2 else 1, hq, 1, 1)
        alibi = -slopes * (i - j).abs().to(q.dtype)
    return _sdpa_on_mask(q, k, v, keep, scale, dropout_p, alibi)


def _sdpa_on_mask(q, k, v, keep, scale, dropout_p=0.0, bias=None):
    """PyTorch SDPA where bool `keep` `[B, 1, Sq, Skv]` is True, plus an optional float `bias`; q `[B,Sq,H,D]`,
    k/v `[B,Skv,Hkv,D]` -> `[B,Sq,H,D]`. Rows that see no key give zeros."""
    rep = q.shape[2] // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if rep > 1:
        kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
    masked = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, float("-inf"))
    masked = masked if bias is None else masked + bias
    any_key = keep.any(-1, keepdim=True)
    masked = torch.where(any_key, masked, torch.zeros((), dtype=q.dtype, device=q.device))
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=masked, dropout_p=dropout_p,
                                                           scale=scale)
    return out.masked_fill(~any_key, 0.0).transpose(1, 2)


# ----------------------------------------------------------------------------------------------------------------
# The adapter


def _run(kernel_fn, q, k, v, kw, masks, extra, takes_masks):
    """kernel_fn on `[B, S, H, D]` views; packed rows given by cu_seqlens go in as `[T, H, D]`. A plug-in kernel
    without `key_mask` / `seqused_k` / `segments` arguments gets varlen inputs instead (one host sync). `extra`:
    `dropout_p` and `sinks`, when the call has them."""
    if "cu_seqlens_q" in masks:
        b, sq = q.shape[0], q.shape[1]
        out = kernel_fn(q[0], k[0], v[0], **kw, **masks, **extra)
        return out.view(b, sq, *out.shape[1:])
    if masks and not takes_masks:
        def varlen_kernel(q, k, v, p):
            return kernel_fn(q, k, v, **kw, cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k,
                             max_seqlen_q=p.max_seqlen_q, max_seqlen_k=p.max_seqlen_k, **extra), None

        return _unpadded(varlen_kernel, q, k, v, AttentionParams(**kw, **masks))[0]
    return kernel_fn(q, k, v, **kw, **masks, **extra)


def _fallback(name, q, k, v, kw, masks, dropout):
    _warn_once(f"dropout:{name}", f"{name}: the attention kernel has no dropout; training with attention dropout "
                                  f"{dropout} runs through PyTorch SDPA instead (slower). Set the model's attention "
                                  "dropout to 0 to keep the fast kernel.")
    if "seqused_k" in masks:
        raise NotImplementedError(f"{name}: attention dropout with a static KV cache is not supported (it is for "
                                  "training; generation runs the model in eval mode).")
    pad_mask = masks["key_mask"] > 0 if "key_mask" in masks else None
    seg = masks["segments"][0] if "segments" in masks else None
    if "cu_seqlens_q" in masks:
        if not torch.equal(masks["cu_seqlens_q"], masks["cu_seqlens_k"]):
            raise NotImplementedError(f"{name}: attention dropout with different query/key packing is not supported.")
        seg = cu_seqlens_segment_ids(masks["cu_seqlens_k"], q.shape[1])[None]
    return _sdpa_fallback(q, k, v, causal=kw["causal"], scale=kw["softmax_scale"], dropout_p=dropout,
                          window=kw["window_size"], alibi_slopes=kw["alibi_slopes"], softcap=kw["softcap"],
                          pad_mask=pad_mask, seg_ids=seg)


def _attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, kernel_fn, name,
                       kernel_dropout, kernel_masks, kernel_sinks=False, auto_dispatch=False, **kwargs):
    """Transformers attention function: query `[B,Hq,Sq,D]`, key/value `[B,Hkv,Skv,D]` -> (`[B,Sq,Hq,D]`, None)."""
    _check_inputs(name, query, key, kwargs)
    sinks = kwargs.get("s_aux")
    if sinks is not None and not kernel_sinks:
        raise NotImplementedError(f"{name} attention has no attention sinks (`s_aux`); this model needs them. Use "
                                  "attn_implementation='fastpath' (or 'eager') for it.")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [B,S,H,D] views, no copy
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    window = (-1, -1)
    # a sliding-window layer whose attention does not pass its window (Qwen2-MoE) still has it as an attribute
    # (read from the instance dict: nn.Module's __getattr__ miss costs ~0.7 µs a call, per layer and decode step)
    sliding_window = kwargs["sliding_window"] if "sliding_window" in kwargs else vars(module).get("sliding_window")
    if sliding_window is not None and k.shape[1] > sliding_window:
        window = (sliding_window - 1, -1 if is_causal else sliding_window - 1)
    slopes = kwargs.get("alibi_slopes")
    kw = dict(causal=bool(is_causal), softmax_scale=scale, window_size=window, softcap=kwargs.get("softcap") or 0.0,
              alibi_slopes=alibi_slopes_of(module, query.device) if slopes is None else slopes)
    dropout = float(dropout or 0.0) if module.training else 0.0
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.dtype == torch.bool:
        key_ok = _as_padding_mask(attention_mask, kw["causal"], window)
        if key_ok is None:
            return _dense_mask_fallback(name, q, k, v, attention_mask, kw, dropout, sinks), None
        attention_mask = key_ok
    masks = _plan(name, attention_mask, q, k, kwargs, torch.is_grad_enabled() and query.requires_grad)
    if auto_dispatch and not masks and not dropout and window == (-1, -1) and not kw["softcap"] and \
            kw["alibi_slopes"] is None and sinks is None:
        # a plain call: where `fastpath` picks SDPA, call it on Transformers' own [B, H, S, D] tensors (the general
        # path's layout changes and checks cost ~15 µs of host time a call, which eager decoding pays per layer)
        backend = select_backend("auto", q, k, v, AttentionParams(**kw))
        if backend.name == "sdpa":
            return backend.attend(query, key, value, kw["causal"], scale).transpose(1, 2), None
    if sinks is not None:
        if dropout:
            raise NotImplementedError(f"{name}: attention dropout with attention sinks is not supported; set the "
                                      "model's attention dropout to 0.")
        return _run(kernel_fn, q, k, v, kw, masks, dict(sinks=sinks), kernel_masks), None
    if dropout:
        if kernel_dropout:
            try:
                return _run(kernel_fn, q, k, v, kw, masks, dict(dropout_p=dropout), kernel_masks), None
            except NotImplementedError:
                pass
        return _fallback(name, q, k, v, kw, masks, dropout), None
    return _run(kernel_fn, q, k, v, kw, masks, {}, kernel_masks), None


def make_attention_function(kernel_fn, name: str = "fastpath", auto_dispatch: bool = False):
    """A Transformers attention function (`fn(module, query, key, value, attention_mask, scaling, dropout,
    **kwargs) -> (out [B,Sq,Hq,D], None)`) running `kernel_fn` (signature of `hf_fastpath.attention.attention`).
    `auto_dispatch`: kernel_fn is `attention(backend="auto")` (plain calls that it would hand to SDPA go there
    directly)."""
    fn = functools.partial(_attention_forward, kernel_fn=kernel_fn, name=name,
                           kernel_dropout=_kernel_takes(kernel_fn, "dropout_p"),
                           kernel_masks=_kernel_takes(kernel_fn, "key_mask"),
                           kernel_sinks=_kernel_takes(kernel_fn, "sinks", by_name=True), auto_dispatch=auto_dispatch)
    functools.update_wrapper(fn, _attention_forward)
    fn.__name__ = f"{name}_attention_forward"
    return fn


_FORBIDDEN_IN_NAMES = ("flash", "sdpa", "flex_attention", "/", ":", "paged")


def register_attention_variant(name: str, kernel_fn, *, mask_fn=fastpath_mask) -> None:
    """Register `name` with Transformers (attention function AND mask function) running `kernel_fn`, and give the
    models that choose attention classes by name (Falcon, GPT-J on older Transformers) a class for it.
    Idempotent for the same name; re-registering a name replaces its kernel."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    low = name.lower()
    bad = [s for s in _FORBIDDEN_IN_NAMES if s in low]
    if bad:
        raise ValueError(f"Attention name {name!r} contains {bad[0]!r}, which Transformers treats specially "
                         "(flash / SDPA / flex checks or Hub-kernel names). Pick another name, e.g. 'fastpath_x'.")
    auto = getattr(kernel_fn, "func", None) is attention and getattr(kernel_fn, "keywords", {}) == {"backend": "auto"}
    fn = make_attention_function(kernel_fn, name, auto_dispatch=auto)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, mask_fn)
    VARIANTS[name] = fn
    from . import falcon

    falcon.register_name(name)


def _builtin_kernel(backend: str):
    kernel = functools.partial(attention, backend=backend)
    functools.update_wrapper(kernel, attention)
    return kernel


def uses_attention_interface(model) -> bool:
    """Whether `model` computes attention through Transformers' `ALL_ATTENTION_FUNCTIONS`, where our names take
    effect: its modeling module (or its text model's) imports it, or the model table patches its attention classes
    (Falcon on older Transformers). Bloom, MPT, BigBird... compute attention in their own code: with our name they
    would fail on our mask or silently ignore our kernels."""
    import importlib

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    from .models import facts_for

    config = getattr(model, "config", None)
    if facts_for(config).attention_class_table:
        return True
    # the model's own classes (remote code included), not Transformers' base classes, and its text model's
    modules = {cls.__module__ for cls in type(model).__mro__ if issubclass(cls, transformers.PreTrainedModel)
               and not cls.__module__.startswith("transformers.modeling")}
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    text_class = getattr(transformers, str(MODEL_MAPPING_NAMES.get(getattr(text, "model_type", None))), None)
    if text_class is not None:
        modules.add(text_class.__module__)
    return any(hasattr(importlib.import_module(m), "ALL_ATTENTION_FUNCTIONS") for m in modules)


def _check_model_takes_our_attention(original):
    """Wraps `PreTrainedModel.get_correct_attn_implementation` (from_pretrained, set_attn_implementation): one of our
    names on a model that would not use it is a clear error there, not a shape error (or a silent eager run) later."""
    @functools.wraps(original)
    def checked(self, requested_attention, *args, **kwargs):
        chosen = original(self, requested_attention, *args, **kwargs)
        if chosen in VARIANTS and not uses_attention_interface(self):
            raise ValueError(f"attn_implementation={chosen!r}: {type(self).__name__} computes attention in its own "
                             "code, not through Transformers' AttentionInterface, so hf_fastpath's kernels cannot run "
                             "in it. Use attn_implementation='sdpa' or 'eager' for this model.")
        return chosen

    checked._hf_fastpath_checked = True
    return checked


def register() -> None:
    """Register the built-in `fastpath*` names, low-bit ones included. Safe to call more than once."""
    from transformers import PreTrainedModel

    from ..attention.lowbit import fp4_attention, fp8_attention

    kernels = {name: _builtin_kernel(backend) for name, backend in _BUILTIN_VARIANTS.items()}
    kernels.update(fastpath_fp8=fp8_attention, fastpath_fp4=fp4_attention)
    for name, kernel in kernels.items():
        if name not in VARIANTS:
            register_attention_variant(name, kernel)
    original = getattr(PreTrainedModel, "get_correct_attn_implementation", None)
    if original is not None and not getattr(original, "_hf_fastpath_checked", False):
        PreTrainedModel.get_correct_attn_implementation = _check_model_takes_our_attention(original)
