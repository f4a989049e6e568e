"""Triton kernels for GKA: chunk-parallel Chebyshev solve with the chunk-wise ‖H_t‖_F of Gated KalmaNet §4.2.1,
and the implicit-differentiation backward of §4.2.2 / appendix D.

Notation (per (batch, head), chunk of BT tokens, local log-decay G_t = Σ_{s≤t in chunk} g_s, chunk-start states
H0 = H_{[c]}, S0 = U_{[c]}ᵀ (K×V)):

    A[t, s]   = e^{G_t − G_s} β_s  (s ≤ t)            intra-chunk mask
    H_t x     = e^{G_t} H0 x + Σ_s A[t, s] k_s (k_s·x)   → rows: e^G ⊙ (X H0) + (A ⊙ X Kᵀ) K
    ‖H_t‖²_F  = e^{2G_t}‖H0‖² + 2 e^{G_t} Σ_s A[t,s] k_sᵀH0k_s + Σ_s A[t,s] (A (KKᵀ)^{∘2})[t,s]
    U_t z     = e^G ⊙ (Z S0) + (A ⊙ Z Kᵀ) V

Forward: ``state`` kernel (sequential over chunks, one program per (b, h)) writes every chunk-start H0, S0;
``solve`` kernel (one program per (chunk, b, h)) computes ‖H_t‖_F, x̂_t by Chebyshev, z_t and o_t.
Non-causal: the state kernel reduces H, U over the whole sequence once and every chunk reads that one state.

Backward (implicit differentiation, no stored iterates; x̂_t and ‖H_t‖_F are saved):
    dz_t = U_tᵀ do_t,  dα_t = dz_t·(x_t − q_t),  y_t = CH(H_t + λ_t I, α_t dz_t)  (adjoint solve),
    dq_t = (1 − α_t) dz_t + y_t,
    dH_t = −y_t x_tᵀ + c_t H_t with c_t = −a (x_t·y_t)/‖H_t‖_F  (the λ = a‖H‖_F path, eq. 13/40),  dU_t = do_t z_tᵀ.
Then dk, dv, dβ from the adjoint states D_s = Σ_{t≥s} e^{G_t−G_s} dH_t (carried backwards across chunks by the
``bwd_state`` kernel, built intra-chunk with masks), and dg from dG_t = ⟨dH_t, H_t⟩ + ⟨dU_t, U_t⟩ − β_t dβ_t
(appendix D eqs. 16–24) followed by a reverse cumulative sum.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..utils import autocast_custom_bwd, autocast_custom_fwd, empty_output, input_guard
from .naive import EPS

__all__ = ["chunk_gka"]

#: Matmul precision of the Chebyshev matvecs on tensor cores (see _launch_config).
DOT_PRECISION = "tf32x3"


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _materialize(Hm, kc, A, eG, BT: tl.constexpr, K: tl.constexpr):
    """H_t for every token of the chunk as a (BT, K, K) tile: e^{G_t} H0 + Σ_s A[t, s] k_s k_sᵀ."""
    kk = tl.reshape(kc[:, :, None] * kc[:, None, :], (BT, K * K))
    flat = eG[:, None] * tl.reshape(Hm, (1, K * K)) + _dot(A, kk, "tf32x3")
    return tl.reshape(flat, (BT, K, K))


@triton.jit
def _hmatvec(X, Hm, Ht, kc, A, eG, CAUSAL: tl.constexpr, MAT: tl.constexpr, PREC: tl.constexpr):
    """Rows of H_t x_t for every token of the chunk (MAT: from the materialised H_t, exact fp32 on CUDA cores)."""
    if MAT:
        return tl.sum(Ht * X[:, None, :], 2)
    HX = _dot(X, Hm, PREC)
    if CAUSAL:
        HX = HX * eG[:, None] + _dot(A * _dot(X, tl.trans(kc), PREC), kc, PREC)
    return HX


@triton.jit
def _chebyshev(rhs, Hm, Ht, kc, A, eG, lam, fro, NUM_ITERS: tl.constexpr, CAUSAL: tl.constexpr, MAT: tl.constexpr,
               PREC: tl.constexpr):
    """Algorithm 1 row-wise: μ = λ_t, L = ‖H_t‖_F + λ_t, the iteration count fixed."""
    step = 2.0 / (fro + 2.0 * lam)
    half = fro * step * 0.5
    rho2 = half * half
    x_prev = tl.zeros_like(rhs)
    x = step[:, None] * rhs
    omega = tl.full(step.shape, 2.0, tl.float32)
    for _ in range(NUM_ITERS):
        omega = 4.0 / (4.0 - rho2 * omega)
        res = _hmatvec(x, Hm, Ht, kc, A, eG, CAUSAL, MAT, PREC) + lam[:, None] * x - rhs
        x_new = x - (step * omega)[:, None] * res + (omega - 1.0)[:, None] * (x - x_prev)
        x_prev = x
        x = x_new
    return x


@triton.jit
def _gates(g, beta, row, offs_t, mask_t, BT: tl.constexpr, CAUSAL: tl.constexpr, HAS_BETA: tl.constexpr):
    """β, the local cumulative log-decay G, e^G, the (unweighted) mask Ã and A = Ã·β for one chunk."""
    if HAS_BETA:
        b = tl.load(beta + row, mask=mask_t, other=0.0).to(tl.float32)
    else:
        b = tl.where(mask_t, 1.0, 0.0)
    if CAUSAL:
        gc = tl.load(g + row, mask=mask_t, other=0.0).to(tl.float32)
        G = tl.cumsum(gc, 0)
        causal = offs_t[:, None] >= offs_t[None, :]
        At = tl.where(causal, tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0)
    else:
        G = tl.zeros([BT], tl.float32)
        At = tl.zeros([BT, BT], tl.float32)
    return b, G, tl.exp(G), At, At * b[None, :]


@triton.jit
def gka_fwd_state_kernel(k, v, g, beta, h0, s0, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BT: tl.constexpr, CAUSAL: tl.constexpr, HAS_BETA: tl.constexpr, PREC: tl.constexpr):
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, K)
    offs_v = tl.arange(0, V)
    Hs = tl.zeros([K, K], tl.float32)
    Ss = tl.zeros([K, V], tl.float32)
    for i_t in range(NT):
        t = i_t * BT + offs_t
        mask_t = t < T
        row = (i_b * T + t) * H + i_h
        kc = tl.load(k + row[:, None] * K + offs_k[None, :], mask=mask_t[:, None], other=0.0).to(tl.float32)
        vc = tl.load(v + row[:, None] * V + offs_v[None, :], mask=mask_t[:, None], other=0.0).to(tl.float32)
        if HAS_BETA:
            b = tl.load(beta + row, mask=mask_t, other=0.0).to(tl.float32)
        else:
            b = tl.where(mask_t, 1.0, 0.0)
        if CAUSAL:
            base = (i_bh * NT + i_t)
            tl.store(h0 + base * K * K + offs_k[:, None] * K + offs_k[None, :], Hs)
            tl.store(s0 + base * K * V + offs_k[:, None] * V + offs_v[None, :], Ss)
            gc = tl.load(g + row, mask=mask_t, other=0.0).to(tl.float32)
            G = tl.cumsum(gc, 0)
            g_end = tl.sum(gc, 0)
            kw = kc * (tl.exp(g_end - G) * b)[:, None]
            decay = tl.exp(g_end)
            Hs = Hs * decay + _dot(tl.trans(kw), kc, PREC)
            Ss = Ss * decay + _dot(tl.trans(kw), vc, PREC)
        else:
            kw = kc * b[:, None]
            Hs += _dot(tl.trans(kw), kc, PREC)
            Ss += _dot(tl.trans(kw), vc, PREC)
    if not CAUSAL:
        tl.store(h0 + i_bh * K * K + offs_k[:, None] * K + offs_k[None, :], Hs)
        tl.store(s0 + i_bh * K * V + offs_k[:, None] * V + offs_v[None, :], Ss)


@triton.jit
def gka_fwd_solve_kernel(q, k, v, g, beta, alpha, h0, s0, o, x_out, fro_out, T, NT, ridge, eps,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                         NUM_ITERS: tl.constexpr, CAUSAL: tl.constexpr, HAS_BETA: tl.constexpr,
                         HAS_ALPHA: tl.constexpr, MAT: tl.constexpr, PREC: tl.constexpr):
    # Only what the Chebyshev loop needs is loaded before it (register pressure: the loop runs NUM_ITERS times).
    i_bh = tl.program_id(0).to(tl.int64)
    i_t = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, K)
    offs_v = tl.arange(0, V)
    t = i_t * BT + offs_t
    mask_t = t < T
    row = (i_b * T + t) * H + i_h
    p_q = q + row[:, None] * K + offs_k[None, :]
    kc = tl.load(k + row[:, None] * K + offs_k[None, :], mask=mask_t[:, None], other=0.0).to(tl.float32)
    b, G, eG, At, A = _gates(g, beta, row, offs_t, mask_t, BT, CAUSAL, HAS_BETA)
    if CAUSAL:
        state = i_bh * NT + i_t
    else:
        state = i_bh
    Hm = tl.load(h0 + state * K * K + offs_k[:, None] * K + offs_k[None, :])

    h_sq = tl.sum(tl.sum(Hm * Hm, 1), 0)
    Ht = Hm
    if MAT:
        Ht = _materialize(Hm, kc, A, eG, BT, K)
        fro2 = tl.sum(tl.sum(Ht * Ht, 2), 1)
    elif CAUSAL:
        gram = _dot(kc, tl.trans(kc), PREC)
        khk = tl.sum(_dot(kc, Hm, PREC) * kc, 1)
        fro2 = eG * eG * h_sq + 2.0 * eG * tl.sum(A * khk[None, :], 1) + tl.sum(A * _dot(A, gram * gram, PREC), 1)
    else:
        fro2 = tl.zeros([BT], tl.float32) + h_sq
    fro = tl.sqrt(tl.maximum(fro2, 0.0))
    lam = ridge * (fro + eps)
    qc = tl.load(p_q, mask=mask_t[:, None], other=0.0).to(tl.float32)
    X = _chebyshev(qc, Hm, Ht, kc, A, eG, lam, fro, NUM_ITERS, CAUSAL, MAT, PREC)
    tl.store(x_out + row[:, None] * K + offs_k[None, :], X, mask=mask_t[:, None])
    tl.store(fro_out + row, fro, mask=mask_t)

    if HAS_ALPHA:
        a = tl.load(alpha + row, mask=mask_t, other=0.0).to(tl.float32)
        Z = a[:, None] * X + (1.0 - a[:, None]) * qc
    else:
        Z = X
    Sm = tl.load(s0 + state * K * V + offs_k[:, None] * V + offs_v[None, :])
    O = _dot(Z, Sm, PREC)
    if CAUSAL:
        vc = tl.load(v + row[:, None] * V + offs_v[None, :], mask=mask_t[:, None], other=0.0).to(tl.float32)
        O = O * eG[:, None] + _dot(A * _dot(Z, tl.trans(kc), PREC), vc, PREC)
    tl.store(o + row[:, None] * V + offs_v[None, :], O.to(o.dtype.element_ty), mask=mask_t[:, None])


@triton.jit
def gka_bwd_solve_kernel(q, k, v, g, beta, alpha, h0, s0, x_in, fro_in, do, dq, dalpha, y_out, dgp, dh_sum, du_sum,
                         T, NT, ridge, eps, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                         NUM_ITERS: tl.constexpr, CAUSAL: tl.constexpr, HAS_BETA: tl.constexpr,
                         HAS_ALPHA: tl.constexpr, MAT: tl.constexpr, PREC: tl.constexpr):
    """Adjoint solve per chunk: dq, dα, y, the token part of dG, and this chunk's contribution to the adjoint
    states (decayed to the chunk start): Σ_t e^{G_t} (dH_t + dH_tᵀ) and Σ_t e^{G_t} z_t do_tᵀ.

    Everything that does not need y is done (and stored) before the Chebyshev loop, and what is needed after it is
    re-loaded, so that the loop's live set is small."""
    i_bh = tl.program_id(0).to(tl.int64)
    i_t = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, K)
    offs_v = tl.arange(0, V)
    t = i_t * BT + offs_t
    mask_t = t < T
    row = (i_b * T + t) * H + i_h
    p_x = x_in + row[:, None] * K + offs_k[None, :]
    kc = tl.load(k + row[:, None] * K + offs_k[None, :], mask=mask_t[:, None], other=0.0).to(tl.float32)
    dO = tl.load(do + row[:, None] * V + offs_v[None, :], mask=mask_t[:, None], other=0.0).to(tl.float32)
    b, G, eG, At, A = _gates(g, beta, row, offs_t, mask_t, BT, CAUSAL, HAS_BETA)
    if CAUSAL:
        state = i_bh * NT + i_t
    else:
        state = i_bh
    base = i_bh * NT + i_t

    # dz_t = U_tᵀ do_t, then everything that only needs z and dz.
    Sm = tl.load(s0 + state * K * V + offs_k[:, None] * V + offs_v[None, :])
    dZ = _dot(dO, tl.trans(Sm), PREC)
    if CAUSAL:
        vc = tl.load(v + row[:, None] * V + offs_v[None, :], mask=mask_t[:, None], other=0.0).to(tl.float32)
        dZ = dZ * eG[:, None] + _dot(A * _dot(dO, tl.trans(vc), PREC), kc, PREC)
    X = tl.load(p_x, mask=mask_t[:, None], other=0.0)
    if HAS_ALPHA:
        qc = tl.load(q + row[:, None] * K + offs_k[None, :], mask=mask_t[:, None], other=0.0).to(tl.float32)
        a = tl.load(alpha + row, mask=mask_t, other=0.0).to(tl.float32)
        tl.store(dalpha + row, tl.sum(dZ * (X - qc), 1), mask=mask_t)
        Z = a[:, None] * X + (1.0 - a[:, None]) * qc
        dX = a[:, None] * dZ
    else:
        Z = X
        dX = dZ
    zdz = tl.sum(Z * dZ, 1)
    DU = _dot(tl.trans(Z), dO * eG[:, None], PREC)
    tl.store(du_sum + base * K * V + offs_k[:, None] * V + offs_v[None, :], DU)

    # Adjoint solve y = (H_t + λ_t I)⁻¹ α_t dz_t.
    fro = tl.load(fro_in + row, mask=mask_t, other=0.0)
    lam = ridge * (fro + eps)
    Hm = tl.load(h0 + state * K * K + offs_k[:, None] * K + offs_k[None, :])
    Ht = Hm
    if MAT:
        Ht = _materialize(Hm, kc, A, eG, BT, K)
    Y = _chebyshev(dX, Hm, Ht, kc, A, eG, lam, fro, NUM_ITERS, CAUSAL, MAT, PREC)
    DQ = dZ - dX + Y
    tl.store(dq + row[:, None] * K + offs_k[None, :], DQ.to(dq.dtype.element_ty), mask=mask_t[:, None])
    tl.store(y_out + row[:, None] * K + offs_k[None, :], Y, mask=mask_t[:, None])

    X = tl.load(p_x, mask=mask_t[:, None], other=0.0)
    c = tl.where(fro > 0, -ridge * tl.sum(X * Y, 1) / tl.where(fro > 0, fro, 1.0), 0.0)
    HX = _hmatvec(X, Hm, Ht, kc, A, eG, CAUSAL, MAT, PREC)
    tl.store(dgp + row, zdz - tl.sum(Y * HX, 1) + c * fro * fro, mask=mask_t)

    Ye = Y * eG[:, None]
    Xe = X * eG[:, None]
    DH = -(_dot(tl.trans(Ye), X, PREC) + _dot(tl.trans(Xe), Y, PREC))
    DH += (2.0 * tl.sum(c * eG * eG, 0)) * Hm
    if CAUSAL:
        u = tl.sum(A * (c * eG)[:, None], 0)
        DH += 2.0 * _dot(tl.trans(kc * u[:, None]), kc, PREC)
    tl.store(dh_sum + base * K * K + offs_k[:, None] * K + offs_k[None, :], DH)


@triton.jit
def gka_bwd_state_kernel(g, dh, du, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    """In place: chunk contributions (decayed to the chunk start) → adjoint states at each chunk's end."""
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, K)
    offs_v = tl.arange(0, V)
    Es = tl.zeros([K, K], tl.float32)
    Us = tl.zeros([K, V], tl.float32)
    for j in range(NT):
        i_t = NT - 1 - j
        t = i_t * BT + offs_t
        mask_t = t < T
        gc = tl.load(g + (i_b * T + t) * H + i_h, mask=mask_t, other=0.0).to(tl.float32)
        decay = tl.exp(tl.sum(gc, 0))
        base = i_bh * NT + i_t
        p_h = dh + base * K * K + offs_k[:, None] * K + offs_k[None, :]
        p_u = du + base * K * V + offs_k[:, None] * V + offs_v[None, :]
        ch = tl.load(p_h)
        cu = tl.load(p_u)
        tl.store(p_h, Es)
        tl.store(p_u, Us)
        Es = Es * decay + ch
        Us = Us * decay + cu


@triton.jit
def gka_bwd_grad_kernel(q, k, v, g, beta, alpha, h0, x_in, y_in, fro_in, dgp, do, dh_end, du_end, dk, dv, dbeta, dG,
                        T, NT, ridge, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                        CAUSAL: tl.constexpr, HAS_BETA: tl.constexpr, HAS_ALPHA: tl.constexpr,
                        PREC: tl.constexpr):
    """dk, dv, dβ and dG (before the reverse cumulative sum) of one chunk."""
    i_bh = tl.program_id(0).to(tl.int64)
    i_t = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, K)
    offs_v = tl.arange(0, V)
    t = i_t * BT + offs_t
    mask_t = t < T
    row = (i_b * T + t) * H + i_h
    kc = tl.load(k + row[:, None] * K + offs_k[None, :], mask=mask_t[:, None], other=0.0).to(tl.float32)
    vc = tl.load(v + row[:, None] * V + offs_v[None, :], mask=mask_t[:, None], other=0.0).to(tl.float32)
    b, G, eG, At, A = _gates(g, beta, row, offs_t, mask_t, BT, CAUSAL, HAS_BETA)
    if CAUSAL:
        state = i_bh * NT + i_t
    else:
        state = i_bh
    Es = tl.load(dh_end + state * K * K + offs_k[:, None] * K + offs_k[None, :])
    Us = tl.load(du_end + state * K * V + offs_k[:, None] * V + offs_v[None, :])
    R = _dot(kc, Es, PREC)
    Q = _dot(vc, tl.trans(Us), PREC)
    DV = _dot(kc, Us, PREC)
    if CAUSAL:
        # Loads sit next to their uses so that few (BT, K) tiles are live at once.
        g_end = tl.sum(tl.where(offs_t == BT - 1, G, 0.0), 0)
        w_end = tl.exp(g_end - G)
        R = R * w_end[:, None]
        Q = Q * w_end[:, None]
        DV = DV * w_end[:, None]
        kT = tl.trans(kc)
        p_x = x_in + row[:, None] * K + offs_k[None, :]
        X = tl.load(p_x, mask=mask_t[:, None], other=0.0)
        if HAS_ALPHA:
            qc = tl.load(q + row[:, None] * K + offs_k[None, :], mask=mask_t[:, None], other=0.0).to(tl.float32)
            a = tl.load(alpha + row, mask=mask_t, other=0.0).to(tl.float32)
            Z = a[:, None] * X + (1.0 - a[:, None]) * qc
        else:
            Z = X
        dO = tl.load(do + row[:, None] * V + offs_v[None, :], mask=mask_t[:, None], other=0.0).to(tl.float32)
        Q += _dot(tl.trans(At * _dot(dO, tl.trans(vc), PREC)), Z, PREC)
        DV += _dot(tl.trans(At * _dot(Z, kT, PREC)), dO, PREC)
        Y = tl.load(y_in + row[:, None] * K + offs_k[None, :], mask=mask_t[:, None], other=0.0)
        fro = tl.load(fro_in + row, mask=mask_t, other=0.0)
        c = tl.where(fro > 0, -ridge * tl.sum(X * Y, 1) / tl.where(fro > 0, fro, 1.0), 0.0)
        R -= _dot(tl.trans(At * _dot(X, kT, PREC)), Y, PREC) + _dot(tl.trans(At * _dot(Y, kT, PREC)), X, PREC)
        W = _dot(tl.trans(At * c[:, None]), A, PREC)
        R += 2.0 * _dot(W * _dot(kc, kT, PREC), kc, PREC)
        Hm = tl.load(h0 + state * K * K + offs_k[:, None] * K + offs_k[None, :])
        R += (2.0 * tl.sum(At * (c * eG)[:, None], 0))[:, None] * _dot(kc, Hm, PREC)
    DK = b[:, None] * (R + Q)
    DB = tl.sum(kc * (0.5 * R + Q), 1)
    DV = b[:, None] * DV
    tl.store(dk + row[:, None] * K + offs_k[None, :], DK.to(dk.dtype.element_ty), mask=mask_t[:, None])
    tl.store(dv + row[:, None] * V + offs_v[None, :], DV.to(dv.dtype.element_ty), mask=mask_t[:, None])
    if HAS_BETA:
        tl.store(dbeta + row, DB, mask=mask_t)
    if CAUSAL:
        p = tl.load(dgp + row, mask=mask_t, other=0.0)
        tl.store(dG + row, p - b * DB, mask=mask_t)


def _launch_config(K: int, V: int, causal: bool) -> tuple[int, int, str, bool]:
    """(chunk size, warps, dot precision, materialise H_t).

    Default: the Chebyshev matvec is three small tensor-core matmuls, e^G ⊙ (X H0) + (A ⊙ X Kᵀ) K
    (2K² + 4·BT·K flops per token and iteration), in tf32x3 (fp32-level accuracy; plain tf32 lets the solver's
    residual stall near 1e-3·κ). Opt-in (``VISIONSSM_GKA_MAT=1``, causal only): build every H_t of the chunk once
    and run the matvecs on that (BT, K, K) tile in exact fp32 on CUDA cores (2K² flops) — on an H200 at
    (B256, T196, H10, K16) it measured 2.3× slower than the matmul path (3-D reductions and layout conversions
    every iteration), so it stays off. ``VISIONSSM_GKA_CHUNK`` (16/32/64), ``VISIONSSM_GKA_WARPS`` and
    ``VISIONSSM_GKA_DOT`` (tf32x3/tf32/ieee) override the rest, for tuning. Two warps beat four for K = 16
    (H200: forward 1.05 vs 2.07 ms at the shape above)."""
    mat = False
    if max(K, V) >= 128:
        chunk, warps = 16, 8
    elif max(K, V) >= 64:
        chunk, warps = 32, 4
    else:
        chunk, warps = 32, 2
    chunk = int(os.environ.get("VISIONSSM_GKA_CHUNK", chunk))
    warps = int(os.environ.get("VISIONSSM_GKA_WARPS", warps))
    mat = causal and os.environ.get("VISIONSSM_GKA_MAT", "1" if mat else "0") == "1"
    if chunk not in (16, 32, 64):
        raise ValueError(f"VISIONSSM_GKA_CHUNK must be 16, 32 or 64, got {chunk}")
    precision = os.environ.get("VISIONSSM_GKA_DOT", DOT_PRECISION)
    if precision not in ("tf32x3", "tf32", "ieee"):
        raise ValueError(f"VISIONSSM_GKA_DOT must be tf32x3, tf32 or ieee, got {precision}")
    return chunk, warps, precision, mat


def gka_fwd(q, k, v, g, beta, alpha, causal: bool, ridge: float, num_iters: int, config=None):
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT, warps, prec, mat = config or _launch_config(K, V, causal)
    NT = triton.cdiv(T, BT)
    NS = NT if causal else 1
    dev = q.device
    h0 = torch.empty(B * H, NS, K, K, device=dev, dtype=torch.float32)
    s0 = torch.empty(B * H, NS, K, V, device=dev, dtype=torch.float32)
    dummy = q
    g_ = g if causal else dummy
    beta_ = beta if beta is not None else dummy
    alpha_ = alpha if alpha is not None else dummy
    gka_fwd_state_kernel[(B * H,)](k, v, g_, beta_, h0, s0, T, NT, H=H, K=K, V=V, BT=BT, CAUSAL=causal,
                                   HAS_BETA=beta is not None, PREC=prec, num_warps=warps, num_stages=2)
    o = empty_output((B, T, H, V), device=dev, dtype=v.dtype)
    x = empty_output((B, T, H, K), device=dev, dtype=torch.float32)
    fro = empty_output((B, T, H), device=dev, dtype=torch.float32)
    gka_fwd_solve_kernel[(B * H, NT)](q, k, v, g_, beta_, alpha_, h0, s0, o, x, fro, T, NT, ridge, EPS,
                                      H=H, K=K, V=V, BT=BT, NUM_ITERS=num_iters, CAUSAL=causal,
                                      HAS_BETA=beta is not None, HAS_ALPHA=alpha is not None, MAT=mat,
                                      PREC=prec, num_warps=warps, num_stages=1)
    return o, x, fro, h0, s0


def gka_bwd(q, k, v, g, beta, alpha, x, fro, h0, s0, do, causal: bool, ridge: float, num_iters: int, config):
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT, warps, prec, mat = config
    NT = triton.cdiv(T, BT)
    dev = q.device
    dummy = q
    g_ = g if causal else dummy
    beta_ = beta if beta is not None else dummy
    alpha_ = alpha if alpha is not None else dummy
    f32 = torch.float32
    dq = empty_output((B, T, H, K), device=dev, dtype=q.dtype)
    dalpha = empty_output((B, T, H), device=dev, dtype=f32) if alpha is not None else None
    y = empty_output((B, T, H, K), device=dev, dtype=f32)
    dgp = empty_output((B, T, H), device=dev, dtype=f32)
    dh = torch.empty(B * H, NT, K, K, device=dev, dtype=f32)
    du = torch.empty(B * H, NT, K, V, device=dev, dtype=f32)
    gka_bwd_solve_kernel[(B * H, NT)](q, k, v, g_, beta_, alpha_, h0, s0, x, fro, do, dq,
                                      dalpha if dalpha is not None else dummy, y, dgp, dh, du, T, NT, ridge, EPS,
                                      H=H, K=K, V=V, BT=BT, NUM_ITERS=num_iters, CAUSAL=causal,
                                      HAS_BETA=beta is not None, HAS_ALPHA=alpha is not None, MAT=mat,
                                      PREC=prec, num_warps=warps, num_stages=1)
    if causal:
        gka_bwd_state_kernel[(B * H,)](g, dh, du, T, NT, H=H, K=K, V=V, BT=BT, num_warps=warps, num_stages=2)
    else:
        dh = dh.sum(1, keepdim=True)
        du = du.sum(1, keepdim=True)
    dk = empty_output((B, T, H, K), device=dev, dtype=k.dtype)
    dv = empty_output((B, T, H, V), device=dev, dtype=v.dtype)
    dbeta = empty_output((B, T, H), device=dev, dtype=f32) if beta is not None else None
    dG = empty_output((B, T, H), device=dev, dtype=f32) if causal else None
    gka_bwd_grad_kernel[(B * H, NT)](q, k, v, g_, beta_, alpha_, h0, x, y, fro, dgp, do, dh, du, dk, dv,
                                     dbeta if dbeta is not None else dummy, dG if dG is not None else dummy,
                                     T, NT, ridge, H=H, K=K, V=V, BT=BT, CAUSAL=causal, HAS_BETA=beta is not None,
                                     HAS_ALPHA=alpha is not None, PREC=prec, num_warps=warps, num_stages=1)
    dg = None
    if causal:
        # dg_r = Σ_{t ≥ r} dG_t: a reverse cumulative sum over the whole sequence.
        dg = dG.flip(1).cumsum(1).flip(1)
    return dq, dk, dv, dg, dbeta, dalpha


class ChunkGKAFunction(torch.autograd.Function):

    @staticmethod
    @input_guard
    @autocast_custom_fwd
    def forward(ctx, q, k, v, g, beta, alpha, causal, ridge, num_iters):
        config = _launch_config(q.shape[-1], v.shape[-1], causal)
        o, x, fro, h0, s0 = gka_fwd(q, k, v, g, beta, alpha, causal, ridge, num_iters, config)
        ctx.save_for_backward(q, k, v, g, beta, alpha, x, fro, h0, s0)
        ctx.causal, ctx.ridge, ctx.num_iters, ctx.config = causal, ridge, num_iters, config
        return o

    @staticmethod
    @input_guard
    @autocast_custom_bwd
    def backward(ctx, do):
        q, k, v, g, beta, alpha, x, fro, h0, s0 = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dalpha = gka_bwd(q, k, v, g, beta, alpha, x, fro, h0, s0, do, ctx.causal,
                                                ctx.ridge, ctx.num_iters, ctx.config)
        cast = lambda grad, like: None if grad is None or like is None else grad.to(like.dtype)
        return dq, dk, dv, cast(dg, g), cast(dbeta, beta), cast(dalpha, alpha), None, None, None


@torch.compiler.disable
def chunk_gka(q, k, v, g, beta=None, alpha=None, *, causal: bool = True, ridge: float = 0.02,
              num_iters: int = 30) -> torch.Tensor:
    """Triton GKA (arguments validated by :func:`visionssm.kernels.gka.gka`)."""
    if not causal:
        g = None
    return ChunkGKAFunction.apply(q, k, v, g, beta, alpha, causal, ridge, num_iters)
