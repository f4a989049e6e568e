"""The Triton entry of the GKA op: picks the kernels for (causal, solver) and wraps them for autograd."""

from __future__ import annotations

import torch

__all__ = ["gka_triton"]


@torch.compiler.disable
def gka_triton(q, k, v, g, beta, alpha, *, causal: bool, ridge: float, num_iters: int, solver: str) -> torch.Tensor:
    """Triton GKA (arguments validated, ``solver`` resolved by :func:`visionssm.kernels.gka.gka`)."""
    from .chunk import chunk_gka

    return chunk_gka(q, k, v, g, beta, alpha, causal=causal, ridge=ridge, num_iters=num_iters)
