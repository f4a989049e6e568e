"""Triton kernels of the gated per-head RMSNorm: one program per (BR rows of B·L, HB heads), tiles [BR, HB, BD].

The gate is addressed as ``gate + b·gstride_b + t·gstride_t + h·D + d`` (row = b·L + t), so a column slice of a
larger tensor is read in place; o, y, do and dgate are contiguous.

The low-rank kernels (``*_lowrank_*``) take the gate before its up-projection, (B·L, RANK) read in place the same
way from ``gate + goffset`` (a column slice of an aligned tensor is passed as that tensor and its offset, so the
pointer stays 16-byte aligned), and build the gate of a [BR, HB, BD] tile as ``tl.dot(gate_low [BR, RP],
Wᵀ [RP, HB·BD]) + bias`` in float32. The weight's and bias's gradients are sums over all rows: the backward's
programs walk the row tiles with a stride of the grid size and keep their sums in registers, one float32 partial per
program, summed after the launch. The gradient of a gate_low row sums over every head: when one backward program
holds all of them (the launch plan's choice where its registers allow) it is written once, otherwise each head
group writes its float32 share, summed after.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: The arguments each kernel stores to (some only under a constexpr flag): all that torch.compile's analysis of a
#: launch may take as written (tools/inductor_check.py, tests/kernels/test_inductor_writes.py).
WRITES = {"gated_rmsnorm_bwd_kernel": {"dgate", "do", "dw_partial"}, "gated_rmsnorm_fwd_kernel": {"y"},
          "gated_rmsnorm_lowrank_bwd_kernel": {"dgate_partial", "dgb_partial", "dgw_partial", "do", "dw_partial"},
          "gated_rmsnorm_lowrank_fwd_kernel": {"y"}}


@triton.jit
def _tile(pid_r, pid_h, R, L, gstride_b, gstride_t, H: tl.constexpr, D: tl.constexpr, BR: tl.constexpr,
          HB: tl.constexpr, BD: tl.constexpr):
    """(offsets into o/y, offsets into gate, mask) of this program's [BR, HB, BD] tile."""
    r2 = (pid_r * BR + tl.arange(0, BR))[:, None]
    h2 = (pid_h * HB + tl.arange(0, HB))[None, :]
    d3 = tl.arange(0, BD)[None, None, :]
    mask = ((r2 < R) & (h2 < H))[:, :, None] & (d3 < D)
    off = (tl.cast(r2, tl.int64) * H + h2)[:, :, None] * D + d3
    rows = tl.cast(r2, tl.int64)
    goff = (rows // L * gstride_b + rows % L * gstride_t)[:, :, None] + h2[:, :, None] * D + d3
    return off, goff, mask


@triton.jit
def _normalized(o, off, mask, D: tl.constexpr, EPS: tl.constexpr):
    """(n, 1/RMS) of the tile's heads in float32: n = x / RMS(x) over each head's D channels, 1/RMS as [BR, HB, 1]."""
    x = tl.load(o + off, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=2) / D + EPS)[:, :, None]
    return x * rstd, rstd


@triton.jit
def _norm_weight(weight, D: tl.constexpr, BD: tl.constexpr):
    """The per-channel weight (shared by the heads) as a float32 [1, 1, BD] tile, zero in the padding."""
    d3 = tl.arange(0, BD)[None, None, :]
    return tl.load(weight + d3, mask=d3 < D, other=0.0).to(tl.float32)


@triton.jit
def _norm_input_grad(g, n, rstd, w, D: tl.constexpr):
    """The gradient of x for the gradient ``g`` of n·w (n = x / RMS(x) per head)."""
    dn = g * w
    return rstd * (dn - n * (tl.sum(dn * n, axis=2) / D)[:, :, None])


@triton.jit
def _gate_act(gate, goff, mask, SILU: tl.constexpr):
    """(activation(gate), its derivative)."""
    return _act(tl.load(gate + goff, mask=mask, other=0.0).to(tl.float32), SILU)


@triton.jit
def _act(z, SILU: tl.constexpr):
    """(activation(z), its derivative) of float32 z."""
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
    n, _ = _normalized(o, off, mask, D, EPS)
    out = n * _norm_weight(weight, D, BD)
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
    n, rstd = _normalized(o, off, mask, D, EPS)
    w = _norm_weight(weight, D, BD)
    g = tl.load(dy + off, mask=mask, other=0.0).to(tl.float32)
    if HAS_GATE:
        act, act_grad = _gate_act(gate, goff, mask, SILU)
        tl.store(dgate + off, g * n * w * act_grad, mask=mask)
        g *= act
    # g is now the gradient of n · w
    tl.store(do + off, _norm_input_grad(g, n, rstd, w, D), mask=mask)
    dw = tl.sum(tl.sum(g * n, axis=0), axis=0)
    d1 = tl.arange(0, BD)
    tl.store(dw_partial + (pid_r * tl.num_programs(1) + pid_h) * D + d1, dw, mask=d1 < D)


# ---------------------------------------------------------------------------------------------------------------
# Low-rank gate: gate = gate_low @ gate_weightᵀ + gate_bias, computed per tile


@triton.jit
def _columns(pid_h, H: tl.constexpr, D: tl.constexpr, HB: tl.constexpr, BD: tl.constexpr):
    """Column ``h·D + d`` of the gate for each flat column ``(h − pid_h·HB)·BD + d`` of a [rows, HB·BD] tile of the
    heads pid_h·HB …, and whether it is a real one (h < H, d < D)."""
    c = tl.arange(0, HB * BD)
    h = pid_h * HB + c // BD
    d = c % BD
    return h * D + d, (h < H) & (d < D)


@triton.jit
def _load_gate_low(gate, tile, NR, L, gstride_b, gstride_t, BR: tl.constexpr, RANK: tl.constexpr,
                   RP: tl.constexpr):
    """The [BR, RP] float32 tile of gate_low (zero beyond the rows and the rank). Its row indices are the caller's
    to compute: torch's mutation analysis of a ``wrap_triton`` launch counts every pointer argument of a helper
    whose result addresses a store as written."""
    rows = tile * BR + tl.arange(0, BR)
    rows64 = tl.cast(rows, tl.int64)
    r1 = tl.arange(0, RP)
    goff = (rows64 // L * gstride_b + rows64 % L * gstride_t)[:, None] + r1[None, :]
    gmask = (rows < NR)[:, None] & (r1 < RANK)[None, :]
    return tl.load(gate + goff, mask=gmask, other=0.0).to(tl.float32)


@triton.jit
def _load_up_weight(gate_weight, pid_h, H: tl.constexpr, D: tl.constexpr, HB: tl.constexpr, BD: tl.constexpr,
                    RANK: tl.constexpr, RP: tl.constexpr):
    """The transposed rows of gate_weight for the heads pid_h·HB …, a float32 [RP, HB·BD] tile (zero-padded)."""
    n, valid = _columns(pid_h, H, D, HB, BD)
    r1 = tl.arange(0, RP)
    wmask = valid[None, :] & (r1 < RANK)[:, None]
    return tl.load(gate_weight + n[None, :] * RANK + r1[:, None], mask=wmask, other=0.0).to(tl.float32)


@triton.jit
def _up_project(gl, wt, gate_bias, pid_h, H: tl.constexpr, D: tl.constexpr, BR: tl.constexpr, HB: tl.constexpr,
                BD: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr):
    """The full gate [BR, HB, BD] of a tile: gl [BR, RP] @ wt [RP, HB·BD] (+ bias), float32."""
    z = tl.dot(gl, wt, input_precision=PREC)
    if HAS_BIAS:
        n, valid = _columns(pid_h, H, D, HB, BD)
        z += tl.load(gate_bias + n, mask=valid, other=0.0).to(tl.float32)[None, :]
    return tl.reshape(z, (BR, HB, BD))


@triton.jit
def gated_rmsnorm_lowrank_fwd_kernel(
    o, gate, gate_weight, gate_bias, weight, y,
    NR, L, gstride_b, gstride_t, goffset,
    H: tl.constexpr, D: tl.constexpr, BR: tl.constexpr, HB: tl.constexpr, BD: tl.constexpr, RANK: tl.constexpr,
    RP: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, EPS: tl.constexpr, PREC: tl.constexpr,
):
    pid, pid_h = tl.program_id(0), tl.program_id(1)
    off, _, mask = _tile(pid, pid_h, NR, L, 0, 0, H, D, BR, HB, BD)
    n, _ = _normalized(o, off, mask, D, EPS)
    w = _norm_weight(weight, D, BD)
    gl = _load_gate_low(gate + goffset, pid, NR, L, gstride_b, gstride_t, BR, RANK, RP)
    wt = _load_up_weight(gate_weight, pid_h, H, D, HB, BD, RANK, RP)
    act, _ = _act(_up_project(gl, wt, gate_bias, pid_h, H, D, BR, HB, BD, HAS_BIAS, PREC), SILU)
    tl.store(y + off, n * w * act, mask=mask)


@triton.jit
def gated_rmsnorm_lowrank_bwd_kernel(
    o, gate, gate_weight, gate_bias, weight, dy, do, dgate_partial, dw_partial, dgw_partial, dgb_partial,
    NR, L, gstride_b, gstride_t, goffset, num_tiles,
    H: tl.constexpr, D: tl.constexpr, BR: tl.constexpr, HB: tl.constexpr, BD: tl.constexpr, RANK: tl.constexpr,
    RP: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, EPS: tl.constexpr, PREC: tl.constexpr,
):
    """Programs (p, g) take the row tiles p, p + P, … (P = the grid's first size) of the heads g·HB …; the gradient of
    gate_low is this head group's share, ``dgate_partial[g]`` (the gate's own gradient when there is one group)."""
    pid, pid_h = tl.program_id(0), tl.program_id(1)
    w = _norm_weight(weight, D, BD)
    r1 = tl.arange(0, RP)
    acc_w = tl.zeros([BD], dtype=tl.float32)
    acc_gw = tl.zeros([RP, HB * BD], dtype=tl.float32)
    acc_gb = tl.zeros([HB * BD], dtype=tl.float32)
    for tile in range(pid, num_tiles, tl.num_programs(0)):
        off, _, mask = _tile(tile, pid_h, NR, L, 0, 0, H, D, BR, HB, BD)
        n, rstd = _normalized(o, off, mask, D, EPS)
        g = tl.load(dy + off, mask=mask, other=0.0).to(tl.float32)
        gl = _load_gate_low(gate + goffset, tile, NR, L, gstride_b, gstride_t, BR, RANK, RP)
        rows = tl.cast(tile * BR + tl.arange(0, BR), tl.int64)
        # loaded per tile (from L1/L2): kept across the loop it pins a second copy of itself in shared memory
        wt = _load_up_weight(gate_weight, pid_h, H, D, HB, BD, RANK, RP)
        act, act_grad = _act(_up_project(gl, wt, gate_bias, pid_h, H, D, BR, HB, BD, HAS_BIAS, PREC), SILU)
        # gradient of the full gate; zero in the padding (dy is loaded as zero there)
        dz = tl.reshape(g * n * w * act_grad, (BR, HB * BD))
        g *= act
        # g is now the gradient of n · w
        tl.store(do + off, _norm_input_grad(g, n, rstd, w, D), mask=mask)
        acc_w += tl.sum(tl.sum(g * n, axis=0), axis=0)
        dgl = tl.dot(dz, tl.trans(wt), input_precision=PREC)
        tl.store(dgate_partial + pid_h * NR * RANK + rows[:, None] * RANK + r1[None, :], dgl,
                 mask=(rows < NR)[:, None] & (r1 < RANK)[None, :])
        acc_gw = tl.dot(tl.trans(gl), dz, acc_gw, input_precision=PREC)
        acc_gb += tl.sum(dz, axis=0)
    d1 = tl.arange(0, BD)
    tl.store(dw_partial + (pid * tl.num_programs(1) + pid_h) * D + d1, acc_w, mask=d1 < D)
    n_cols, valid = _columns(pid_h, H, D, HB, BD)
    tl.store(dgw_partial + pid * (H * D * RANK) + n_cols[None, :] * RANK + r1[:, None], acc_gw,
             mask=valid[None, :] & (r1 < RANK)[:, None])
    if HAS_BIAS:
        tl.store(dgb_partial + pid * (H * D) + n_cols, acc_gb, mask=valid)
