"""Causal GKA, ridge systems solved by the paper's Chebyshev iteration (Algorithm 1), one chunk per program.

Within a chunk the product H_t x_t of every token is done in chunk form on tensor cores,
e^{G_t} (X H0)_t + ((A ⊙ X Kᵀ) K)_t (2K² + 4·BT·K flops per token and iteration), with μ = λ_t, L = ‖H_t‖_F + λ_t;
‖H_t‖²_F = e^{2G_t}‖H0‖² + 2 e^{G_t} Σ_s A[t,s] k_sᵀH0k_s + Σ_s A[t,s] (A (K Kᵀ)^{∘2})[t,s] comes from the chunk's
Gram matrix. The forward stores x_t and ‖H_t‖_F; the backward runs the same iteration on α_t dz_t (implicit
differentiation, appendix D) with the stored norm. Matmul precision as in :mod:`.kernel_causal` (bf16 hi/lo splits
for 16-bit inputs, with H0's and the keys' parts split once per chunk, outside the iteration).

The same kernels with ``num_iters`` chosen for fp32 convergence serve ``solver="direct"`` for heads wider than 16
(see launch_causal.converged_iters). ``solver="auto"`` runs the steps its 1e-3 promise needs, the first
``num_coarse`` of them coarse: every product in one bf16 (16-bit inputs) or TF32 pass. An early step's rounding
is an error in the iterate that the remaining full-precision steps shrink like any other, so only the last steps
need the split products (naive.auto_chebyshev_steps says how many).

``STAGE`` splits a solve over two launches of the same kernel: 0 runs every step; 1 only the coarse steps, storing
the iterate and the one before it (fp32, as the registers hold them); 2 the full steps from those. A kernel with
both loops compiled in keeps the bf16 low parts live through the coarse loop, which at 128-wide heads doubles its
spills; each stage alone holds what its own steps need.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel_causal import _hi, _lo, chunk_gates, chunk_program, load_tile, mm

__all__ = ["chebyshev_bwd_kernel", "chebyshev_fwd_kernel"]


#: The arguments each kernel stores to (some only under a constexpr flag): all that torch.compile's analysis of a
#: launch may take as written (tools/inductor_check.py, tests/kernels/test_inductor_writes.py).
WRITES = {"chebyshev_bwd_kernel": {"c_out", "dalpha", "dgp", "dq", "y_out", "y_prev"},
          "chebyshev_fwd_kernel": {"fro_out", "x_out", "x_prev"}}


@triton.jit
def _dot_acc(a, b, acc, PREC: tl.constexpr):
    """acc + a @ b of two bf16 tiles, accumulated in place (one accumulator tile for a whole chain of products)."""
    if PREC == "split_emulated":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _parts_dot(a_hi, a_lo, b_hi, b_lo, acc, PREC: tl.constexpr, B_EXACT: tl.constexpr):
    """acc + a @ b from bf16 parts split beforehand: a_hi b_hi + a_lo b_hi (+ a_hi b_lo unless b is exact)."""
    acc = _dot_acc(a_hi, b_hi, acc, PREC)
    acc = _dot_acc(a_lo, b_hi, acc, PREC)
    if not B_EXACT:
        acc = _dot_acc(a_hi, b_lo, acc, PREC)
    return acc


@triton.jit
def _matvec_acc(X, acc, Hm, Hm_hi, Hm_lo, kT, kT_hi, kT_lo, kc, kc_hi, kc_lo, A, eG, PREC: tl.constexpr,
                IN_EXACT: tl.constexpr, COARSE: tl.constexpr = False):
    """acc + rows H_t x_t of the chunk, e^{G_t} (X H0)_t + ((A ⊙ X Kᵀ) K)_t. X is split once for both of its
    products, and the intra-chunk product accumulates onto acc + e^G ⊙ (X H0) (one accumulator chain).
    ``COARSE``: each product in one pass instead (bf16 high parts only; TF32 for "tf32x3")."""
    if COARSE and PREC == "tf32x3":
        S = A * tl.dot(X, kT, input_precision="tf32")
        acc += tl.dot(X, Hm, input_precision="tf32") * eG[:, None]
        return tl.dot(S, kc, acc, input_precision="tf32")
    if COARSE and PREC != "ieee":
        x_hi = _hi(X)
        S = A * _dot_acc(x_hi, kT_hi, tl.zeros_like(A), PREC)
        acc += _dot_acc(x_hi, Hm_hi, tl.zeros_like(X), PREC) * eG[:, None]
        return _dot_acc(_hi(S), kc_hi, acc, PREC)
    if PREC == "ieee" or PREC == "tf32x3":
        S = A * tl.dot(X, kT, input_precision=PREC)
        acc += tl.dot(X, Hm, input_precision=PREC) * eG[:, None]
        return tl.dot(S, kc, acc, input_precision=PREC)
    x_hi = _hi(X)
    x_lo = _lo(X, x_hi)
    S = A * _parts_dot(x_hi, x_lo, kT_hi, kT_lo, tl.zeros_like(A), PREC, IN_EXACT)
    acc += _parts_dot(x_hi, x_lo, Hm_hi, Hm_lo, tl.zeros_like(X), PREC, False) * eG[:, None]
    s_hi = _hi(S)
    return _parts_dot(s_hi, _lo(S, s_hi), kc_hi, kc_lo, acc, PREC, IN_EXACT)


@triton.jit
def _chebyshev_step(x, x_prev, omega, rhs, scale, row, m_t, Hm, Hm_hi, Hm_lo, kT, kT_hi, kT_lo, kc, kc_hi, kc_lo, A,
                    eG, lam, step, rho2, K: tl.constexpr, PREC: tl.constexpr, IN_EXACT: tl.constexpr,
                    COARSE: tl.constexpr):
    """One step of Algorithm 1: (x, x_prev, ω) → (x_new, x, ω_new). The right-hand side is loaded again in every
    step rather than held in registers through the loop, and the residual (H_t + λ_t) x − b is one accumulator
    chain started at λ_t x − b."""
    omega = 4.0 / (4.0 - rho2 * omega)
    b = scale[:, None] * load_tile(rhs, row, m_t, K, 0, K).to(tl.float32)
    res = _matvec_acc(x, lam[:, None] * x - b, Hm, Hm_hi, Hm_lo, kT, kT_hi, kT_lo, kc, kc_hi, kc_lo, A, eG, PREC,
                      IN_EXACT, COARSE)
    return x - (step * omega)[:, None] * res + (omega - 1.0)[:, None] * (x - x_prev), x, omega


@triton.jit
def _chebyshev(rhs, scale, row, m_t, Hm, Hm_hi, Hm_lo, kT, kT_hi, kT_lo, kc, kc_hi, kc_lo, A, eG, lam, fro, num_iters,
               num_coarse, x_buf, x_prev_buf, K: tl.constexpr, PREC: tl.constexpr, IN_EXACT: tl.constexpr,
               HAS_COARSE: tl.constexpr, STAGE: tl.constexpr):
    """Algorithm 1 row-wise: ``num_iters`` steps for (H_t + λ_t I) x = b with μ = λ_t, L = ‖H_t‖_F + λ_t and
    b = scale ⊙ rhs[rows], the first ``num_coarse`` of them with one-pass products (``HAS_COARSE``: the coarse
    loop is compiled in at all; with it, the 128-wide solve spills twice as much). ``STAGE`` 1 stops after the
    coarse steps and stores x and x_prev in ``x_buf`` / ``x_prev_buf``; ``STAGE`` 2 starts from them (ω again from
    its recurrence, which only depends on the step count)."""
    step = 2.0 / (fro + 2.0 * lam)
    half = fro * step * 0.5
    rho2 = half * half
    omega = tl.full(step.shape, 2.0, tl.float32)
    if STAGE == 2:
        x = load_tile(x_buf, row, m_t, K, 0, K)
        x_prev = load_tile(x_prev_buf, row, m_t, K, 0, K)
        for _ in range(num_coarse):
            omega = 4.0 / (4.0 - rho2 * omega)
    else:
        x = (step * scale)[:, None] * load_tile(rhs, row, m_t, K, 0, K).to(tl.float32)
        x_prev = tl.zeros_like(x)
        if HAS_COARSE:
            for _ in range(num_coarse):
                x, x_prev, omega = _chebyshev_step(x, x_prev, omega, rhs, scale, row, m_t, Hm, Hm_hi, Hm_lo, kT,
                                                   kT_hi, kT_lo, kc, kc_hi, kc_lo, A, eG, lam, step, rho2, K, PREC,
                                                   IN_EXACT, True)
    if STAGE == 1:
        o_k = tl.arange(0, K)
        tl.store(x_buf + row[:, None] * K + o_k[None, :], x, mask=m_t[:, None])
        tl.store(x_prev_buf + row[:, None] * K + o_k[None, :], x_prev, mask=m_t[:, None])
    else:
        for _ in range(num_iters - num_coarse):
            x, x_prev, omega = _chebyshev_step(x, x_prev, omega, rhs, scale, row, m_t, Hm, Hm_hi, Hm_lo, kT, kT_hi,
                                               kT_lo, kc, kc_hi, kc_lo, A, eG, lam, step, rho2, K, PREC, IN_EXACT,
                                               False)
    return x


@triton.jit
def _chunk_system(k, g, beta, h0, row, m_t, base, K: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
                  IN_EXACT: tl.constexpr, HAS_BETA: tl.constexpr):
    """What the chunk's matvecs need (with the loop-invariant bf16 parts) and the mask A, e^G."""
    o_k = tl.arange(0, K)
    kc = load_tile(k, row, m_t, K, 0, K).to(tl.float32)
    b, G, g_end, Ad = chunk_gates(g, beta, row, m_t, BT, HAS_BETA)
    Hm = tl.load(h0 + base * K * K + o_k[:, None] * K + o_k[None, :])
    kT = tl.trans(kc)
    Hm_hi = _hi(Hm)
    kc_hi = _hi(kc)
    kT_hi = _hi(kT)
    return kc, kT, Hm, Hm_hi, _lo(Hm, Hm_hi), kc_hi, _lo(kc, kc_hi), kT_hi, _lo(kT, kT_hi), Ad * b[None, :], tl.exp(G)


@triton.jit
def chebyshev_fwd_kernel(q, k, g, beta, h0, x_out, fro_out, x_prev, ridge, eps, num_iters, num_coarse, T, NT,
                         H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
                         IN_EXACT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_COARSE: tl.constexpr,
                         STAGE: tl.constexpr):
    """x_t by ``num_iters`` Chebyshev steps and ‖H_t‖_F for one chunk (``STAGE``: see the module; stage 2 reads the
    norm stage 1 stored, ``x_prev`` is the iterate buffer between them)."""
    ridge = tl.cast(ridge, tl.float32)  # fp32 whatever the launcher passes (Inductor passes Python floats as fp64)
    eps = tl.cast(eps, tl.float32)
    i_b, i_h, i_c, o_t, m_t, row, base = chunk_program(T, NT, H, BT)
    o_k = tl.arange(0, K)
    kc, kT, Hm, Hm_hi, Hm_lo, kc_hi, kc_lo, kT_hi, kT_lo, A, eG = _chunk_system(
        k, g, beta, h0, row, m_t, base, K, BT, PREC, IN_EXACT, HAS_BETA)
    if STAGE == 2:
        fro = tl.load(fro_out + row, mask=m_t, other=0.0)
    else:
        khk = tl.sum(mm(kc, Hm, PREC, IN_EXACT, False) * kc, 1)
        gram = mm(kc, kT, PREC, IN_EXACT, IN_EXACT)
        h_sq = tl.sum(tl.sum(Hm * Hm, 1), 0)
        fro2 = eG * eG * h_sq + 2.0 * eG * tl.sum(A * khk[None, :], 1)
        fro2 += tl.sum(A * mm(A, gram * gram, PREC, False, False), 1)
        fro = tl.sqrt(tl.maximum(fro2, 0.0))
        tl.store(fro_out + row, fro, mask=m_t)
    lam = ridge * (fro + eps)
    X = _chebyshev(q, tl.where(m_t, 1.0, 0.0), row, m_t, Hm, Hm_hi, Hm_lo, kT, kT_hi, kT_lo, kc, kc_hi, kc_lo, A, eG,
                   lam, fro, num_iters, num_coarse, x_out, x_prev, K, PREC, IN_EXACT, HAS_COARSE, STAGE)
    if STAGE != 1:
        tl.store(x_out + row[:, None] * K + o_k[None, :], X, mask=m_t[:, None])


@triton.jit
def chebyshev_bwd_kernel(q, k, g, beta, alpha, h0, x_in, fro_in, dz, dq, dalpha, y_out, c_out, dgp, y_prev, ridge,
                         eps, num_iters, num_coarse, T, NT, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                         PREC: tl.constexpr, IN_EXACT: tl.constexpr, HAS_BETA: tl.constexpr,
                         HAS_ALPHA: tl.constexpr, HAS_COARSE: tl.constexpr, STAGE: tl.constexpr):
    """Adjoint solve y = CH(H_t + λ_t I, α_t dz_t) with the forward's ‖H_t‖_F, then dq, dα, c_t = −ridge x·y / F_t
    and dgp_t = z·dz − y·H_t x + c_t F_t² (the token part of the log-decay gradient). ``STAGE`` 1 only runs the
    coarse steps (iterates to ``y_out`` / ``y_prev``); the rest happens in stage 2 (or 0)."""
    ridge = tl.cast(ridge, tl.float32)  # fp32 whatever the launcher passes (Inductor passes Python floats as fp64)
    eps = tl.cast(eps, tl.float32)
    i_b, i_h, i_c, o_t, m_t, row, base = chunk_program(T, NT, H, BT)
    o_k = tl.arange(0, K)
    kc, kT, Hm, Hm_hi, Hm_lo, kc_hi, kc_lo, kT_hi, kT_lo, A, eG = _chunk_system(
        k, g, beta, h0, row, m_t, base, K, BT, PREC, IN_EXACT, HAS_BETA)
    fro = tl.load(fro_in + row, mask=m_t, other=0.0)
    lam = ridge * (fro + eps)
    if HAS_ALPHA:
        a = tl.load(alpha + row, mask=m_t, other=0.0).to(tl.float32)
    else:
        a = tl.where(m_t, 1.0, 0.0)
    Y = _chebyshev(dz, a, row, m_t, Hm, Hm_hi, Hm_lo, kT, kT_hi, kT_lo, kc, kc_hi, kc_lo, A, eG, lam, fro, num_iters,
                   num_coarse, y_out, y_prev, K, PREC, IN_EXACT, HAS_COARSE, STAGE)
    if STAGE != 1:
        dZ = load_tile(dz, row, m_t, K, 0, K)
        tl.store(y_out + row[:, None] * K + o_k[None, :], Y, mask=m_t[:, None])
        tl.store(dq + row[:, None] * K + o_k[None, :], ((1.0 - a[:, None]) * dZ + Y).to(dq.dtype.element_ty),
                 mask=m_t[:, None])
        X = load_tile(x_in, row, m_t, K, 0, K)
        Q = load_tile(q, row, m_t, K, 0, K).to(tl.float32)
        if HAS_ALPHA:
            tl.store(dalpha + row, tl.sum(dZ * (X - Q), 1), mask=m_t)
        c = tl.where(fro > 0, -ridge * tl.sum(X * Y, 1) / tl.where(fro > 0, fro, 1.0), 0.0)
        tl.store(c_out + row, c, mask=m_t)
        HX = _matvec_acc(X, tl.zeros_like(X), Hm, Hm_hi, Hm_lo, kT, kT_hi, kT_lo, kc, kc_hi, kc_lo, A, eG, PREC,
                         IN_EXACT)
        Z = a[:, None] * X + (1.0 - a[:, None]) * Q
        tl.store(dgp + row, tl.sum(Z * dZ, 1) - tl.sum(Y * HX, 1) + c * fro * fro, mask=m_t)
