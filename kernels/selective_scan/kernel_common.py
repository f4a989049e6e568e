"""The ``@triton.jit`` helpers the forward and backward kernels share."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softplus(x):
    # torch.nn.functional.softplus with its default threshold of 20
    return tl.where(x <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))), x)


@triton.jit
def program_block(dim, L, G, DG, N, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Which (channel block, batch x group, segment) this program scans: the program ids, the batch index, the
    block's channels (local offsets, global indices and mask), the state-size offsets and masks, and where the
    block's rows of the (batch, dim, L) inputs and the group's rows of the (batch x group, N, L) B / C start."""
    pid_d = tl.program_id(0)
    pid_bg = tl.program_id(1)
    seg = tl.program_id(2)
    nseg = tl.num_programs(2)
    i_b = pid_bg // G
    i_g = pid_bg % G
    offs_dl = tl.arange(0, BLOCK_D)
    offs_dg = pid_d * BLOCK_D + offs_dl
    mask_d = offs_dg < DG
    d = i_g * DG + offs_dg
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    mask_dn = mask_d[:, None] & mask_n[None, :]
    row_off = tl.cast(i_b * dim + d, tl.int64) * L
    bc_off = tl.cast(pid_bg, tl.int64) * N * L
    return pid_d, pid_bg, seg, nseg, i_b, offs_dl, d, mask_d, offs_n, mask_n, mask_dn, row_off, bc_off


@triton.jit
def load_channel_params(A_ptr, bias_ptr, D_ptr, d, offs_n, mask_d, mask_dn, N, HAS_BIAS: tl.constexpr,
                        HAS_D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The block's A (fp32), A·log2(e) for exp2, delta_bias and D (zeros where absent)."""
    A = tl.load(A_ptr + d[:, None] * N + offs_n[None, :], mask=mask_dn, other=0.0).to(tl.float32)
    A2 = A * 1.4426950408889634
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
    Dv = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
    return A, A2, bias, Dv


@triton.jit
def chunk_tile(c, offs_s, mask_d, row_off, L, REVERSE: tl.constexpr, CHUNK: tl.constexpr):
    """Chunk c's (CHUNK, BLOCK_D) tile: its live steps, their times (mirrored in the reverse direction), the tile's
    mask and its element offsets (rows ``row_off`` apart, time along the first axis)."""
    tau = c * CHUNK + offs_s
    mask_s = tau < L
    if REVERSE:
        t = L - 1 - tau
    else:
        t = tau
    m2 = mask_s[:, None] & mask_d[None, :]
    p2 = row_off[None, :] + t[:, None]
    return mask_s, t, m2, p2


@triton.jit
def load_delta(dl_ptr, p2, m2, bias, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """The delta tile before (with the bias) and after the softplus, in fp32; zero on masked steps, so that padded
    steps leave the state as it is."""
    dt_in = tl.load(dl_ptr + p2, mask=m2, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt_in += bias[None, :]
    if SOFTPLUS:
        dt = softplus(dt_in)
    else:
        dt = dt_in
    dt = tl.where(m2, dt, 0.0)
    return dt_in, dt


@triton.jit
def load_gated_grad(dout_ptr, z_ptr, p2, m2, HAS_Z: tl.constexpr):
    """The output gradient tile and, with a gate z, z, σ(z) and the gradient at the ungated output (do·z·σ(z))."""
    do = tl.load(dout_ptr + p2, mask=m2, other=0.0).to(tl.float32)
    if HAS_Z:
        zt = tl.load(z_ptr + p2, mask=m2, other=0.0).to(tl.float32)
        sz = tl.sigmoid(zt)
        g = do * zt * sz
    else:
        zt = do  # unused without z
        sz = do
        g = do
    return do, zt, sz, g
