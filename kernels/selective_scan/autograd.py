"""The autograd wrapper of the selective-scan kernels and the op's Triton entry point."""

from __future__ import annotations

import torch

from ..utils import autocast_custom_bwd, autocast_custom_fwd
from .launch import backward, forward

__all__ = ["SelectiveScanFunction", "selective_scan_triton"]


class SelectiveScanFunction(torch.autograd.Function):
    @staticmethod
    @autocast_custom_fwd
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, softplus, causal, return_last_state):
        # the chunk-start states are only worth storing when a gradient will be asked for
        save = any(ctx.needs_input_grad[:8])
        out, last, states, seg_sum, cfg = forward(u, delta, A, B, C, D, z, delta_bias, softplus, causal,
                                                  return_last_state, save)
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, states, seg_sum)
        ctx.flags = (softplus, causal, return_last_state)
        ctx.cfg = cfg
        return (out, last) if return_last_state else out

    @staticmethod
    @autocast_custom_bwd
    def backward(ctx, dout, dlast=None):
        u, delta, A, B, C, D, z, delta_bias, states, seg_sum = ctx.saved_tensors
        softplus, causal, return_last_state = ctx.flags
        if dlast is not None and not return_last_state:
            dlast = None
        grads = backward(dout, dlast, u, delta, A, B, C, D, z, delta_bias, states, seg_sum, softplus, causal, ctx.cfg)
        return (*grads, None, None, None)


# eager calls only: torch.compile and torch.export take the registered op (custom_op.py) instead
def selective_scan_triton(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, *,
                          causal=True, return_last_state=False):
    """The Triton path of :func:`visionssm.kernels.selective_scan` (arguments already validated)."""
    return SelectiveScanFunction.apply(u, delta, A, B, C, D, z, delta_bias, delta_softplus, causal,
                                       return_last_state)
