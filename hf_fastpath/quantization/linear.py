"""`W4A16Linear`: a frozen low-bit weight-only linear layer (GPTQ / AWQ weights, fp16/bf16 activations).

Buffers (the W4A16 kernel contract; K = in_features, N = out_features, G = ceil(K / group_size)):
    qweight int32 [K*bits/32, N]  codes packed along K, rows sorted by group (row k in group k // gs); 4 bits in the
                                  K-tiled tile-major order of `kernels.w4a16_layout`, other widths GPTQ-style
    scales  [G, N]                in the compute dtype (follows `model.to(dtype)`)
    zeros   [G, N]                zero points as floats, same dtype as scales
    perm    int64 [K] or None     act-order checkpoints: y = x[..., perm] @ W_sorted
    bias    [N] or None           a frozen parameter
    W[k, n] = scales[k // gs, n] * (code(k, n) - zeros[k // gs, n])

`state_dict()` speaks the checkpoint format named by `checkpoint_format` ("gptq", "gptq_v2" or "awq": keys `qweight`,
`qzeros`, `scales`, `g_idx`; AWQ without `g_idx`), so `save_pretrained` writes files other GPTQ/AWQ tools read and
`load_state_dict` accepts them back. During `from_pretrained` a layer made by `for_checkpoint` holds the checkpoint
tensors as they are on disk until `finish_loading()` converts them.

`weight` is a zero-size placeholder `[0, N]` that carries the layer's device and compute dtype (GPT-2's init and PEFT
read `.weight`); it holds no data, so nothing can overwrite the quantized weight through it.

Compute: on CUDA with 4-bit codes and fp16/bf16 activations the Triton kernels in `hf_fastpath.kernels.w4a16` run
(forward `w4a16_matmul`, backward dx = dy @ W^T via `w4a16_matmul_grad_input`; the weight is frozen), as the torch ops
`hf_fastpath::w4a16_matmul` / `hf_fastpath::w4a16_matmul_grad_input` when autograd or torch.compile needs them
(fullgraph-compilable: generate() with a static cache). Everything else
(CPU, fp32 activations, 2/3/8 bits, a group size that does not divide K) dequantizes and uses a plain matmul.
`w4a16_backend("kernel")` forces the kernels (on CPU tensors this needs TRITON_INTERPRET=1: tests),
`w4a16_backend("reference")` forces the dequantize path.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from ..kernels import w4a16_ops
from ..kernels.common import interpret_requested, warn_once
from . import formats as F

logger = logging.getLogger(__name__)

CHECKPOINT_FORMATS = ("gptq", "gptq_v2", "awq")
_BACKENDS = ("auto", "kernel", "reference")
_backend = "auto"
def _warn_once(key: str, message: str) -> None:
    warn_once(__name__, "w4a16:" + key, message)


@contextlib.contextmanager
def w4a16_backend(name: str):
    """Choose how `W4A16Linear` computes inside the block: "auto" (default), "kernel" or "reference"."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"unknown W4A16 backend {name!r}; choose one of {_BACKENDS}")
    previous, _backend = _backend, name
    try:
        yield
    finally:
        _backend = previous


_kernel_module = None


def _kernels():
    global _kernel_module
    if _kernel_module is None:
        try:
            from ..kernels import w4a16
        except ImportError:  # the kernels module is optional at import time
            return None
        _kernel_module = w4a16
    return _kernel_module


class W4A16Linear(nn.Module):
    """Frozen low-bit weight-only linear layer; see the module docstring for its buffers and state_dict."""

    def __init__(self, in_features: int, out_features: int, bits: int = 4, group_size: int = 128, bias: bool = True,
                 *, act_order: bool = False, dtype: torch.dtype = torch.float16, device=None,
                 checkpoint_format: str = "gptq"):
        super().__init__()
        F.check_bits(bits)
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format must be one of {CHECKPOINT_FORMATS}, got {checkpoint_format!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.bits = bits
        self.group_size = group_size
        self.checkpoint_format = checkpoint_format
        self._staging: str | None = None  # the checkpoint format while `from_pretrained` fills raw tensors
        gs = F.resolve_group_size(group_size, in_features)
        groups = F.num_groups(in_features, group_size)
        rows = F.packed_len(in_features, bits, "in_features")
        self.register_buffer("qweight", torch.zeros(rows, out_features, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=dtype, device=device))
        self.register_buffer("zeros", torch.zeros(groups, out_features, dtype=dtype, device=device))
        perm = torch.arange(in_features, device=device) if act_order else None
        self.register_buffer("perm", perm)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self._effective_group_size = gs
        self._kernel_route: dict = {}  # (dtype, device, backend) -> whether forward runs the Triton kernels
        # [(input, output)] or [None]: this layer's output for that very input, computed with its siblings (see
        # `ConcatForward`). A list, so that handing over costs no nn.Module.__setattr__ (~10 µs each).
        self._handoff = [None]
        self.checkpoint_specs()  # raises now if the sizes cannot be stored in this format
        self._register_state_dict_hook(_state_dict_to_checkpoint)
        self._register_load_state_dict_pre_hook(_load_checkpoint_state_dict, with_module=True)

    # ------------------------------------------------------------------------------------------------ constructors

    @classmethod
    def from_quantized(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None, bits: int = 4,
                       group_size: int = 128, *, dtype: torch.dtype | None = None,
                       checkpoint_format: str = "gptq") -> W4A16Linear:
        """Build from integer codes `[K, N]`, scales `[G, N]`, integer zero points `[G, N]` and g_idx `[K]`.

        W[k, n] = scales[g_idx[k], n] * (codes[k, n] - zeros[g_idx[k], n]). `dtype` is the compute dtype of the layer
        (default: the bias dtype, else the scales dtype); the layer lives on the device of `codes`.
        """
        in_features, out_features = codes.shape
        if g_idx is None:
            g_idx = F.trivial_g_idx(in_features, group_size, codes.device)
        if dtype is None:
            dtype = bias.dtype if bias is not None else scales.dtype
        weight = F.IntWeight(codes.to(torch.int32), scales, zeros.to(torch.int32), g_idx.to(torch.int32))
        _check_int_weight(weight, in_features, out_features, bits, group_size)
        kernel = F.to_kernel_layout(weight, bits, group_size, dtype)
        layer = cls(in_features, out_features, bits, group_size, bias is not None, act_order=kernel.perm is not None,
                    dtype=dtype, device=codes.device, checkpoint_format=checkpoint_format)
        layer._set_kernel_tensors(kernel)
        if bias is not None:
            layer.bias.data.copy_(bias.detach().to(dtype))
        return layer

    @classmethod
    def for_checkpoint(cls, in_features: int, out_features: int, *, bits: int, group_size: int, bias: bool,
                       checkpoint_format: str, dtype: torch.dtype, device=None,
                       scale_dtype: torch.dtype = torch.float16) -> W4A16Linear:
        """An empty layer whose buffers have the checkpoint's names, shapes and dtypes (for `from_pretrained`).

        Call `finish_loading()` once the tensors are filled in.
        """
        layer = cls(in_features, out_features, bits, group_size, bias, dtype=dtype, device=device,
                    checkpoint_format=checkpoint_format)
        for name in ("qweight", "scales", "zeros", "perm"):
            delattr(layer, name)
        for name, (shape, tensor_dtype) in layer.checkpoint_specs(scale_dtype).items():
            layer.register_buffer(name, torch.zeros(shape, dtype=tensor_dtype, device=device))
        layer._staging = checkpoint_format
        layer._compute_dtype = dtype
        return layer

    # ------------------------------------------------------------------------------------------------ checkpoint I/O

    def checkpoint_specs(self, scale_dtype: torch.dtype = torch.float16) -> dict[str, tuple[tuple, torch.dtype]]:
        """Names, shapes and dtypes of this layer's tensors in its checkpoint format (bias excluded)."""
        fmt = self._staging or self.checkpoint_format
        if fmt == "awq":
            shapes = F.awq_shapes(self.in_features, self.out_features, self.group_size, self.bits)
        else:
            shapes = F.gptq_shapes(self.in_features, self.out_features, self.bits, self.group_size)
        return {name: (shape, scale_dtype if name == "scales" else torch.int32) for name, shape in shapes.items()}

    def finish_loading(self, loaded: set[str] | None = None) -> None:
        """Check the raw checkpoint tensors and convert them to the kernel layout (after `from_pretrained` filled them).

        `loaded` names the tensors the checkpoint supplied (default: those marked loaded by Transformers); a missing
        `g_idx` means the trivial one, a missing `qzeros` means symmetric (zero = 2**(bits-1)).
        """
        fmt = self._staging
        if fmt is None:
            return
        specs = self.checkpoint_specs()
        flagged = {name for name, buf in self._buffers.items() if getattr(buf, "_is_hf_initialized", False)}
        if loaded is None:
            # Transformers marks what it loaded; without any mark (tensors replaced since), trust every tensor
            loaded = flagged if "qweight" in flagged else set(specs)
        for name, (shape, tensor_dtype) in specs.items():
            tensor = self._buffers[name]
            if name not in loaded:
                if name in ("qweight", "scales"):
                    raise ValueError(f"checkpoint tensor '{name}' of {self._describe()} is missing")
                continue
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"checkpoint tensor '{name}' of {self._describe()} has shape {tuple(tensor.shape)}, expected "
                    f"{shape} (in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                    f"group_size={self.group_size}, format={fmt}); check the quantization_config in config.json"
                )
            if name != "scales" and tensor.dtype != torch.int32:
                raise ValueError(f"checkpoint tensor '{name}' of {self._describe()} has dtype {tensor.dtype}, "
                                 "expected torch.int32")
            if name == "scales" and not tensor.is_floating_point():
                raise ValueError(f"checkpoint tensor 'scales' of {self._describe()} has dtype {tensor.dtype}, "
                                 "expected a float dtype (float16)")
        qweight, scales = self._buffers["qweight"], self._buffers["scales"]
        if qweight.is_meta:
            raise NotImplementedError(f"{self._describe()} was offloaded (meta tensors): W4A16 layers must be loaded "
                                      "onto a CPU or GPU device (no disk offload)")
        device = qweight.device
        if self.bias is not None:
            if "qweight" in flagged and not getattr(self.bias, "_is_hf_initialized", False):
                self.bias.data.zero_()  # the checkpoint has no bias for this layer: never leave memory uninitialised
            self.bias.requires_grad_(False)  # the loader makes float parameters trainable; this layer is frozen
        dtype = self._compute_dtype_hint
        if "qzeros" in loaded:
            qzeros = self._buffers["qzeros"]
        else:
            _warn_once("no-qzeros", "W4A16 checkpoint without qzeros: assuming symmetric zero points")
            sym = torch.full((scales.shape[0], self.out_features), 2 ** (self.bits - 1), dtype=torch.int32,
                             device=device)
            qzeros = F.awq_pack_cols(sym) if fmt == "awq" else F.pack_gptq_zeros(sym, self.bits, fmt)
        if fmt == "awq":
            weight = F.awq_unpack(qweight, qzeros, scales, self.group_size, self.bits)
            kernel = F.to_kernel_layout(weight, self.bits, self.group_size, dtype)
        else:
            g_idx = self._buffers["g_idx"] if "g_idx" in loaded else None
            if g_idx is not None and ((g_idx < 0).any() or (g_idx >= scales.shape[0]).any()):
                raise ValueError(f"checkpoint tensor 'g_idx' of {self._describe()} holds group indices outside "
                                 f"[0, {scales.shape[0]})")
            kernel = F.gptq_to_kernel_layout(qweight, qzeros, scales, g_idx, self.bits, self.group_size, fmt,
                                             dtype, self.in_features)
        for name in list(specs):
            delattr(self, name)
        self._staging = None
        self.register_buffer("qweight", None)
        self.register_buffer("scales", None)
        self.register_buffer("zeros", None)
        self.register_buffer("perm", None)
        self._set_kernel_tensors(kernel)

    def checkpoint_tensors(self, checkpoint_format: str | None = None,
                           scale_dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
        """This layer's tensors in a checkpoint format (default: its own), bias excluded."""
        fmt = checkpoint_format or self.checkpoint_format
        if self._staging is not None:
            return {name: self._buffers[name] for name in self.checkpoint_specs()}
        if self.qweight.is_meta:
            specs = self.checkpoint_specs(scale_dtype)
            return {n: torch.empty(s, dtype=d, device="meta") for n, (s, d) in specs.items()}
        if fmt == "awq":
            return F.awq_pack(self.int_weight(), self.bits, scale_dtype)
        return F.kernel_to_gptq(self.qweight, self.scales, self.zeros, self.perm, self.bits, self.group_size,
                                self.in_features, fmt, scale_dtype)

    # ------------------------------------------------------------------------------------------------ weights

    def int_weight(self) -> F.IntWeight:
        """Integer codes, scales, integer zero points and g_idx in the original input order."""
        self._check_loaded()
        return F.from_kernel_layout(self.qweight, self.scales, self.zeros, self.perm, self.bits, self.group_size,
                                    self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as nn.Linear stores it: `[out_features, in_features]`."""
        w_sorted = self._dequantize_sorted(torch.float32)
        if self.perm is not None:
            w = torch.empty_like(w_sorted)
            w[self.perm] = w_sorted
            w_sorted = w
        return w_sorted.t().contiguous().to(dtype)

    @property
    def weight(self) -> torch.Tensor:
        """Zero-size `[0, out_features]` placeholder with the layer's device and compute dtype (holds no data)."""
        reference = self._buffers.get("scales")
        if reference is None:
            return torch.empty(0, self.out_features)
        return reference[:0]

    # ------------------------------------------------------------------------------------------------ compute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Eager decoding runs this once per linear and token and is host-bound, so the hot path avoids
        # nn.Module.__getattr__ (~1-2 µs per buffer) and rechecking what was checked at load.
        handoff = self._handoff
        provided = handoff[0]
        if provided is not None and provided[0] is x:
            handoff[0] = None
            return provided[1]
        self._check_loaded()
        if x.shape[-1] != self.in_features:
            raise ValueError(f"W4A16Linear expects inputs with last dimension {self.in_features}, got {tuple(x.shape)}")
        buffers = self._buffers
        lead = x.shape[:-1]
        if x.dtype == torch.float32 and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))  # a custom kernel does not get autocast by itself
        x2 = x.reshape(-1, self.in_features)
        perm = buffers["perm"]
        if perm is not None:
            x2 = x2.index_select(1, perm)  # autograd scatters dx back
        if self._use_kernel(x2):
            scales, zeros = buffers["scales"], buffers["zeros"]
            if scales.dtype != x2.dtype:
                scales, zeros = scales.to(x2.dtype), zeros.to(x2.dtype)
            args = (x2.contiguous(), buffers["qweight"], scales, zeros, self._effective_group_size)
            if torch.compiler.is_compiling() or (x2.requires_grad and torch.is_grad_enabled()):
                y = w4a16_ops.w4a16_matmul_op(*args)
            else:  # eager inference: the weights were checked at load, and the op's dispatch costs host time
                y = _kernels().w4a16_matmul_rows(*args)
        else:
            y = x2 @ self._dequantize_sorted(x2.dtype)
        bias = self._parameters["bias"]
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.view(*lead, self.out_features)  # a torch.Size argument costs twice as much host time

    def _use_kernel(self, x: torch.Tensor) -> bool:
        key = (x.dtype, x.device, _backend)
        use = self._kernel_route.get(key)
        if use is None:  # decided once per dtype, device and backend: eager decoding calls this thousands of times
            use = self._kernel_route[key] = self._decide_kernel(x)
        return use

    def _decide_kernel(self, x: torch.Tensor) -> bool:
        if _backend == "reference":
            return False
        reasons = []
        if self.bits != 4:
            reasons.append(f"bits={self.bits}")
        if self.in_features % self._effective_group_size != 0:
            reasons.append(f"group_size {self._effective_group_size} does not divide in_features {self.in_features}")
        if x.dtype not in (torch.float16, torch.bfloat16):
            reasons.append(f"activations are {x.dtype}")
        if not x.is_cuda and not (_backend == "kernel" and interpret_requested()):
            reasons.append("tensors are on the CPU")
        if not reasons and _kernels() is None:
            reasons.append("hf_fastpath.kernels.w4a16 is not available")
        if reasons and (_backend == "kernel" or x.is_cuda):
            message = "W4A16 Triton kernels not used (" + "; ".join(reasons) + "): dequantize + matmul instead"
            if _backend == "kernel":
                raise RuntimeError(message)
            _warn_once("fallback:" + ";".join(reasons), message)
        return not reasons

    def _dequantize_sorted(self, dtype: torch.dtype) -> torch.Tensor:
        """W with rows in kernel (group-sorted) order, `[K, N]`."""
        codes = F.unpack_kernel_rows(self.qweight, self.bits, self.in_features)
        g = torch.arange(self.in_features, device=codes.device) // self._effective_group_size
        w = (codes.float() - self.zeros.float()[g]) * self.scales.float()[g]
        return w.to(dtype)

    # ------------------------------------------------------------------------------------------------ internals

    def _set_kernel_tensors(self, kernel: F.KernelTensors) -> None:
        self.qweight = kernel.qweight
        self.scales = kernel.scales
        self.zeros = kernel.zeros
        self.perm = kernel.perm

    @property
    def _compute_dtype_hint(self) -> torch.dtype:
        return getattr(self, "_compute_dtype", torch.float16)

    def _check_loaded(self) -> None:
        if self._staging is not None:
            raise RuntimeError(f"{self._describe()} still holds raw checkpoint tensors; call finish_loading() first")

    def _describe(self) -> str:
        name = getattr(self, "_hf_fastpath_name", None)
        return f"layer '{name}'" if name else f"W4A16Linear({self.in_features}, {self.out_features})"

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, bias={self.bias is not None}, act_order={self.perm is not None}, "
                f"format={self.checkpoint_format}")


def _check_int_weight(weight: F.IntWeight, in_features: int, out_features: int, bits: int, group_size: int) -> None:
    groups = F.num_groups(in_features, group_size)
    expected = {"codes": (in_features, out_features), "scales": (groups, out_features),
                "zeros": (groups, out_features), "g_idx": (in_features,)}
    for name, shape in expected.items():
        got = tuple(getattr(weight, name).shape)
        if got != shape:
            raise ValueError(f"{name} has shape {got}, expected {shape} (bits={bits}, group_size={group_size})")
    if weight.codes.numel() and (weight.codes.min() < 0 or weight.codes.max() >= 2**bits):
        raise ValueError(f"codes must lie in [0, {2**bits}) for bits={bits}")


def _state_dict_to_checkpoint(module: W4A16Linear, state_dict, prefix, local_metadata):
    """state_dict hook: replace the kernel-layout buffers by the checkpoint tensors."""
    if module._staging is not None or prefix + "qweight" not in state_dict:
        return state_dict
    for name in ("qweight", "scales", "zeros", "perm"):
        state_dict.pop(prefix + name, None)
    for name, tensor in module.checkpoint_tensors().items():
        state_dict[prefix + name] = tensor
    return state_dict


def _load_checkpoint_state_dict(module: W4A16Linear, state_dict, prefix, local_metadata, strict, missing_keys,
                                unexpected_keys, error_msgs):
    """load_state_dict pre-hook: accept checkpoint-format tensors and convert them to the kernel layout."""
    if module._staging is not None or prefix + "qzeros" not in state_dict:
        return
    fmt = module.checkpoint_format
    qweight = state_dict.pop(prefix + "qweight")
    qzeros = state_dict.pop(prefix + "qzeros")
    scales = state_dict.pop(prefix + "scales")
    g_idx = state_dict.pop(prefix + "g_idx", None)
    dtype = module.scales.dtype if module.scales is not None else scales.dtype
    if fmt == "awq":
        weight = F.awq_unpack(qweight, qzeros, scales, module.group_size, module.bits)
        kernel = F.to_kernel_layout(weight, module.bits, module.group_size, dtype)
    else:
        kernel = F.gptq_to_kernel_layout(qweight, qzeros, scales, g_idx, module.bits, module.group_size, fmt,
                                         dtype, module.in_features)
    state_dict[prefix + "qweight"] = kernel.qweight
    state_dict[prefix + "scales"] = kernel.scales
    state_dict[prefix + "zeros"] = kernel.zeros
    # the perm buffer exists exactly when the incoming weight needs one
    if kernel.perm is not None:
        if module.perm is None:
            module.perm = torch.empty_like(kernel.perm, device=module.qweight.device)
        state_dict[prefix + "perm"] = kernel.perm
    else:
        module.perm = None
