"""Launch layout and cached launch plans of the gated RMSNorm kernels.

Settings (forced through :mod:`visionssm.kernels.tuning` under the op name ``"gated_rmsnorm"``): ``block_rows``
(rows of B·L per program), ``heads_per_program``, ``num_warps``; ``reference`` runs the PyTorch reference instead.
"""

from __future__ import annotations

import torch

from .. import tuning
from ..utils import DirectLaunch, aligned16, cdiv, empty_output, empty_output_like, heads_per_program, next_pow2
from .kernel import gated_rmsnorm_bwd_kernel, gated_rmsnorm_fwd_kernel

OP = "gated_rmsnorm"
SETTINGS = ("block_rows", "heads_per_program", "num_warps", "reference")
#: Elements of one [rows, heads, channels] tile: 8 per thread of four warps (sm_90a: ~110 registers; 2048-element
#: tiles need 150–210).
TILE = 1024


def launch_config(R: int, H: int, D: int) -> dict:
    BD = next_pow2(D)
    HB = heads_per_program(H, BD)
    cfg = {"heads_per_program": HB, "block_rows": max(1, min(next_pow2(R), TILE // (HB * BD)))}
    tile = cfg["block_rows"] * HB * BD
    cfg["num_warps"] = 4 if tile >= 1024 else 2 if tile >= 256 else 1
    return tuning.apply_overrides(OP, cfg, SETTINGS)


class Plan:
    __slots__ = ("fwd", "bwd", "bwd_args", "dw_rows", "dummy", "has_gate")


def _build(o, gate, activation: str, eps: float) -> Plan:
    B, L, H, D = o.shape
    R = B * L
    cfg = launch_config(R, H, D)
    BR, HB = cfg["block_rows"], cfg["heads_per_program"]
    grid = (cdiv(R, BR), cdiv(H, HB))
    plan = Plan()
    plan.has_gate = gate is not None
    plan.dummy = torch.empty(1, device=o.device, dtype=torch.float32)
    plan.dw_rows = grid[0] * grid[1]
    dims = (R, L, 0, 0) if gate is None else (R, L, gate.stride(0), gate.stride(1))
    constexprs = {"H": H, "D": D, "BR": BR, "HB": HB, "BD": next_pow2(D), "HAS_GATE": gate is not None,
                  "SILU": activation == "silu", "EPS": eps}
    options = {"num_warps": cfg["num_warps"]}
    plan.fwd = DirectLaunch(gated_rmsnorm_fwd_kernel, grid, dims, constexprs, options)
    plan.bwd = {}
    plan.bwd_args = (gated_rmsnorm_bwd_kernel, grid, dims, constexprs, options)
    return plan


def run_fwd(plan: Plan, o, gate, weight) -> torch.Tensor:
    B, L, H, D = o.shape
    y = empty_output((B, L, H * D), device=o.device, dtype=o.dtype)
    gate_ = plan.dummy if gate is None else gate
    plan.fwd(aligned16(o, gate_, weight, y), o, gate_, weight, y)
    return y


def run_bwd(plan: Plan, o, gate, weight, dy):
    """(do, dgate or None, dweight)."""
    dy = dy.contiguous()
    do = empty_output_like(o)
    dgate = None if gate is None else empty_output(gate.shape, device=o.device, dtype=gate.dtype)
    dw_partial = empty_output((plan.dw_rows, o.shape[3]), device=o.device, dtype=torch.float32)
    gate_ = plan.dummy if gate is None else gate
    dgate_ = plan.dummy if dgate is None else dgate
    launch = plan.bwd.get(dy.dtype)
    if launch is None:
        launch = plan.bwd[dy.dtype] = DirectLaunch(*plan.bwd_args)
    launch(aligned16(o, gate_, weight, dy, do, dgate_, dw_partial), o, gate_, weight, dy, do, dgate_, dw_partial)
    return do, dgate, dw_partial.sum(0).to(weight.dtype)


# Plans per call signature.
_PLANS = tuning.PlanCache()


def get_plan(o, gate, weight, activation: str, eps: float) -> Plan:
    key = (o.shape, o.dtype, o.device, weight.dtype, None if gate is None else (gate.stride(), gate.dtype),
           activation, eps)
    return _PLANS.get_or_build(key, lambda: _build(o, gate, activation, eps))
