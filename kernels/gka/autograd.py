"""The Triton entry of the GKA op: picks the kernels for (causal, solver) and wraps them for autograd."""

from __future__ import annotations

import torch

from ..utils import device_guard

__all__ = ["GlobalGKAFunction", "gka_triton"]


class GlobalGKAFunction(torch.autograd.Function):
    """Non-causal GKA in closed form (:mod:`.global_kernels`): one forward and one backward kernel launch.

    Not wrapped in input_guard / custom_fwd / custom_bwd (host time: eager vision calls are launch-bound): the inputs
    are made contiguous and the device set here, and there is no PyTorch op inside for autocast to act on."""

    @staticmethod
    def forward(ctx, q, k, v, beta, alpha, ridge: float, num_iters: int, solver: str):
        from .global_launch import global_fwd, global_plan

        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        beta = None if beta is None else beta.contiguous()
        alpha = None if alpha is None else alpha.contiguous()
        plan = global_plan(q, v, beta, alpha, solver, num_iters, save=True)
        guard = device_guard(q)
        if guard is None:
            o, states = global_fwd(plan, q, k, v, beta, alpha, ridge)
        else:
            with guard:
                o, states = global_fwd(plan, q, k, v, beta, alpha, ridge)
        ctx.save_for_backward(q, k, v, beta, alpha, states)
        ctx.plan, ctx.ridge = plan, ridge
        return o

    @staticmethod
    def backward(ctx, do):
        from .global_launch import global_bwd

        q, k, v, beta, alpha, states = ctx.saved_tensors
        do = do.to(v.dtype).contiguous()
        guard = device_guard(do)
        if guard is None:
            grads = global_bwd(ctx.plan, q, k, v, beta, alpha, states, do, ctx.ridge)
        else:
            with guard:
                grads = global_bwd(ctx.plan, q, k, v, beta, alpha, states, do, ctx.ridge)
        return (*grads, None, None, None)


def _gka_global(q, k, v, beta, alpha, ridge: float, num_iters: int, solver: str) -> torch.Tensor:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, beta, alpha)):
        return GlobalGKAFunction.apply(q, k, v, beta, alpha, ridge, num_iters, solver)
    # nothing to differentiate: no autograd node, nothing saved
    from .global_launch import global_fwd, global_plan

    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    beta = None if beta is None else beta.contiguous()
    alpha = None if alpha is None else alpha.contiguous()
    plan = global_plan(q, v, beta, alpha, solver, num_iters, save=False)
    guard = device_guard(q)
    if guard is None:
        return global_fwd(plan, q, k, v, beta, alpha, ridge)[0]
    with guard:
        return global_fwd(plan, q, k, v, beta, alpha, ridge)[0]


@torch.compiler.disable
def gka_triton(q, k, v, g, beta, alpha, *, causal: bool, ridge: float, num_iters: int, solver: str) -> torch.Tensor:
    """Triton GKA (arguments validated, ``solver`` resolved by :func:`visionssm.kernels.gka.gka`). Non-causal calls
    take the closed form (``g`` unused); causal ones the chunked kernels."""
    if not causal:
        return _gka_global(q, k, v, beta, alpha, ridge, num_iters, solver)
    from .chunk import chunk_gka

    return chunk_gka(q, k, v, g, beta, alpha, causal=causal, ridge=ridge, num_iters=num_iters)
