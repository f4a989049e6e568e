"""The Triton entry of the GKA op: picks the kernels for (causal, solver) and wraps them for autograd.

Causal calls run the stage-split kernels of :mod:`.launch_causal` (per-token direct solve or chunked Chebyshev);
non-causal calls the closed form of :mod:`.launch_noncausal` (one solve per (batch, head)). Calls with nothing to
differentiate skip autograd and save nothing.

The Functions are not wrapped in input_guard / custom_fwd / custom_bwd: eager vision calls are bound by host time,
so the inputs are made contiguous and the device set here, and autocast has no PyTorch op inside to act on."""

from __future__ import annotations

import torch

from ..utils import contiguous, device_guard, needs_grad

__all__ = ["CausalGKAFunction", "NoncausalGKAFunction", "gka_triton"]


class CausalGKAFunction(torch.autograd.Function):
    """Causal GKA: the forward keeps x_t, the chunk-start states (and ‖H_t‖_F for Chebyshev); the backward is the
    implicit-differentiation gradient (exact for the direct solve)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, alpha, ridge: float, solver: str, num_iters: int):
        from .launch_causal import causal_fwd, fwd_plan

        q, k, v, g, beta, alpha = contiguous(q, k, v, g, beta, alpha)
        with device_guard(q):
            plan = fwd_plan(q, k, v, g, beta, alpha, solver, num_iters, ridge)
            o, saved = causal_fwd(plan, q, k, v, g, beta, alpha, ridge, save=True)
        x, fro, h0, s0 = saved
        ctx.save_for_backward(q, k, v, g, beta, alpha, x, fro, h0, s0)
        ctx.plan, ctx.ridge = plan, ridge
        return o

    @staticmethod
    def backward(ctx, do):
        from .launch_causal import causal_bwd

        q, k, v, g, beta, alpha, x, fro, h0, s0 = ctx.saved_tensors
        do = do.to(v.dtype).contiguous()
        with device_guard(do):
            grads = causal_bwd(ctx.plan, q, k, v, g, beta, alpha, x, fro, h0, s0, do, ctx.ridge)
        return (*grads, None, None, None)


class NoncausalGKAFunction(torch.autograd.Function):
    """Non-causal GKA in closed form (:mod:`.kernel_noncausal`): one forward and one backward kernel launch."""

    @staticmethod
    def forward(ctx, q, k, v, beta, alpha, ridge: float, num_iters: int, solver: str):
        from .launch_noncausal import noncausal_fwd, noncausal_plan

        q, k, v, beta, alpha = contiguous(q, k, v, beta, alpha)
        plan = noncausal_plan(q, v, beta, alpha, solver, num_iters, save=True)
        with device_guard(q):
            o, states = noncausal_fwd(plan, q, k, v, beta, alpha, ridge)
        ctx.save_for_backward(q, k, v, beta, alpha, states)
        ctx.plan, ctx.ridge = plan, ridge
        return o

    @staticmethod
    def backward(ctx, do):
        from .launch_noncausal import noncausal_bwd

        q, k, v, beta, alpha, states = ctx.saved_tensors
        do = do.to(v.dtype).contiguous()
        with device_guard(do):
            grads = noncausal_bwd(ctx.plan, q, k, v, beta, alpha, states, do, ctx.ridge)
        return (*grads, None, None, None)


def _causal(q, k, v, g, beta, alpha, ridge: float, num_iters: int, solver: str) -> torch.Tensor:
    if needs_grad(q, k, v, g, beta, alpha):
        return CausalGKAFunction.apply(q, k, v, g, beta, alpha, ridge, solver, num_iters)
    from .launch_causal import causal_fwd, fwd_plan

    q, k, v, g, beta, alpha = contiguous(q, k, v, g, beta, alpha)
    with device_guard(q):
        plan = fwd_plan(q, k, v, g, beta, alpha, solver, num_iters, ridge)
        return causal_fwd(plan, q, k, v, g, beta, alpha, ridge, save=False)[0]


def _noncausal(q, k, v, beta, alpha, ridge: float, num_iters: int, solver: str) -> torch.Tensor:
    if needs_grad(q, k, v, beta, alpha):
        return NoncausalGKAFunction.apply(q, k, v, beta, alpha, ridge, num_iters, solver)
    from .launch_noncausal import noncausal_fwd, noncausal_plan

    q, k, v, beta, alpha = contiguous(q, k, v, beta, alpha)
    plan = noncausal_plan(q, v, beta, alpha, solver, num_iters, save=False)
    with device_guard(q):
        return noncausal_fwd(plan, q, k, v, beta, alpha, ridge)[0]


@torch.compiler.disable
def gka_triton(q, k, v, g, beta, alpha, *, causal: bool, ridge: float, num_iters: int, solver: str) -> torch.Tensor:
    """Triton GKA (arguments validated, ``solver`` resolved by :func:`visionssm.kernels.gka.gka`). Non-causal calls
    take the closed form (``g`` unused); causal ones the stage-split chunk kernels."""
    if causal:
        return _causal(q, k, v, g, beta, alpha, ridge, num_iters, solver)
    return _noncausal(q, k, v, beta, alpha, ridge, num_iters, solver)
