"""Linear + cross-entropy without the full logits: `chunked_linear_cross_entropy(hidden, weight, labels)`.

A causal LM's training loss is cross_entropy(hidden @ weightᵀ + bias, labels). Computed the plain way, the
[tokens, vocab] logits dominate peak memory in fine-tuning: for 8 x 2048 tokens and Llama-3's 128,256-word vocabulary
they are 4.2 GB in bf16, 8.4 GB once up-cast to fp32 for the loss, and as much again for their gradient — more than
the 4-bit weights of an 8B model. Here the rows (tokens) are processed in chunks; for each chunk the logits are
computed, reduced to the loss, turned into their gradient and multiplied back into the gradient of `hidden` (and of
`weight` / `bias` when those require grad), then freed. Only one chunk of logits ever exists. On the GPU a Triton
kernel (one program per row: online max / sum of exp in fp32, then the gradient written over the logits in place)
(`kernels/cross_entropy.py`) makes that chunk, in the matmul dtype, the only [rows, vocab] buffer; the CPU path uses
torch ops on an fp32 copy.
Rows without a target (-100) are dropped before the matmul.

Tensors in, tensors out: no Transformers import here (the Transformers wiring is
`hf_fastpath.integrations.causal_lm_loss`).
"""

from __future__ import annotations


import torch

from .kernels.cross_entropy import cross_entropy_rows_
from .kernels.common import triton_runs_on

__all__ = ["chunked_linear_cross_entropy", "default_chunk_rows", "CHUNK_BYTES"]

# Budget for one chunk of logits counted in fp32, whatever the number of tokens. On the GPU (Triton path) the op's
# [rows, vocab] memory is one chunk in the matmul dtype: 0.5 GiB in bf16 for Llama-3's vocabulary (2048 rows), against
# ~21 GB of bf16 logits, fp32 logits and their gradient for 16k tokens the plain way. The CPU path holds the fp32 chunk
# and a compute-dtype copy (1.5x the budget). Chunks of ~2k rows (at a 128k vocabulary) keep the three GEMMs per chunk
# (logits, grad of hidden, grad of weight if trainable) large enough to run at full speed.
CHUNK_BYTES = 1 << 30


def default_chunk_rows(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk so that one chunk of fp32 logits takes at most `chunk_bytes` (a multiple of 64 rows when
    possible, at least 1)."""
    rows = max(1, chunk_bytes // (4 * max(1, vocab_size)))
    return rows - rows % 64 if rows >= 64 else rows


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    softcap: float | None = None,
    chunk_rows: int | None = None,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T + bias, labels) as a float32 scalar (float64 when computing in float64),
    without materialising all logits.

    hidden: [..., H] (any float dtype); weight: [V, H]; bias: [V] or None; labels: [...] integer (same leading shape
    as hidden), `ignore_index` marks tokens without a target.
    Reduction: the mean over the non-ignored tokens; or, with `num_items_in_batch` (Transformers' gradient-accumulation
    contract), their sum divided by `num_items_in_batch`. No target at all gives a loss of 0 and zero gradients
    (torch's mean would give NaN).
    softcap: Gemma-style final logit soft-capping, logits = softcap * tanh(logits / softcap), before the softmax.
    chunk_rows: tokens per chunk (default `default_chunk_rows(V)`: about 1 GiB of fp32 logits).
    compute_dtype: dtype of the matmuls; default the autocast dtype when autocast is on for hidden's device (as
    nn.Linear would run), else weight's dtype. Log-sum-exp, loss and softmax are computed in float32 (float64 if
    compute_dtype is float64).
    Gradients: hidden's in hidden's dtype, weight's / bias's in theirs; weight's is accumulated chunk by chunk in
    weight's dtype (one rounding per chunk when it is bf16/fp16).
    """
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"hidden [..., {hidden.shape[-1]}] and weight {list(weight.shape)} do not match: weight must "
                         f"be [vocab, {hidden.shape[-1]}] (an nn.Linear weight)")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels {list(labels.shape)} must have hidden's leading shape {list(hidden.shape[:-1])} "
                         "(shift the labels before calling; see hf_fastpath.integrations.causal_lm_loss)")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias {list(bias.shape)} must be [{weight.shape[0]}]")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap}")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if compute_dtype is None:
        device_type = hidden.device.type
        if torch.is_autocast_enabled(device_type):
            compute_dtype = torch.get_autocast_dtype(device_type)
        else:
            compute_dtype = weight.dtype
    return _ChunkedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, labels.reshape(-1).to(hidden.device), ignore_index,
        num_items_in_batch, softcap, chunk_rows or default_chunk_rows(weight.shape[0]), compute_dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The gradients are computed in the forward pass, chunk by chunk, while each chunk's logits exist; backward only
    scales them by the incoming (scalar) gradient.

    Why not save and recompute in backward: recomputing needs the same chunk of logits again (same peak memory) plus a
    fourth [T, H] x [H, V] GEMM per step; computing ahead costs only a [T, H] gradient buffer (what backward would
    allocate anyway). When nothing requires grad (evaluation, torch.no_grad) no gradient is computed."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, num_items_in_batch, softcap, chunk_rows,
                compute_dtype):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        vocab = weight.shape[0]

        # Only rows with a target take part: the last position of every sequence, padding and masked prompts cost
        # nothing (one host sync for the count, which also validates the labels).
        valid = labels != ignore_index
        rows = valid.nonzero().squeeze(1)
        lab = labels.index_select(0, rows)
        n_valid = rows.numel()
        out_of_range = (lab < 0) | (lab >= vocab)
        if n_valid and bool(out_of_range.any()):
            bad = lab[out_of_range][0].item()
            raise IndexError(f"label {bad} is outside the vocabulary [0, {vocab}) and is not ignore_index "
                             f"({ignore_index})")
        # fp32 softmax statistics (fp64 when computing in fp64, for exact references)
        acc_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
        if num_items_in_batch is None:
            scale = 1.0 / n_valid if n_valid else 0.0
        elif torch.is_tensor(num_items_in_batch):  # stays on the device: no host sync
            scale = 1.0 / num_items_in_batch.to(device=hidden.device, dtype=acc_dtype)
        else:
            scale = 1.0 / float(num_items_in_batch)

        w = weight.to(compute_dtype)
        b = bias.to(compute_dtype) if bias is not None else None
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros(vocab, device=weight.device, dtype=acc_dtype) if need_b else None
        total = torch.zeros((), device=hidden.device, dtype=acc_dtype)

        scale_t = torch.as_tensor(scale, dtype=acc_dtype, device=hidden.device).reshape(1)
        # Explicit dtypes inside: autocast would otherwise re-cast the operands of every matmul.
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n_valid, chunk_rows):
                idx = rows[start:start + chunk_rows]
                target = lab[start:start + chunk_rows]
                h = hidden.index_select(0, idx).to(compute_dtype)
                logits = h @ w.t() if b is None else torch.addmm(b, h, w.t())
                loss_rows, g = _rows_loss_and_grad(logits, target, scale_t, softcap, need_h or need_w or need_b)
                del logits
                total += loss_rows.sum(dtype=acc_dtype)
                if g is None:
                    continue
                if need_h:
                    grad_h.index_copy_(0, idx, (g @ w).to(hidden.dtype))
                if need_w:
                    grad_w.addmm_(g.t().to(weight.dtype), h.to(weight.dtype))
                if need_b:
                    grad_b += g.sum(0, dtype=grad_b.dtype)
                del g, h

        # Kept as attributes, not saved tensors: they are results of this function, not inputs to re-read.
        ctx.grads = (grad_h, grad_w, grad_b.to(bias.dtype) if need_b else None)
        return total * scale_t[0]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("chunked_linear_cross_entropy computes its gradients in the forward pass and hands them "
                               "out once: a second backward through the same loss (retain_graph=True) is not supported; "
                               "run the forward again")
        grads, ctx.grads = ctx.grads, None
        # Scaled in place (no second [T, H] buffer); loss.backward() passes 1.0.
        out = [None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads]
        return out[0], out[1], out[2], None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------------------------------
# per chunk: [rows, V] logits -> per-row loss, and the logits overwritten by their gradient


def _rows_loss_and_grad(logits, target, scale, softcap, need_grad):
    """Loss of every row (fp32, fp64 for fp64 logits) and d loss / d logits = (softmax - onehot) * scale in
    logits' dtype (None when not `need_grad`). The Triton kernel (CUDA, or the interpreter) writes the gradient over
    the logits in place: the chunk is the only [rows, V] buffer. The torch path (CPU, fp64) needs an fp32 copy."""
    use_triton = logits.dtype != torch.float64 and triton_runs_on(logits)
    if use_triton:
        loss = cross_entropy_rows_(logits, target, scale, softcap, need_grad)
        return loss, (logits if need_grad else None)
    return _rows_loss_and_grad_torch(logits, target, scale, softcap, need_grad)


def _rows_loss_and_grad_torch(logits, target, scale, softcap, need_grad):
    acc_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits.to(acc_dtype)  # the fp32 chunk (logits themselves when fp32): every step below is in place on it
    if softcap is not None:
        z.div_(softcap).tanh_()
        tanh = z.clone() if need_grad else None
        z.mul_(softcap)
    z_target = z.gather(1, target[:, None]).squeeze(1)
    z_max = z.amax(1)
    z.sub_(z_max[:, None]).exp_()
    sum_exp = z.sum(1)
    loss = z_max + sum_exp.log() - z_target
    if not need_grad:
        return loss, None
    z.div_(sum_exp[:, None])
    z.scatter_add_(1, target[:, None], torch.full_like(z_target[:, None], -1.0))
    if softcap is not None:  # d(softcap * tanh(x / softcap))/dx = 1 - tanh²
        z.mul_(tanh.square_().neg_().add_(1.0))
    z.mul_(scale.to(acc_dtype))
    return loss, z.to(logits.dtype)
