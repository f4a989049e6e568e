"""Triton backward kernels of Comba.

Every chunk's gradients follow from the state entering it (``h0``, stored by the forward), the gradient of the
state leaving it (``dh``) and its inverse (stored by the forward, or recomputed). Two ways to get ``dh``:

* one pass (``comba_bwd_kernel``): a program walks a sequence's chunks in reverse, carrying ``dh`` in registers and
  computing each chunk's gradients on the way (16–32-wide states; 64-wide ones with many sequences);
* split: a light walk carries only ``dh`` and stores it per chunk (``comba_bwd_dh_kernel``), then one program per
  chunk computes that chunk's gradients (``comba_bwd_kernel`` with ``SPLIT``; 128-wide states, whose one-pass walk
  spills, and 64-wide ones with few sequences, whose one-pass walks are too few to hide their latency).

Gradients that sum over the value dimension (dq, dk, dp, dβ, dg) are written per value block (and grid direction)
and reduced afterwards.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel_common import (
    _accumulate,
    _chunk_rows,
    _chunk_wy,
    _decay,
    _gate_grad,
    _input_dot,
    _load_raw,
    _load_token,
    _lp_dot,
    _unit_lower_inverse,
    _walk_masks,
)

#: The arguments each kernel stores to (some only under a constexpr flag): all that torch.compile's analysis of a
#: launch may take as written (tools/inductor_check.py, tests/kernels/test_inductor_writes.py).
WRITES = {"comba_bwd_dh_kernel": {"dh"}, "comba_bwd_kernel": {"dbeta", "dg", "dk", "dp", "dq", "dv"}}


@triton.jit
def _token_bwd(q, k, p, v, g, beta, do, b_h0, b_dh1, dq_base, dk_base, dp_base, dv_base, dg_base, db_base, scale,
               i_b, i_h, t, o_k, o_v, T, H, K: tl.constexpr, V: tl.constexpr, ACC: tl.constexpr):
    """Gradients of one rank-1 token step u = β(v − h0ᵀp), h1 = e^g h0 + k uᵀ, o = scale·h1ᵀq, given the state
    before it and the gradient of the state after it from later tokens (zero at the end of a walk). Returns the
    gradient of the state before it."""
    t_q, t_k, t_p, t_v, t_g, t_beta, t_row = _load_token(q, k, p, v, g, beta, i_b, i_h, t, o_k, o_v, T, H, K, V)
    m_k = o_k < K
    m_v = o_v < V
    t_do = tl.load(do + t_row * V + o_v, mask=m_v, other=0).to(tl.float32)
    t_x = t_v - tl.sum(b_h0 * t_p[:, None], 0)
    t_u = t_beta * t_x
    t_a = tl.exp(t_g)
    t_h1 = b_h0 * t_a + t_k[:, None] * t_u[None, :]
    t_dh1 = scale * t_q[:, None] * t_do[None, :] + b_dh1
    t_du = tl.sum(t_dh1 * t_k[:, None], 0)
    t_dr = -t_beta * t_du
    _accumulate(dq_base + t_row * K + o_k, scale * tl.sum(t_h1 * t_do[None, :], 1), m_k, ACC)
    _accumulate(dk_base + t_row * K + o_k, tl.sum(t_dh1 * t_u[None, :], 1), m_k, ACC)
    _accumulate(dp_base + t_row * K + o_k, tl.sum(b_h0 * t_dr[None, :], 1), m_k, ACC)
    _accumulate(dv_base + t_row * V + o_v, t_beta * t_du, m_v, ACC)
    _accumulate(dg_base + t_row, t_a * tl.sum(tl.sum(t_dh1 * b_h0, 1), 0), t_row >= 0, ACC)
    _accumulate(db_base + t_row, tl.sum(t_du * t_x, 0), t_row >= 0, ACC)
    return t_a * t_dh1 + t_p[:, None] * t_dr[None, :]


@triton.jit
def _bwd_output_side(b_q, b_k, b_do, b_h, b_dh, b_u, b_Gi, b_Gl, dq_ptrs, m_tk, scale, lp_ty, REV: tl.constexpr,
                     ACC: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr, LP_DOT: tl.constexpr,
                     STATE_LP: tl.constexpr):
    """Gradients through o = e^{Gi} ⊙ (q_s h0) + Mq u and h_end = e^{Gl} h0 + kdᵀ u (Mq = q_s kᵀ ⊙ D, kd =
    e^{Gl − Gi} k): stores dq; returns du, dk (its output part) and the output parts of dGi and dGl."""
    before, upto = _walk_masks(REV, BT)
    b_D = _decay(b_Gi, b_Gi, upto)
    b_qs = b_q * scale
    b_eG = tl.exp(b_Gi)
    b_Mq = _input_dot(b_q, b_k, lp_ty, PREC, LP_DOT) * (b_D * scale)
    b_kdecay = tl.exp(b_Gl - b_Gi)
    b_kd = b_k * b_kdecay[:, None]
    b_du = (_lp_dot(tl.trans(b_Mq), b_do, lp_ty, PREC, LP_DOT, STATE_LP)
            + _lp_dot(b_kd, b_dh, lp_ty, PREC, LP_DOT, STATE_LP))
    b_dMq = _lp_dot(b_do, tl.trans(b_u), lp_ty, PREC, LP_DOT, STATE_LP)
    b_dMqD = b_dMq * b_D
    b_doh = _lp_dot(b_do, tl.trans(b_h), lp_ty, PREC, LP_DOT, STATE_LP)
    # gradients are stored as soon as they are final: fewer tiles live at once (register pressure)
    b_dq = scale * (b_eG[:, None] * b_doh + _lp_dot(b_dMqD, b_k, lp_ty, PREC, LP_DOT, STATE_LP))
    _accumulate(dq_ptrs, b_dq, m_tk, ACC)
    b_udh = _lp_dot(b_u, tl.trans(b_dh), lp_ty, PREC, LP_DOT, STATE_LP)
    b_dk = _lp_dot(tl.trans(b_dMqD), b_qs, lp_ty, PREC, LP_DOT, STATE_LP) + b_kdecay[:, None] * b_udh
    b_term = b_dMq * b_Mq
    b_c = tl.sum(b_kd * b_udh, 1)
    b_dGi = tl.sum(b_qs * b_doh, 1) * b_eG + tl.sum(b_term, 1) - tl.sum(b_term, 0) - b_c
    b_dGl = tl.exp(b_Gl) * tl.sum(tl.sum(b_dh.to(tl.float32) * b_h.to(tl.float32), 1), 0) + tl.sum(b_c, 0)
    return b_du, b_dk, b_dGi, b_dGl


@triton.jit
def _chunk_bwd(r_q, r_k, r_p, r_v, r_g, r_beta, r_do, b_h, b_dh, b_inv, dq_base, dk_base, dp_base, dv_base, dg_base,
               db_base, scale, row, m_t, o_k, o_v, lp_ty, REV: tl.constexpr, ACC: tl.constexpr, K: tl.constexpr,
               V: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr, PREC: tl.constexpr,
               LP_DOT: tl.constexpr, LOAD_INV: tl.constexpr, STATE_LP: tl.constexpr, need_dh):
    """Every gradient of one chunk, given the state entering it (``b_h``) and the gradient of the state leaving it
    (``b_dh``); stores them and (``need_dh``, a run-time flag) returns the gradient of the entering state."""
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    b_q, b_k, b_p, b_v = r_q.to(tl.float32), r_k.to(tl.float32), r_p.to(tl.float32), r_v.to(tl.float32)
    b_g, b_beta, b_do = r_g.to(tl.float32), r_beta.to(tl.float32), r_do.to(tl.float32)
    b_Gi, b_Ge, b_Gl, b_pk, b_E, b_A, b_pw = _chunk_wy(b_k, b_p, b_g, b_beta, lp_ty, REV, BT, PREC, LP_DOT)
    if not LOAD_INV:
        b_inv = _unit_lower_inverse(b_A, BT, LOG2_BT, PREC)
    b_u = tl.dot(b_inv, b_v * b_beta[:, None] - _lp_dot(b_pw, b_h, lp_ty, PREC, LP_DOT, STATE_LP),
                 input_precision=PREC)
    b_du, b_dk, b_dGi, b_dGl = _bwd_output_side(b_q, b_k, b_do, b_h, b_dh, b_u, b_Gi, b_Gl,
                                                dq_base + row[:, None] * K + o_k[None, :], m_tk, scale, lp_ty, REV,
                                                ACC, BT, PREC, LP_DOT, STATE_LP)
    # u = inv (βv − pw h0) with pw = β e^{Ge} p,  A = β_t e^{Ge_t − Gi_s} p_t·k_s (s ≺ t). With dRv = invᵀ du (the
    # gradient of inv's right-hand side): d(pw) = −dRv h0ᵀ, dA = −dRv uᵀ and dh0 gets −pwᵀ dRv.
    b_dRv = tl.dot(tl.trans(b_inv), b_du, input_precision=PREC)
    b_dRp = -_lp_dot(b_dRv, tl.trans(b_h), lp_ty, PREC, LP_DOT, STATE_LP)
    b_dA = -_lp_dot(b_dRv, tl.trans(b_u), lp_ty, PREC, LP_DOT, STATE_LP)
    b_dh_prev = b_dh
    if need_dh:
        b_qe = b_q * (scale * tl.exp(b_Gi))[:, None]
        # (in the state's own dtype: a split program's stored dh may be 16-bit)
        b_dh_prev = (_lp_dot(tl.trans(b_qe), b_do, lp_ty, PREC, LP_DOT, STATE_LP) + tl.exp(b_Gl) * b_dh
                     - _lp_dot(tl.trans(b_pw), b_dRv, lp_ty, PREC, LP_DOT, STATE_LP)).to(b_dh.dtype)
    b_eGe = tl.exp(b_Ge)
    b_rp = tl.sum(b_dRp * b_p, 1)
    _accumulate(dv_base + row[:, None] * V + o_v[None, :], b_dRv * b_beta[:, None], m_tv, ACC)
    b_dS = b_dA * b_E
    b_dbeta = b_rp * b_eGe + tl.sum(b_dRv * b_v, 1) + tl.sum(b_dS * b_pk, 1)
    b_dS = b_dS * b_beta[:, None]
    b_dp = b_dRp * (b_beta * b_eGe)[:, None] + _lp_dot(b_dS, b_k, lp_ty, PREC, LP_DOT, STATE_LP)
    _accumulate(dp_base + row[:, None] * K + o_k[None, :], b_dp, m_tk, ACC)
    b_dk += _lp_dot(tl.trans(b_dS), b_p, lp_ty, PREC, LP_DOT, STATE_LP)
    _accumulate(dk_base + row[:, None] * K + o_k[None, :], b_dk, m_tk, ACC)
    b_Aterm = b_dA * b_A
    b_dGe = b_beta * b_eGe * b_rp + tl.sum(b_Aterm, 1)
    b_dGi -= tl.sum(b_Aterm, 0)
    _accumulate(dg_base + row, _gate_grad(b_dGi, b_dGe, b_dGl, REV), m_t, ACC)
    _accumulate(db_base + row, b_dbeta, m_t, ACC)
    return b_dh_prev


@triton.jit
def _load_bwd_chunk(q, k, p, v, g, beta, do, h_base, inv_base, i_b, i_h, c, NF, o_k, o_v, T, H, K: tl.constexpr,
                    V: tl.constexpr, BT: tl.constexpr, LOAD_INV: tl.constexpr):
    """Everything the backward reads for chunk ``c`` (nothing outside [0, NF): the prefetch past either end)."""
    row, m_t = _chunk_rows(i_b, i_h, c, T, H, BT)
    r_q, r_k, r_p, r_v, r_g, r_beta = _load_raw(q, k, p, v, g, beta, row, m_t, o_k, o_v, K, V)
    r_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & (o_v < V)[None, :], other=0)
    c_k = o_k[:, None] * 0 + c  # the chunk index as a tile (masks of a scalar do not broadcast everywhere)
    r_h = tl.load(h_base + c * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=(o_k[:, None] < K) & (o_v[None, :] < V) & (c_k >= 0) & (c_k < NF), other=0)
    r_inv = r_h  # an unused placeholder when the inverses are recomputed
    if LOAD_INV:
        o_t = tl.arange(0, BT)
        c_t = o_t[:, None] * 0 + o_t[None, :] * 0 + c
        r_inv = tl.load(inv_base + c * BT * BT + o_t[:, None] * BT + o_t[None, :], mask=(c_t >= 0) & (c_t < NF),
                        other=0)
    return r_q, r_k, r_p, r_v, r_g, r_beta, r_do, r_h, r_inv


@triton.jit
def _bwd_gradients(q, k, v, p, g, beta, do, h_base, inv_base, dh_base, dq_base, dk_base, dp_base, dv_base, dg_base,
                   db_base, scale, i_b, i_h, i_v, i_c, T, NT, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                   LOG2_BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, REV: tl.constexpr, ACC: tl.constexpr,
                   SPLIT: tl.constexpr, PREC: tl.constexpr, LP_DOT: tl.constexpr,
                   LOAD_INV: tl.constexpr, PREFETCH: tl.constexpr, TAIL: tl.constexpr, STATE_LP: tl.constexpr):
    """One direction's gradients: of every chunk, in reverse walk order with ``dh`` carried in registers, or
    (``SPLIT``) of chunk ``i_c`` alone, from the state gradient the dh walk stored for it. The single-token chunk
    (``TAIL``) goes with the last full chunk: the forward walk's last step comes first here, the reversed walk's
    first step last."""
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    lp_ty = q.dtype.element_ty
    NF = NT - TAIL
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if SPLIT:
        c_lo = i_c
        count = tl.minimum(i_c + 1, NF) - i_c  # 0 when the sequence is a single token
        last = i_c >= NF - 1
        # nothing follows the forward walk's last chunk or the reversed walk's chunk 0: dh = 0 there
        c_kv = o_k[:, None] * 0 + o_v[None, :] * 0 + i_c
        stored = (c_kv > 0) if REV else (c_kv < NF - 1)
        b_dh = tl.load(dh_base + i_c * K * V + o_k[:, None] * V + o_v[None, :], mask=m_kv & stored, other=0)
    else:
        c_lo = 0
        count = NF
        last = True
    # (nested ifs: the outer condition is resolved at compile time, the inner one at run time)
    if TAIL and not REV:  # noqa: SIM102
        if last:  # the forward walk's last step: the single-token chunk
            b_h = tl.load(h_base + NF * K * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0)
            b_dh = _token_bwd(q, k, p, v, g, beta, do, b_h, b_dh, dq_base, dk_base, dp_base, dv_base, dg_base,
                              db_base, scale, i_b, i_h, NF * BT, o_k, o_v, T, H, K, V, ACC).to(b_dh.dtype)
    # the gradient of the state entering a chunk: needed by the next chunk of a pass, or by the reversed walk's
    # first step; a split program's neighbour got it from the dh walk
    if SPLIT:
        need_dh = False
        if TAIL and REV:
            need_dh = last
    else:
        need_dh = True  # (also after the pass's last chunk: cheaper than a branch)
    if PREFETCH:
        n_q, n_k, n_p, n_v, n_g, n_beta, n_do, n_h, n_inv = _load_bwd_chunk(
            q, k, p, v, g, beta, do, h_base, inv_base, i_b, i_h, c_lo if REV else c_lo + count - 1, NF, o_k, o_v,
            T, H, K, V, BT, LOAD_INV)
    for i_r in range(0, count):
        i_w = c_lo + i_r if REV else c_lo + count - 1 - i_r
        row, m_t = _chunk_rows(i_b, i_h, i_w, T, H, BT)
        if PREFETCH:
            r_q, r_k, r_p, r_v, r_g, r_beta, r_do, b_h, b_inv = n_q, n_k, n_p, n_v, n_g, n_beta, n_do, n_h, n_inv
            n_q, n_k, n_p, n_v, n_g, n_beta, n_do, n_h, n_inv = _load_bwd_chunk(
                q, k, p, v, g, beta, do, h_base, inv_base, i_b, i_h, i_w + 1 if REV else i_w - 1, NF, o_k, o_v, T,
                H, K, V, BT, LOAD_INV)
        else:
            r_q, r_k, r_p, r_v, r_g, r_beta, r_do, b_h, b_inv = _load_bwd_chunk(
                q, k, p, v, g, beta, do, h_base, inv_base, i_b, i_h, i_w, NF, o_k, o_v, T, H, K, V, BT, LOAD_INV)
        b_dh = _chunk_bwd(r_q, r_k, r_p, r_v, r_g, r_beta, r_do, b_h, b_dh, b_inv, dq_base, dk_base, dp_base,
                          dv_base, dg_base, db_base, scale, row, m_t, o_k, o_v, lp_ty, REV, ACC, K, V, BT, LOG2_BT,
                          PREC, LP_DOT, LOAD_INV, STATE_LP, need_dh)
    if TAIL and REV:  # noqa: SIM102
        if last:  # the reversed walk's first step, from the zero state
            _token_bwd(q, k, p, v, g, beta, do, tl.zeros([BK, BV], dtype=tl.float32), b_dh, dq_base, dk_base,
                       dp_base, dv_base, dg_base, db_base, scale, i_b, i_h, NF * BT, o_k, o_v, T, H, K, V, ACC)


@triton.jit
def comba_bwd_kernel(q, k, v, p, g, beta, h0, inv, dh, do, dq, dk, dv, dp, dg, dbeta, scale, T, NT, B, H,
                     K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, NV: tl.constexpr, N_DIR: tl.constexpr, DIR_LOOP: tl.constexpr,
                     SPLIT: tl.constexpr, PREC: tl.constexpr, LP_DOT: tl.constexpr,
                     LOAD_INV: tl.constexpr, PREFETCH: tl.constexpr, TAIL: tl.constexpr, STATE_LP: tl.constexpr,
                     ATOMIC_ADD: tl.constexpr):
    """The backward's gradients (grid: chunk with ``SPLIT`` else 1, batch·head, value block × directions on the
    grid). ``DIR_LOOP``: this program runs both directions, the reversed one adding onto the forward one's gradients
    (``ATOMIC_ADD``: by atomic adds); otherwise each direction writes its own partial gradients (summed afterwards)."""
    scale = tl.cast(scale, tl.float32)  # fp32 whatever the launcher passes (Inductor passes Python floats as fp64)
    i_c, i_bh, i_z = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_v = i_z % NV
    i_b, i_h = i_bh // H, i_bh % H
    BTH = B * T * H
    for d in tl.static_range(N_DIR):
        i_slot = 0 if DIR_LOOP else d
        i_part = tl.cast(i_slot * NV + i_v, tl.int64) * BTH
        seq = tl.cast(d * B * H + i_bh, tl.int64) * NT
        if (i_z // NV == d) | (DIR_LOOP or N_DIR == 1):
            _bwd_gradients(q, k, v, p, g, beta, do, h0 + seq * K * V, inv + seq * BT * BT, dh + seq * K * V,
                           dq + i_part * K, dk + i_part * K, dp + i_part * K, dv + tl.cast(i_slot * BTH, tl.int64) * V,
                           dg + i_part, dbeta + i_part, scale, i_b, i_h, i_v, i_c, T, NT, H, K, V, BT, LOG2_BT, BK,
                           BV, d == 1, (1 + ATOMIC_ADD) * (DIR_LOOP and d == 1), SPLIT, PREC, LP_DOT, LOAD_INV,
                           PREFETCH, TAIL, STATE_LP)
        if DIR_LOOP and d + 1 < N_DIR:
            tl.debug_barrier()  # the reversed direction adds onto what other threads of this program stored


@triton.jit
def _dh_chunk(q, k, p, do, g, beta, b_dh, b_inv, scale, row, m_t, o_k, o_v, lp_ty, REV: tl.constexpr,
              K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr, PREC: tl.constexpr,
              LP_DOT: tl.constexpr, LOAD_INV: tl.constexpr, STATE_LP: tl.constexpr):
    """The state gradient through one chunk, without u or h: du = Mqᵀ do + kd dh, dRv = invᵀ du,
    dh ← (q_s e^{Gi})ᵀ do + e^{Gl} dh − pwᵀ dRv."""
    # do is loaded in v's place (same shape)
    r_q, r_k, r_p, r_do, r_g, r_beta = _load_raw(q, k, p, do, g, beta, row, m_t, o_k, o_v, K, V)
    b_q, b_k, b_p, b_do = r_q.to(tl.float32), r_k.to(tl.float32), r_p.to(tl.float32), r_do.to(tl.float32)
    b_Gi, b_Ge, b_Gl, b_pk, b_E, b_A, b_pw = _chunk_wy(b_k, b_p, r_g.to(tl.float32), r_beta.to(tl.float32), lp_ty,
                                                       REV, BT, PREC, LP_DOT)
    if not LOAD_INV:
        b_inv = _unit_lower_inverse(b_A, BT, LOG2_BT, PREC)
    before, upto = _walk_masks(REV, BT)
    b_Mq = _input_dot(b_q, b_k, lp_ty, PREC, LP_DOT) * (_decay(b_Gi, b_Gi, upto) * scale)
    b_kd = b_k * tl.exp(b_Gl - b_Gi)[:, None]
    b_du = (_lp_dot(tl.trans(b_Mq), b_do, lp_ty, PREC, LP_DOT, STATE_LP)
            + _lp_dot(b_kd, b_dh, lp_ty, PREC, LP_DOT, STATE_LP))
    b_dRv = tl.dot(tl.trans(b_inv), b_du, input_precision=PREC)
    b_qe = b_q * (scale * tl.exp(b_Gi))[:, None]
    return (_lp_dot(tl.trans(b_qe), b_do, lp_ty, PREC, LP_DOT, STATE_LP) + tl.exp(b_Gl) * b_dh
            - _lp_dot(tl.trans(b_pw), b_dRv, lp_ty, PREC, LP_DOT, STATE_LP))


@triton.jit
def _token_dh(q, k, p, do, g, beta, b_dh1, scale, i_b, i_h, t, o_k, o_v, T, H, K: tl.constexpr, V: tl.constexpr):
    """The state gradient through one rank-1 token step (see _token_bwd), from the state gradient after it."""
    t_q, t_k, t_p, t_do, t_g, t_beta, t_row = _load_token(q, k, p, do, g, beta, i_b, i_h, t, o_k, o_v, T, H, K, V)
    t_dh1 = scale * t_q[:, None] * t_do[None, :] + b_dh1
    t_du = tl.sum(t_dh1 * t_k[:, None], 0)
    return tl.exp(t_g) * t_dh1 - t_p[:, None] * (t_beta * t_du)[None, :]


@triton.jit
def _dh_walk(q, k, p, g, beta, inv_base, do, dh_base, scale, i_b, i_h, i_v, T, NT, H, K: tl.constexpr,
             V: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
             REV: tl.constexpr, PREC: tl.constexpr, LP_DOT: tl.constexpr,
             LOAD_INV: tl.constexpr, TAIL: tl.constexpr, STATE_LP: tl.constexpr):
    """One direction's state-gradient walk: stores dh[c], the gradient of the state leaving chunk c, for every
    full chunk but the walk's last (its dh is zero, or comes from the single token that the split program of that
    chunk handles itself)."""
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    lp_ty = q.dtype.element_ty
    NF = NT - TAIL
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if TAIL and not REV:
        b_dh = _token_dh(q, k, p, do, g, beta, b_dh, scale, i_b, i_h, NF * BT, o_k, o_v, T, H, K, V)
    # through chunks NF−1 … 1 (forward; after chunk c the gradient leaves chunk c − 1) or 0 … NF−2 (reversed;
    # after chunk c it leaves chunk c + 1)
    for i_r in range(0, NF - 1):
        i_c = i_r if REV else NF - 1 - i_r
        row, m_t = _chunk_rows(i_b, i_h, i_c, T, H, BT)
        b_inv = b_dh
        if LOAD_INV:
            b_inv = tl.load(inv_base + i_c * BT * BT + o_t[:, None] * BT + o_t[None, :])
        b_dh = _dh_chunk(q, k, p, do, g, beta, b_dh, b_inv, scale, row, m_t, o_k, o_v, lp_ty, REV, K, V, BT, LOG2_BT,
                         PREC, LP_DOT, LOAD_INV, STATE_LP)
        i_to = i_c + 1 if REV else i_c - 1
        tl.store(dh_base + i_to * K * V + o_k[:, None] * V + o_v[None, :], b_dh.to(dh_base.dtype.element_ty),
                 mask=m_kv)


@triton.jit
def comba_bwd_dh_kernel(q, k, p, g, beta, inv, do, dh, scale, T, NT, B, H, K: tl.constexpr, V: tl.constexpr,
                        BT: tl.constexpr, LOG2_BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        N_DIR: tl.constexpr, PREC: tl.constexpr, LP_DOT: tl.constexpr,
                        LOAD_INV: tl.constexpr, TAIL: tl.constexpr, STATE_LP: tl.constexpr):
    """The state-gradient walks of the split backward (grid: value block, batch·head, direction)."""
    scale = tl.cast(scale, tl.float32)  # fp32 whatever the launcher passes (Inductor passes Python floats as fp64)
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    for d in tl.static_range(N_DIR):
        seq = tl.cast(d * B * H + i_bh, tl.int64) * NT
        if (tl.program_id(2) == d) | (N_DIR == 1):
            _dh_walk(q, k, p, g, beta, inv + seq * BT * BT, do, dh + seq * K * V, scale, i_b, i_h, i_v, T, NT, H, K, V,
                     BT, LOG2_BT, BK, BV, d == 1, PREC, LP_DOT, LOAD_INV, TAIL, STATE_LP)
