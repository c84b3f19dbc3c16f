"""Zigzag ring attention: exact attention over a sequence sharded across a context-parallel process group.

Every rank holds its zigzag shard of Q, K and V (`zigzag.py`). K/V travel once around the ring; at each of the
`world` steps a rank attends its Q to the K/V block it currently holds while the next block is already on its way
(`torch.distributed.batch_isend_irecv`, overlapped with the block's compute). Block results are merged with their
log-sum-exp in fp32 (fp64 for fp64 inputs), so the error does not grow with the world size:

    lse' = logaddexp(lse, b_lse);  out' = exp(lse - lse') * out + exp(b_lse - lse') * b_out

Causal schedule with zigzag shards (rank r holds chunks r and 2w-1-r; at step s it holds K/V of rank src = r - s):
- step 0 (its own K/V): causal attention of the local shard on itself;
- src < r: chunk src is entirely in the past of both local Q chunks, chunk 2w-1-src entirely in their future:
  all of Q against the first half of K/V;
- src > r: only the late local chunk 2w-1-r sees anything, and it sees both chunks of src: second half of Q
  against all of K/V.
So every step after the first costs half a block on every rank: balanced work.

Backward recomputes each block from the GLOBAL (merged) out and LSE; dQ accumulates locally, and the dK/dV partial
sums travel the ring in fp32 behind K/V until they come back to the rank that owns those keys.

Packed batches (`cu_seqlens` of the global batch) use the variable-length kernels per block with the local
`cu_seqlens` (global / world), so no query ever sees another document.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..attention.interface import attention_backward, attention_forward
from .zigzag import check_zigzag_lengths, group_size_and_rank

__all__ = ["ring_attention"]


@dataclass
class _Halves:
    """Where the two zigzag chunks of the local shard sit, for one of the two layouts.

    Dense `[B, S, H, D]` (lse `[B, H, S]`): first half is `[:, :S/2]`. Packed `[T, H, D]` (lse `[H, T]`): the first
    half of every document's local segment, gathered with an index.
    """

    seq_len: int
    cu: torch.Tensor | None = None  # local cu_seqlens (int32), packed only
    max_len: int | None = None
    half_cu: torch.Tensor | None = None  # cu_seqlens of one half of every document
    half_max_len: int | None = None
    first_idx: torch.Tensor | None = None
    second_idx: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        return self.cu is not None

    def seq_dim(self, is_lse: bool) -> int:
        if self.packed:
            return 1 if is_lse else 0
        return 2 if is_lse else 1

    def take(self, x: torch.Tensor, second: bool, is_lse: bool = False) -> torch.Tensor:
        dim = self.seq_dim(is_lse)
        if self.packed:
            return x.index_select(dim, self.second_idx if second else self.first_idx)
        half = self.seq_len // 2
        return x.narrow(dim, half if second else 0, half).contiguous()

    def put(self, acc: torch.Tensor, second: bool, value: torch.Tensor, is_lse: bool = False, add=False) -> None:
        dim = self.seq_dim(is_lse)
        if self.packed:
            idx = self.second_idx if second else self.first_idx
            (acc.index_add_ if add else acc.index_copy_)(dim, idx, value)
        else:
            half = self.seq_len // 2
            view = acc.narrow(dim, half if second else 0, half)
            view.add_(value) if add else view.copy_(value)

    def kernel_kw(self, q_half: bool, k_half: bool) -> dict:
        """cu_seqlens/max_seqlen kwargs for a block whose Q (or K) is one half of the shard."""
        if not self.packed:
            return {}
        return dict(
            cu_seqlens_q=self.half_cu if q_half else self.cu,
            cu_seqlens_k=self.half_cu if k_half else self.cu,
            max_seqlen_q=self.half_max_len if q_half else self.max_len,
            max_seqlen_k=self.half_max_len if k_half else self.max_len,
        )


def _packed_halves(cu_global, world: int, local_len: int, device) -> _Halves:
    cu = torch.as_tensor(cu_global).to("cpu", torch.int64)
    check_zigzag_lengths(int(cu[-1]), world, cu)
    if int(cu[-1]) != local_len * world:
        raise ValueError(
            f"cu_seqlens describes a packed batch of {int(cu[-1])} tokens, but the local shard has {local_len} tokens "
            f"x {world} ranks = {local_len * world}. Pass the cu_seqlens of the GLOBAL (unsharded) packed batch."
        )
    local_cu = cu // world
    half_cu = cu // (2 * world)
    halves = torch.diff(half_cu)
    starts = local_cu[:-1]
    # Token index of every element of the first / second halves, document by document.
    offs = torch.arange(int(half_cu[-1])) - torch.repeat_interleave(half_cu[:-1], halves)
    first = torch.repeat_interleave(starts, halves) + offs
    second = first + torch.repeat_interleave(halves, halves)
    max_half = int(halves.max()) if halves.numel() else 0
    return _Halves(
        seq_len=local_len,
        cu=local_cu.to(device, torch.int32),
        max_len=2 * max_half,
        half_cu=half_cu.to(device, torch.int32),
        half_max_len=max_half,
        first_idx=first.to(device),
        second_idx=second.to(device),
    )


@dataclass
class _Plan:
    group: object
    world: int
    rank: int
    causal: bool
    kernel_kw: dict  # softmax_scale, softcap
    halves: _Halves
    exchange: object = None  # (send, recv) -> requests; None = P2P over the group (benchmarks inject a local copy)

    def peer(self, offset: int) -> int:
        local = (self.rank + offset) % self.world
        return dist.get_global_rank(self.group, local) if self.group is not None else local

    def block(self, step: int) -> str:
        """Which part of the attention matrix step `step` computes: 'diagonal', 'full', 'k_first' or 'q_second'."""
        if step == 0:
            return "diagonal"
        if not self.causal:
            return "full"
        return "k_first" if (self.rank - step) % self.world < self.rank else "q_second"


def _accum_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _send_next_recv_prev(send: torch.Tensor, recv: torch.Tensor, plan: _Plan):
    if plan.exchange is not None:
        return plan.exchange(send, recv)
    ops = [
        dist.P2POp(dist.isend, send, plan.peer(+1), plan.group),
        dist.P2POp(dist.irecv, recv, plan.peer(-1), plan.group),
    ]
    return dist.batch_isend_irecv(ops)


def _wait(reqs) -> None:
    for r in reqs or ():
        r.wait()


def _pack(*ts: torch.Tensor) -> torch.Tensor:
    """One flat buffer (one message per ring step)."""
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(buf: torch.Tensor, like: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    out, o = [], 0
    for t in like:
        out.append(buf[o : o + t.numel()].view(t.shape))
        o += t.numel()
    return out


def _lse_to_out_layout(lse: torch.Tensor, packed: bool) -> torch.Tensor:
    # [B, H, S] -> [B, S, H, 1];  [H, T] -> [T, H, 1]
    return (lse.transpose(0, 1) if packed else lse.transpose(1, 2)).unsqueeze(-1)


def merge_partials(out, lse, b_out, b_lse, packed: bool = False):
    """Merge two partial attention results (out in the accumulator dtype, lse alike). Rows that saw nothing in
    either part (both lse = -inf) stay 0 with lse = -inf, never NaN."""
    new_lse = torch.logaddexp(lse, b_lse)
    safe = new_lse.masked_fill(torch.isneginf(new_lse), 0.0)
    wa = _lse_to_out_layout(torch.exp(lse - safe), packed)
    wb = _lse_to_out_layout(torch.exp(b_lse - safe), packed)
    return wa * out + wb * b_out.to(out.dtype), new_lse


def _block_forward(q, k, v, acc: torch.dtype, **kw):
    """One block's (out, lse), out written in the accumulator dtype: no bf16 rounding of partials before the merge."""
    return attention_forward(q, k, v, out_dtype=acc, **kw)


def _forward(q, k, v, plan: _Plan):
    h = plan.halves
    if plan.world == 1:  # plain attention, no copies
        return attention_forward(q, k, v, causal=plan.causal, **plan.kernel_kw, **h.kernel_kw(False, False))
    acc = _accum_dtype(q)
    out = lse = None
    kv = _pack(k, v)
    for step in range(plan.world):
        reqs = None
        if step + 1 < plan.world:
            nxt = torch.empty_like(kv)
            reqs = _send_next_recv_prev(kv, nxt, plan)
        kb, vb = _unpack(kv, (k, v))
        kind = plan.block(step)
        if kind in ("diagonal", "full"):
            b_out, b_lse = _block_forward(q, kb, vb, acc, causal=plan.causal and kind == "diagonal",
                                          **plan.kernel_kw, **h.kernel_kw(False, False))
            if out is None:
                out, lse = b_out.to(acc), b_lse.to(acc)
            else:
                out, lse = merge_partials(out, lse, b_out, b_lse.to(acc), h.packed)
        elif kind == "k_first":
            b_out, b_lse = _block_forward(q, h.take(kb, False), h.take(vb, False), acc, causal=False,
                                          **plan.kernel_kw, **h.kernel_kw(False, True))
            out, lse = merge_partials(out, lse, b_out, b_lse.to(acc), h.packed)
        else:  # q_second
            b_out, b_lse = _block_forward(h.take(q, True), kb, vb, acc, causal=False,
                                          **plan.kernel_kw, **h.kernel_kw(True, False))
            o2, l2 = merge_partials(h.take(out, True), h.take(lse, True, is_lse=True), b_out, b_lse.to(acc), h.packed)
            h.put(out, True, o2)
            h.put(lse, True, l2, is_lse=True)
        _wait(reqs)
        if reqs is not None:
            kv = nxt
    return out.to(q.dtype), lse


def _backward(dout, q, k, v, out, lse, plan: _Plan):
    h = plan.halves
    if plan.world == 1:
        return attention_backward(dout, q, k, v, out, lse, causal=plan.causal, **plan.kernel_kw,
                                  **h.kernel_kw(False, False))
    acc = _accum_dtype(q)
    gk = dict(grad_dtype=acc, **plan.kernel_kw)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = _pack(k, v)
    dkv_reqs = dkv_in = None
    for step in range(plan.world):
        kv_reqs = None
        if step + 1 < plan.world:
            nxt = torch.empty_like(kv)
            kv_reqs = _send_next_recv_prev(kv, nxt, plan)
        kb, vb = _unpack(kv, (k, v))
        kind = plan.block(step)
        if kind in ("diagonal", "full"):
            bdq, bdk, bdv = attention_backward(dout, q, kb, vb, out, lse, causal=plan.causal and kind == "diagonal",
                                               **gk, **h.kernel_kw(False, False))
            dq += bdq
        elif kind == "k_first":
            bdq, bdk, bdv = attention_backward(dout, q, h.take(kb, False), h.take(vb, False), out, lse,
                                               causal=False, **gk, **h.kernel_kw(False, True))
            dq += bdq
        else:  # q_second
            bdq_h, bdk, bdv = attention_backward(h.take(dout, True), h.take(q, True), kb, vb, h.take(out, True),
                                                 h.take(lse, True, is_lse=True), causal=False, **gk,
                                                 **h.kernel_kw(True, False))
            h.put(dq, True, bdq_h, add=True)
        # The dK/dV sums for the block we hold arrive from the previous rank (which held it one step earlier);
        # ours are added in place, then the sums move on to the next rank.
        _wait(dkv_reqs)
        if dkv_in is None:  # step 0: the diagonal block starts the sums for our own K/V
            dkv = torch.empty(k.numel() + v.numel(), dtype=acc, device=k.device)
            dk_sum, dv_sum = _unpack(dkv, (k, v))
            dk_sum.copy_(bdk)
            dv_sum.copy_(bdv)
        else:
            dkv = dkv_in
            dk_sum, dv_sum = _unpack(dkv, (k, v))
            h.put(dk_sum, False, bdk, add=True) if kind == "k_first" else dk_sum.add_(bdk)
            h.put(dv_sum, False, bdv, add=True) if kind == "k_first" else dv_sum.add_(bdv)
        del bdk, bdv
        dkv_in = torch.empty_like(dkv)
        dkv_reqs = _send_next_recv_prev(dkv, dkv_in, plan)
        _wait(kv_reqs)
        if kv_reqs is not None:
            kv = nxt
    _wait(dkv_reqs)  # after `world` hops the sums for our own K/V are complete and back home
    dk, dv = _unpack(dkv_in, (k, v))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan):
        out, lse = _forward(q, k, v, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, ctx.plan)
        return dq, dk, dv, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    group=None,
    cu_seqlens: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    return_lse: bool = False,
):
    """Exact attention over a sequence sharded across `group` in the zigzag layout (`zigzag_shard`).

    q `[B, S_local, Hq, D]`, k/v `[B, S_local, Hkv, D]` (GQA/MQA: Hq a multiple of Hkv; K/V are never repeated).
    `group`: the context-parallel process group (default: the whole world; world size 1 = plain attention).
    `cu_seqlens`: for a packed batch (B = 1, or `[T_local, H, D]` tensors), the cumulative document lengths of the
    GLOBAL packed batch; every document length must be a multiple of `2 * world` (see `pad_documents_to_multiple`).
    Returns out like q (and the fp32 LSE `[B, Hq, S_local]`, or `[Hq, T_local]` when packed, with `return_lse`).
    Differentiable w.r.t. q, k, v.
    """
    world, rank = group_size_and_rank(group)
    if group is None and world > 1:
        group = dist.group.WORLD
    squeeze = False
    if cu_seqlens is not None and q.dim() == 4:
        if q.shape[0] != 1:
            raise ValueError(f"A packed batch (cu_seqlens given) must have batch size 1, got q {tuple(q.shape)}.")
        q, k, v, squeeze = q[0], k[0], v[0], True
    want = 3 if cu_seqlens is not None else 4
    if q.dim() != want or k.dim() != want or v.dim() != want:
        raise ValueError(
            f"ring_attention expects {'[T, H, D] (or [1, T, H, D]) tensors with cu_seqlens' if want == 3 else '[B, S, H, D] tensors'}, "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}."
        )
    seq_dim = 0 if cu_seqlens is not None else 1
    local_len = q.shape[seq_dim]
    if k.shape[seq_dim] != local_len or v.shape[seq_dim] != local_len:
        raise ValueError(f"q, k and v must hold the same tokens, got q {tuple(q.shape)}, k {tuple(k.shape)}.")
    if cu_seqlens is not None:
        halves = _packed_halves(cu_seqlens, world, local_len, q.device)
    else:
        if world > 1 and local_len % 2:
            raise ValueError(
                f"The local shard has {local_len} tokens; a zigzag shard holds two equal chunks, so it must be even "
                f"(global length a multiple of {2 * world}). Shard with hf_fastpath.parallel.zigzag_shard."
            )
        halves = _Halves(seq_len=local_len)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    plan = _Plan(group, world, rank, causal, dict(softmax_scale=scale, softcap=softcap), halves)
    out, lse = _RingAttention.apply(q, k, v, plan)
    if squeeze:
        out = out.unsqueeze(0)
    return (out, lse) if return_lse else out


def _local_copy_exchange(send: torch.Tensor, recv: torch.Tensor):
    recv.copy_(send)
    return None


def simulate_rank_schedule(q, k, v, *, world: int, rank: int, causal: bool = True, softmax_scale=None):
    """Benchmark helper: run rank `rank`'s share of a `world`-rank ring in this one process, with the K/V (and
    dK/dV) exchange replaced by a local copy. Same kernels, block shapes, merges and copies as the real ring, but the
    blocks hold this rank's own K/V, so the VALUES are not the ring's answer: use it for timing only."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    plan = _Plan(None, world, rank, causal, dict(softmax_scale=scale, softcap=0.0), _Halves(seq_len=q.shape[1]),
                 exchange=_local_copy_exchange)
    return _RingAttention.apply(q, k, v, plan)[0]
