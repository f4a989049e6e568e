"""Triton helpers shared by the prologue's forward and backward kernels.

Tiles are [BT tokens, HB heads, BD channels of a head] (three-dimensional, so per-head reductions are a sum over
the last axis); per-head scalars are [BT, HB] or [1, HB]. Everything is computed in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _program_tile(L, stride_b, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, HB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """This program's tile: (batch index, head indices [HB], tokens [BT, 1], heads [1, HB], their mask, the 3-D
    token/head columns, the key/value channel ranges and masks, and the offset of the batch element's row 0 in
    ``proj``). No pointer goes in: torch's mutation analysis of a ``wrap_triton`` launch counts every pointer
    argument of a helper whose result addresses a store as written."""
    pid_t, pid_b, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t2 = (pid_t * BT + tl.arange(0, BT))[:, None]
    h1 = pid_h * HB + tl.arange(0, HB)
    h2 = h1[None, :]
    mask_h = h2 < H
    mask2 = (t2 < L) & mask_h
    t3, h3 = t2[:, :, None], h2[:, :, None]
    dk = tl.arange(0, BK)[None, None, :]
    dv = tl.arange(0, BV)[None, None, :]
    mask_k = mask2[:, :, None] & (dk < K)
    mask_v = mask2[:, :, None] & (dv < V)
    start = tl.cast(pid_b, tl.int64) * stride_b
    return pid_t, pid_b, h1, t2, h2, mask_h, mask2, t3, h3, dk, dv, mask_k, mask_v, start


@triton.jit
def _short_conv(row0, conv_w, t, col, mask, L, stride_t, KS: tl.constexpr, LEFT: tl.constexpr):
    """Depthwise convolution over tokens before the activation: Σ_j w[col, j] · x[t + j − LEFT, col], with x = 0
    outside [0, L). ``row0`` points at token 0 of this batch element, ``col`` holds the tile's column indices."""
    acc = tl.zeros(mask.shape, dtype=tl.float32)
    for j in tl.static_range(KS):
        tj = t + (j - LEFT)
        x = tl.load(row0 + tj * stride_t + col, mask=mask & (tj >= 0) & (tj < L), other=0.0).to(tl.float32)
        w = tl.load(conv_w + col * KS + j, mask=mask, other=0.0).to(tl.float32)
        acc += x * w
    return acc


@triton.jit
def _log1p(u):
    """log(1 + u) to full float32 precision for u ≥ 0 (the correction (w − 1) recovers what 1 + u rounded off)."""
    w = 1.0 + u
    return tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))


@triton.jit
def _softplus(z):
    """torch's softplus (threshold 20): z above 20, else log(1 + e^z), computed without overflow."""
    return tl.where(z > 20.0, z, tl.maximum(z, 0.0) + _log1p(tl.exp(-tl.abs(z))))


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _head_param(ptr, h, mask_h, other):
    """A per-head parameter as a [1, HB] float32 row."""
    return tl.load(ptr + h, mask=mask_h, other=other).to(tl.float32)


@triton.jit
def _silu_grad(c, dy, s):
    """d SiLU(c) / dc · dy, given s = σ(c)."""
    return dy * s * (1.0 + c * (1.0 - s))


@triton.jit
def _silu_l2(c, EPS: tl.constexpr):
    """(σ(c), ŷ = y/√(‖y‖² + eps), 1/√(‖y‖² + eps)) for y = SiLU(c), norms per head."""
    s = _sigmoid(c)
    y = c * s
    r = tl.math.rsqrt(tl.sum(y * y, axis=2) + EPS)
    return s, y * r[:, :, None], r
