"""The prologue's backward kernels.

1. ``prologue_bwd_kernel`` (same grid as the forward): recomputes the forward from proj, takes the gradients of
   q, k, v, p, g, beta, alpha back through the feedback/correction, the L2 norms and the SiLU to the convolution's
   output (``dconv``, (B, L, 2HK + HV)), writes the gate-logit columns of proj's gradient, and stores per-program
   partial sums of the per-head parameters' gradients (``partials``, (programs, SLOTS, H), summed on the host).
2. ``conv_bwd_kernel``, one program per (token block, batch element, BC channels): the transposed convolution of
   ``dconv`` into proj's gradient (q, k, v columns) and the weight gradient's partial sums per program row.

Two kernels because a token's input gradient needs its neighbours' ``dconv``, which depends on their whole heads.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel_common import _head_param, _program_tile, _short_conv, _sigmoid, _silu_grad, _silu_l2, _softplus

# Rows of the per-head partial sums: the parameters' gradients, in this order (host-side names; the kernels read
# the constexpr copies below).
PARAM_SLOTS = {"feedback": 0, "correction": 1, "A_log": 2, "dt_bias": 3, "beta_bias": 4, "alpha_bias": 5}
SLOTS = len(PARAM_SLOTS)
SLOT_FEEDBACK, SLOT_CORRECTION, SLOT_A_LOG, SLOT_DT_BIAS, SLOT_BETA_BIAS, SLOT_ALPHA_BIAS = (
    tl.constexpr(PARAM_SLOTS[name]) for name in ("feedback", "correction", "A_log", "dt_bias", "beta_bias",
                                                 "alpha_bias"))
N_SLOTS = tl.constexpr(SLOTS)


#: The arguments each kernel stores to (some only under a constexpr flag): all that torch.compile's analysis of a
#: launch may take as written (tools/inductor_check.py, tests/kernels/test_inductor_writes.py).
WRITES = {"conv_bwd_kernel": {"dproj", "dw_partial"}, "prologue_bwd_kernel": {"dconv", "dproj", "partials"}}


@triton.jit
def _silu_l2_grad(c, s, y_hat, r, dy_hat):
    """Gradient at c of ŷ (see :func:`_silu_l2`), given the gradient ``dy_hat`` of ŷ."""
    dy = r[:, :, None] * (dy_hat - y_hat * tl.sum(dy_hat * y_hat, axis=2)[:, :, None])
    return _silu_grad(c, dy, s)


@triton.jit
def _store_partial(partials, row, slot, h1, value, H: tl.constexpr, SLOTS_: tl.constexpr):
    tl.store(partials + (row * SLOTS_ + slot) * H + h1, value, mask=h1 < H)


@triton.jit
def _sigmoid_gate_grad(tok, dtok, col, bias, grad, out2, h2, mask_h, mask2, HAS_BIAS: tl.constexpr):
    """Writes d(logit) = dgate · σ'(logit + bias) into proj's gradient; returns its sum over the tile's tokens."""
    z = tl.load(tok + col + h2, mask=mask2, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += _head_param(bias, h2, mask_h, 0.0)
    s = _sigmoid(z)
    dz = tl.load(grad + out2, mask=mask2, other=0.0).to(tl.float32) * s * (1.0 - s)
    tl.store(dtok + col + h2, dz, mask=mask2)
    return tl.sum(dz, axis=0)


@triton.jit
def prologue_bwd_kernel(
    proj, conv_w, beta_bias, alpha_bias, A_log, dt_bias, feedback, correction,
    dq, dk, dv, dp, dg, dbeta, dalpha,
    dconv, dproj, partials,
    L, stride_b_units, stride_t_units, beta_col, alpha_col, decay_col, dstride_b_units, dstride_t_units,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KS: tl.constexpr, LEFT: tl.constexpr,
    BT: tl.constexpr, HB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_BETA_BIAS: tl.constexpr, HAS_ALPHA: tl.constexpr, HAS_ALPHA_BIAS: tl.constexpr, HAS_DECAY: tl.constexpr,
    FEEDBACK: tl.constexpr, IPLR: tl.constexpr, EPS: tl.constexpr, ROW_ALIGN: tl.constexpr,
):
    # the strides' factor ROW_ALIGN known to the compiler (see row_alignment() in launch.py)
    stride_b, stride_t = stride_b_units * ROW_ALIGN, stride_t_units * ROW_ALIGN
    dstride_b, dstride_t = dstride_b_units * ROW_ALIGN, dstride_t_units * ROW_ALIGN
    pid_t, pid_b, h1, t2, h2, mask_h, mask2, t3, h3, dk_, dv_, mask_k, mask_v, start = _program_tile(
        L, stride_b, H, K, V, BT, HB, BK, BV)
    row0 = proj + start
    tok = row0 + t2 * stride_t
    drow0 = dproj + tl.cast(pid_b, tl.int64) * dstride_b
    dtok = drow0 + t2 * dstride_t
    out2 = (tl.cast(pid_b, tl.int64) * L + t2) * H + h2
    out_k = out2[:, :, None] * K + dk_
    C = 2 * H * K + H * V
    conv_row = (tl.cast(pid_b, tl.int64) * L + t3) * C  # [BT, 1, 1] start of each token's row of dconv
    prow = pid_t + pid_b * tl.num_programs(0)  # this program's row of the partial sums

    d_q = tl.load(dq + out_k, mask=mask_k, other=0.0).to(tl.float32)
    d_k = tl.load(dk + out_k, mask=mask_k, other=0.0).to(tl.float32)
    if HAS_DECAY:
        z = tl.load(tok + decay_col + h2, mask=mask2, other=0.0).to(tl.float32) + _head_param(dt_bias, h2, mask_h, 0.0)
        A = tl.exp(_head_param(A_log, h2, mask_h, 0.0))
        g = -A * _softplus(z)
        d_g = tl.load(dg + out2, mask=mask2, other=0.0).to(tl.float32)
    col_k = H * K + h3 * K + dk_
    ck = _short_conv(row0, conv_w, t3, col_k, mask_k, L, stride_t, KS, LEFT)
    sk, k_hat, rk = _silu_l2(ck, EPS)
    if FEEDBACK:
        b = _sigmoid(_head_param(feedback, h2, mask_h, 0.0))
        d = _head_param(correction, h2, mask_h, 0.0)
        d_p = tl.load(dp + out_k, mask=mask_k, other=0.0).to(tl.float32)
        pk = tl.sum(d_p * k_hat, axis=2)
        qk = tl.sum(d_q * k_hat, axis=2)
        if IPLR:
            gain = 2.0 * tl.exp(g)  # p = gain · b · k̂
            d_g += gain * b * pk
        else:
            gain = tl.full([1, HB], 1.0, tl.float32)
        d_k += (gain * b)[:, :, None] * d_p - (d * b)[:, :, None] * d_q
        d_b = gain * pk - d * qk
        _store_partial(partials, prow, SLOT_FEEDBACK, h1, tl.sum(d_b * (b * (1.0 - b)), axis=0), H, N_SLOTS)
        _store_partial(partials, prow, SLOT_CORRECTION, h1, tl.sum(-b * qk, axis=0), H, N_SLOTS)
    if HAS_DECAY:
        dz = d_g * (-A * _sigmoid(z))
        tl.store(dtok + decay_col + h2, dz, mask=mask2)
        _store_partial(partials, prow, SLOT_A_LOG, h1, tl.sum(d_g * g, axis=0), H, N_SLOTS)
        _store_partial(partials, prow, SLOT_DT_BIAS, h1, tl.sum(dz, axis=0), H, N_SLOTS)
    d_bias = _sigmoid_gate_grad(tok, dtok, beta_col, beta_bias, dbeta, out2, h2, mask_h, mask2, HAS_BETA_BIAS)
    if HAS_BETA_BIAS:
        _store_partial(partials, prow, SLOT_BETA_BIAS, h1, d_bias, H, N_SLOTS)
    if HAS_ALPHA:
        d_bias = _sigmoid_gate_grad(tok, dtok, alpha_col, alpha_bias, dalpha, out2, h2, mask_h, mask2, HAS_ALPHA_BIAS)
        if HAS_ALPHA_BIAS:
            _store_partial(partials, prow, SLOT_ALPHA_BIAS, h1, d_bias, H, N_SLOTS)

    tl.store(dconv + conv_row + col_k, _silu_l2_grad(ck, sk, k_hat, rk, d_k), mask=mask_k)
    col_q = h3 * K + dk_
    cq = _short_conv(row0, conv_w, t3, col_q, mask_k, L, stride_t, KS, LEFT)
    sq, q_hat, rq = _silu_l2(cq, EPS)
    tl.store(dconv + conv_row + col_q, _silu_l2_grad(cq, sq, q_hat, rq, d_q), mask=mask_k)
    col_v = 2 * H * K + h3 * V + dv_
    cv = _short_conv(row0, conv_w, t3, col_v, mask_v, L, stride_t, KS, LEFT)
    d_v = tl.load(dv + out2[:, :, None] * V + dv_, mask=mask_v, other=0.0).to(tl.float32)
    tl.store(dconv + conv_row + col_v, _silu_grad(cv, d_v, _sigmoid(cv)), mask=mask_v)


@triton.jit
def conv_bwd_kernel(
    dconv, proj, conv_w, dproj, dw_partial,
    L, stride_b_units, stride_t_units, dstride_b_units, dstride_t_units,
    C: tl.constexpr, KS: tl.constexpr, LEFT: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BKS: tl.constexpr, ROW_ALIGN: tl.constexpr,
):
    """dx[s, c] = Σ_j w[c, j] · dconv[s + LEFT − j, c];  dw[c, j] = Σ_t dconv[t, c] · x[t + j − LEFT, c].

    One program per (BT tokens, batch element, BC channels), all independent: the shifted reads of ``dconv`` and
    ``x`` overlap their neighbours' and come from cache. Its weight-gradient partial sum goes to row
    (batch element, token block) of ``dw_partial``."""
    # the strides' factor ROW_ALIGN known to the compiler (see row_alignment() in launch.py)
    stride_b, stride_t = stride_b_units * ROW_ALIGN, stride_t_units * ROW_ALIGN
    dstride_b, dstride_t = dstride_b_units * ROW_ALIGN, dstride_t_units * ROW_ALIGN
    pid_t, pid_b, pid_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c2 = (pid_c * BC + tl.arange(0, BC))[None, :]
    mask_c = c2 < C
    taps = tl.arange(0, BKS)[:, None]
    t = pid_t * BT + tl.arange(0, BT)[:, None]
    mask = (t < L) & mask_c
    dc_row0 = dconv + tl.cast(pid_b, tl.int64) * L * C
    x_row0 = proj + tl.cast(pid_b, tl.int64) * stride_b
    dc = tl.load(dc_row0 + t * C + c2, mask=mask, other=0.0).to(tl.float32)
    dx = tl.zeros([BT, BC], dtype=tl.float32)
    dw = tl.zeros([BKS, BC], dtype=tl.float32)
    for j in tl.static_range(KS):
        w = tl.load(conv_w + c2 * KS + j, mask=mask_c, other=0.0).to(tl.float32)
        ts = t + (LEFT - j)
        dx += w * tl.load(dc_row0 + ts * C + c2, mask=mask_c & (ts >= 0) & (ts < L), other=0.0).to(tl.float32)
        tx = t + (j - LEFT)
        x = tl.load(x_row0 + tx * stride_t + c2, mask=mask & (tx >= 0) & (tx < L), other=0.0).to(tl.float32)
        dw += tl.where(taps == j, tl.sum(dc * x, axis=0)[None, :], 0.0)
    tl.store(dproj + tl.cast(pid_b, tl.int64) * dstride_b + t * dstride_t + c2, dx, mask=mask)
    row = pid_b * tl.num_programs(0) + pid_t
    tl.store(dw_partial + (tl.cast(row, tl.int64) * KS + taps) * C + c2, dw, mask=(taps < KS) & mask_c)
