"""``selective_scan`` as a registered op (:mod:`visionssm.kernels.library`).

``visionssm::selective_scan(u, delta, A, B, C, D?, z?, delta_bias?, delta_softplus, causal, return_last_state,
save_states) -> (out, last_state, saved)``: ``last_state`` is an empty tensor without ``return_last_state`` (a
schema has a fixed number of outputs). ``save_states`` (the caller's "a gradient will be asked for") makes the
Triton forward keep its chunk-start states for the backward, as the autograd.Function does.

No autocast handling: like the autograd.Function (``custom_fwd`` without ``cast_inputs``), the op takes its inputs
in the dtypes the caller passes, and autocast has no unregistered op to act on.
"""

from __future__ import annotations

import torch

from .. import library
from ..dispatch import op_backend
from .naive import selective_scan_torch


def _last_dtype(triton: bool, tensors) -> torch.dtype:
    # the Triton state is fp32; the PyTorch path's is its compute dtype
    if not triton and any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _reference(u, delta, A, B, C, D, z, delta_bias, softplus, causal, return_last_state, save_states):
    if return_last_state:
        return selective_scan_torch(u, delta, A, B, C, D, z, delta_bias, softplus, causal=causal,
                                    return_last_state=True)
    out = selective_scan_torch(u, delta, A, B, C, D, z, delta_bias, softplus, causal=causal)
    return out, u.new_empty((0,), dtype=_last_dtype(False, (u, delta, A, B, C, D, z, delta_bias)))


def _groups(B: torch.Tensor) -> int:
    return B.shape[1] if B.dim() == 4 else 1


def selective_scan_forward(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                           D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None,
                           delta_softplus: bool, causal: bool, return_last_state: bool,
                           save_states: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    tensors = (u, delta, A, B, C, D, z, delta_bias)
    if op_backend(*tensors) != "triton":
        return (*_reference(*tensors, delta_softplus, causal, return_last_state, save_states), [])
    from .launch import forward

    out, last, states, seg_sum, _ = forward(*tensors, delta_softplus, causal, return_last_state, save_states)
    if last is None:
        last = u.new_empty((0,), dtype=torch.float32)
    return out, last, [t for t in (states, seg_sum) if t is not None]


def _selective_scan_fake(u, delta, A, B, C, D, z, delta_bias, delta_softplus, causal, return_last_state,
                         save_states):
    tensors = (u, delta, A, B, C, D, z, delta_bias)
    triton = op_backend(*tensors) == "triton"
    batch, dim, length = u.shape
    nstate = A.shape[1]
    out = u.new_empty(u.shape)
    last = u.new_empty((batch, dim, nstate) if return_last_state else (0,), dtype=_last_dtype(triton, tensors))
    if not triton:
        return out, last, []
    from .launch import saved_shapes

    # the launch layout (chunks, segments) needs plain ints: the Triton path specializes on the sizes
    shapes = saved_shapes(int(batch), int(dim), int(length), int(nstate), int(_groups(B)), causal, save_states)
    return out, last, [u.new_empty(s, dtype=torch.float32) for s in shapes if s is not None]


def selective_scan_backward(grads: list[torch.Tensor], inputs: list[torch.Tensor | None], saved: list[torch.Tensor],
                            delta_softplus: bool, causal: bool, return_last_state: bool,
                            save_states: bool) -> list[torch.Tensor]:
    if op_backend(*inputs) != "triton":
        return library.reference_backward(_reference, grads, inputs, delta_softplus, causal, return_last_state,
                                          save_states)
    from .launch import backward, launch_config, saved_shapes

    u, delta, A, B, C, D, z, delta_bias = inputs
    batch, dim, length = u.shape
    nstate, groups = A.shape[1], _groups(B)
    states_shape, seg_sum_shape = saved_shapes(batch, dim, length, nstate, groups, causal, save_states)
    if not save_states and saved_shapes(batch, dim, length, nstate, groups, causal, True)[0] is not None:
        raise RuntimeError("selective_scan: the backward needs the forward's chunk states, which the op was told not "
                           "to keep (save_states=False)")
    saved = iter(saved)
    states = next(saved) if states_shape is not None else None
    seg_sum = next(saved) if seg_sum_shape is not None else None
    dout, dlast = grads
    found = backward(dout, dlast if return_last_state else None, u, delta, A, B, C, D, z, delta_bias, states, seg_sum,
                     delta_softplus, causal, launch_config(length, nstate, dim // groups, batch * groups))
    return [g for g in found if g is not None]


selective_scan_op = library.register("selective_scan", selective_scan_forward, _selective_scan_fake,
                                     selective_scan_backward)
