"""Gated KalmaNet (GKA) in plain PyTorch: the specification the Triton kernels are tested against.

Recurrence (Gated KalmaNet §4.1 with the vision input gate β of appendix N, eq. 55), per (batch, head):

    H_t = e^{g_t} H_{t-1} + β_t k_t k_tᵀ          (K×K data covariance, fading)
    U_t = e^{g_t} U_{t-1} + β_t v_t k_tᵀ          (V×K cross covariance)
    F_t = ‖H_t‖_F,  λ_t = ridge · (F_t + EPS)
    x̂_t = CH(H_t + λ_t I, q_t, num_iters)         Chebyshev iteration (Algorithm 1) with μ = λ_t, L = F_t + λ_t
    z_t = α_t x̂_t + (1 − α_t) q_t                 α-connection
    o_t = U_t z_t

Non-causal: H = Σ_t β_t k_t k_tᵀ and U = Σ_t β_t v_t k_tᵀ over the whole sequence (``g`` unused), then the same
solve and read-out for every query.

``EPS`` keeps the system regular when ‖H‖_F = 0 (all keys seen so far are zero): then λ = ridge·EPS, the solve
returns q / λ and the read-out is U z = 0, finite. For keys of unit norm F_t ≥ β_t, so EPS changes nothing else.

Two implementations:

* :func:`gka_recurrent` — a readable token loop (any dtype, float64 included) with ``exact=True`` replacing the
  Chebyshev iteration by an exact solve (:func:`spd_solve`, a Cholesky factorisation). This is the spec; it is slow.
* :func:`gka_chunked` — the same maths vectorised over all (batch, head) pairs and over the tokens of a chunk
  (``H_t`` materialised per token inside a chunk). This is the CPU path of :func:`visionssm.kernels.gka`; its
  gradients come from autograd through the iterations.

:func:`gka_closed_form` writes the non-causal exact solve in closed form (one solve per (batch, head)): the fast
float64 reference of the non-causal kernels at full-size shapes.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["AUTO_TOLERANCE", "EPS", "auto_chebyshev_steps", "chebyshev_solve", "chebyshev_steps", "gka_chunked",
           "gka_closed_form", "gka_recurrent", "spd_solve"]

#: Added to ‖H_t‖_F inside λ_t so that an all-zero covariance still gives a regular system (see module docstring).
EPS = 1e-6
#: What ``solver="auto"`` promises where it iterates: every x̂_t within this relative distance of the exact solution.
AUTO_TOLERANCE = 1e-3


def _convergence_rate(ridge: float) -> tuple[float, float]:
    """(κ, R): the condition number bound κ = 1 + 1/ridge of H_t + λ_t I with λ_t = ridge (F_t + EPS) (its spectrum
    lies in [λ_t, F_t + λ_t]) and Chebyshev's error factor per step R = (√κ − 1)/(√κ + 1)."""
    kappa = 1.0 + 1.0 / ridge
    root = math.sqrt(kappa)
    return kappa, (root - 1.0) / (root + 1.0)


def chebyshev_steps(ridge: float, tol: float) -> int:
    """Steps of Algorithm 1 after which the iterate is within ``tol`` (relative) of the exact ridge solution for every
    H_t: the error after r steps is at most 2 R^r / (1 + R^{2r}) (attained when H_t has rank one)."""
    _, rate = _convergence_rate(ridge)
    return max(1, math.ceil(math.log(2.0 / tol) / -math.log(rate)))


def auto_chebyshev_steps(ridge: float, coarse: bool = True) -> tuple[int, int]:
    """(steps, coarse steps) of the Chebyshev solve ``solver="auto"`` runs for causal heads wider than 16.

    With ``coarse`` the Triton kernels run the first steps with one-pass bf16 (TF32 for fp32 inputs) products: such a
    step's rounding is an error in the iterate of up to about κ·2⁻⁸, which the full-precision steps after it shrink
    like any other error, so the last steps are kept full until their bound reaches 0.5/κ. The steps are then those
    whose bound is 6e-4, leaving 4e-4 of :data:`AUTO_TOLERANCE` to the coarse steps and rounding: 29 at ridge 0.02,
    10 of them coarse. Fitted to float64 simulations of the bf16 rounding at 64- and 128-wide heads, ridge 0.005 to
    0.5 (``benchmarks/gka_coarse_steps.py``). Without, every step has split (≈ fp32) products, whose rounding stays
    below 1e-4 (8.5e-5 at worst in float64 simulations), so the bound may take 9e-4: 28 steps at ridge 0.02."""
    if not coarse:
        return chebyshev_steps(ridge, 9e-4), 0
    kappa, _ = _convergence_rate(ridge)
    steps = chebyshev_steps(ridge, 6e-4)
    return steps, max(0, steps - chebyshev_steps(ridge, 0.5 / kappa))


def chebyshev_solve(matvec, rhs: torch.Tensor, lam: torch.Tensor, fro: torch.Tensor, num_iters: int,
                    coarse_matvec=None, num_coarse: int = 0) -> torch.Tensor:
    """Algorithm 1: ``num_iters`` Chebyshev steps for ``(H + λI) x = rhs`` with eigenvalue bounds μ = λ, L = F + λ.

    ``matvec(x)`` returns ``(H + λI) x``; ``lam`` and ``fro`` broadcast against ``rhs[..., 0]``. The first
    ``num_coarse`` steps call ``coarse_matvec`` instead (to model the Triton kernels' one-pass products)."""
    lam = lam.unsqueeze(-1)
    fro = fro.unsqueeze(-1)
    step = 2.0 / (fro + 2.0 * lam)          # 2 / (L + μ)
    rho_sq = (fro * step / 2.0) ** 2        # ρ² with ρ = (L − μ) / (L + μ)
    x_prev = torch.zeros_like(rhs)
    x = step * rhs
    omega = torch.full_like(rho_sq, 2.0)
    for i in range(num_iters):
        omega = 4.0 / (4.0 - rho_sq * omega)
        product = (coarse_matvec if i < num_coarse else matvec)(x)
        x_new = x - step * omega * (product - rhs) + (omega - 1.0) * (x - x_prev)
        x_prev, x = x, x_new
    return x


def spd_solve(A: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """``A⁻¹ rhs`` for symmetric positive definite ``A`` (..., K, K) and ``rhs`` (..., K), by a Cholesky factorisation
    written with matmuls and slices only, column by column. Unlike ``torch.linalg.solve`` it exports to ONNX, and it
    is the algorithm the direct-solve kernels run, in whatever dtype ``A`` has (float64 for the spec)."""
    K = A.shape[-1]
    rows = torch.arange(K, device=A.device)
    columns = []                                          # columns of the lower-triangular factor L, zero above j
    for j in range(K):
        s = A[..., :, j]
        if columns:
            left = torch.stack(columns, dim=-1)           # (..., K, j)
            s = s - (left @ left[..., j, :].unsqueeze(-1)).squeeze(-1)
        s = s * (rows >= j).to(s.dtype)
        columns.append(s / s[..., j:j + 1].sqrt())
    L = torch.stack(columns, dim=-1)
    y = []                                                # L y = rhs
    for i in range(K):
        acc = rhs[..., i]
        if y:
            acc = acc - (L[..., i, :i] * torch.stack(y, dim=-1)).sum(-1)
        y.append(acc / L[..., i, i])
    x = [None] * K                                        # Lᵀ x = y
    for i in reversed(range(K)):
        acc = y[i]
        if i < K - 1:
            acc = acc - (L[..., i + 1:, i] * torch.stack(x[i + 1:], dim=-1)).sum(-1)
        x[i] = acc / L[..., i, i]
    return torch.stack(x, dim=-1)


def _defaults(q, g, beta, alpha, causal):
    shape = q.shape[:3]
    if g is None or not causal:
        g = q.new_zeros(shape)
    if beta is None:
        beta = q.new_ones(shape)
    if alpha is None:
        alpha = q.new_ones(shape)
    return g, beta, alpha


def gka_recurrent(q, k, v, g=None, beta=None, alpha=None, *, causal: bool = True, ridge: float = 0.02,
                  num_iters: int = 30, exact: bool = False) -> torch.Tensor:
    """Token-by-token GKA (the spec). Shapes as :func:`visionssm.kernels.gka`; computes in ``q.dtype``
    (pass float64 tensors for a float64 reference). ``exact=True`` solves exactly (:func:`spd_solve`)."""
    g, beta, alpha = _defaults(q, g, beta, alpha, causal)
    B, T, NH, K = q.shape
    V = v.shape[-1]
    eye = torch.eye(K, dtype=q.dtype, device=q.device)
    H = q.new_zeros(B, NH, K, K)
    U = q.new_zeros(B, NH, V, K)
    if not causal:
        H = torch.einsum("bth,bthi,bthj->bhij", beta, k, k)
        U = torch.einsum("bth,bthi,bthj->bhij", beta, v, k)
    outputs = []
    for t in range(T):
        kt, vt, qt = k[:, t], v[:, t], q[:, t]
        bt = beta[:, t, :, None, None]
        if causal:
            decay = g[:, t].exp()[..., None, None]
            H = decay * H + bt * kt.unsqueeze(-1) * kt.unsqueeze(-2)
            U = decay * U + bt * vt.unsqueeze(-1) * kt.unsqueeze(-2)
        fro = torch.linalg.matrix_norm(H)
        lam = ridge * (fro + EPS)
        A = H + lam[..., None, None] * eye
        if exact:
            x = spd_solve(A, qt)
        else:
            x = chebyshev_solve(lambda y, A=A: (A @ y.unsqueeze(-1)).squeeze(-1), qt, lam, fro, num_iters)
        at = alpha[:, t, :, None]
        z = at * x + (1.0 - at) * qt
        outputs.append((U @ z.unsqueeze(-1)).squeeze(-1))
    return torch.stack(outputs, dim=1)


def gka_closed_form(q, k, v, beta=None, alpha=None, *, ridge: float = 0.02) -> torch.Tensor:
    """Non-causal GKA with the exact solve: one (H + λI) per (batch, head) for every query, differentiable; equals
    ``gka_recurrent(..., causal=False, exact=True)`` (computes in ``q.dtype``)."""
    B, T, NH, K = q.shape
    beta = q.new_ones(B, T, NH) if beta is None else beta
    alpha = q.new_ones(B, T, NH) if alpha is None else alpha
    H = torch.einsum("bth,bthi,bthj->bhij", beta, k, k)
    U = torch.einsum("bth,bthi,bthj->bhij", beta, v, k)
    lam = ridge * (torch.linalg.matrix_norm(H) + EPS)
    A = H + lam[..., None, None] * torch.eye(K, dtype=q.dtype, device=q.device)
    qh = q.transpose(1, 2)
    x = torch.linalg.solve(A, qh.transpose(-1, -2)).transpose(-1, -2)
    a = alpha.transpose(1, 2).unsqueeze(-1)
    z = a * x + (1.0 - a) * qh
    return (z @ U.transpose(-1, -2)).transpose(1, 2)


def _chunk_matvec(y, *, decay, H0, kT, A, kc):
    """Rows H_t y_t of a chunk: e^{G_t} H0 y_t + Σ_s A[t, s] k_s (k_s·y_t)."""
    return decay * (y @ H0) + ((y @ kT) * A) @ kc


def gka_chunked(q, k, v, g=None, beta=None, alpha=None, *, causal: bool = True, ridge: float = 0.02,
                num_iters: int = 30, chunk_size: int = 64, exact: bool = False) -> torch.Tensor:
    """Vectorised GKA: all (batch, head) pairs and all tokens of a chunk at once, a Python loop over chunks only.

    Inside a chunk (local log-decay G, chunk-start states H0, U0, mask A[t, s] = e^{G_t − G_s} β_s for s ≤ t) the
    matrix-vector products are batched matmuls, as in the Triton kernels:
    H_t x_t = e^{G_t} H0 x_t + Σ_s A[t, s] k_s (k_s·x_t) and U_t z_t = e^{G_t} U0 z_t + Σ_s A[t, s] v_s (k_s·z_t);
    ‖H_t‖_F comes from the materialised H_t. Computes in float32 (float64 when the inputs are float64) and
    returns ``v.dtype``."""
    out_dtype = v.dtype
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    g, beta, alpha = _defaults(q, g, beta, alpha, causal)
    q, k, v, g, beta, alpha = (t.to(dtype) for t in (q, k, v, g, beta, alpha))
    B, T, NH, K = q.shape
    V = v.shape[-1]
    # (B, H, T, ·) so that (batch, head) pairs form the leading batch dimensions.
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    g, beta, alpha = (t.transpose(1, 2) for t in (g, beta, alpha))
    eye = torch.eye(K, dtype=dtype, device=q.device)

    def solve(Hx, Ht, fro, rhs):
        """(H_t + λ_t I) x = rhs; ``Hx(x)`` gives the rows H_t x_t, ``Ht()`` the materialised H_t (exact solve)."""
        lam = ridge * (fro + EPS)
        if exact:
            return spd_solve(Ht() + lam[..., None, None] * eye, rhs)
        return chebyshev_solve(lambda x: Hx(x) + lam.unsqueeze(-1) * x, rhs, lam, fro, num_iters)

    def mix(x, a, qc):
        a = a.unsqueeze(-1)
        return a * x + (1.0 - a) * qc

    if not causal:
        H = torch.einsum("bht,bhti,bhtj->bhij", beta, k, k)
        U = torch.einsum("bht,bhti,bhtj->bhij", beta, k, v)                  # Uᵀ, (K, V)
        fro = torch.linalg.matrix_norm(H).unsqueeze(-1).expand(B, NH, T)
        x = solve(lambda y: y @ H, lambda: H.unsqueeze(2).expand(B, NH, T, K, K), fro, q)
        o = mix(x, alpha, q) @ U
        return o.transpose(1, 2).to(out_dtype)

    H = q.new_zeros(B, NH, K, K)
    U = q.new_zeros(B, NH, K, V)                                              # Uᵀ, (K, V)
    outputs = []
    for start in range(0, T, chunk_size):
        sl = slice(start, min(start + chunk_size, T))
        qc, kc, vc, gc, bc, ac = q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl], alpha[:, :, sl]
        C = qc.shape[2]
        G = gc.cumsum(-1)                                                     # (B, H, C) log-decay from chunk start
        causal_mask = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        diff = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~causal_mask, float("-inf"))
        A = diff.exp() * bc.unsqueeze(-2)                                     # A[t, s] = e^{G_t − G_s} β_s, s ≤ t
        decay = G.exp().unsqueeze(-1)
        kT = kc.transpose(-1, -2)
        Ht = decay.unsqueeze(-1) * H.unsqueeze(2) + torch.einsum("bhts,bhsi,bhsj->bhtij", A, kc, kc)
        fro = torch.linalg.matrix_norm(Ht)
        x = solve(functools.partial(_chunk_matvec, decay=decay, H0=H, kT=kT, A=A, kc=kc),
                  functools.partial(torch.Tensor.clone, Ht), fro, qc)
        z = mix(x, ac, qc)
        outputs.append(decay * (z @ U) + ((z @ kT) * A) @ vc)
        w = (G[..., -1:] - G).exp() * bc                                      # e^{G_C − G_s} β_s
        end = G[..., -1].exp()[..., None, None]
        H = end * H + (kT * w.unsqueeze(-2)) @ kc
        U = end * U + (kT * w.unsqueeze(-2)) @ vc
    o = torch.cat(outputs, dim=2)
    return o.transpose(1, 2).to(out_dtype)
