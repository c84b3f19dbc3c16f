"""GPTQ (Frantar et al., 2022): quantize one linear's weight column by column, pushing each column's rounding error
onto the columns not yet quantized through the inverse Hessian of the layer's reconstruction loss ||WX - QX||².

Usage: `g = GPTQ(in_features)`, `g.add_batch(x)` for every calibration input (any leading shape), then
`g.quantize(weight, bits=..., group_size=..., sym=..., desc_act=..., static_groups=...)`.

GPTAQ (Li et al., 2025, "asymmetric calibration"): `add_batch(x, x_float)` also passes what the layer sees in the
float model. The loss becomes ||W X_float - Q X||², which corrects the error earlier quantized layers left in X
instead of inheriting it. Its minimizer without the grid is W* = W + W ΔXᵀX H⁻¹ (ΔX = X_float - X, H = XᵀX), and
||W X_float - Q X||² = ||(W* - Q) X||² + const, so GPTQ on the target W* with the same H solves it.
`quantize(..., gptaq_alpha=a)` moves the target a fraction a of the way to W* (a < 1 regularizes: the correction
is fitted on the calibration text only).
"""

from __future__ import annotations

import logging
import math

import torch

from .formats import resolve_group_size
from .rtn import QuantizedWeight, check_bits, grid_params, quantize_codes

logger = logging.getLogger(__name__)


class GPTQ:
    """Accumulates H = 2/n Σ x xᵀ over the calibration inputs of one linear layer and quantizes its weight (with
    float inputs, also D = 2/n Σ (x_float - x)ᵀ x for GPTAQ's target)."""

    def __init__(self, in_features: int, device=None):
        self.in_features = in_features
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.D = None
        self.nsamples = 0

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, x.shape[-1]).to(device=self.H.device, dtype=torch.float32)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the layer expects {self.in_features}")
        return x

    @torch.no_grad()
    def add_batch(self, x: torch.Tensor, x_float: torch.Tensor | None = None) -> None:
        x = self._rows(x)
        if x_float is not None:
            x_float = self._rows(x_float)
            if x_float.shape != x.shape:
                raise ValueError(f"x_float has {x_float.shape[0]} rows, x has {x.shape[0]}")
        if self.nsamples and (x_float is None) != (self.D is None):
            raise ValueError("pass x_float to every add_batch of a GPTQ accumulator or to none")
        m = x.shape[0]
        # Running means of 2 x xᵀ (and 2 Δxᵀ x): rescale the old sums, then add the new rows scaled by sqrt(2 / n).
        keep = self.nsamples / (self.nsamples + m)
        self.nsamples += m
        root = math.sqrt(2 / self.nsamples)
        scaled = x * root
        self.H.mul_(keep).addmm_(scaled.t(), scaled)
        if x_float is not None:
            if self.D is None:
                self.D = torch.zeros_like(self.H)
            self.D.mul_(keep).addmm_((x_float - x).t(), scaled, alpha=root)

    @torch.no_grad()
    def quantize(self, weight: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True,
                 desc_act: bool = False, static_groups: bool = False, damp_percent: float = 0.01,
                 block_size: int = 128, scale_dtype: torch.dtype | None = torch.float16, gptaq_alpha: float = 1.0):
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
        if self.D is not None and gptaq_alpha:
            W += gptaq_alpha * self._target_shift(W, H, damp_percent)
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

    def _target_shift(self, W: torch.Tensor, H: torch.Tensor, damp_percent: float) -> torch.Tensor:
        """W D H⁻¹ (H dampened as GPTQ dampens it): how far GPTAQ's unconstrained optimum lies from W."""
        L, info = torch.linalg.cholesky_ex(self._dampened(H, damp_percent))
        if info != 0:
            logger.warning("GPTAQ: the dampened Hessian is not positive definite; quantizing toward W itself")
            return torch.zeros_like(W)
        # (W D) H⁻¹ = (H⁻¹ Dᵀ Wᵀ)ᵀ, H symmetric
        return torch.cholesky_solve((W @ self.D).t(), L).t()

    @staticmethod
    def _dampened(H: torch.Tensor, damp: float) -> torch.Tensor:
        """H + damp · mean(diag H) · I: GPTQ's regularization of the Hessian."""
        Hd = H.clone()
        Hd.diagonal().add_(damp * torch.mean(torch.diag(H)))
        return Hd

    @staticmethod
    def _inverse_cholesky(H: torch.Tensor, damp_percent: float) -> torch.Tensor:
        """Upper Cholesky factor of H⁻¹ after dampening the diagonal; more dampening if H is not positive definite."""
        damp = damp_percent
        for _ in range(6):
            L, info = torch.linalg.cholesky_ex(GPTQ._dampened(H, damp))
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
