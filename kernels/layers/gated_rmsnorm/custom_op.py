"""``gated_rmsnorm`` as a registered op (:mod:`visionssm.kernels.library`): one op for the plain gate and the
low-rank gate (``gate_weight`` given: the gate up-projected inside the kernels)."""

from __future__ import annotations

import torch

from ... import library
from ...utils import device_guard
from .naive import gated_rmsnorm_reference, up_project_gate


def _reference(o, gate, weight, gate_weight, gate_bias, activation, eps):
    return gated_rmsnorm_reference(o, gate, weight, activation=activation, eps=eps, gate_weight=gate_weight,
                                   gate_bias=gate_bias)


def _triton(*tensors) -> bool:
    from . import OP

    return library.runs_triton(OP, *tensors)


def _layout(o, gate, weight):
    """The inputs as the kernels read them (the eager entry points' layout: a gate strided in its rows is kept)."""
    if gate is not None and gate.stride(-1) != 1:
        gate = gate.contiguous()
    return o.contiguous(), gate, weight.contiguous()


def _low_rank_in_kernels(o, gate_weight) -> bool:
    from .launch import low_rank_fits

    return low_rank_fits(o.shape[2], o.shape[3], gate_weight.shape[1])


def gated_rmsnorm_forward(o: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor,
                          gate_weight: torch.Tensor | None, gate_bias: torch.Tensor | None, activation: str,
                          eps: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    if not _triton(o, gate, weight, gate_weight, gate_bias):
        return _reference(o, gate, weight, gate_weight, gate_bias, activation, eps), []
    if gate_weight is not None and not _low_rank_in_kernels(o, gate_weight):
        # too wide for the kernels' registers: the projection in PyTorch (float32), then the plain-gate kernels
        gate, gate_weight, gate_bias = up_project_gate(gate, gate_weight, gate_bias), None, None
    o, gate, weight = _layout(o, gate, weight)
    with device_guard(o):
        if gate_weight is None:
            from .launch import get_plan, run_fwd

            return run_fwd(get_plan(o, gate, weight, activation, eps), o, gate, weight), []
        from .autograd import _gate_source
        from .launch import get_lowrank_plan, run_fwd_lowrank

        gate_weight = gate_weight.contiguous()
        source, offset = _gate_source(gate)
        plan = get_lowrank_plan(o, gate, gate_weight, gate_bias, offset, weight, activation, eps)
        return run_fwd_lowrank(plan, o, source, gate_weight, gate_bias, weight), []


def _gated_rmsnorm_fake(o, gate, weight, gate_weight, gate_bias, activation, eps):
    B, L, H, D = o.shape
    return o.new_empty((B, L, H * D)), []


def _plain_backward(o, gate, weight, dy, activation, eps):
    from .launch import get_plan, run_bwd

    o, gate, weight = _layout(o, gate, weight)
    with device_guard(o):
        return run_bwd(get_plan(o, gate, weight, activation, eps), o, gate, weight, dy)


def gated_rmsnorm_backward(grads: list[torch.Tensor], inputs: list[torch.Tensor | None], saved: list[torch.Tensor],
                           activation: str, eps: float) -> list[torch.Tensor]:
    o, gate, weight, gate_weight, gate_bias = inputs
    if not _triton(*inputs):
        return library.reference_backward(_reference, grads, inputs, activation, eps)
    (dy,) = grads
    if gate_weight is None:
        do, dgate, dweight = _plain_backward(o, gate, weight, dy, activation, eps)
        return [do, dweight] if gate is None else [do, dgate, dweight]
    if not _low_rank_in_kernels(o, gate_weight):
        # the plain kernels' gradient of the up-projected gate, then the projection's (as the eager path's autograd)
        projection = [t for t in (gate, gate_weight, gate_bias) if t is not None]
        full, project_vjp = torch.func.vjp(lambda g, w, *b: up_project_gate(g, w, b[0] if b else None), *projection)
        do, dfull, dweight = _plain_backward(o, full, weight, dy, activation, eps)
        dgate, dgate_weight, *dgate_bias = project_vjp(dfull)
        return [do, dgate, dweight, dgate_weight, *dgate_bias]
    from .autograd import _gate_source
    from .launch import get_lowrank_plan, run_bwd_lowrank

    o, gate, weight = _layout(o, gate, weight)
    gate_weight = gate_weight.contiguous()
    source, offset = _gate_source(gate)
    plan = get_lowrank_plan(o, gate, gate_weight, gate_bias, offset, weight, activation, eps)
    with device_guard(o):
        do, dgate, dweight, dgate_weight, dgate_bias = run_bwd_lowrank(plan, o, gate, source, gate_weight, gate_bias,
                                                                       weight, dy)
    return [do, dgate, dweight, dgate_weight] + ([] if gate_bias is None else [dgate_bias])


gated_rmsnorm_op = library.register("gated_rmsnorm", gated_rmsnorm_forward, _gated_rmsnorm_fake,
                                    gated_rmsnorm_backward)
