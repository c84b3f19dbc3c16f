"""Plain-PyTorch attention: the definition every kernel is tested against, and the CPU path.

Semantics (shared by every backend, FlashAttention-2 conventions):
- layout `[B, S, H, D]` (dense) or `[T, H, D]` with `cu_seqlens_q/k` (varlen, sequences packed back to back);
- GQA/MQA: query head `h` reads key/value head `h // (Hq // Hkv)`;
- scores `s = scale * q.k`; with `softcap > 0`, `s = softcap * tanh(s / softcap)`;
  with ALiBi, `s += -slope[h] * |i + Sk - Sq - j|`;
- causal is bottom-right aligned: query `i` sees key `j` iff `j <= i + Sk - Sq`;
  `window_size=(left, right)` (-1 = unbounded) keeps `i + Sk - Sq - left <= j <= i + Sk - Sq + right`;
- `seqused_k` (int `[B]`, dense): sequence b's keys are its first `seqused_k[b]` slots (a static KV cache); the
  other slots do not exist, and `Sk` above is `seqused_k[b]`;
- `key_mask` (`[B, Sk]`, dense): key j of sequence b is attended only where `key_mask[b, j] > 0` (padding);
- `segments` (`kernels.flash_attention.segment_table`, dense, Sq == Sk): packed sequences; query i sees key j only
  if both lie in the same sequence (plane 0 of the table);
- `lse` is the natural log-sum-exp of the masked scores, fp32, `[B, Hq, Sq]` (dense) or `[Hq, T]` (varlen);
- a query row that sees no key returns zeros and `lse = -inf`, never NaN.
"""

from __future__ import annotations

import math

import torch

__all__ = ["attention_forward", "attention_backward", "visible_mask"]


def visible_mask(sq: int, sk: int, causal: bool, window_size=(-1, -1), device=None) -> torch.Tensor | None:
    """Bool `[sq, sk]`: True where query i may see key j (bottom-right aligned). None when all visible."""
    left, right = window_size
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left < 0 and right < 0:
        return None
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        keep &= j <= i + right
    if left >= 0:
        keep &= j >= i - left
    return keep


def _scores(q, k, scale, softcap, alibi_slopes, causal, window_size):
    """q `[Hq,Sq,D]`, k `[Hq,Sk,D]` (already expanded) -> raw scores, capped scores, visibility mask."""
    sq, sk = q.shape[1], k.shape[1]
    raw = torch.einsum("hqd,hkd->hqk", q, k) * scale
    s = softcap * torch.tanh(raw / softcap) if softcap > 0 else raw
    if alibi_slopes is not None:
        i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        j = torch.arange(sk, device=q.device)[None, :]
        s = s - alibi_slopes.to(s.dtype)[:, None, None] * (i - j).abs().to(s.dtype)
    keep = visible_mask(sq, sk, causal, window_size, q.device)
    return raw, s, keep


def _with_key_mask(keep, key_ok, sq):
    """key_ok: bool [Sk] (padding) or [Sq, Sk] (packed segments)."""
    if key_ok is None:
        return keep
    key_ok = key_ok.expand(sq, -1) if key_ok.dim() == 1 else key_ok
    return key_ok if keep is None else keep & key_ok


def _one_sequence_forward(q, k, v, scale, causal, window_size, softcap, alibi_slopes, key_ok=None):
    """q `[Sq,Hq,D]`, k/v `[Sk,Hkv,D]` in the compute dtype -> out `[Sq,Hq,D]`, lse `[Hq,Sq]`."""
    hq, hkv = q.shape[1], k.shape[1]
    rep = hq // hkv
    qh = q.transpose(0, 1)
    kh = k.transpose(0, 1).repeat_interleave(rep, 0)
    vh = v.transpose(0, 1).repeat_interleave(rep, 0)
    _, s, keep = _scores(qh, kh, scale, softcap, alibi_slopes, causal, window_size)
    keep = _with_key_mask(keep, key_ok, q.shape[0])
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for rows that see nothing
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe_lse[..., None])  # exp(-inf) = 0 on masked entries and empty rows
    out = torch.einsum("hqk,hkd->hqd", p, vh)
    return out.transpose(0, 1), lse


def _one_sequence_backward(do, q, k, v, out, lse, scale, causal, window_size, softcap, alibi_slopes, key_ok=None):
    """Analytic gradients from the given (possibly globally merged) out and lse, as FlashAttention does."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    rep = hq // hkv
    qh = q.transpose(0, 1)
    kh = k.transpose(0, 1).repeat_interleave(rep, 0)
    vh = v.transpose(0, 1).repeat_interleave(rep, 0)
    doh, oh = do.transpose(0, 1), out.transpose(0, 1)
    raw, s, keep = _scores(qh, kh, scale, softcap, alibi_slopes, causal, window_size)
    keep = _with_key_mask(keep, key_ok, q.shape[0])
    safe_lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)
    p = torch.exp(s - safe_lse[..., None])  # rows with lse=-inf contribute nothing
    if keep is not None:
        p = p.masked_fill(~keep, 0.0)
    dv = torch.einsum("hqk,hqd->hkd", p, doh)
    dp = torch.einsum("hqd,hkd->hqk", doh, vh)
    delta = (doh * oh).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    if softcap > 0:
        ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
    dq = torch.einsum("hqk,hkd->hqd", ds, kh) * scale
    dk = torch.einsum("hqk,hqd->hkd", ds, qh) * scale
    sk = k.shape[0]
    dk = dk.reshape(hkv, rep, sk, d).sum(1)
    dv = dv.reshape(hkv, rep, sk, v.shape[2]).sum(1)
    return dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)


def _sequences(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k=None):
    """Yield (slice_q, slice_k) per sequence for dense (batch) or varlen inputs."""
    if cu_seqlens_q is None:
        used = [k.shape[1]] * q.shape[0] if seqused_k is None else seqused_k.clamp(0, k.shape[1]).tolist()
        for b in range(q.shape[0]):
            yield (b,), (b, slice(0, used[b]))
    else:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for b in range(len(cq) - 1):
            yield (slice(cq[b], cq[b + 1]),), (slice(ck[b], ck[b + 1]),)


def _key_ok(key_mask, segments, b, ik):
    """Which keys of sequence b its queries may see: [Sk] for a key mask, [Sq, Sk] for packed segments."""
    if segments is not None:
        seg = segments[0, b]
        return seg[:, None] == seg[None, :]
    return None if key_mask is None else key_mask[ik] > 0


def _check(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k=None, key_mask=None, segments=None):
    from .params import _check_masks, check_qkv

    check_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k)
    _check_masks(q, k, cu_seqlens_q is not None, seqused_k, key_mask, segments)


def attention_forward(
    q,
    k,
    v,
    *,
    causal=False,
    softmax_scale=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,  # accepted for a uniform signature; the reference does not need them
    max_seqlen_k=None,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    seqused_k=None,
    key_mask=None,
    segments=None,
    compute_dtype=None,
):
    """Reference forward. Returns `(out, lse)`; out in q's dtype, lse fp32. Computes in `compute_dtype`
    (default: float32, or float64 for float64 inputs)."""
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, key_mask, segments)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    cd = compute_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    qc, kc, vc = q.to(cd), k.to(cd), v.to(cd)
    slopes = None if alibi_slopes is None else alibi_slopes.to(cd)
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=cd, device=q.device)
    varlen = cu_seqlens_q is not None
    lse = torch.full((q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1]), float("-inf"),
                     dtype=cd, device=q.device)
    for b, (iq, ik) in enumerate(_sequences(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k)):
        sl = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        key_ok = _key_ok(key_mask, segments, b, ik)
        o, l = _one_sequence_forward(qc[iq], kc[ik], vc[ik], scale, causal, window_size, softcap, sl, key_ok)
        out[iq] = o
        if varlen:
            lse[:, iq[0]] = l
        else:
            lse[b] = l
    return out.to(q.dtype), lse.float() if cd != torch.float64 else lse


def attention_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    *,
    causal=False,
    softmax_scale=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,  # accepted for a uniform signature; the reference does not need them
    max_seqlen_k=None,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    seqused_k=None,
    key_mask=None,
    segments=None,
    grad_dtype=None,
):
    """Reference backward from `out` and `lse` (which may come from a larger, merged attention: ring attention
    passes the global ones). Returns `(dq, dk, dv)` shaped like q, k, v, in `grad_dtype` (default: input dtype)."""
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, key_mask, segments)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    qc, kc, vc, doc, oc, lc = (t.to(cd) for t in (q, k, v, dout, out, lse))
    slopes = None if alibi_slopes is None else alibi_slopes.to(cd)
    dq, dk, dv = torch.zeros_like(qc), torch.zeros_like(kc), torch.zeros_like(vc)
    varlen = cu_seqlens_q is not None
    for b, (iq, ik) in enumerate(_sequences(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k)):
        sl = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        l = lc[:, iq[0]] if varlen else lc[b]
        key_ok = _key_ok(key_mask, segments, b, ik)
        g = _one_sequence_backward(doc[iq], qc[iq], kc[ik], vc[ik], oc[iq], l, scale, causal, window_size,
                                   softcap, sl, key_ok)
        dq[iq], dk[ik], dv[ik] = g
    gd = grad_dtype or q.dtype
    return dq.to(gd), dk.to(gd), dv.to(gd)
