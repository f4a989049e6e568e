"""Causal SKA kernels: token t queries the operator of its own prefix (tokens ≤ t, running sequence max).

Forward, two launches:

1. ``ska_causal_state_kernel`` (one program per (batch, head)) walks the chunks of BT tokens and stores the raw
   prefix statistics *before* each chunk: G₀ = Σ k kᵀ, M = Σ k_τ k_{τ−1}ᵀ, Cᵀ = Σ k vᵀ, the largest ‖k‖² and its
   token. The backward reads them again.
2. ``ska_causal_fwd_kernel`` (one program per chunk and (batch, head)) builds every token's own statistics from the
   chunk's state and a cumulative sum over the chunk, in blocks of BS tokens held as [BS, R, R] tensors (BS = BT
   for R = 16; fewer tokens per block for wider ranks, so a block stays in registers), inverts them, runs each
   token's power iteration and filter ``x_t = G_t⁻¹(M_t G_t⁻¹/σ̂_t)^p q̂_t``, and reads out ``o_t = C_t x_t``
   as linear attention does (the chunk's state plus masked products inside the chunk).

Backward (σ̂ detached), two launches:

3. ``ska_causal_bwd_token_kernel`` (chunk-parallel) repeats the per-token algebra, runs each token's adjoint
   recursion from ``C_tᵀ do_t`` and stores the rank-1 factors of the per-token adjoints (``dG_t = −Σ_j g_j x_jᵀ``,
   ``dM_t = Σ_j g_j x_{j−1}ᵀ / σ̂_t``, ``dC_t = do_t x_pᵀ``, already scaled to raw keys), dq, and adds each
   token's share of the sequence max's gradient to the key that holds its running max.
4. ``ska_causal_bwd_walk_kernel`` (one program per (batch, head)) walks the chunks backwards with the suffix sums
   of those adjoints (R×R, R×R, R×V) and writes dk and dv: the later chunks through the suffix sums, the chunk
   itself through masked products of the factors.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel_common import (
    accumulate_stats,
    head_seq,
    load_rows,
    matvec_rows,
    matvec_t_rows,
    power_sigma_rows,
    row_offsets,
    spd_inverse_rows,
    store_rows,
    store_stats,
    zero_stats,
)

#: The arguments each kernel stores to (some only under a constexpr flag): all that torch.compile's analysis of a
#: launch may take as written (tools/inductor_check.py, tests/kernels/test_inductor_writes.py).
WRITES = {"ska_causal_bwd_token_kernel": {"dq", "ds_buf", "ga_buf", "tok_buf", "x_buf"},
          "ska_causal_bwd_walk_kernel": {"dk", "dv"}, "ska_causal_fwd_kernel": {"o"},
          "ska_causal_state_kernel": {"c_buf", "g_buf", "m_buf", "n_buf"}}


@triton.jit
def ska_causal_state_kernel(k, v, g_buf, m_buf, c_buf, n_buf, T, H, NT,
                            R: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr):
    pid = tl.cast(tl.program_id(0), tl.int64)
    k_seq = head_seq(k, pid, T, H, R)
    v_seq = head_seq(v, pid, T, H, V)
    G, M, CT, best, arg = zero_stats(R, V)
    for c in range(NT):
        store_stats(g_buf, m_buf, c_buf, n_buf, pid * NT + c, G, M, CT, best, arg, R, V)
        G, M, CT, best, arg = accumulate_stats(k_seq, v_seq, c * BT, T, H * R, H * V, G, M, CT, best, arg,
                                               R, V, BT, PREC)


# Torch's mutation analysis of a ``wrap_triton`` launch follows a store's address back through every argument of the
# helper call that produced it and stops only at a load in the kernel's own body, so nothing that locates a store
# comes from a helper that takes pointers: the chunk kernels compute rows and the running max themselves or with
# pointer-free helpers (repeating what _block_operators computes; Triton's CSE merges the repeats) and load the
# chunk's max and keys themselves (the backward adds the max's gradient to the key that holds it).


@triton.jit
def _chunk_rows(pid, c, H, NT, R: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    """Chunk c of (batch, head) pid: the token strides of its key and value sequences, its slot in the statistics
    buffers, its first token, the key columns and its tokens."""
    HR = H * R
    HV = H * V
    st = pid * NT + c
    c0 = c * BT
    rr = tl.arange(0, R)
    tokens = c0 + tl.arange(0, BT)
    return HR, HV, st, c0, rr, tokens


@triton.jit
def _chunk_state(g_buf, m_buf, c_buf, st, R: tl.constexpr, V: tl.constexpr):
    """The raw statistics before the chunk of statistics slot ``st``: G₀, M, Cᵀ."""
    rr = tl.arange(0, R)
    vv = tl.arange(0, V)
    mat = st * R * R + rr[:, None] * R + rr[None, :]
    G0 = tl.load(g_buf + mat)
    M0 = tl.load(m_buf + mat)
    CT0 = tl.load(c_buf + st * R * V + rr[:, None] * V + vv[None, :])
    return G0, M0, CT0


@triton.jit
def _running_max(best0, n2, j0, BT: tl.constexpr, BS: tl.constexpr):
    """For the BS tokens from chunk offset j0: upto [BS, BT] = "chunk token τ ≤ t" and the running max ‖k‖² from the
    chunk's start value ``best0`` and its tokens' ``n2``."""
    ii = tl.arange(0, BS)
    tt = tl.arange(0, BT)
    upto = tt[None, :] <= (j0 + ii)[:, None]
    best = tl.maximum(best0, tl.max(tl.where(upto, n2[None, :], -1.0), axis=1))
    return upto, best


@triton.jit
def _block_operators(k_seq, q_seq, G0, M0, best0, kt, kpt, n2, c0, j0, T, HR, ridge,
                     R: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, NUM_ITERS: tl.constexpr,
                     NORMALIZE: tl.constexpr, EPS: tl.constexpr):
    """Per-token operators of the BS tokens c0 + j0 + [0, BS): (1/s, G_n⁻¹, M_n, 1/σ̂, the queries q̂), in
    max-normalised coordinates."""
    ii = tl.arange(0, BS)
    tt = tl.arange(0, BT)
    rr = tl.arange(0, R)
    rows = c0 + j0 + ii
    ks = load_rows(k_seq, rows, rr, T, HR, 0)
    kps = load_rows(k_seq, rows, rr, T, HR, -1)
    Gp = G0
    Mp = M0
    if BS < BT:  # add the chunk's tokens before this block
        before = tl.where((tt < j0)[:, None], kt, 0.0)
        Gp += tl.dot(tl.trans(before), kt, input_precision="ieee")
        Mp += tl.dot(tl.trans(before), kpt, input_precision="ieee")
    G3 = Gp[None, :, :] + tl.cumsum(ks[:, :, None] * ks[:, None, :], axis=0)
    M3 = Mp[None, :, :] + tl.cumsum(ks[:, :, None] * kps[:, None, :], axis=0)
    _, best = _running_max(best0, n2, j0, BT, BS)
    inv_s = 1.0 / tl.maximum(tl.sqrt(best), EPS)
    inv_s2 = (inv_s * inv_s)[:, None, None]
    eye = (rr[:, None] == rr[None, :]).to(tl.float32)[None, :, :]
    Gn = G3 * inv_s2 + ridge * eye
    Mn = M3 * inv_s2
    Gi = spd_inverse_rows(Gn, R)
    if NORMALIZE:
        isig = 1.0 / power_sigma_rows(Gn, Gi, Mn, NUM_ITERS, EPS, BS, R)
    else:
        isig = tl.full([BS], 1.0, tl.float32)
    qs = load_rows(q_seq, rows, rr, T, HR, 0) * inv_s[:, None]
    return inv_s, Gi, Mn, isig, qs


@triton.jit
def _apply_filter(Gi, Mn, isig, qs, steps):
    """x_steps with x₀ = G⁻¹q̂ and x_j = G⁻¹M x_{j−1}/σ̂ (per token)."""
    x = matvec_rows(Gi, qs)
    for _ in range(steps):
        x = matvec_rows(Gi, matvec_rows(Mn, x)) * isig[:, None]
    return x


@triton.jit
def ska_causal_fwd_kernel(q, k, v, o, g_buf, m_buf, c_buf, n_buf, T, H, NT, ridge,
                          R: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                          POWER: tl.constexpr, NUM_ITERS: tl.constexpr, NORMALIZE: tl.constexpr,
                          PREC: tl.constexpr, EPS: tl.constexpr):
    ridge = tl.cast(ridge, tl.float32)  # fp32 whatever the launcher passes (Inductor passes Python floats as fp64)
    c = tl.program_id(0)
    pid = tl.cast(tl.program_id(1), tl.int64)
    vv = tl.arange(0, V)
    o_seq = head_seq(o, pid, T, H, V)
    k_seq, q_seq, v_seq = head_seq(k, pid, T, H, R), head_seq(q, pid, T, H, R), head_seq(v, pid, T, H, V)
    HR, HV, st, c0, rr, tokens = _chunk_rows(pid, c, H, NT, R, V, BT)
    G0, M0, CT0 = _chunk_state(g_buf, m_buf, c_buf, st, R, V)
    best0 = tl.load(n_buf + st * 2)  # max and keys loaded here, as the backward must (note above _chunk_rows)
    kmask, koff = row_offsets(tokens, T, HR, 0)
    kt = tl.load(k_seq + koff + rr[None, :], mask=kmask, other=0.0).to(tl.float32)
    kpt = load_rows(k_seq, tokens, rr, T, HR, -1)
    vt = load_rows(v_seq, tokens, vv, T, HV, 0)
    n2 = tl.where(tokens < T, tl.sum(kt * kt, axis=1), -1.0)
    for j0 in range(0, BT, BS):
        inv_s, Gi, Mn, isig, qs = _block_operators(k_seq, q_seq, G0, M0, best0, kt, kpt, n2, c0, j0, T, HR, ridge, R,
                                                   BT, BS, NUM_ITERS, NORMALIZE, EPS)
        rows = c0 + j0 + tl.arange(0, BS)
        upto, _ = _running_max(best0, n2, j0, BT, BS)
        x = _apply_filter(Gi, Mn, isig, qs, POWER)
        # o_t = C_t x_t / s_t with C_t = (state) + Σ_{τ ≤ t in chunk} v_τ k_τᵀ, raw keys
        if BS == BT:
            scores = tl.where(upto, tl.dot(x, tl.trans(kt), input_precision=PREC), 0.0)
            out = tl.dot(x, CT0, input_precision=PREC) + tl.dot(scores, vt, input_precision=PREC)
        else:
            scores = tl.where(upto, tl.sum(x[:, None, :] * kt[None, :, :], axis=2), 0.0)
            out = tl.sum(x[:, :, None] * CT0[None, :, :], axis=1) + tl.sum(scores[:, :, None] * vt[None, :, :], axis=1)
        out = out * inv_s[:, None]
        store_rows(o_seq, rows, vv, T, H * V, out)


@triton.jit
def ska_causal_bwd_token_kernel(q, k, v, do, dq, g_buf, m_buf, c_buf, n_buf, x_buf, ga_buf, tok_buf, ds_buf,
                                T, H, NT, ridge,
                                R: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                                POWER: tl.constexpr, NUM_ITERS: tl.constexpr, NORMALIZE: tl.constexpr,
                                PREC: tl.constexpr, EPS: tl.constexpr):
    ridge = tl.cast(ridge, tl.float32)  # fp32 whatever the launcher passes (Inductor passes Python floats as fp64)
    c = tl.program_id(0)
    pid = tl.cast(tl.program_id(1), tl.int64)
    BH = tl.cast(tl.num_programs(1), tl.int64)
    rr = tl.arange(0, R)
    vv = tl.arange(0, V)
    tt = tl.arange(0, BT)
    do_seq = head_seq(do, pid, T, H, V)
    k_seq, q_seq, v_seq = head_seq(k, pid, T, H, R), head_seq(q, pid, T, H, R), head_seq(v, pid, T, H, V)
    HR, HV, st, c0, _, tokens = _chunk_rows(pid, c, H, NT, R, V, BT)
    G0, M0, CT0 = _chunk_state(g_buf, m_buf, c_buf, st, R, V)
    best0 = tl.load(n_buf + st * 2)  # the max, its key and the keys locate ds_buf's store: loaded here
    arg0 = tl.load(n_buf + st * 2 + 1).to(tl.int32)
    kmask, koff = row_offsets(tokens, T, HR, 0)
    kt = tl.load(k_seq + koff + rr[None, :], mask=kmask, other=0.0).to(tl.float32)
    kpt = load_rows(k_seq, tokens, rr, T, HR, -1)
    vt = load_rows(v_seq, tokens, vv, T, HV, 0)
    n2 = tl.where(tokens < T, tl.sum(kt * kt, axis=1), -1.0)
    for j0 in range(0, BT, BS):
        inv_s, Gi, Mn, isig, qs = _block_operators(k_seq, q_seq, G0, M0, best0, kt, kpt, n2, c0, j0, T, HR, ridge, R,
                                                   BT, BS, NUM_ITERS, NORMALIZE, EPS)
        rows = c0 + j0 + tl.arange(0, BS)
        upto, best = _running_max(best0, n2, j0, BT, BS)
        live = rows < T
        dos = load_rows(do_seq, rows, vv, T, H * V, 0)
        # y = C_tᵀ do_t / s_t, the adjoint of x_p
        if BS == BT:
            scores = tl.where(upto, tl.dot(dos, tl.trans(vt), input_precision=PREC), 0.0)
            y = tl.dot(dos, tl.trans(CT0), input_precision=PREC) + tl.dot(scores, kt, input_precision=PREC)
        else:
            scores = tl.where(upto, tl.sum(dos[:, None, :] * vt[None, :, :], axis=2), 0.0)
            y = tl.sum(dos[:, None, :] * CT0[None, :, :], axis=2) + tl.sum(scores[:, :, None] * kt[None, :, :], axis=1)
        y = y * inv_s[:, None]
        inv_s2 = (inv_s * inv_s)[:, None]
        factor = tl.cast(rows[:, None], tl.int64) * R + rr[None, :]
        trace = tl.zeros([BS], dtype=tl.float32)                     # −tr(dG_n) = Σ_j g_j·x_j
        g = tl.zeros([BS, R], dtype=tl.float32)
        for i in range(POWER + 1):
            j = POWER - i
            g = matvec_rows(Gi, y)
            x = _apply_filter(Gi, Mn, isig, qs, j)                    # x_j, recomputed (POWER is small)
            slot = (j * BH + pid) * T * R
            tl.store(x_buf + slot + factor, x, mask=live[:, None])
            tl.store(ga_buf + slot + factor, g * inv_s2, mask=live[:, None])
            trace += tl.sum(g * x, axis=1)
            y = matvec_t_rows(Mn, g) * isig[:, None]
        # after j = 0, g is dq̂ (the adjoint of q̂ = q/s)
        store_rows(head_seq(dq, pid, T, H, R), rows, rr, T, H * R, g * inv_s[:, None])
        tl.store(tok_buf + (pid * T + rows) * 2, isig, mask=live)
        tl.store(tok_buf + (pid * T + rows) * 2 + 1, inv_s, mask=live)
        # the running max moves only the ridge term λ s_t² I: ds_t = 2λ tr(dG_n)/s_t, to the key holding the max
        ds = -2.0 * ridge * trace * inv_s
        holder = tl.max(tl.where(upto & (n2[None, :] == best[:, None]), c0 + tt[None, :], -1), axis=1)
        holder = tl.where(holder < 0, arg0, holder)
        unclamped = tl.sqrt(best) >= EPS
        tl.atomic_add(ds_buf + pid * T + holder, ds, mask=live & unclamped)


@triton.jit
def ska_causal_bwd_walk_kernel(k, v, do, dk, dv, x_buf, ga_buf, tok_buf, ds_buf, T, H, NT,
                               R: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, POWER: tl.constexpr,
                               PREC: tl.constexpr, EPS: tl.constexpr):
    pid = tl.cast(tl.program_id(0), tl.int64)
    BH = tl.cast(tl.num_programs(0), tl.int64)
    b = pid // H
    h = pid % H
    rr = tl.arange(0, R)
    vv = tl.arange(0, V)
    tt = tl.arange(0, BT)
    k_seq = k + b * T * H * R + h * R
    v_seq = v + b * T * H * V + h * V
    do_seq = do + b * T * H * V + h * V
    later = tt[None, :] >= tt[:, None]          # [τ, t]: t ≥ τ
    strictly_later = tt[None, :] > tt[:, None]
    SG = tl.zeros([R, R], dtype=tl.float32)     # suffix sums over later chunks: Σ dG_t, Σ dM_t, Σ dC_tᵀ
    SM = tl.zeros([R, R], dtype=tl.float32)
    SCT = tl.zeros([R, V], dtype=tl.float32)
    for ci in range(NT):
        c0 = (NT - 1 - ci) * BT
        rows = c0 + tt
        live = rows < T
        kt = load_rows(k_seq, rows, rr, T, H * R, 0)
        kp = load_rows(k_seq, rows, rr, T, H * R, -1)
        kn = load_rows(k_seq, rows, rr, T, H * R, 1)
        vt = load_rows(v_seq, rows, vv, T, H * V, 0)
        dot_ = load_rows(do_seq, rows, vv, T, H * V, 0)
        isig = tl.load(tok_buf + (pid * T + rows) * 2, mask=live, other=0.0)
        inv_s = tl.load(tok_buf + (pid * T + rows) * 2 + 1, mask=live, other=0.0)
        dk_t = tl.dot(kt, SG + tl.trans(SG), input_precision=PREC) + tl.dot(kp, tl.trans(SM), input_precision=PREC)
        dk_t += tl.dot(kn, SM, input_precision=PREC) + tl.dot(vt, tl.trans(SCT), input_precision=PREC)
        dv_t = tl.dot(kt, SCT, input_precision=PREC)
        factor = tl.cast(rows[:, None], tl.int64) * R + rr[None, :]
        for j in range(POWER + 1):                                   # dG_t = −Σ_j GA_j,t X_j,tᵀ
            slot = (j * BH + pid) * T * R
            Xj = tl.load(x_buf + slot + factor, mask=live[:, None], other=0.0)
            GAj = tl.load(ga_buf + slot + factor, mask=live[:, None], other=0.0)
            dk_t -= tl.dot(tl.where(later, tl.dot(kt, tl.trans(Xj), input_precision=PREC), 0.0), GAj,
                           input_precision=PREC)
            dk_t -= tl.dot(tl.where(later, tl.dot(kt, tl.trans(GAj), input_precision=PREC), 0.0), Xj,
                           input_precision=PREC)
            SG -= tl.dot(tl.trans(GAj), Xj, input_precision=PREC)
        for j in range(1, POWER + 1):                                # dM_t = Σ_j GA_j,t X_{j−1},tᵀ / σ̂_t
            Xm = tl.load(x_buf + ((j - 1) * BH + pid) * T * R + factor, mask=live[:, None], other=0.0)
            GM = tl.load(ga_buf + (j * BH + pid) * T * R + factor, mask=live[:, None], other=0.0) * isig[:, None]
            dk_t += tl.dot(tl.where(later, tl.dot(kp, tl.trans(Xm), input_precision=PREC), 0.0), GM,
                           input_precision=PREC)
            dk_t += tl.dot(tl.where(strictly_later, tl.dot(kn, tl.trans(GM), input_precision=PREC), 0.0), Xm,
                           input_precision=PREC)
            SM += tl.dot(tl.trans(GM), Xm, input_precision=PREC)
        # dC_t = do_t x_{p,t}ᵀ / s_t
        XC = tl.load(x_buf + (POWER * BH + pid) * T * R + factor, mask=live[:, None], other=0.0) * inv_s[:, None]
        dk_t += tl.dot(tl.where(later, tl.dot(vt, tl.trans(dot_), input_precision=PREC), 0.0), XC,
                       input_precision=PREC)
        dv_t += tl.dot(tl.where(later, tl.dot(kt, tl.trans(XC), input_precision=PREC), 0.0), dot_,
                       input_precision=PREC)
        SCT += tl.dot(tl.trans(XC), dot_, input_precision=PREC)
        # the sequence max's share (collected per key by the token kernel): ds · k/‖k‖
        ds = tl.load(ds_buf + pid * T + rows, mask=live, other=0.0)
        norm = tl.maximum(tl.sqrt(tl.sum(kt * kt, axis=1)), EPS)
        dk_t += (ds / norm)[:, None] * kt
        kq_rows = b * T * H * R + h * R + tl.cast(rows[:, None], tl.int64) * (H * R) + rr[None, :]
        tl.store(dk + kq_rows, dk_t.to(dk.dtype.element_ty), mask=live[:, None])
        tl.store(dv + b * T * H * V + h * V + tl.cast(rows[:, None], tl.int64) * (H * V) + vv[None, :],
                 dv_t.to(dv.dtype.element_ty), mask=live[:, None])
