"""Low-precision attention: `fp8_attention` and `fp4_attention`, with the `hf_fastpath.attention.attention` signature.

Forward: Q, K, V quantized per token (scales along the head dim only: causally safe, see
`hf_fastpath.kernels.lowbit_quant`), then the FP8 tensor-core kernel of `hf_fastpath.kernels.lowbit_attention`.
Backward: straight-through: the FlashAttention backward on the unquantized inputs, given the low-precision
forward's out and lse, so training works and gradients are those of attention at the quantized output. Its
products with P and dS (dV = P^T dO, dK = dS^T Q, dQ = dS K) run in the 16-bit dtype (default) or, with
`backward="fp8"`, in e4m3 (what FP4 training on FP4 hardware needs): gradients within 3.6-3.7% (relative) of
float64 on the H200, but 0.33-0.48x the 16-bit backward's speed there (quantizing P and dS every step costs more
than the FP8 tensor cores save; benchmarks/results/lowbit_attention_backward.json).

Where the low-bit kernel cannot serve a call (sliding window, softcap, ALiBi, dropout) the call runs on the bf16
`attention` with a one-time warning. On a CPU without TRITON_INTERPRET=1 a float emulation of the same quantized
arithmetic runs (slow; for accuracy studies).
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch

from ..kernels import lowbit_attention as kla
from ..kernels import lowbit_quant as lq
from ..kernels import row_quant
from ..kernels.common import warn_once
from . import interface, ops
from .params import make_params

Tensor = torch.Tensor

logger = logging.getLogger(__name__)

__all__ = ["fp8_attention", "fp4_attention", "lowbit_attention", "quantize_for_attention"]

def _warn_once(key: str, msg: str) -> None:
    warn_once(__name__, "lowbit:" + key, msg)


def _resolve_p_fp4(p_format: str) -> bool:
    if p_format == "fp4":
        return True
    if p_format == "fp8":
        return False
    if p_format != "auto":
        raise ValueError(f"p_format must be 'auto', 'fp8' or 'fp4', got {p_format!r}")
    # FP4 P would pay only in an MMA whose both operands are block-scaled FP4 (sm_100's kind::mxf4). V's scales lie
    # along the head dim (per token: causally safe), not along P.V's contraction, so V enters that MMA as e4m3 and
    # an FP4 P would run at the FP8 rate anyway: it costs accuracy and ALU and buys nothing on any GPU.
    return False


def _native_fp4_qk(fp4_mma: str, qk_fmt: str, q: torch.Tensor) -> bool:
    """Whether Q.K^T runs as a block-scaled FP4 dot (`tl.dot_scaled`) on packed MXFP4 Q/K."""
    if fp4_mma not in ("auto", "native", "fp8"):
        raise ValueError(f"fp4_mma must be 'auto', 'native' or 'fp8', got {fp4_mma!r}")
    d = q.shape[-1]
    if fp4_mma == "fp8" or qk_fmt != "mxfp4" or d < 32 or d & (d - 1):
        if fp4_mma == "native" and qk_fmt != "fp8":
            _warn_once(f"fp4mma:{qk_fmt}:{d}", f"native FP4 tensor-core attention is built for MXFP4 Q/K with a "
                                               f"power-of-two head dim >= 32 (got {qk_fmt}, head dim {d}); Q.K^T runs "
                                               "on FP8 tensor cores instead")
        return False
    fp4_cores = q.device.type == "cuda" and torch.cuda.get_device_capability(q.device)[0] >= 10
    if fp4_mma == "native" and q.device.type == "cuda" and not fp4_cores:
        # Triton emulates the block-scaled dot there (through bf16: slower), and on the H200 (Triton 3.6) that
        # emulation hit an illegal instruction for some shapes (hd 64, non-causal, 777 tokens)
        _warn_once("fp4mma:emulated", "this GPU has no FP4 tensor cores: Q.K^T runs on FP8 tensor cores "
                                      "(fp4_mma='native' is for sm_100+ GPUs, and the CPU interpreter)")
        return False
    return fp4_mma == "native" or fp4_cores



def quantize_for_attention(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., D]` -> `(e4m3 [..., D], fp32 scale [...])`: fp8 per token, or FP4 values in e4m3 containers."""
    if fmt == "fp8":
        q8, s = lq.quantize_fp8(x, check=False)
    else:
        q8, s = lq.fp4_rows_to_e4m3(lq.quantize_rows(x, fmt, check=False))
    return q8.contiguous(), s.contiguous()


def _forward(q, k, v, fmt, p_fp4, kw, qk_fmt=None, rotate=False, native_fp4=False):
    """Raw forward: `(out, lse)` in the layouts of `reference.attention_forward`. Q and K use `qk_fmt` when given.
    `rotate`: Q, K, V times the orthonormal Hadamard matrix before quantizing (fused into the quantizer where it
    can be), the output times its inverse (itself) after. `native_fp4`: Q/K packed MXFP4 and Q.K^T on FP4 tensor
    cores (see `lowbit_attention`'s `fp4_mma`)."""
    qk_fmt = qk_fmt or fmt
    varlen = kw["cu_seqlens_q"] is not None
    h = hadamard(q.shape[-1], q.device, q.dtype) if rotate else None
    fused = rotate and interface.use_triton(q) and row_quant.can_fuse_rotation(q.shape[-1])
    if rotate and not fused:
        q, k, v = q @ h, k @ h, v @ h
    out, lse = _forward_rotated(q, k, v, fmt, p_fp4, kw, qk_fmt, fused, varlen, native_fp4)
    return (out @ h if rotate and not fused else out), lse  # the fused kernel rotates its output back itself


def _forward_rotated(q, k, v, fmt, p_fp4, kw, qk_fmt, fused, varlen, native_fp4=False):
    if interface.use_triton(q):
        if varlen:
            cu_q, cu_k = kw["cu_seqlens_q"].to(torch.int32), kw["cu_seqlens_k"].to(torch.int32)
            max_q = kw["max_seqlen_q"] or int(torch.diff(cu_q).max())
        else:
            b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
            cu_q = torch.arange(b + 1, device=q.device, dtype=torch.int32) * sq
            cu_k = torch.arange(b + 1, device=q.device, dtype=torch.int32) * sk
            max_q = sq
        qk_out = "mxfp4_packed" if native_fp4 else qk_fmt  # packed codes + E8M0 exponents for the block-scaled dot
        q8, qs = row_quant.quantize_e4m3_rows(q, qk_out, rotate=fused)
        k8, ks = row_quant.quantize_e4m3_rows(k, qk_out, rotate=fused)
        vt8, vs = row_quant.quantize_e4m3_rows(v, fmt, transpose=True, rotate=fused)
        out, lse = kla.lowbit_flash_forward(q8, qs, k8, ks, vt8, vs, cu_seqlens_q=cu_q,
                                            cu_seqlens_k=cu_k, max_seqlen_q=max_q, causal=kw["causal"],
                                            softmax_scale=kw["softmax_scale"], p_fp4=p_fp4, out_dtype=q.dtype,
                                            rotate=fused, key_starts_aligned=not varlen and (
                                                k.shape[0] == 1 or k.shape[1] % 16 == 0))
        if not varlen:
            out = out.view(q.shape)
            lse = lse.view(q.shape[2], q.shape[0], q.shape[1]).permute(1, 0, 2).contiguous()
        return out, lse
    # CPU float emulation, one sequence at a time
    if varlen:
        cq, ck = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
        spans = [(slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])) for i in range(len(cq) - 1)]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
        for sl_q, sl_k in spans:
            o, l = kla.lowbit_attention_emulated(q[sl_q], k[sl_k], v[sl_k], fmt=fmt, causal=kw["causal"],
                                                 softmax_scale=kw["softmax_scale"], p_fp4=p_fp4, qk_fmt=qk_fmt)
            out[sl_q], lse[:, sl_q] = o, l
        return out.to(q.dtype), lse
    outs, lses = zip(*(kla.lowbit_attention_emulated(q[i], k[i], v[i], fmt=fmt, causal=kw["causal"],
                                                      softmax_scale=kw["softmax_scale"], p_fp4=p_fp4, qk_fmt=qk_fmt)
                       for i in range(q.shape[0])))
    return torch.stack(outs).to(q.dtype), torch.stack(lses)


def _packed_decode(q, k, v, softmax_scale, return_lse):
    """One query token per sequence against a packed low-bit KV cache (`[B, 1, H, D]` q, transposed K/V views)."""
    from ..kernels.lowbit_decode import lowbit_decode

    kfmt, kview, length, k_t, k_layout = k.packed_cache_view()
    _, vview, _, v_t, v_layout = v.packed_cache_view()
    if not (k_t and v_t):
        raise ValueError("packed K/V must be given in the [B, S, H, D] layout (transpose(1, 2) of the cache)")
    if k_layout != v_layout:
        raise ValueError(f"packed K and V code layouts differ ({k_layout} / {v_layout})")
    out, lse = lowbit_decode(q[:, 0], kview, vview, length, fmt=kfmt, softmax_scale=softmax_scale,
                             code_layout=k_layout)
    out = out[:, None]
    return (out, lse[:, :, None]) if return_lse else out


@torch.library.custom_op("hf_fastpath::lowbit_attn_forward", mutates_args=())
def _lowbit_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
               max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float, fmt: str, p_fp4: bool,
               qk_fmt: str, rotate: bool, native_fp4: bool, fp8_backward: bool) -> tuple[Tensor, Tensor]:
    """The low-bit forward as one op (torch.compile sees through it by its fake implementation)."""
    kw = dict(causal=causal, softmax_scale=softmax_scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
              max_seqlen_q=max_seqlen_q or None, max_seqlen_k=max_seqlen_k or None, window_size=(-1, -1),
              softcap=0.0, alibi_slopes=None)
    return _forward(q, k, v, fmt, p_fp4, kw, qk_fmt, rotate, native_fp4)


@_lowbit_op.register_fake
def _(q, k, v, cu_seqlens_q, *args):
    lse_shape = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


def _lowbit_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, *_, fp8_backward = inputs
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k)
    ctx.args = (max_q, max_k, causal, scale, fp8_backward)
    ctx.mark_non_differentiable(output[1])


def _lowbit_backward(ctx, dout, _dlse):
    # straight-through: gradients of attention, evaluated at the low-precision forward's out/lse (the rotation
    # leaves attention unchanged, so the unrotated inputs serve)
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    max_q, max_k, causal, scale, fp8_backward = ctx.args
    if interface.use_triton(q):
        dq, dk, dv = ops.flash_attn_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, None, None, None,
                                             None, causal, scale, -1, -1, 0.0, fp8_backward)
    else:
        if fp8_backward:
            _warn_once("fp8-backward-cpu", "the FP8 attention backward needs the Triton kernels (a CUDA GPU, or "
                                           "TRITON_INTERPRET=1 on the CPU): this backward runs in full precision")
        dq, dk, dv = interface.attention_backward(dout.contiguous(), q, k, v, out, lse, causal=causal,
                                                  softmax_scale=scale, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    return (dq, dk, dv) + (None,) * 12


_lowbit_op.register_autograd(_lowbit_backward, setup_context=_lowbit_setup)


_HADAMARD: dict = {}


def hadamard(d: int, device, dtype) -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard matrix `[d, d]` (d a power of two)."""
    key = (d, str(device), dtype)
    if key not in _HADAMARD:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _HADAMARD[key] = (h / math.sqrt(d)).to(device=device, dtype=dtype)
    return _HADAMARD[key]


def lowbit_attention(q, k, v, *, fmt="fp8", p_format="auto", rotate=True, causal=False, softmax_scale=None,
                     cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, seqused_k=None, key_mask=None,
                     segments=None, return_lse=False, backend="auto", dropout_p=0.0, qk_format=None, backward="auto",
                     fp4_mma="auto"):
    """Attention with Q/K/V (and P) in `fmt` ("fp8", "mxfp4", "nvfp4"); arguments as `hf_fastpath.attention`.
    `p_format`: "fp8", "fp4" (P mapped to E2M1 with a power-of-two scale per 32 keys inside the softmax), or "auto"
    (= "fp8": with V in e4m3 an FP4 P is no faster on any GPU, see `_resolve_p_fp4`).
    `rotate`: multiply Q, K, V by an orthonormal Hadamard matrix along the head dim before quantizing (and the output
    by its inverse): q.k and P.V are unchanged, outlier channels are spread over all channels, so the per-token
    scales waste less range (as FlashAttention-3's FP8 "incoherent processing"). Per token: still causally safe.
    Only for power-of-two head dims. `backend` is accepted for signature compatibility; the bf16 fallback uses it.
    `qk_format`: quantize Q and K in this format instead of `fmt` (e.g. "fp8" with an FP4 `fmt`: FP4 keys cost
    most of FP4 attention's error, FP4 values little; see benchmarks/results/lowbit_accuracy.json).
    `backward`: "bf16" (the products with P and dS in the inputs' 16-bit dtype; "auto" is this) or "fp8" (in e4m3:
    slower on Hopper, see the module docstring). Both are straight-through.
    `fp4_mma`, for MXFP4 Q/K: "native" computes Q.K^T from the packed codes as one block-scaled FP4 dot
    (`tl.dot_scaled`: FP4 tensor cores on sm_100+; a GPU without them falls back to "fp8" with a one-time warning),
    "fp8" feeds the FP4 values to FP8 tensor cores in e4m3 containers, "auto" picks native on sm_100+. Same numbers
    up to fp32 summation order (the containers drop blocks 2**8 below a row's largest). P.V stays FP8 either way.
    Decoding (at most 16 queries a sequence against a bf16/fp16 KV cache) runs the 16-bit kernel: quantizing the
    whole cache every step would read it more than once. `seqused_k`, `key_mask`, `segments` (see
    `hf_fastpath.attention.attention`) are served by dropping the excluded keys first (one host sync)."""
    if fmt not in lq.FORMATS:
        raise ValueError(f"unknown low-bit format {fmt!r}; choose one of {lq.FORMATS}")
    if backward not in ("auto", "fp8", "bf16"):
        raise ValueError(f"backward must be 'auto', 'fp8' or 'bf16', got {backward!r}")
    fp8_backward = backward == "fp8"
    if qk_format is not None and qk_format not in lq.FORMATS:
        raise ValueError(f"unknown low-bit qk_format {qk_format!r}; choose one of {lq.FORMATS}")
    window_size = tuple(int(w) for w in window_size)
    if hasattr(k, "packed_cache_view"):  # keys/values straight from a LowBitCache(packed_decode=True)
        plain = (window_size == (-1, -1) and not softcap and alibi_slopes is None and not dropout_p
                 and cu_seqlens_q is None and q.dim() == 4 and q.shape[1] == 1
                 and q.shape[-1] >= 16 and (q.shape[-1] & (q.shape[-1] - 1)) == 0)
        if plain and not q.requires_grad:
            return _packed_decode(q, k, v, softmax_scale, return_lse)
        k, v = k.materialize(), v.materialize()
    bf16_kw = dict(causal=causal, softmax_scale=softmax_scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, window_size=window_size, softcap=softcap,
                   alibi_slopes=alibi_slopes, seqused_k=seqused_k, key_mask=key_mask, segments=segments,
                   return_lse=return_lse, backend=backend, dropout_p=dropout_p)
    if cu_seqlens_q is None and q.dim() == 4 and q.shape[1] <= 16 and q.shape[1] < k.shape[1]:
        return interface.attention(q, k, v, **bf16_kw)  # decoding against a 16-bit cache
    unsupported = [name for name, bad in (("sliding window", window_size != (-1, -1)), ("softcap", bool(softcap)),
                                          ("ALiBi", alibi_slopes is not None), ("dropout", bool(dropout_p)))
                   if bad]
    if unsupported:
        _warn_once("fallback:" + ",".join(unsupported),
                   f"{fmt} attention does not support {', '.join(unsupported)}: these calls run in bf16 "
                   "(hf_fastpath.attention.attention) instead.")
        return interface.attention(q, k, v, **bf16_kw)
    d = q.shape[-1]
    if fmt != "fp8" and (d % lq.BLOCK[fmt] or v.shape[-1] != d):
        _warn_once(f"fp4dim:{d}", f"{fmt} needs a head dim that is a multiple of {lq.BLOCK[fmt]} (got {d}); "
                                  "using fp8 attention instead.")
        fmt = "fp8"
    if qk_format not in (None, "fp8") and d % lq.BLOCK[qk_format]:
        qk_format = "fp8"
    if v.shape[-1] != d:
        raise ValueError(f"low-bit attention needs equal q/k/v head dims, got {d}, {k.shape[-1]}, {v.shape[-1]}")
    params = make_params(q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens_q=cu_seqlens_q,
                         cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                         seqused_k=seqused_k, key_mask=key_mask, segments=segments)
    rotate = bool(rotate) and d >= 16 and d & (d - 1) == 0
    native_fp4 = _native_fp4_qk(fp4_mma, qk_format or fmt, q)
    p_fp4 = _resolve_p_fp4(p_format)

    def run(q, k, v, p):
        return _lowbit_op(q, k, v, p.cu_seqlens_q, p.cu_seqlens_k, int(p.max_seqlen_q or 0), int(p.max_seqlen_k or 0),
                          p.causal, p.softmax_scale, fmt, p_fp4, qk_format or fmt, rotate, native_fp4, fp8_backward)

    if params.masks_keys():
        if return_lse:
            raise NotImplementedError("return_lse with seqused_k / key_mask / segments is not supported here.")
        return interface._unpadded(run, q, k, v, params)[0]
    out, lse = run(q, k, v, params)
    return (out, lse) if return_lse else out


def fp8_attention(q, k, v, **kwargs):
    """FP8 (e4m3) attention, per-token scales; see `lowbit_attention`."""
    return lowbit_attention(q, k, v, fmt="fp8", **kwargs)


def fp4_attention(q, k, v, *, fmt="mxfp4", **kwargs):
    """FP4 (E2M1) attention with MXFP4 (default) or NVFP4 block scales; see `lowbit_attention`."""
    if fmt not in ("mxfp4", "nvfp4"):
        raise ValueError(f"fp4_attention takes fmt='mxfp4' or 'nvfp4', got {fmt!r}")
    return lowbit_attention(q, k, v, fmt=fmt, **kwargs)
