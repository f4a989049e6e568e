"""Triton helpers shared by the Comba forward and backward kernels: chunk geometry and loads, the chunk's WY
quantities (gate sums, decay masks, p·kᵀ, A) and the unit-triangular inverse.

Chunks and directions. A sequence of T tokens is cut into NT = ⌈T/BT⌉ chunks of BT tokens; chunk c holds tokens
[c·BT, c·BT + BT) (the last one padded: padded rows load k = p = q = v = β = g = 0, so they neither write, read nor
decay the state). The forward direction walks chunks 0 … NT−1, the reversed direction (non-causal calls) walks
NT−1 … 0. Both keep every chunk's rows in token order: only "which token comes first" changes, through the decay
masks and the direction of the gate sums (``REV``). So the two directions of a chunk touch the same rows, share
their loads and write the same addresses, and a chunk-parallel kernel can do both directions of a chunk at once.

Within a chunk (``s ≺ t``: token s is processed before token t in the walk; ``Gi`` the inclusive sum of g over the
tokens up to t in walk order, ``Ge = Gi − g``, ``Gl`` the sum over the whole chunk)::

    A_ts = β_t e^{Ge_t − Gi_s} (p_t · k_s) for s ≺ t,   D_ts = e^{Gi_t − Gi_s} for s ⪯ t,
    u = (I + A)^{-1} (βv − pw h0) with pw = β e^{Ge} p,   o = scale (e^{Gi} q h0 + (q kᵀ ⊙ D) u),
    h_end = e^{Gl} h0 + (e^{Gl − Gi} k)ᵀ u.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _unit_lower_inverse(A, BT: tl.constexpr, LOG2_BT: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^{-1} for a [BT, BT] tile A that is strictly triangular (lower or upper: every step only uses which
    block an entry lies in).

    Built up by blocks: within 2-token blocks (I + N)^{-1} = I − N, since N² = 0 there; then pairs of blocks are
    merged, 2 → 4 → … → BT, with (I + D + O)^{-1} = D^{-1} − D^{-1} O D^{-1} (D the block-diagonal part, O the entries
    between the two halves of a merged block, (D^{-1} O)² = 0). Two small products per level, 2·log2(BT) − 2 in all.
    Every intermediate is a block of the true inverse, so nothing large cancels and one TF32 pass per product is
    enough for 16-bit inputs (emulated: it adds < 1e-3 to the output's error from the other TF32 products). A power
    series (I − A + A² − …) with the same number of products builds terms in the 10⁵–10⁶ range when neighbouring
    keys align and the feedback gain βp·k approaches 2 (the iplr transition): 8% output error even in fp32."""
    rows = tl.arange(0, BT)
    block = rows // 2
    inv = (rows[:, None] == rows[None, :]).to(tl.float32) - tl.where(block[:, None] == block[None, :], A, 0.0)
    for level in tl.static_range(1, LOG2_BT):
        half = rows // (1 << level)
        whole = rows // (2 << level)
        between = (whole[:, None] == whole[None, :]) & (half[:, None] != half[None, :])
        off = tl.where(between, A, 0.0)
        inv -= tl.dot(tl.dot(inv, off, input_precision=PREC), inv, input_precision=PREC)
    return inv


@triton.jit
def _walk_masks(REV: tl.constexpr, BT: tl.constexpr):
    """(before, upto): [BT, BT] masks of s ≺ t and s ⪯ t for row t, column s."""
    o_t = tl.arange(0, BT)
    if REV:
        before = o_t[:, None] < o_t[None, :]
    else:
        before = o_t[:, None] > o_t[None, :]
    return before, before | (o_t[:, None] == o_t[None, :])


@triton.jit
def _gate_sums(b_g, REV: tl.constexpr):
    """Gi (inclusive, in walk order), Ge = Gi − g, and Gl = the chunk's total."""
    b_Gi = tl.cumsum(b_g, 0, reverse=REV)
    return b_Gi, b_Gi - b_g, tl.sum(b_g, 0)


@triton.jit
def _decay(b_x, b_y, mask):
    """e^{x_t − y_s} where ``mask``, 0 elsewhere (masked before exp: the other triangle may overflow)."""
    return tl.where(mask, tl.exp(tl.where(mask, b_x[:, None] - b_y[None, :], 0.0)), 0.0)


@triton.jit
def _gate_grad(b_dGi, b_dGe, b_dGl, REV: tl.constexpr):
    """dg from the gradients of Gi, Ge and Gl: g_j enters Gi_t for j ⪯ t, Ge_t for j ≺ t, and Gl."""
    return tl.cumsum(b_dGi + b_dGe, 0, reverse=not REV) - b_dGe + b_dGl


@triton.jit
def _chunk_rows(i_b, i_h, c, T, H, BT: tl.constexpr):
    """Token rows of chunk ``c`` and their mask (none outside [0, T): padded rows, chunks past either end)."""
    t = c * BT + tl.arange(0, BT)
    return (tl.cast(i_b, tl.int64) * T + t) * H + i_h, (t >= 0) & (t < T)


@triton.jit
def _load_raw(q, k, p, v, g, beta, row, m_t, o_k, o_v, K: tl.constexpr, V: tl.constexpr):
    """A chunk's inputs in their own dtypes (converted where used, so a prefetch does not wait on them)."""
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    r_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_tk, other=0)
    r_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0)
    r_p = tl.load(p + row[:, None] * K + o_k[None, :], mask=m_tk, other=0)
    r_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_tv, other=0)
    r_g = tl.load(g + row, mask=m_t, other=0)
    r_beta = tl.load(beta + row, mask=m_t, other=0)
    return r_q, r_k, r_p, r_v, r_g, r_beta


@triton.jit
def _load_token(q, k, p, v, g, beta, i_b, i_h, t, o_k, o_v, T, H, K: tl.constexpr, V: tl.constexpr):
    """Token ``t`` as fp32 vectors (q, k, p over K; v over the value block) and scalars, and its row."""
    row = (tl.cast(i_b, tl.int64) * T + t) * H + i_h
    m_k = o_k < K
    m_v = o_v < V
    t_q = tl.load(q + row * K + o_k, mask=m_k, other=0).to(tl.float32)
    t_k = tl.load(k + row * K + o_k, mask=m_k, other=0).to(tl.float32)
    t_p = tl.load(p + row * K + o_k, mask=m_k, other=0).to(tl.float32)
    t_v = tl.load(v + row * V + o_v, mask=m_v, other=0).to(tl.float32)
    t_g = tl.load(g + row).to(tl.float32)
    t_beta = tl.load(beta + row).to(tl.float32)
    return t_q, t_k, t_p, t_v, t_g, t_beta, row


@triton.jit
def _input_dot(a, b, lp_ty, PREC: tl.constexpr, LP_DOT: tl.constexpr):
    """a @ bᵀ of two input tiles (held in fp32). With LP_DOT the tiles go back to their bf16/fp16 input dtype —
    exact, they came from it — and use the 16-bit tensor-core path; the fp32 accumulation is the same."""
    if LP_DOT:
        return tl.dot(a.to(lp_ty), tl.trans(b.to(lp_ty)))
    return tl.dot(a, tl.trans(b), input_precision=PREC)


@triton.jit
def _lp_dot(a, b, lp_ty, PREC: tl.constexpr, LP_DOT: tl.constexpr, LP: tl.constexpr):
    """a @ b. With ``LP`` both operands are rounded to the 16-bit input dtype and multiplied on 16-bit tensor cores
    (emulated by the rounding alone where LP_DOT is off, so the interpreter checks the same numerics); otherwise
    TF32 / fp32 as ``PREC`` says. The accumulation is fp32 either way."""
    # (if/else, not early returns: the code after a compile-time return is still compiled)
    if LP and LP_DOT:
        out = tl.dot(a.to(lp_ty), b.to(lp_ty))
    elif LP:
        out = tl.dot(a.to(lp_ty).to(tl.float32), b.to(lp_ty).to(tl.float32), input_precision=PREC)
    else:
        out = tl.dot(a, b, input_precision=PREC)
    return out


@triton.jit
def _chunk_wy(b_k, b_p, b_g, b_beta, lp_ty, REV: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
              LP_DOT: tl.constexpr):
    """The chunk's state-independent quantities in ``REV``'s walk order: Gi, Ge, Gl, p·kᵀ, the decays E of A, A
    itself and the scaled feedback keys pw = β e^{Ge} p."""
    before, upto = _walk_masks(REV, BT)
    b_Gi, b_Ge, b_Gl = _gate_sums(b_g, REV)
    b_pk = _input_dot(b_p, b_k, lp_ty, PREC, LP_DOT)
    b_E = _decay(b_Ge, b_Gi, before)
    b_A = b_beta[:, None] * b_pk * b_E
    b_pw = b_p * (b_beta * tl.exp(b_Ge))[:, None]
    return b_Gi, b_Ge, b_Gl, b_pk, b_E, b_A, b_pw


@triton.jit
def _accumulate(ptr, value, mask, ACC: tl.constexpr):
    """Store ``value`` (``ACC`` 0), or add it to what is already there (the second direction onto the first): ACC 2
    by an atomic add, whose result nothing waits for, ACC 1 by a load, an add and a store (Triton's interpreter has
    no 16-bit atomics), where the warp stalls on the load. Either way the sum is rounded to the output's dtype once
    more: the first direction's value was stored rounded, the atomic add also rounds ``value`` first."""
    if ACC == 2:
        tl.atomic_add(ptr, value.to(ptr.dtype.element_ty), mask=mask, sem="relaxed")
    else:
        if ACC == 1:
            value += tl.load(ptr, mask=mask, other=0).to(tl.float32)
        tl.store(ptr, value.to(ptr.dtype.element_ty), mask=mask)
