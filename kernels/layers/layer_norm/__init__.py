"""LayerNorm over the last axis, the norm of the isotropic backbones' blocks:
``layer_norm(x, weight, bias, *, eps, out_dtype=None)``, and with the residual add before it (a pre-norm block's
second norm): ``add_layer_norm(x, residual, weight, bias, *, eps, out_dtype=None) -> (norm, residual + x)``.

The same function as ``torch.nn.functional.layer_norm(x, (C,), weight, bias, eps)`` (:mod:`.naive` is that, and the
CPU path), its result optionally in another dtype. Backends (:mod:`visionssm.kernels.dispatch`): one Triton kernel
forward and one backward for CUDA tensors (and under ``TRITON_INTERPRET=1``), the PyTorch reference otherwise;
float64 inputs always take the PyTorch path.
Why a kernel of our own: at the backbones' shapes (many rows of a few hundred channels) PyTorch's weight-gradient
kernel is far from its byte floor. The launch setting
``reference=True`` (``kernels.tuning.launch_overrides("layer_norm", reference=True)``) runs the reference on CUDA too.
"""

from __future__ import annotations

import math

import torch

from ... import dispatch as _dispatch
from ... import library, tuning
from ...utils import check_dtype, check_same_device
from .custom_op import add_layer_norm_op, layer_norm_op
from .naive import add_layer_norm_reference, layer_norm_reference

__all__ = ["OP", "add_layer_norm", "add_layer_norm_reference", "layer_norm", "layer_norm_reference"]

OP = "layer_norm"
_IO_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_DTYPE_SET = frozenset(_IO_DTYPES)
#: Channels one tile holds (the kernels keep a row in registers).
MAX_CHANNELS = 8192
_FUSED = None


def _well_formed(x, weight, bias, eps, out_dtype) -> bool:
    """Cheap checks that accept only arguments :func:`_validate` accepts (the common case, on every call); anything
    else goes through :func:`_validate`, which names what is wrong."""
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)) or x.dim() < 1:
        return False
    shape = (x.shape[-1],)
    if x.dtype not in _DTYPE_SET or weight.dtype not in _DTYPE_SET or weight.shape != shape or x.numel() == 0:
        return False
    device = x.device
    if weight.device != device or type(eps) is not float or not 0.0 < eps < math.inf:
        return False
    if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype in _DTYPE_SET):
        return False
    return bias is None or (isinstance(bias, torch.Tensor) and bias.dtype in _DTYPE_SET and bias.shape == shape
                            and bias.device == device)


def _validate(x, weight, bias, eps, out_dtype) -> None:
    if _well_formed(x, weight, bias, eps, out_dtype):
        return
    check_dtype("x", x, _IO_DTYPES)
    if x.dim() < 1 or x.numel() == 0:
        raise ValueError(f"x must have at least one dimension and one element, got shape {tuple(x.shape)}")
    C = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None and name == "bias":
            continue
        check_dtype(name, t, _IO_DTYPES)
        if tuple(t.shape) != (C,):
            raise ValueError(f"{name} must have shape (C,) = ({C},) for x of shape {tuple(x.shape)}, got "
                             f"{tuple(t.shape)}")
    check_same_device(x=x, weight=weight, bias=bias)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
    if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype in _DTYPE_SET):
        raise TypeError(f"out_dtype must be None or one of {', '.join(map(str, _IO_DTYPES))}, got {out_dtype!r}")


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               eps: float = 1e-5, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """LayerNorm of ``x`` (..., C) over its last axis, times ``weight`` (C,) plus ``bias`` (C,) or None; returns
    x's shape, in ``out_dtype`` (default: x's dtype), computed in fp32 (float64 for float64 inputs) and rounded once.

    ``out_dtype`` lets a norm whose result goes straight into a 16-bit matrix product (a pre-norm block under
    autocast) write it in that precision: the float32 result rounded to nearest, without a cast's pass over the
    activations (the gradient then arrives in that dtype too)."""
    _validate(x, weight, bias, eps, out_dtype)
    if out_dtype is None:
        out_dtype = x.dtype
    if library.tracing():
        return layer_norm_op(x, weight, bias, float(eps), out_dtype)[0]
    if (_dispatch.select_backend(x, weight, bias) == "triton" and x.shape[-1] <= MAX_CHANNELS
            and not tuning.overrides(OP).get("reference", False)):
        return _fused()(x, weight, bias, eps=float(eps), out_dtype=out_dtype)
    return layer_norm_reference(x, weight, bias, eps=float(eps)).to(out_dtype)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   *, eps: float = 1e-5, out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer_norm(residual + x, weight, bias, eps=eps, out_dtype=out_dtype), residual + x)`` in one pass.

    ``residual`` has x's shape; the sum has ``residual + x``'s dtype (PyTorch's promotion: a float32 residual stream
    plus a 16-bit branch is float32) and is rounded to it before it is normalised, so both results equal the unfused
    composition's. The norm comes in ``out_dtype`` (default: the sum's dtype). The gradient of each input is written
    in its own dtype by the backward kernel, the residual stream's gradient added in there."""
    _validate(x, weight, bias, eps, out_dtype)
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    check_dtype("residual", residual, _IO_DTYPES)
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    check_same_device(x=x, residual=residual)
    if library.tracing():
        y, summed, _ = add_layer_norm_op(x, residual, weight, bias, float(eps),
                                         out_dtype or torch.promote_types(x.dtype, residual.dtype))
        return y, summed
    if (_dispatch.select_backend(x, residual, weight, bias) == "triton" and x.shape[-1] <= MAX_CHANNELS
            and not tuning.overrides(OP).get("reference", False)):
        return _fused(True)(x, residual, weight, bias, eps=float(eps), out_dtype=out_dtype)
    y, summed = add_layer_norm_reference(x, residual, weight, bias, eps=float(eps))
    return y.to(out_dtype or summed.dtype), summed


def _fused(add: bool = False):
    """The Triton entry points, imported on first use (importing visionssm never imports Triton)."""
    global _FUSED
    if _FUSED is None:
        from .autograd import fused_add_layer_norm, fused_layer_norm

        _FUSED = (fused_layer_norm, fused_add_layer_norm)
    return _FUSED[add]
