"""Triton kernels of non-causal GKA: the closed form, one program per (batch, head).

Non-causal, every token of a (batch, head) regresses on the same statistics

    H = Σ_t β_t k_t k_tᵀ (K×K),  Uᵀ = Σ_t β_t k_t v_tᵀ (K×V),  F = ‖H‖_F,  λ = ridge·(F + EPS),
    M = (H + λI)⁻¹  (``direct``)  or  M = p_r(H + λI)  (``chebyshev``: Algorithm 1 run on the identity),

so the ridge solve x_t = M q_t is one K×K matrix per (batch, head), and the read-out o_t = U z_t with
z_t = α_t x_t + (1 − α_t) q_t is two GEMMs over the token rows:

    P = M Uᵀ,  D = P − Uᵀ,  O = Q Uᵀ + α ⊙ (Q D).

Backward (implicit differentiation of x = M q, exact for the direct solve), with G₀ = Σ_t do_t q_tᵀ and
G₁ = Σ_t α_t do_t q_tᵀ (V×K) accumulated over the tokens:

    dq = dO U + α ⊙ (dO Dᵀ),  dα_t = q_t · (D do_t),
    dU = G₀ + G₁ (M − I),  W = Σ_t y_t x_tᵀ = P G₁ M,  dH = −W − ridge·tr(W)·H / F  (0 when F = 0),
    S = dH + dHᵀ,  dk = β ⊙ (K S + V dU),  dv = β ⊙ (K dUᵀ),  dβ_t = k_t·(½ S k_t + dUᵀ v_t).

Every per-token product has one operand that is exact in the input dtype (q, k, v, do) and one fp32 matrix. For
bf16 inputs (``LP``) the fp32 matrix is split into a bf16 high and low part and both multiply the exact operand on
bf16 tensor cores (~2⁻¹⁷ relative per product; the high part alone, ~2⁻⁹, loses too much on gradients that are
cancelling sums over the tokens). Other inputs run fp32 dots in ``PREC`` (the launch plan picks exact fp32 or
tf32x3; the interpreter is exact). The statistics H and Uᵀ always use both halves of β_t k_t (a single pass would put
2⁻⁹ into H, which the solve amplifies by up to κ ≈ 1/ridge). The per-(batch, head) K×K products run in ``SPREC``
(tf32x3, exact fp32, or bf16x3: see :func:`_state_dot`), those inside the solve in ``SOLVE_SPREC`` (the solve kernel's
``SPREC``).

``EMU``: Triton's CPU interpreter multiplies 16-bit dots wrongly, so there the bf16 dots run on the same bf16
values converted to fp32 (exact products, fp32 accumulation: what the tensor cores compute).

Accuracy of M: a swept inverse in fp32 is off by ~κ·u in every entry, unstructured, and the read-out and
gradient contractions cancel large entries of M (e.g. k·M k when the keys span few directions), which turns that
into ~1e-4 relative errors of dβ and dk for fp32 inputs; ``F64`` sweeps in fp64 and rounds M once (fp32 inputs
only: for bf16 inputs the error is far below the output's rounding). Other inputs invert in fp32 with a block
inverse for 64-wide heads in the split forward (``BLOCK_INVERSE``: :mod:`.kernel_noncausal_inverse`).

The forward stores H, M and Uᵀ (fp32 K×K, K×K, K×V blocks per (batch, head)) when a backward will follow; the
backward reads them instead of re-reading k and v and solving again, and recomputes R = D (P when α ≡ 1) =
M Uᵀ (− Uᵀ), which only the wide heads' forward (RELOAD) stores. The forward can run as three launches
(``PHASE``), which 64-wide heads use for the solve.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel_noncausal_inverse import _inverse_in_memory, _lp_dot, _split, _state_dot, _sweep_inverse

__all__ = ["gka_noncausal_bwd_kernel", "gka_noncausal_fwd_kernel", "gka_noncausal_solve_kernel"]


#: The arguments each kernel stores to (some only under a constexpr flag): all that torch.compile's analysis of a
#: launch may take as written (tools/inductor_check.py, tests/kernels/test_inductor_writes.py).
WRITES = {"gka_noncausal_bwd_kernel": {"dalpha", "dbeta", "dk", "dq", "dv", "scratch"},
          "gka_noncausal_fwd_kernel": {"o", "states"}, "gka_noncausal_solve_kernel": {"states"}}


@triton.jit
def _dot_exact_a(a, b_hi, b_lo, LP: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):
    """a @ b for a exact in the input dtype and b fp32 (given split when LP, as b_hi otherwise)."""
    if LP:
        out = _lp_dot(a, b_hi, None, EMU)
        out = _lp_dot(a, b_lo, out, EMU)
    else:
        out = tl.dot(a, b_hi, input_precision=PREC)
    return out


@triton.jit
def _dot_exact_b(a, b, acc, LP_TY: tl.constexpr, LP: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):
    """acc + a @ b for a fp32 and b exact in the input dtype (a is split here when LP)."""
    if LP:
        a_hi, a_lo = _split(a, LP_TY)
        acc = _lp_dot(a_hi, b, acc, EMU)
        acc = _lp_dot(a_lo, b, acc, EMU)
    else:
        acc = tl.dot(a, b, acc, input_precision=PREC)
    return acc


@triton.jit
def _tile_ptrs(base, t, HN, N: tl.constexpr):
    """Pointers to the (BT, N) tile of tokens ``t`` of one (batch, head): ``base`` points at its token 0 and rows are
    ``HN = H·N`` elements apart (int32 offsets within the sequence; the host checks that they fit)."""
    return base + (t * HN)[:, None] + tl.arange(0, N)[None, :]


@triton.jit
def _load_tile(base, t, mask, HN, N: tl.constexpr, LP: tl.constexpr):
    """A (BT, N) input tile: as stored when LP (the exact operand of bf16 dots), else fp32; 0 for padded tokens."""
    tile = tl.load(_tile_ptrs(base, t, HN, N), mask=mask[:, None], other=0.0)
    if not LP:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _load_gate(base, t, mask, H, HAS: tl.constexpr):
    """A (B, T, H) gate for the tile (1 where it is absent), 0 for padded tokens."""
    if HAS:
        gate = tl.load(base + t * H, mask=mask, other=0.0).to(tl.float32)
    else:
        gate = tl.where(mask, 1.0, 0.0)
    return gate


@triton.jit
def _token_tile(x_base, g_base, start, T, H, N: tl.constexpr, BT: tl.constexpr, HAS_GATE: tl.constexpr,
                LP: tl.constexpr):
    """The (BT, N) tile and the gate of tokens start … start + BT − 1 (0 past T, where nothing is read)."""
    t = start + tl.arange(0, BT)
    mask = t < T
    return _load_tile(x_base, t, mask, H * N, N, LP), _load_gate(g_base, t, mask, H, HAS_GATE)


@triton.jit
def _token_tiles(x_base, y_base, g_base, start, T, H, NX: tl.constexpr, NY: tl.constexpr, BT: tl.constexpr,
                 HAS_GATE: tl.constexpr, LP: tl.constexpr):
    """Two token tiles and the gate (:func:`_token_tile`)."""
    x, g = _token_tile(x_base, g_base, start, T, H, NX, BT, HAS_GATE, LP)
    t = start + tl.arange(0, BT)
    return x, _load_tile(y_base, t, t < T, H * NY, NY, LP), g


@triton.jit
def _operand(ptr, R: tl.constexpr, C: tl.constexpr, SR: tl.constexpr, SC: tl.constexpr, LP: tl.constexpr):
    """An (R, C) fp32 matrix at ``ptr`` (strides SR, SC; transposed reads are free) as the split operand of
    :func:`_dot_exact_a`."""
    x = tl.load(ptr + tl.arange(0, R)[:, None] * SR + tl.arange(0, C)[None, :] * SC)
    if LP:
        hi, lo = _split(x, tl.bfloat16)
    else:
        hi, lo = x, x
    return hi, lo


@triton.jit
def _statistics(k_base, v_base, b_base, T, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                HAS_BETA: tl.constexpr, LP: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr,
                PREFETCH: tl.constexpr):
    """H = Σ β k kᵀ (symmetrised) and Uᵀ = Σ β k vᵀ over the whole sequence, fp32. PREFETCH: each step loads the
    next tile before it works on the current one (the loads are not pipelined otherwise)."""
    Hs = tl.zeros([K, K], tl.float32)
    Us = tl.zeros([K, V], tl.float32)
    if PREFETCH:
        kn, vn, bn = _token_tiles(k_base, v_base, b_base, 0, T, H, K, V, BT, HAS_BETA, LP)
    for start in range(0, T, BT):
        if PREFETCH:
            kc, vc, b = kn, vn, bn
            kn, vn, bn = _token_tiles(k_base, v_base, b_base, start + BT, T, H, K, V, BT, HAS_BETA, LP)
        else:
            kc, vc, b = _token_tiles(k_base, v_base, b_base, start, T, H, K, V, BT, HAS_BETA, LP)
        if HAS_BETA:
            kw = tl.trans(kc.to(tl.float32) * b[:, None])
            Hs = _dot_exact_b(kw, kc, Hs, tl.bfloat16, LP, PREC, EMU)
            Us = _dot_exact_b(kw, vc, Us, tl.bfloat16, LP, PREC, EMU)
        elif LP:
            # β = 1: k itself is exact in the input dtype, one pass is exact
            kT = tl.trans(kc)
            Hs = _lp_dot(kT, kc, Hs, EMU)
            Us = _lp_dot(kT, vc, Us, EMU)
        else:
            kT = tl.trans(kc)
            Hs = tl.dot(kT, kc, Hs, input_precision=PREC)
            Us = tl.dot(kT, vc, Us, input_precision=PREC)
    return 0.5 * (Hs + tl.trans(Hs)), Us


@triton.jit
def _chebyshev_inverse(A, lam, F, K: tl.constexpr, NUM_ITERS: tl.constexpr, SPREC: tl.constexpr, EMU: tl.constexpr):
    """p_r(A) for the paper's Algorithm 1 (μ = λ, L = F + λ) run on the identity: then x_t = p_r(A) q_t is the
    iteration's result for every token."""
    offs = tl.arange(0, K)
    eye = tl.where(offs[:, None] == offs[None, :], 1.0, 0.0)
    step = 2.0 / (F + 2.0 * lam)
    half = F * step * 0.5
    rho2 = half * half
    X_prev = tl.zeros([K, K], tl.float32)
    X = eye * step
    omega = step * 0.0 + 2.0
    for _ in range(NUM_ITERS):
        omega = 4.0 / (4.0 - rho2 * omega)
        residual = _state_dot(A, X, SPREC, EMU) - eye
        X_new = X - (step * omega) * residual + (omega - 1.0) * (X - X_prev)
        X_prev = X
        X = X_new
    return 0.5 * (X + tl.trans(X))


@triton.jit
def _solve_matrix(Hs, ridge, K: tl.constexpr, SOLVER: tl.constexpr, NUM_ITERS: tl.constexpr, SPREC: tl.constexpr,
                  EMU: tl.constexpr, F64: tl.constexpr, EPS: tl.constexpr):
    """M for H: the exact inverse of H + λI (SOLVER 0: swept, in fp64 when F64) or its Chebyshev polynomial."""
    offs = tl.arange(0, K)
    F = tl.sqrt(tl.sum(tl.sum(Hs * Hs, 1), 0))
    lam = ridge * (F + EPS)
    A = tl.where(offs[:, None] == offs[None, :], Hs + lam, Hs)
    if SOLVER == 0:
        if F64:
            M = _sweep_inverse(A.to(tl.float64), (F + lam).to(tl.float64), K).to(tl.float32)
        else:
            M = _sweep_inverse(A, F + lam, K)
    else:
        M = _chebyshev_inverse(A, lam, F, K, NUM_ITERS, SPREC, EMU)
    return M


@triton.jit
def _state_blocks(states, i_bh, K: tl.constexpr, V: tl.constexpr, RELOAD: tl.constexpr):
    """Where this (batch, head)'s saved H, M (K×K), Uᵀ and, with RELOAD only, R (K×V), all row-major, start: one
    block after another (the host's ``state_words``)."""
    base = states + i_bh * (2 * K * K + (2 if RELOAD else 1) * K * V)
    p_m = base + K * K
    p_u = base + 2 * K * K
    return base, p_m, p_u, p_u + K * V


@triton.jit
def _load_square(ptr, K: tl.constexpr):
    return tl.load(ptr + tl.arange(0, K)[:, None] * K + tl.arange(0, K)[None, :])


@triton.jit
def _store_matrix(ptr, x, R: tl.constexpr, C: tl.constexpr):
    tl.store(ptr + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :], x)


@triton.jit
def _sequence(i_bh, T, H, K: tl.constexpr, V: tl.constexpr):
    """Element offsets of token 0 of this (batch, head) in (B, T, H, K), (B, T, H, V) and (B, T, H) tensors."""
    i_b = i_bh // H
    row0 = i_b * T * H + (i_bh - i_b * H)
    return row0 * K, row0 * V, row0


@triton.jit
def _read_out(q_base, a_base, o_base, p_u, p_r, Us, R, qn, an, T, H, K: tl.constexpr, V: tl.constexpr,
              BT: tl.constexpr, HAS_ALPHA: tl.constexpr, RELOAD: tl.constexpr, LP: tl.constexpr,
              PREC: tl.constexpr, EMU: tl.constexpr, PREFETCH: tl.constexpr):
    """O = Q Uᵀ + α ⊙ (Q R) (α ≡ 1: O = Q R) per token tile; RELOAD: Uᵀ and R re-read per tile from the state.
    PREFETCH: ``qn, an`` are the first tiles and each step loads the next one before it works on the current one."""
    if RELOAD:
        tl.debug_barrier()                                                  # the state stores, seen by all warps
    elif LP:
        U_hi, U_lo = _split(Us, tl.bfloat16)
        R_hi, R_lo = _split(R, tl.bfloat16)
    else:
        U_hi, U_lo, R_hi, R_lo = Us, Us, R, R
    for start in range(0, T, BT):
        t = start + tl.arange(0, BT)
        mask = t < T
        if PREFETCH:
            qc, a = qn, an
            qn, an = _token_tile(q_base, a_base, start + BT, T, H, K, BT, HAS_ALPHA, LP)
        else:
            qc, a = _token_tile(q_base, a_base, start, T, H, K, BT, HAS_ALPHA, LP)
        if RELOAD:
            R_hi, R_lo = _operand(p_r, K, V, V, 1, LP)
        out = _dot_exact_a(qc, R_hi, R_lo, LP, PREC, EMU)
        if HAS_ALPHA:
            if RELOAD:
                U_hi, U_lo = _operand(p_u, K, V, V, 1, LP)
            out = _dot_exact_a(qc, U_hi, U_lo, LP, PREC, EMU) + a[:, None] * out
        tl.store(_tile_ptrs(o_base, t, H * V, V), out.to(o_base.dtype.element_ty), mask=mask[:, None])


@triton.jit(do_not_specialize=["T", "H"])
def gka_noncausal_fwd_kernel(q, k, v, beta, alpha, o, states, ridge, T, H, K: tl.constexpr, V: tl.constexpr,
                             BT: tl.constexpr, SOLVER: tl.constexpr, NUM_ITERS: tl.constexpr, HAS_BETA: tl.constexpr,
                             HAS_ALPHA: tl.constexpr, SAVE: tl.constexpr, RELOAD: tl.constexpr, LP: tl.constexpr,
                             PREC: tl.constexpr, SPREC: tl.constexpr, EMU: tl.constexpr, F64: tl.constexpr,
                             EPS: tl.constexpr, PREFETCH: tl.constexpr, PHASE: tl.constexpr,
                             SOLVE_SPREC: tl.constexpr):
    """One (batch, head): statistics over all tokens, M, then O = Q Uᵀ + α ⊙ (Q D) (α ≡ 1: O = Q P) per token tile.
    PREFETCH: the token loops load one tile ahead, and the read-out's first tile is read before the statistics (its
    latency hidden behind them and the solve).

    PHASE 0 does all of it; split in three launches (wide heads: the solve's serial steps then run on programs that
    hold only the K×K tile, many to an SM, instead of the few that fit with the token passes' registers), PHASE 1 stores
    H and Uᵀ, :func:`gka_noncausal_solve_kernel` M, and PHASE 2 reads M and Uᵀ back for the read-out.

    The state block R is D (with α) or P (without); it is stored only with RELOAD (wide heads), where the read-out's
    K×V operands are re-read per token tile instead of held through the loop (registers / shared memory): otherwise
    the backward recomputes it from M and Uᵀ (one K×K by K×V product against K·V·4 bytes written and read)."""
    ridge = tl.cast(ridge, tl.float32)  # fp32 whatever the launcher passes (Inductor passes Python floats as fp64)
    i_bh = tl.cast(tl.program_id(0), tl.int64)
    off_k, off_v, off_g = _sequence(i_bh, T, H, K, V)
    q_base = q + off_k
    a_base = alpha + off_g
    p_h, p_m, p_u, p_r = _state_blocks(states, i_bh, K, V, RELOAD)
    qn, an = 0.0, 0.0                                                       # the read-out's first tiles (PREFETCH)
    if PREFETCH and PHASE != 1:
        qn, an = _token_tile(q_base, a_base, 0, T, H, K, BT, HAS_ALPHA, LP)
    if PHASE == 2:
        M = _load_square(p_m, K)
        Us = tl.load(p_u + tl.arange(0, K)[:, None] * V + tl.arange(0, V)[None, :])
    else:
        Hs, Us = _statistics(k + off_k, v + off_v, beta + off_g, T, H, K, V, BT, HAS_BETA, LP, PREC, EMU, PREFETCH)
    if PHASE == 1:
        _store_matrix(p_h, Hs, K, K)
        _store_matrix(p_u, Us, K, V)
    else:
        if PHASE == 0:
            M = _solve_matrix(Hs, ridge, K, SOLVER, NUM_ITERS, SOLVE_SPREC, EMU, F64, EPS)
            if SAVE or RELOAD:
                _store_matrix(p_h, Hs, K, K)
                _store_matrix(p_m, M, K, K)
                _store_matrix(p_u, Us, K, V)
        R = _state_dot(M, Us, SPREC, EMU)                                  # P = M Uᵀ
        if HAS_ALPHA:
            R -= Us                                                         # D = P − Uᵀ
        if RELOAD:
            _store_matrix(p_r, R, K, V)                                     # the backward recomputes it otherwise
        _read_out(q_base, a_base, o + off_v, p_u, p_r, Us, R, qn, an, T, H, K, V, BT, HAS_ALPHA, RELOAD, LP, PREC,
                  EMU, PREFETCH)


@triton.jit
def gka_noncausal_solve_kernel(states, ridge, K: tl.constexpr, V: tl.constexpr, SOLVER: tl.constexpr,
                               NUM_ITERS: tl.constexpr, RELOAD: tl.constexpr, SPREC: tl.constexpr, EMU: tl.constexpr,
                               F64: tl.constexpr, EPS: tl.constexpr, BLOCK_INVERSE: tl.constexpr):
    """M from the saved H for one (batch, head): the middle launch of the split forward (``PHASE``). The block
    inverse (BLOCK_INVERSE) reads and writes its top-level blocks in place in the state instead of holding K×K tiles."""
    ridge = tl.cast(ridge, tl.float32)  # fp32 whatever the launcher passes (Inductor passes Python floats as fp64)
    p_h, p_m, p_u, p_r = _state_blocks(states, tl.cast(tl.program_id(0), tl.int64), K, V, RELOAD)
    if SOLVER == 0 and not F64 and BLOCK_INVERSE:
        _inverse_in_memory(p_h, p_m, ridge, K, SPREC, EMU, EPS)
    else:
        M = _solve_matrix(_load_square(p_h, K), ridge, K, SOLVER, NUM_ITERS, SPREC, EMU, F64, EPS)
        _store_matrix(p_m, M, K, K)


@triton.jit
def _query_side(q_base, a_base, do_base, dq_base, da_base, p_u, p_r, Us, R, qn, dOn, an, T, H, K: tl.constexpr,
                V: tl.constexpr, BT: tl.constexpr, HAS_ALPHA: tl.constexpr, RELOAD: tl.constexpr, LP: tl.constexpr,
                PREC: tl.constexpr, EMU: tl.constexpr, PREFETCH: tl.constexpr):
    """dq = dO U + α ⊙ (dO Dᵀ) (α ≡ 1: dO Pᵀ) and dα_t = q_t·(D do_t) for every token; returns G₀ = Σ do qᵀ and
    G₁ = Σ α do qᵀ (V×K; the same sum when α ≡ 1). U and Dᵀ / Pᵀ come from the K×V ``Us`` and ``R``, or with RELOAD
    are read transposed from the K×V state blocks per token tile. PREFETCH: ``qn, dOn, an`` are the first tiles (read
    by the caller) and each step loads the next one before it works on the current one."""
    if not RELOAD:
        if LP:
            R_hi, R_lo = _split(tl.trans(R), tl.bfloat16)
            U_hi, U_lo = _split(tl.trans(Us), tl.bfloat16)
        else:
            R_hi = tl.trans(R)
            U_hi = tl.trans(Us)
            R_lo, U_lo = R_hi, U_hi
    G0 = tl.zeros([V, K], tl.float32)
    G1 = tl.zeros([V, K], tl.float32)
    for start in range(0, T, BT):
        t = start + tl.arange(0, BT)
        mask = t < T
        if PREFETCH:
            qc, dOc, a = qn, dOn, an
            qn, dOn, an = _token_tiles(q_base, do_base, a_base, start + BT, T, H, K, V, BT, HAS_ALPHA, LP)
        else:
            qc = _load_tile(q_base, t, mask, H * K, K, LP)
            dOc = _load_tile(do_base, t, mask, H * V, V, LP)
        if RELOAD:
            R_hi, R_lo = _operand(p_r, V, K, 1, V, LP)
        grad = _dot_exact_a(dOc, R_hi, R_lo, LP, PREC, EMU)
        if HAS_ALPHA:
            if RELOAD:
                U_hi, U_lo = _operand(p_u, V, K, 1, V, LP)
            if not PREFETCH:
                # read where it is used: loaded with q and dO it stays live through the products (more spills)
                a = _load_gate(a_base, t, mask, H, True)
            tl.store(da_base + t * H, tl.sum(qc.to(tl.float32) * grad, 1), mask=mask)
            grad = _dot_exact_a(dOc, U_hi, U_lo, LP, PREC, EMU) + a[:, None] * grad
            G1 = _dot_exact_b(tl.trans(dOc.to(tl.float32) * a[:, None]), qc, G1, tl.bfloat16, LP, PREC, EMU)
        if LP:
            G0 = _lp_dot(tl.trans(dOc), qc, G0, EMU)
        else:
            G0 = tl.dot(tl.trans(dOc), qc, G0, input_precision=PREC)
        tl.store(_tile_ptrs(dq_base, t, H * K, K), grad.to(dq_base.dtype.element_ty), mask=mask[:, None])
    if not HAS_ALPHA:
        G1 = G0
    return G0, G1


@triton.jit
def _state_gradients(G0, G1, P_held, ridge, p_h, p_m, p_u, p_r, K: tl.constexpr, V: tl.constexpr,
                     HAS_ALPHA: tl.constexpr, RELOAD: tl.constexpr, HOLD_P: tl.constexpr, SPREC: tl.constexpr,
                     EMU: tl.constexpr):
    """S = dH + dHᵀ (K×K) and dU (V×K) from the token sums G₀, G₁ and the saved state. P = M Uᵀ is ``P_held``
    (HOLD_P: narrow heads, where it costs a few registers through the query-side pass), else recomputed (RELOAD:
    read), not held through that pass (registers of wide heads)."""
    offs_k = tl.arange(0, K)
    kv = offs_k[:, None] * V + tl.arange(0, V)[None, :]
    eye = offs_k[:, None] == offs_k[None, :]
    M = _load_square(p_m, K)
    if HOLD_P:
        P = P_held
    elif RELOAD:
        P = tl.load(p_r + kv)
        if HAS_ALPHA:
            P += tl.load(p_u + kv)
    else:
        P = _state_dot(M, tl.load(p_u + kv), SPREC, EMU)
    # G₁M is a factor of both: dU = G₀ + G₁(M − I) and W = P G₁ M = Σ_t y_t x_tᵀ
    G1M = _state_dot(G1, M, SPREC, EMU)
    dU = G0 + G1M - G1
    W = _state_dot(P, G1M, SPREC, EMU)
    trace = tl.sum(tl.sum(tl.where(eye, W, 0.0), 1), 0)
    Hs = _load_square(p_h, K)
    F = tl.sqrt(tl.sum(tl.sum(Hs * Hs, 1), 0))
    # λ = ridge·(F + EPS): dλ = −tr W reaches H through ∂F/∂H = H/F (taken as 0 at F = 0, as autograd does)
    coef = tl.where(F > 0, 2.0 * ridge * trace / tl.where(F > 0, F, 1.0), 0.0)
    S = -(W + tl.trans(W)) - coef * Hs
    return S, dU


@triton.jit
def _key_side(k_base, v_base, b_base, dk_base, dv_base, db_base, S, dU, p_s, p_du, kn, vn, bn, T, H,
              K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, HAS_BETA: tl.constexpr, RELOAD: tl.constexpr,
              LP: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr, PREFETCH: tl.constexpr):
    """dk = β ⊙ (K S + V dU), dv = β ⊙ (K dUᵀ), dβ_t = k_t·(½ S k_t + dUᵀ v_t) for every token. RELOAD: S and dU
    (V×K, row-major) are read per tile from ``p_s``, ``p_du`` instead of held in ``S``, ``dU``.
    PREFETCH: as in :func:`_query_side` (``kn, vn, bn``: the first tiles)."""
    if not RELOAD:
        dUt = tl.trans(dU)
        if LP:
            S_hi, S_lo = _split(S, tl.bfloat16)
            dU_hi, dU_lo = _split(dU, tl.bfloat16)
            dUt_hi, dUt_lo = _split(dUt, tl.bfloat16)
        else:
            S_hi, S_lo, dU_hi, dU_lo, dUt_hi, dUt_lo = S, S, dU, dU, dUt, dUt
    for start in range(0, T, BT):
        t = start + tl.arange(0, BT)
        mask = t < T
        if PREFETCH:
            kc, vc, b = kn, vn, bn
            kn, vn, bn = _token_tiles(k_base, v_base, b_base, start + BT, T, H, K, V, BT, HAS_BETA, LP)
        else:
            kc, vc, b = _token_tiles(k_base, v_base, b_base, start, T, H, K, V, BT, HAS_BETA, LP)
        if RELOAD:
            S_hi, S_lo = _operand(p_s, K, K, K, 1, LP)
            dU_hi, dU_lo = _operand(p_du, V, K, K, 1, LP)
        KS = _dot_exact_a(kc, S_hi, S_lo, LP, PREC, EMU)
        VdU = _dot_exact_a(vc, dU_hi, dU_lo, LP, PREC, EMU)
        grad = b[:, None] * (KS + VdU)
        tl.store(_tile_ptrs(dk_base, t, H * K, K), grad.to(dk_base.dtype.element_ty), mask=mask[:, None])
        if HAS_BETA:
            tl.store(db_base + t * H, tl.sum(kc.to(tl.float32) * (0.5 * KS + VdU), 1), mask=mask)
        if RELOAD:
            dUt_hi, dUt_lo = _operand(p_du, K, V, 1, K, LP)
        grad = b[:, None] * _dot_exact_a(kc, dUt_hi, dUt_lo, LP, PREC, EMU)
        tl.store(_tile_ptrs(dv_base, t, H * V, V), grad.to(dv_base.dtype.element_ty), mask=mask[:, None])


@triton.jit(do_not_specialize=["T", "H"])
def gka_noncausal_bwd_kernel(q, k, v, beta, alpha, do, states, scratch, dq, dk, dv, dbeta, dalpha, ridge, T, H,
                             K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, HAS_BETA: tl.constexpr,
                             HAS_ALPHA: tl.constexpr, RELOAD: tl.constexpr, LP: tl.constexpr, PREC: tl.constexpr,
                             SPREC: tl.constexpr, EMU: tl.constexpr, PREFETCH: tl.constexpr, HOLD_P: tl.constexpr):
    """One (batch, head): the query-side pass (dq, dα, token sums), the state gradients, the key-side pass.
    RELOAD: S and dU go through ``scratch`` (K×K + V×K per (batch, head)) between the last two. PREFETCH: the passes
    load one tile ahead; their first tiles are read before the work that precedes them (R; the state gradients)."""
    ridge = tl.cast(ridge, tl.float32)  # fp32 whatever the launcher passes (Inductor passes Python floats as fp64)
    i_bh = tl.cast(tl.program_id(0), tl.int64)
    off_k, off_v, off_g = _sequence(i_bh, T, H, K, V)
    p_s = scratch + i_bh * (K * K + V * K)
    p_du = p_s + K * K
    p_h, p_m, p_u, p_r = _state_blocks(states, i_bh, K, V, RELOAD)
    qn, dOn, an = 0.0, 0.0, 0.0                                          # the first tiles, read here with PREFETCH
    if PREFETCH:
        qn, dOn, an = _token_tiles(q + off_k, do + off_v, alpha + off_g, 0, T, H, K, V, BT, HAS_ALPHA, LP)
    if RELOAD:
        # wide heads: the query-side pass re-reads its operands per token tile
        Us = tl.zeros([K, V], tl.float32)
        R = Us
        P = Us
    else:
        # R as the forward computed it (it is not stored): P = M Uᵀ, D = P − Uᵀ
        Us = tl.load(p_u + tl.arange(0, K)[:, None] * V + tl.arange(0, V)[None, :])
        P = _state_dot(_load_square(p_m, K), Us, SPREC, EMU)
        R = P - Us if HAS_ALPHA else P
    G0, G1 = _query_side(q + off_k, alpha + off_g, do + off_v, dq + off_k, dalpha + off_g, p_u, p_r, Us, R, qn, dOn,
                         an, T, H, K, V, BT, HAS_ALPHA, RELOAD, LP, PREC, EMU, PREFETCH)
    kn, vn, bn = 0.0, 0.0, 0.0
    if PREFETCH:
        kn, vn, bn = _token_tiles(k + off_k, v + off_v, beta + off_g, 0, T, H, K, V, BT, HAS_BETA, LP)
    S, dU = _state_gradients(G0, G1, P, ridge, p_h, p_m, p_u, p_r, K, V, HAS_ALPHA, RELOAD, HOLD_P, SPREC, EMU)
    if RELOAD:
        _store_matrix(p_s, S, K, K)
        _store_matrix(p_du, dU, V, K)
        tl.debug_barrier()
    _key_side(k + off_k, v + off_v, beta + off_g, dk + off_k, dv + off_v, dbeta + off_g, S, dU, p_s, p_du, kn, vn, bn,
              T, H, K, V, BT, HAS_BETA, RELOAD, LP, PREC, EMU, PREFETCH)
