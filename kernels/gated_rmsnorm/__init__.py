"""Gated per-head RMSNorm op, the output side of the GKA and Comba layers:
``gated_rmsnorm(o, gate, weight, *, activation, eps) -> (B, L, H·D)``.

Each head's output is RMS-normalised, scaled by ``weight`` (shared by the heads) and multiplied by
``activation(gate)``; the gate may be a strided view (e.g. columns of the input projection's output), read in
place. :mod:`.naive` states the maths (and is the CPU path). Backends (:mod:`visionssm.kernels.dispatch`): one
Triton kernel forward and one backward for CUDA tensors (and under ``TRITON_INTERPRET=1``), the PyTorch reference
otherwise; float64 inputs always take the PyTorch path. The launch setting ``reference=True``
(``kernels.tuning.launch_overrides("gated_rmsnorm", reference=True)``) runs the reference on CUDA too.
"""

from __future__ import annotations

import math

import torch

from .. import dispatch as _dispatch
from .. import tuning
from ..utils import check_dtype
from .naive import gated_rmsnorm_reference

__all__ = ["ACTIVATIONS", "OP", "gated_rmsnorm", "gated_rmsnorm_reference"]

OP = "gated_rmsnorm"
ACTIVATIONS = ("silu", "sigmoid")
_IO_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_FUSED = None


def _validate(o, gate, weight, activation, eps) -> None:
    check_dtype("o", o, _IO_DTYPES)
    if o.dim() != 4 or min(o.shape) < 1:
        raise ValueError(f"o must have shape (B, L, H, D) with every size >= 1, got {tuple(o.shape)}")
    B, L, H, D = o.shape
    if gate is not None:
        check_dtype("gate", gate, _IO_DTYPES)
        if tuple(gate.shape) != (B, L, H * D):
            raise ValueError(f"gate must have shape (B, L, H·D) = ({B}, {L}, {H * D}), got {tuple(gate.shape)}")
        if gate.device != o.device:
            raise ValueError(f"gate is on {gate.device}, o on {o.device}")
    check_dtype("weight", weight, _IO_DTYPES)
    if tuple(weight.shape) != (D,):
        raise ValueError(f"weight must have shape (D,) = ({D},), got {tuple(weight.shape)}")
    if weight.device != o.device:
        raise ValueError(f"weight is on {weight.device}, o on {o.device}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")


def gated_rmsnorm(o: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, *, activation: str = "silu",
                  eps: float = 1e-6) -> torch.Tensor:
    """Per-head RMSNorm of ``o`` (B, L, H, D) times ``weight`` (D,) times ``activation(gate)`` (gate (B, L, H·D)
    or None); returns (B, L, H·D) in o's dtype."""
    _validate(o, gate, weight, activation, eps)
    if _dispatch.select_backend(o, gate, weight) == "triton" and not tuning.overrides(OP).get("reference", False):
        return _fused()(o, gate, weight, activation=activation, eps=float(eps))
    return gated_rmsnorm_reference(o, gate, weight, activation=activation, eps=float(eps))


def _fused():
    """The Triton entry point, imported on first use (importing visionssm never imports Triton)."""
    global _FUSED
    if _FUSED is None:
        from .autograd import fused_gated_rmsnorm

        _FUSED = fused_gated_rmsnorm
    return _FUSED
