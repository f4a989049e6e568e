"""PyTorch reference of the gated per-head RMSNorm (float64-capable)::

    y[b, t, h, :] = o[b, t, h, :] / √(mean_d o[b, t, h, d]² + eps) · weight · act(gate[b, t, h, :])

act = SiLU (GKA) or sigmoid (Comba), or no gate; the result is returned flattened to (B, L, H·D) in o's dtype,
ready for the output projection. Computed in float32 (float64 for float64 inputs), as the layers' GatedRMSNorm.

With ``gate_weight`` (H·D, R) the gate argument is low-rank, (B, L, R), and the gate used is
``gate @ gate_weightᵀ + gate_bias``, computed in float32 (float64 when any of the three is float64) whatever the
autocast state, as the kernels compute it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["gated_rmsnorm_reference", "up_project_gate"]


def up_project_gate(gate: torch.Tensor, gate_weight: torch.Tensor, gate_bias: torch.Tensor | None) -> torch.Tensor:
    """``gate @ gate_weightᵀ + gate_bias`` in float32, or float64 when any input is float64 (autocast off)."""
    present = [t for t in (gate, gate_weight, gate_bias) if t is not None]
    wide = torch.float64 if any(t.dtype == torch.float64 for t in present) else torch.float32
    with torch.autocast(gate.device.type, enabled=False):
        return F.linear(gate.to(wide), gate_weight.to(wide), None if gate_bias is None else gate_bias.to(wide))


def gated_rmsnorm_reference(o: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, *, activation: str,
                            eps: float, gate_weight: torch.Tensor | None = None,
                            gate_bias: torch.Tensor | None = None) -> torch.Tensor:
    B, L, H, D = o.shape
    if gate_weight is not None:
        gate = up_project_gate(gate, gate_weight, gate_bias)
    wide = torch.float64 if torch.float64 in (o.dtype, weight.dtype) else torch.float32
    x = o.to(wide)
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.to(wide)
    if gate is not None:
        g = gate.reshape(B, L, H, D).to(torch.float64 if gate.dtype == torch.float64 else wide)
        y = y * (F.silu(g) if activation == "silu" else torch.sigmoid(g))
    return y.to(o.dtype).reshape(B, L, H * D)
