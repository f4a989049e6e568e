"""Triton forward kernels of Comba: the chunk-parallel passes (inverses; W and U0) and the state walk.

The walk (``comba_fwd_kernel``): one program carries the state h ∈ R^{K×BV} of one (batch, head, value block) in
registers (fp32) through the chunks of the sequence, one direction after the other (or one direction per program
along grid axis 2, each writing its own fp32 partial output). When a backward follows it stores the state entering
every chunk (``h0``). Per chunk it needs (I + A)^{-1}: computed in the walk, or loaded from a chunk-parallel pass
that ran first (``comba_inv_kernel``; off the walk's sequential path, both directions from one load), or — when the
value dimension is split over programs, which would each repeat the K-side work — replaced by W = inv·pw and
U0 = inv·(βv) from that pass.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel_common import (
    _accumulate,
    _chunk_rows,
    _chunk_wy,
    _decay,
    _gate_sums,
    _input_dot,
    _load_raw,
    _load_token,
    _lp_dot,
    _unit_lower_inverse,
    _walk_masks,
)

#: The arguments each kernel stores to (some only under a constexpr flag): all that torch.compile's analysis of a
#: launch may take as written (tools/inductor_check.py, tests/kernels/test_inductor_writes.py).
WRITES = {"comba_fwd_kernel": {"h0", "inv", "o", "u0", "w"}, "comba_inv_kernel": {"inv", "u0", "w"}}


@triton.jit
def comba_inv_kernel(k, p, g, beta, inv, w, u0, v, T, NT, B, H, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, LOG2_BT: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr,
                     N_DIR: tl.constexpr, SAVE_WY: tl.constexpr, PREC: tl.constexpr,
                     LP_DOT: tl.constexpr):
    """Chunk-parallel pass (grid: chunk, batch·head): every direction's (I + A)^{-1} of one chunk, from one load of
    its keys and gates; with ``SAVE_WY`` also W = inv·pw and U0 = inv·(βv) (the walk then only does the
    state-dependent products)."""
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
    for d in tl.static_range(N_DIR):
        b_Gi, b_Ge, b_Gl, b_pk, b_E, b_A, b_pw = _chunk_wy(b_k, b_p, b_g, b_beta, k.dtype.element_ty, d == 1, BT,
                                                           PREC, LP_DOT)
        b_inv = _unit_lower_inverse(b_A, BT, LOG2_BT, PREC)
        base = tl.cast(d * B * H + i_bh, tl.int64) * NT + i_c
        tl.store(inv + base * BT * BT + o_t[:, None] * BT + o_t[None, :], b_inv)
        if SAVE_WY:
            all_t = o_t[:, None] < BT
            b_W = tl.dot(b_inv, b_pw, input_precision=PREC)
            b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & (o_v < V)[None, :], other=0)
            b_U0 = tl.dot(b_inv, b_v.to(tl.float32) * b_beta[:, None], input_precision=PREC)
            tl.store(w + base * BT * K + o_t[:, None] * K + o_k[None, :], b_W, mask=all_t & (o_k < K)[None, :])
            tl.store(u0 + base * BT * V + o_t[:, None] * V + o_v[None, :], b_U0, mask=all_t & (o_v < V)[None, :])


@triton.jit
def _fwd_token(q, k, p, v, g, beta, o_base, b_h, t, scale, i_b, i_h, o_k, o_v, T, H, K: tl.constexpr,
               V: tl.constexpr, ACC: tl.constexpr):
    """One token as a rank-1 step (a chunk holding a single token: T % BT == 1): returns the state after it."""
    t_q, t_k, t_p, t_v, t_g, t_beta, t_row = _load_token(q, k, p, v, g, beta, i_b, i_h, t, o_k, o_v, T, H, K, V)
    t_u = t_beta * (t_v - tl.sum(b_h * t_p[:, None], 0))
    b_h = b_h * tl.exp(t_g) + t_k[:, None] * t_u[None, :]
    _accumulate(o_base + t_row * V + o_v, scale * tl.sum(b_h * t_q[:, None], 0), o_v < V, ACC)
    return b_h


@triton.jit
def _fwd_chunk(r_q, r_k, r_p, r_v, r_g, r_beta, b_h, b_inv, b_W, b_U0, p_o, m_tv, p_inv, m_inv, scale, lp_ty,
               REV: tl.constexpr, ACC: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr, PREC: tl.constexpr,
               LP_DOT: tl.constexpr, INV_IN: tl.constexpr, LOAD_WY: tl.constexpr, SAVE_INV: tl.constexpr,
               STATE_LP: tl.constexpr):
    """One chunk of the walk: writes (or adds) its output and returns the state leaving it."""
    b_q, b_k, b_p, b_v = r_q.to(tl.float32), r_k.to(tl.float32), r_p.to(tl.float32), r_v.to(tl.float32)
    b_g, b_beta = r_g.to(tl.float32), r_beta.to(tl.float32)
    before, upto = _walk_masks(REV, BT)
    if LOAD_WY:
        b_Gi, b_Ge, b_Gl = _gate_sums(b_g, REV)
        b_u = b_U0 - _lp_dot(b_W, b_h, lp_ty, PREC, LP_DOT, STATE_LP)
    else:
        b_Gi, b_Ge, b_Gl, b_pk, b_E, b_A, b_pw = _chunk_wy(b_k, b_p, b_g, b_beta, lp_ty, REV, BT, PREC, LP_DOT)
        if not INV_IN:
            b_inv = _unit_lower_inverse(b_A, BT, LOG2_BT, PREC)
            if SAVE_INV:
                tl.store(p_inv, b_inv, mask=m_inv)
        # u = U0 − W h = inv (βv − pw h): one product with the inverse instead of W and U0
        b_u = tl.dot(b_inv, b_v * b_beta[:, None] - _lp_dot(b_pw, b_h, lp_ty, PREC, LP_DOT, STATE_LP),
                     input_precision=PREC)
    b_qk = _input_dot(b_q, b_k, lp_ty, PREC, LP_DOT) * (_decay(b_Gi, b_Gi, upto) * scale)
    b_o = _lp_dot(b_q * (scale * tl.exp(b_Gi))[:, None], b_h, lp_ty, PREC, LP_DOT, STATE_LP)
    b_o += _lp_dot(b_qk, b_u, lp_ty, PREC, LP_DOT, STATE_LP)
    _accumulate(p_o, b_o, m_tv, ACC)
    b_kd = b_k * tl.exp(b_Gl - b_Gi)[:, None]
    return b_h * tl.exp(b_Gl) + _lp_dot(tl.trans(b_kd), b_u, lp_ty, PREC, LP_DOT, STATE_LP)


@triton.jit
def _fwd_walk(q, k, v, p, g, beta, o_base, h_base, inv_base, w_base, u0_base, scale, i_b, i_h, i_v, T, NT, H,
              K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, REV: tl.constexpr, ACC: tl.constexpr, SAVE_H: tl.constexpr, SAVE_INV: tl.constexpr,
              INV_IN: tl.constexpr, LOAD_WY: tl.constexpr, PREC: tl.constexpr,
              LP_DOT: tl.constexpr, PREFETCH: tl.constexpr, TAIL: tl.constexpr, STATE_LP: tl.constexpr):
    """One direction's walk over the chunks. With ``TAIL`` (T % BT == 1) the last chunk holds one token: the
    forward direction ends with it as a rank-1 step, the reversed one starts with it (from the zero state)."""
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    lp_ty = q.dtype.element_ty
    NF = NT - TAIL  # full chunks
    # every value block computes the same inverses: the first one keeps them
    m_inv = (o_t[:, None] * 0 + o_t[None, :] * 0 + i_v) == 0
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if REV and TAIL:
        b_h = _fwd_token(q, k, p, v, g, beta, o_base, b_h, NF * BT, scale, i_b, i_h, o_k, o_v, T, H, K, V, ACC)
    if PREFETCH:
        row, m_t = _chunk_rows(i_b, i_h, NF - 1 if REV else 0, T, H, BT)
        n_q, n_k, n_p, n_v, n_g, n_beta = _load_raw(q, k, p, v, g, beta, row, m_t, o_k, o_v, K, V)
    for i_w in range(0, NF):
        i_c = NF - 1 - i_w if REV else i_w
        row, m_t = _chunk_rows(i_b, i_h, i_c, T, H, BT)
        if PREFETCH:
            r_q, r_k, r_p, r_v, r_g, r_beta = n_q, n_k, n_p, n_v, n_g, n_beta
            n_row, n_m = _chunk_rows(i_b, i_h, i_c - 1 if REV else i_c + 1, T, H, BT)
            n_q, n_k, n_p, n_v, n_g, n_beta = _load_raw(q, k, p, v, g, beta, n_row, n_m, o_k, o_v, K, V)
        else:
            r_q, r_k, r_p, r_v, r_g, r_beta = _load_raw(q, k, p, v, g, beta, row, m_t, o_k, o_v, K, V)
        if SAVE_H:
            tl.store(h_base + i_c * K * V + o_k[:, None] * V + o_v[None, :], b_h.to(h_base.dtype.element_ty),
                     mask=m_kv)
        p_inv = inv_base + i_c * BT * BT + o_t[:, None] * BT + o_t[None, :]
        # placeholders for the operands a layout does not use
        b_inv = b_h
        b_W = b_h
        b_U0 = b_h
        if LOAD_WY:
            all_t = o_t[:, None] < BT
            b_W = tl.load(w_base + i_c * BT * K + o_t[:, None] * K + o_k[None, :], mask=all_t & (o_k < K)[None, :],
                          other=0)
            b_U0 = tl.load(u0_base + i_c * BT * V + o_t[:, None] * V + o_v[None, :],
                           mask=all_t & (o_v < V)[None, :], other=0)
        elif INV_IN:
            b_inv = tl.load(p_inv)
        b_h = _fwd_chunk(r_q, r_k, r_p, r_v, r_g, r_beta, b_h, b_inv, b_W, b_U0,
                         o_base + row[:, None] * V + o_v[None, :], m_t[:, None] & (o_v < V)[None, :], p_inv, m_inv,
                         scale, lp_ty, REV, ACC, BT, LOG2_BT, PREC, LP_DOT, INV_IN, LOAD_WY, SAVE_INV, STATE_LP)
    if TAIL and not REV:
        if SAVE_H:
            tl.store(h_base + NF * K * V + o_k[:, None] * V + o_v[None, :], b_h.to(h_base.dtype.element_ty),
                     mask=m_kv)
        _fwd_token(q, k, p, v, g, beta, o_base, b_h, NF * BT, scale, i_b, i_h, o_k, o_v, T, H, K, V, ACC)


@triton.jit
def _fwd_directions(q, k, v, p, g, beta, o, h0, inv, w, u0, scale, i_b, i_h, i_v, i_bh, T, NT, B, H,
                    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, N_DIR: tl.constexpr, DIR_LOOP: tl.constexpr, SAVE_H: tl.constexpr,
                    SAVE_INV: tl.constexpr, INV_IN: tl.constexpr, LOAD_WY: tl.constexpr, PREC: tl.constexpr,
                    LP_DOT: tl.constexpr, PREFETCH: tl.constexpr, TAIL: tl.constexpr, STATE_LP: tl.constexpr):
    """The walks of one program laid out by ``comba_fwd_kernel``'s grid (both directions with ``DIR_LOOP``)."""
    for d in tl.static_range(N_DIR):
        if DIR_LOOP:
            o_base = o
        else:
            o_base = o + tl.cast(d * B * T * H, tl.int64) * V
        state = tl.cast(d * B * H + i_bh, tl.int64) * NT
        # directions on the grid: program_id(2) picks one (runtime test; always true for DIR_LOOP)
        if (tl.program_id(2) == d) | (DIR_LOOP or N_DIR == 1):
            _fwd_walk(q, k, v, p, g, beta, o_base, h0 + state * K * V, inv + state * BT * BT, w + state * BT * K,
                      u0 + state * BT * V, scale, i_b, i_h, i_v, T, NT, H, K, V, BT, LOG2_BT, BK, BV, d == 1,
                      DIR_LOOP and d == 1, SAVE_H, SAVE_INV, INV_IN, LOAD_WY, PREC, LP_DOT, PREFETCH, TAIL, STATE_LP)
        if DIR_LOOP and d + 1 < N_DIR:
            tl.debug_barrier()  # the reversed direction reads back what other threads of this program stored


@triton.jit
def comba_fwd_kernel(q, k, v, p, g, beta, o, h0, inv, w, u0, scale, T, NT, B, H, n_pair, K: tl.constexpr,
                     V: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     N_DIR: tl.constexpr, DIR_LOOP: tl.constexpr, SAVE_H: tl.constexpr, SAVE_INV: tl.constexpr,
                     INV_IN: tl.constexpr, LOAD_WY: tl.constexpr, PREC: tl.constexpr,
                     LP_DOT: tl.constexpr, PREFETCH: tl.constexpr, TAIL: tl.constexpr, STATE_LP: tl.constexpr,
                     BALANCE: tl.constexpr):
    """The state walk (grid: value block, batch·head, directions on the grid). ``DIR_LOOP``: this program runs
    both directions, the reversed one adding onto its own forward output; otherwise program_id(2) is the direction
    and each writes its own fp32 partial (summed afterwards).

    ``BALANCE`` (with ``DIR_LOOP``): only the first ``n_pair`` sequences get a program for both directions; each
    later sequence gets two programs along grid axis 1, one per direction, which add onto an output the launch
    zeroed (atomic adds). The programs of one direction are half as long, so a last wave of the grid that would hold
    a few both-direction programs holds twice as many one-direction ones instead."""
    scale = tl.cast(scale, tl.float32)  # fp32 whatever the launcher passes (Inductor passes Python floats as fp64)
    i_v, i_p = tl.program_id(0), tl.program_id(1)
    i_bh = i_p
    both = True  # without BALANCE a compile-time True: the one-direction branch below is not compiled
    if BALANCE:
        both = i_p < n_pair
        i_bh = tl.where(both, i_p, n_pair + (i_p - n_pair) // 2)
    i_b, i_h = i_bh // H, i_bh % H
    if both:
        _fwd_directions(q, k, v, p, g, beta, o, h0, inv, w, u0, scale, i_b, i_h, i_v, i_bh, T, NT, B, H, K, V, BT,
                        LOG2_BT, BK, BV, N_DIR, DIR_LOOP, SAVE_H, SAVE_INV, INV_IN, LOAD_WY, PREC, LP_DOT, PREFETCH,
                        TAIL, STATE_LP)
    else:
        for d in tl.static_range(N_DIR):
            if (i_p - n_pair) % 2 == d:
                state = tl.cast(d * B * H + i_bh, tl.int64) * NT
                _fwd_walk(q, k, v, p, g, beta, o, h0 + state * K * V, inv + state * BT * BT, w + state * BT * K,
                          u0 + state * BT * V, scale, i_b, i_h, i_v, T, NT, H, K, V, BT, LOG2_BT, BK, BV, d == 1, 2,
                          SAVE_H, SAVE_INV, INV_IN, LOAD_WY, PREC, LP_DOT, PREFETCH, TAIL, STATE_LP)
