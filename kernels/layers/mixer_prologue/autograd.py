"""The autograd wrapper of the prologue kernels and their entry point."""

from __future__ import annotations

import torch

from ...utils import device_guard, needs_grad
from .kernel_bwd import PARAM_SLOTS
from .launch import get_plan, run_bwd, run_fwd

# the row of each per-head parameter's gradient in the partial sums, in the order the kernels take the parameters
_PARAM_SLOTS = tuple(PARAM_SLOTS[name] for name in ("beta_bias", "alpha_bias", "A_log", "dt_bias", "feedback",
                                                    "correction"))


def _gate_view(proj, gate_cols):
    return None if gate_cols is None else proj[..., gate_cols[0]:gate_cols[0] + gate_cols[1]]


def _run_fwd(plan, proj, conv_weight, params):
    with device_guard(proj):
        return run_fwd(plan, proj, conv_weight, params)


class PrologueFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, proj, conv_weight, beta_bias, alpha_bias, A_log, dt_bias, feedback, correction, plan):
        params = (beta_bias, alpha_bias, A_log, dt_bias, feedback, correction)
        outputs = _run_fwd(plan, proj, conv_weight, params)
        ctx.save_for_backward(proj, conv_weight, *params)
        ctx.plan = plan
        # the gate columns leave as a view of proj: their gradient is written into proj's gradient in backward
        return (*outputs, _gate_view(proj, plan.gate_cols))

    @staticmethod
    def backward(ctx, dq, dk, dv, dp, dg, dbeta, dalpha, dgate):
        proj, conv_weight, *params = ctx.saved_tensors
        grads = (dq, dk, dv, dp, dg, dbeta, dalpha)
        with device_guard(proj):
            dproj, dweight, head_grads = run_bwd(ctx.plan, proj, conv_weight, params, grads, dgate)
        param_grads = tuple(None if p is None or not needed else head_grads[slot].to(p.dtype)
                            for p, slot, needed in zip(params, _PARAM_SLOTS, ctx.needs_input_grad[2:8]))
        return (dproj, dweight, *param_grads, None)


# torch.compile runs the kernels as they are (a graph break), as for the mixer ops.
@torch.compiler.disable
def fused_mixer_prologue(proj, conv_weight, params: tuple, spec) -> tuple:
    """Triton prologue (validated arguments expected; see :func:`visionssm.kernels.mixer_prologue`): ``params`` the
    six per-head parameters in the kernels' order, ``spec`` the layer's PrologueSpec."""
    if proj.stride(-1) != 1:
        proj = proj.contiguous()
    conv_weight = conv_weight.contiguous()
    H, K, V, causal, beta_col, alpha_col, decay_col, transition, eps = spec.attrs
    plan = get_plan(proj, conv_weight, params, H, K, V, causal, (beta_col, alpha_col, decay_col), spec.gate_cols,
                    transition, eps)
    if needs_grad(proj, conv_weight, *params):
        return PrologueFunction.apply(proj, conv_weight, *params, plan)
    return (*_run_fwd(plan, proj, conv_weight, params), _gate_view(proj, spec.gate_cols))
