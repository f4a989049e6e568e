"""``ska`` as a registered op (:mod:`visionssm.kernels.library`).

``visionssm::ska(q, k, v, causal, ridge, power, num_iters, normalize, save) -> (o, saved)``. ``save`` (the caller's
"a gradient will be asked for") makes the Triton forward keep what its backward reads, as the autograd.Function
does. The PyTorch path's data-dependent Cholesky retry runs inside the op, out of the traced graph.
"""

from __future__ import annotations

import torch

from .. import library
from ..dispatch import op_backend
from ..utils import device_guard
from .naive import ska_parallel


def _reference(q, k, v, causal, ridge, power, num_iters, normalize, save):
    return ska_parallel(q, k, v, causal=causal, ridge=ridge, power=power, num_iters=num_iters, normalize=normalize)


def ska_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, ridge: float, power: int,
                num_iters: int, normalize: bool, save: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    if op_backend(q, k, v) != "triton":
        return _reference(q, k, v, causal, ridge, power, num_iters, normalize, save), []
    from .launch import get_plan, kernel_inputs, run_causal_fwd, run_noncausal_fwd

    q, k, v = kernel_inputs(q, k, v, causal)
    run = run_causal_fwd if causal else run_noncausal_fwd
    with device_guard(q):
        o, saved = run(get_plan(q, k, v, causal, ridge, power, num_iters, normalize), q, k, v, save)
    return o, saved or []


def _ska_fake(q, k, v, causal, ridge, power, num_iters, normalize, save):
    o = v.new_empty(v.shape)
    if not save or op_backend(q, k, v) != "triton":
        return o, []
    from .launch import saved_shapes

    B, T, H, R = q.shape
    return o, [q.new_empty(shape, dtype=torch.float32) for shape in saved_shapes(B, T, H, R, v.shape[3], causal)]


def ska_backward(grads: list[torch.Tensor], inputs: list[torch.Tensor | None], saved: list[torch.Tensor],
                 causal: bool, ridge: float, power: int, num_iters: int, normalize: bool,
                 save: bool) -> list[torch.Tensor]:
    if op_backend(*inputs) != "triton":
        return library.reference_backward(_reference, grads, inputs, causal, ridge, power, num_iters, normalize, save)
    if not save:
        raise RuntimeError("ska: the backward needs what the forward keeps, which the op was told not to keep "
                           "(save=False)")
    from .launch import get_plan, kernel_inputs, run_causal_bwd, run_noncausal_bwd

    q, k, v = kernel_inputs(*inputs, causal)
    do = grads[0].contiguous()
    if do.dtype != v.dtype:
        do = do.to(v.dtype)
    run = run_causal_bwd if causal else run_noncausal_bwd
    with device_guard(do):
        return list(run(get_plan(q, k, v, causal, ridge, power, num_iters, normalize), q, k, v, do, saved))


ska_op = library.register("ska", ska_forward, _ska_fake, ska_backward)
