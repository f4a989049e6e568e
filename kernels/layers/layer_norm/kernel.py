"""Triton kernels of the LayerNorm op over the last axis of a contiguous tensor read as (N, C) rows, C in one tile.

Forward: one program per BR rows. Backward: one program per ``rows`` consecutive rows, walked BR at a time; it
recomputes each row's mean and 1/σ from x (no statistics are stored) and accumulates its rows' share of the weight and
bias gradients in registers, written as one fp32 partial row per program (a few hundred rows, summed by one reduction
afterwards): PyTorch's own weight-gradient kernel is far from its byte floor at the backbones' narrow rows.

The fused residual add (``add_layer_norm``): the forward also reads the residual and writes the sum it normalises; the
backward reads that sum as its x, adds the gradient that reaches the sum directly (the residual stream's) and writes
the total once per input dtype, in place of an add kernel each way and a cast of the gradient.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: The arguments each kernel stores to (some only under a constexpr flag): all that torch.compile's analysis of a
#: launch may take as written (tools/inductor_check.py, tests/kernels/test_inductor_writes.py).
WRITES = {"layer_norm_bwd_kernel": {"db_partial", "dw_partial", "dx", "dx_other"},
          "layer_norm_fwd_kernel": {"summed", "y"}}


@triton.jit
def _normalize(xv, mask, C: tl.constexpr, EPS: tl.constexpr):
    """(x̂, 1/σ) of a [BR, BC] fp32 tile that is 0 outside ``mask``."""
    mean = tl.sum(xv, axis=1) / C
    xc = tl.where(mask, xv - mean[:, None], 0.0)
    rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=1) / C + EPS)
    return xc * rstd[:, None], rstd


@triton.jit
def layer_norm_fwd_kernel(x, residual, summed, weight, bias, y, N, C: tl.constexpr, BR: tl.constexpr,
                          BC: tl.constexpr, HAS_BIAS: tl.constexpr, ADD_RESIDUAL: tl.constexpr, EPS: tl.constexpr):
    """y = LN(x), or with ``ADD_RESIDUAL`` summed = residual + x (in summed's dtype) and y = LN(summed)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BC)
    mask = (rows < N)[:, None] & (cols < C)[None, :]
    offs = tl.cast(rows, tl.int64)[:, None] * C + cols[None, :]
    xv = tl.load(x + offs, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        # the sum is rounded to its stored dtype before it is normalised, as ``residual + x`` then the norm would be
        xv = (xv.to(tl.float32) + tl.load(residual + offs, mask=mask, other=0.0).to(tl.float32)).to(
            summed.dtype.element_ty)
        tl.store(summed + offs, xv, mask=mask)
    xhat, _ = _normalize(xv.to(tl.float32), mask, C, EPS)
    out = xhat * tl.load(weight + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        out += tl.load(bias + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
    tl.store(y + offs, out.to(y.dtype.element_ty), mask=mask)


@triton.jit
def layer_norm_bwd_kernel(x, weight, dy, dsummed, dx, dx_other, dw_partial, db_partial, N, rows_per_program,
                          C: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr,
                          ADD_DSUMMED: tl.constexpr, OTHER_DTYPE: tl.constexpr, EPS: tl.constexpr):
    """dx = (w·dy − x̂·mean(w·dy·x̂) − mean(w·dy)) / σ (+ dsummed, the gradient reaching the sum directly, with
    ``ADD_DSUMMED``; also written to dx_other in its dtype with ``OTHER_DTYPE``) for rows [pid·rows, (pid + 1)·rows);
    partial Σ dy·x̂, Σ dy. x is the normalised tensor (the sum, for the fused add)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BC)
    w = tl.load(weight + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
    # The partial sums stay [BR, BC] tiles until the end: a row sum per step crosses the warps where the tile's layout
    # spreads its rows over them (the layout the loads take when dy is 16-bit), a shared-memory round trip each time.
    dw = tl.zeros([BR, BC], tl.float32)
    db = tl.zeros([BR, BC], tl.float32)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, N)
    for r0 in range(start, end, BR):
        rows = r0 + tl.arange(0, BR)
        mask = (rows < end)[:, None] & (cols < C)[None, :]
        offs = tl.cast(rows, tl.int64)[:, None] * C + cols[None, :]
        xhat, rstd = _normalize(tl.load(x + offs, mask=mask, other=0.0).to(tl.float32), mask, C, EPS)
        g = tl.load(dy + offs, mask=mask, other=0.0).to(tl.float32)
        gw = g * w
        c1 = tl.sum(gw * xhat, axis=1) / C
        c2 = tl.sum(gw, axis=1) / C
        grad = (gw - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        if ADD_DSUMMED:
            grad += tl.load(dsummed + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx + offs, grad.to(dx.dtype.element_ty), mask=mask)
        if OTHER_DTYPE:
            tl.store(dx_other + offs, grad.to(dx_other.dtype.element_ty), mask=mask)
        dw += g * xhat
        db += g
    tl.store(dw_partial + pid * C + cols, tl.sum(dw, axis=0), mask=cols < C)
    if HAS_BIAS:
        tl.store(db_partial + pid * C + cols, tl.sum(db, axis=0), mask=cols < C)
