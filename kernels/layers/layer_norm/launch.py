"""Launch layout and cached launch plans of the LayerNorm kernels.

Rows per tile fill a 1024-element tile; warps follow the tile's size. The backward runs BWD_PROGRAMS_PER_SM programs
per SM, each walking N / programs rows and writing one partial row of the weight and bias gradients. Tests may force
``block_rows`` (rows per tile, so that tiny inputs span several tiles) through :mod:`visionssm.kernels.tuning` (op
``"layer_norm"``); ``reference`` runs the PyTorch reference instead.
"""

from __future__ import annotations

import torch

from ... import tuning
from ...utils import DirectLaunch, aligned16, cdiv, empty_output, empty_output_like, next_pow2, placeholder, sm_count
from .kernel import layer_norm_bwd_kernel, layer_norm_fwd_kernel

OP = "layer_norm"
SETTINGS = ("block_rows", "reference")
#: Backward programs per SM: enough partial rows to fill the GPU, few enough that their final sum stays cheap.
BWD_PROGRAMS_PER_SM = 4
#: Elements of one [rows, channels] tile: 8 fp32 values per thread of four warps.
TILE = 1024


def launch_config(N: int, C: int) -> dict:
    BC = next_pow2(C)
    rows = max(1, min(next_pow2(N), TILE // BC))
    tile = rows * BC
    cfg = tuning.apply_overrides(OP, {"block_rows": rows}, SETTINGS)
    cfg["num_warps"] = 8 if tile >= 4096 else 4 if tile >= 1024 else 2 if tile >= 256 else 1
    return cfg


class Plan:
    __slots__ = ("fwd", "bwd", "bwd_args", "programs", "dummy", "has_bias", "C")


def _build(x, has_bias: bool, eps: float, add_residual: bool) -> Plan:
    C = x.shape[-1]
    N = x.numel() // C
    cfg = launch_config(N, C)
    BR = cfg["block_rows"]
    plan = Plan()
    plan.has_bias, plan.C = has_bias, C
    plan.dummy = placeholder(x.device)
    sms = sm_count(x.device, 2)
    # whole tiles of rows per backward program
    rows = max(BR, cdiv(cdiv(N, sms * BWD_PROGRAMS_PER_SM), BR) * BR)
    plan.programs = cdiv(N, rows)
    constexprs = {"C": C, "BR": BR, "BC": next_pow2(C), "HAS_BIAS": has_bias, "EPS": eps}
    options = {"num_warps": cfg["num_warps"]}
    plan.fwd = DirectLaunch(layer_norm_fwd_kernel, (cdiv(N, BR),), (N,), {**constexprs, "ADD_RESIDUAL": add_residual},
                            options)
    plan.bwd = {}
    plan.bwd_args = (layer_norm_bwd_kernel, (plan.programs,), (N, rows), constexprs, options)
    return plan


def run_fwd(plan: Plan, x, weight, bias, out_dtype: torch.dtype, residual=None):
    """y of x's shape in ``out_dtype``; x is contiguous, read as (N, C) rows. With ``residual`` (contiguous, x's
    shape): (y, summed), summed = residual + x in their promoted dtype, y its norm."""
    y = empty_output_like(x) if out_dtype == x.dtype else empty_output(x.shape, device=x.device, dtype=out_dtype)
    bias_ = plan.dummy if bias is None else bias
    if residual is None:
        plan.fwd(aligned16(x, weight, bias_, y), x, plan.dummy, plan.dummy, weight, bias_, y)
        return y
    summed = empty_output(x.shape, device=x.device, dtype=torch.promote_types(x.dtype, residual.dtype))
    plan.fwd(aligned16(x, residual, summed, weight, bias_, y), x, residual, summed, weight, bias_, y)
    return y, summed


def run_bwd(plan: Plan, x, weight, dy, dsummed=None, other_dtype=None):
    """(dx, dx in ``other_dtype`` or None, dweight, dbias or None); ``dsummed`` (x's shape) is added to dx."""
    dy = dy.contiguous()
    dx = empty_output_like(x)
    dx_other = None if other_dtype is None else empty_output(x.shape, device=x.device, dtype=other_dtype)
    # the weight's and the bias's partial rows in one buffer, reduced by one launch
    partials = empty_output((1 + plan.has_bias, plan.programs, plan.C), device=x.device, dtype=torch.float32)
    dw = partials[0]
    db = partials[1] if plan.has_bias else plan.dummy
    if dsummed is not None:
        dsummed = dsummed.contiguous()
    key = (dy.dtype, None if dsummed is None else dsummed.dtype, other_dtype)
    launch = plan.bwd.get(key)
    if launch is None:
        kernel, grid, dims, constexprs, options = plan.bwd_args
        constexprs = {**constexprs, "ADD_DSUMMED": dsummed is not None, "OTHER_DTYPE": other_dtype is not None}
        launch = plan.bwd[key] = DirectLaunch(kernel, grid, dims, constexprs, options)
    dsummed_ = plan.dummy if dsummed is None else dsummed
    dx_other_ = plan.dummy if dx_other is None else dx_other
    launch(aligned16(x, weight, dy, dsummed_, dx, dx_other_, dw, db), x, weight, dy, dsummed_, dx, dx_other_, dw, db)
    sums = partials.sum(1).to(weight.dtype)
    return dx, dx_other, sums[0], sums[1] if plan.has_bias else None


# Plans per call signature.
_PLANS = tuning.PlanCache()


def get_plan(x, weight, bias, eps: float, out_dtype: torch.dtype, residual=None) -> Plan:
    # the output's dtype is part of the key: the forward kernel is compiled for it (and the residual's, with the add)
    key = (x.shape, x.dtype, x.device, weight.dtype, None if bias is None else bias.dtype, eps, out_dtype,
           None if residual is None else residual.dtype)
    return _PLANS.get_or_build(key, lambda: _build(x, bias is not None, eps, residual is not None))
