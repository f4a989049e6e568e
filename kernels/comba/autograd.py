"""The autograd wrapper of the Comba Triton kernels and their entry point."""

from __future__ import annotations

import torch

from ..utils import device_guard, needs_grad
from .launch import bwd_plan, fwd_plan, run_bwd, run_fwd


def _forward(q, k, v, p, g, beta, scale: float, causal: bool, save_state: bool):
    plan = fwd_plan(q, v, g, beta, causal, save_state)
    return (*run_fwd(plan, q, k, v, p, g, beta, scale), plan)


def _backward(ctx, q, k, v, p, g, beta, h0, inv, do):
    fwd = ctx.plan
    plan = fwd.bwd
    if plan is None or do.dtype != v.dtype:
        plan = bwd_plan(q, v, g, beta, do, ctx.causal, inv is not None, h0.dtype)
        if fwd.cached and do.dtype == v.dtype:
            fwd.bwd = plan  # the next backward of this forward plan skips the lookup
    return run_bwd(plan, q, k, v, p, g, beta, h0, inv, do, ctx.scale)


class CombaFunction(torch.autograd.Function):
    # Not wrapped in input_guard / custom_fwd / custom_bwd: the inputs are made contiguous and the device set here
    # directly, and autocast has nothing to act on (no PyTorch op inside that it would cast), so the backward needs
    # no autocast context (entering one costs more host time than the rest of the backward's Python).
    @staticmethod
    def forward(ctx, q, k, v, p, g, beta, scale: float, causal: bool):
        q, k, v, p, g, beta = q.contiguous(), k.contiguous(), v.contiguous(), p.contiguous(), g.contiguous(), \
            beta.contiguous()
        save = any(ctx.needs_input_grad[:6])
        with device_guard(q):
            o, h0, inv, plan = _forward(q, k, v, p, g, beta, scale, causal, save)
        if save:
            ctx.save_for_backward(q, k, v, p, g, beta, h0, inv)
        ctx.scale, ctx.causal, ctx.plan = scale, causal, plan
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, p, g, beta, h0, inv = ctx.saved_tensors
        do = do.contiguous()
        with device_guard(do):
            return (*_backward(ctx, q, k, v, p, g, beta, h0, inv, do), None, None)


# Eager calls only: torch.compile and torch.export take the registered op (custom_op.py) instead.
def fused_comba(q, k, v, p, g, beta, *, scale: float, causal: bool) -> torch.Tensor:
    """Triton Comba (validated arguments expected; see :func:`visionssm.kernels.comba`)."""
    if needs_grad(q, k, v, p, g, beta):
        return CombaFunction.apply(q, k, v, p, g, beta, scale, causal)
    # nothing to differentiate: no autograd node, no saved state
    q, k, v, p, g, beta = q.contiguous(), k.contiguous(), v.contiguous(), p.contiguous(), g.contiguous(), \
        beta.contiguous()
    with device_guard(q):
        return _forward(q, k, v, p, g, beta, scale, causal, False)[0]
