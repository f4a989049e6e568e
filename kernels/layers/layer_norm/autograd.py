"""The autograd wrappers of the LayerNorm kernels (alone and with the residual add) and their entry points."""

from __future__ import annotations

import torch

from ...utils import device_guard, needs_grad
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
            dx, _, dweight, dbias = run_bwd(ctx.plan, x, weight, dy)
        return dx, dweight, dbias, None, None


class AddLayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, plan, out_dtype):
        with device_guard(x):
            y, summed = run_fwd(plan, x, weight, bias, out_dtype, residual)
        ctx.save_for_backward(summed, weight)
        ctx.plan = plan
        # the sum's gradient is also written in the dtype of the input whose dtype differs from the sum's (a 16-bit
        # branch added to a float32 residual stream): no cast after the kernel (autograd casts any other mismatch)
        ctx.x_other = x.dtype != summed.dtype
        ctx.other_dtype = x.dtype if ctx.x_other else residual.dtype if residual.dtype != summed.dtype else None
        ctx.out_dtype = out_dtype
        ctx.set_materialize_grads(False)  # an unused output (the sum, after the final norm) costs no zero tensor
        return y, summed

    @staticmethod
    def backward(ctx, dy, dsummed):
        summed, weight = ctx.saved_tensors
        with device_guard(summed):
            if dy is None:
                dy = torch.zeros(summed.shape, device=summed.device, dtype=ctx.out_dtype)
            dsum, dx_other, dweight, dbias = run_bwd(ctx.plan, summed, weight, dy, dsummed, ctx.other_dtype)
        if dx_other is None:
            return dsum, dsum, dweight, dbias, None, None
        if ctx.x_other:
            return dx_other, dsum, dweight, dbias, None, None
        return dsum, dx_other, dweight, dbias, None, None


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


@torch.compiler.disable
def fused_add_layer_norm(x, residual, weight, bias, *, eps: float,
                         out_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``(LayerNorm(residual + x), residual + x)`` (validated arguments expected; see
    :func:`visionssm.kernels.layers.layer_norm.add_layer_norm`); ``out_dtype=None``: the sum's dtype."""
    x = x.contiguous()
    residual = residual.contiguous()
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    if out_dtype is None:
        out_dtype = torch.promote_types(x.dtype, residual.dtype)  # the sum's
    plan = get_plan(x, weight, bias, eps, out_dtype, residual)
    if needs_grad(x, residual, weight, bias):
        return AddLayerNormFunction.apply(x, residual, weight, bias, plan, out_dtype)
    with device_guard(x):
        return run_fwd(plan, x, weight, bias, out_dtype, residual)
