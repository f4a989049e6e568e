"""Pieces shared by the SKA kernels: tile loads, and the dense R×R algebra in registers for a block of matrices at
once ([NB, R, R]: one matrix per (batch, head) for the non-causal operators, one per token for the causal ones) —
the inverse of the regularised Gram matrix and the power iteration for σ̂.

The inverse is Gauss–Jordan elimination without pivoting, which is stable for symmetric positive definite matrices
(every pivot is a Schur complement of G, at least λ). It gives G⁻¹ explicitly, so everything after it is products:
the kernels never need a Cholesky factor (see ``naive`` for why σ̂ does not either). Batching many small matrices
per program amortises the latency of the cross-lane reductions each elimination step needs."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_offsets(rows, T, stride, shift: tl.constexpr):
    """The mask of rows ``rows + shift`` in [0, T) and their offsets in a (T, ·) sequence with row stride ``stride``,
    [rows, 1] each. No pointer goes in: a kernel loads with these itself where what it loads locates a store (torch's
    mutation analysis of a ``wrap_triton`` launch stops only at a load in the kernel's own body)."""
    r = rows + shift
    live = (r >= 0) & (r < T)
    mask = live[:, None]
    return mask, tl.cast(r[:, None], tl.int64) * stride


@triton.jit
def load_rows(ptr, rows, cols, T, stride, shift: tl.constexpr):
    """Rows ``rows + shift`` of a (T, ·) sequence with row stride ``stride`` (zeros outside [0, T)), in fp32.
    16-bit inputs are exact in TF32, so the tensor-core products of input tiles lose nothing."""
    mask, off = row_offsets(rows, T, stride, shift)
    return tl.load(ptr + off + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_rows(ptr, rows, cols, T, stride, x):
    """Store ``x`` in rows ``rows`` of a (T, ·) sequence with row stride ``stride`` (rows past T untouched), in the
    sequence's dtype: the counterpart of :func:`load_rows`."""
    tl.store(ptr + tl.cast(rows[:, None], tl.int64) * stride + cols[None, :], x.to(ptr.dtype.element_ty),
             mask=(rows < T)[:, None])


@triton.jit
def head_seq(ptr, pid, T, H, D):
    """Start of (batch, head) ``pid``'s sequence in a contiguous (B, T, H, D) tensor."""
    return strided_head_seq(ptr, pid, H, T * H * D, D)


@triton.jit
def strided_head_seq(ptr, pid, H, seq_stride, D):
    """Start of (batch, head) ``pid``'s sequence in a (B, T, H, D) tensor whose (H, D) block is contiguous and whose
    batch stride is ``seq_stride`` (its token stride goes to :func:`load_rows`)."""
    b = pid // H
    h = pid % H
    return ptr + b * seq_stride + h * D


@triton.jit
def zero_stats(R: tl.constexpr, V: tl.constexpr):
    """Empty raw statistics (G₀, M, Cᵀ, largest ‖k‖², its token): the start of every scan over a sequence."""
    G = tl.zeros([R, R], dtype=tl.float32)
    M = tl.zeros([R, R], dtype=tl.float32)
    CT = tl.zeros([R, V], dtype=tl.float32)
    best = tl.cast(-1.0, tl.float32)
    arg = tl.cast(0, tl.int32)
    return G, M, CT, best, arg


@triton.jit
def accumulate_stats(k_seq, v_seq, t0, T, k_row, v_row, G, M, CT, best, arg,
                     R: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr):
    """The raw statistics with the BT tokens from t0 added: G₀ += Σ k kᵀ, M += Σ k_t k_{t−1}ᵀ, Cᵀ += Σ k vᵀ, and
    the running largest ‖k‖² with its token (ties: the later token holds the max). ``k_row``, ``v_row``: token
    strides of k and v."""
    rr = tl.arange(0, R)
    vv = tl.arange(0, V)
    rows = t0 + tl.arange(0, BT)
    kt = load_rows(k_seq, rows, rr, T, k_row, 0)
    kp = load_rows(k_seq, rows, rr, T, k_row, -1)
    vt = load_rows(v_seq, rows, vv, T, v_row, 0)
    ktT = tl.trans(kt)
    G += tl.dot(ktT, kt, input_precision=PREC)
    M += tl.dot(ktT, kp, input_precision=PREC)
    CT += tl.dot(ktT, vt, input_precision=PREC)
    n2 = tl.where(rows < T, tl.sum(kt * kt, axis=1), -1.0)
    tile_best = tl.max(n2, axis=0)
    tile_arg = tl.max(tl.where(n2 == tile_best, rows, -1), axis=0)
    arg = tl.where(tile_best >= best, tile_arg, arg)
    best = tl.maximum(best, tile_best)
    return G, M, CT, best, arg


@triton.jit
def store_stats(g_buf, m_buf, c_buf, n_buf, slot, G, M, CT, best, arg, R: tl.constexpr, V: tl.constexpr):
    """Write raw statistics to their ``slot`` of the statistics buffers (the token index as fp32 next to ‖k‖²)."""
    rr = tl.arange(0, R)
    vv = tl.arange(0, V)
    mat = slot * R * R + rr[:, None] * R + rr[None, :]
    tl.store(g_buf + mat, G)
    tl.store(m_buf + mat, M)
    tl.store(c_buf + slot * R * V + rr[:, None] * V + vv[None, :], CT)
    tl.store(n_buf + slot * 2, best)
    tl.store(n_buf + slot * 2 + 1, arg.to(tl.float32))


# Floor of the norms the power iteration divides by (an exactly zero M keeps a zero iterate, σ̂ = 0 → EPS).
TINY = tl.constexpr(1e-30)


@triton.jit
def spd_inverse_rows(A, R: tl.constexpr):
    """A⁻¹ for every [R, R] slice of a [BS, R, R] fp32 tensor of symmetric positive definite matrices."""
    idx = tl.arange(0, R)
    rows = idx[None, :, None]
    cols = idx[None, None, :]
    for j in range(R):
        col = tl.sum(tl.where(cols == j, A, 0.0), axis=2)                  # [BS, R]: A[:, :, j]
        inv_p = 1.0 / tl.sum(tl.where(idx[None, :] == j, col, 0.0), axis=1)  # [BS]
        # row j equals column j up to the sign of the entries already eliminated (the matrix stays symmetric
        # up to that sign pattern), so it needs no second reduction
        row = tl.where(idx[None, :] < j, -col, col) * inv_p[:, None]
        A = A - col[:, :, None] * row[:, None, :]
        A = tl.where(rows == j, row[:, None, :], A)
        A = tl.where(cols == j, -(col * inv_p[:, None])[:, :, None], A)
        A = tl.where((rows == j) & (cols == j), inv_p[:, None, None], A)
    return A


@triton.jit
def matvec_rows(A, x):
    """A_t x_t for every token: [BS, R, R] × [BS, R] → [BS, R]."""
    return tl.sum(A * x[:, None, :], axis=2)


@triton.jit
def matvec_t_rows(A, x):
    """A_tᵀ x_t for every token: [BS, R, R] × [BS, R] → [BS, R]."""
    return tl.sum(A * x[:, :, None], axis=1)


@triton.jit
def power_sigma_rows(G, Gi, M, NUM_ITERS: tl.constexpr, EPS: tl.constexpr, BS: tl.constexpr, R: tl.constexpr):
    """σ̂ of every K_w = L⁻¹ M L⁻ᵀ (G = L Lᵀ) of a [BS, R, R] block: ``x ← G⁻¹MᵀG⁻¹M x`` from x = 1 (key
    coordinates), normalised each step, then ``σ̂² = (Mx)ᵀG⁻¹(Mx) / xᵀGx``, clamped at EPS; returns [BS]."""
    x = tl.full([BS, R], 1.0, tl.float32)
    for _ in range(NUM_ITERS):
        y = matvec_rows(Gi, matvec_rows(M, x))
        x = matvec_rows(Gi, matvec_t_rows(M, y))
        x = x / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), TINY)[:, None]
    mx = matvec_rows(M, x)
    num = tl.sum(mx * matvec_rows(Gi, mx), axis=1)
    den = tl.sum(x * matvec_rows(G, x), axis=1)
    return tl.maximum(tl.sqrt(tl.maximum(num, 0.0) / tl.maximum(den, TINY)), EPS)
