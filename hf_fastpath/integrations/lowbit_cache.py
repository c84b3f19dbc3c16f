"""`LowBitCache`: a Transformers KV cache that stores keys and values in FP8 or FP4 with per-token scales.

    cache = hf_fastpath.LowBitCache("fp8")          # or "mxfp4", "nvfp4"
    model.generate(**inputs, cache=cache)           # `past_key_values=cache` before Transformers 5.24

Each token is quantized once when it enters the cache (scales along the head dim only), so appending never
re-quantizes and a later token never changes an earlier one. Memory per cached value: 8 bits + 32/D (fp8),
4.25 bits (mxfp4), 4.5 bits + 32/D (nvfp4), against 16 for bf16.

What `update` hands back to the attention function:
- default: the whole cache dequantized to the model dtype, so every attention implementation works (the memory is
  saved, the bandwidth is not);
- `packed_decode=True` (use with attn_implementation "fastpath_fp8" / "fastpath_fp4"): lightweight `PackedKV`
  tensors. hf_fastpath's low-bit attention runs decode steps with the split-KV kernel that reads the packed
  cache directly (`hf_fastpath.kernels.lowbit_decode`); any other use of them dequantizes first, so other
  attention implementations still compute the right thing, only slower. FP4 bytes are then stored in the decode
  byte layout (`lowbit_quant.recode_for_decode`, same codes, bits placed for a cheaper unpack).

Built on the layer extension point both Transformers 5.17 and 5.24 have: `Cache(layer_class_to_replicate=...)`
with a `DynamicLayer` subclass. Full-attention layers only (no sliding-window layers).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from ..kernels import lowbit_quant as lq

__all__ = ["LowBitCache", "LowBitLayer", "PackedKV", "CACHE_FORMATS"]

CACHE_FORMATS = ("fp8", "mxfp4", "nvfp4")
aten = torch.ops.aten


class _Store:
    """Growable quantized storage for one of K or V: data/row/block buffers `[B, Hkv, capacity, ...]`.
    `decode_layout`: FP4 bytes kept in `lowbit_quant.recode_for_decode`'s layout (cheaper for the decode kernel)."""

    def __init__(self, fmt: str, decode_layout: bool = False):
        self.fmt = fmt
        self.code_layout = "decode" if decode_layout and fmt in ("mxfp4", "nvfp4") else "nibbles"
        self.data = self.row = self.block = None
        self.length = 0
        self.head_dim = None

    def _grow(self, qr: lq.QuantizedRows, need: int):
        cap = 0 if self.data is None else self.data.shape[2]
        if need <= cap:
            return
        new_cap = max(need, 2 * cap, 64)

        def grow(old, like):
            if like is None:
                return None
            buf = torch.zeros(*like.shape[:2], new_cap, *like.shape[3:], dtype=like.dtype, device=like.device)
            if old is not None and self.length:
                buf[:, :, : self.length] = old[:, :, : self.length]
            return buf

        self.data, self.row, self.block = grow(self.data, qr.data), grow(self.row, qr.scale), \
            grow(self.block, qr.block_scale)

    def append(self, x: torch.Tensor):
        """x `[B, Hkv, S, D]`."""
        qr = lq.quantize_rows(x, self.fmt, check=False)
        self.head_dim = x.shape[-1]
        n = x.shape[2]
        self._grow(qr, self.length + n)
        sl = slice(self.length, self.length + n)
        self.data[:, :, sl] = qr.data if self.code_layout == "nibbles" else lq.recode_for_decode(qr.data)
        if qr.scale is not None:
            self.row[:, :, sl] = qr.scale
        if qr.block_scale is not None:
            self.block[:, :, sl] = qr.block_scale
        self.length += n

    def rows(self) -> lq.QuantizedRows:
        n = self.length
        data = self.data[:, :, :n]
        if self.code_layout == "decode":
            data = lq.recode_from_decode(data)
        return lq.QuantizedRows(self.fmt, data, None if self.row is None else self.row[:, :, :n],
                                None if self.block is None else self.block[:, :, :n], self.head_dim)

    def dequantize(self, dtype) -> torch.Tensor:
        return lq.dequantize_rows(self.rows(), dtype)

    def kernel_view(self):
        """`(data, row_scale, block_scale)` buffers for `lowbit_decode` (capacity-sized; length tracked apart)."""
        return self.data, self.row, self.block

    def apply(self, fn):
        for name in ("data", "row", "block"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, fn(t))


class PackedKV(torch.Tensor):
    """Stand-in for a `[B, Hkv, L, D]` key or value tensor (or its `transpose(1, 2)`) backed by a `_Store`.
    Any operation other than transpose/detach/alias dequantizes it first, so it is always safe to use."""

    @staticmethod
    def __new__(cls, store: _Store, dtype, transposed: bool = False):
        b, h = store.data.shape[:2]
        shape = (b, h, store.length, store.head_dim)
        if transposed:
            shape = (b, store.length, h, store.head_dim)
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=store.data.device)
        t.store, t.transposed = store, transposed
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self):
        return f"PackedKV({self.store.fmt}, shape={tuple(self.shape)}, transposed={self.transposed})"

    def packed_cache_view(self):
        """`(fmt, (data, row, block), length, transposed, code_layout)` for the decode kernel."""
        return self.store.fmt, self.store.kernel_view(), self.store.length, self.transposed, self.store.code_layout

    def materialize(self) -> torch.Tensor:
        x = self.store.dequantize(self.dtype)
        return x.transpose(1, 2) if self.transposed else x

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.transpose.int and isinstance(args[0], PackedKV) and sorted(args[1:3]) == [1, 2]:
            return PackedKV(args[0].store, args[0].dtype, not args[0].transposed)
        if func in (aten.detach.default, aten.alias.default) and isinstance(args[0], PackedKV):
            return PackedKV(args[0].store, args[0].dtype, args[0].transposed)

        def unwrap(x):
            return x.materialize() if isinstance(x, PackedKV) else x

        args = tuple(torch.utils._pytree.tree_map(unwrap, list(args)))
        kwargs = torch.utils._pytree.tree_map(unwrap, kwargs)
        return func(*args, **kwargs)


class LowBitLayer(DynamicLayer):
    """One layer's FP8/FP4 K/V. `fmt` and `packed_decode` are set on per-cache subclasses."""

    fmt = "fp8"
    packed_decode = False
    is_croppable = True

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.k_store, self.v_store = self._stores()
        self.dtype = None

    def lazy_initialization(self, key_states, value_states=None, *args, **kwargs):
        self.device = key_states.device
        self.dtype = key_states.dtype
        empty = key_states[:, :, :0]
        self.keys, self.values = empty, (value_states if value_states is not None else key_states)[:, :, :0]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.k_store.append(key_states)
        self.v_store.append(value_states)
        if self.packed_decode and key_states.shape[2] == 1:
            return PackedKV(self.k_store, key_states.dtype), PackedKV(self.v_store, value_states.dtype)
        return self.k_store.dequantize(key_states.dtype), self.v_store.dequantize(value_states.dtype)

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.k_store.length

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # Transformers < 5.20 name
        return -1

    def _stores(self):
        return _Store(self.fmt, self.packed_decode), _Store(self.fmt, self.packed_decode)

    def reset(self) -> None:
        self.k_store, self.v_store = self._stores()
        self.keys = self.values = None
        self.is_initialized = False

    def crop(self, n: int) -> None:
        """n < 0: drop the last -n tokens (Transformers 5.24); n >= 0: keep the first n (older meaning)."""
        length = self.get_seq_length()
        keep = max(length + n, 0) if n < 0 else min(n, length)
        self.k_store.length = self.v_store.length = keep

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for s in (self.k_store, self.v_store):
            if s.data is not None:
                s.apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        for s in (self.k_store, self.v_store):
            if s.data is not None:
                s.apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for s in (self.k_store, self.v_store):
            if s.data is not None:
                s.apply(lambda t: t[indices])

    def offload(self):
        for s in (self.k_store, self.v_store):
            if s.data is not None:
                s.apply(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        for s in (self.k_store, self.v_store):
            if s.data is not None and s.data.device != self.device:
                s.apply(lambda t: t.to(self.device, non_blocking=True))


class LowBitCache(DynamicCache):
    """KV cache in FP8 (`"fp8"`) or FP4 (`"mxfp4"`, `"nvfp4"`); pass it to `generate` or forward as `cache`
    (`past_key_values` before Transformers 5.24).
    `packed_decode=True` lets hf_fastpath's low-bit attention read the packed cache in decode steps."""

    def __init__(self, fmt: str = "fp8", *, packed_decode: bool = False):
        if fmt not in CACHE_FORMATS:
            raise ValueError(f"unknown KV cache format {fmt!r}; choose one of {CACHE_FORMATS}")
        self.fmt = fmt
        layer_cls = type(f"LowBitLayer_{fmt}", (LowBitLayer,), {"fmt": fmt, "packed_decode": bool(packed_decode)})
        Cache.__init__(self, layer_class_to_replicate=layer_cls)

    def __iter__(self):  # DynamicCache iterates raw keys/values; ours are quantized
        for layer in self.layers:
            yield layer.k_store.dequantize(layer.dtype), layer.v_store.dequantize(layer.dtype), None

    def __repr__(self):
        return f"LowBitCache(fmt={self.fmt!r}, layers={len(self.layers)}, tokens={self.get_seq_length()})"
