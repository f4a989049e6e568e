"""PyTorch reference of the gated per-head RMSNorm (float64-capable)::

    y[b, t, h, :] = o[b, t, h, :] / √(mean_d o[b, t, h, d]² + eps) · weight · act(gate[b, t, h, :])

act = SiLU (GKA) or sigmoid (Comba), or no gate; the result is returned flattened to (B, L, H·D) in o's dtype,
ready for the output projection. Computed in float32 (float64 for float64 inputs), as the layers' GatedRMSNorm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["gated_rmsnorm_reference"]


def gated_rmsnorm_reference(o: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, *, activation: str,
                            eps: float) -> torch.Tensor:
    B, L, H, D = o.shape
    wide = torch.float64 if torch.float64 in (o.dtype, weight.dtype) else torch.float32
    x = o.to(wide)
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.to(wide)
    if gate is not None:
        g = gate.reshape(B, L, H, D).to(torch.float64 if gate.dtype == torch.float64 else wide)
        y = y * (F.silu(g) if activation == "silu" else torch.sigmoid(g))
    return y.to(o.dtype).reshape(B, L, H * D)
