"""The Triton entry of the GKA op: picks the kernels for (causal, solver) and wraps them for autograd.

Causal calls run the stage-split kernels of :mod:`.causal_launch` (per-token direct solve or chunked Chebyshev);
non-causal calls run :mod:`.chunk`."""

from __future__ import annotations

import torch

from ..utils import device_guard

__all__ = ["CausalGKAFunction", "gka_triton"]


def _contiguous(*tensors):
    return tuple(None if t is None else t.contiguous() for t in tensors)


class CausalGKAFunction(torch.autograd.Function):
    """Causal GKA: the forward keeps x_t, the chunk-start states (and ‖H_t‖_F for Chebyshev); the backward is the
    implicit-differentiation gradient (exact for the direct solve)."""

    # Not wrapped in input_guard / custom_fwd: inputs are made contiguous and the device set here, and autocast has
    # no PyTorch op inside to act on (entering its context costs host time that matters at vision shapes).
    @staticmethod
    def forward(ctx, q, k, v, g, beta, alpha, ridge: float, solver: str, num_iters: int):
        from .causal_launch import causal_fwd, fwd_plan

        q, k, v, g, beta, alpha = _contiguous(q, k, v, g, beta, alpha)
        guard = device_guard(q)
        with guard if guard is not None else _NULL:
            plan = fwd_plan(q, k, v, g, beta, alpha, solver, num_iters, ridge)
            o, saved = causal_fwd(plan, q, k, v, g, beta, alpha, ridge, save=True)
        x, fro, h0, s0 = saved
        ctx.save_for_backward(q, k, v, g, beta, alpha, x, fro, h0, s0)
        ctx.plan, ctx.ridge = plan, ridge
        return o

    @staticmethod
    def backward(ctx, do):
        from .causal_launch import causal_bwd

        q, k, v, g, beta, alpha, x, fro, h0, s0 = ctx.saved_tensors
        do = do.contiguous()
        if do.dtype != v.dtype:
            do = do.to(v.dtype)
        guard = device_guard(do)
        with guard if guard is not None else _NULL:
            dq, dk, dv, dg, dbeta, dalpha = causal_bwd(ctx.plan, q, k, v, g, beta, alpha, x, fro, h0, s0, do,
                                                       ctx.ridge)
        return dq, dk, dv, dg, dbeta, dalpha, None, None, None


class _NullContext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL = _NullContext()


def _causal_inference(q, k, v, g, beta, alpha, ridge: float, solver: str, num_iters: int) -> torch.Tensor:
    from .causal_launch import causal_fwd, fwd_plan

    q, k, v, g, beta, alpha = _contiguous(q, k, v, g, beta, alpha)
    guard = device_guard(q)
    with guard if guard is not None else _NULL:
        plan = fwd_plan(q, k, v, g, beta, alpha, solver, num_iters, ridge)
        return causal_fwd(plan, q, k, v, g, beta, alpha, ridge, save=False)[0]


@torch.compiler.disable
def gka_triton(q, k, v, g, beta, alpha, *, causal: bool, ridge: float, num_iters: int, solver: str) -> torch.Tensor:
    """Triton GKA (arguments validated, ``solver`` resolved by :func:`visionssm.kernels.gka.gka`)."""
    if not causal:
        from .chunk import chunk_gka

        return chunk_gka(q, k, v, g, beta, alpha, causal=causal, ridge=ridge, num_iters=num_iters)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, g, beta, alpha)):
        return CausalGKAFunction.apply(q, k, v, g, beta, alpha, ridge, solver, num_iters)
    return _causal_inference(q, k, v, g, beta, alpha, ridge, solver, num_iters)
