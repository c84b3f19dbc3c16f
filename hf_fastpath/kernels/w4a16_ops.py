"""The W4A16 kernels as `torch.library` custom ops (with autograd and fake implementations): what torch.compile
and CUDA graphs see of a W4A16 layer.

Dynamo cannot trace the launch code, so under torch.compile the graph holds one opaque node per layer (fullgraph:
generate() with a static cache compiles), and CUDA graphs capture the launches. Eager inference calls the kernels
directly (`W4A16Linear`): the op dispatch costs more host time per call than the launch itself.

    y = torch.ops.hf_fastpath.w4a16_matmul(x2d, qweight, scales, zeros, group_size)   # dx = dy @ W^T in backward
"""

from __future__ import annotations

import torch

__all__ = ["w4a16_matmul_op", "w4a16_grad_input_op", "w4a16_concat_op", "w4a16_experts_op"]


def _kernels():
    from . import w4a16  # imports Triton: only when a kernel runs

    return w4a16


@torch.library.custom_op("hf_fastpath::w4a16_matmul", mutates_args=())
def w4a16_matmul_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int) -> torch.Tensor:
    # a fresh split-K workspace: under "reduce-overhead" every allocation belongs to a CUDA-graph pool, and a
    # cached workspace allocated there (even in the eager warm-up run) would outlive the pool's bookkeeping
    return _kernels().w4a16_matmul(x, qweight, scales, zeros, group_size, cache_workspace=False)


@w4a16_matmul_op.register_fake
def _(x, qweight, scales, zeros, group_size):
    return x.new_empty(x.shape[0], qweight.shape[1])


@torch.library.custom_op("hf_fastpath::w4a16_matmul_grad_input", mutates_args=())
def w4a16_grad_input_op(dy: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         group_size: int) -> torch.Tensor:
    return _kernels().w4a16_matmul_grad_input(dy, qweight, scales, zeros, group_size)


@w4a16_grad_input_op.register_fake
def _(dy, qweight, scales, zeros, group_size):
    return dy.new_empty(dy.shape[0], qweight.shape[0] * 8)


@torch.library.custom_op("hf_fastpath::w4a16_matmul_concat", mutates_args=())
def w4a16_concat_op(x: torch.Tensor, qweights: list[torch.Tensor], scales: list[torch.Tensor],
                     zeros: list[torch.Tensor], group_size: int) -> torch.Tensor:
    return _kernels().w4a16_matmul_concat(x, list(zip(qweights, scales, zeros)), group_size, cache_workspace=False)


@w4a16_concat_op.register_fake
def _(x, qweights, scales, zeros, group_size):
    return x.new_empty(x.shape[0], sum(q.shape[1] for q in qweights))


@torch.library.custom_op("hf_fastpath::w4a16_experts_matmul", mutates_args=())
def w4a16_experts_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, tiles: torch.Tensor, rows_per_expert: int, widths: list[int]) -> torch.Tensor:
    return _kernels().w4a16_experts_matmul_rows(x, qweight, scales, zeros, group_size, tiles, rows_per_expert,
                                                widths, cache_workspace=False)


@w4a16_experts_op.register_fake
def _(x, qweight, scales, zeros, group_size, tiles, rows_per_expert, widths):
    return x.new_empty(x.shape[0], sum(widths) if widths else qweight.shape[2])


def _op_setup_context(ctx, inputs, output):
    _, qweight, scales, zeros, group_size = inputs
    ctx.save_for_backward(qweight, scales, zeros)
    ctx.group_size = group_size


def _op_backward(ctx, dy):
    qweight, scales, zeros = ctx.saved_tensors
    dx = None
    if ctx.needs_input_grad[0]:
        dx = w4a16_grad_input_op(dy.contiguous(), qweight, scales, zeros, ctx.group_size)
    return dx, None, None, None, None


w4a16_matmul_op.register_autograd(_op_backward, setup_context=_op_setup_context)
