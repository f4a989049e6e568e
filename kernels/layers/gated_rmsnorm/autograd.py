"""The autograd wrappers of the gated RMSNorm kernels (plain and low-rank gate) and their entry points."""

from __future__ import annotations

import torch

from ...utils import device_guard, needs_grad, traced
from .launch import get_lowrank_plan, get_plan, low_rank_fits, run_bwd, run_bwd_lowrank, run_fwd, run_fwd_lowrank
from .naive import up_project_gate


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


def _gate_source(gate):
    """(tensor, element offset) addressing the low-rank gate from a 16-byte aligned pointer: a column slice of the
    input projection's output starts unaligned, and an unaligned pointer costs every launch the JIT's slow path."""
    if traced(gate) or gate.data_ptr() % 16 == 0:  # traced: the compiler places the gate and launches the kernel
        return gate, 0
    base = gate._base
    if base is not None and base.dtype == gate.dtype and base.data_ptr() % 16 == 0:
        shift = gate.data_ptr() - base.data_ptr()
        if shift >= 0:
            return base, shift // gate.element_size()
    return gate, 0


class GatedRMSNormLowRankFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, gate, gate_weight, gate_bias, weight, plan, gate_source):
        ctx.save_for_backward(o, gate, gate_weight, gate_bias, weight)
        ctx.plan = plan
        with device_guard(o):
            return run_fwd_lowrank(plan, o, gate_source, gate_weight, gate_bias, weight)

    @staticmethod
    def backward(ctx, dy):
        o, gate, gate_weight, gate_bias, weight = ctx.saved_tensors
        source, offset = _gate_source(gate)
        plan = ctx.plan
        if offset != plan.gate_offset:  # the saved view lost its base: address it from its own pointer
            plan = get_lowrank_plan(o, gate, gate_weight, gate_bias, offset, weight, *plan.op_args)
        with device_guard(o):
            do, dgate, dweight, dgate_weight, dgate_bias = run_bwd_lowrank(plan, o, gate, source, gate_weight,
                                                                           gate_bias, weight, dy)
        # the gate's gradient is contiguous (B, L, R); autograd adds it into the strided view's base
        return do, dgate, dgate_weight, dgate_bias, dweight, None, None


@torch.compiler.disable
def fused_gated_rmsnorm_low_rank(o, gate, gate_weight, gate_bias, weight, *, activation: str,
                                 eps: float) -> torch.Tensor:
    """Triton gated RMSNorm with the low-rank gate up-projected in the kernels (validated arguments expected)."""
    if not low_rank_fits(o.shape[2], o.shape[3], gate_weight.shape[1]):
        # too wide for the kernels' registers: the projection in PyTorch (float32, as the kernels), then the op
        return fused_gated_rmsnorm(o, up_project_gate(gate, gate_weight, gate_bias), weight, activation=activation,
                                   eps=eps)
    o = o.contiguous()
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    gate_weight, weight = gate_weight.contiguous(), weight.contiguous()
    source, offset = _gate_source(gate)
    plan = get_lowrank_plan(o, gate, gate_weight, gate_bias, offset, weight, activation, eps)
    if needs_grad(o, gate, gate_weight, gate_bias, weight):
        return GatedRMSNormLowRankFunction.apply(o, gate, gate_weight, gate_bias, weight, plan, source)
    with device_guard(o):
        return run_fwd_lowrank(plan, o, source, gate_weight, gate_bias, weight)
