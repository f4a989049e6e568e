"""Triton device functions of the non-causal GKA kernels: the fp32 products of per-(batch, head) matrices and the
inverse of the K×K ridge matrix A = H + λI (symmetric positive definite, κ ≤ 1 + 1/ridge).

The inverse is a Gauss–Jordan sweep (:func:`_sweep_inverse`) for most heads and, for 64-wide ones in the split
forward, a block inverse (:func:`_inverse_in_memory`): the 2×2 Schur complement on half-width blocks, whose
diagonal blocks are swept. A sweep is K serial, latency-bound steps (a cross-thread column reduction and a rank-1
update of the whole tile); the block form does as many serial steps on tiles a quarter the size and the rest as a
few tensor-core products (:func:`_state_dot`). A is symmetric positive definite, so neither needs pivoting: the
leading blocks and the Schur complements are symmetric positive definite with κ no larger than A's, and their
diagonals are bounded by A's (the ``scale`` of every sweep)."""

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
def _split(x, LP_TY: tl.constexpr):
    """fp32 x ≈ hi + lo with hi, lo in LP_TY."""
    hi = x.to(LP_TY)
    return hi, (x - hi.to(tl.float32)).to(LP_TY)


@triton.jit
def _state_dot(a, b, SPREC: tl.constexpr, EMU: tl.constexpr):
    """a @ b for fp32 a, b (the per-(batch, head) products): ``"bf16x3"`` = hi·hi + hi·lo + lo·hi on bf16 tensor
    cores (~2⁻¹⁶ relative; its operands take half the shared memory of tf32x3's, which matters for 128-wide
    heads), else tl.dot's ``SPREC``."""
    if SPREC == "bf16x3":
        a_hi, a_lo = _split(a, tl.bfloat16)
        b_hi, b_lo = _split(b, tl.bfloat16)
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
    (the 32-wide blocks of :func:`_inverse_in_memory`), where the column's is five shuffle rounds per held row."""
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
def _symmetrised(X):
    return 0.5 * (X + tl.trans(X))


@triton.jit
def _inverse_in_memory(p_h, p_m, ridge, K: tl.constexpr, SPREC: tl.constexpr, EMU: tl.constexpr, EPS: tl.constexpr):
    """M = (H + λI)⁻¹ from the row-major symmetric (K, K) H at ``p_h`` into ``p_m`` by one 2×2 Schur level on
    K/2-step sweeps: X = A11⁻¹A12, S = A22 − A12ᵀX, M22 = S⁻¹, M12 = −X M22, M11 = A11⁻¹ − M12 Xᵀ. The blocks are
    read and written in place in memory, so that no (K, K) tile is ever held (the registers of one program, hence
    how many programs share an SM to hide the serial steps' latency). The products are not exactly symmetric in
    floating point: S and M11 are symmetrised (the sweep reads S's rows as its columns, the backward reads M as
    symmetric)."""
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
    I11 = _sweep_inverse(A11, scale, N, True)
    tl.store(p_m + r * K + c, I11)
    A12 = tl.load(p_h + r * K + N + c, cache_modifier=".cg")
    X = _state_dot(I11, A12, SPREC, EMU)                                   # A11⁻¹ A12
    A22 = tl.load(p_h + (N + r) * K + N + c, cache_modifier=".cg")
    S = _symmetrised(tl.where(r == c, A22 + lam, A22) - _state_dot(tl.trans(A12), X, SPREC, EMU))
    M22 = _sweep_inverse(S, scale, N, True)
    M12 = -_state_dot(X, M22, SPREC, EMU)
    tl.store(p_m + r * K + N + c, M12)
    tl.store(p_m + (N + c) * K + r, M12)                                  # M21 = M12ᵀ
    tl.store(p_m + (N + r) * K + N + c, M22)
    tl.debug_barrier()                                                    # A11⁻¹ in M11's place, seen by all warps
    I11 = tl.load(p_m + r * K + c, cache_modifier=".cg")
    tl.debug_barrier()                                                    # read by all before M11 overwrites it
    tl.store(p_m + r * K + c, _symmetrised(I11 - _state_dot(M12, tl.trans(X), SPREC, EMU)))
