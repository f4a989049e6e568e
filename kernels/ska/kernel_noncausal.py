"""Non-causal SKA kernels: one operator per (batch, head), queried by all of its tokens.

The work splits into streaming passes over the sequence (one program per (batch, head), bandwidth-bound) and the
small dense algebra of the operators, which is latency-bound and therefore batched, NB operators per program.

Forward:

1. ``ska_noncausal_stats_kernel``: raw statistics from k and v — G₀ = Σ k kᵀ, M = Σ k_t k_{t−1}ᵀ, Cᵀ = Σ k vᵀ,
   the largest ‖k‖² and the token holding it (ties: the later token).
2. ``ska_noncausal_operator_kernel``: normalise by s, G⁻¹, σ̂, the filter ``Ψ = (G⁻¹Mᵀ/σ̂)^p G⁻¹Cᵀ`` (R×V); stores
   Ψ/s, so that ``o = q Ψ / s``, and, when a backward follows, G⁻¹, N = G⁻¹Mᵀ/σ̂, W₀ = G⁻¹Cᵀ and 1/σ̂.
3. ``ska_noncausal_out_kernel``: o = q (Ψ/s).

Backward (σ̂ detached):

4. ``ska_noncausal_dq_kernel``: dq = do (Ψ/s)ᵀ and Σ q doᵀ (dΨ up to 1/s).
5. ``ska_noncausal_operator_bwd_kernel``: from the saved G⁻¹, N, W₀, 1/σ̂, the algebra differentiated down to the raw
   statistics — dG₀ (stored as dG₀ + dG₀ᵀ), dM, dCᵀ — and the sequence max's share ds = 2λ tr(dG_n)/s (s enters
   only through the ridge term λ s² I of the raw Gram matrix).
6. ``ska_noncausal_dkv_kernel``: dk (the adjoints applied to each key, its predecessor and its successor, plus ds on
   the key holding the max) and dv = k dCᵀ.

``*_n`` quantities are in max-normalised coordinates (k̂ = k/s).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel_common import (
    accumulate_stats,
    head_seq,
    load_rows,
    power_sigma_rows,
    spd_inverse_rows,
    store_rows,
    store_stats,
    strided_head_seq,
    zero_stats,
)

#: The arguments each kernel stores to (some only under a constexpr flag): all that torch.compile's analysis of a
#: launch may take as written (tools/inductor_check.py, tests/kernels/test_inductor_writes.py).
WRITES = {"ska_noncausal_dkv_kernel": {"dk", "dv"}, "ska_noncausal_dq_kernel": {"dq", "qdo_buf"},
          "ska_noncausal_operator_bwd_kernel": {"dc_buf", "dm_buf", "ds_buf", "sg_buf"},
          "ska_noncausal_operator_kernel": {"gi_buf", "isig_buf", "nn_buf", "psi_buf", "w0_buf"},
          "ska_noncausal_out_kernel": {"o"}, "ska_noncausal_stats_kernel": {"c_buf", "g_buf", "m_buf", "n_buf"}}


@triton.jit
def ska_noncausal_stats_kernel(k, v, g_buf, m_buf, c_buf, n_buf, T, H, k_seq_stride, k_row, v_seq_stride, v_row,
                               R: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr):
    pid = tl.cast(tl.program_id(0), tl.int64)
    k_seq = strided_head_seq(k, pid, H, k_seq_stride, R)
    v_seq = strided_head_seq(v, pid, H, v_seq_stride, V)
    G, M, CT, best, arg = zero_stats(R, V)
    for t0 in range(0, T, BT):
        G, M, CT, best, arg = accumulate_stats(k_seq, v_seq, t0, T, k_row, v_row, G, M, CT, best, arg, R, V, BT,
                                               PREC)
    store_stats(g_buf, m_buf, c_buf, n_buf, pid, G, M, CT, best, arg, R, V)


@triton.jit
def _problems(BH, NB: tl.constexpr):
    """This program's NB operators: (problem index, live), [NB] each. No pointer goes in: torch's mutation analysis
    of a ``wrap_triton`` launch counts every pointer argument of a helper whose result addresses a store as written."""
    prob = tl.cast(tl.program_id(0), tl.int64) * NB + tl.arange(0, NB)
    return prob, prob < BH


@triton.jit
def _scales(n_buf, prob, live, EPS: tl.constexpr):
    """(‖k‖ max², 1/s) of operators ``prob``, [NB] each."""
    best = tl.load(n_buf + prob * 2, mask=live, other=0.0)
    return best, 1.0 / tl.maximum(tl.sqrt(best), EPS)


@triton.jit
def _load_blocks(ptr, prob, live, R: tl.constexpr, C: tl.constexpr):
    """The [NB, R, C] fp32 blocks of problems ``prob`` (row-major R×C per problem; 0 for dead ones)."""
    rr = tl.arange(0, R)
    cc = tl.arange(0, C)
    return tl.load(ptr + prob[:, None, None] * R * C + rr[None, :, None] * C + cc[None, None, :],
                   mask=live[:, None, None], other=0.0)


@triton.jit
def _store_blocks(ptr, prob, live, x, R: tl.constexpr, C: tl.constexpr):
    rr = tl.arange(0, R)
    cc = tl.arange(0, C)
    tl.store(ptr + prob[:, None, None] * R * C + rr[None, :, None] * C + cc[None, None, :], x,
             mask=live[:, None, None])


@triton.jit
def _operators(g_buf, m_buf, c_buf, prob, live, inv_s, ridge, R: tl.constexpr, V: tl.constexpr, NB: tl.constexpr,
               NUM_ITERS: tl.constexpr, NORMALIZE: tl.constexpr, EPS: tl.constexpr):
    """The operators from their raw statistics: (G_n⁻¹, M_n, Cᵀ_n, 1/σ̂, N = G_n⁻¹M_nᵀ/σ̂, W₀ = G_n⁻¹Cᵀ_n), 3-D
    [NB, ·, ·] tensors (1/σ̂: [NB])."""
    rr = tl.arange(0, R)
    G = _load_blocks(g_buf, prob, live, R, R)
    M = _load_blocks(m_buf, prob, live, R, R)
    CT = _load_blocks(c_buf, prob, live, R, V)
    inv_s2 = (inv_s * inv_s)[:, None, None]
    eye = (rr[:, None] == rr[None, :]).to(tl.float32)[None, :, :]
    Gn = 0.5 * (G + tl.permute(G, (0, 2, 1))) * inv_s2 + ridge * eye
    Mn = M * inv_s2
    CTn = CT * inv_s[:, None, None]
    Gi = spd_inverse_rows(Gn, R)
    if NORMALIZE:
        isig = 1.0 / power_sigma_rows(Gn, Gi, Mn, NUM_ITERS, EPS, NB, R)
    else:
        isig = tl.full([NB], 1.0, tl.float32)
    N = tl.dot(Gi, tl.permute(Mn, (0, 2, 1)), input_precision="ieee") * isig[:, None, None]
    W0 = tl.dot(Gi, CTn, input_precision="ieee")
    return Gi, Mn, CTn, isig, N, W0


@triton.jit
def _power(N, W0, POWER: tl.constexpr):
    """Ψ = N^p W₀ (batched)."""
    W = W0
    for _ in range(POWER):
        W = tl.dot(N, W, input_precision="ieee")
    return W


@triton.jit
def ska_noncausal_operator_kernel(g_buf, m_buf, c_buf, n_buf, psi_buf, gi_buf, nn_buf, w0_buf, isig_buf, BH, ridge,
                                  R: tl.constexpr, V: tl.constexpr, NB: tl.constexpr, POWER: tl.constexpr,
                                  NUM_ITERS: tl.constexpr, NORMALIZE: tl.constexpr, EPS: tl.constexpr,
                                  SAVE: tl.constexpr):
    """Ψ/s per operator; SAVE (a backward follows): also G_n⁻¹, N, W₀ and 1/σ̂, which the backward would otherwise
    rebuild (the inverse and the power iteration are most of this kernel's latency)."""
    ridge = tl.cast(ridge, tl.float32)  # fp32 whatever the launcher passes (Inductor passes Python floats as fp64)
    prob, live = _problems(BH, NB)
    best, inv_s = _scales(n_buf, prob, live, EPS)
    Gi, Mn, CTn, isig, N, W0 = _operators(g_buf, m_buf, c_buf, prob, live, inv_s, ridge, R, V, NB, NUM_ITERS,
                                          NORMALIZE, EPS)
    _store_blocks(psi_buf, prob, live, _power(N, W0, POWER) * inv_s[:, None, None], R, V)
    if SAVE:
        _store_blocks(gi_buf, prob, live, Gi, R, R)
        _store_blocks(nn_buf, prob, live, N, R, R)
        _store_blocks(w0_buf, prob, live, W0, R, V)
        tl.store(isig_buf + prob, isig, mask=live)


@triton.jit
def ska_noncausal_out_kernel(q, psi_buf, o, T, H, q_seq_stride, q_row, R: tl.constexpr, V: tl.constexpr,
                             BT: tl.constexpr, PREC: tl.constexpr):
    pid = tl.cast(tl.program_id(0), tl.int64)
    rr = tl.arange(0, R)
    vv = tl.arange(0, V)
    tt = tl.arange(0, BT)
    q_seq = strided_head_seq(q, pid, H, q_seq_stride, R)
    o_seq = head_seq(o, pid, T, H, V)
    psi = tl.load(psi_buf + pid * R * V + rr[:, None] * V + vv[None, :])
    for t0 in range(0, T, BT):
        rows = t0 + tt
        out = tl.dot(load_rows(q_seq, rows, rr, T, q_row, 0), psi, input_precision=PREC)
        store_rows(o_seq, rows, vv, T, H * V, out)


@triton.jit
def ska_noncausal_dq_kernel(q, do, psi_buf, dq, qdo_buf, T, H, q_seq_stride, q_row, R: tl.constexpr, V: tl.constexpr,
                            BT: tl.constexpr, PREC: tl.constexpr):
    pid = tl.cast(tl.program_id(0), tl.int64)
    rr = tl.arange(0, R)
    vv = tl.arange(0, V)
    tt = tl.arange(0, BT)
    q_seq = strided_head_seq(q, pid, H, q_seq_stride, R)
    dq_seq = head_seq(dq, pid, T, H, R)
    do_seq = head_seq(do, pid, T, H, V)
    psiT = tl.trans(tl.load(psi_buf + pid * R * V + rr[:, None] * V + vv[None, :]))
    qdo = tl.zeros([R, V], dtype=tl.float32)
    for t0 in range(0, T, BT):
        rows = t0 + tt
        qt = load_rows(q_seq, rows, rr, T, q_row, 0)
        dot_ = load_rows(do_seq, rows, vv, T, H * V, 0)
        qdo += tl.dot(tl.trans(qt), dot_, input_precision=PREC)
        dq_t = tl.dot(dot_, psiT, input_precision=PREC)
        store_rows(dq_seq, rows, rr, T, H * R, dq_t)
    tl.store(qdo_buf + pid * R * V + rr[:, None] * V + vv[None, :], qdo)


@triton.jit
def ska_noncausal_operator_bwd_kernel(m_buf, c_buf, n_buf, gi_buf, nn_buf, w0_buf, isig_buf, qdo_buf, sg_buf, dm_buf,
                                      dc_buf, ds_buf, BH, ridge, R: tl.constexpr, V: tl.constexpr, NB: tl.constexpr,
                                      POWER: tl.constexpr, EPS: tl.constexpr):
    ridge = tl.cast(ridge, tl.float32)  # fp32 whatever the launcher passes (Inductor passes Python floats as fp64)
    prob, live = _problems(BH, NB)
    best, inv_s = _scales(n_buf, prob, live, EPS)
    Mn = _load_blocks(m_buf, prob, live, R, R) * (inv_s * inv_s)[:, None, None]
    CTn = _load_blocks(c_buf, prob, live, R, V) * inv_s[:, None, None]
    Gi = _load_blocks(gi_buf, prob, live, R, R)
    N = _load_blocks(nn_buf, prob, live, R, R)
    W0 = _load_blocks(w0_buf, prob, live, R, V)
    isig = tl.load(isig_buf + prob, mask=live, other=1.0)
    dPsi = _load_blocks(qdo_buf, prob, live, R, V) * inv_s[:, None, None]
    NT = tl.permute(N, (0, 2, 1))
    # Ψ = N^p W₀: dN = Σ_j (Nᵀ)^{p−j} dΨ (N^{j−1} W₀)ᵀ, dW₀ = (Nᵀ)^p dΨ
    dN = tl.zeros_like(N)
    for j in range(1, POWER + 1):
        A = dPsi
        for _ in range(POWER - j):
            A = tl.dot(NT, A, input_precision="ieee")
        B = W0
        for _ in range(j - 1):
            B = tl.dot(N, B, input_precision="ieee")
        dN += tl.dot(A, tl.permute(B, (0, 2, 1)), input_precision="ieee")
    dW0 = dPsi
    for _ in range(POWER):
        dW0 = tl.dot(NT, dW0, input_precision="ieee")
    # W₀ = G⁻¹Cᵀ and N = G⁻¹Mᵀ/σ̂ → G⁻¹, Cᵀ, M; then G⁻¹ → G
    dGi = tl.dot(dW0, tl.permute(CTn, (0, 2, 1)), input_precision="ieee")
    dGi += tl.dot(dN, Mn, input_precision="ieee") * isig[:, None, None]
    dCTn = tl.dot(Gi, dW0, input_precision="ieee")
    dMn = tl.dot(tl.permute(dN, (0, 2, 1)), Gi, input_precision="ieee") * isig[:, None, None]
    dGn = -tl.dot(tl.dot(Gi, dGi, input_precision="ieee"), Gi, input_precision="ieee")
    # to the raw statistics; s moves only the ridge term λ s² I: ds = 2λ tr(dG_n)/s, to the key holding the max
    inv_s2 = (inv_s * inv_s)[:, None, None]
    dGr = dGn * inv_s2
    _store_blocks(sg_buf, prob, live, dGr + tl.permute(dGr, (0, 2, 1)), R, R)
    _store_blocks(dm_buf, prob, live, dMn * inv_s2, R, R)
    _store_blocks(dc_buf, prob, live, dCTn * inv_s[:, None, None], R, V)
    rr = tl.arange(0, R)
    diag = (rr[:, None] == rr[None, :])[None, :, :]
    trace = tl.sum(tl.sum(tl.where(diag, dGn, 0.0), axis=2), axis=1)
    ds = 2.0 * ridge * trace * inv_s
    # ds · k/‖k‖ for the holder, whose norm is s (when s is not the EPS floor)
    tl.store(ds_buf + prob, tl.where(tl.sqrt(best) >= EPS, ds * inv_s, 0.0), mask=live)


@triton.jit
def ska_noncausal_dkv_kernel(k, v, n_buf, sg_buf, dm_buf, dc_buf, ds_buf, dk, dv, T, H, k_seq_stride, k_row,
                             v_seq_stride, v_row, R: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                             PREC: tl.constexpr):
    pid = tl.cast(tl.program_id(0), tl.int64)
    rr = tl.arange(0, R)
    vv = tl.arange(0, V)
    tt = tl.arange(0, BT)
    k_seq = strided_head_seq(k, pid, H, k_seq_stride, R)
    v_seq = strided_head_seq(v, pid, H, v_seq_stride, V)
    dk_seq = head_seq(dk, pid, T, H, R)
    dv_seq = head_seq(dv, pid, T, H, V)
    mat = pid * R * R + rr[:, None] * R + rr[None, :]
    S = tl.load(sg_buf + mat)                       # dG₀ + dG₀ᵀ
    dM = tl.load(dm_buf + mat)
    dMT = tl.trans(dM)
    dCT = tl.load(dc_buf + pid * R * V + rr[:, None] * V + vv[None, :])
    dC = tl.trans(dCT)
    ds = tl.load(ds_buf + pid)
    holder = tl.load(n_buf + pid * 2 + 1).to(tl.int32)
    for t0 in range(0, T, BT):
        rows = t0 + tt
        kt = load_rows(k_seq, rows, rr, T, k_row, 0)
        kp = load_rows(k_seq, rows, rr, T, k_row, -1)
        kn = load_rows(k_seq, rows, rr, T, k_row, 1)
        vt = load_rows(v_seq, rows, vv, T, v_row, 0)
        dk_t = tl.dot(kt, S, input_precision=PREC) + tl.dot(kp, dMT, input_precision=PREC)
        dk_t += tl.dot(kn, dM, input_precision=PREC) + tl.dot(vt, dC, input_precision=PREC)
        dk_t += tl.where(rows == holder, ds, 0.0)[:, None] * kt
        dv_t = tl.dot(kt, dCT, input_precision=PREC)
        store_rows(dk_seq, rows, rr, T, H * R, dk_t)
        store_rows(dv_seq, rows, vv, T, H * V, dv_t)
