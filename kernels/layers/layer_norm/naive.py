"""PyTorch reference of the LayerNorm op (float64-capable)::

    y[..., :] = (x[..., :] − mean(x)) / √(var(x) + eps) · weight + bias      (biased variance over the last axis)

Computed in float32 (float64 when any input is float64) and returned in x's dtype: ``F.layer_norm`` itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["add_layer_norm_reference", "layer_norm_reference"]


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                         eps: float) -> torch.Tensor:
    wide = torch.float64 if torch.float64 in (x.dtype, weight.dtype) else torch.float32
    y = F.layer_norm(x.to(wide), (x.shape[-1],), weight.to(wide), None if bias is None else bias.to(wide), eps)
    return y.to(x.dtype)


def add_layer_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             *, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer_norm(residual + x), residual + x)``, the norm in the sum's dtype."""
    summed = residual + x
    return layer_norm_reference(summed, weight, bias, eps=eps), summed
