"""The autograd wrapper of the LayerNorm kernels and their entry point."""

from __future__ import annotations

import torch

from ..utils import device_guard, needs_grad
from .launch import get_plan, run_bwd, run_fwd


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, plan, out_dtype):
        ctx.save_for_backward(x2, weight)
        ctx.plan = plan
        with device_guard(x2):
            return run_fwd(plan, x2, weight, bias, out_dtype)

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        with device_guard(x2):
            dx, dweight, dbias = run_bwd(ctx.plan, x2, weight, dy)
        return dx, dweight, dbias, None, None


# torch.compile runs the kernels as they are (a graph break), as for the mixer ops.
@torch.compiler.disable
def fused_layer_norm(x, weight, bias, *, eps: float) -> torch.Tensor:
    """Triton LayerNorm over the last axis (validated arguments expected; see :func:`visionssm.kernels.layer_norm`)."""
    shape = x.shape
    x2 = x.contiguous().view(-1, shape[-1])
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    plan = get_plan(x2, weight, bias, eps)
    if needs_grad(x, weight, bias):
        y = LayerNormFunction.apply(x2, weight, bias, plan, x.dtype)
    else:
        with device_guard(x2):
            y = run_fwd(plan, x2, weight, bias, x.dtype)
    return y.view(shape)
