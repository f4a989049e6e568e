"""Gated per-head RMSNorm op, the output side of the GKA and Comba layers:
``gated_rmsnorm(o, gate, weight, *, activation, eps, gate_weight=None, gate_bias=None) -> (B, L, H·D)``.

Each head's output is RMS-normalised, scaled by ``weight`` (shared by the heads) and multiplied by
``activation(gate)``; the gate may be a strided view (e.g. columns of the input projection's output), read in
place. With ``gate_weight`` the gate is low-rank and up-projected inside the op (Comba's output gate), so the
full-width gate never goes through GPU memory and the layer makes no separate Linear call. :mod:`.naive` states
the maths (and is the CPU path). Backends (:mod:`visionssm.kernels.dispatch`): one Triton kernel forward and one
backward for CUDA tensors (and under ``TRITON_INTERPRET=1``), the PyTorch reference
otherwise; float64 inputs always take the PyTorch path. The launch setting ``reference=True``
(``kernels.tuning.launch_overrides("gated_rmsnorm", reference=True)``) runs the reference on CUDA too.
"""

from __future__ import annotations

import math

import torch

from ... import dispatch as _dispatch
from ... import library, tuning
from ...utils import check_dtype, check_same_device
from .custom_op import gated_rmsnorm_op
from .naive import gated_rmsnorm_reference

__all__ = ["ACTIVATIONS", "OP", "gated_rmsnorm", "gated_rmsnorm_reference"]

OP = "gated_rmsnorm"
ACTIVATIONS = ("silu", "sigmoid")
_IO_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_FUSED = None
_FUSED_LOW_RANK = None


def _validate_low_rank(o, gate, gate_weight, gate_bias) -> None:
    B, L, H, D = o.shape
    if gate_weight is None:
        if gate_bias is not None:
            raise ValueError("gate_bias needs gate_weight (it is the bias of the gate's up-projection)")
        return
    check_dtype("gate_weight", gate_weight, _IO_DTYPES)
    if gate_weight.dim() != 2 or gate_weight.shape[0] != H * D or gate_weight.shape[1] < 1:
        raise ValueError(f"gate_weight must have shape (H·D, R) = ({H * D}, R) with R >= 1, "
                         f"got {tuple(gate_weight.shape)}")
    if gate is None:
        raise ValueError("gate must be given with gate_weight (the low-rank gate, (B, L, R))")
    check_dtype("gate", gate, _IO_DTYPES)
    if tuple(gate.shape) != (B, L, gate_weight.shape[1]):
        raise ValueError(f"gate must have shape (B, L, R) = ({B}, {L}, {gate_weight.shape[1]}) with gate_weight, "
                         f"got {tuple(gate.shape)}")
    if gate_bias is not None:
        check_dtype("gate_bias", gate_bias, _IO_DTYPES)
        if tuple(gate_bias.shape) != (H * D,):
            raise ValueError(f"gate_bias must have shape (H·D,) = ({H * D},), got {tuple(gate_bias.shape)}")


def _validate(o, gate, weight, activation, eps, gate_weight, gate_bias) -> None:
    check_dtype("o", o, _IO_DTYPES)
    if o.dim() != 4 or min(o.shape) < 1:
        raise ValueError(f"o must have shape (B, L, H, D) with every size >= 1, got {tuple(o.shape)}")
    B, L, H, D = o.shape
    _validate_low_rank(o, gate, gate_weight, gate_bias)
    if gate is not None and gate_weight is None:
        check_dtype("gate", gate, _IO_DTYPES)
        if tuple(gate.shape) != (B, L, H * D):
            raise ValueError(f"gate must have shape (B, L, H·D) = ({B}, {L}, {H * D}), got {tuple(gate.shape)}")
    check_dtype("weight", weight, _IO_DTYPES)
    if tuple(weight.shape) != (D,):
        raise ValueError(f"weight must have shape (D,) = ({D},), got {tuple(weight.shape)}")
    check_same_device(o=o, gate=gate, weight=weight, gate_weight=gate_weight, gate_bias=gate_bias)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")


def gated_rmsnorm(o: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, *, activation: str = "silu",
                  eps: float = 1e-6, gate_weight: torch.Tensor | None = None,
                  gate_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head RMSNorm of ``o`` (B, L, H, D) times ``weight`` (D,) times ``activation(gate)`` (gate (B, L, H·D)
    or None); returns (B, L, H·D) in o's dtype.

    With ``gate_weight`` (H·D, R) the ``gate`` argument is low-rank, (B, L, R) (a strided view is read in place), and
    the gate is ``gate @ gate_weightᵀ + gate_bias`` (gate_bias (H·D,) or None): an ``nn.Linear(R, H·D)`` folded into
    the op. That projection is computed in float32 from the weight and bias as they are (float32 parameters stay
    float32 under autocast, where a separate Linear would have run in bf16 and rounded the gate to bf16): the
    kernels' products are exact float32 for float32 gates and tf32 tensor-core products (16-bit gates are exact in
    tf32; the weight is rounded to 10 mantissa bits) for 16-bit gates, always with float32 sums."""
    _validate(o, gate, weight, activation, eps, gate_weight, gate_bias)
    if library.tracing():
        return gated_rmsnorm_op(o, gate, weight, gate_weight, gate_bias, activation, float(eps))[0]
    if (_dispatch.select_backend(o, gate, weight, gate_weight, gate_bias) == "triton"
            and not tuning.overrides(OP).get("reference", False)):
        if gate_weight is not None:
            return _fused_low_rank()(o, gate, gate_weight, gate_bias, weight, activation=activation, eps=float(eps))
        return _fused()(o, gate, weight, activation=activation, eps=float(eps))
    return gated_rmsnorm_reference(o, gate, weight, activation=activation, eps=float(eps), gate_weight=gate_weight,
                                   gate_bias=gate_bias)


def _fused():
    """The Triton entry point, imported on first use (importing visionssm never imports Triton)."""
    global _FUSED
    if _FUSED is None:
        from .autograd import fused_gated_rmsnorm

        _FUSED = fused_gated_rmsnorm
    return _FUSED


def _fused_low_rank():
    """The Triton entry point of the low-rank gate, imported on first use."""
    global _FUSED_LOW_RANK
    if _FUSED_LOW_RANK is None:
        from .autograd import fused_gated_rmsnorm_low_rank

        _FUSED_LOW_RANK = fused_gated_rmsnorm_low_rank
    return _FUSED_LOW_RANK
