"""Transformers wiring of the `fastpath*` attention implementations.

`register()` (called by `import hf_fastpath`; idempotent) registers, with both `AttentionInterface` and
`AttentionMaskInterface`:

- `fastpath`: best available backend (FA3 > FA4 > FA2 > own Triton on CUDA; reference on CPU);
- `fastpath_triton`, `fastpath_fa2`, `fastpath_fa3`, `fastpath_fa4`: one backend forced (clear error if missing).

Use them as any Transformers attention: `from_pretrained(..., attn_implementation="fastpath")` or
`model.set_attn_implementation("fastpath")`. Llama, GPT-2, GPT-NeoX, GPT-J and GPT-BigCode go through Transformers'
attention interface; Falcon (and GPT-J on Transformers 5.17, which still picks attention classes by name) get their own
attention classes from `hf_fastpath.integrations.falcon`.

Other attention kernels plug in through the same adapter:

    from hf_fastpath.integrations.transformers_attention import register_attention_variant
    register_attention_variant("fastpath_fp8", fp8_attention)

where `fp8_attention(q, k, v, *, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
window_size, softcap, alibi_slopes, [dropout_p])` has the signature of `hf_fastpath.attention.attention` (q `[B,S,H,D]`,
or `[T,H,D]` with cu_seqlens). The adapter does everything model-specific: layout, GQA without repeating K/V, padding
masks (unpadded to varlen), packed batches (`cu_seq_lens_q/k` kwargs or restarting `position_ids`), static caches,
`is_causal`, `sliding_window`, `softcap`, dropout (fallback to PyTorch SDPA with a one-time warning when the kernel
has none).

Masks: the registered mask function (`fastpath_mask`) is Transformers' flash-attention one (a 2-D `[B, Skv]` padding
mask or None), extended for static caches whose unfilled tail the 2-D mask does not describe, and for packed batches.
Host syncs: none on the plain path (no padding, no packing); with a padding mask, packing by `position_ids` or a static
cache, one per forward (the unpadding indices are computed by the first layer and reused by the others).
Padded batches are unpadded to varlen (K/V gathered per layer; decode of a padded batch therefore copies the real
part of the KV cache each step).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math

import torch

from ..attention import attention

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
    "fastpath_fa2": "fa2",
    "fastpath_fa3": "fa3",
    "fastpath_fa4": "fa4",
}
# Names registered so far (built-in and plug-ins) -> attention function handed to Transformers.
VARIANTS: dict[str, callable] = {}

_MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


# ----------------------------------------------------------------------------------------------------------------
# Mask function


def fastpath_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, **kwargs):
    """Mask function registered for every `fastpath*` name. Returns one of
    - None: every key in `[0, kv_length)` is real (plain causal attention);
    - a bool `[B, M]` padding mask over the first M <= kv_length cache slots (as Transformers' flash-attention mask);
    - an int32 `[B, S]` tensor of packed-sequence ids, when Transformers detected a padding-free packed batch from
      restarting `position_ids` (so models whose attention never sees `position_ids`, e.g. GPT-BigCode, still keep
      the sequences apart).
    Static caches without padding: `generate()` drops the all-ones mask and the cache reports the whole cache as
    `kv_length`; only the first `q_offset + q_length` slots hold tokens, so we return an all-True mask of that
    length (the attention function then reads only those slots, densely)."""
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[1] == kv_length and attention_mask.all():
            return None
        return attention_mask
    if isinstance(q_offset, torch.Tensor) or kv_offset + kv_length > q_offset + q_length:
        filled = int(q_offset + q_length) - kv_offset  # one host sync per forward, static caches only
        if filled < kv_length:
            device = kwargs.get("device") or (q_offset.device if isinstance(q_offset, torch.Tensor) else None)
            mask = torch.ones(batch_size, max(filled, 0), dtype=torch.bool, device=device)
            _remember(_last_mask_info, mask, {"all_valid": True})
            return mask
        return None
    if mask_function is not None and mask_function is not _causal_mask_function() and q_length == kv_length > 1:
        return _packed_segments(mask_function, batch_size, q_length, kwargs.get("device"))
    return None


def _causal_mask_function():
    from transformers.masking_utils import causal_mask_function

    return causal_mask_function


def _packed_segments(mask_function, batch_size, length, device):
    """Sequence ids `[B, S]` (int32) where query i may not see key i-1, i.e. where a packed sequence starts; None if
    no such boundary. Only sequence boundaries are taken from `mask_function` (other patterns are not supported)."""
    bidx = torch.arange(batch_size, device=device)[:, None]
    qidx = torch.arange(1, length, device=device)[None, :]
    sees_previous = mask_function(bidx, torch.zeros_like(bidx), qidx, qidx - 1).expand(batch_size, length - 1)
    if bool(sees_previous.all()):
        return None
    starts = (~sees_previous).to(torch.int32)
    seg = torch.cat([starts.new_zeros(batch_size, 1), starts.cumsum(-1, dtype=torch.int32)], dim=1)
    return seg


# ----------------------------------------------------------------------------------------------------------------
# Unpadding, with the result kept for the next layers (all layers of a forward share one mask tensor, so the host
# syncs of nonzero()/max() happen once per forward, not once per layer)

_last_mask_info: list = [None]
_last_packed_info: list = [None]


def _compiling() -> bool:
    return hasattr(torch, "compiler") and torch.compiler.is_compiling()


def _remember(slot, tensor, info, key=None):
    if not _compiling():
        slot[0] = (tensor, tensor._version, key, info)


def _recall(slot, tensor, key=None):
    cached = slot[0]
    if (not _compiling() and cached is not None and cached[0] is tensor and cached[1] == tensor._version
            and (cached[2] is None or cached[2] == key)):
        return cached[3]
    return None


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def _unpad_info(mask: torch.Tensor, sq: int, causal: bool) -> dict:
    """Indices and cu_seqlens of the real tokens of a `[B, M]` bool padding mask: the keys, and the queries: in
    causal attention the queries are the last `sq` slots of the mask (prefill, chunked prefill, decode); in
    non-causal attention with `sq != M` (cross-attention) the mask says nothing about them: all are kept."""
    info = _recall(_last_mask_info, mask, (sq, causal))
    if info is not None:
        return info
    bmask = mask.bool()
    if bool(bmask.all()):
        info = {"all_valid": True}
        _remember(_last_mask_info, mask, info)
        return info
    b, m = bmask.shape
    lens_k = bmask.sum(-1, dtype=torch.int32)
    info = {"all_valid": False, "idx_k": bmask.flatten().nonzero().flatten(), "cu_k": _cu_seqlens(lens_k),
            "max_k": int(lens_k.max())}
    if sq == m:
        info.update(idx_q=info["idx_k"], cu_q=info["cu_k"], max_q=info["max_k"])
    elif sq == 1 or not causal:  # decode (one query per row) or cross-attention: every query row is kept
        idx_q = torch.arange(b * sq, device=mask.device)
        info.update(idx_q=idx_q, cu_q=torch.arange(b + 1, dtype=torch.int32, device=mask.device) * sq, max_q=sq)
    else:  # chunked prefill / speculative decoding: the queries are the last `sq` slots
        qmask = bmask[:, -sq:]
        lens_q = qmask.sum(-1, dtype=torch.int32)
        info.update(idx_q=qmask.flatten().nonzero().flatten(), cu_q=_cu_seqlens(lens_q), max_q=int(lens_q.max()))
    _remember(_last_mask_info, mask, info, (sq, causal))
    return info


def _segments_info(seg: torch.Tensor) -> dict:
    """cu_seqlens of the flattened `[B*S]` tokens from packed-sequence ids `[B, S]`."""
    info = _recall(_last_mask_info, seg)
    if info is not None:
        return info
    b, s = seg.shape
    new_seq = torch.ones_like(seg, dtype=torch.bool)
    new_seq[:, 1:] = seg[:, 1:] != seg[:, :-1]
    starts = new_seq.flatten().nonzero().flatten().to(torch.int32)
    cu = torch.cat([starts, starts.new_full((1,), b * s)])
    info = {"cu_q": cu, "cu_k": cu, "max_q": int(torch.diff(cu).max())}
    info["max_k"] = info["max_q"]
    _remember(_last_mask_info, seg, info)
    return info


def _packed_info(position_ids: torch.Tensor) -> dict | None:
    """cu_seqlens of a packed `[1, T]` batch whose positions restart (a new sequence wherever the position does not
    grow by one, as Transformers' masks define it); None when it is one plain sequence."""
    cached = _recall(_last_packed_info, position_ids)
    if cached is not None:
        return cached["info"]
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(torch.diff(pos) != 1).flatten() + 1
    info = None
    if starts.numel():
        cu = torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), pos.numel())]).to(torch.int32)
        max_len = int(torch.diff(cu).max())
        info = {"cu_q": cu, "cu_k": cu, "max_q": max_len, "max_k": max_len}
    _remember(_last_packed_info, position_ids, {"info": info})
    return info


def _gather_rows(x: torch.Tensor, flat_idx: torch.Tensor) -> torch.Tensor:
    """Rows `flat_idx` of `x [B, S, H, D]` seen as `[B*S, H, D]`, without first copying a strided `x`."""
    s = x.shape[1]
    return x[flat_idx // s, flat_idx % s]


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
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{name} attention has no attention sinks (`s_aux`); this model needs them. Use "
                                  "attn_implementation='eager' or 'flash_attention_3' (vllm kernels) for it.")
    if kwargs.get("output_attentions"):
        _warn_once("output_attentions", f"{name} attention does not return attention weights "
                                        "(output_attentions=True); use attn_implementation='eager' to get them.")


def _kernel_takes_dropout(kernel_fn) -> bool:
    try:
        params = inspect.signature(kernel_fn).parameters
    except (TypeError, ValueError):
        return False
    return "dropout_p" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _sdpa_fallback(q, k, v, *, causal, scale, dropout_p, window, alibi_slopes, softcap, pad_mask, seg_ids):
    """Attention with dropout through PyTorch SDPA on a dense boolean mask (training fallback for kernels without
    dropout). q `[B,Sq,H,D]`, k/v `[B,Skv,Hkv,D]`; `pad_mask` `[B,Skv]` bool or None; `seg_ids` `[B,S]` packed
    sequence ids or None. Rows that see no key give zeros."""
    b, sq, hq, _ = q.shape
    skv, hkv = k.shape[1], k.shape[2]
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
    rep = hq // hkv
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if rep > 1:
        kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
    bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, float("-inf"))
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(q.dtype).reshape(-1 if alibi_slopes.dim() == 2 else 1, hq, 1, 1)
        bias = bias - slopes * (i - j).abs().to(q.dtype)
    any_key = keep.any(-1, keepdim=True)
    bias = torch.where(any_key, bias, torch.zeros((), dtype=q.dtype, device=q.device))
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, dropout_p=dropout_p,
                                                           scale=scale)
    out = out.masked_fill(~any_key, 0.0)
    return out.transpose(1, 2)


# ----------------------------------------------------------------------------------------------------------------
# The adapter


def _plan(name, attention_mask, q, k, v, causal, kwargs):
    """How to feed the kernel: ("dense", k, v, None), ("unpad", k, v, info) or ("packed", k, v, info)."""
    b, sq, skv = q.shape[0], q.shape[1], k.shape[1]
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"{name} attention takes a 2-D padding mask (or None), got a {attention_mask.dim()}-D mask "
                f"{tuple(attention_mask.shape)}: a custom 4-D mask cannot be honoured by a FlashAttention kernel. "
                "Pass a 2-D attention_mask, or use attn_implementation='sdpa' for custom masks.")
        if attention_mask.dtype == torch.int32:  # packed-sequence ids from `fastpath_mask`
            return "packed", k, v, _segments_info(attention_mask)
        m = attention_mask.shape[1]
        if m > skv:
            raise ValueError(f"{name}: the padding mask covers {m} keys but only {skv} keys were given.")
        if m < skv:  # static cache: only the first m slots hold tokens
            k, v = k[:, :m], v[:, :m]
        info = _unpad_info(attention_mask, sq, causal)
        if info["all_valid"]:
            return "dense", k, v, None
        return "unpad", k, v, info

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:  # DataCollatorWithFlattening(return_flash_attn_kwargs=True)
        cu_q = (cu_k if cu_q is None else cu_q).to(device=q.device, dtype=torch.int32)
        cu_k = (cu_q if cu_k is None else cu_k).to(device=q.device, dtype=torch.int32)
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        max_q = int(torch.diff(cu_q).max()) if max_q is None else int(max_q)
        max_k = int(torch.diff(cu_k).max()) if max_k is None else int(max_k)
        return "packed", k, v, {"cu_q": cu_q, "cu_k": cu_k, "max_q": max_q, "max_k": max_k}

    position_ids = kwargs.get("position_ids")
    if b == 1 and sq > 1 and sq == skv and position_ids is not None and position_ids.shape[-1] == sq:
        info = _packed_info(position_ids)  # restarting positions (padding-free batch without cu_seqlens)
        if info is not None:
            return "packed", k, v, info
    return "dense", k, v, None


def _run(kernel_fn, mode, q, k, v, info, kw, dropout):
    b, sq = q.shape[0], q.shape[1]
    if mode == "dense":
        return _call(kernel_fn, q, k, v, kw, dropout)
    if mode == "unpad":
        out = _call(kernel_fn, _gather_rows(q, info["idx_q"]), _gather_rows(k, info["idx_k"]),
                    _gather_rows(v, info["idx_k"]), kw, dropout, cu_seqlens_q=info["cu_q"],
                    cu_seqlens_k=info["cu_k"], max_seqlen_q=info["max_q"], max_seqlen_k=info["max_k"])
        full = out.new_zeros(b * sq, *out.shape[1:]).index_copy(0, info["idx_q"], out)
        return full.view(b, sq, *out.shape[1:])
    qf, kf, vf = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
    out = _call(kernel_fn, qf, kf, vf, kw, dropout, cu_seqlens_q=info["cu_q"], cu_seqlens_k=info["cu_k"],
                max_seqlen_q=info["max_q"], max_seqlen_k=info["max_k"])
    return out.view(b, sq, *out.shape[1:])


def _call(kernel_fn, q, k, v, kw, dropout, **varlen):
    if dropout:
        return kernel_fn(q, k, v, dropout_p=dropout, **kw, **varlen)
    return kernel_fn(q, k, v, **kw, **varlen)


def _fallback(name, mode, q, k, v, info, attention_mask, kw, dropout):
    _warn_once(f"dropout:{name}", f"{name}: the attention kernel has no dropout; training with attention dropout "
                                  f"{dropout} runs through PyTorch SDPA instead (slower). Set the model's attention "
                                  "dropout to 0 to keep the fast kernel.")
    pad_mask = seg = None
    if mode == "unpad":
        pad_mask = attention_mask[:, : k.shape[1]].bool()
    elif mode == "packed":
        if not torch.equal(info["cu_q"], info["cu_k"]):
            raise NotImplementedError(f"{name}: attention dropout with different query/key packing is not supported.")
        seg = _segment_ids(info["cu_k"], q.shape[0] * q.shape[1]).view(q.shape[0], q.shape[1])
    return _sdpa_fallback(q, k, v, causal=kw["causal"], scale=kw["softmax_scale"], dropout_p=dropout,
                          window=kw["window_size"], alibi_slopes=kw["alibi_slopes"], softcap=kw["softcap"],
                          pad_mask=pad_mask, seg_ids=seg)


def _segment_ids(cu: torch.Tensor, total: int) -> torch.Tensor:
    marks = torch.zeros(total, dtype=torch.int32, device=cu.device)
    inner = cu[1:-1].long()
    inner = inner[inner < total]
    marks.index_add_(0, inner, torch.ones_like(inner, dtype=torch.int32))
    return torch.cumsum(marks, 0)


def _attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, kernel_fn, name,
                       kernel_dropout, **kwargs):
    """Transformers attention function: query `[B,Hq,Sq,D]`, key/value `[B,Hkv,Skv,D]` -> (`[B,Sq,Hq,D]`, None)."""
    _check_inputs(name, query, key, kwargs)
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [B,S,H,D] views, no copy
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    window = (-1, -1)
    sliding_window = kwargs.get("sliding_window")
    if sliding_window is not None and k.shape[1] > sliding_window:
        window = (sliding_window - 1, -1 if is_causal else sliding_window - 1)
    kw = dict(causal=bool(is_causal), softmax_scale=scale, window_size=window, softcap=kwargs.get("softcap") or 0.0,
              alibi_slopes=kwargs.get("alibi_slopes"))
    dropout = float(dropout or 0.0) if module.training else 0.0

    mode, k, v, info = _plan(name, attention_mask, q, k, v, kw["causal"], kwargs)
    if dropout:
        if kernel_dropout:
            try:
                return _run(kernel_fn, mode, q, k, v, info, kw, dropout), None
            except NotImplementedError:
                pass
        return _fallback(name, mode, q, k, v, info, attention_mask, kw, dropout), None
    return _run(kernel_fn, mode, q, k, v, info, kw, 0.0), None


def make_attention_function(kernel_fn, name: str = "fastpath"):
    """A Transformers attention function (`fn(module, query, key, value, attention_mask, scaling, dropout,
    **kwargs) -> (out [B,Sq,Hq,D], None)`) running `kernel_fn` (signature of `hf_fastpath.attention.attention`)."""
    fn = functools.partial(_attention_forward, kernel_fn=kernel_fn, name=name,
                           kernel_dropout=_kernel_takes_dropout(kernel_fn))
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
    fn = make_attention_function(kernel_fn, name)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, mask_fn)
    VARIANTS[name] = fn
    from . import falcon

    falcon.register_name(name)


def _builtin_kernel(backend: str):
    kernel = functools.partial(attention, backend=backend)
    functools.update_wrapper(kernel, attention)
    return kernel


def register() -> None:
    """Register the built-in `fastpath*` names, low-bit ones included. Safe to call more than once."""
    from ..attention.lowbit import fp4_attention, fp8_attention

    kernels = {name: _builtin_kernel(backend) for name, backend in _BUILTIN_VARIANTS.items()}
    kernels.update(fastpath_fp8=fp8_attention, fastpath_fp4=fp4_attention)
    for name, kernel in kernels.items():
        if name not in VARIANTS:
            register_attention_variant(name, kernel)
