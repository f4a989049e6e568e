"""Triton kernels of causal GKA that do not depend on how the ridge systems are solved (FLA-style stage split).

Per (batch, head), chunks of BT tokens, chunk-local log-decay G_t = Σ_{s≤t in chunk} g_s, masks
Ã[t, s] = e^{G_t − G_s} (s ≤ t) and A[t, s] = Ã[t, s] β_s, chunk-start states H0 = H_{[c]} (K×K), S0 = U_{[c]}ᵀ (K×V):

forward   ``state_fwd_kernel``   H0, S0 of every chunk (one program per (row block, b·h) walks the chunks)
          (solver)               x_t = (H_t + λ_t I)⁻¹ q_t                       (kernel_causal_direct / _chebyshev)
          ``readout_kernel``     o_t = U_t z_t, z_t = α_t x_t + (1 − α_t) q_t:  e^G ⊙ (Z S0) + (A ⊙ Z Kᵀ) V
backward  ``dz_kernel``          dz_t = U_tᵀ do_t:                              e^G ⊙ (dO S0ᵀ) + (A ⊙ dO Vᵀ) K
          (solver)               y_t = (H_t + λ_t I)⁻¹ α_t dz_t, dq, dα, c_t = −ridge x_t·y_t / F_t, dgp_t
          ``adjoint_scan_kernel`` adjoint states at every chunk end, walking the chunks backwards:
                                 D = Σ_{t later} e^{G_t − G_end} (dH_t + dH_tᵀ),
                                 E = Σ_{t later} e^{G_t − G_end} z_t do_tᵀ,
                                 with dH_t = −y_t x_tᵀ + c_t H_t and dU_t = do_t z_tᵀ; and each chunk's share of
                                 dg from the later chunks, ½⟨D, H0_next⟩ + ⟨E, S0_next⟩ (so no reverse cumsum runs
                                 over the whole sequence)
          ``grad_kernel``        dk, dv, dβ and dg of one chunk (in-chunk reverse cumsum of dG_t = dgp_t − β_t dβ_t)
          ``adjoint_grad_kernel`` (16-wide heads) the last two in one program per (b, h) walking the chunks backwards
                                 with D, E in registers: no per-chunk states or dg offsets in memory (a last
                                 wave's sequences split in two programs; a single-token last chunk on vectors)

Matmul precision (``PREC``): "ieee" / "tf32x3" (fp32 inputs: exact fp32 products, or 3-pass TF32 where exact
fp32 tiles would not fit registers), "split" (16-bit inputs: every fp32 operand is split into bf16 hi + lo parts and
the partial products run on bf16 tensor cores — hi·hi + hi·lo + lo·hi for two fp32 operands, two products when one
side is exact in bf16, i.e. a bf16 input tile; ≈ 2⁻¹⁶ relative, against tf32x3's six bf16-pass equivalents) and
"split_emulated" (the same splits with the partial products in fp32: Triton's interpreter multiplies 16-bit dots
wrongly, so the CPU tests check the splitting this way).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["adjoint_grad_kernel", "adjoint_scan_kernel", "dz_kernel", "grad_kernel", "readout_kernel",
           "state_fwd_kernel"]


#: The arguments each kernel stores to (some only under a constexpr flag): all that torch.compile's analysis of a
#: launch may take as written (tools/inductor_check.py, tests/kernels/test_inductor_writes.py).
WRITES = {"adjoint_grad_kernel": {"dbeta", "dg", "dk", "dv"}, "adjoint_scan_kernel": {"dend", "eend", "offs"},
          "dz_kernel": {"dz"}, "grad_kernel": {"dbeta", "dg", "dk", "dv"}, "readout_kernel": {"o"},
          "state_fwd_kernel": {"h0", "s0"}}


@triton.jit
def _lp(a, b, PREC: tl.constexpr):
    """a @ b of two bf16 tiles with fp32 accumulation."""
    if PREC == "split_emulated":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _hi(a):
    return a.to(tl.float32).to(tl.bfloat16)


@triton.jit
def _lo(a, a_hi):
    return (a.to(tl.float32) - a_hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def mm(a, b, PREC: tl.constexpr, A_EXACT: tl.constexpr, B_EXACT: tl.constexpr):
    """a @ b with fp32 accuracy. ``*_EXACT``: that operand holds bf16 values (a bf16 input tile), one part."""
    if PREC == "ieee" or PREC == "tf32x3":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
    a_hi = _hi(a)
    b_hi = _hi(b)
    acc = _lp(a_hi, b_hi, PREC)
    if not A_EXACT:
        acc += _lp(_lo(a, a_hi), b_hi, PREC)
    if not B_EXACT:
        acc += _lp(a_hi, _lo(b, b_hi), PREC)
    return acc


@triton.jit
def chunk_rows(i_b, i_h, i_c, T, H: tl.constexpr, BT: tl.constexpr):
    """Token offsets of chunk ``i_c``, their validity and their (b, t, h) row index (int64)."""
    o_t = tl.arange(0, BT)
    t = i_c * BT + o_t
    m_t = t < T
    row = (tl.cast(i_b, tl.int64) * T + t) * H + i_h
    return o_t, m_t, row


@triton.jit
def chunk_program(T, NT, H: tl.constexpr, BT: tl.constexpr):
    """This program's chunk (grid: chunk, batch·head): batch, head and chunk indices, the chunk's token offsets,
    validity and rows (:func:`chunk_rows`), and its index into the per-chunk state buffers (int64)."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_t, m_t, row = chunk_rows(i_b, i_h, i_c, T, H, BT)
    base = tl.cast(i_bh * NT + i_c, tl.int64)
    return i_b, i_h, i_c, o_t, m_t, row, base


@triton.jit
def load_tile(ptr, row, m_t, W: tl.constexpr, col0, NC: tl.constexpr):
    """Columns [col0, col0 + NC) of the chunk's rows of a (·, W) tensor, in its own dtype (0 past the end)."""
    o_c = col0 + tl.arange(0, NC)
    return tl.load(ptr + row[:, None] * W + o_c[None, :], mask=m_t[:, None], other=0.0)


@triton.jit
def chunk_gates(g, beta, row, m_t, BT: tl.constexpr, HAS_BETA: tl.constexpr):
    """β, G (chunk-local cumulative log-decay), G_end and the decay mask Ã of one chunk."""
    gc = tl.load(g + row, mask=m_t, other=0.0).to(tl.float32)
    if HAS_BETA:
        b = tl.load(beta + row, mask=m_t, other=0.0).to(tl.float32)
    else:
        b = tl.where(m_t, 1.0, 0.0)
    G = tl.cumsum(gc, 0)
    o_t = tl.arange(0, BT)
    causal = o_t[:, None] >= o_t[None, :]
    Ad = tl.where(causal, tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0)
    return b, G, tl.sum(gc, 0), Ad


@triton.jit
def mix_z(q, alpha, x, row, m_t, K: tl.constexpr, col0, NC: tl.constexpr, HAS_ALPHA: tl.constexpr):
    """z = α x + (1 − α) q on columns [col0, col0 + NC) (fp32)."""
    X = load_tile(x, row, m_t, K, col0, NC)
    if HAS_ALPHA:
        a = tl.load(alpha + row, mask=m_t, other=0.0).to(tl.float32)
        Q = load_tile(q, row, m_t, K, col0, NC).to(tl.float32)
        return a[:, None] * X + (1.0 - a[:, None]) * Q
    return X


@triton.jit
def state_fwd_kernel(k, v, g, beta, h0, s0, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BKR: tl.constexpr, PREC: tl.constexpr, IN_EXACT: tl.constexpr,
                     HAS_BETA: tl.constexpr):
    """Chunk-start states, rows [i_r·BKR, (i_r + 1)·BKR) of H0 and S0: H ← e^{G_end} H + (k w)ᵀ k,
    S ← e^{G_end} S + (k w)ᵀ v with w_s = e^{G_end − G_s} β_s."""
    i_r, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_r = tl.arange(0, BKR)
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    Hs = tl.zeros([BKR, K], tl.float32)
    Ss = tl.zeros([BKR, V], tl.float32)
    # the last chunk's own share would go into no stored state: the loop stops before it
    for i_c in range(NT - 1):
        base = tl.cast(i_bh * NT + i_c, tl.int64)
        tl.store(h0 + base * K * K + (i_r * BKR + o_r)[:, None] * K + o_k[None, :], Hs)
        tl.store(s0 + base * K * V + (i_r * BKR + o_r)[:, None] * V + o_v[None, :], Ss)
        o_t, m_t, row = chunk_rows(i_b, i_h, i_c, T, H, BT)
        kc = load_tile(k, row, m_t, K, 0, K)
        kr = load_tile(k, row, m_t, K, i_r * BKR, BKR)
        vc = load_tile(v, row, m_t, V, 0, V)
        b, G, g_end, Ad = chunk_gates(g, beta, row, m_t, BT, HAS_BETA)
        kw = tl.trans(kr.to(tl.float32) * (tl.exp(g_end - G) * b)[:, None])
        decay = tl.exp(g_end)
        Hs = Hs * decay + mm(kw, kc, PREC, False, IN_EXACT)
        Ss = Ss * decay + mm(kw, vc, PREC, False, IN_EXACT)
    base = tl.cast(i_bh * NT + NT - 1, tl.int64)
    tl.store(h0 + base * K * K + (i_r * BKR + o_r)[:, None] * K + o_k[None, :], Hs)
    tl.store(s0 + base * K * V + (i_r * BKR + o_r)[:, None] * V + o_v[None, :], Ss)


@triton.jit
def readout_kernel(q, k, v, g, beta, alpha, x, s0, o, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr, IN_EXACT: tl.constexpr,
                   HAS_BETA: tl.constexpr, HAS_ALPHA: tl.constexpr):
    """o = e^G ⊙ (Z S0) + (A ⊙ Z Kᵀ) V for one chunk, BC output columns at a time (wide heads: fewer live tiles)."""
    i_b, i_h, i_c, o_t, m_t, row, base = chunk_program(T, NT, H, BT)
    o_k = tl.arange(0, K)
    Z = mix_z(q, alpha, x, row, m_t, K, 0, K, HAS_ALPHA)
    b, G, g_end, Ad = chunk_gates(g, beta, row, m_t, BT, HAS_BETA)
    S = (Ad * b[None, :]) * mm(Z, tl.trans(load_tile(k, row, m_t, K, 0, K)), PREC, False, IN_EXACT)
    eG = tl.exp(G)
    for c0 in range(0, V, BC):
        o_c = c0 + tl.arange(0, BC)
        S0 = tl.load(s0 + base * K * V + o_k[:, None] * V + o_c[None, :])
        O = mm(Z, S0, PREC, False, False) * eG[:, None]
        O += mm(S, load_tile(v, row, m_t, V, c0, BC), PREC, False, IN_EXACT)
        tl.store(o + row[:, None] * V + o_c[None, :], O.to(o.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def dz_kernel(k, v, g, beta, do, s0, dz, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
              BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr, IN_EXACT: tl.constexpr,
              HAS_BETA: tl.constexpr):
    """dz = U_tᵀ do_t = e^G ⊙ (dO S0ᵀ) + (A ⊙ dO Vᵀ) K for one chunk (fp32), BC columns at a time."""
    i_b, i_h, i_c, o_t, m_t, row, base = chunk_program(T, NT, H, BT)
    o_v = tl.arange(0, V)
    dO = load_tile(do, row, m_t, V, 0, V)
    b, G, g_end, Ad = chunk_gates(g, beta, row, m_t, BT, HAS_BETA)
    S = (Ad * b[None, :]) * mm(dO, tl.trans(load_tile(v, row, m_t, V, 0, V)), PREC, IN_EXACT, IN_EXACT)
    eG = tl.exp(G)
    for c0 in range(0, K, BC):
        o_c = c0 + tl.arange(0, BC)
        S0 = tl.load(s0 + base * K * V + o_c[:, None] * V + o_v[None, :])
        dZ = mm(dO, tl.trans(S0), PREC, IN_EXACT, False) * eG[:, None]
        dZ += mm(S, load_tile(k, row, m_t, K, c0, BC), PREC, False, IN_EXACT)
        tl.store(dz + row[:, None] * K + o_c[None, :], dZ, mask=m_t[:, None])


@triton.jit
def _adjoint_step(q, k, g, beta, alpha, do, x, y, c, h0, i_b, i_h, i_r, i_c, base, T, H: tl.constexpr,
                  K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BKR: tl.constexpr, PREC: tl.constexpr,
                  IN_EXACT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_ALPHA: tl.constexpr):
    """Chunk ``i_c``'s contribution, decayed to its start, to rows [i_r·BKR, …) of D and E, its total decay, and its
    H0 rows (the next step's "next chunk" state)."""
    o_t, m_t, row = chunk_rows(i_b, i_h, i_c, T, H, BT)
    o_r = i_r * BKR + tl.arange(0, BKR)
    o_k = tl.arange(0, K)
    b, G, g_end, Ad = chunk_gates(g, beta, row, m_t, BT, HAS_BETA)
    e = tl.exp(G)
    ct = tl.load(c + row, mask=m_t, other=0.0)
    ce = ct * e
    # Σ_t e^{G_t} (−y_t x_tᵀ − x_t y_tᵀ)
    X = load_tile(x, row, m_t, K, 0, K)
    Yr = load_tile(y, row, m_t, K, i_r * BKR, BKR)
    dD = -mm(tl.trans(Yr * e[:, None]), X, PREC, False, False)
    Y = load_tile(y, row, m_t, K, 0, K)
    Xr = load_tile(x, row, m_t, K, i_r * BKR, BKR)
    dD -= mm(tl.trans(Xr * e[:, None]), Y, PREC, False, False)
    # 2 Σ_t c_t e^{G_t} H_t = 2 Σ_t c_t e^{2 G_t} H0 + 2 Σ_r u_r k_r k_rᵀ,  u_r = Σ_t c_t e^{G_t} A[t, r]
    Hc = tl.load(h0 + base * K * K + o_r[:, None] * K + o_k[None, :])
    dD += (2.0 * tl.sum(ce * e, 0)) * Hc
    u = tl.sum((Ad * b[None, :]) * ce[:, None], 0)
    kr = load_tile(k, row, m_t, K, i_r * BKR, BKR).to(tl.float32)
    dD += 2.0 * mm(tl.trans(kr * u[:, None]), load_tile(k, row, m_t, K, 0, K), PREC, False, IN_EXACT)
    # Σ_t e^{G_t} z_t do_tᵀ
    Zr = mix_z(q, alpha, x, row, m_t, K, i_r * BKR, BKR, HAS_ALPHA)
    dE = mm(tl.trans(Zr * e[:, None]), load_tile(do, row, m_t, V, 0, V), PREC, False, IN_EXACT)
    return dD, dE, tl.exp(g_end), Hc


@triton.jit
def adjoint_scan_kernel(q, k, g, beta, alpha, do, x, y, c, h0, s0, dend, eend, offs, T, NT, H: tl.constexpr,
                        K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BKR: tl.constexpr, NKR: tl.constexpr,
                        PREC: tl.constexpr, IN_EXACT: tl.constexpr, HAS_BETA: tl.constexpr,
                        HAS_ALPHA: tl.constexpr):
    """Adjoint states at every chunk's end (rows [i_r·BKR, …)), walking the chunks backwards, and this row block's
    part of each chunk's dg offset ½⟨D, H0_next⟩ + ⟨E, S0_next⟩ = Σ of dG over the later chunks."""
    i_r, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_r = i_r * BKR + tl.arange(0, BKR)
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    Ds = tl.zeros([BKR, K], tl.float32)
    Es = tl.zeros([BKR, V], tl.float32)
    Hn = tl.zeros([BKR, K], tl.float32)
    Sn = tl.zeros([BKR, V], tl.float32)
    for j in range(NT):
        i_c = NT - 1 - j
        base = tl.cast(i_bh * NT + i_c, tl.int64)
        tl.store(dend + base * K * K + o_r[:, None] * K + o_k[None, :], Ds)
        tl.store(eend + base * K * V + o_r[:, None] * V + o_v[None, :], Es)
        tl.store(offs + base * NKR + i_r, 0.5 * tl.sum(tl.sum(Ds * Hn, 1), 0) + tl.sum(tl.sum(Es * Sn, 1), 0))
        dD, dE, decay, Hn = _adjoint_step(q, k, g, beta, alpha, do, x, y, c, h0, i_b, i_h, i_r, i_c, base, T, H, K,
                                          V, BT, BKR, PREC, IN_EXACT, HAS_BETA, HAS_ALPHA)
        Sn = tl.load(s0 + base * K * V + o_r[:, None] * V + o_v[None, :])
        Ds = Ds * decay + dD
        Es = Es * decay + dE


@triton.jit
def _chunk_mats(q, k, v, alpha, do, x, y, c, row, m_t, b, G, Ad, K: tl.constexpr, V: tl.constexpr,
                PREC: tl.constexpr, IN_EXACT: tl.constexpr, HAS_ALPHA: tl.constexpr):
    """The chunk's BT×BT factors of the gradients (see :func:`grad_kernel`): K, (Ã ∘ Y Kᵀ)ᵀ, (Ã ∘ X Kᵀ)ᵀ,
    (Ã ∘ Z Kᵀ)ᵀ, (Ãᵀ diag(c) A) ∘ K Kᵀ, 2 a and (Ã ∘ dO Vᵀ)ᵀ."""
    ct = tl.load(c + row, mask=m_t, other=0.0)
    kc = load_tile(k, row, m_t, K, 0, K)
    kT = tl.trans(kc)
    X = load_tile(x, row, m_t, K, 0, K)
    Y = load_tile(y, row, m_t, K, 0, K)
    Z = mix_z(q, alpha, x, row, m_t, K, 0, K, HAS_ALPHA)
    M_y = tl.trans(Ad * mm(Y, kT, PREC, False, IN_EXACT))
    M_x = tl.trans(Ad * mm(X, kT, PREC, False, IN_EXACT))
    M_z = tl.trans(Ad * mm(Z, kT, PREC, False, IN_EXACT))
    W = mm(tl.trans(Ad * ct[:, None]), Ad * b[None, :], PREC, False, False) * mm(kc, kT, PREC, IN_EXACT, IN_EXACT)
    two_a = 2.0 * tl.sum(Ad * (ct * tl.exp(G))[:, None], 0)
    M_v = tl.trans(Ad * mm(load_tile(do, row, m_t, V, 0, V), tl.trans(load_tile(v, row, m_t, V, 0, V)), PREC,
                           IN_EXACT, IN_EXACT))
    return kc, M_y, M_x, M_z, W, two_a, M_v


@triton.jit
def grad_kernel(q, k, v, g, beta, alpha, do, x, y, c, dgp, h0, dend, eend, offs, dk, dv, dbeta, dg, T, NT,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                NKR: tl.constexpr, PREC: tl.constexpr, IN_EXACT: tl.constexpr, HAS_BETA: tl.constexpr,
                HAS_ALPHA: tl.constexpr):
    """dk = β (R + Q), dv = β P, dβ = ½ k·R + v·P and dg of one chunk, with R_s = D_s k_s (D symmetric), Q_s = E_sᵀ v_s,
    P_s = E_s k_s (E as K×V: Σ z doᵀ):

        R = w ⊙ (K D_end) − (Ã ∘ Y Kᵀ)ᵀ X − (Ã ∘ X Kᵀ)ᵀ Y + 2 ((Ãᵀ diag(c) A) ∘ K Kᵀ) K + 2 a ⊙ (K H0)
        Q = w ⊙ (V E_endᵀ) + (Ã ∘ dO Vᵀ)ᵀ Z,    P = w ⊙ (K E_end) + (Ã ∘ Z Kᵀ)ᵀ dO

    (w_s = e^{G_end − G_s}, a_s = Σ_t Ã[t,s] c_t e^{G_t}; the c terms are the λ = ridge ‖H‖_F path). The chunk's
    BT×BT products come first, then BC output columns at a time. dg = (reverse cumsum of dgp − β dβ inside the
    chunk) + the later chunks' share from the adjoint scan."""
    i_b, i_h, i_c, o_t, m_t, row, base = chunk_program(T, NT, H, BT)
    b, G, g_end, Ad = chunk_gates(g, beta, row, m_t, BT, HAS_BETA)
    # read before the stores below, which the compiler cannot move them above: the warp would wait for them there
    dgpt = tl.load(dgp + row, mask=m_t, other=0.0)
    later = tl.sum(tl.load(offs + base * NKR + tl.arange(0, NKR)), 0)
    w_end = tl.exp(g_end - G)
    kc, M_y, M_x, M_z, W, two_a, M_v = _chunk_mats(q, k, v, alpha, do, x, y, c, row, m_t, b, G, Ad, K, V, PREC,
                                                   IN_EXACT, HAS_ALPHA)
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    db = tl.zeros([BT], tl.float32)
    for c0 in range(0, K, BC):
        o_c = c0 + tl.arange(0, BC)
        Dm = tl.load(dend + base * K * K + o_k[:, None] * K + o_c[None, :])
        R = mm(kc, Dm, PREC, IN_EXACT, False) * w_end[:, None]
        R -= mm(M_y, load_tile(x, row, m_t, K, c0, BC), PREC, False, False)
        R -= mm(M_x, load_tile(y, row, m_t, K, c0, BC), PREC, False, False)
        kb = load_tile(k, row, m_t, K, c0, BC)
        R += 2.0 * mm(W, kb, PREC, False, IN_EXACT)
        Hm = tl.load(h0 + base * K * K + o_k[:, None] * K + o_c[None, :])
        R += two_a[:, None] * mm(kc, Hm, PREC, IN_EXACT, False)
        db += 0.5 * tl.sum(kb.to(tl.float32) * R, 1)
        Em = tl.load(eend + base * K * V + o_c[:, None] * V + o_v[None, :])
        R += mm(load_tile(v, row, m_t, V, 0, V), tl.trans(Em), PREC, IN_EXACT, False) * w_end[:, None]
        R += mm(M_v, mix_z(q, alpha, x, row, m_t, K, c0, BC, HAS_ALPHA), PREC, False, False)
        tl.store(dk + row[:, None] * K + o_c[None, :], (b[:, None] * R).to(dk.dtype.element_ty), mask=m_t[:, None])
    for c0 in range(0, V, BC):
        o_c = c0 + tl.arange(0, BC)
        Em = tl.load(eend + base * K * V + o_k[:, None] * V + o_c[None, :])
        P = mm(kc, Em, PREC, IN_EXACT, False) * w_end[:, None]
        P += mm(M_z, load_tile(do, row, m_t, V, c0, BC), PREC, False, IN_EXACT)
        db += tl.sum(load_tile(v, row, m_t, V, c0, BC).to(tl.float32) * P, 1)
        tl.store(dv + row[:, None] * V + o_c[None, :], (b[:, None] * P).to(dv.dtype.element_ty), mask=m_t[:, None])
    if HAS_BETA:
        tl.store(dbeta + row, db.to(dbeta.dtype.element_ty), mask=m_t)
    dG = dgpt - b * db
    tl.store(dg + row, (tl.cumsum(dG, 0, reverse=True) + later).to(dg.dtype.element_ty), mask=m_t)


@triton.jit
def _fused_chunk(q, k, g, beta, alpha, do, x, y, c, dgp, h0, row, m_t, i_bh, i_c, NT, K: tl.constexpr,
                 V: tl.constexpr, BT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_ALPHA: tl.constexpr,
                 WITH_DGP: tl.constexpr):
    """What :func:`adjoint_grad_kernel` reads of chunk ``i_c`` of sequence ``i_bh`` (its rows and their validity
    from :func:`chunk_rows`), all loads issued together: β, G, G_end, Ã, c, dgp (``WITH_DGP``; else unread zeros), k,
    dO, x, y, z, H0, e^G and a = Σ_t Ã[t, ·] c_t e^{G_t}. The rows come from the caller: torch's mutation analysis of
    a ``wrap_triton`` launch counts every pointer argument of a helper whose result addresses a store as written."""
    b, G, g_end, Ad = chunk_gates(g, beta, row, m_t, BT, HAS_BETA)
    ct = tl.load(c + row, mask=m_t, other=0.0)
    # read with the chunk's other inputs: where it is used, after the chunk's stores (which the compiler cannot
    # move a load above), the warp would wait for it
    if WITH_DGP:
        dgpt = tl.load(dgp + row, mask=m_t, other=0.0)
    else:
        dgpt = tl.zeros([BT], tl.float32)
    kc = load_tile(k, row, m_t, K, 0, K)
    dO = load_tile(do, row, m_t, V, 0, V)
    X = load_tile(x, row, m_t, K, 0, K)
    Y = load_tile(y, row, m_t, K, 0, K)
    if HAS_ALPHA:
        a = tl.load(alpha + row, mask=m_t, other=0.0).to(tl.float32)
        Z = a[:, None] * X + (1.0 - a[:, None]) * load_tile(q, row, m_t, K, 0, K).to(tl.float32)
    else:
        Z = X
    Hc = tl.load(h0 + tl.cast(i_bh * NT + i_c, tl.int64) * K * K + tl.arange(0, K)[:, None] * K
                 + tl.arange(0, K)[None, :])
    e = tl.exp(G)
    a_c = tl.sum(Ad * (ct * e)[:, None], 0)
    return b, G, g_end, Ad, ct, dgpt, kc, dO, X, Y, Z, Hc, e, a_c


@triton.jit
def _through_chunk(Ds, Es, g_end, b, ct, kc, dO, X, Y, Z, Hc, e, a_c, PREC: tl.constexpr, IN_EXACT: tl.constexpr):
    """The adjoint states D, E carried from a chunk's end to its start: decayed by e^{G_end}, plus the chunk's share
    Σ_t e^{G_t} (dH_t + dH_tᵀ) and Σ_t e^{G_t} z_t do_tᵀ, with Σ_t e^{G_t} c_t H_t = Σ_t c_t e^{2 G_t} H0 +
    Σ_r β_r a_r k_r k_rᵀ."""
    S = mm(tl.trans(Y * e[:, None]), X, PREC, False, False)
    dD = (2.0 * tl.sum(ct * e * e, 0)) * Hc - S - tl.trans(S)
    dD += 2.0 * mm(tl.trans(kc.to(tl.float32) * (b * a_c)[:, None]), kc, PREC, False, IN_EXACT)
    decay = tl.exp(g_end)
    return Ds * decay + dD, Es * decay + mm(tl.trans(Z * e[:, None]), dO, PREC, False, IN_EXACT)


@triton.jit
def _tail_step(q, k, v, g, beta, alpha, do, x, y, c, dgp, h0, dk, dv, dbeta, dg, i_bh, T, NT, H: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr, HAS_BETA: tl.constexpr, HAS_ALPHA: tl.constexpr, STORE: tl.constexpr):
    """The backward walk's first step when the last chunk holds a single token s (T = 49 = 3·16 + 1), on vectors
    instead of BT-row tiles: with D = E = 0 at its end and Ã = 1, :func:`_chunk_grads` reduces to

        P = (z·k) do,   R = 2 c e (H0 k) + 2 c β (k·k) k − (y·k) x − (x·k) y + (do·v) z,
        dβ = v·P + ½ k·(R without its last term),   dk = β R,   dv = β P,   dG = dgp − β dβ,

    and its shares of D and E to 2 c e² H0 − e (y xᵀ + x yᵀ) + 2 β c e k kᵀ and e z doᵀ (e = e^{g_s}). Stores the
    token's gradients where ``STORE`` (not for a program that walks only the chunks before it); returns (D, E, dG)."""
    i_b, i_h = i_bh // H, i_bh % H
    row = (tl.cast(i_b, tl.int64) * T + T - 1) * H + i_h
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    gs = tl.load(g + row).to(tl.float32)
    if HAS_BETA:
        bs = tl.load(beta + row).to(tl.float32)
    else:
        bs = 1.0
    cs = tl.load(c + row)
    dgps = tl.load(dgp + row)
    kv = tl.load(k + row * K + o_k).to(tl.float32)
    vv = tl.load(v + row * V + o_v).to(tl.float32)
    dov = tl.load(do + row * V + o_v).to(tl.float32)
    xv = tl.load(x + row * K + o_k)
    yv = tl.load(y + row * K + o_k)
    if HAS_ALPHA:
        a = tl.load(alpha + row).to(tl.float32)
        zv = a * xv + (1.0 - a) * tl.load(q + row * K + o_k).to(tl.float32)
    else:
        zv = xv
    Hc = tl.load(h0 + tl.cast(i_bh * NT + NT - 1, tl.int64) * K * K + o_k[:, None] * K + o_k[None, :])
    e = tl.exp(gs)
    P = tl.sum(zv * kv, 0) * dov
    R = (2.0 * cs * e) * tl.sum(Hc * kv[None, :], 1) + (2.0 * cs * bs * tl.sum(kv * kv, 0)) * kv
    R -= tl.sum(yv * kv, 0) * xv + tl.sum(xv * kv, 0) * yv
    db = tl.sum(vv * P, 0) + 0.5 * tl.sum(kv * R, 0)
    R += tl.sum(dov * vv, 0) * zv
    dG = dgps - bs * db
    if STORE:
        tl.store(dk + row * K + o_k, (bs * R).to(dk.dtype.element_ty))
        tl.store(dv + row * V + o_v, (bs * P).to(dv.dtype.element_ty))
        if HAS_BETA:
            tl.store(dbeta + row, db.to(dbeta.dtype.element_ty))
        tl.store(dg + row, dG.to(dg.dtype.element_ty))
    Dt = (2.0 * cs * e * e) * Hc - e * (yv[:, None] * xv[None, :] + xv[:, None] * yv[None, :])
    Dt += (2.0 * bs * cs * e) * (kv[:, None] * kv[None, :])
    return Dt, e * (zv[:, None] * dov[None, :]), dG


@triton.jit
def adjoint_grad_kernel(q, k, v, g, beta, alpha, do, x, y, c, dgp, h0, s0, dk, dv, dbeta, dg, T, NT, n_whole, n_late,
                        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
                        IN_EXACT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_ALPHA: tl.constexpr,
                        SPLIT: tl.constexpr, TAIL: tl.constexpr):
    """``adjoint_scan_kernel`` and ``grad_kernel`` in one program per (b, h), for heads narrow enough to keep the
    whole K×K and K×V adjoint states D, E in registers: walking the chunks backwards, a chunk's gradients use D, E at
    its end (:func:`_chunk_grads`), then its own share is added to them. Neither the per-chunk states nor the dg
    offsets go through memory (the later chunks' Σ dG is a running sum), and each chunk's inputs are read once.

    ``SPLIT``: the sequences from ``n_whole`` on (those of the grid's last wave) get two programs each, ordered
    (late, early) per sequence. The late one runs the walk over the last ``n_late`` chunks alone; the early one first
    sums those chunks' shares of D and E (the cheap part of a step), takes their Σ dG from the identity
    ½⟨D, H0⟩ + ⟨E, S0⟩ at its first own chunk's end (as ``adjoint_scan_kernel`` does), then walks the chunks before
    them. ``TAIL``: the last chunk holds a single token, whose step (the walk's first) runs on vectors
    (:func:`_tail_step`)."""
    i_bh = tl.program_id(0)
    Ds = tl.zeros([K, K], tl.float32)
    Es = tl.zeros([K, V], tl.float32)
    later = tl.zeros([], tl.float32)
    j_first = 1 if TAIL else 0  # the walk's first tile step
    j_lo = j_first
    j_hi = NT
    walks_tail = True  # this program walks the last chunk (with its gradients)
    # nested: the outer test is a constexpr, so kernels without SPLIT compile none of this
    if SPLIT:  # noqa: SIM102
        if i_bh >= n_whole:
            part = i_bh - n_whole
            i_bh = n_whole + part // 2
            if part % 2 == 0:
                j_hi = n_late
            else:
                walks_tail = False
                if TAIL:
                    # (its dG is part of the late chunks' Σ dG, taken from the identity below)
                    Ds, Es, tail_dg = _tail_step(q, k, v, g, beta, alpha, do, x, y, c, dgp, h0, dk, dv, dbeta, dg,
                                                 i_bh, T, NT, H, K, V, HAS_BETA, HAS_ALPHA, False)
                for j in range(j_first, n_late):
                    i_c = NT - 1 - j
                    _, m_t, row = chunk_rows(i_bh // H, i_bh % H, i_c, T, H, BT)
                    b, _, g_end, _, ct, _, kc, dO, X, Y, Z, Hc, e, a_c = _fused_chunk(
                        q, k, g, beta, alpha, do, x, y, c, dgp, h0, row, m_t, i_bh, i_c, NT, K, V, BT, HAS_BETA,
                        HAS_ALPHA, False)
                    Ds, Es = _through_chunk(Ds, Es, g_end, b, ct, kc, dO, X, Y, Z, Hc, e, a_c, PREC, IN_EXACT)
                base = tl.cast(i_bh * NT + NT - n_late, tl.int64)
                Hn = tl.load(h0 + base * K * K + tl.arange(0, K)[:, None] * K + tl.arange(0, K)[None, :])
                Sn = tl.load(s0 + base * K * V + tl.arange(0, K)[:, None] * V + tl.arange(0, V)[None, :])
                later = 0.5 * tl.sum(tl.sum(Ds * Hn, 1), 0) + tl.sum(tl.sum(Es * Sn, 1), 0)
                j_lo = n_late
    # nested for the same reason
    if TAIL:  # noqa: SIM102
        if walks_tail:
            Ds, Es, later = _tail_step(q, k, v, g, beta, alpha, do, x, y, c, dgp, h0, dk, dv, dbeta, dg, i_bh, T, NT,
                                       H, K, V, HAS_BETA, HAS_ALPHA, True)
    for j in range(j_lo, j_hi):
        i_c = NT - 1 - j
        _, m_t, row = chunk_rows(i_bh // H, i_bh % H, i_c, T, H, BT)
        b, G, g_end, Ad, ct, dgpt, kc, dO, X, Y, Z, Hc, e, a_c = _fused_chunk(
            q, k, g, beta, alpha, do, x, y, c, dgp, h0, row, m_t, i_bh, i_c, NT, K, V, BT, HAS_BETA, HAS_ALPHA, True)
        dG = _chunk_grads(v, dgpt, dk, dv, dbeta, row, m_t, b, G, g_end, Ad, ct, kc, dO, X, Y, Z, Hc, a_c, Ds, Es, K,
                          V, PREC, IN_EXACT, HAS_BETA)
        tl.store(dg + row, (tl.cumsum(dG, 0, reverse=True) + later).to(dg.dtype.element_ty), mask=m_t)
        later += tl.sum(dG, 0)
        Ds, Es = _through_chunk(Ds, Es, g_end, b, ct, kc, dO, X, Y, Z, Hc, e, a_c, PREC, IN_EXACT)


@triton.jit
def _chunk_grads(v, dgpt, dk, dv, dbeta, row, m_t, b, G, g_end, Ad, ct, kc, dO, X, Y, Z, Hc, a_c, Dm, Em,
                 K: tl.constexpr, V: tl.constexpr, PREC: tl.constexpr, IN_EXACT: tl.constexpr,
                 HAS_BETA: tl.constexpr):
    """dk, dv, dβ of one chunk from its loaded tiles and the whole adjoint states D, E at its end (the formulas of
    :func:`grad_kernel`; ``dgpt``: the chunk's dgp); returns dG_t = dgp_t − β_t dβ_t."""
    w_end = tl.exp(g_end - G)
    kT = tl.trans(kc)
    vc = load_tile(v, row, m_t, V, 0, V)
    # dv: P = w ⊙ (K E) + (Ã ∘ Z Kᵀ)ᵀ dO
    P = mm(kc, Em, PREC, IN_EXACT, False) * w_end[:, None]
    P += mm(tl.trans(Ad * mm(Z, kT, PREC, False, IN_EXACT)), dO, PREC, False, IN_EXACT)
    db = tl.sum(vc.to(tl.float32) * P, 1)
    o_v = tl.arange(0, V)
    tl.store(dv + row[:, None] * V + o_v[None, :], (b[:, None] * P).to(dv.dtype.element_ty), mask=m_t[:, None])
    # dk: R, the λ path first
    R = mm(kc, Hc, PREC, IN_EXACT, False) * (2.0 * a_c)[:, None]
    W = mm(tl.trans(Ad * ct[:, None]), Ad * b[None, :], PREC, False, False) * mm(kc, kT, PREC, IN_EXACT, IN_EXACT)
    R += 2.0 * mm(W, kc, PREC, False, IN_EXACT)
    R += mm(kc, Dm, PREC, IN_EXACT, False) * w_end[:, None]
    R -= mm(tl.trans(Ad * mm(Y, kT, PREC, False, IN_EXACT)), X, PREC, False, False)
    R -= mm(tl.trans(Ad * mm(X, kT, PREC, False, IN_EXACT)), Y, PREC, False, False)
    db += 0.5 * tl.sum(kc.to(tl.float32) * R, 1)
    R += mm(vc, tl.trans(Em), PREC, IN_EXACT, False) * w_end[:, None]
    R += mm(tl.trans(Ad * mm(dO, tl.trans(vc), PREC, IN_EXACT, IN_EXACT)), Z, PREC, False, False)
    o_k = tl.arange(0, K)
    tl.store(dk + row[:, None] * K + o_k[None, :], (b[:, None] * R).to(dk.dtype.element_ty), mask=m_t[:, None])
    if HAS_BETA:
        tl.store(dbeta + row, db.to(dbeta.dtype.element_ty), mask=m_t)
    return dgpt - b * db
