"""Triton kernels for Comba: one program walks a whole (batch, head[, value block]) sequence chunk by chunk.

Each chunk of ``BT`` tokens is done in the WY/UT form (one unit-lower triangular inverse per chunk, see
:mod:`.naive` for the algebra; the inverse is a product of log2(16) factors per 16-token block, merged for
32-token chunks, all small tensor-core products in 3-pass TF32 for 16-bit inputs — single-pass TF32 loses ~10%
when neighbouring keys align — and exact FMAs for fp32 inputs); the state ``h ∈ R^{K×BV}`` stays in registers
(fp32) between chunks, so nothing but the inputs, the outputs and — when a backward will follow — one fp32 state
and one BT×BT inverse per chunk ever touch global memory. Vision workloads (T ≈ 49–320, batch × heads in the
thousands) fill the GPU with one-warp programs.

Few, long sequences (LM shapes): a chunk-parallel kernel (``comba_wy_kernel``, one program per chunk) first
computes W = inv·(β e^{Ge} p) and U0 = inv·(βv); the sequential walk then only does the state-dependent products,
and the value dimension is split over programs without repeating the K-side work per value block.

Non-causal calls run the reversed recurrence in the same launch, addressing tokens as ``T − 1 − j`` (no reversed
copies of the inputs): with many programs each one runs both directions and adds the second onto its own output
(``DIR_LOOP``); with few, a second grid slice (``program_id(2) == 1``) takes the reversed direction and the two
partial outputs are summed afterwards.

Backward: the forward stores the state entering every chunk (``h0``) and the chunk's inverse. For small states
(16–32 wide) one kernel walks the chunks in reverse, rebuilds the rest of the chunk's WY quantities and carries
``dh`` in registers. For 64-wide and larger states that kernel spills, so the backward is split: a light walk
carries only ``dh`` and stores it per chunk (``comba_bwd_dh_kernel``), then one program per chunk computes all
its gradients from the stored ``h0`` and ``dh`` (``comba_bwd_chunk_kernel``; non-causal: a second launch adds the
reversed direction). Gradients that sum over the value dimension (dq, dk, dp, dβ, dg) are written per value block
(and grid direction) and reduced afterwards.

Launch layout (chunk size, warps, value split, direction handling, W/U0 pre-pass) comes from a heuristic fitted to
H200 measurements; for large small-head problems on CUDA prefetching and register caps are also timed once per
problem shape and the fastest kept (``_choose``; never under CUDA graph capture, which forbids the synchronization).

Host side: vision workloads are host-bound in eager mode, so everything that depends only on the problem's shape,
dtypes and flags is worked out once into a cached launch plan (``_FwdPlan``/``_BwdPlan``), and a plan's later
launches call the kernel Triton compiled for it directly (:class:`visionssm.kernels.utils.DirectLaunch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils import DirectLaunch, aligned16, cdiv, device_guard, empty_output, empty_output_like

__all__ = ["CombaFunction", "fused_comba"]


@triton.jit
def _unit_lower_inverse(A, BT: tl.constexpr, LOG2_BT: tl.constexpr, INV_PREC: tl.constexpr):
    """(I + A)^{-1} for a strictly lower triangular [BT, BT] tile.

    A is nilpotent, so with N = −A: (I + A)^{-1} = I + N + … + N^{BT−1} = (I + N)(I + N²)(I + N⁴)…(I + N^{BT/2}):
    2·log2(BT) − 2 small matrix products instead of BT dependent row updates. The factors cancel each other, so
    the products need fp32 accuracy: "ieee" (CUDA-core FMAs) or "tf32x3" (three tensor-core passes, ~fp32), and
    a 32-token tile is merged from two 16-token series (below)."""
    tl.static_assert(BT <= 32, "the block step below merges at most two 16-token blocks")
    rows = tl.arange(0, BT)
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    if BT > 16:
        # The cancellation grows with the series length: over 32 tokens with nearly parallel keys even exact fp32
        # loses ~10% of the output. So invert the two 16-token diagonal blocks D by the series, then merge:
        # (I + D + O)^{-1} = (I - D^{-1} O) D^{-1}, since (D^{-1} O)² = 0 for the off-diagonal block O.
        same_block = (rows[:, None] // 16) == (rows[None, :] // 16)
        diag = tl.where(same_block, A, 0.0)
        off = A - diag
        power = -diag
        inv = eye + power
        for _ in tl.static_range(3):  # 2 + 4 + 8 + 16: the series of a 16-token block
            power = tl.dot(power, power, input_precision=INV_PREC)
            inv += tl.dot(inv, power, input_precision=INV_PREC)
        inv -= tl.dot(tl.dot(inv, off, input_precision=INV_PREC), inv, input_precision=INV_PREC)
    else:
        power = -A
        inv = eye + power
        for _ in tl.static_range(LOG2_BT - 1):
            power = tl.dot(power, power, input_precision=INV_PREC)
            inv += tl.dot(inv, power, input_precision=INV_PREC)
    return inv


@triton.jit
def _chunk_rows(i_b, i_h, i_d, i_c, o_k, o_v, T, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    """Token rows of chunk ``i_c`` (direction ``i_d`` walks the sequence from its end) and their masks."""
    o_t = tl.arange(0, BT)
    j = i_c * BT + o_t
    m_t = (j < T) & (j >= 0)
    t_idx = tl.where(i_d == 0, j, T - 1 - j)
    row = (i_b.to(tl.int64) * T + t_idx) * H + i_h
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    return row, m_t, m_tk, m_tv


@triton.jit
def _load_raw(q, k, p, v, g, beta, i_b, i_h, i_d, i_c, o_k, o_v, T, H, K: tl.constexpr,
              V: tl.constexpr, BT: tl.constexpr):
    """The chunk's inputs in their own dtypes (converted where used, so a prefetch does not wait on them)."""
    row, m_t, m_tk, m_tv = _chunk_rows(i_b, i_h, i_d, i_c, o_k, o_v, T, H, K, V, BT)
    r_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_tk, other=0)
    r_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0)
    r_p = tl.load(p + row[:, None] * K + o_k[None, :], mask=m_tk, other=0)
    r_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_tv, other=0)
    r_g = tl.load(g + row, mask=m_t, other=0)
    r_beta = tl.load(beta + row, mask=m_t, other=0)
    return r_q, r_k, r_p, r_v, r_g, r_beta


@triton.jit
def _load_chunk(q, k, p, v, g, beta, i_b, i_h, i_d, i_c, o_k, o_v, T, H, K: tl.constexpr,
                V: tl.constexpr, BT: tl.constexpr):
    r_q, r_k, r_p, r_v, r_g, r_beta = _load_raw(q, k, p, v, g, beta, i_b, i_h, i_d, i_c, o_k, o_v, T, H, K, V, BT)
    row, m_t, m_tk, m_tv = _chunk_rows(i_b, i_h, i_d, i_c, o_k, o_v, T, H, K, V, BT)
    return (r_q.to(tl.float32), r_k.to(tl.float32), r_p.to(tl.float32), r_v.to(tl.float32), r_g.to(tl.float32),
            r_beta.to(tl.float32), row, m_t, m_tk, m_tv)


@triton.jit
def _load_token(q, k, p, v, g, beta, i_b, i_h, i_d, j, o_k, o_v, T, H, K: tl.constexpr, V: tl.constexpr):
    """Token ``j`` of direction ``i_d`` as fp32 vectors (q, k, p over K; v over the value block) and scalars."""
    t_idx = tl.where(i_d == 0, j, T - 1 - j)
    row = (i_b.to(tl.int64) * T + t_idx) * H + i_h
    m_k = o_k < K
    m_v = o_v < V
    t_q = tl.load(q + row * K + o_k, mask=m_k, other=0).to(tl.float32)
    t_k = tl.load(k + row * K + o_k, mask=m_k, other=0).to(tl.float32)
    t_p = tl.load(p + row * K + o_k, mask=m_k, other=0).to(tl.float32)
    t_v = tl.load(v + row * V + o_v, mask=m_v, other=0).to(tl.float32)
    t_g = tl.load(g + row).to(tl.float32)
    t_beta = tl.load(beta + row).to(tl.float32)
    return t_q, t_k, t_p, t_v, t_g, t_beta, row, m_k, m_v


@triton.jit
def _input_dot(a, b, lp_ty, PREC: tl.constexpr, LP_DOT: tl.constexpr):
    """a @ bᵀ of two input tiles (held in fp32). With LP_DOT the tiles go back to their bf16/fp16 input dtype —
    exact, they came from it — and use the 16-bit tensor-core path; the fp32 accumulation is the same."""
    if LP_DOT:
        return tl.dot(a.to(lp_ty), tl.trans(b.to(lp_ty)))
    return tl.dot(a, tl.trans(b), input_precision=PREC)


@triton.jit
def _chunk_wy(b_k, b_p, b_v, b_g, b_beta, b_inv_in, lp_ty, BT: tl.constexpr, LOG2_BT: tl.constexpr,
              PREC: tl.constexpr, INV_PREC: tl.constexpr, LP_DOT: tl.constexpr, LOAD_INV: tl.constexpr):
    """Gate cumsums and the chunk's WY quantities: Gi, Ge, p·kᵀ, E, A, (I+A)^{-1} (``b_inv_in`` when the forward
    stored it) and the scaled feedback keys pw = β e^{Ge} p (W = inv·pw, U0 = inv·(βv))."""
    o_t = tl.arange(0, BT)
    strict = o_t[:, None] > o_t[None, :]
    b_Gi = tl.cumsum(b_g, 0)
    b_Ge = b_Gi - b_g
    b_pk = _input_dot(b_p, b_k, lp_ty, PREC, LP_DOT)
    b_E = tl.where(strict, tl.exp(tl.where(strict, b_Ge[:, None] - b_Gi[None, :], 0.0)), 0.0)
    b_A = b_beta[:, None] * b_pk * b_E
    if LOAD_INV:
        b_inv = b_inv_in
    else:
        b_inv = _unit_lower_inverse(b_A, BT, LOG2_BT, INV_PREC)
    b_pw = b_p * (b_beta * tl.exp(b_Ge))[:, None]
    return b_Gi, b_Ge, b_pk, b_E, b_A, b_inv, b_pw


@triton.jit
def _accumulate(ptr, value, mask, ACC):
    """Store ``value``, adding what is already there when ``ACC`` (the second direction of a program)."""
    if ACC:
        value += tl.load(ptr, mask=mask, other=0).to(tl.float32)
    tl.store(ptr, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def comba_wy_kernel(k, v, p, g, beta, w, u0, inv, T, NT, B, H, K: tl.constexpr, V: tl.constexpr,
                    BT: tl.constexpr, LOG2_BT: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr,
                    SAVE_INV: tl.constexpr, PREC: tl.constexpr, INV_PREC: tl.constexpr, LP_DOT: tl.constexpr):
    """Chunk-parallel part of the forward (grid: chunk, batch·head, direction): W, U0 (and the inverse) of one
    chunk, so the sequential state walk that follows does only the state-dependent products."""
    i_c, i_bh, i_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BVF)
    b_q, b_k, b_p, b_v, b_g, b_beta, row, m_t, m_tk, m_tv = _load_chunk(
        k, k, p, v, g, beta, i_b, i_h, i_d, i_c, o_k, o_v, T, H, K, V, BT)
    b_Gi, b_Ge, b_pk, b_E, b_A, b_inv, b_pw = _chunk_wy(
        b_k, b_p, b_v, b_g, b_beta, inv, k.dtype.element_ty, BT, LOG2_BT, PREC, INV_PREC, LP_DOT, False)
    b_W = tl.dot(b_inv, b_pw, input_precision=PREC)
    b_U0 = tl.dot(b_inv, b_v * b_beta[:, None], input_precision=PREC)
    base = (i_d.to(tl.int64) * B * H + i_bh) * NT + i_c
    all_t = o_t[:, None] < BT
    tl.store(w + base * BT * K + o_t[:, None] * K + o_k[None, :], b_W, mask=all_t & (o_k < K)[None, :])
    tl.store(u0 + base * BT * V + o_t[:, None] * V + o_v[None, :], b_U0, mask=all_t & (o_v < V)[None, :])
    if SAVE_INV:
        tl.store(inv + base * BT * BT + o_t[:, None] * BT + o_t[None, :], b_inv)


@triton.jit
def comba_fwd_kernel(q, k, v, p, g, beta, o, h0, inv, w, u0, scale, T, NT, B, H, K: tl.constexpr,
                     V: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     SAVE_H: tl.constexpr, SAVE_INV: tl.constexpr, DIR_LOOP: tl.constexpr, N_DIR: tl.constexpr,
                     PREC: tl.constexpr, INV_PREC: tl.constexpr, LP_DOT: tl.constexpr, LOAD_WY: tl.constexpr,
                     PREFETCH: tl.constexpr, TAIL: tl.constexpr):
    # DIR_LOOP: this program runs every direction itself, adding the reversed pass onto its own forward output
    # (no partial buffers); otherwise program_id(2) picks the direction and each writes its own slot.
    # PREFETCH: the next chunk's inputs are loaded while this one is computed (latency hidden, more registers).
    # TAIL: the last chunk holds a single token (T % BT == 1, e.g. T = 49): one rank-1 step instead of a chunk.
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    lower = o_t[:, None] >= o_t[None, :]
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    for i_dd in range(0, N_DIR):
        i_d = i_dd + tl.program_id(2)
        if DIR_LOOP:
            o_base = o
        else:
            o_base = o + i_d.to(tl.int64) * B * T * H * V
        h_base = h0 + (i_d.to(tl.int64) * B * H + i_bh) * NT * K * V
        inv_base = inv + (i_d.to(tl.int64) * B * H + i_bh) * NT * BT * BT
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
        NTL = NT
        if TAIL:
            NTL = NT - 1
        if PREFETCH:
            n_q, n_k, n_p, n_v, n_g, n_beta = _load_raw(q, k, p, v, g, beta, i_b, i_h, i_d, 0, o_k, o_v, T, H, K, V,
                                                        BT)
        for i_c in range(0, NTL):
            row, m_t, m_tk, m_tv = _chunk_rows(i_b, i_h, i_d, i_c, o_k, o_v, T, H, K, V, BT)
            if PREFETCH:
                r_q, r_k, r_p, r_v, r_g, r_beta = n_q, n_k, n_p, n_v, n_g, n_beta
                n_q, n_k, n_p, n_v, n_g, n_beta = _load_raw(q, k, p, v, g, beta, i_b, i_h, i_d, i_c + 1, o_k, o_v,
                                                            T, H, K, V, BT)
            else:
                r_q, r_k, r_p, r_v, r_g, r_beta = _load_raw(q, k, p, v, g, beta, i_b, i_h, i_d, i_c, o_k, o_v, T, H,
                                                            K, V, BT)
            b_q, b_k, b_p, b_v = r_q.to(tl.float32), r_k.to(tl.float32), r_p.to(tl.float32), r_v.to(tl.float32)
            b_g, b_beta = r_g.to(tl.float32), r_beta.to(tl.float32)
            if SAVE_H:
                tl.store(h_base + i_c * K * V + o_k[:, None] * V + o_v[None, :], b_h, mask=m_kv)
            if LOAD_WY:
                # W, U0 (and the stored inverse) come from comba_wy_kernel
                wy = (i_d.to(tl.int64) * B * H + i_bh) * NT + i_c
                all_t = o_t[:, None] < BT
                b_W = tl.load(w + wy * BT * K + o_t[:, None] * K + o_k[None, :], mask=all_t & (o_k < K)[None, :],
                              other=0)
                b_U0 = tl.load(u0 + wy * BT * V + o_t[:, None] * V + o_v[None, :], mask=all_t & (o_v < V)[None, :],
                               other=0)
                b_Gi = tl.cumsum(b_g, 0)
                b_u = b_U0 - tl.dot(b_W, b_h, input_precision=PREC)
            else:
                b_Gi, b_Ge, b_pk, b_E, b_A, b_inv, b_pw = _chunk_wy(
                    b_k, b_p, b_v, b_g, b_beta, inv_base, q.dtype.element_ty, BT, LOG2_BT, PREC, INV_PREC,
                    LP_DOT, False)
                # u = U0 − W h = inv (βv − pw h): one product with the inverse instead of W and U0
                b_u = tl.dot(b_inv, b_v * b_beta[:, None] - tl.dot(b_pw, b_h, input_precision=PREC),
                             input_precision=PREC)
                if SAVE_INV:
                    # every value block computes the same inverse; the first one keeps it for the backward
                    tl.store(inv_base + i_c * BT * BT + o_t[:, None] * BT + o_t[None, :], b_inv,
                             mask=(o_t[:, None] + o_t[None, :] * 0 + i_v * BT) < BT)
            b_D = tl.where(lower, tl.exp(tl.where(lower, b_Gi[:, None] - b_Gi[None, :], 0.0)), 0.0)
            b_qk = _input_dot(b_q, b_k, q.dtype.element_ty, PREC, LP_DOT) * (b_D * scale)
            b_q = b_q * scale
            b_o = tl.dot(b_q * tl.exp(b_Gi)[:, None], b_h, input_precision=PREC)
            b_o += tl.dot(b_qk, b_u, input_precision=PREC)
            p_o = o_base + row[:, None] * V + o_v[None, :]
            _accumulate(p_o, b_o, m_tv, i_dd > 0)
            b_Gl = tl.sum(tl.where(o_t == BT - 1, b_Gi, 0.0), 0)
            b_kd = b_k * tl.exp(b_Gl - b_Gi)[:, None]
            b_h = b_h * tl.exp(b_Gl) + tl.dot(tl.trans(b_kd), b_u, input_precision=PREC)
        if TAIL:
            if SAVE_H:
                tl.store(h_base + NTL * K * V + o_k[:, None] * V + o_v[None, :], b_h, mask=m_kv)
            t_q, t_k, t_p, t_v, t_g, t_beta, t_row, t_mk, t_mv = _load_token(q, k, p, v, g, beta, i_b, i_h, i_d,
                                                                             NTL * BT, o_k, o_v, T, H, K, V)
            t_u = t_beta * (t_v - tl.sum(b_h * t_p[:, None], 0))
            b_h = b_h * tl.exp(t_g) + t_k[:, None] * t_u[None, :]
            _accumulate(o_base + t_row * V + o_v, scale * tl.sum(b_h * t_q[:, None], 0), t_mv, i_dd > 0)
        # the next direction reads back what other threads of this program stored
        tl.debug_barrier()


@triton.jit
def _load_bwd_raw(q, k, p, v, g, beta, do, h_base, inv_base, i_b, i_h, i_d, i_c, o_k, o_v, T, H, K: tl.constexpr,
                  V: tl.constexpr, BT: tl.constexpr, LOAD_INV: tl.constexpr):
    """Everything the backward reads for chunk ``i_c`` (nothing when ``i_c`` < 0: the prefetch past the start)."""
    r_q, r_k, r_p, r_v, r_g, r_beta = _load_raw(q, k, p, v, g, beta, i_b, i_h, i_d, i_c, o_k, o_v, T, H, K, V, BT)
    row, m_t, m_tk, m_tv = _chunk_rows(i_b, i_h, i_d, i_c, o_k, o_v, T, H, K, V, BT)
    r_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0)
    r_h = tl.load(h_base + i_c * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=(o_k[:, None] < K) & (o_v[None, :] < V) & (o_k[:, None] * 0 + i_c >= 0), other=0)
    if LOAD_INV:
        o_t = tl.arange(0, BT)
        r_inv = tl.load(inv_base + i_c * BT * BT + o_t[:, None] * BT + o_t[None, :],
                        mask=(o_t[:, None] * 0 + o_t[None, :] * 0 + i_c) >= 0, other=0)
    else:
        r_inv = r_h
    return r_q, r_k, r_p, r_v, r_g, r_beta, r_do, r_h, r_inv


@triton.jit
def _tail_bwd(q, k, p, v, g, beta, do, h_base, dq_base, dk_base, dp_base, dv_base, dg_base, db_base, scale, i_b,
              i_h, i_d, NTL, o_k, o_v, T, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, acc):
    """Gradients of the single last token (``TAIL``): u = β(v − h0ᵀp), h1 = e^g h0 + k uᵀ, o = scale·h1ᵀq, with
    nothing after it (dh1 comes from o alone). Returns the gradient of the state entering it."""
    t_q, t_k, t_p, t_v, t_g, t_beta, t_row, t_mk, t_mv = _load_token(q, k, p, v, g, beta, i_b, i_h, i_d, NTL * BT,
                                                                     o_k, o_v, T, H, K, V)
    t_do = tl.load(do + t_row * V + o_v, mask=t_mv, other=0).to(tl.float32)
    t_h0 = tl.load(h_base + NTL * K * V + o_k[:, None] * V + o_v[None, :],
                   mask=(o_k[:, None] < K) & (o_v[None, :] < V), other=0)
    t_x = t_v - tl.sum(t_h0 * t_p[:, None], 0)
    t_u = t_beta * t_x
    t_a = tl.exp(t_g)
    t_h1 = t_h0 * t_a + t_k[:, None] * t_u[None, :]
    t_dh1 = scale * t_q[:, None] * t_do[None, :]
    t_du = tl.sum(t_dh1 * t_k[:, None], 0)
    t_dr = -t_beta * t_du
    _accumulate(dq_base + t_row * K + o_k, scale * tl.sum(t_h1 * t_do[None, :], 1), t_mk, acc)
    _accumulate(dk_base + t_row * K + o_k, tl.sum(t_dh1 * t_u[None, :], 1), t_mk, acc)
    _accumulate(dp_base + t_row * K + o_k, tl.sum(t_h0 * t_dr[None, :], 1), t_mk, acc)
    _accumulate(dv_base + t_row * V + o_v, t_beta * t_du, t_mv, acc)
    _accumulate(dg_base + t_row, t_a * tl.sum(tl.sum(t_dh1 * t_h0, 1), 0), t_row >= 0, acc)
    _accumulate(db_base + t_row, tl.sum(t_du * t_x, 0), t_row >= 0, acc)
    return t_a * t_dh1 + t_p[:, None] * t_dr[None, :]


@triton.jit
def _chunk_bwd(r_q, r_k, r_p, r_v, r_g, r_beta, r_do, b_h, b_dh, b_inv_in, dq_base, dk_base, dp_base, dv_base,
               dg_base, db_base, scale, row, m_t, m_tk, m_tv, o_k, o_v, lp_ty, acc, K: tl.constexpr,
               V: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr, PREC: tl.constexpr, INV_PREC: tl.constexpr,
               LP_DOT: tl.constexpr, LOAD_INV: tl.constexpr):
    """Every gradient of one chunk, given the state entering it (``b_h``) and the gradient of the state leaving it
    (``b_dh``); stores them and returns the gradient of the entering state."""
    o_t = tl.arange(0, BT)
    lower = o_t[:, None] >= o_t[None, :]
    b_q, b_k, b_p, b_v = r_q.to(tl.float32), r_k.to(tl.float32), r_p.to(tl.float32), r_v.to(tl.float32)
    b_g, b_beta, b_do = r_g.to(tl.float32), r_beta.to(tl.float32), r_do.to(tl.float32)
    b_Gi, b_Ge, b_pk, b_E, b_A, b_inv, b_pw = _chunk_wy(
        b_k, b_p, b_v, b_g, b_beta, b_inv_in, lp_ty, BT, LOG2_BT, PREC, INV_PREC, LP_DOT, LOAD_INV)
    b_u = tl.dot(b_inv, b_v * b_beta[:, None] - tl.dot(b_pw, b_h, input_precision=PREC),
                 input_precision=PREC)
    b_qs = b_q * scale
    b_eG = tl.exp(b_Gi)
    b_Gl = tl.sum(tl.where(o_t == BT - 1, b_Gi, 0.0), 0)
    b_eGl = tl.exp(b_Gl)
    b_D = tl.where(lower, tl.exp(tl.where(lower, b_Gi[:, None] - b_Gi[None, :], 0.0)), 0.0)
    b_Mq = _input_dot(b_q, b_k, lp_ty, PREC, LP_DOT) * (b_D * scale)
    b_kd = b_k * tl.exp(b_Gl - b_Gi)[:, None]

    # o = e^{G} ⊙ (q_s h0) + Mq u;  h_end = e^{G_last} h0 + kdᵀ u
    b_du = tl.dot(tl.trans(b_Mq), b_do, input_precision=PREC) + tl.dot(b_kd, b_dh, input_precision=PREC)
    b_dMq = tl.dot(b_do, tl.trans(b_u), input_precision=PREC)
    b_dMqD = b_dMq * b_D
    b_doh = tl.dot(b_do, tl.trans(b_h), input_precision=PREC)
    b_dq = scale * (b_eG[:, None] * b_doh + tl.dot(b_dMqD, b_k, input_precision=PREC))
    # gradients are stored as soon as they are final: fewer tiles live at once (register pressure)
    _accumulate(dq_base + row[:, None] * K + o_k[None, :], b_dq, m_tk, acc)
    b_udh = tl.dot(b_u, tl.trans(b_dh), input_precision=PREC)
    b_dk = tl.dot(tl.trans(b_dMqD), b_qs, input_precision=PREC) + tl.exp(b_Gl - b_Gi)[:, None] * b_udh
    b_term = b_dMq * b_Mq
    b_c = tl.sum(b_kd * b_udh, 1)
    b_dGi = (tl.sum(b_qs * b_doh, 1) * b_eG + tl.sum(b_term, 1) - tl.sum(b_term, 0) - b_c)
    b_dGl = b_eGl * tl.sum(tl.sum(b_dh * b_h, 1), 0) + tl.sum(b_c, 0)
    b_dGi += tl.where(o_t == BT - 1, b_dGl, 0.0)

    # u = inv (βv − pw h0) with pw = β e^{Ge} p,  A = strict(β_t e^{Ge_t − Gi_s} p_t·k_s).
    # With dRv = invᵀ du (the gradient of inv's right-hand side): d(pw) = −dRv h0ᵀ, dA = −dRv uᵀ and
    # dh0 gets −pwᵀ dRv — three products where the W/U0 form needs five.
    b_dRv = tl.dot(tl.trans(b_inv), b_du, input_precision=PREC)
    b_dRp = -tl.dot(b_dRv, tl.trans(b_h), input_precision=PREC)
    b_dA = -tl.dot(b_dRv, tl.trans(b_u), input_precision=PREC)
    b_dh_prev = (tl.dot(tl.trans(b_qs * b_eG[:, None]), b_do, input_precision=PREC) + b_eGl * b_dh
                 - tl.dot(tl.trans(b_pw), b_dRv, input_precision=PREC))
    b_wscale = b_beta * tl.exp(b_Ge)
    b_rp = tl.sum(b_dRp * b_p, 1)
    b_dp = b_dRp * b_wscale[:, None]
    _accumulate(dv_base + row[:, None] * V + o_v[None, :], b_dRv * b_beta[:, None], m_tv, acc)
    b_dS = b_dA * b_E
    b_dbeta = b_rp * tl.exp(b_Ge) + tl.sum(b_dRv * b_v, 1) + tl.sum(b_dS * b_pk, 1)
    b_dS = b_dS * b_beta[:, None]
    b_dp += tl.dot(b_dS, b_k, input_precision=PREC)
    _accumulate(dp_base + row[:, None] * K + o_k[None, :], b_dp, m_tk, acc)
    b_dk += tl.dot(tl.trans(b_dS), b_p, input_precision=PREC)
    _accumulate(dk_base + row[:, None] * K + o_k[None, :], b_dk, m_tk, acc)
    b_Aterm = b_dA * b_A
    b_dGe = b_wscale * b_rp + tl.sum(b_Aterm, 1)
    b_dGi -= tl.sum(b_Aterm, 0)
    # Gi = inclusive cumsum(g), Ge = exclusive cumsum(g), both chunk-local
    b_dg = (tl.sum(b_dGi, 0) - tl.cumsum(b_dGi, 0) + b_dGi) + (tl.sum(b_dGe, 0) - tl.cumsum(b_dGe, 0))
    _accumulate(dg_base + row, b_dg, m_t, acc)
    _accumulate(db_base + row, b_dbeta, m_t, acc)
    return b_dh_prev


@triton.jit
def comba_bwd_kernel(q, k, v, p, g, beta, h0, inv, do, dq, dk, dv, dp, dg, dbeta, scale, T, NT, B,
                     H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, DIR_LOOP: tl.constexpr,
                     N_DIR: tl.constexpr, PREC: tl.constexpr, INV_PREC: tl.constexpr, LP_DOT: tl.constexpr,
                     LOAD_INV: tl.constexpr, PREFETCH: tl.constexpr, TAIL: tl.constexpr):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    BTH = B * T * H
    for i_dd in range(0, N_DIR):
        i_d = i_dd + tl.program_id(2)
        if DIR_LOOP:
            i_slot = i_dd * 0
        else:
            i_slot = i_d
        acc = i_dd > 0
        i_part = (i_slot * NV + i_v).to(tl.int64)
        h_base = h0 + (i_d.to(tl.int64) * B * H + i_bh) * NT * K * V
        inv_base = inv + (i_d.to(tl.int64) * B * H + i_bh) * NT * BT * BT
        dk_base = dk + i_part * BTH * K
        dq_base = dq + i_part * BTH * K
        dp_base = dp + i_part * BTH * K
        dv_base = dv + i_slot.to(tl.int64) * BTH * V
        dg_base = dg + i_part * BTH
        db_base = dbeta + i_part * BTH
        b_dh = tl.zeros([BK, BV], dtype=tl.float32)
        NTL = NT
        if TAIL:
            NTL = NT - 1
        if TAIL:
            b_dh = _tail_bwd(q, k, p, v, g, beta, do, h_base, dq_base, dk_base, dp_base, dv_base, dg_base, db_base,
                             scale, i_b, i_h, i_d, NTL, o_k, o_v, T, H, K, V, BT, acc)
        if PREFETCH:
            n_q, n_k, n_p, n_v, n_g, n_beta, n_do, n_h, n_inv = _load_bwd_raw(
                q, k, p, v, g, beta, do, h_base, inv_base, i_b, i_h, i_d, NTL - 1, o_k, o_v, T, H, K, V, BT,
                LOAD_INV)
        for i_r in range(0, NTL):
            i_c = NTL - 1 - i_r
            row, m_t, m_tk, m_tv = _chunk_rows(i_b, i_h, i_d, i_c, o_k, o_v, T, H, K, V, BT)
            if PREFETCH:
                r_q, r_k, r_p, r_v, r_g, r_beta, r_do, b_h, b_inv_in = n_q, n_k, n_p, n_v, n_g, n_beta, n_do, n_h, n_inv
                n_q, n_k, n_p, n_v, n_g, n_beta, n_do, n_h, n_inv = _load_bwd_raw(
                    q, k, p, v, g, beta, do, h_base, inv_base, i_b, i_h, i_d, i_c - 1, o_k, o_v, T, H, K, V, BT,
                    LOAD_INV)
            else:
                r_q, r_k, r_p, r_v, r_g, r_beta, r_do, b_h, b_inv_in = _load_bwd_raw(
                    q, k, p, v, g, beta, do, h_base, inv_base, i_b, i_h, i_d, i_c, o_k, o_v, T, H, K, V, BT,
                    LOAD_INV)
            b_dh = _chunk_bwd(r_q, r_k, r_p, r_v, r_g, r_beta, r_do, b_h, b_dh, b_inv_in, dq_base, dk_base, dp_base,
                              dv_base, dg_base, db_base, scale, row, m_t, m_tk, m_tv, o_k, o_v, q.dtype.element_ty,
                              acc, K, V, BT, LOG2_BT, PREC, INV_PREC, LP_DOT, LOAD_INV)
        tl.debug_barrier()


@triton.jit
def comba_bwd_dh_kernel(q, k, p, g, beta, inv, do, dh, scale, T, NT, B, H, K: tl.constexpr, V: tl.constexpr,
                        BT: tl.constexpr, LOG2_BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        PREC: tl.constexpr, INV_PREC: tl.constexpr, LP_DOT: tl.constexpr, LOAD_INV: tl.constexpr,
                        TAIL: tl.constexpr):
    """Split backward, sequential part (grid: value block, batch·head, direction): only the state gradient walks
    the chunks in reverse; the one leaving chunk c is stored as ``dh[c]`` for :func:`comba_bwd_chunk_kernel`.
    Per chunk: du = Mqᵀ do + kd dh, dRv = invᵀ du, dh ← (q_s e^{G})ᵀ do + e^{G_last} dh − pwᵀ dRv (no u, no h)."""
    i_v, i_bh, i_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    lower = o_t[:, None] >= o_t[None, :]
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    dh_base = dh + (i_d.to(tl.int64) * B * H + i_bh) * NT * K * V
    inv_base = inv + (i_d.to(tl.int64) * B * H + i_bh) * NT * BT * BT
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    NTL = NT
    if TAIL:
        NTL = NT - 1
        # the single last token (see _tail_bwd); do is loaded in v's place
        t_q, t_k, t_p, t_do, t_g, t_beta, t_row, t_mk, t_mv = _load_token(q, k, p, do, g, beta, i_b, i_h, i_d,
                                                                          NTL * BT, o_k, o_v, T, H, K, V)
        t_dh1 = scale * t_q[:, None] * t_do[None, :]
        t_du = tl.sum(t_dh1 * t_k[:, None], 0)
        b_dh = tl.exp(t_g) * t_dh1 - t_p[:, None] * (t_beta * t_du)[None, :]
    for i_r in range(0, NTL):
        i_c = NTL - 1 - i_r
        tl.store(dh_base + i_c * K * V + o_k[:, None] * V + o_v[None, :], b_dh, mask=m_kv)
        if i_c > 0:  # the gradient of the zero initial state is not needed
            # do is loaded in v's place (same shape)
            b_q, b_k, b_p, b_do, b_g, b_beta, row, m_t, m_tk, m_tv = _load_chunk(
                q, k, p, do, g, beta, i_b, i_h, i_d, i_c, o_k, o_v, T, H, K, V, BT)
            if LOAD_INV:
                b_inv_in = tl.load(inv_base + i_c * BT * BT + o_t[:, None] * BT + o_t[None, :])
            else:
                b_inv_in = tl.zeros([BT, BT], dtype=tl.float32)
            b_Gi, b_Ge, b_pk, b_E, b_A, b_inv, b_pw = _chunk_wy(
                b_k, b_p, b_k, b_g, b_beta, b_inv_in, q.dtype.element_ty, BT, LOG2_BT, PREC, INV_PREC, LP_DOT,
                LOAD_INV)
            b_Gl = tl.sum(tl.where(o_t == BT - 1, b_Gi, 0.0), 0)
            b_D = tl.where(lower, tl.exp(tl.where(lower, b_Gi[:, None] - b_Gi[None, :], 0.0)), 0.0)
            b_Mq = _input_dot(b_q, b_k, q.dtype.element_ty, PREC, LP_DOT) * (b_D * scale)
            b_kd = b_k * tl.exp(b_Gl - b_Gi)[:, None]
            b_du = (tl.dot(tl.trans(b_Mq), b_do, input_precision=PREC)
                    + tl.dot(b_kd, b_dh, input_precision=PREC))
            b_dRv = tl.dot(tl.trans(b_inv), b_du, input_precision=PREC)
            b_qe = b_q * (scale * tl.exp(b_Gi))[:, None]
            b_dh = (tl.dot(tl.trans(b_qe), b_do, input_precision=PREC) + tl.exp(b_Gl) * b_dh
                    - tl.dot(tl.trans(b_pw), b_dRv, input_precision=PREC))


@triton.jit
def comba_bwd_chunk_kernel(q, k, v, p, g, beta, h0, inv, dh, do, dq, dk, dv, dp, dg, dbeta, scale, T, NT, B, H,
                           K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr,
                           BK: tl.constexpr, BV: tl.constexpr, DIR: tl.constexpr, ACC: tl.constexpr,
                           PREC: tl.constexpr, INV_PREC: tl.constexpr, LP_DOT: tl.constexpr, LOAD_INV: tl.constexpr,
                           TAIL: tl.constexpr):
    """Split backward, chunk-parallel part (grid: chunk, batch·head, value block; one launch per direction, the
    second adding onto the first's gradients): every gradient of one chunk from the stored entering state ``h0[c]``
    and leaving-state gradient ``dh[c]``. Gradients summed over values are written per value block."""
    i_c, i_bh, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    BTH = B * T * H
    i_part = i_v.to(tl.int64)
    i_seq = DIR * B * H + i_bh.to(tl.int64)
    h_base = h0 + i_seq * NT * K * V
    dh_base = dh + i_seq * NT * K * V
    inv_base = inv + i_seq * NT * BT * BT
    dq_base = dq + i_part * BTH * K
    dk_base = dk + i_part * BTH * K
    dp_base = dp + i_part * BTH * K
    dg_base = dg + i_part * BTH
    db_base = dbeta + i_part * BTH
    NTL = NT
    if TAIL:
        NTL = NT - 1
    if i_c == NTL:  # only with TAIL: the grid has NT programs along axis 0, the last one for the single token
        _tail_bwd(q, k, p, v, g, beta, do, h_base, dq_base, dk_base, dp_base, dv, dg_base, db_base, scale, i_b, i_h,
                  DIR, NTL, o_k, o_v, T, H, K, V, BT, ACC)
    else:
        row, m_t, m_tk, m_tv = _chunk_rows(i_b, i_h, DIR, i_c, o_k, o_v, T, H, K, V, BT)
        r_q, r_k, r_p, r_v, r_g, r_beta, r_do, b_h, b_inv_in = _load_bwd_raw(
            q, k, p, v, g, beta, do, h_base, inv_base, i_b, i_h, DIR, i_c, o_k, o_v, T, H, K, V, BT, LOAD_INV)
        b_dh = tl.load(dh_base + i_c * K * V + o_k[:, None] * V + o_v[None, :],
                       mask=(o_k[:, None] < K) & (o_v[None, :] < V), other=0)
        _chunk_bwd(r_q, r_k, r_p, r_v, r_g, r_beta, r_do, b_h, b_dh, b_inv_in, dq_base, dk_base, dp_base, dv,
                   dg_base, db_base, scale, row, m_t, m_tk, m_tv, o_k, o_v, q.dtype.element_ty, ACC, K, V, BT,
                   LOG2_BT, PREC, INV_PREC, LP_DOT, LOAD_INV)


def _next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


#: Launch choices forced for tuning sweeps (keys of :func:`_launch_config`'s result); empty in normal use.
CONFIG_OVERRIDES: dict = {}


def _launch_config(K: int, V: int, T: int, BH: int, ND: int, backward: bool) -> dict:
    BK = max(16, _next_pow2(K))
    BV = max(16, _next_pow2(V))
    # 16-token chunks everywhere: for 64- and 128-wide heads too, 32-token ones made the one-pass backward spill
    # registers (H200, 2026-11-22: fwd+bwd 0.65x / 0.62x with 16 at B64 T1024 D64 / B256 T197 H6 D64; with the split
    # backward 32 is 0.90x at the first and 1.09x at B4 T2048 D128: kernels-comba-sweep-nvidia-h200-2026-11-22.log)
    BT = 16
    # Few (batch, head) sequences: split the value dimension to put more programs on the GPU.
    while BV > 32 and (BH * ND * cdiv(V, BV) < 128 or BK * BV > 64 * 64):
        BV //= 2
    # Measured on an H200 (benchmarks/results, comba): one warp per 16×16 state block, four from 32×32 up, the
    # split backward's chunk-parallel kernel included (at eight it does not spill but fits one program per SM).
    area = BK * BV
    num_warps = 1 if area <= 256 else 2 if area < 1024 else 4
    cfg = {"BT": BT, "BK": BK, "BV": BV, "num_warps": num_warps,
           # Enough programs already: run both directions in one program (no partial buffers to reduce).
           "dir_loop": ND == 2 and BH * cdiv(V, BV) >= 1024,
           # Inverse products: 3-pass TF32 on tensor cores for 16-bit inputs, exact FMAs for fp32 inputs.
           "inv_prec": "tf32x3",
           # The forward keeps each chunk's inverse for the backward (BT² fp32 per chunk, next to h0).
           "store_inv": True,
           # q·kᵀ and p·kᵀ on 16-bit tensor cores straight from the inputs (exact products).
           "lp_dot": True,
           # W, U0 from a chunk-parallel kernel first (the state walk then skips the inverse); for few, long
           # sequences, where the walk is latency-bound and repeats the K-side work per value block.
           "pre_wy": BH * ND * cdiv(V, BV) < 1024 and T > 4 * BT,
           # Load chunk i+1 while chunk i is computed: for 64-wide and larger heads (fwd+bwd 0.96-0.97x at the
           # sweep's three such shapes); for small heads timed as a candidate where the launch is tuned.
           "prefetch": max(BK, BV) >= 64,
           "token_tail": True,
           # Backward in two parts for 64-wide and larger states: the state gradient's walk over the chunks
           # (stored per chunk), then every chunk's gradients in parallel. The one-pass backward holds too much at
           # once there and spills (H200 sweep, 2026-11-22: it takes 1.08x / 1.42x the split's fwd+bwd time at
           # B64 T1024 D64 / B4 T2048 D128, 0.98x at B256 T197 H6 D64); for 16-wide heads the split is 1.3-1.5x
           # slower.
           "split_bwd": max(BK, BV) >= 64,
           "dh_num_warps": num_warps}
    cfg.update({key: val for key, val in CONFIG_OVERRIDES.items()
                if not (backward and key == "BT") and key != "bwd_num_warps"})
    if backward and "bwd_num_warps" in CONFIG_OVERRIDES:
        cfg["num_warps"] = CONFIG_OVERRIDES["bwd_num_warps"]
    cfg["NV"] = cdiv(V, cfg["BV"])
    return cfg


def _precision_args(cfg: dict, dtype: torch.dtype, device_type: str) -> dict:
    """PREC, INV_PREC, LP_DOT (in the kernels' argument order)."""
    low = dtype in (torch.float16, torch.bfloat16)
    # fp32 inputs get exact fp32 products; fp16/bf16 inputs use TF32 tensor cores (well inside their tolerance).
    # Triton's interpreter multiplies 16-bit dots wrongly, so LP_DOT is a GPU-only path (covered by cuda tests).
    return {"PREC": "tf32" if low else "ieee", "INV_PREC": cfg["inv_prec"] if low else "ieee",
            "LP_DOT": bool(cfg["lp_dot"] and low and device_type == "cuda")}


def _launch_options(cfg: dict) -> dict:
    options = {"num_warps": cfg["num_warps"]}
    if cfg.get("maxnreg"):
        options["maxnreg"] = cfg["maxnreg"]
    return options


def _tail(T: int, BT: int, cfg: dict) -> bool:
    """A last chunk of one token runs as a rank-1 step (T = 49 = 3·16 + 1 would otherwise pay a fourth chunk)."""
    return bool(cfg["token_tail"]) and T % BT == 1


def _directions(cfg: dict, ND: int) -> tuple[int, int]:
    """(programs along grid axis 2, directions each program runs)."""
    return (1, ND) if cfg["dir_loop"] else (ND, 1)


# Measured choice among a few launch layouts, per problem, for the large small-head workloads where the heuristic
# could be off by a lot (vision shapes). Filled on first use; ``TUNING_LOG`` keeps the timings for the benchmark.
_TUNED: dict = {}
TUNING_LOG: dict = {}


def _candidates(cfg: dict, K: int, V: int, BH: int, device: torch.device, backward: bool) -> list[dict]:
    if device.type != "cuda" or max(K, V) > 32 or BH < 512 or CONFIG_OVERRIDES:
        return [cfg]
    # The heuristic's layout, the next chunk prefetched, and register caps (more programs resident per SM against
    # some spills).
    return [cfg, {**cfg, "prefetch": True}] + [{**cfg, "maxnreg": cap} for cap in ((168, 128) if backward else (128,))]


def _choose(tune_key: tuple, cfgs: list[dict], build, run):
    """The launch plan for the first of ``cfgs`` (the heuristic's) or, with several, the fastest when timed once per
    ``tune_key``. Returns (plan, final); a plan that is not final (timing still due) must not be cached.

    Timing synchronizes the device and records timed events, which a CUDA graph capture forbids (the capture would
    be invalidated): under capture an untimed key gets the heuristic's layout and is timed on a later eager call."""
    if len(cfgs) == 1:
        return build(cfgs[0]), True
    cfg = _TUNED.get(tune_key)
    if cfg is not None:
        return build(cfg), True
    if torch.cuda.is_current_stream_capturing():
        return build(cfgs[0]), False
    plans = [build(c) for c in cfgs]
    timings = []
    for plan in plans:
        try:
            run(plan)
        except Exception:  # noqa: BLE001 - e.g. a launch option this Triton lacks: not a candidate then
            timings.append(float("inf"))
            continue
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(8):
            run(plan)
        end.record()
        torch.cuda.synchronize()
        timings.append(start.elapsed_time(end) / 8)
    best = min(range(len(cfgs)), key=timings.__getitem__)
    _TUNED[tune_key] = cfgs[best]
    TUNING_LOG[tune_key] = [({k: c.get(k) for k in ("num_warps", "prefetch", "maxnreg", "dir_loop")}, ms)
                            for c, ms in zip(cfgs, timings)]
    return plans[best], True


# ---------------------------------------------------------------------------------------------------------------
# Launch plans: everything a call does that depends only on the problem's shape, dtypes, device and flags (the
# layout choice, buffer shapes, grids, the kernels' scalar and constexpr arguments) is worked out once per such key
# and cached, so a call only allocates its outputs and launches (vision workloads are host-bound in eager mode).


class _FwdPlan:
    __slots__ = ("BT", "save_state", "save_inv", "o_shape", "o_dtype", "partial", "h0_shape", "inv_shape",
                 "w_shape", "u0_shape", "wy", "main", "dummy", "bwd", "key")


class _BwdPlan:
    __slots__ = ("NP", "grid_dirs", "main", "dh_walk", "chunk_passes", "cached")


def _fwd_cfgs(B, T, H, K, V, causal, device):
    ND = 1 if causal else 2
    base = _launch_config(K, V, T, B * H, ND, backward=False)
    return ND, _candidates(base, K, V, B * H, device, backward=False)


def _build_fwd(cfg: dict, B: int, T: int, H: int, K: int, V: int, ND: int, dtype: torch.dtype,
               v_dtype: torch.dtype, device: torch.device, save_state: bool) -> _FwdPlan:
    BT, BV = cfg["BT"], cfg["BV"]
    NT = cdiv(T, BT)
    grid_dirs, loop_dirs = _directions(cfg, ND)
    plan = _FwdPlan()
    plan.BT, plan.save_state, plan.bwd, plan.key = BT, save_state, None, None
    plan.save_inv = save_inv = save_state and cfg["store_inv"]
    # one program per direction pair: o directly; one per direction: an fp32 partial per direction, summed after
    plan.partial = grid_dirs > 1
    plan.o_shape = (grid_dirs, B, T, H, V) if plan.partial else (B, T, H, V)
    plan.o_dtype = torch.float32 if plan.partial else v_dtype
    plan.h0_shape = (ND, B * H, NT, K, V) if save_state else None
    plan.inv_shape = (ND, B * H, NT, BT, BT) if save_inv else None
    # one never-read fp32 word for the pointer arguments a launch does not use (no placeholder allocation per call)
    plan.dummy = torch.empty(1, device=device, dtype=torch.float32)
    precision = _precision_args(cfg, dtype, device.type)
    dims = (T, NT, B, H)
    if cfg["pre_wy"]:
        BVF = max(16, _next_pow2(V))
        plan.w_shape, plan.u0_shape = (ND, B * H, NT, BT, K), (ND, B * H, NT, BT, V)
        plan.wy = DirectLaunch(comba_wy_kernel, (NT, B * H, ND), dims,
                          {"K": K, "V": V, "BT": BT, "LOG2_BT": BT.bit_length() - 1, "BK": cfg["BK"], "BVF": BVF,
                           "SAVE_INV": save_inv, **precision},
                          {"num_warps": 4 if cfg["BK"] * BVF >= 64 * 64 else 2})
    else:
        plan.w_shape = plan.u0_shape = plan.wy = None
    plan.main = DirectLaunch(comba_fwd_kernel, (cfg["NV"], B * H, grid_dirs), dims,
                        {"K": K, "V": V, "BT": BT, "LOG2_BT": BT.bit_length() - 1, "BK": cfg["BK"], "BV": BV,
                         "SAVE_H": save_state, "SAVE_INV": save_inv, "DIR_LOOP": cfg["dir_loop"], "N_DIR": loop_dirs,
                         **precision, "LOAD_WY": cfg["pre_wy"], "PREFETCH": cfg["prefetch"],
                         "TAIL": _tail(T, BT, cfg)},
                        _launch_options(cfg))
    return plan


def _run_fwd(plan: _FwdPlan, q, k, v, p, g, beta, scale: float):
    device = q.device
    aligned = aligned16(q, k, v, p, g, beta)
    # empty_like (the cheapest allocation) where no NaN poisoning is asked for; o has v's shape and dtype then
    o = empty_output_like(v) if not plan.partial else empty_output(plan.o_shape, device=device, dtype=plan.o_dtype)
    dummy = plan.dummy
    h0 = dummy if plan.h0_shape is None else empty_output(plan.h0_shape, device=device, dtype=torch.float32)
    inv = dummy if plan.inv_shape is None else empty_output(plan.inv_shape, device=device, dtype=torch.float32)
    if plan.wy is None:
        w = u0 = dummy
    else:
        w = empty_output(plan.w_shape, device=device, dtype=torch.float32)
        u0 = empty_output(plan.u0_shape, device=device, dtype=torch.float32)
        plan.wy(aligned, k, v, p, g, beta, w, u0, inv)
    plan.main(aligned, q, k, v, p, g, beta, o, h0, inv, w, u0, scale)
    if plan.partial:
        o = o.sum(0).to(v.dtype)
    return o, (h0 if plan.save_state else None), (inv if plan.save_inv else None)


_FWD_PLANS: dict = {}
_BWD_PLANS: dict = {}


def _fwd_plan(q, k, v, p, g, beta, scale: float, causal: bool, save_state: bool) -> _FwdPlan:
    key = (q.shape, v.shape[3], q.dtype, g.dtype, beta.dtype, q.device, causal, save_state)
    plan = _FWD_PLANS.get(key)
    if plan is not None and not CONFIG_OVERRIDES:
        return plan
    B, T, H, K = q.shape
    V = v.shape[3]
    ND, cfgs = _fwd_cfgs(B, T, H, K, V, causal, q.device)
    plan, final = _choose(
        ("fwd", K, V, T, B * H, ND, q.dtype, save_state), cfgs,
        lambda cfg: _build_fwd(cfg, B, T, H, K, V, ND, q.dtype, v.dtype, q.device, save_state),
        lambda pl: _run_fwd(pl, q, k, v, p, g, beta, scale))
    if final and not CONFIG_OVERRIDES:
        plan.key = key
        _FWD_PLANS[key] = plan
    return plan


def _build_bwd(cfg: dict, B: int, T: int, H: int, K: int, V: int, ND: int, BT: int, dtype: torch.dtype,
               device: torch.device, has_inv: bool) -> _BwdPlan:
    BV, NV = cfg["BV"], cfg["NV"]
    grid_dirs, loop_dirs = _directions(cfg, ND)
    plan = _BwdPlan()
    plan.cached = False
    NT = cdiv(T, BT)
    common = {"K": K, "V": V, "BT": BT, "LOG2_BT": BT.bit_length() - 1, "BK": cfg["BK"], "BV": BV,
              **_precision_args(cfg, dtype, device.type), "LOAD_INV": has_inv, "TAIL": _tail(T, BT, cfg)}
    if cfg["split_bwd"]:
        # the state-gradient walk, then every chunk's gradients in parallel: one launch per direction, the reversed
        # one adding onto the first's gradients (no partials per direction)
        plan.NP, plan.grid_dirs, plan.main = NV, 1, None
        plan.dh_walk = DirectLaunch(comba_bwd_dh_kernel, (NV, B * H, ND), (T, NT, B, H), common,
                                    {"num_warps": cfg["dh_num_warps"]})
        plan.chunk_passes = tuple(
            DirectLaunch(comba_bwd_chunk_kernel, (NT, B * H, NV), (T, NT, B, H),
                         {**common, "DIR": direction, "ACC": direction > 0}, _launch_options(cfg))
            for direction in range(ND))
        return plan
    plan.dh_walk = plan.chunk_passes = None
    # partial gradients per value block and grid direction (usually one: the gradients themselves)
    plan.NP, plan.grid_dirs = grid_dirs * NV, grid_dirs
    plan.main = DirectLaunch(comba_bwd_kernel, (NV, B * H, grid_dirs), (T, cdiv(T, BT), B, H),
                        {"K": K, "V": V, "BT": BT, "LOG2_BT": BT.bit_length() - 1, "BK": cfg["BK"], "BV": BV,
                         "NV": NV, "DIR_LOOP": cfg["dir_loop"], "N_DIR": loop_dirs,
                         **_precision_args(cfg, dtype, device.type), "LOAD_INV": has_inv, "PREFETCH": cfg["prefetch"],
                         "TAIL": _tail(T, BT, cfg)},
                        _launch_options(cfg))
    return plan


def _partials(count: int, like: torch.Tensor) -> torch.Tensor:
    """The gradient of ``like`` (one partial: in its own dtype) or ``count`` fp32 partials, summed afterwards."""
    if count == 1:
        return empty_output(like.shape, device=like.device, dtype=like.dtype)
    return empty_output((count, *like.shape), device=like.device, dtype=torch.float32)


def _run_bwd(plan: _BwdPlan, q, k, v, p, g, beta, h0, inv, do, scale: float):
    aligned = aligned16(q, k, v, p, g, beta, do)
    NP, grid_dirs = plan.NP, plan.grid_dirs
    if NP == 1 and grid_dirs == 1:  # the usual case: each gradient shaped like its (contiguous) input
        dq, dk, dv, dp = empty_output_like(q), empty_output_like(k), empty_output_like(v), empty_output_like(p)
        dg, dbeta = empty_output_like(g), empty_output_like(beta)
    else:
        dq, dk, dp, dg, dbeta = (_partials(NP, t) for t in (q, k, p, g, beta))
        dv = _partials(grid_dirs, v)
    inv = h0 if inv is None else inv  # an unread pointer when the inverses are recomputed
    if plan.main is not None:
        plan.main(aligned, q, k, v, p, g, beta, h0, inv, do, dq, dk, dv, dp, dg, dbeta, scale)
    else:
        dh = empty_output(h0.shape, device=h0.device, dtype=torch.float32)
        plan.dh_walk(aligned, q, k, p, g, beta, inv, do, dh, scale)
        for launch in plan.chunk_passes:
            launch(aligned, q, k, v, p, g, beta, h0, inv, dh, do, dq, dk, dv, dp, dg, dbeta, scale)
    if NP > 1:
        dq, dk, dp = dq.sum(0).to(q.dtype), dk.sum(0).to(k.dtype), dp.sum(0).to(p.dtype)
        dg, dbeta = dg.sum(0).to(g.dtype), dbeta.sum(0).to(beta.dtype)
    if grid_dirs > 1:
        dv = dv.sum(0).to(v.dtype)
    return dq, dk, dv, dp, dg, dbeta


def _bwd_plan(q, k, v, p, g, beta, h0, inv, do, scale: float, causal: bool, BT: int) -> _BwdPlan:
    has_inv = inv is not None
    key = (q.shape, v.shape[3], q.dtype, g.dtype, beta.dtype, do.dtype, q.device, causal, BT, has_inv)
    plan = _BWD_PLANS.get(key)
    if plan is not None and not CONFIG_OVERRIDES:
        return plan
    B, T, H, K = q.shape
    V = v.shape[3]
    ND = 1 if causal else 2
    base = {**_launch_config(K, V, T, B * H, ND, backward=True), "BT": BT}
    plan, final = _choose(
        ("bwd", K, V, T, B * H, ND, q.dtype, BT, has_inv), _candidates(base, K, V, B * H, q.device, backward=True),
        lambda cfg: _build_bwd(cfg, B, T, H, K, V, ND, BT, q.dtype, q.device, has_inv),
        lambda pl: _run_bwd(pl, q, k, v, p, g, beta, h0, inv, do, scale))
    if final and not CONFIG_OVERRIDES:
        plan.cached = True
        _BWD_PLANS[key] = plan
    return plan


def comba_fwd(q, k, v, p, g, beta, scale: float, causal: bool, save_state: bool):
    """Returns (o, h0, inv, BT): h0 / inv (None unless ``save_state``) are what the backward reads back.
    Contiguous inputs expected."""
    plan = _fwd_plan(q, k, v, p, g, beta, scale, causal, save_state)
    return (*_run_fwd(plan, q, k, v, p, g, beta, scale), plan.BT)


def comba_bwd(q, k, v, p, g, beta, h0, inv, do, scale: float, causal: bool, BT: int):
    """``inv``: the per-chunk inverses stored by the forward, or None to recompute them. Contiguous inputs
    expected."""
    plan = _bwd_plan(q, k, v, p, g, beta, h0, inv, do, scale, causal, BT)
    return _run_bwd(plan, q, k, v, p, g, beta, h0, inv, do, scale)


class CombaFunction(torch.autograd.Function):
    # Not wrapped in input_guard / custom_fwd / custom_bwd: the inputs are made contiguous and the device set here
    # directly, and autocast has nothing to act on (no PyTorch op inside that it would cast), so the backward needs
    # no autocast context (entering one costs more host time than the rest of the backward's Python).
    @staticmethod
    def forward(ctx, q, k, v, p, g, beta, scale: float, causal: bool):
        q, k, v, p, g, beta = q.contiguous(), k.contiguous(), v.contiguous(), p.contiguous(), g.contiguous(), \
            beta.contiguous()
        save = any(ctx.needs_input_grad[:6])
        guard = device_guard(q)
        if guard is None:
            plan = _fwd_plan(q, k, v, p, g, beta, scale, causal, save)
            o, h0, inv = _run_fwd(plan, q, k, v, p, g, beta, scale)
        else:
            with guard:
                plan = _fwd_plan(q, k, v, p, g, beta, scale, causal, save)
                o, h0, inv = _run_fwd(plan, q, k, v, p, g, beta, scale)
        if save:
            ctx.save_for_backward(q, k, v, p, g, beta, h0, inv)
        ctx.scale, ctx.causal, ctx.plan = scale, causal, plan
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, p, g, beta, h0, inv = ctx.saved_tensors
        do = do.contiguous()
        guard = device_guard(do)
        if guard is None:
            return (*_backward(ctx, q, k, v, p, g, beta, h0, inv, do), None, None)
        with guard:
            return (*_backward(ctx, q, k, v, p, g, beta, h0, inv, do), None, None)


def _backward(ctx, q, k, v, p, g, beta, h0, inv, do):
    fwd = ctx.plan
    plan = fwd.bwd
    if plan is None or do.dtype != v.dtype or CONFIG_OVERRIDES:
        plan = _bwd_plan(q, k, v, p, g, beta, h0, inv, do, ctx.scale, ctx.causal, fwd.BT)
        if plan.cached and fwd.key is not None and do.dtype == v.dtype:
            fwd.bwd = plan  # the next backward of this forward plan skips the lookup
    return _run_bwd(plan, q, k, v, p, g, beta, h0, inv, do, ctx.scale)


# torch.compile runs the kernels as they are (a graph break), as for the other ops: the launch plans are host-side
# caches and the direct relaunch is not traceable.
@torch.compiler.disable
def fused_comba(q, k, v, p, g, beta, *, scale: float, causal: bool) -> torch.Tensor:
    """Triton Comba (validated arguments expected; see :func:`visionssm.kernels.comba`)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or p.requires_grad
                                    or g.requires_grad or beta.requires_grad):
        return CombaFunction.apply(q, k, v, p, g, beta, scale, causal)
    # nothing to differentiate: no autograd node, no saved state
    q, k, v, p, g, beta = q.contiguous(), k.contiguous(), v.contiguous(), p.contiguous(), g.contiguous(), \
        beta.contiguous()
    guard = device_guard(q)
    if guard is None:
        return _run_fwd(_fwd_plan(q, k, v, p, g, beta, scale, causal, False), q, k, v, p, g, beta, scale)[0]
    with guard:
        return _run_fwd(_fwd_plan(q, k, v, p, g, beta, scale, causal, False), q, k, v, p, g, beta, scale)[0]
