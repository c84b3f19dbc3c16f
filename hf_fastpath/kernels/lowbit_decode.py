"""Split-KV decode attention that reads a low-bit KV cache directly (Triton).

One new query token per sequence attends to `kv_len` cached tokens. Grid: (batch x KV head, split); each program
takes the whole GQA group of its KV head (each cached byte is read once per group) and one contiguous slice of the
keys; a second kernel merges the slices by their LSE in fp32.

Cache layout per layer (`fmt` as in `lowbit_quant`): data `[B, Hkv, S_cap, Dq]` (Dq = D for bf16/fp8, D/2 for
packed FP4, bytes as `pack_nibbles` or, `code_layout="decode"`, as `recode_for_decode`), row scales fp32
`[B, Hkv, S_cap]` (fp8, nvfp4), block scales `[B, Hkv, S_cap, D/block]` (FP4).

bf16 / fp8 (`_decode_split_kernel`): every cached value becomes an exact fp16 number in registers (e4m3 directly),
dotted with the fp16 query on tensor cores; the fp32 row factor multiplies the scores and is folded into P.
FP4 (`_decode_fp4_kernel`): the codes go to fp16 with 1.5-2 integer ops per value (PTX bit tricks) and are never
multiplied by their scales: the block scales sit on the MMA rows (see that kernel's docstring).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import lowbit_quant as lq
from .device import num_sms, on_input_device
from .launch import launch_cached
from .split_kv import merge_splits
from .common import cdiv, interpreting, next_pow2

__all__ = ["lowbit_decode", "FMT_CODES"]

FMT_CODES = {"bf16": 0, "fp8": 1, "mxfp4": 2, "nvfp4": 3}
LOG2E = 1.4426950408889634


@triton.jit
def _load_tile(DATA, ROWS, BSC, base_tok, offs_n, n_ok, D: tl.constexpr, FMT: tl.constexpr, BLOCK: tl.constexpr,
               EMULATE: tl.constexpr):
    """Cached rows `offs_n` -> (values [BLOCK_N, D] in the MMA dtype (fp16; bf16 for a bf16 cache; fp32 under the
    interpreter), fp32 row factor [BLOCK_N]) with value * factor = the cached number. FP4 block scales are taken
    relative to the row's largest (powers of two for mxfp4), so every value is exact in fp16."""
    tok = base_tok + offs_n
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    if FMT == 0 or FMT == 1:
        offs_d = tl.arange(0, D)
        x = tl.load(DATA + tok[:, None] * D + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        if EMULATE:
            vals = x.to(tl.float32)
        elif FMT == 1:
            vals = x.to(tl.float16)  # e4m3 -> fp16 is one conversion per pair on sm_89+; bf16 would take three
        else:
            vals = x
        if FMT == 1:
            rs = tl.load(ROWS + tok, mask=n_ok, other=0.0)
        else:
            rs = tl.full([BLOCK_N], 1.0, tl.float32)
    else:
        offs_b = tl.arange(0, D // 2)
        byte = tl.load(DATA + tok[:, None] * (D // 2) + offs_b[None, :], mask=n_ok[:, None], other=0).to(tl.int16)
        codes = tl.reshape(tl.join(byte & 0xF, (byte >> 4) & 0xF), (BLOCK_N, D))
        # E2M1 bits -> fp16 bits: exponent field = e, top mantissa bit = m; that fp16 number is the value / 2**14
        half = (((codes & 7) << 9) | ((codes & 8) << 12)).to(tl.float16, bitcast=True)
        offs_s = tl.arange(0, D // BLOCK)
        sc_ptrs = BSC + tok[:, None] * (D // BLOCK) + offs_s[None, :]
        if FMT == 2:  # E8M0: value = code * 2**(e - 127) = [code * 2**(e - e_max)] * 2**(e_max - 127)
            e = tl.load(sc_ptrs, mask=n_ok[:, None], other=1).to(tl.int32)
            e_max = tl.max(e, 1)
            f = e - e_max[:, None] + 14 + 127  # the extra 2**14 undoes the fp16 bit trick's 2**-14
            mult = tl.where(f >= 1, (tl.maximum(f, 1) << 23).to(tl.float32, bitcast=True), 0.0)
            rs = tl.where(n_ok, (e_max << 23).to(tl.float32, bitcast=True), 0.0)
        else:  # nvfp4: value = code * sb * row_scale; code * sb <= 2688 has <= 6 significant bits
            sb = tl.load(sc_ptrs, mask=n_ok[:, None], other=0.0).to(tl.float32)
            mult = sb
            rs = tl.load(ROWS + tok, mask=n_ok, other=0.0)
        if EMULATE:
            code_val = half.to(tl.float32) * 16384.0
            if FMT == 2:
                code_val = half.to(tl.float32)
            vals = tl.reshape(tl.reshape(code_val, (BLOCK_N, D // BLOCK, BLOCK)) * mult[:, :, None], (BLOCK_N, D))
        elif FMT == 2:
            v3 = tl.reshape(half, (BLOCK_N, D // BLOCK, BLOCK)) * mult.to(tl.float16)[:, :, None]
            vals = tl.reshape(v3, (BLOCK_N, D)).to(tl.float16)
        else:
            code_val = (half * 16384.0).to(tl.float16)
            v3 = tl.reshape(code_val, (BLOCK_N, D // BLOCK, BLOCK)) * mult.to(tl.float16)[:, :, None]
            vals = tl.reshape(v3, (BLOCK_N, D)).to(tl.float16)
    return vals, rs


@triton.jit
def _decode_split_kernel(Q, KD, KR, KB, VD, VR, VB, O_PART, L_PART, kv_len, S_CAP, tokens_per_split, qk_scale,
                         NUM_SPLITS, HQ: tl.constexpr, HKV: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                         FMT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    G: tl.constexpr = HQ // HKV
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    g_ok = offs_g < G
    hq = hk * G + offs_g
    q = tl.load(Q + (b * HQ + hq)[:, None] * D + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    if EMULATE:
        q = q.to(tl.float32)
    elif FMT == 0:
        q = q.to(tl.bfloat16)
    else:  # fp16 MMA; a query beyond fp16's range saturates
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    base_tok = (b * HKV + hk) * S_CAP
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, kv_len)
    acc = tl.zeros([G_PAD, D], dtype=tl.float32)
    m_i = tl.zeros([G_PAD], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    for n0 in tl.range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        k, ks = _load_tile(KD, KR, KB, base_tok, offs_n, n_ok, D, FMT, BLOCK, EMULATE)
        s = tl.dot(q, tl.trans(k)) * (ks * qk_scale)[None, :]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v, vs = _load_tile(VD, VR, VB, base_tok, offs_n, n_ok, D, FMT, BLOCK, EMULATE)
        # V row factors lie along the contraction: fold them into P relative to the block's largest (P' <= 1, no
        # fp16 underflow), and put that largest back on the block's product
        vmax = tl.max(vs, 0)
        w = vs * tl.where(vmax > 0, 1.0 / tl.maximum(vmax, 1e-30), 0.0)
        pv = p * w[None, :]
        acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v) * vmax
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse2 = tl.where(l_i > 0, m_i + tl.math.log2(l_safe), float("-inf"))  # log2 domain
    row = (b * HQ + hq) * NUM_SPLITS + split
    tl.store(O_PART + row[:, None] * D + offs_d[None, :], acc / l_safe[:, None], mask=g_ok[:, None])
    tl.store(L_PART + row, lse2, mask=g_ok)


# E2M1 pairs -> fp16 on the GPU. Input: 4 packed bytes b0..b3 ($4). PRMT puts bytes into the high byte of 16-bit
# lanes ({0, b0, 0, b1}); there the high nibble already has its sign on fp16's sign bit and needs its magnitude
# (e1 e0 m) moved down 3 bits onto fp16's exponent low bits + top mantissa bit; the low nibble moves up 4 bits first.
# The fp16 number is code * 2**-14 (the E2M1 subnormal 0.5 lands on fp16's subnormal 2**-15). Outputs: low nibbles
# of (b0, b1), (b2, b3) in $0, $1 and high nibbles in $2, $3. 2 integer ops per value, no float math.
_E2M1_F16_PTX = tl.constexpr("""{
.reg .b32 x, y, t, u;
prmt.b32 x, $4, 0, 0x1404;
prmt.b32 y, $4, 0, 0x3424;
shr.b32 t, x, 3;
and.b32 t, t, 0x0E000E00;
lop3.b32 $2, x, 0x80008000, t, 0xEA;
shr.b32 t, y, 3;
and.b32 t, t, 0x0E000E00;
lop3.b32 $3, y, 0x80008000, t, 0xEA;
shl.b32 u, x, 4;
shl.b32 t, x, 1;
and.b32 u, u, 0x80008000;
lop3.b32 $0, t, 0x0E000E00, u, 0xEA;
shl.b32 u, y, 4;
shl.b32 t, y, 1;
and.b32 u, u, 0x80008000;
lop3.b32 $1, t, 0x0E000E00, u, 0xEA;
}""")

# The same for the decode byte layout (`lowbit_quant.recode_for_decode`: even element's magnitude in bits 0-2 and
# sign in bit 6, odd element's in bits 3-5 and 7): one shift + one mask gives the even elements, three ops the odd
# ones. 1.5 integer ops per value instead of 2.
_E2M1_F16_RECODED_PTX = tl.constexpr("""{
.reg .b32 x, y, t;
prmt.b32 x, $4, 0, 0x1404;
prmt.b32 y, $4, 0, 0x3424;
shl.b32 t, x, 1;
and.b32 $0, t, 0x8E008E00;
shl.b32 t, y, 1;
and.b32 $1, t, 0x8E008E00;
shr.b32 t, x, 2;
and.b32 t, t, 0x0E000E00;
lop3.b32 $2, x, 0x80008000, t, 0xEA;
shr.b32 t, y, 2;
and.b32 t, t, 0x0E000E00;
lop3.b32 $3, y, 0x80008000, t, 0xEA;
}""")


@triton.jit
def _e2m1_unpack(byte, EMULATE: tl.constexpr, UNPACK: tl.constexpr, RECODED: tl.constexpr):
    """Packed bytes -> (even-element values, odd-element values) of the same shape: fp16 numbers code * 2**-14
    (fp32 under the interpreter). RECODED: bytes in the decode layout of `lowbit_quant.recode_for_decode`."""
    if UNPACK == 1 and not EMULATE:
        if RECODED:
            lo, hi = tl.inline_asm_elementwise(_E2M1_F16_RECODED_PTX, "=r,=r,=r,=r,r", [byte],
                                               dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            lo, hi = tl.inline_asm_elementwise(_E2M1_F16_PTX, "=r,=r,=r,=r,r", [byte],
                                               dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        x = byte.to(tl.int32)
        if RECODED:
            lo = (((x & 7) << 9) | ((x & 0x40) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
            hi = (((x & 0x38) << 6) | ((x & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
        else:
            lo = (((x & 7) << 9) | ((x & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)
            hi = (((x & 0x70) << 5) | ((x & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
        if EMULATE:
            lo = lo.to(tl.float32)
            hi = hi.to(tl.float32)
    return lo, hi


@triton.jit
def _block_scales(BSC, ROWS, tok, n_ok, NB: tl.constexpr, FMT: tl.constexpr):
    """Absolute fp32 scale of every (block, token) `[NB, BLOCK_N]`; 0 for tokens outside the range."""
    offs_b = tl.arange(0, NB)
    ptrs = BSC + tok[None, :] * NB + offs_b[:, None]
    if FMT == 2:  # E8M0 byte e -> 2**(e - 127): the byte is the fp32 exponent field
        e = tl.load(ptrs, mask=n_ok[None, :], other=0).to(tl.int32)
        return (e << 23).to(tl.float32, bitcast=True)
    else:
        sb = tl.load(ptrs, mask=n_ok[None, :], other=0.0).to(tl.float32)
        rs = tl.load(ROWS + tok, mask=n_ok, other=0.0)
        return sb * rs[None, :]


@triton.jit
def _decode_fp4_kernel(Q, KD, KR, KB, VD, VR, VB, O_PART, L_PART, kv_len, S_CAP, tokens_per_split, qk_scale,
                       NUM_SPLITS, HQ: tl.constexpr, HKV: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                       FMT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr,
                       UNPACK: tl.constexpr, RECODED: tl.constexpr):
    """FP4 cache. The MMA rows are (query head, scale block) pairs: row (g, b) holds head g's query restricted to
    block b's dims, so Q_rows . codes gives each block's partial score; the block scales then multiply [rows, keys]
    partials (once per block, not once per value) and a sum over b gives the score. For P.V, row (g, b) of P
    carries the V scales of block b, and only block b's output columns of that row are kept. The padding rows a
    4-head GQA group would waste in a 16-row MMA carry the blocks instead. Codes are split by nibble (even / odd
    head dims) so unpacking never reorders values: two dots of D/2 each."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    G: tl.constexpr = HQ // HKV
    NB: tl.constexpr = D // BLOCK
    R: tl.constexpr = G_PAD * NB
    DH: tl.constexpr = D // 2
    BB: tl.constexpr = BLOCK // 2  # packed bytes per scale block
    offs_r = tl.arange(0, R)  # row r = (block b, head g) with r = b * G_PAD + g
    r_g = offs_r % G_PAD
    r_b = offs_r // G_PAD
    offs_j = tl.arange(0, DH)
    offs_nb = tl.arange(0, NB)
    q_ok = (r_g < G)[:, None] & ((offs_j // BB)[None, :] == r_b[:, None])
    q_ptr = Q + (b * HQ + hk * G + r_g)[:, None] * D + 2 * offs_j[None, :]
    q_lo = tl.load(q_ptr, mask=q_ok, other=0.0).to(tl.float32)
    q_hi = tl.load(q_ptr + 1, mask=q_ok, other=0.0).to(tl.float32)
    if not EMULATE:  # fp16 MMA; a query beyond fp16's range saturates
        q_lo = tl.minimum(tl.maximum(q_lo, -65504.0), 65504.0).to(tl.float16)
        q_hi = tl.minimum(tl.maximum(q_hi, -65504.0), 65504.0).to(tl.float16)
    base_tok = (b * HKV + hk) * S_CAP
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, kv_len)
    acc_lo = tl.zeros([R, DH], dtype=tl.float32)
    acc_hi = tl.zeros([R, DH], dtype=tl.float32)
    m_i = tl.zeros([G_PAD], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    for n0 in tl.range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        tok = base_tok + offs_n
        kb = tl.load(KD + tok[:, None] * DH + offs_j[None, :], mask=n_ok[:, None], other=0)
        k_lo, k_hi = _e2m1_unpack(kb, EMULATE, UNPACK, RECODED)
        s_rows = tl.dot(q_lo, tl.trans(k_lo))
        s_rows = tl.dot(q_hi, tl.trans(k_hi), s_rows)
        ksc = _block_scales(KB, KR, tok, n_ok, NB, FMT)
        # unpacked values are code * 2**-14: the 2**14 rides on the softmax scale
        s = tl.sum(tl.reshape(s_rows, (NB, G_PAD, BLOCK_N)) * ksc[:, None, :], 0) * (qk_scale * 16384.0)
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vb = tl.load(VD + tok[:, None] * DH + offs_j[None, :], mask=n_ok[:, None], other=0)
        v_lo, v_hi = _e2m1_unpack(vb, EMULATE, UNPACK, RECODED)
        vsc = _block_scales(VB, VR, tok, n_ok, NB, FMT)
        # P rows carry the V scales relative to the tile's largest (<= 1: no fp16 overflow); the largest and the
        # codes' 2**14 go back on the product
        vmax = tl.max(tl.max(vsc, 1), 0)
        w = vsc * tl.where(vmax > 0, 1.0 / tl.maximum(vmax, 1e-37), 0.0)
        p_rows = tl.reshape(w[:, None, :] * p[None, :, :], (R, BLOCK_N)).to(v_lo.dtype)
        f = vmax * 16384.0
        alpha_rows = tl.reshape(tl.broadcast_to(alpha[None, :], (NB, G_PAD)), (R,))
        acc_lo = acc_lo * alpha_rows[:, None] + tl.dot(p_rows, v_lo) * f
        acc_hi = acc_hi * alpha_rows[:, None] + tl.dot(p_rows, v_hi) * f
        m_i = m_new
    # row (g, b) is right only on block b's columns
    keep = (offs_j // BB)[None, None, :] == offs_nb[:, None, None]
    o_lo = tl.sum(tl.where(keep, tl.reshape(acc_lo, (NB, G_PAD, DH)), 0.0), 0)
    o_hi = tl.sum(tl.where(keep, tl.reshape(acc_hi, (NB, G_PAD, DH)), 0.0), 0)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse2 = tl.where(l_i > 0, m_i + tl.math.log2(l_safe), float("-inf"))  # log2 domain
    offs_g = tl.arange(0, G_PAD)
    g_ok = offs_g < G
    row = (b * HQ + hk * G + offs_g) * NUM_SPLITS + split
    o_ptr = O_PART + row[:, None] * D + 2 * offs_j[None, :]
    tl.store(o_ptr, o_lo / l_safe[:, None], mask=g_ok[:, None])
    tl.store(o_ptr + 1, o_hi / l_safe[:, None], mask=g_ok[:, None])
    tl.store(L_PART + row, lse2, mask=g_ok)


# Launch settings; benchmarks/lowbit_attention.py --sweep times candidates on the H200. `waves`: programs per SM
# wanted from the key splits (decode is memory bound: enough loads in flight hide the latency).
# FP4 caches: `fp4_kernel` "rows" (block scales on the MMA rows, `_decode_fp4_kernel`) or "tile" (every value
# scaled in registers, `_decode_split_kernel`); `unpack` 1 = PTX bit trick, 0 = Triton integer ops.
DECODE_CONFIG = {"waves": 2, "min_tokens_per_split": 256, "block_n": None, "num_warps": 4, "num_stages": 3,
                 "fp4_kernel": "rows", "unpack": 1}
# H200 sweep winners of the rows kernel (benchmarks/results/lowbit_attention_decode.json): small 2-warp programs,
# many per SM (2 x 64 keys x 64 packed bytes per step)
DECODE_FORMAT_DEFAULTS = {"mxfp4": {"block_n": 64, "num_warps": 2, "num_stages": 3, "waves": 8},
                          "nvfp4": {"block_n": 64, "num_warps": 2, "num_stages": 3, "waves": 4}}
DECODE_CONFIG_OVERRIDE: dict = {}  # fmt -> dict with any of the keys above


def _settings(fmt: str) -> dict:
    return {**DECODE_CONFIG, **DECODE_FORMAT_DEFAULTS.get(fmt, {}), **DECODE_CONFIG_OVERRIDE.get(fmt, {})}


def _num_splits(programs: int, kv_len: int, block_n: int, device, cfg=DECODE_CONFIG) -> int:
    if interpreting() or device.type != "cuda":
        return max(1, min(4, cdiv(kv_len, block_n)))
    sms = num_sms(device)
    want = max(1, int(cfg["waves"] * sms) // max(programs, 1))
    return max(1, min(want, cdiv(kv_len, cfg["min_tokens_per_split"]), 256))


@on_input_device
def lowbit_decode(q, k_cache, v_cache, kv_len, *, fmt, softmax_scale=None, num_splits=None, block_n=None,
                  code_layout="nibbles"):
    """One decode step. q `[B, Hq, D]`; `k_cache`/`v_cache` are `(data, row_scale|None, block_scale|None)` in the
    layout of the module docstring; `kv_len` valid tokens (the same for every sequence). FP4 `code_layout`:
    "nibbles" (`lowbit_quant.pack_nibbles`) or "decode" (`lowbit_quant.recode_for_decode`, cheaper to unpack).
    Returns out `[B, Hq, D]` (q's dtype) and lse `[B, Hq]` fp32."""
    b, hq, d = q.shape
    kd, kr, kb = k_cache
    vd, vr, vb = v_cache
    if code_layout not in ("nibbles", "decode"):
        raise ValueError(f"code_layout must be 'nibbles' or 'decode', got {code_layout!r}")
    recoded = code_layout == "decode" and fmt in ("mxfp4", "nvfp4")
    hkv, s_cap = kd.shape[1], kd.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if d & (d - 1) or d < 16:
        raise ValueError(f"decode kernel needs a power-of-two head dim >= 16, got {d}")
    code = FMT_CODES[fmt]
    block = {"mxfp4": 32, "nvfp4": 16}.get(fmt, 32)
    g = hq // hkv
    g_pad = max(16, next_pow2(g))
    cfg = _settings(fmt)
    if block_n is None:
        block_n = 32 if interpreting() else (cfg["block_n"] or (64 if d > 128 else 128))
    splits = num_splits or _num_splits(b * hkv, kv_len, block_n, q.device, cfg)
    per_split = cdiv(cdiv(max(kv_len, 1), splits), block_n) * block_n
    splits = max(1, cdiv(max(kv_len, 1), per_split))
    o_part = torch.empty(b * hq * splits, d, dtype=torch.float32, device=q.device)
    l_part = torch.empty(b * hq * splits, dtype=torch.float32, device=q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    dummy = l_part
    q = q.contiguous()
    rows_kernel = code >= 2 and d >= 32 and (cfg["fp4_kernel"] == "rows" or recoded)
    if recoded and not rows_kernel:  # only the rows kernel reads the decode layout: back to nibbles (slow path)
        kd, vd = lq.recode_from_decode(kd), lq.recode_from_decode(vd)
    # one decode step per layer and token: the launches skip Triton's per-call argument handling (kernels/launch.py)
    args = (q, kd, kr if kr is not None else dummy, kb if kb is not None else dummy, vd,
            vr if vr is not None else dummy, vb if vb is not None else dummy, o_part, l_part, kv_len, s_cap,
            per_split, scale * LOG2E, splits)
    common = dict(HQ=hq, HKV=hkv, D=d, FMT=code, BLOCK=block, BLOCK_N=block_n, EMULATE=interpreting())
    stages = 1 if interpreting() else cfg["num_stages"]
    if rows_kernel:
        nb = d // block
        meta = dict(common, G_PAD=max(next_pow2(g), cdiv(16, nb)), UNPACK=cfg["unpack"], RECODED=recoded,
                    num_warps=cfg["num_warps"], num_stages=stages)
        launch_cached(_decode_fp4_kernel, (b * hkv, splits), args, meta)
    else:
        meta = dict(common, G_PAD=g_pad, num_warps=cfg["num_warps"], num_stages=stages)
        launch_cached(_decode_split_kernel, (b * hkv, splits), args, meta)
    out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, dtype=torch.float32, device=q.device)
    merge_splits(o_part, l_part, out.view(b, 1, hq, d), lse.view(b, hq, 1), num_splits=splits,
                 part_strides=(d, splits * d), lse_part_strides=(1, splits), lse_log2=True)
    return out, lse
