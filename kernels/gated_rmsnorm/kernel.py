"""Triton kernels of the gated per-head RMSNorm: one program per (BR rows of B·L, HB heads), tiles [BR, HB, BD].

The gate is addressed as ``gate + b·gstride_b + t·gstride_t + h·D + d`` (row = b·L + t), so a column slice of a
larger tensor is read in place; o, y, do and dgate are contiguous.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile(pid_r, pid_h, R, L, gstride_b, gstride_t, H: tl.constexpr, D: tl.constexpr, BR: tl.constexpr,
          HB: tl.constexpr, BD: tl.constexpr):
    """(offsets into o/y, offsets into gate, mask) of this program's [BR, HB, BD] tile."""
    r2 = (pid_r * BR + tl.arange(0, BR))[:, None]
    h2 = (pid_h * HB + tl.arange(0, HB))[None, :]
    d3 = tl.arange(0, BD)[None, None, :]
    mask = ((r2 < R) & (h2 < H))[:, :, None] & (d3 < D)
    off = (r2.to(tl.int64) * H + h2)[:, :, None] * D + d3
    rows = r2.to(tl.int64)
    goff = (rows // L * gstride_b + rows % L * gstride_t)[:, :, None] + h2[:, :, None] * D + d3
    return off, goff, mask


@triton.jit
def _gate_act(gate, goff, mask, SILU: tl.constexpr):
    """(activation(gate), its derivative)."""
    z = tl.load(gate + goff, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-z))
    if SILU:
        return z * s, s * (1.0 + z * (1.0 - s))
    return s, s * (1.0 - s)


@triton.jit
def gated_rmsnorm_fwd_kernel(
    o, gate, weight, y,
    R, L, gstride_b, gstride_t,
    H: tl.constexpr, D: tl.constexpr, BR: tl.constexpr, HB: tl.constexpr, BD: tl.constexpr,
    HAS_GATE: tl.constexpr, SILU: tl.constexpr, EPS: tl.constexpr,
):
    off, goff, mask = _tile(tl.program_id(0), tl.program_id(1), R, L, gstride_b, gstride_t, H, D, BR, HB, BD)
    x = tl.load(o + off, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=2) / D + EPS)
    d3 = tl.arange(0, BD)[None, None, :]
    w = tl.load(weight + d3, mask=d3 < D, other=0.0).to(tl.float32)
    out = x * rstd[:, :, None] * w
    if HAS_GATE:
        act, _ = _gate_act(gate, goff, mask, SILU)
        out *= act
    tl.store(y + off, out, mask=mask)


@triton.jit
def gated_rmsnorm_bwd_kernel(
    o, gate, weight, dy, do, dgate, dw_partial,
    R, L, gstride_b, gstride_t,
    H: tl.constexpr, D: tl.constexpr, BR: tl.constexpr, HB: tl.constexpr, BD: tl.constexpr,
    HAS_GATE: tl.constexpr, SILU: tl.constexpr, EPS: tl.constexpr,
):
    pid_r, pid_h = tl.program_id(0), tl.program_id(1)
    off, goff, mask = _tile(pid_r, pid_h, R, L, gstride_b, gstride_t, H, D, BR, HB, BD)
    x = tl.load(o + off, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=2) / D + EPS)[:, :, None]
    n = x * rstd
    d3 = tl.arange(0, BD)[None, None, :]
    w = tl.load(weight + d3, mask=d3 < D, other=0.0).to(tl.float32)
    g = tl.load(dy + off, mask=mask, other=0.0).to(tl.float32)
    if HAS_GATE:
        act, act_grad = _gate_act(gate, goff, mask, SILU)
        tl.store(dgate + off, g * n * w * act_grad, mask=mask)
        g *= act
    # g is now the gradient of n · w
    dn = g * w
    tl.store(do + off, rstd * (dn - n * (tl.sum(dn * n, axis=2) / D)[:, :, None]), mask=mask)
    dw = tl.sum(tl.sum(g * n, axis=0), axis=0)
    d1 = tl.arange(0, BD)
    tl.store(dw_partial + (pid_r * tl.num_programs(1) + pid_h) * D + d1, dw, mask=d1 < D)
