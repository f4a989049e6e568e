"""The autograd wrapper of the SKA Triton kernels and their entry point."""

from __future__ import annotations

import torch

from ..utils import device_guard, needs_grad
from .launch import get_plan, kernel_inputs, run_causal_bwd, run_causal_fwd, run_noncausal_bwd, run_noncausal_fwd


def _forward(q, k, v, causal: bool, options: tuple, save: bool):
    plan = get_plan(q, k, v, causal, *options)
    run = run_causal_fwd if causal else run_noncausal_fwd
    return (*run(plan, q, k, v, save), plan)


class SKAFunction(torch.autograd.Function):
    # The inputs are laid out for the kernels and the device set here directly; autocast has no PyTorch op inside
    # to act on.
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, ridge: float, power: int, num_iters: int, normalize: bool):
        q, k, v = kernel_inputs(q, k, v, causal)
        with device_guard(q):
            o, saved, plan = _forward(q, k, v, causal, (ridge, power, num_iters, normalize), True)
        ctx.save_for_backward(q, k, v, *saved)
        ctx.causal, ctx.plan = causal, plan
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, *saved = ctx.saved_tensors
        do = do.contiguous()
        if do.dtype != v.dtype:
            do = do.to(v.dtype)
        run = run_causal_bwd if ctx.causal else run_noncausal_bwd
        with device_guard(do):
            dq, dk, dv = run(ctx.plan, q, k, v, do, saved)
        return dq, dk, dv, None, None, None, None, None


# eager calls only: torch.compile and torch.export take the registered op (custom_op.py) instead
def fused_ska(q, k, v, *, causal: bool, ridge: float, power: int, num_iters: int, normalize: bool) -> torch.Tensor:
    """Triton SKA (validated arguments expected; see :func:`visionssm.kernels.ska`)."""
    if needs_grad(q, k, v):
        return SKAFunction.apply(q, k, v, causal, ridge, power, num_iters, normalize)
    q, k, v = kernel_inputs(q, k, v, causal)
    with device_guard(q):
        return _forward(q, k, v, causal, (ridge, power, num_iters, normalize), False)[0]
