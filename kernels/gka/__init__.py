"""Gated KalmaNet (GKA) mixer op: test-time ridge regression at every token, causal or not.

See :mod:`visionssm.kernels.gka.naive` for the exact recurrence (the spec) and the ‖H‖_F = 0 convention. The ridge
system can be solved two ways (``solver=``): exactly (``"direct"``), or by the paper's Chebyshev iteration
(``"chebyshev"``, Algorithm 1 with ``num_iters`` steps); ``"auto"`` picks per problem (:func:`resolve_solver`)."""

from __future__ import annotations

import torch

from .. import library
from ..utils import (
    check_bool,
    check_dtype,
    check_int,
    check_layout,
    check_positive,
    check_same_device,
    check_shape,
    needs_grad,
)
from .custom_op import gka_causal_op, gka_noncausal_op

__all__ = ["SOLVERS", "SUPPORTED_HEAD_DIMS", "gka", "resolve_solver"]

#: Head dimensions (K of q/k, V of v) the Triton kernels are compiled for.
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: ``solver=`` values: the exact ridge solution, the paper's Chebyshev iteration, or :func:`resolve_solver`'s choice.
SOLVERS = ("auto", "direct", "chebyshev")


def resolve_solver(solver: str, causal: bool, head_dim: int) -> str:
    """The solver ``"auto"`` stands for: ``"direct"`` (exact) for every non-causal problem (one K×K solve per
    (batch, head)) and for causal heads of width 16 (an fp32 Cholesky factorisation per token, each token's matrix
    held by one GPU thread); for causal heads of 32 and more ``"chebyshev_auto"``: a 32-wide matrix (528 entries)
    does not fit one thread's registers, so the Triton ``"direct"`` solve there is the Chebyshev iteration run to
    fp32 convergence (60 steps at ridge 0.02), and ``"auto"`` takes the Chebyshev iteration with the fewest steps
    whose error bound stays within 1e-3 of the exact solve, on the GPU its first steps with one-pass products
    (:func:`.naive.auto_chebyshev_steps`: at ridge 0.02 29 steps, 10 of them coarse, where the CPU path runs 28 full
    ones; unlike the paper's fixed 30 it holds the 1e-3 at every ridge, e.g. 58 / 55 steps at ridge 0.005)."""
    if solver != "auto":
        return solver
    return "direct" if not causal or head_dim <= 16 else "chebyshev_auto"


def _validate(q, k, v, g, beta, alpha, causal, ridge, num_iters, solver):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_dtype(name, t, _INPUT_DTYPES)
    for name, t in (("g", g), ("beta", beta), ("alpha", alpha)):
        if t is not None:
            check_dtype(name, t, _INPUT_DTYPES)
    B, T, H, K = check_layout("q", q, "(B, T, H, K)", "B, T, H")
    check_shape("k", k, (B, T, H, K), "(B, T, H, K)")
    if v.dim() != 4:
        raise ValueError(f"v must have shape (B, T, H, V), got {tuple(v.shape)}")
    check_shape("v", v, (B, T, H, None), "(B, T, H, V)")
    V = v.shape[-1]
    if K not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q/k head dim K must be one of {SUPPORTED_HEAD_DIMS}, got {K}")
    if V not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"v head dim V must be one of {SUPPORTED_HEAD_DIMS}, got {V}")
    if k.dtype != q.dtype:
        raise TypeError(f"k must have the dtype of q ({q.dtype}), got {k.dtype}")
    for name, t in (("g", g), ("beta", beta), ("alpha", alpha)):
        if t is not None:
            check_shape(name, t, (B, T, H), "(B, T, H)")
    check_bool("causal", causal)
    if causal and g is None:
        raise ValueError("g must be given when causal=True (pass zeros for no forgetting)")
    check_positive("ridge", ridge)
    check_int("num_iters", num_iters, 1)
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, alpha=alpha)


def gka(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, beta: torch.Tensor | None = None,
        alpha: torch.Tensor | None = None, *, causal: bool = True, ridge: float = 0.02,
        num_iters: int = 30, solver: str = "auto") -> torch.Tensor:
    """Gated KalmaNet mixer.

    Args:
        q, k: ``(B, T, H, K)`` queries and keys (L2-normalised by the caller), K in {16, 32, 64, 128}.
        v: ``(B, T, H, V)`` values, V in {16, 32, 64, 128}.
        g: ``(B, T, H)`` log forgetting gate (≤ 0). Required when ``causal``; ignored (may be ``None``) otherwise.
        beta: ``(B, T, H)`` input gate in (0, 1); ``None`` means 1.
        alpha: ``(B, T, H)`` α-connection in [0, 1]; ``None`` means 1 (pure ridge-regression read-out).
        causal: token t sees tokens ≤ t with fading weights; ``False``: every token sees the whole sequence.
        ridge: a in λ_t = a·(‖H_t‖_F + EPS).
        num_iters: Chebyshev iterations (``solver="chebyshev"`` only).
        solver: ``"direct"``: the exact ridge solution x̂_t = (H_t + λ_t I)⁻¹ q_t in fp32 (a factorisation per
            (batch, head) non-causally and per token for causal 16-wide heads; for wider causal heads the Chebyshev
            iteration run to fp32 convergence);
            ``"chebyshev"``: the paper's Algorithm 1 with ``num_iters`` steps (its numerics, for checkpoints trained
            with them); ``"auto"``: :func:`resolve_solver` — exact for non-causal problems and causal heads ≤ 16
            wide, for wider causal heads the Chebyshev iteration with as many steps as its bound needs to stay
            within 1e-3 of the exact solve (28-29 at ridge 0.02; ``num_iters`` is not used).

    Returns:
        ``o``: ``(B, T, H, V)`` in the dtype of ``v``. Internally fp32 (float64 inputs stay float64 on the PyTorch
        path). Gradients flow to q, k, v, g, beta and alpha (the Triton backward differentiates the exact ridge
        solution implicitly; the PyTorch path differentiates through the iterations — they agree to the solver's
        accuracy).

    ‖H_t‖_F = 0 (every key so far is zero): λ_t = ridge·EPS (``naive.EPS`` = 1e-6) keeps the system regular,
    x̂_t = q_t / λ_t and o_t = U_t z_t = 0 — finite, though gradients wrt such keys are large (≈ 1/λ_t).
    """
    _validate(q, k, v, g, beta, alpha, causal, ridge, num_iters, solver)
    solver = resolve_solver(solver, causal, q.shape[-1])
    if library.tracing():
        if causal:
            return gka_causal_op(q, k, v, g, beta, alpha, float(ridge), num_iters, solver)[0]
        return gka_noncausal_op(q, k, v, beta, alpha, float(ridge), num_iters, solver,
                             needs_grad(q, k, v, beta, alpha))[0]
    from ..dispatch import select_backend

    if select_backend(q, k, v, g, beta, alpha) == "triton":
        from .autograd import gka_triton

        return gka_triton(q, k, v, g, beta, alpha, causal=causal, ridge=float(ridge), num_iters=num_iters,
                          solver=solver)
    from .naive import auto_chebyshev_steps, gka_chunked

    if solver == "chebyshev_auto":  # every step in full precision here: the coarse ones are a GPU speed measure
        num_iters = auto_chebyshev_steps(float(ridge), coarse=False)[0]
    return gka_chunked(q, k, v, g, beta, alpha, causal=causal, ridge=float(ridge), num_iters=num_iters,
                       exact=solver == "direct")
