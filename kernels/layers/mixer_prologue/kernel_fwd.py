"""The prologue's forward kernel: one program per (BT tokens, batch element, HB heads).

It reads q, k, v and the gate logits straight from the input projection's output (row stride ``stride_t``, passed
in units of ``ROW_ALIGN`` elements; the convolution's neighbouring tokens are re-read from cache), and writes the
mixer kernel's inputs, contiguous: q, k, v, p as (B, L, H, ·) in the output dtype, g / beta / alpha as (B, L, H)
float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel_common import _head_param, _program_tile, _short_conv, _sigmoid, _silu_l2, _softplus

#: The arguments each kernel stores to (some only under a constexpr flag): all that torch.compile's analysis of a
#: launch may take as written (tools/inductor_check.py, tests/kernels/test_inductor_writes.py).
WRITES = {"prologue_fwd_kernel": {"alpha_out", "beta_out", "g_out", "k_out", "p_out", "q_out", "v_out"}}


@triton.jit
def prologue_fwd_kernel(
    proj, conv_w, beta_bias, alpha_bias, A_log, dt_bias, feedback, correction,
    q_out, k_out, v_out, p_out, g_out, beta_out, alpha_out,
    L, stride_b_units, stride_t_units, beta_col, alpha_col, decay_col,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KS: tl.constexpr, LEFT: tl.constexpr,
    BT: tl.constexpr, HB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_BETA_BIAS: tl.constexpr, HAS_ALPHA: tl.constexpr, HAS_ALPHA_BIAS: tl.constexpr, HAS_DECAY: tl.constexpr,
    FEEDBACK: tl.constexpr, IPLR: tl.constexpr, EPS: tl.constexpr, ROW_ALIGN: tl.constexpr,
):
    # the strides' factor ROW_ALIGN known to the compiler (see row_alignment() in launch.py)
    stride_b, stride_t = stride_b_units * ROW_ALIGN, stride_t_units * ROW_ALIGN
    _, pid_b, _, t2, h2, mask_h, mask2, t3, h3, dk, dv, mask_k, mask_v, start = _program_tile(
        L, stride_b, H, K, V, BT, HB, BK, BV)
    row0 = proj + start
    tok = row0 + t2 * stride_t
    out2 = (tl.cast(pid_b, tl.int64) * L + t2) * H + h2  # [BT, HB] index into (B, L, H)

    if HAS_DECAY:
        z = tl.load(tok + decay_col + h2, mask=mask2, other=0.0).to(tl.float32) + _head_param(dt_bias, h2, mask_h, 0.0)
        g = -tl.exp(_head_param(A_log, h2, mask_h, 0.0)) * _softplus(z)
        tl.store(g_out + out2, g, mask=mask2)
    zb = tl.load(tok + beta_col + h2, mask=mask2, other=0.0).to(tl.float32)
    if HAS_BETA_BIAS:
        zb += _head_param(beta_bias, h2, mask_h, 0.0)
    tl.store(beta_out + out2, _sigmoid(zb), mask=mask2)
    if HAS_ALPHA:
        za = tl.load(tok + alpha_col + h2, mask=mask2, other=0.0).to(tl.float32)
        if HAS_ALPHA_BIAS:
            za += _head_param(alpha_bias, h2, mask_h, 0.0)
        tl.store(alpha_out + out2, _sigmoid(za), mask=mask2)

    out_k = out2[:, :, None] * K + dk
    ck = _short_conv(row0, conv_w, t3, H * K + h3 * K + dk, mask_k, L, stride_t, KS, LEFT)
    _, k_hat, _ = _silu_l2(ck, EPS)
    tl.store(k_out + out_k, k_hat, mask=mask_k)
    cq = _short_conv(row0, conv_w, t3, h3 * K + dk, mask_k, L, stride_t, KS, LEFT)
    _, q_hat, _ = _silu_l2(cq, EPS)
    if FEEDBACK:
        b = _sigmoid(_head_param(feedback, h2, mask_h, 0.0))
        d = _head_param(correction, h2, mask_h, 0.0)
        q_hat -= (d * b)[:, :, None] * k_hat
        if IPLR:
            s = 2.0 * b * tl.exp(g)
        else:
            s = b
        tl.store(p_out + out_k, s[:, :, None] * k_hat, mask=mask_k)
    tl.store(q_out + out_k, q_hat, mask=mask_k)

    cv = _short_conv(row0, conv_w, t3, 2 * H * K + h3 * V + dv, mask_v, L, stride_t, KS, LEFT)
    tl.store(v_out + out2[:, :, None] * V + dv, cv * _sigmoid(cv), mask=mask_v)
