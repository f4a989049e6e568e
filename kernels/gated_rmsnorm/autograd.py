"""The autograd wrapper of the gated RMSNorm kernels and their entry point."""

from __future__ import annotations

import torch

from ..utils import device_guard, needs_grad
from .launch import get_plan, run_bwd, run_fwd


class GatedRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, gate, weight, plan):
        ctx.save_for_backward(o, gate, weight)
        ctx.plan = plan
        with device_guard(o):
            return run_fwd(plan, o, gate, weight)

    @staticmethod
    def backward(ctx, dy):
        o, gate, weight = ctx.saved_tensors
        with device_guard(o):
            do, dgate, dweight = run_bwd(ctx.plan, o, gate, weight, dy)
        return do, dgate, dweight, None


# torch.compile runs the kernels as they are (a graph break), as for the mixer ops.
@torch.compiler.disable
def fused_gated_rmsnorm(o, gate, weight, *, activation: str, eps: float) -> torch.Tensor:
    """Triton gated RMSNorm (validated arguments expected; see :func:`visionssm.kernels.gated_rmsnorm`)."""
    o = o.contiguous()
    if gate is not None and gate.stride(-1) != 1:
        gate = gate.contiguous()
    weight = weight.contiguous()
    plan = get_plan(o, gate, weight, activation, eps)
    if needs_grad(o, weight, gate):
        return GatedRMSNormFunction.apply(o, gate, weight, plan)
    with device_guard(o):
        return run_fwd(plan, o, gate, weight)
