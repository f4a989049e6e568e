"""GKA as registered ops (:mod:`visionssm.kernels.library`): ``gka_causal`` (the stage-split chunk kernels) and
``gka_noncausal`` (the closed form). ``solver`` arrives resolved (:func:`visionssm.kernels.gka.resolve_solver`).

Saved for the backward on the Triton path: causal x, H0, S0 and, for the Chebyshev solves, ‖H_t‖_F (all of them
written by the forward anyway); non-causal the per-(batch, head) states, only when ``save`` (the public function passes
whether a gradient is needed: an inference call's kernel then writes no states)."""

from __future__ import annotations

import torch

from .. import library
from ..dispatch import op_backend
from ..utils import contiguous, device_guard


def _causal_reference(q, k, v, g, beta, alpha, ridge, num_iters, solver):
    from .naive import auto_chebyshev_steps, gka_chunked

    if solver == "chebyshev_auto":  # every step in full precision here, as in the eager PyTorch path
        num_iters = auto_chebyshev_steps(ridge, coarse=False)[0]
    return gka_chunked(q, k, v, g, beta, alpha, causal=True, ridge=ridge, num_iters=num_iters,
                       exact=solver == "direct")


def _noncausal_reference(q, k, v, beta, alpha, ridge, num_iters, solver, save):
    from .naive import gka_chunked

    return gka_chunked(q, k, v, None, beta, alpha, causal=False, ridge=ridge, num_iters=num_iters,
                       exact=solver == "direct")


def gka_causal_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor | None,
                       alpha: torch.Tensor | None, ridge: float, num_iters: int,
                       solver: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    if op_backend(q, k, v, g, beta, alpha) != "triton":
        return _causal_reference(q, k, v, g, beta, alpha, ridge, num_iters, solver), []
    from .launch_causal import causal_fwd, fwd_plan

    q, k, v, g, beta, alpha = contiguous(q, k, v, g, beta, alpha)
    with device_guard(q):
        plan = fwd_plan(q, k, v, g, beta, alpha, solver, num_iters, ridge)
        o, (x, fro, h0, s0) = causal_fwd(plan, q, k, v, g, beta, alpha, ridge, save=True)
    return o, [x, h0, s0] if fro is None else [x, h0, s0, fro]


def _gka_causal_fake(q, k, v, g, beta, alpha, ridge, num_iters, solver):
    o = v.new_empty(v.shape)
    if op_backend(q, k, v, g, beta, alpha) != "triton":
        return o, []
    from .launch_causal import per_token_solve, saved_shapes

    B, T, H, K = q.shape
    K, V = int(K), int(v.shape[3])  # head widths pick the launch settings: specialised
    x, fro, h0, s0 = saved_shapes(B, T, H, K, V, per_token_solve(solver, K))
    return o, [q.new_empty(shape, dtype=torch.float32) for shape in (x, h0, s0, fro) if shape is not None]


def gka_causal_backward(grads: list[torch.Tensor], inputs: list[torch.Tensor | None], saved: list[torch.Tensor],
                        ridge: float, num_iters: int, solver: str) -> list[torch.Tensor]:
    if op_backend(*inputs) != "triton":
        return library.reference_backward(_causal_reference, grads, inputs, ridge, num_iters, solver)
    from .launch_causal import causal_bwd, fwd_plan

    q, k, v, g, beta, alpha = contiguous(*inputs)
    x, h0, s0, *rest = saved
    fro = rest[0] if rest else None
    do = grads[0].to(v.dtype).contiguous()
    with device_guard(q):
        plan = fwd_plan(q, k, v, g, beta, alpha, solver, num_iters, ridge)
        found = causal_bwd(plan, q, k, v, g, beta, alpha, x, fro, h0, s0, do, ridge)
    return [t for t in found if t is not None]


def gka_noncausal_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor | None,
                       alpha: torch.Tensor | None, ridge: float, num_iters: int, solver: str,
                       save: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    if op_backend(q, k, v, beta, alpha) != "triton":
        return _noncausal_reference(q, k, v, beta, alpha, ridge, num_iters, solver, save), []
    from .launch_noncausal import noncausal_fwd, noncausal_plan

    q, k, v, beta, alpha = contiguous(q, k, v, beta, alpha)
    with device_guard(q):
        plan = noncausal_plan(q, v, beta, alpha, solver, num_iters, save=save)
        o, states = noncausal_fwd(plan, q, k, v, beta, alpha, ridge)
    return o, [] if states is None else [states]


def _gka_noncausal_fake(q, k, v, beta, alpha, ridge, num_iters, solver, save):
    o = v.new_empty(v.shape)
    if not save or op_backend(q, k, v, beta, alpha) != "triton":
        return o, []
    from .launch_noncausal import states_shape

    B, T, H, K = q.shape
    shape = states_shape(B, T, H, int(K), int(v.shape[3]), q.dtype, v.dtype, True)
    return o, [q.new_empty(shape, dtype=torch.float32)]


def gka_noncausal_backward(grads: list[torch.Tensor], inputs: list[torch.Tensor | None], saved: list[torch.Tensor],
                        ridge: float, num_iters: int, solver: str, save: bool) -> list[torch.Tensor]:
    if op_backend(*inputs) != "triton":
        return library.reference_backward(_noncausal_reference, grads, inputs, ridge, num_iters, solver, save)
    if not save:
        raise RuntimeError("gka_noncausal: the forward ran with save=False and kept no states for the backward; pass "
                           "save=True when a gradient is needed")
    from .launch_noncausal import noncausal_bwd, noncausal_plan

    q, k, v, beta, alpha = contiguous(*inputs)
    do = grads[0].to(v.dtype).contiguous()
    with device_guard(q):
        plan = noncausal_plan(q, v, beta, alpha, solver, num_iters, save=True)
        found = noncausal_bwd(plan, q, k, v, beta, alpha, saved[0], do, ridge)
    return [t for t in found if t is not None]


gka_causal_op = library.register("gka_causal", gka_causal_forward, _gka_causal_fake, gka_causal_backward)
gka_noncausal_op = library.register("gka_noncausal", gka_noncausal_forward, _gka_noncausal_fake, gka_noncausal_backward)
