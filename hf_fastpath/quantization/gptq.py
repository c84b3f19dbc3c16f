"""GPTQ (Frantar et al., 2022): quantize one linear's weight column by column, pushing each column's rounding error
onto the columns not yet quantized through the inverse Hessian of the layer's reconstruction loss ||WX - QX||².

Usage: `g = GPTQ(in_features)`, `g.add_batch(x)` for every calibration input (any leading shape), then
`g.quantize(weight, bits=..., group_size=..., sym=..., desc_act=..., static_groups=...)`.
"""

from __future__ import annotations

import logging
import math

import torch

from .formats import resolve_group_size
from .rtn import QuantizedWeight, check_bits, grid_params, quantize_codes

logger = logging.getLogger(__name__)


class GPTQ:
    """Accumulates H = 2/n Σ x xᵀ over the calibration inputs of one linear layer and quantizes its weight."""

    def __init__(self, in_features: int, device=None):
        self.in_features = in_features
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.nsamples = 0

    @torch.no_grad()
    def add_batch(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(device=self.H.device, dtype=torch.float32)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the layer expects {self.in_features}")
        m = x.shape[0]
        # Running mean of 2 x xᵀ: rescale the old sum, then add the new rows scaled by sqrt(2 / n).
        self.H.mul_(self.nsamples / (self.nsamples + m))
        self.nsamples += m
        x = x * math.sqrt(2 / self.nsamples)
        self.H.addmm_(x.t(), x)

    @torch.no_grad()
    def quantize(self, weight: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True,
                 desc_act: bool = False, static_groups: bool = False, damp_percent: float = 0.01,
                 block_size: int = 128, scale_dtype: torch.dtype | None = torch.float16):
        """Returns `(QuantizedWeight, loss)`; `weight` in nn.Linear layout `[out, in]` (not modified)."""
        check_bits(bits)
        if self.nsamples == 0:
            raise RuntimeError("GPTQ.quantize called before any add_batch: the layer saw no calibration input")
        W = weight.detach().to(device=self.H.device, dtype=torch.float32).clone()
        rows, cols = W.shape
        gs = resolve_group_size(group_size, cols)
        H = self.H.clone()

        # Inputs that are always zero carry no information: their weights do not matter, pin them to 0.
        dead = torch.diag(H) == 0
        H[dead, dead] = 1
        W[:, dead] = 0

        n_groups = -(-cols // gs)  # the last group may be shorter
        static = None
        if static_groups:
            # Each group's grid fixed up front from the unmodified weight (so act-order cannot reorder groups).
            static = [grid_params(W[:, g * gs:(g + 1) * gs], bits, sym, scale_dtype) for g in range(n_groups)]

        perm = None
        if desc_act:
            # Quantize the inputs with the largest activations first, while many columns remain to absorb errors.
            perm = torch.argsort(torch.diag(H), descending=True)
            W = W[:, perm]
            H = H[perm][:, perm]

        Hinv = self._inverse_cholesky(H, damp_percent)

        codes = torch.zeros_like(W)
        losses = torch.zeros(rows, device=W.device)
        scales = torch.zeros(n_groups, rows, device=W.device)
        zeros = torch.zeros(n_groups, rows, device=W.device)
        scale = zero = None

        for i1 in range(0, cols, block_size):
            i2 = min(i1 + block_size, cols)
            # The block held transposed ([column, row]): each column update touches contiguous memory.
            W1 = W[:, i1:i2].t().contiguous()
            Q1 = torch.zeros_like(W1)
            Err1 = torch.zeros_like(W1)
            Hinv1 = Hinv[i1:i2, i1:i2]
            for i in range(i2 - i1):
                col = i1 + i
                if static is not None:
                    g = int(perm[col]) // gs if perm is not None else col // gs
                    scale, zero = static[g]
                elif col % gs == 0:
                    # Grid for the group that starts here, from the weights as updated so far.
                    upcoming = torch.cat([W1[i:].t(), W[:, i2:]], dim=1)[:, :gs]
                    scale, zero = grid_params(upcoming, bits, sym, scale_dtype)
                    scales[col // gs], zeros[col // gs] = scale, zero
                w = W1[i]
                q_int = quantize_codes(w, scale, zero, bits)
                codes[:, col] = q_int
                Q1[i] = scale * (q_int - zero)
                err = (w - Q1[i]) / Hinv1[i, i]
                W1[i:].addr_(Hinv1[i, i:], err, alpha=-1)
                Err1[i] = err
            losses += (Err1**2).sum(0) / 2  # (w - q)² / d² / 2 per row: GPTQ's estimate of the added error
            # Lazy batch update: the block's accumulated errors applied to all later columns in one matmul.
            W[:, i2:].addmm_(Err1.t(), Hinv[i1:i2, i2:], alpha=-1)

        if static is not None:
            for g, (s, z) in enumerate(static):
                scales[g], zeros[g] = s, z
        if perm is not None:
            inv = torch.argsort(perm)
            codes = codes[:, inv]
            if static is not None:
                g_idx = torch.arange(cols, device=W.device) // gs
            else:
                g_idx = (torch.arange(cols, device=W.device) // gs)[inv]
        else:
            g_idx = torch.arange(cols, device=W.device) // gs

        result = QuantizedWeight(
            codes=codes.t().contiguous().to(torch.int32),
            scales=scales,
            zeros=zeros.to(torch.int32),
            g_idx=g_idx.to(torch.int32),
            bits=bits,
            group_size=group_size,
        )
        return result, float(losses.sum())

    @staticmethod
    def _inverse_cholesky(H: torch.Tensor, damp_percent: float) -> torch.Tensor:
        """Upper Cholesky factor of H⁻¹ after dampening the diagonal; more dampening if H is not positive definite."""
        mean_diag = torch.mean(torch.diag(H))
        idx = torch.arange(H.shape[0], device=H.device)
        damp = damp_percent
        for _ in range(6):
            Hd = H.clone()
            Hd[idx, idx] += damp * mean_diag
            L, info = torch.linalg.cholesky_ex(Hd)
            if info == 0:
                Hinv = torch.cholesky_inverse(L)
                U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
                if info == 0:
                    if damp != damp_percent:
                        logger.warning("GPTQ: Hessian needed damp_percent=%.3g (asked %.3g) to be positive definite",
                                       damp, damp_percent)
                    return U
            damp = damp * 10 if damp > 0 else 0.01
        raise RuntimeError(
            "GPTQ: the Hessian is not positive definite even with heavy dampening; the calibration inputs are "
            "degenerate (too few samples, or NaN/inf activations)"
        )
