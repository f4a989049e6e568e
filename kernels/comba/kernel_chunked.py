"""Triton forward kernels of Comba's chunk-parallel form (long sequences).

Chunks of BT = 64 tokens (``launch.LONG_CHUNK``), each direction's per-chunk algebra as in kernel_common (Gi, Ge,
Gl, A over the 64 tokens in walk order). Four launches, only the third sequential:

1. ``comba_inv_kernel`` (kernel_fwd.py) at 16 tokens: every 16-token block's (I + A)^{-1}, chunk-parallel;
2. ``comba_chunk_wy_kernel``: per 64-token chunk, its (I + A)^{-1} merged from those blocks (two merge levels
   instead of building it from 2-token blocks), W = inv·pw and U0 = inv·(βv); both directions from one load;
3. ``comba_state_kernel``: the only walk; per (value block, sequence, direction) it carries h through the chunks,
   u = U0 − W h, h ← e^{Gl} h + kdᵀ u, and stores the state entering each chunk and u (over U0, in place);
4. ``comba_chunk_out_kernel``: every chunk's output o = scale (e^{Gi} q h0 + (q kᵀ ⊙ D) u), both directions summed
   in one program, chunks in parallel.

The backward is the split backward of kernel_bwd.py at BT = 64 (the state-gradient walk, then one program per chunk)
reading the states and 64-token inverses stored here.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel_common import _chunk_rows, _chunk_wy, _decay, _gate_sums, _input_dot, _lp_dot, _merge_inverse, _walk_masks


@triton.jit
def comba_chunk_wy_kernel(k, p, v, g, beta, inv16, inv, w, u0, T, NT16, NC, B, H, K: tl.constexpr,
                          V: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr, BS: tl.constexpr,
                          LOG2_BS: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, N_DIR: tl.constexpr,
                          SAVE_INV: tl.constexpr, PREC: tl.constexpr, LP_DOT: tl.constexpr):
    """Chunk-parallel (grid: chunk, batch·head): each direction's (I + A)^{-1} of one BT-token chunk, merged from
    the BS-token blocks' inverses ``inv16``; stores W = inv·pw and U0 = inv·(βv), and (``SAVE_INV``) the inverse."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BVF)
    row, m_t = _chunk_rows(i_b, i_h, i_c, T, H, BT)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    b_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
    b_p = tl.load(p + row[:, None] * K + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
    b_g = tl.load(g + row, mask=m_t, other=0).to(tl.float32)
    b_beta = tl.load(beta + row, mask=m_t, other=0).to(tl.float32)
    b_bv = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & (o_v < V)[None, :],
                   other=0).to(tl.float32) * b_beta[:, None]
    # the BS-token block of each row; blocks past the sequence's end are all padding, whose inverse is I
    block = i_c * (BT // BS) + o_t // BS
    diag = (o_t[:, None] // BS == o_t[None, :] // BS) & (block < NT16)[:, None]
    eye = (o_t[:, None] == o_t[None, :]).to(tl.float32)
    all_t = o_t[:, None] < BT
    for d in tl.static_range(N_DIR):
        b_Gi, b_Ge, b_Gl, b_pk, b_E, b_A, b_pw = _chunk_wy(b_k, b_p, b_g, b_beta, k.dtype.element_ty, d == 1, BT,
                                                           PREC, LP_DOT)
        base16 = (d * B * H + i_bh).to(tl.int64) * NT16 + block
        b_inv = tl.load(inv16 + base16[:, None] * BS * BS + (o_t % BS)[:, None] * BS + (o_t % BS)[None, :],
                        mask=diag, other=0)
        b_inv = tl.where((block < NT16)[:, None], b_inv, eye)
        b_inv = _merge_inverse(b_inv, b_A, BT, LOG2_BS, LOG2_BT, PREC)
        base = (d * B * H + i_bh).to(tl.int64) * NC + i_c
        if SAVE_INV:
            tl.store(inv + base * BT * BT + o_t[:, None] * BT + o_t[None, :], b_inv)
        b_W = tl.dot(b_inv, b_pw, input_precision=PREC)
        b_U0 = tl.dot(b_inv, b_bv, input_precision=PREC)
        tl.store(w + base * BT * K + o_t[:, None] * K + o_k[None, :], b_W, mask=all_t & (o_k < K)[None, :])
        tl.store(u0 + base * BT * V + o_t[:, None] * V + o_v[None, :], b_U0, mask=all_t & (o_v < V)[None, :])


@triton.jit
def _load_state_inputs(k, g, w_base, u_base, i_b, i_h, c, T, H, o_t, o_k, o_v, K: tl.constexpr, V: tl.constexpr,
                       BT: tl.constexpr):
    """What the walk reads for chunk ``c``: its keys and gates, W and U0 (nothing outside [0, NC): a prefetch past
    either end)."""
    row, m_t = _chunk_rows(i_b, i_h, c, T, H, BT)
    r_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0)
    r_g = tl.load(g + row, mask=m_t, other=0)
    c_t = o_t * 0 + c  # the chunk index as a vector (masks of a scalar do not broadcast everywhere)
    inside = ((c_t >= 0) & (c_t * BT < T))[:, None]
    r_W = tl.load(w_base + c * BT * K + o_t[:, None] * K + o_k[None, :], mask=inside & (o_k < K)[None, :], other=0)
    r_U = tl.load(u_base + c * BT * V + o_t[:, None] * V + o_v[None, :], mask=inside & (o_v < V)[None, :], other=0)
    return r_k, r_g, r_W, r_U


@triton.jit
def _state_walk(k, g, w_base, u_base, h_base, i_b, i_h, i_v, T, NC, H, K: tl.constexpr, V: tl.constexpr,
                BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, REV: tl.constexpr, PREC: tl.constexpr,
                LP_DOT: tl.constexpr, LP: tl.constexpr):
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    m_tv = (o_t < BT)[:, None] & (o_v < V)[None, :]
    lp_ty = k.dtype.element_ty
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    # loads of the next chunk are issued before this chunk's products: they do not depend on the state
    n_k, n_g, n_W, n_U = _load_state_inputs(k, g, w_base, u_base, i_b, i_h, NC - 1 if REV else 0, T, H, o_t, o_k,
                                            o_v, K, V, BT)
    for i_w in range(0, NC):
        i_c = NC - 1 - i_w if REV else i_w
        r_k, r_g, r_W, r_U = n_k, n_g, n_W, n_U
        n_k, n_g, n_W, n_U = _load_state_inputs(k, g, w_base, u_base, i_b, i_h, i_c - 1 if REV else i_c + 1, T, H,
                                                o_t, o_k, o_v, K, V, BT)
        tl.store(h_base + i_c * K * V + o_k[:, None] * V + o_v[None, :], b_h.to(h_base.dtype.element_ty), mask=m_kv)
        b_Gi, b_Ge, b_Gl = _gate_sums(r_g.to(tl.float32), REV)
        b_u = r_U - _lp_dot(r_W, b_h, lp_ty, PREC, LP_DOT, LP)
        tl.store(u_base + i_c * BT * V + o_t[:, None] * V + o_v[None, :], b_u, mask=m_tv)
        b_kd = r_k.to(tl.float32) * tl.exp(b_Gl - b_Gi)[:, None]
        b_h = b_h * tl.exp(b_Gl) + _lp_dot(tl.trans(b_kd), b_u, lp_ty, PREC, LP_DOT, LP)


@triton.jit
def comba_state_kernel(k, g, w, u, h0, T, NC, B, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, N_DIR: tl.constexpr, PREC: tl.constexpr,
                       LP_DOT: tl.constexpr, LP: tl.constexpr):
    """The state walk (grid: value block, batch·head, direction): stores the state entering every chunk in ``h0``
    and overwrites U0 with u = U0 − W h in ``u``."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    for d in tl.static_range(N_DIR):
        if (tl.program_id(2) == d) | (N_DIR == 1):
            seq = (d * B * H + i_bh).to(tl.int64) * NC
            _state_walk(k, g, w + seq * BT * K, u + seq * BT * V, h0 + seq * K * V, i_b, i_h, i_v, T, NC, H, K, V,
                        BT, BK, BV, d == 1, PREC, LP_DOT, LP)


@triton.jit
def comba_chunk_out_kernel(q, k, g, h0, u, o, scale, T, NC, B, H, K: tl.constexpr, V: tl.constexpr,
                           BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, N_DIR: tl.constexpr,
                           PREC: tl.constexpr, LP_DOT: tl.constexpr, LP: tl.constexpr):
    """Every chunk's output (grid: value block, chunk, batch·head) from the state entering it and its u, both
    directions summed here (they cover the same rows)."""
    i_v, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    m_tv = (o_t < BT)[:, None] & (o_v < V)[None, :]
    lp_ty = q.dtype.element_ty
    row, m_t = _chunk_rows(i_b, i_h, i_c, T, H, BT)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
    b_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
    b_g = tl.load(g + row, mask=m_t, other=0).to(tl.float32)
    b_qk = _input_dot(b_q, b_k, lp_ty, PREC, LP_DOT) * scale
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for d in tl.static_range(N_DIR):
        before, upto = _walk_masks(d == 1, BT)
        b_Gi, b_Ge, b_Gl = _gate_sums(b_g, d == 1)
        base = (d * B * H + i_bh).to(tl.int64) * NC + i_c
        b_h = tl.load(h0 + base * K * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0)
        b_u = tl.load(u + base * BT * V + o_t[:, None] * V + o_v[None, :], mask=m_tv, other=0)
        b_o += _lp_dot(b_q * (scale * tl.exp(b_Gi))[:, None], b_h.to(tl.float32), lp_ty, PREC, LP_DOT, LP)
        b_o += _lp_dot(b_qk * _decay(b_Gi, b_Gi, upto), b_u, lp_ty, PREC, LP_DOT, LP)
    tl.store(o + row[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_t[:, None] & (o_v < V)[None, :])
