"""``layer_norm`` and ``add_layer_norm`` as registered ops (:mod:`visionssm.kernels.library`)."""

from __future__ import annotations

import torch

from ... import library
from ...utils import device_guard
from .naive import add_layer_norm_reference, layer_norm_reference


def _reference(x, weight, bias, eps, out_dtype):
    return layer_norm_reference(x, weight, bias, eps=eps).to(out_dtype)


def _add_reference(x, residual, weight, bias, eps, out_dtype):
    y, summed = add_layer_norm_reference(x, residual, weight, bias, eps=eps)
    return y.to(out_dtype), summed


def _triton(*tensors) -> bool:
    from . import MAX_CHANNELS, OP

    return library.runs_triton(OP, *tensors) and tensors[0].shape[-1] <= MAX_CHANNELS


def layer_norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                       out_dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    if not _triton(x, weight, bias):
        return _reference(x, weight, bias, eps, out_dtype), []
    from .launch import get_plan, run_fwd

    x, weight = x.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    with device_guard(x):
        return run_fwd(get_plan(x, weight, bias, eps, out_dtype), x, weight, bias, out_dtype), []


def _layer_norm_fake(x, weight, bias, eps, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype), []


def layer_norm_backward(grads: list[torch.Tensor], inputs: list[torch.Tensor | None], saved: list[torch.Tensor],
                        eps: float, out_dtype: torch.dtype) -> list[torch.Tensor]:
    x, weight, bias = inputs
    if not _triton(x, weight, bias):
        return library.reference_backward(_reference, grads, inputs, eps, out_dtype)
    from .launch import get_plan, run_bwd

    x, weight = x.contiguous(), weight.contiguous()
    with device_guard(x):
        dx, _, dweight, dbias = run_bwd(get_plan(x, weight, bias, eps, out_dtype), x, weight, grads[0])
    return [dx, dweight] if bias is None else [dx, dweight, dbias]


def add_layer_norm_forward(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           eps: float, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor,
                                                                        list[torch.Tensor]]:
    if not _triton(x, residual, weight, bias):
        return (*_add_reference(x, residual, weight, bias, eps, out_dtype), [])
    from .launch import get_plan, run_fwd

    x, residual, weight = x.contiguous(), residual.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    with device_guard(x):
        return (*run_fwd(get_plan(x, weight, bias, eps, out_dtype, residual), x, weight, bias, out_dtype, residual),
                [])


def _add_layer_norm_fake(x, residual, weight, bias, eps, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape, dtype=torch.promote_types(x.dtype,
                                                                                               residual.dtype)), []


def add_layer_norm_backward(grads: list[torch.Tensor], inputs: list[torch.Tensor | None], saved: list[torch.Tensor],
                            eps: float, out_dtype: torch.dtype) -> list[torch.Tensor]:
    x, residual, weight, bias = inputs
    if not _triton(x, residual, weight, bias):
        return library.reference_backward(_add_reference, grads, inputs, eps, out_dtype)
    from .launch import get_plan, run_bwd

    (summed,) = saved
    dy, dsummed = grads
    # the sum's gradient is written once more in the dtype of the input whose dtype differs from the sum's
    x_other = x.dtype != summed.dtype
    other_dtype = x.dtype if x_other else residual.dtype if residual.dtype != summed.dtype else None
    with device_guard(summed):
        dsum, dx_other, dweight, dbias = run_bwd(get_plan(x, weight, bias, eps, out_dtype, residual), summed,
                                                 weight.contiguous(), dy, dsummed, other_dtype)
    dx, dresidual = (dsum, dsum) if dx_other is None else (dx_other, dsum) if x_other else (dsum, dx_other)
    return [dx, dresidual, dweight] if bias is None else [dx, dresidual, dweight, dbias]


layer_norm_op = library.register("layer_norm", layer_norm_forward, _layer_norm_fake, layer_norm_backward)
add_layer_norm_op = library.register("add_layer_norm", add_layer_norm_forward, _add_layer_norm_fake,
                                     add_layer_norm_backward, saved_outputs=(1,))
