"""The autograd wrapper of the LayerNorm kernels and their entry point."""

from __future__ import annotations

import torch

from ..utils import device_guard, needs_grad
from .launch import get_plan, run_bwd, run_fwd


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, plan, out_dtype):
        ctx.save_for_backward(x, weight)
        ctx.plan = plan
        with device_guard(x):
            return run_fwd(plan, x, weight, bias, out_dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        with device_guard(x):
            dx, dweight, dbias = run_bwd(ctx.plan, x, weight, dy)
        return dx, dweight, dbias, None, None


# torch.compile runs the kernels as they are (a graph break), as for the mixer ops.
@torch.compiler.disable
def fused_layer_norm(x, weight, bias, *, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """Triton LayerNorm over the last axis (validated arguments expected; see :func:`visionssm.kernels.layer_norm`).
    The kernels read a contiguous x of any rank as (N, C) rows, so no reshaping views are made (host time)."""
    x = x.contiguous()
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    plan = get_plan(x, weight, bias, eps, out_dtype)
    if needs_grad(x, weight, bias):
        return LayerNormFunction.apply(x, weight, bias, plan, out_dtype)
    with device_guard(x):
        return run_fwd(plan, x, weight, bias, out_dtype)
