"""``comba`` as a registered op (:mod:`visionssm.kernels.library`).

``visionssm::comba(q, k, v, p, g, beta, scale, causal, save) -> (o, saved)``: with ``save`` (a backward follows) on
the Triton path, ``saved`` is the chunk states h0 the backward reads, then the chunks' inverses where the launch layout
keeps them; empty otherwise.
"""

from __future__ import annotations

import torch

from .. import library
from ..dispatch import op_backend
from ..utils import contiguous, device_guard
from .naive import comba_chunked


def _reference(q, k, v, p, g, beta, scale, causal):
    return comba_chunked(q, k, v, p, g, beta, scale=scale, causal=causal)


def comba_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, scale: float, causal: bool,
                  save: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    # k, v, p share q's dtype and all six share a device (validated): q, g and beta decide the backend
    if op_backend(q, g, beta) != "triton":
        return _reference(q, k, v, p, g, beta, scale, causal), []
    from .launch import fwd_plan, run_fwd

    q, k, v, p, g, beta = contiguous(q, k, v, p, g, beta)
    with device_guard(q):
        o, h0, inv = run_fwd(fwd_plan(q, v, g, beta, causal, save), q, k, v, p, g, beta, scale)
    return o, [] if h0 is None else [h0] if inv is None else [h0, inv]


def _comba_fake(q, k, v, p, g, beta, scale, causal, save):
    o = v.new_empty(v.shape)
    if not save or op_backend(q, g, beta) != "triton":
        return o, []
    from .launch import training_saved_layout

    # the launch layout needs plain ints (it compares and rounds them): dynamic shapes specialise here
    B, T, H, K = (int(n) for n in q.shape)
    h0_shape, state_dtype, inv_shape = training_saved_layout(B, T, H, K, int(v.shape[3]), causal, q.dtype)
    h0 = q.new_empty(h0_shape, dtype=state_dtype)
    return o, [h0] if inv_shape is None else [h0, q.new_empty(inv_shape, dtype=torch.float32)]


def comba_backward(grads: list[torch.Tensor], inputs: list[torch.Tensor | None], saved: list[torch.Tensor],
                   scale: float, causal: bool, save: bool) -> list[torch.Tensor]:
    # the backward follows the forward's path: the Triton forward keeps its states, the reference none
    if not saved:
        return library.reference_backward(_reference, grads, inputs, scale, causal)
    from .launch import bwd_plan, run_bwd

    q, k, v, p, g, beta = contiguous(*inputs)
    h0, inv = saved[0], saved[1] if len(saved) > 1 else None
    do = grads[0].contiguous()
    with device_guard(do):
        plan = bwd_plan(q, v, g, beta, do, causal, inv is not None, h0.dtype)
        return list(run_bwd(plan, q, k, v, p, g, beta, h0, inv, do, scale))


comba_op = library.register("comba", comba_forward, _comba_fake, comba_backward)
