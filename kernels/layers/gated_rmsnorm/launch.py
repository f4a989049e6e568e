"""Launch layout and cached launch plans of the gated RMSNorm kernels.

Tiles of 1024 elements; warps follow the tile's size. Tests may force (through :mod:`visionssm.kernels.tuning`, op
``"gated_rmsnorm"``) ``block_rows`` (rows of B·L per program) and ``heads_per_program``; ``reference`` runs the
PyTorch reference instead. With a low-rank gate (``gate_weight``) also ``heads_per_program_bwd`` and
``programs_bwd`` (row programs of the backward, which sum the weight gradients over their row tiles); there
``block_rows`` must be a power of two >= 16 (the smallest ``tl.dot`` tile).
"""

from __future__ import annotations

import torch

from ... import tuning
from ...utils import (
    DirectLaunch,
    aligned16,
    cdiv,
    empty_output,
    empty_output_like,
    heads_per_program,
    next_pow2,
    placeholder,
    sm_count,
)
from .kernel import (
    gated_rmsnorm_bwd_kernel,
    gated_rmsnorm_fwd_kernel,
    gated_rmsnorm_lowrank_bwd_kernel,
    gated_rmsnorm_lowrank_fwd_kernel,
)

OP = "gated_rmsnorm"
SETTINGS = ("block_rows", "heads_per_program", "reference", "heads_per_program_bwd", "programs_bwd")
#: Elements of one [rows, heads, channels] tile: 8 per thread of four warps (larger tiles need many more registers).
TILE = 1024


def launch_config(R: int, H: int, D: int) -> dict:
    BD = next_pow2(D)
    HB = heads_per_program(H, BD)
    cfg = {"heads_per_program": HB, "block_rows": max(1, min(next_pow2(R), TILE // (HB * BD)))}
    cfg = tuning.apply_overrides(OP, cfg, SETTINGS)
    for name in ("heads_per_program_bwd", "programs_bwd"):
        cfg.pop(name, None)  # low-rank settings: no meaning here
    tile = cfg["block_rows"] * cfg["heads_per_program"] * BD
    cfg["num_warps"] = 4 if tile >= 1024 else 2 if tile >= 256 else 1
    return cfg


#: Largest float32 weight-gradient accumulator [rank, heads·BD] a low-rank backward program holds at eight warps
#: without spilling registers (twice that spills).
LOWRANK_ACCUMULATOR = 4096


#: Widest forward program (heads·BD columns of 16 rows) that keeps eight warps' registers moderate.
LOWRANK_FWD_COLUMNS = 512


def low_rank_fits(H: int, D: int, rank: int) -> bool:
    """Whether the low-rank kernels take this shape: one head's weight-gradient accumulator within the budget."""
    return max(16, next_pow2(rank)) * next_pow2(D) <= LOWRANK_ACCUMULATOR and next_pow2(D) <= LOWRANK_FWD_COLUMNS


def lowrank_config(NR: int, H: int, D: int, rank: int, device: torch.device) -> dict:
    """Launch settings of the low-rank gate kernels: 16 rows (the smallest dot) of every head in one forward program
    (heads padded to a power of two) up to 512 columns; in the backward as many heads as the accumulator budget allows
    and two row programs per SM (one resident at a time at these register counts) split over the head groups."""
    BD, RP = next_pow2(D), max(16, next_pow2(rank))
    HB = next_pow2(H)
    while HB > 1 and HB * BD > LOWRANK_FWD_COLUMNS:
        HB //= 2
    cfg = {"block_rows": 16, "heads_per_program": HB}
    HB_bwd = next_pow2(H)
    while HB_bwd > 1 and RP * HB_bwd * BD > LOWRANK_ACCUMULATOR:
        HB_bwd //= 2
    cfg["heads_per_program_bwd"] = HB_bwd
    sms = sm_count(device, 4)
    cfg["programs_bwd"] = max(1, cdiv(2 * sms, cdiv(H, HB_bwd)))
    cfg = tuning.apply_overrides(OP, cfg, SETTINGS)
    cfg["num_warps"] = 8 if cfg["block_rows"] * cfg["heads_per_program"] * BD >= 4096 else 4
    cfg["num_warps_bwd"] = 8
    BR = cfg["block_rows"]
    if not (isinstance(BR, int) and BR >= 16 and next_pow2(BR) == BR):
        raise ValueError(f"block_rows must be a power of two >= 16 with a low-rank gate, got {BR!r}")
    for name in ("heads_per_program", "heads_per_program_bwd"):
        HB = cfg[name]
        if not (isinstance(HB, int) and 1 <= HB <= next_pow2(H) and next_pow2(HB) == HB):
            raise ValueError(f"{name} must be a power of two in [1, {next_pow2(H)}], got {HB!r}")
    cfg["programs_bwd"] = max(1, min(cfg["programs_bwd"], cdiv(NR, BR)))
    return cfg


class Plan:
    __slots__ = ("fwd", "bwd", "bwd_args", "dw_rows", "dummy", "has_gate", "bwd_groups", "bwd_programs", "num_tiles",
                 "gate_offset", "op_args")


def _build(o, gate, activation: str, eps: float) -> Plan:
    B, L, H, D = o.shape
    R = B * L
    cfg = launch_config(R, H, D)
    BR, HB = cfg["block_rows"], cfg["heads_per_program"]
    grid = (cdiv(R, BR), cdiv(H, HB))
    plan = Plan()
    plan.has_gate = gate is not None
    plan.dummy = placeholder(o.device)
    plan.dw_rows = grid[0] * grid[1]
    dims = (R, L, 0, 0) if gate is None else (R, L, gate.stride(0), gate.stride(1))
    constexprs = {"H": H, "D": D, "BR": BR, "HB": HB, "BD": next_pow2(D), "HAS_GATE": gate is not None,
                  "SILU": activation == "silu", "EPS": eps}
    options = {"num_warps": cfg["num_warps"]}
    plan.fwd = DirectLaunch(gated_rmsnorm_fwd_kernel, grid, dims, constexprs, options)
    plan.bwd = {}
    plan.bwd_args = (gated_rmsnorm_bwd_kernel, grid, dims, constexprs, options)
    return plan


def _build_lowrank(o, gate, gate_weight, gate_bias, gate_offset: int, activation: str, eps: float) -> Plan:
    B, L, H, D = o.shape
    NR, rank = B * L, gate_weight.shape[1]
    cfg = lowrank_config(NR, H, D, rank, o.device)
    BR = cfg["block_rows"]
    plan = Plan()
    plan.has_gate = True
    plan.gate_offset, plan.op_args = gate_offset, (activation, eps)
    plan.dummy = placeholder(o.device)
    plan.num_tiles = cdiv(NR, BR)
    plan.bwd_groups = cdiv(H, cfg["heads_per_program_bwd"])
    plan.bwd_programs = cfg["programs_bwd"]
    plan.dw_rows = plan.bwd_programs * plan.bwd_groups
    # 16-bit gates are exact in tf32: on the tensor cores only the weight is rounded (to 10 mantissa bits)
    constexprs = {"H": H, "D": D, "BR": BR, "BD": next_pow2(D), "RANK": rank, "RP": max(16, next_pow2(rank)),
                  "HAS_BIAS": gate_bias is not None, "SILU": activation == "silu", "EPS": eps,
                  "PREC": "ieee" if gate.dtype == torch.float32 else "tf32"}
    dims = (NR, L, gate.stride(0), gate.stride(1), gate_offset)
    HB = cfg["heads_per_program"]
    plan.fwd = DirectLaunch(gated_rmsnorm_lowrank_fwd_kernel, (plan.num_tiles, cdiv(H, HB)), dims,
                            {**constexprs, "HB": HB}, {"num_warps": cfg["num_warps"]})
    plan.bwd = {}
    plan.bwd_args = (gated_rmsnorm_lowrank_bwd_kernel, (plan.bwd_programs, plan.bwd_groups), (*dims, plan.num_tiles),
                     {**constexprs, "HB": cfg["heads_per_program_bwd"]}, {"num_warps": cfg["num_warps_bwd"]})
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


def run_fwd_lowrank(plan: Plan, o, gate_source, gate_weight, gate_bias, weight) -> torch.Tensor:
    B, L, H, D = o.shape
    y = empty_output((B, L, H * D), device=o.device, dtype=o.dtype)
    bias = plan.dummy if gate_bias is None else gate_bias
    plan.fwd(aligned16(o, gate_source, gate_weight, gate_bias, weight, y), o, gate_source, gate_weight, bias, weight,
             y)
    return y


def run_bwd_lowrank(plan: Plan, o, gate, gate_source, gate_weight, gate_bias, weight, dy):
    """(do, dgate (B, L, rank) contiguous, dweight, dgate_weight, dgate_bias or None)."""
    dy = dy.contiguous()
    B, L, H, D = o.shape
    rank = gate_weight.shape[1]
    do = empty_output_like(o)
    if plan.bwd_groups == 1:
        dgate = dgate_partial = empty_output((B, L, rank), device=o.device, dtype=gate.dtype)
    else:  # each head group's share in float32, summed below
        dgate_partial = empty_output((plan.bwd_groups, B, L, rank), device=o.device, dtype=torch.float32)
    dw_partial = empty_output((plan.dw_rows, D), device=o.device, dtype=torch.float32)
    dgw_partial = empty_output((plan.bwd_programs, H * D, rank), device=o.device, dtype=torch.float32)
    dgb_partial = plan.dummy if gate_bias is None else empty_output((plan.bwd_programs, H * D), device=o.device,
                                                                    dtype=torch.float32)
    launch = plan.bwd.get(dy.dtype)
    if launch is None:
        launch = plan.bwd[dy.dtype] = DirectLaunch(*plan.bwd_args)
    bias = plan.dummy if gate_bias is None else gate_bias
    tensors = (o, gate_source, gate_weight, bias, weight, dy, do, dgate_partial, dw_partial, dgw_partial, dgb_partial)
    launch(aligned16(*tensors), *tensors)
    if plan.bwd_groups > 1:
        dgate = dgate_partial.sum(0).to(gate.dtype)
    dgate_bias = None if gate_bias is None else dgb_partial.sum(0).to(gate_bias.dtype)
    return do, dgate, dw_partial.sum(0).to(weight.dtype), dgw_partial.sum(0).to(gate_weight.dtype), dgate_bias


# Plans per call signature.
_PLANS = tuning.PlanCache()


def get_plan(o, gate, weight, activation: str, eps: float) -> Plan:
    key = (o.shape, o.dtype, o.device, weight.dtype, None if gate is None else (gate.stride(), gate.dtype),
           activation, eps)
    return _PLANS.get_or_build(key, lambda: _build(o, gate, activation, eps))


def get_lowrank_plan(o, gate, gate_weight, gate_bias, gate_offset: int, weight, activation: str, eps: float) -> Plan:
    key = (o.shape, o.dtype, o.device, weight.dtype, gate.stride(), gate.dtype, gate_offset, gate_weight.shape,
           gate_weight.dtype, None if gate_bias is None else gate_bias.dtype, activation, eps)
    return _PLANS.get_or_build(key, lambda: _build_lowrank(o, gate, gate_weight, gate_bias, gate_offset, activation,
                                                           eps))
