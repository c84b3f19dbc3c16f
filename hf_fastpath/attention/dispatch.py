"""Which kernel `fastpath` runs for a call our Triton kernel serves and torch SDPA or our Gluon kernel (Hopper) could
serve too: the one that measured fastest for the nearest measured kind of call on this GPU architecture.

The tables (`dispatch_sm90.json`, ...) come from `benchmarks/attention_dispatch.py --write-table`: per phase
(`prefill`: forward only, `train`: forward + backward, `decode`: one query, CUDA-graph times, and `decode_eager`,
host time included), head dim, GQA or not, causal or not, batch and key length, the median times of each kernel
(`triton_ms`, `sdpa_ms`, and `gluon_ms` where measured), each called as it runs in a model; rows marked `masked`
time padded and packed batches, rows marked `windowed` sliding windows and soft-capped scores, rows marked `alibi`
ALiBi (`benchmarks/gluon_attention_masked.py`), rows marked `varlen` varlen calls whose queries and keys are packed
differently (`benchmarks/gluon_attention_varlen.py`). A call takes the rows with the same phase, causality and kind
(a windowed or ALiBi call without such rows of its phase and causality: the masked ones, then the plain ones; a
masked or varlen call packed alike: the masked ones, then the plain ones; a varlen call packed differently: only
`varlen` rows, and our Triton kernel without them), then the nearest head dim, GQA-ness, and (in log scale) key
length and batch.
GPUs without a table run our kernel.

SDPA serves only plain calls: no varlen, window, softcap, ALiBi, key mask or static-cache length, and either as
many queries as keys or one query (SDPA's causal mask is top-left aligned).
"""

from __future__ import annotations

import json
import math
import os

import torch

__all__ = ["choose", "fastest", "table_for", "explain"]

_TABLES: dict = {}
_CHOICES: dict = {}


def table_for(capability) -> list | None:
    """The measured rows for a compute capability (None: no table)."""
    if capability is None:
        return None
    name = f"dispatch_sm{capability[0]}{capability[1]}.json"
    if name not in _TABLES:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
        _TABLES[name] = json.load(open(path))["rows"] if os.path.exists(path) else None
    return _TABLES[name]


def phase_of(req) -> str:
    if req.q_len == 1 and req.kv_len > 1:
        return "decode"
    return "train" if req.train else "prefill"


def cuda_half_unsupported(req) -> str | None:
    """What the flash kernels and SDPA's fast paths all need: CUDA, float16/bfloat16, equal q/k and v head dims."""
    if req.capability is None:
        return "needs a CUDA device"
    if req.dtype not in (torch.float16, torch.bfloat16):
        return f"needs float16/bfloat16 inputs, got {req.dtype}"
    if req.head_dim != req.head_dim_v:
        return "needs equal q/k and v head dims"
    return None


def sdpa_unsupported(req) -> str | None:
    """Why torch SDPA (as `fastpath` calls it) cannot serve this request, or None."""
    why = cuda_half_unsupported(req)
    if why:
        return why
    for used, what in ((req.varlen, "varlen"), (req.window, "sliding window"), (req.softcap, "softcap"),
                       (req.alibi, "ALiBi"), (req.dropout, "dropout"), (req.lse, "the LSE"),
                       (req.key_mask, "a padding mask or packed sequences"), (req.seqused, "a static-cache length")):
        if used:
            return f"is not used with {what}"
    if req.q_len != req.kv_len and req.q_len != 1:
        return "aligns causal masks top-left (bottom-right needed when queries != keys)"
    return None


def _nearest(rows, key, value, log=False):
    dist = (lambda r: abs(math.log(r[key] / value))) if log else (lambda r: abs(r[key] - value))
    best = min(dist(r) for r in rows)
    return [r for r in rows if dist(r) == best]


def fastest(row, candidates=("sdpa", "gluon")) -> str:
    """The fastest of "triton" and the candidates measured in this table row."""
    times = {name: row.get(f"{name}_ms") for name in ("triton",) + tuple(candidates)}
    return min((t, name) for name, t in times.items() if t is not None)[1]


@torch.compiler.assume_constant_result
def _choose(key) -> str:
    capability, phase, head_dim, gqa, causal, kind, batch, kv_len, candidates = key
    rows = table_for(capability)
    if not rows:
        return "triton"
    rows = [r for r in rows if r["phase"] == phase and (phase.startswith("decode") or r["causal"] == causal)]
    if kind == "varlen":  # queries and keys packed differently: only rows measured so, else our Triton kernel
        rows = [r for r in rows if r.get("varlen")]
        return fastest(_nearest_row(rows, head_dim, gqa, kv_len, batch), candidates) if rows else "triton"
    plain = [r for r in rows if not r.get("masked") and not r.get("windowed") and not r.get("alibi")
             and not r.get("varlen")]
    masked = [r for r in rows if r.get("masked")] or plain
    if kind in ("windowed", "alibi"):
        rows = [r for r in rows if r.get(kind)] or masked
    else:
        rows = masked if kind == "masked" else plain
    if not rows:
        return "triton"
    return fastest(_nearest_row(rows, head_dim, gqa, kv_len, batch), candidates)


def _nearest_row(rows, head_dim, gqa, kv_len, batch):
    rows = _nearest(rows, "head_dim", head_dim)
    rows = _nearest(rows, "gqa", gqa)
    rows = _nearest(rows, "kv_len", max(kv_len, 1), log=True)
    return _nearest(rows, "batch", max(batch, 1), log=True)[0]


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def choose(req, candidates=("sdpa",)) -> str:
    """"triton" or one of `candidates` (backends that can serve this request besides our Triton kernel: "sdpa",
    "gluon"), whichever measured fastest. Eager decoding uses the eager (host time included) figures, compiled code
    the CUDA-graph ones. Lengths and batches are looked up by their power-of-two ceiling, so a growing KV cache does
    not add a cache entry per token."""
    phase = phase_of(req)
    compiling = torch.compiler.is_compiling()
    if phase == "decode" and not compiling:
        phase = "decode_eager"
    kind = ("varlen" if req.varlen and not req.one_packing else "windowed" if req.window or req.softcap
            else "alibi" if req.alibi else "masked" if req.key_mask or req.varlen else "")
    key = (tuple(req.capability), phase, req.head_dim, req.heads > req.kv_heads, req.causal, kind,
           _pow2(req.batch), _pow2(req.kv_len), tuple(candidates))
    if compiling:  # a constant at trace time; filling _CHOICES here would trip the graph's guards on the next call
        return _choose(key)
    choice = _CHOICES.get(key)
    if choice is None:
        choice = _CHOICES[key] = _choose(key)
    return choice


def explain(capability) -> list[str]:
    """One line per measured kind of call: which kernel `fastpath` runs there (for `hf-fastpath env`)."""
    rows = table_for(capability)
    if not rows:
        return ["no measured table for this GPU: fastpath runs hf_fastpath's Triton kernel"]
    out = []
    for r in rows:
        kind = next((f"{k} " for k in ("masked", "windowed", "alibi", "varlen") if r.get(k)), "")
        shape = (f"{r['phase']:7s} {kind}hd{r['head_dim']} {'GQA' if r['gqa'] else 'MHA'} "
                 f"{'causal' if r['causal'] else 'full  '} batch {r['batch']:3d} keys {r['kv_len']:6d}")
        times = ", ".join(f"{n} {r[f'{n}_ms']:.3f} ms" for n in ("triton", "gluon", "sdpa") if r.get(f"{n}_ms"))
        out.append(f"{shape}: {fastest(r):6s} ({times})")
    return out
