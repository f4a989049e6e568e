"""Triton device functions of the non-causal GKA kernels: the fp32 products of per-(batch, head) matrices and the
inverse of the K×K ridge matrix A = H + λI (symmetric positive definite, κ ≤ 1 + 1/ridge).

The inverse is a Gauss–Jordan sweep (:func:`_sweep_inverse`) for narrow heads and, for wide ones, a block inverse
(:func:`_block_inverse`): the 2×2 Schur complement on half-width blocks, whose diagonal blocks are swept (or split
once more). A sweep is K serial steps, each a cross-thread column reduction and a rank-1 update of the whole tile
whose operand changes layout through shared memory; on a 64-wide tile those steps are latency-bound and take about
half of the forward. The block form does the same number of serial steps on tiles a quarter (or a sixteenth) the
size, and the rest as a few tensor-core products (:func:`_state_dot`). A is symmetric positive definite, so neither
needs pivoting: the leading blocks and the Schur complements are symmetric positive definite with κ no larger than
A's, and their diagonals are bounded by A's (the ``scale`` of every sweep)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = []


@triton.jit
def _lp_dot(a, b, acc, EMU: tl.constexpr):
    """a @ b + acc for 16-bit a, b: exact products, fp32 accumulation."""
    if EMU:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _split(x, LP_TY: tl.constexpr, PASSES: tl.constexpr):
    """fp32 x ≈ hi + lo with hi, lo in LP_TY (lo = hi when one pass is asked for: never read then)."""
    hi = x.to(LP_TY)
    if PASSES == 2:
        lo = (x - hi.to(tl.float32)).to(LP_TY)
    else:
        lo = hi
    return hi, lo


@triton.jit
def _state_dot(a, b, SPREC: tl.constexpr, EMU: tl.constexpr):
    """a @ b for fp32 a, b (the per-(batch, head) products): ``"bf16x3"`` = hi·hi + hi·lo + lo·hi on bf16 tensor
    cores (~2⁻¹⁶ relative; its operands take half the shared memory of tf32x3's, which matters for 128-wide
    heads), else tl.dot's ``SPREC``."""
    if SPREC == "bf16x3":
        a_hi, a_lo = _split(a, tl.bfloat16, 2)
        b_hi, b_lo = _split(b, tl.bfloat16, 2)
        out = _lp_dot(a_hi, b_lo, None, EMU)
        out = _lp_dot(a_lo, b_hi, out, EMU)
        out = _lp_dot(a_hi, b_hi, out, EMU)
    else:
        out = tl.dot(a, b, input_precision=SPREC)
    return out


@triton.jit
def _sweep_inverse(A, scale, K: tl.constexpr, BY_ROWS: tl.constexpr = False):
    """A⁻¹ for a symmetric positive definite A (κ ≤ 1 + 1/ridge here) whose diagonal entries are at most ``scale``:
    K Gauss–Jordan sweeps of B = A / scale, no pivoting, one rank-1 update each.

    Sweeping pivot j with d = b_jj maps b_jj → −1/d, b_ij and b_ji → b_ij/d (i ≠ j) and every other entry
    b_il → b_il − b_ij b_jl / d; after all K pivots the tile holds −B⁻¹. For a symmetric tile that map is
    B − a aᵀ − 2 e_j e_jᵀ with a = (b_:j − e_j)/√d (d > 0: B stays positive definite on the pivots not swept yet).
    The −2 on b_jj is left out: no later pivot reads b_jj (they read their own column, whose entry j is off the
    diagonal), so after all K pivots B⁻¹ = 2I − B. Each step is one column reduction (within a warp) and one
    update of one fused multiply–add per entry; the tile stays exactly symmetric (a_i a_l = a_l a_i). The scaling
    keeps every pivot d ≤ 1, so the shifted diagonal 2 − 1/d − … never cancels against the 2 taken off at the end.

    BY_ROWS: row j is taken by a reduction over the rows (axis 0) instead of column j over the columns. Triton lays
    a tile's columns across a warp's lanes, so that reduction stays within each thread when one warp holds the tile
    (the 32-wide leaves of :func:`_block_inverse`), where the column's is five shuffle rounds per held row."""
    offs = tl.arange(0, K)
    inv_scale = 1.0 / scale
    B = A * inv_scale
    for j in range(K):
        if BY_ROWS:
            line = tl.sum(tl.where(offs[:, None] == j, B, 0.0), 0)      # row j = column j
        else:
            line = tl.sum(tl.where(offs[None, :] == j, B, 0.0), 1)      # column j = row j
        unit = tl.where(offs == j, 1.0, 0.0)
        d = tl.sum(line * unit, 0)
        a = (line - unit) * (1.0 / tl.sqrt(d))
        B -= a[:, None] * a[None, :]
    return (tl.where(offs[:, None] == offs[None, :], 2.0, 0.0) - B) * inv_scale


@triton.jit
def _quarters(A, N: tl.constexpr):
    """The four (N/2, N/2) blocks A11, A12, A21, A22 of the (N, N) register tile A."""
    parts = tl.permute(tl.reshape(A, (2, N // 2, 2, N // 2)), (1, 3, 0, 2))   # (a, b, block row, block column)
    left, right = tl.split(parts)                                             # block column 0 / 1
    A11, A21 = tl.split(left)
    A12, A22 = tl.split(right)
    return A11, A12, A21, A22


@triton.jit
def _assemble(A11, A12, A21, A22, N: tl.constexpr):
    """The (N, N) tile of four (N/2, N/2) blocks (the inverse of :func:`_quarters`)."""
    parts = tl.join(tl.join(A11, A12), tl.join(A21, A22))                   # (a, b, block column, block row)
    return tl.reshape(tl.permute(parts, (3, 0, 2, 1)), (N, N))


@triton.jit
def _symmetrised(X):
    return 0.5 * (X + tl.trans(X))


@triton.jit
def _schur_combine(I11, A12, A21, A22, scale, N: tl.constexpr, NESTED: tl.constexpr, SPREC: tl.constexpr,
                   EMU: tl.constexpr):
    """The (N, N) A⁻¹ from I11 = A11⁻¹ and the other blocks (:func:`_schur_blocks`)."""
    M11, M12, M22 = _schur_blocks(I11, A12, A21, A22, scale, N, NESTED, SPREC, EMU)
    return _assemble(M11, M12, tl.trans(M12), M22, N)


@triton.jit
def _schur_blocks(I11, A12, A21, A22, scale, N: tl.constexpr, NESTED: tl.constexpr, SPREC: tl.constexpr,
                  EMU: tl.constexpr):
    """Blocks M11, M12, M22 of A⁻¹ (M21 = M12ᵀ) from I11 = A11⁻¹ and the other (N/2, N/2) blocks of A:
    X = A11⁻¹A12, S = A22 − A21 X, M22 = S⁻¹ (swept, or with NESTED one more block level), M12 = −X M22,
    M11 = A11⁻¹ − M12 Xᵀ (= A11⁻¹ + X S⁻¹ Xᵀ). The products are not exactly symmetric in floating point: S and M11
    are symmetrised (the sweep reads S's rows as its columns, and the backward reads M as symmetric)."""
    X = _state_dot(I11, A12, SPREC, EMU)
    S = _symmetrised(A22 - _state_dot(A21, X, SPREC, EMU))
    if NESTED:
        M22 = _schur_sweeps(S, scale, N // 2, SPREC, EMU)
    else:
        M22 = _sweep_inverse(S, scale, N // 2, True)
    M12 = -_state_dot(X, M22, SPREC, EMU)
    M11 = _symmetrised(I11 - _state_dot(M12, tl.trans(X), SPREC, EMU))
    return M11, M12, M22


@triton.jit
def _schur_sweeps(A, scale, N: tl.constexpr, SPREC: tl.constexpr, EMU: tl.constexpr):
    """A⁻¹ by one 2×2 block level whose two diagonal inverses (A11 and the Schur complement) are N/2-step sweeps."""
    A11, A12, A21, A22 = _quarters(A, N)
    return _schur_combine(_sweep_inverse(A11, scale, N // 2, True), A12, A21, A22, scale, N, False, SPREC, EMU)


@triton.jit
def _schur_nested(A, scale, N: tl.constexpr, SPREC: tl.constexpr, EMU: tl.constexpr):
    """A⁻¹ by two block levels: sweeps on N/4-wide leaves."""
    A11, A12, A21, A22 = _quarters(A, N)
    return _schur_combine(_schur_sweeps(A11, scale, N // 2, SPREC, EMU), A12, A21, A22, scale, N, True, SPREC, EMU)


@triton.jit
def _block_inverse(A, scale, K: tl.constexpr, LEAF: tl.constexpr, SPREC: tl.constexpr, EMU: tl.constexpr):
    """A⁻¹ for the symmetric positive definite (K, K) A with diagonal at most ``scale``: a sweep (LEAF = K), one 2×2
    Schur level on sweeps of K/2 (LEAF = K/2), or two levels on sweeps of K/4 (LEAF = K/4); the products in SPREC."""
    if LEAF >= K:
        M = _sweep_inverse(A, scale, K)
    elif LEAF * 2 == K:
        M = _schur_sweeps(A, scale, K, SPREC, EMU)
    else:
        tl.static_assert(LEAF * 4 == K, "LEAF must be K, K/2 or K/4")
        M = _schur_nested(A, scale, K, SPREC, EMU)
    return M


@triton.jit
def _inverse_in_memory(p_h, p_m, ridge, K: tl.constexpr, LEAF: tl.constexpr, SPREC: tl.constexpr, EMU: tl.constexpr,
                       EPS: tl.constexpr):
    """M = (H + λI)⁻¹ from the row-major symmetric (K, K) H at ``p_h`` into ``p_m``, for LEAF = K/2 or K/4: the
    top-level blocks are read and written in place in memory, so that no (K, K) tile is ever held (the registers
    of one program, hence how many programs share an SM to hide the serial steps' latency)."""
    N: tl.constexpr = K // 2
    r = tl.arange(0, N)[:, None]
    c = tl.arange(0, N)[None, :]
    # H is symmetric (A21 = A12ᵀ). Few blocks are live at a time (registers: one warp holds a 32×32 fp32 block in 32
    # per thread): A12 and A22 are read again where they are used, and A11⁻¹ waits in M11's place until the end
    A11 = tl.load(p_h + r * K + c)
    A12 = tl.load(p_h + r * K + N + c)
    A22 = tl.load(p_h + (N + r) * K + N + c)
    F = tl.sqrt(tl.sum(tl.sum(A11 * A11 + 2.0 * (A12 * A12) + A22 * A22, 1), 0))
    lam = ridge * (F + EPS)
    scale = F + lam
    A11 = tl.where(r == c, A11 + lam, A11)
    if LEAF * 2 == K:
        I11 = _sweep_inverse(A11, scale, N, True)
    else:
        I11 = _schur_sweeps(A11, scale, N, SPREC, EMU)
    tl.store(p_m + r * K + c, I11)
    A12 = tl.load(p_h + r * K + N + c, cache_modifier=".cg")
    X = _state_dot(I11, A12, SPREC, EMU)                                   # A11⁻¹ A12
    A22 = tl.load(p_h + (N + r) * K + N + c, cache_modifier=".cg")
    S = _symmetrised(tl.where(r == c, A22 + lam, A22) - _state_dot(tl.trans(A12), X, SPREC, EMU))
    if LEAF * 2 == K:
        M22 = _sweep_inverse(S, scale, N, True)
    else:
        M22 = _schur_sweeps(S, scale, N, SPREC, EMU)
    M12 = -_state_dot(X, M22, SPREC, EMU)
    tl.store(p_m + r * K + N + c, M12)
    tl.store(p_m + (N + c) * K + r, M12)                                  # M21 = M12ᵀ
    tl.store(p_m + (N + r) * K + N + c, M22)
    tl.debug_barrier()                                                    # A11⁻¹ in M11's place, seen by all warps
    I11 = tl.load(p_m + r * K + c, cache_modifier=".cg")
    tl.debug_barrier()                                                    # read by all before M11 overwrites it
    tl.store(p_m + r * K + c, _symmetrised(I11 - _state_dot(M12, tl.trans(X), SPREC, EMU)))
