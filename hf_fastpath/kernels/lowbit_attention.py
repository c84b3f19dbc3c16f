"""FP8 / FP4 FlashAttention forward (Triton), plus a float emulation of the same quantized arithmetic.

Numerics (one scale per token and head along the head dim everywhere, so a later token never changes an earlier
token's output, and prefill equals token-by-token decode up to rounding):
- Q, K: e4m3 values with one fp32 scale per token; S = (Q8 K8^T) * q_scale * k_scale * softmax_scale, in fp32.
- Softmax in fp32 (online, exp2). The denominator uses the unquantized fp32 probabilities.
- V: e4m3 with one fp32 scale per token. That scale lies along the PV contraction, so it is folded into P before P
  is quantized: P'_ij = P_ij * v_scale_j * 256 / vmax_i, where vmax_i is the largest V scale among the keys query i
  sees (a prefix max over the sequence: only earlier tokens under causal masking, so causally safe; computed once,
  `_prefix_max_kernel`). The factor 256 / vmax_i is folded into the exponent (one FMA per score), so P' <= 256 fits
  e4m3. P' is rounded to e4m3 (or, with `p_fp4`, to E2M1 with one power-of-two scale per 32 keys, held exactly in
  e4m3) and fed to the FP8 tensor cores.
- FP4 Q/K/V are handed to this kernel already expanded into e4m3 containers (`lowbit_quant.fp4_rows_to_e4m3`):
  every E2M1 value is exact in e4m3, so FP4 numerics run on Hopper's FP8 tensor cores. Or (QK_MX) Q and K come
  packed in MXFP4 (codes + E8M0 scales per 32) and Q.K^T is one `tl.dot_scaled` per key block: on sm_100 Triton 3.6
  builds it as `tcgen05.mma kind::mxf4` (FP4 tensor cores; read off an offline compile: no Blackwell GPU was at
  hand to time it); on Hopper Triton emulates it through bf16 (slower, and on the H200 it hit an illegal
  instruction for one shape), so `fp4_attention` uses the containers there.
- V is passed transposed (`[Hkv, D, T]`, tokens contiguous): Hopper's FP8 MMA wants its second operand K-major.
- `lowp=False` runs the same kernel on bf16/fp16 operands with unit scales (our bf16 baseline).

Speed (H200, see `_CONFIGS`): one warpgroup per program, K/V tiles and the per-token scales by TMA, nothing in the
key loop that reduces across warps. Per element of the score tile the FP8 path does one multiply by the K scale,
the row max, one FMA, exp2, the row sum, one multiply by the V scale and the cast; the two scale multiplies (and
their registers) are what separates it from unit-scale FP8 (640 vs 850 TFLOP/s at hd 128).

Layout: tokens flattened into rows with `cu_seqlens` (dense batches pass `arange(B+1) * S`): q `[Tq, H, D]`,
k `[Tk, Hkv, D]`, vt `[Hkv, D, Tk_pad]`, scales `[T, H]`. Output `[Tq, H, D]` and lse `[H, Tq]` (natural log, fp32).
Causal masking is bottom-right aligned; a row that sees no key gives zeros and lse = -inf.

Under TRITON_INTERPRET=1 FP8 `tl.dot` is not available: operands (exact e4m3 values) are upcast to fp32 there, which
is the exact-product, fp32-accumulate arithmetic the GPU's FP8 MMA approximates; P is rounded to e4m3 with the same
round-to-nearest-even in fp32 arithmetic (the interpreter's own fp8 conversion mis-rounds at binade carries).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import lowbit_quant as lq
from .common import cdiv, interpreting, next_pow2
from .device import on_input_device
from .launch import COMPILE_OPTIONS
from .row_quant import _ceil_exp2, _load_hadamard, _rotate_rows, _round_e4m3_nonneg, hadamard_pm1
from .varlen_gaps import fill_outside_sequences

__all__ = ["lowbit_flash_forward", "lowbit_attention_emulated", "transpose_v", "P_SCALE"]

P_SCALE = 256.0  # probabilities (<= 1) are scaled into e4m3's range before rounding
LOG2E = 1.4426950408889634


@triton.jit
def _round_p_fp4(pv, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """pv >= 0 -> E2M1 grid with one power-of-two scale per 32 keys (ceil_pow2(amax / 6), as lowbit_quant)."""
    pb = tl.reshape(pv, (BLOCK_M, BLOCK_N // 32, 32))
    scale = (_ceil_exp2(tl.max(pb, 2) / 6.0) << 23).to(tl.float32, bitcast=True)
    inv = tl.where(scale > 0, 1.0 / tl.maximum(scale, 1e-30), 0.0)
    a = pb * inv[:, :, None]
    m = 0.5 * ((a > 0.25).to(tl.float32) + (a >= 0.75).to(tl.float32) + (a > 1.25).to(tl.float32)
               + (a >= 1.75).to(tl.float32)) + (a > 2.5).to(tl.float32) + (a >= 3.5).to(tl.float32) \
        + 2.0 * (a > 5.0).to(tl.float32)
    return tl.reshape(m * scale[:, :, None], (BLOCK_M, BLOCK_N))


@triton.jit
def _k_scores(q, qb, K, KB, k_start, k_len, hk, start_n, HKV: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EMULATE: tl.constexpr, USE_TMA: tl.constexpr,
              QK_MX: tl.constexpr):
    """Raw Q.K^T of one key block (K tile by TMA, or pointer loads). QK_MX: q and K are packed MXFP4 (two E2M1
    codes a byte, E8M0 scale per 32 along the head dim, `qb` / KB) and the product is one block-scaled dot
    (`tl.dot_scaled`: FP4 tensor cores on sm_100+; Triton emulates it elsewhere)."""
    if QK_MX:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        rows = (k_start + offs_n) * HKV + hk
        offs_c = tl.arange(0, D // 2)
        offs_b = tl.arange(0, D // 32)
        if MASKED:  # code 0 / exponent 127: zero scores, masked by the caller anyway
            ok = (offs_n < k_len)[:, None]
            k = tl.load(K + rows[:, None] * (D // 2) + offs_c[None, :], mask=ok, other=0)
            kb = tl.load(KB + rows[:, None] * (D // 32) + offs_b[None, :], mask=ok, other=127)
        else:
            k = tl.load(K + rows[:, None] * (D // 2) + offs_c[None, :])
            kb = tl.load(KB + rows[:, None] * (D // 32) + offs_b[None, :])
        # A zero accumulator that Triton cannot prove constant: with none (or a literal zero), Triton 3.6's
        # accumulator-init pass fails to build this dot inside a loop for sm_100 (offline compile).
        zero = tl.full([q.shape[0], BLOCK_N], 0.0, tl.float32) + start_n * 0.0
        qk = tl.dot_scaled(q, qb, "e2m1", tl.trans(k), kb, "e2m1", acc=zero)
    else:  # (one return at the end: Triton 3.6 compiles the code after an early return too)
        if USE_TMA:  # rows past the sequence are other tokens or zeros; the caller masks their scores
            k = K.load([k_start + start_n, hk * D])
        else:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            offs_d = tl.arange(0, D_PAD)
            k_ptrs = K + ((k_start + offs_n)[:, None] * HKV + hk) * D + offs_d[None, :]
            if MASKED:
                k = tl.load(k_ptrs, mask=(offs_n < k_len)[:, None] & (offs_d < D)[None, :], other=0.0)
            elif D == D_PAD:
                k = tl.load(k_ptrs)
            else:
                k = tl.load(k_ptrs, mask=(offs_d < D)[None, :], other=0.0)
        if EMULATE:
            qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        else:
            qk = tl.dot(q, tl.trans(k))
    return qk


@triton.jit
def _ld_global(ptrs, mask, EMULATE: tl.constexpr):
    """Plain global loads into registers. Triton would stage a `tl.load` in the loop through shared memory
    (cp.async), which costs a block-wide barrier per key block; inline assembly is left alone by its pipeliner.
    Masked lanes read a valid address (the caller clamps) and get 0."""
    if EMULATE:
        x = tl.load(ptrs, mask=mask, other=0.0)
    else:
        x = tl.inline_asm_elementwise("ld.global.nc.f32 $0, [$1];", "=r,l", [ptrs], dtype=tl.float32, is_pure=True,
                                      pack=1)
        x = tl.where(mask, x, 0.0)
    return x


@triton.jit
def _token_scales(KS, VS, k_start, k_len, hk, start_n, T_S, HKV: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASKED: tl.constexpr, SCALE_LOAD: tl.constexpr, EMULATE: tl.constexpr):
    """Per-token K and V scales of one key block. SCALE_LOAD 0: `tl.load` from `[T, Hkv]`; 1: TMA descriptors
    over transposed `[Hkv, T_S]` copies; 2: register loads from those copies (indices clamped to them); 3: one TMA
    descriptor over `[Hkv * 2, T_S]` (rows 2h, 2h + 1: K and V scales of KV head h) in KS."""
    if SCALE_LOAD == 1:
        ks = tl.reshape(KS.load([hk, k_start + start_n]), (BLOCK_N,))
        vs = tl.reshape(VS.load([hk, k_start + start_n]), (BLOCK_N,))
    elif SCALE_LOAD == 3:
        ks, vs = tl.split(tl.permute(KS.load([2 * hk, k_start + start_n]), (1, 0)))
    elif SCALE_LOAD == 2:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        idx = hk * T_S + tl.minimum(k_start + offs_n, T_S - 1)
        ks = _ld_global(KS + idx, offs_n < k_len, EMULATE)
        vs = _ld_global(VS + idx, offs_n < k_len, EMULATE)
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if MASKED:
            ks = tl.load(KS + (k_start + offs_n) * HKV + hk, mask=offs_n < k_len, other=0.0)
            vs = tl.load(VS + (k_start + offs_n) * HKV + hk, mask=offs_n < k_len, other=0.0)
        else:
            ks = tl.load(KS + (k_start + offs_n) * HKV + hk)
            vs = tl.load(VS + (k_start + offs_n) * HKV + hk)
    return ks, vs


@triton.jit
def _softmax_pv(acc, l_i, m_i, qk, ks, vs, qs, lv, VT, k_start, k_len, hk, start_n, offs_m, diag, T_K_PAD,
                HKV: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, LOWP: tl.constexpr,
                SCALED: tl.constexpr, P_FP4: tl.constexpr, EMULATE: tl.constexpr, USE_TMA: tl.constexpr,
                K_SCALED: tl.constexpr):
    """Online softmax and P.V of one key block, given its raw scores `qk` and token scales. Per element of the
    [BLOCK_M, BLOCK_N] tile the FP8 path costs one multiply by the key scale, the row max, one FMA (row scale, max
    and V normaliser), exp2, the row sum, one multiply by the V scale and the e4m3 cast: at FP8 MMA rates every extra
    op shows. Nothing here reduces across warps."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    col_ok = offs_n < k_len
    if K_SCALED:
        t = qk * ks[None, :]
    else:
        t = qk
    # scores in the log2 domain are t * qs (qs > 0: the row's Q scale times softmax_scale * log2(e)); the max is
    # taken on t, so scale, max and the per-row V normaliser `lv` fuse into one FMA
    if MASKED:
        vis = col_ok[None, :]
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= offs_m[:, None] + diag)
        t = tl.where(vis, t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(t, 1) * qs)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(t, 1) * qs)
        m_safe = m_new
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(t * qs[:, None] - (m_safe - lv)[:, None])  # = P * 2**lv
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if USE_TMA:
        vt = VT.load([hk * D, k_start + start_n])
        if MASKED and not LOWP:  # a bf16 neighbour could hold inf; quantized values are always finite
            vt = tl.where(col_ok[None, :], vt, tl.zeros_like(vt))
    else:
        offs_d = tl.arange(0, D_PAD)
        v_ptrs = VT + (hk * D + offs_d)[:, None] * T_K_PAD + (k_start + offs_n)[None, :]
        if MASKED:
            vt = tl.load(v_ptrs, mask=(offs_d < D)[:, None] & col_ok[None, :], other=0.0)
        elif D == D_PAD:
            vt = tl.load(v_ptrs)
        else:
            vt = tl.load(v_ptrs, mask=(offs_d < D)[:, None], other=0.0)
    if LOWP:
        if SCALED:  # V's scale lies along the contraction: into P, <= 256 by the choice of lv
            p = p * vs[None, :]
        if P_FP4:
            p = _round_p_fp4(p, BLOCK_M, BLOCK_N)
        if EMULATE:
            acc = tl.dot(_round_e4m3_nonneg(p), tl.trans(vt.to(tl.float32)), acc)
        else:
            acc = tl.dot(p.to(tl.float8e4nv), tl.trans(vt), acc)
    else:
        if EMULATE:
            acc = tl.dot(p.to(vt.dtype).to(tl.float32), tl.trans(vt.to(tl.float32)), acc)
        else:
            acc = tl.dot(p.to(vt.dtype), tl.trans(vt), acc)
    return acc, l_i, m_new


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _prefix_max_kernel(VS, OUT, CU_K, HKV: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[t, h] = max of VS[s, h] over the tokens s <= t of t's sequence (one program per sequence and head)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(CU_K + b)
    end = tl.load(CU_K + b + 1)
    carry = tl.max(tl.zeros([BLOCK], tl.float32), 0)
    for s in tl.range(start, end, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        ok = offs < end
        y = tl.maximum(tl.associative_scan(tl.load(VS + offs * HKV + h, mask=ok, other=0.0), 0, _max_combine), carry)
        tl.store(OUT + offs * HKV + h, y, mask=ok)
        carry = tl.max(y, 0)


@triton.jit
def _lowbit_fwd_kernel(Q, QS, K, KS, VT, VS, VMAX, O, LSE, CU_Q, CU_K, HAD, QB, KB, qk_scale, rot_scale, T_K_PAD,
                       T_Q, T_S,
                       H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                       CAUSAL: tl.constexpr, LOWP: tl.constexpr, SCALED: tl.constexpr, P_FP4: tl.constexpr,
                       ROTATE: tl.constexpr, QK_MX: tl.constexpr,
                       EMULATE: tl.constexpr, USE_TMA: tl.constexpr, SCALE_LOAD: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    if CAUSAL:  # the longest rows (most key blocks) start first: less tail at the end of the grid
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // (H // HKV)
    q_start = tl.load(CU_Q + b)
    q_len = tl.load(CU_Q + b + 1) - q_start
    k_start = tl.load(CU_K + b)
    k_len = tl.load(CU_K + b + 1) - k_start
    m_start = pid_m * BLOCK_M
    if m_start < q_len:
        offs_m = m_start + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        row_ok = offs_m < q_len
        d_ok = offs_d < D
        if QK_MX:  # packed codes and E8M0 block scales (D is a power of two >= 32: no padding)
            q_rows = (q_start + offs_m) * H + h
            q = tl.load(Q + q_rows[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :], mask=row_ok[:, None],
                        other=0)
            qb = tl.load(QB + q_rows[:, None] * (D // 32) + tl.arange(0, D // 32)[None, :], mask=row_ok[:, None],
                         other=127)
        else:
            q = tl.load(Q + ((q_start + offs_m)[:, None] * H + h) * D + offs_d[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            qb = q  # unused
        diag = k_len - q_len  # query i sees key j iff j <= i + diag (bottom-right aligned)
        if SCALED:
            if QK_MX:  # the block scales carry all of Q's and K's scale: no per-token factors
                qs = tl.zeros([BLOCK_M], dtype=tl.float32) + qk_scale
            else:
                qs = tl.load(QS + (q_start + offs_m) * H + h, mask=row_ok, other=1.0) * qk_scale
            # P is scaled by 256 / (largest V scale among the keys the row sees, a prefix max: causally safe), so
            # P * v_scale <= 256 fits e4m3; the floor keeps 2**lv and the row sum finite for all-zero V
            last = tl.minimum(offs_m + diag, k_len - 1) if CAUSAL else tl.zeros_like(offs_m) + (k_len - 1)
            vmax = tl.load(VMAX + (k_start + tl.maximum(last, 0)) * HKV + hk, mask=row_ok & (last >= 0), other=1.0)
            lv = tl.math.log2(256.0 / tl.maximum(vmax, 1e-18))
        else:
            qs = tl.zeros([BLOCK_M], dtype=tl.float32) + qk_scale
            lv = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        if CAUSAL:
            hi = tl.minimum(k_len, m_start + BLOCK_M + diag)
            full = tl.minimum(m_start + diag + 1, k_len)
        else:
            hi = k_len
            full = k_len
        hi = tl.maximum(hi, 0)
        full = tl.maximum((full // BLOCK_N) * BLOCK_N, 0)
        full = tl.minimum(full, hi)
        ks = tl.zeros([BLOCK_N], dtype=tl.float32)  # placeholders when unscaled
        vs = ks
        for start_n in tl.range(0, full, BLOCK_N):
            if SCALED:
                ks, vs = _token_scales(KS, VS, k_start, k_len, hk, start_n, T_S, HKV, BLOCK_N, False, SCALE_LOAD,
                                       EMULATE)
            qk = _k_scores(q, qb, K, KB, k_start, k_len, hk, start_n, HKV, D, D_PAD, BLOCK_N, False, EMULATE,
                           USE_TMA, QK_MX)
            acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, qk, ks, vs, qs, lv, VT, k_start, k_len, hk, start_n, offs_m,
                                        diag, T_K_PAD, HKV, D, D_PAD, BLOCK_M, BLOCK_N, False, CAUSAL, LOWP, SCALED,
                                        P_FP4, EMULATE, USE_TMA, SCALED and not QK_MX)
        for start_n in tl.range(full, hi, BLOCK_N):
            if SCALED:
                ks, vs = _token_scales(KS, VS, k_start, k_len, hk, start_n, T_S, HKV, BLOCK_N, True, SCALE_LOAD,
                                       EMULATE)
            qk = _k_scores(q, qb, K, KB, k_start, k_len, hk, start_n, HKV, D, D_PAD, BLOCK_N, True, EMULATE,
                           USE_TMA, QK_MX)
            acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, qk, ks, vs, qs, lv, VT, k_start, k_len, hk, start_n, offs_m,
                                        diag, T_K_PAD, HKV, D, D_PAD, BLOCK_M, BLOCK_N, True, CAUSAL, LOWP, SCALED,
                                        P_FP4, EMULATE, USE_TMA, SCALED and not QK_MX)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe[:, None]  # acc and l both carry the factor 2**lv
        if ROTATE:  # back from the rotated basis (H is its own inverse up to rot_scale**2), as out @ H would do
            out = _rotate_rows(out.to(O.dtype.element_ty), _load_hadamard(HAD, D), rot_scale, EMULATE)
        lse = tl.where(l_i > 0, (m_i + tl.math.log2(l_safe) - lv) * 0.6931471805599453, float("-inf"))
        tl.store(O + ((q_start + offs_m)[:, None] * H + h) * D + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LSE + h * T_Q + q_start + offs_m, lse, mask=row_ok)


# (BLOCK_M, BLOCK_N, num_warps, num_stages[, scale loading]) per (padded head dim, low precision); measured on the
# H200 with `benchmarks/lowbit_attention.py --sweep` (16k tokens; results/lowbit_attention.json): one warpgroup per
# program and TMA for K/V and the scales win (~1.5x over pointer loads staged through shared memory).
_CONFIGS = {(128, True): (64, 128, 4, 3, "tma_pair"), (128, False): (128, 128, 8, 3),
            (256, True): (64, 64, 4, 2, "tma_pair"), (256, False): (128, 64, 8, 2)}
CONFIG_OVERRIDE: dict = {}  # (d_pad, lowp, p_fp4) -> (BLOCK_M, BLOCK_N, warps, stages); benchmarks sweep this
# "auto": K/V tiles by bulk tensor copies (TMA) on sm_90+ when the layout allows; False/True force it.
USE_TMA = "auto"
# per-token K/V scales in the loop: "tma" (bulk copies from transposed `[Hkv, T]` copies; with TMA K/V only, else
# "load"), "tma_pair" (one bulk copy per block from an interleaved `[Hkv * 2, T]` copy), "load" (Triton's pipelined
# loads through shared memory: a block-wide barrier per key block) or "regs" (plain loads from the transposed
# copies). A 5th entry of a launch config overrides it. H200, hd 128, 64x128 tiles, 16k non-causal: tma_pair 640,
# tma 635-640, load 596, regs 503, regs loaded one block ahead 385, unit scales (no scale work) 849-855 TFLOP/s.
SCALE_LOAD = "tma"
_SCALE_MODES = {"load": 0, "tma": 1, "regs": 2, "tma_pair": 3}
_TMA_FAILED: set = set()  # launch configs whose TMA variant did not fit in shared memory


def _config(d_pad: int, lowp: bool, p_fp4: bool = False):
    if (d_pad, lowp, p_fp4) in CONFIG_OVERRIDE:
        return CONFIG_OVERRIDE[(d_pad, lowp, p_fp4)]
    if interpreting():
        return 32, 32, 4, 1
    return _CONFIGS.get((d_pad, lowp), _CONFIGS[(min(max(d_pad, 128), 256), lowp)])


def _tma_descriptors(k, vt, d, d_pad, block_n):
    """(K, V^T) as 2-D TMA descriptors `[Tk, Hkv*D]` and `[Hkv*D, Tk_pad]`, or None when they cannot be used."""
    if USE_TMA is False or interpreting() or not k.is_cuda or d != d_pad:
        return None
    if USE_TMA != True and torch.cuda.get_device_capability(k.device)[0] < 9:  # noqa: E712 (tri-state)
        return None
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    if not (k.is_contiguous() and vt.is_contiguous()) or k.data_ptr() % 16 or vt.data_ptr() % 16:
        return None
    tk, hkv, _ = k.shape
    t_pad = vt.shape[-1]
    if (t_pad * vt.element_size()) % 16 or (hkv * d * k.element_size()) % 16:
        return None
    kd = TensorDescriptor(k, [tk, hkv * d], [hkv * d, 1], [block_n, d])
    vd = TensorDescriptor(vt, [hkv * d, t_pad], [t_pad, 1], [d, block_n])
    return kd, vd


def transpose_v(v_rows: torch.Tensor) -> torch.Tensor:
    """`[T, Hkv, D]` -> `[Hkv, D, T_pad]` with tokens contiguous (T padded to 16 for aligned rows)."""
    t, hkv, d = v_rows.shape
    t_pad = (t + 15) // 16 * 16
    raw = v_rows.view(torch.uint8) if v_rows.dtype == torch.float8_e4m3fn else v_rows
    out = torch.zeros(hkv, d, t_pad, dtype=raw.dtype, device=raw.device)
    out[:, :, :t] = raw.permute(1, 2, 0)
    return out.view(v_rows.dtype) if v_rows.dtype == torch.float8_e4m3fn else out


@on_input_device
def lowbit_flash_forward(q, q_scale, k, k_scale, vt, v_scale, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         causal=False, softmax_scale=None, p_fp4=False, out_dtype=torch.bfloat16, rotate=False,
                         key_starts_aligned=False):
    """Triton forward. q `[Tq,H,D]`, k `[Tk,Hkv,D]`, vt `[Hkv,D,Tk_pad]` (e4m3 with fp32 `[T,H]` scales, or bf16/fp16
    with scales None); cu_seqlens int32 `[B+1]`. Returns out `[Tq,H,D]` (out_dtype) and lse `[H,Tq]` fp32.
    Packed MXFP4 Q and K (`lowbit_quant.quantize_rows(x, "mxfp4")`): q `[Tq,H,D/2]` and k `[Tk,Hkv,D/2]` uint8 codes
    with their E8M0 block scales `[T,H,D/32]` as q_scale / k_scale (D a power of two >= 32); Q.K^T is then one
    block-scaled FP4 dot (`tl.dot_scaled`) per key block, P.V stays FP8 (vt e4m3).
    `rotate`: q, k and v were quantized in the Hadamard-rotated basis (`quantize_e4m3_rows(..., rotate=True)`);
    the kernel rotates its output back before storing it, as `out @ H` would (a power-of-two head dim >= 32):
    one pass over the output fewer, 2-3% of the call at hd 128 on the H200. (Quantizing a 16-bit q in the kernel
    as well was slower there: the Q rotation raised shared memory from 110 to 134 KB, one program per SM instead
    of two; 0.97 vs 0.73 ms at 4k causal. Building the +-1 matrix in registers from index parity instead of
    loading it was slower too: 0.76 vs 0.73 ms.)
    `key_starts_aligned`: every sequence's keys start at a multiple of 16 tokens (cu_seqlens_k), as in a dense
    batch of such lengths, or one sequence. Only then do K/V^T and the scales load by TMA: a V^T tile must start
    16-byte aligned along the tokens, and elsewhere the launch hit an illegal instruction on the H200 (session 19:
    sequences of 1000 or 777 tokens). Otherwise the kernel loads by pointers (~1.5x slower at 16k tokens)."""
    qk_mx = q.dtype == torch.uint8
    lowp = q.dtype == torch.float8_e4m3fn or qk_mx
    if lowp and (q_scale is None or k_scale is None or v_scale is None):
        raise ValueError("e4m3 inputs need q_scale, k_scale and v_scale")
    d = vt.shape[1]
    if qk_mx:
        _check_mx_operands(q, q_scale, k, k_scale, d, vt.dtype)
    if rotate and (d < 32 or d & (d - 1)):
        raise ValueError(f"rotate needs a power-of-two head dim >= 32, got {d}")
    out, lse = _launch(q, q_scale, k, k_scale, vt, v_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal,
                       softmax_scale, p_fp4, out_dtype, rotate, key_starts_aligned)
    # queries outside every sequence: no program wrote them
    fill_outside_sequences(cu_seqlens_q, (out, 0.0, 0), (lse, float("-inf"), 1))
    return out, lse


def _check_mx_operands(q, q_blocks, k, k_blocks, d, v_dtype):
    if d < 32 or d & (d - 1):
        raise ValueError(f"packed MXFP4 Q/K need a power-of-two head dim >= 32, got {d}")
    if v_dtype != torch.float8_e4m3fn:
        raise ValueError(f"packed MXFP4 Q/K go with an e4m3 V, got {v_dtype}")
    for name, x, xb in (("q", q, q_blocks), ("k", k, k_blocks)):
        if x.dtype != torch.uint8 or x.shape[-1] != d // 2 or xb.dtype != torch.uint8 or \
                tuple(xb.shape) != (*x.shape[:-1], d // 32):
            raise ValueError(f"packed MXFP4 {name} must be uint8 [T, heads, {d // 2}] with uint8 E8M0 block scales "
                             f"[T, heads, {d // 32}]; got {name} {x.dtype} {tuple(x.shape)}, scales "
                             f"{xb.dtype} {tuple(xb.shape)}")


def _launch(q, q_scale, k, k_scale, vt, v_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, softmax_scale,
            p_fp4, out_dtype, rotate=False, key_starts_aligned=False):
    """`lowbit_flash_forward`; e4m3 inputs without scales run with unit scales (benchmarks time the scale work)."""
    tq, h = q.shape[:2]
    d = vt.shape[1]
    hkv = k.shape[1]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hkv})")
    qk_mx = q.dtype == torch.uint8
    lowp = q.dtype == torch.float8_e4m3fn or qk_mx
    scaled = lowp and q_scale is not None
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    if not scale > 0:  # the kernel takes the row max before scaling
        raise ValueError(f"softmax_scale must be positive, got {scale}")
    d_pad = max(32, next_pow2(d))
    cfg = _config(d_pad, lowp, bool(p_fp4) and lowp)
    block_m, block_n, warps, stages = cfg[:4]
    out = torch.empty(tq, h, d, dtype=out_dtype, device=q.device)
    lse = torch.empty(h, tq, dtype=torch.float32, device=q.device)
    batch = cu_seqlens_q.numel() - 1
    grid = (cdiv(max(int(max_seqlen_q), 1), block_m), batch * h)
    dummy = lse  # pointer arguments the kernel does not read
    had = hadamard_pm1(d, q.device, out_dtype if out_dtype in (torch.float16, torch.bfloat16) else torch.float32) \
        if rotate else dummy
    vmax = dummy
    if scaled:
        vmax = torch.empty_like(v_scale)
        _prefix_max_kernel[(batch, hkv)](v_scale, vmax, cu_seqlens_k, HKV=hkv, BLOCK=32 if interpreting() else 1024,
                                         num_warps=4, **COMPILE_OPTIONS)

    def launch(k_arg, ks_arg, v_arg, vs_arg, tma, scale_load, t_s):
        _lowbit_fwd_kernel[grid](
            q, q_scale if scaled else dummy, k_arg, ks_arg, v_arg, vs_arg, vmax, out, lse,
            cu_seqlens_q, cu_seqlens_k, had, q_scale if qk_mx else dummy, k_scale if qk_mx else dummy,
            scale * LOG2E, 1.0 / math.sqrt(d), vt.shape[-1], tq, t_s,
            H=h, HKV=hkv, D=d, D_PAD=d_pad, CAUSAL=bool(causal), LOWP=lowp, SCALED=scaled,
            P_FP4=bool(p_fp4) and lowp, ROTATE=bool(rotate), QK_MX=qk_mx, EMULATE=interpreting(), USE_TMA=tma,
            SCALE_LOAD=scale_load,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **COMPILE_OPTIONS,
        )

    if qk_mx:  # K by pointer loads; the token-scale loader reads V's scales (K's are unused and dropped)
        launch(k, v_scale, vt, v_scale, False, 0, 0)
        return out, lse
    key = (d_pad, q.dtype, cfg)
    desc = None if key in _TMA_FAILED or not key_starts_aligned else _tma_descriptors(k, vt, d, d_pad, block_n)
    mode = _SCALE_MODES[cfg[4] if len(cfg) > 4 else SCALE_LOAD] if scaled else 0
    if mode in (1, 3) and desc is None:
        mode = 0
    t_s = cdiv(k.shape[0], 4) * 4
    if desc is not None and mode in (1, 3):
        if mode == 1:
            sk, sv = (_scale_descriptor(_transposed(x), 1, block_n) for x in (k_scale, v_scale))
        else:
            sk = sv = _scale_descriptor(_transposed(k_scale, v_scale), 2, block_n)
        try:
            launch(desc[0], sk, desc[1], sv, True, mode, t_s)
            return out, lse
        except triton.runtime.errors.OutOfResources:  # staging buffers too large: plain loads instead
            _TMA_FAILED.add(key)
            mode = 0
    ks_arg, vs_arg = (k_scale, v_scale) if scaled else (dummy, dummy)
    if mode == 2:
        ks_arg, vs_arg = _transposed(k_scale), _transposed(v_scale)
    if desc is not None:
        try:
            launch(desc[0], ks_arg, desc[1], vs_arg, True, mode, t_s)
            return out, lse
        except triton.runtime.errors.OutOfResources:
            _TMA_FAILED.add(key)
    launch(k, ks_arg, vt, vs_arg, False, mode, t_s)
    return out, lse


def _transposed(*scales):
    """fp32 `[T, Hkv]` scales -> `[Hkv * n, T_pad]` (the n arrays interleaved per head; T padded to 4: 16-byte
    aligned rows for TMA)."""
    t, hkv = scales[0].shape
    st = torch.zeros(hkv, len(scales), cdiv(t, 4) * 4, dtype=torch.float32, device=scales[0].device)
    for i, x in enumerate(scales):
        st[:, i, :t] = x.t()
    return st.view(hkv * len(scales), -1)


def _scale_descriptor(st, rows, block_n):
    from triton.tools.tensor_descriptor import TensorDescriptor

    n, t_pad = st.shape
    return TensorDescriptor(st, [n, t_pad], [t_pad, 1], [rows, block_n])


def lowbit_attention_emulated(q, k, v, *, fmt="fp8", causal=False, softmax_scale=None, p_fp4=False,
                              lowp_p=True, qk_fmt=None):
    """Float emulation of the quantized arithmetic, one sequence: q `[Sq,H,D]`, k/v `[Sk,Hkv,D]` (any float).
    Quantizes Q/K/V exactly like the kernel path (Q and K in `qk_fmt` when given); P is rounded relative to the
    final row max and the max V scale over visible keys (the kernel uses the running row max, so the two agree up
    to one rounding of P).
    Returns out `[Sq,H,D]` fp32 and lse `[H,Sq]`."""
    sq, h, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)

    def quant(x, f):
        return lq.quantize_fp8(x, check=False) if f == "fp8" else lq.fp4_rows_to_e4m3(lq.quantize_rows(x, f,
                                                                                                      check=False))

    (q8, qs), (k8, ks), (v8, vs) = quant(q, qk_fmt or fmt), quant(k, qk_fmt or fmt), quant(v, fmt)
    rep = h // hkv
    qf = q8.float().transpose(0, 1)
    kf = k8.float().transpose(0, 1).repeat_interleave(rep, 0)
    vf = v8.float().transpose(0, 1).repeat_interleave(rep, 0)
    s = torch.einsum("hqd,hkd->hqk", qf, kf) * qs.t()[:, :, None] * ks.t().repeat_interleave(rep, 0)[:, None, :]
    s = s * scale
    vis = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        vis = torch.arange(sk, device=q.device)[None, :] <= torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    s = s.masked_fill(~vis, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    vsh = vs.t().repeat_interleave(rep, 0)[:, None, :]  # [H, 1, Sk]
    if lowp_p:
        vmax = torch.where(vis, vsh, torch.zeros_like(vsh)).amax(-1, keepdim=True)
        pv = p * vsh * torch.where(vmax > 0, P_SCALE / vmax, torch.zeros_like(vmax))
        if p_fp4:
            pad = (-sk) % 32  # kernel groups keys [32j, 32j + 32) of each sequence
            pb = torch.nn.functional.pad(pv, (0, pad)).reshape(h, sq, -1, 32)
            sc = lq.ceil_pow2(pb.amax(-1) / 6.0)
            inv = torch.where(sc > 0, 1.0 / sc, torch.zeros_like(sc))
            pv = (lq.round_to_e2m1(pb * inv[..., None]) * sc[..., None]).reshape(h, sq, -1)[..., :sk]
        pv = pv.to(torch.float8_e4m3fn).float()
        o = torch.einsum("hqk,hkd->hqd", pv, vf) * vmax / P_SCALE
    else:
        o = torch.einsum("hqk,hkd->hqd", p, vf * vs.t().repeat_interleave(rep, 0)[:, :, None])
    out = o / torch.where(l > 0, l, torch.ones_like(l))
    lse = torch.where(l[..., 0] > 0, m[..., 0] + torch.log(l[..., 0]), torch.full_like(l[..., 0], float("-inf")))
    return out.transpose(0, 1), lse
