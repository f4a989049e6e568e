"""Triton kernels for the Mamba-1 selective scan (forward and backward), causal and bidirectional.

Every kernel runs one program per (batch, group of B/C, block of ``BLOCK_D`` channels) and keeps the
``(BLOCK_D, N)`` state in fp32 registers; inputs may be fp32/fp16/bf16 and are upcast on load. Two
implementations share the launch code and the saved-state format (``CONFIG_OVERRIDE["path"]`` picks one):

* ``"seq"`` (default, the fast one): the recurrence walks time one token per loop iteration (``x = exp2(δA') x +
  δuB``, ``y = Σ_n C x``) -- an exp2 and two FMAs per state element per step. With a gradient pending the forward
  stores the state every ``CHUNK`` (``block_l``) tokens; the backward walks the chunks last to first, recomputes
  the chunk's states from the saved one, then walks the chunk backwards with the adjoint
  ``h_t = a_{t+1} h_{t+1} + g_t C_t``. For L <= ``CHUNK`` nothing but the outputs is written; any L works (3136 is
  one more loop trip count, with L/CHUNK saved states per channel). Rows are L tokens apart, so stepping
  straight through memory would touch BLOCK_D cache lines per access (the load/store unit, not DRAM, the limit;
  the first version did, at 1.3-1.4x the GPU time of fwd+bwd at MambaVision's shapes on an H200). Instead, per
  chunk, coalesced (CHUNK, BLOCK_D) tile loads fill a small per-program scratch (L2-resident) laid out
  channel-contiguous; the step loops read one contiguous row per step; the outputs (and in the backward every
  gradient, with dB/dC reduced over channels once per chunk on (CHUNK, BLOCK_D, N) tiles of the states and
  adjoints) are written as tiles. See :func:`_tiled_bwd_kernel`.
* ``"scan"``: chunks of ``BLOCK_L`` tokens as ``(BLOCK_D, N, BLOCK_L)`` register tiles, the recurrence evaluated
  with ``tl.associative_scan`` along time (the backward's adjoint with a reverse scan) and the state carried
  between chunks; more instructions per element (log2 BLOCK_L combine levels) than ``"seq"``.

Long sequences (L >= 1024) with too few (sequence, channel block) programs to fill the GPU are split along time
into segments, one program each (``"seq"`` path): the forward first records every segment's end state from a zero
start and its sum of delta (the decay across a segment is ``exp(A * sum delta)``), then each segment composes the
earlier records into its start state and scans; the backward does the same for the adjoint, last segment first.
Each pass costs about one more read of the inputs; it pays when the programs would otherwise be few and long
(e.g. 3136 tokens at batch 2: 12 segments).

Gradients use ``a_t x_{t-1} = x_t - b_t`` (never a division by ``a``). Reductions over channels (dB, dC) are
written per channel block, those over batch and time (dA, dD, d delta_bias) per (batch, channel); one small
finishing kernel sums them in a fixed order and writes every gradient in its input's dtype (one launch instead of
~8 PyTorch ops: at MambaVision's shapes the eager backward is bound by host-side launch work). No atomics, so the
gradients are deterministic.

Bidirectional (``causal=False``): the reverse-time direction is the same loop with time indices mirrored
(``t = L - 1 - τ``). The forward kernel runs both directions in one launch (the first pass parks ``y_fwd`` in an
fp32 buffer, the second adds ``y_rev`` and applies ``D·u`` and the gate once); the backward runs one launch per
direction, the second accumulating into the first's gradients.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..utils import autocast_custom_bwd, autocast_custom_fwd, cdiv, empty_output, input_guard

__all__ = ["SelectiveScanFunction", "selective_scan_triton"]

_LOG2E = 1.4426950408889634

#: Launch-shape override for experiments and tests, e.g. ``{"path": "scan", "block_l": 16}``. Keys (each
#: optional): ``path`` (``"seq"``: sequential kernels, ``"scan"``: associative-scan kernels), ``lean`` and
#: ``unroll`` (sequential backward/forward code shape, see
#: :func:`_tiled_bwd_kernel`), ``block_l`` (chunk length: the scan tile's time extent, and the checkpoint
#: interval of the saved states), ``block_d_fwd``, ``block_d_bwd``, ``warps_fwd``, ``warps_bwd``, ``segments``
#: (time segments scanned in parallel, ``"seq"`` only). ``None``: the heuristics in :func:`_launch_config`. Read by
#: the forward; its backward reuses the forward's config.
CONFIG_OVERRIDE: dict | None = None


def _launch_config(length: int, nstate: int, channels_per_group: int, sequences: int = 1) -> dict:
    """Launch shape for ``sequences`` (batch x groups) scans of ``length`` tokens and ``channels_per_group``
    (the returned dict is shared: read it, don't modify it)."""
    if CONFIG_OVERRIDE is None:
        return _default_launch_config(length, nstate, channels_per_group, sequences)
    return _build_launch_config(length, nstate, channels_per_group, sequences)


def _build_launch_config(length: int, nstate: int, channels_per_group: int, sequences: int) -> dict:
    block_n = triton.next_power_of_2(nstate)
    cap = triton.next_power_of_2(channels_per_group)
    path = (CONFIG_OVERRIDE or {}).get("path", "seq")
    if path == "seq":
        # the fastest of the launch variants timed side by side on an H200 at MambaVision's four shapes
        # (benchmarks/results/kernels-selective_scan-nvidia-h200-2026-11-21.log, and for the backward's warps
        # kernels-selective_scan-sweep-nvidia-h200-2026-11-22.log): chunks of 8 tokens, 32 channels per program,
        # one warp forward, two backward
        cfg = {"path": "seq", "lean": True, "unroll": True, "block_l": 8,
               "block_d_fwd": 32, "block_d_bwd": 32, "warps_fwd": 1, "warps_bwd": 2}
    else:
        block_l = min(64, max(16, triton.next_power_of_2(length)))
        cfg = {"path": "scan", "block_l": block_l, "block_d_fwd": max(1, 4096 // (block_n * block_l)),
               "block_d_bwd": max(1, 2048 // (block_n * block_l)), "warps_fwd": 4, "warps_bwd": 4}
    cfg.update(CONFIG_OVERRIDE or {})
    cfg["block_d_fwd"] = min(cfg["block_d_fwd"], cap)
    cfg["block_d_bwd"] = min(cfg["block_d_bwd"], cap)
    cfg["block_n"] = block_n
    if cfg["path"] == "seq":
        # no more threads than (BLOCK_D, N) state elements in the sequential kernels: with the state tile replicated
        # across warps (16 warps on a 32 x 8 tile) the tiled backward's d delta came out wrong on an H200
        for kind in ("fwd", "bwd"):
            elements = cfg[f"block_d_{kind}"] * block_n
            cfg[f"warps_{kind}"] = max(1, min(cfg[f"warps_{kind}"], elements // 32))
        # Long sequences with too few (sequence, channel block) programs to fill the GPU: split time into segments
        # (two passes each way, see _tiled_fwd_kernel), aiming at ~2048 programs, segments of >= 256 tokens.
        programs = sequences * cdiv(channels_per_group, cfg["block_d_bwd"])
        if "segments" not in (CONFIG_OVERRIDE or {}):
            cfg["segments"] = min(cdiv(2048, programs), length // 256) if length >= 1024 and programs < 1024 else 1
    else:
        cfg["segments"] = 1  # the associative-scan kernels run whole sequences
    nchunk = cdiv(length, cfg["block_l"])
    cfg["seg_chunks"] = cdiv(nchunk, max(1, cfg["segments"]))
    cfg["segments"] = cdiv(nchunk, cfg["seg_chunks"])  # no empty segment
    return cfg


# one dict per problem size: rebuilding it costs host time on every call
_default_launch_config = functools.lru_cache(maxsize=256)(_build_launch_config)


@triton.jit
def _combine(a1, b1, a2, b2):
    # (a1, b1) then (a2, b2): x -> a2 (a1 x + b1) + b2
    return a1 * a2, b1 * a2 + b2


@triton.jit
def _softplus(x):
    # torch.nn.functional.softplus with its default threshold of 20
    return tl.where(x <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))), x)


@triton.jit
def _fwd_pass(u_ptr, dl_ptr, B_ptr, C_ptr, z_ptr, out_ptr, ybuf_ptr, state_ptr, last_ptr,
              row_off, bc_off, state_off, last_off, A2, bias, Dv, mask_d, offs_n, mask_n, L, N, NCHUNK,
              REVERSE: tl.constexpr, MODE: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
              HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, SAVE_STATES: tl.constexpr,
              RETURN_LAST: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr):
    # MODE 0: write the final output; 1: park y in ybuf (first direction); 2: add ybuf, then write the output.
    offs_l = tl.arange(0, BLOCK_L)
    mask_dn = mask_d[:, None] & mask_n[None, :]
    carry = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    for c in range(0, NCHUNK):
        tau = c * BLOCK_L + offs_l
        mask_l = tau < L
        if REVERSE:
            t = L - 1 - tau
        else:
            t = tau
        m2 = mask_d[:, None] & mask_l[None, :]
        p2 = row_off[:, None] + t[None, :]
        u = tl.load(u_ptr + p2, mask=m2, other=0.0).to(tl.float32)
        dt = tl.load(dl_ptr + p2, mask=m2, other=0.0).to(tl.float32)
        if HAS_BIAS:
            dt += bias[:, None]
        if SOFTPLUS:
            dt = _softplus(dt)
        dt = tl.where(m2, dt, 0.0)
        mbc = mask_n[:, None] & mask_l[None, :]
        pbc = bc_off + offs_n[:, None] * L + t[None, :]
        Bt = tl.load(B_ptr + pbc, mask=mbc, other=0.0).to(tl.float32)
        Ct = tl.load(C_ptr + pbc, mask=mbc, other=0.0).to(tl.float32)
        if SAVE_STATES:
            tl.store(state_ptr + state_off + c * N, carry, mask=mask_dn)
        a = tl.exp2(dt[:, None, :] * A2[:, :, None])
        b = (dt * u)[:, None, :] * Bt[None, :, :]
        pa, sb = tl.associative_scan((a, b), axis=2, combine_fn=_combine)
        x = pa * carry[:, :, None] + sb
        y = tl.sum(x * Ct[None, :, :], axis=1)
        # padded steps (tau >= L) have a = 1, b = 0, so the last column is the state after the last real token
        carry = tl.sum(tl.where(offs_l[None, None, :] == BLOCK_L - 1, x, 0.0), axis=2)
        if MODE == 1:
            tl.store(ybuf_ptr + p2, y, mask=m2)
        else:
            if MODE == 2:
                y += tl.load(ybuf_ptr + p2, mask=m2, other=0.0)
            if HAS_D:
                y += Dv[:, None] * u
            if HAS_Z:
                zt = tl.load(z_ptr + p2, mask=m2, other=0.0).to(tl.float32)
                y = y * zt * tl.sigmoid(zt)
            tl.store(out_ptr + p2, y.to(out_ptr.dtype.element_ty), mask=m2)
    if RETURN_LAST:
        tl.store(last_ptr + last_off, carry, mask=mask_dn)


@triton.jit
def _selective_scan_fwd_kernel(u_ptr, dl_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, out_ptr, ybuf_ptr,
                               state_ptr, last_ptr, dim, L, G, DG, N, NCHUNK,
                               BIDIR: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
                               HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, SAVE_STATES: tl.constexpr,
                               RETURN_LAST: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_L: tl.constexpr):
    pid_d = tl.program_id(0)
    pid_bg = tl.program_id(1)
    i_b = pid_bg // G
    i_g = pid_bg % G
    offs_dg = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_dg < DG
    d = i_g * DG + offs_dg
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    mask_dn = mask_d[:, None] & mask_n[None, :]
    row_off = (i_b * dim + d).to(tl.int64) * L
    bc_off = pid_bg.to(tl.int64) * N * L
    A2 = tl.load(A_ptr + d[:, None] * N + offs_n[None, :], mask=mask_dn, other=0.0).to(tl.float32) * 1.4426950408889634
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
    Dv = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
    if BIDIR:
        state_off = ((i_b * 2) * dim + d).to(tl.int64)[:, None] * NCHUNK * N + offs_n[None, :]
    else:
        state_off = (i_b * dim + d).to(tl.int64)[:, None] * NCHUNK * N + offs_n[None, :]
    last_off = (i_b * dim + d).to(tl.int64)[:, None] * N + offs_n[None, :]
    if BIDIR:
        _fwd_pass(u_ptr, dl_ptr, B_ptr, C_ptr, z_ptr, out_ptr, ybuf_ptr, state_ptr, last_ptr,
                  row_off, bc_off, state_off, last_off, A2, bias, Dv, mask_d, offs_n, mask_n, L, N, NCHUNK,
                  False, 1, HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, SAVE_STATES, False, BLOCK_D, BLOCK_N, BLOCK_L)
        # the second pass reads back what the first wrote, possibly from other threads of this program
        tl.debug_barrier()
        _fwd_pass(u_ptr, dl_ptr, B_ptr, C_ptr, z_ptr, out_ptr, ybuf_ptr, state_ptr, last_ptr,
                  row_off, bc_off, state_off + dim * NCHUNK * N, last_off, A2, bias, Dv, mask_d, offs_n,
                  mask_n, L, N, NCHUNK,
                  True, 2, HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, SAVE_STATES, False, BLOCK_D, BLOCK_N, BLOCK_L)
    else:
        _fwd_pass(u_ptr, dl_ptr, B_ptr, C_ptr, z_ptr, out_ptr, ybuf_ptr, state_ptr, last_ptr,
                  row_off, bc_off, state_off, last_off, A2, bias, Dv, mask_d, offs_n, mask_n, L, N, NCHUNK,
                  False, 0, HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, SAVE_STATES, RETURN_LAST, BLOCK_D, BLOCK_N, BLOCK_L)


@triton.jit
def _store_bc_partials(bc_ptr, ppart, dBc, dCc, mbc, N, L, ACCUM: tl.constexpr):
    # one (batch, group, channel block)'s dB partial at ppart, its dC partial N * L further; the second direction of
    # a bidirectional scan adds to what the first wrote
    if ACCUM:
        dBc += tl.load(bc_ptr + ppart, mask=mbc, other=0.0)
        dCc += tl.load(bc_ptr + N * L + ppart, mask=mbc, other=0.0)
    tl.store(bc_ptr + ppart, dBc, mask=mbc)
    tl.store(bc_ptr + N * L + ppart, dCc, mask=mbc)


@triton.jit
def _store_col_partials(col_ptr, cmat_off, cvec_off, dA_acc, dbias_acc, dD_acc, mask_dn, mask_d, dim,
                        ACCUM: tl.constexpr, HAS_D: tl.constexpr):
    # a program's row of the column partials: dA at cmat_off, d delta_bias at cvec_off, dD dim further (D·u
    # belongs to the first direction only)
    if ACCUM:
        dA_acc += tl.load(col_ptr + cmat_off, mask=mask_dn, other=0.0)
        dbias_acc += tl.load(col_ptr + cvec_off, mask=mask_d, other=0.0)
    tl.store(col_ptr + cmat_off, dA_acc, mask=mask_dn)
    tl.store(col_ptr + cvec_off, dbias_acc, mask=mask_d)
    if HAS_D and not ACCUM:
        tl.store(col_ptr + cvec_off + dim, dD_acc, mask=mask_d)


@triton.jit
def _selective_scan_bwd_kernel(u_ptr, dl_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, dout_ptr, state_ptr,
                               dlast_ptr, du_ptr, ddl_ptr, dz_ptr, col_ptr, bc_ptr,
                               dim, L, G, DG, N, NCHUNK, NDBLK, DIR, NDIR, NCOL,
                               REVERSE: tl.constexpr, ACCUM: tl.constexpr, HAS_D: tl.constexpr,
                               HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                               LOAD_STATES: tl.constexpr, HAS_DLAST: tl.constexpr, BLOCK_D: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr):
    # ACCUM: this is the second direction of a bidirectional scan; add to the gradients the first launch wrote
    # (D·u and the gate belong to the first launch only).
    pid_d = tl.program_id(0)
    pid_bg = tl.program_id(1)
    i_b = pid_bg // G
    i_g = pid_bg % G
    offs_dg = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_dg < DG
    d = i_g * DG + offs_dg
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    mask_dn = mask_d[:, None] & mask_n[None, :]
    offs_l = tl.arange(0, BLOCK_L)
    row_off = (i_b * dim + d).to(tl.int64) * L
    bc_off = pid_bg.to(tl.int64) * N * L
    part_off = (pid_bg * NDBLK + pid_d).to(tl.int64) * 2 * N * L  # dB's row; dC's follows at + N * L
    A = tl.load(A_ptr + d[:, None] * N + offs_n[None, :], mask=mask_dn, other=0.0).to(tl.float32)
    A2 = A * 1.4426950408889634
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
    Dv = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
    state_off = ((i_b * NDIR + DIR) * dim + d).to(tl.int64)[:, None] * NCHUNK * N + offs_n[None, :]
    vec_off = (i_b * dim + d).to(tl.int64)
    mat_off = vec_off[:, None] * N + offs_n[None, :]
    # per-batch partial sums, one row of NCOL per batch: dA (dim x N), then d delta_bias (dim), then dD (dim)
    cmat_off = i_b.to(tl.int64) * NCOL + d[:, None] * N + offs_n[None, :]
    cvec_off = i_b.to(tl.int64) * NCOL + dim * N + d
    dlast = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    if HAS_DLAST:
        dlast = tl.load(dlast_ptr + mat_off, mask=mask_dn, other=0.0).to(tl.float32)

    hcarry = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    dA_acc = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    dD_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dbias_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for i in range(0, NCHUNK):
        c = NCHUNK - 1 - i
        tau = c * BLOCK_L + offs_l
        mask_l = tau < L
        mask_l1 = (tau + 1) < L
        if REVERSE:
            t = L - 1 - tau
            t1 = t - 1
        else:
            t = tau
            t1 = t + 1
        m2 = mask_d[:, None] & mask_l[None, :]
        p2 = row_off[:, None] + t[None, :]
        u = tl.load(u_ptr + p2, mask=m2, other=0.0).to(tl.float32)
        dt_in = tl.load(dl_ptr + p2, mask=m2, other=0.0).to(tl.float32)
        m21 = mask_d[:, None] & mask_l1[None, :]
        dt1 = tl.load(dl_ptr + row_off[:, None] + t1[None, :], mask=m21, other=0.0).to(tl.float32)
        if HAS_BIAS:
            dt_in += bias[:, None]
            dt1 += bias[:, None]
        if SOFTPLUS:
            dt = _softplus(dt_in)
            dt1 = _softplus(dt1)
        else:
            dt = dt_in
        dt = tl.where(m2, dt, 0.0)
        mbc = mask_n[:, None] & mask_l[None, :]
        pbc = bc_off + offs_n[:, None] * L + t[None, :]
        Bt = tl.load(B_ptr + pbc, mask=mbc, other=0.0).to(tl.float32)
        Ct = tl.load(C_ptr + pbc, mask=mbc, other=0.0).to(tl.float32)

        a = tl.exp2(dt[:, None, :] * A2[:, :, None])
        # the adjoint's decay is the next step's: a_{t+1}, zero past the end of the sequence
        a1 = tl.where(mask_l1[None, None, :], tl.exp2(dt1[:, None, :] * A2[:, :, None]), 0.0)
        dtu = dt * u
        b = dtu[:, None, :] * Bt[None, :, :]
        pa, sb = tl.associative_scan((a, b), axis=2, combine_fn=_combine)
        if LOAD_STATES:
            x0 = tl.load(state_ptr + state_off + c * N, mask=mask_dn, other=0.0)
            x = pa * x0[:, :, None] + sb
        else:
            x = sb

        do = tl.load(dout_ptr + p2, mask=m2, other=0.0).to(tl.float32)
        if HAS_Z:
            zt = tl.load(z_ptr + p2, mask=m2, other=0.0).to(tl.float32)
            sz = tl.sigmoid(zt)
            g = do * zt * sz
            y = tl.sum(x * Ct[None, :, :], axis=1)
            if HAS_D and not ACCUM:
                y += Dv[:, None] * u
            dz = do * sz * (1.0 + zt * (1.0 - sz)) * y
            if ACCUM:
                dz += tl.load(dz_ptr + p2, mask=m2, other=0.0).to(tl.float32)
            tl.store(dz_ptr + p2, dz.to(dz_ptr.dtype.element_ty), mask=m2)
        else:
            g = do
        beta = g[:, None, :] * Ct[None, :, :]
        if HAS_DLAST:
            beta += tl.where(tau[None, None, :] == L - 1, dlast[:, :, None], 0.0)
        qa, rb = tl.associative_scan((a1, beta), axis=2, combine_fn=_combine, reverse=True)
        h = qa * hcarry[:, :, None] + rb
        hcarry = tl.sum(tl.where(offs_l[None, None, :] == 0, h, 0.0), axis=2)

        hx = h * (x - b)  # h_t * a_t x_{t-1}
        dA_acc += tl.sum(hx * dt[:, None, :], axis=2)
        hB = tl.sum(h * Bt[None, :, :], axis=1)
        ddt = tl.sum(hx * A[:, :, None], axis=1) + u * hB
        du = dt * hB
        if HAS_D and not ACCUM:
            du += g * Dv[:, None]
            dD_acc += tl.sum(g * u, axis=1)
        if SOFTPLUS:
            ddt = ddt * tl.sigmoid(dt_in)
        ddt = tl.where(m2, ddt, 0.0)
        dbias_acc += tl.sum(ddt, axis=1)
        if ACCUM:
            du += tl.load(du_ptr + p2, mask=m2, other=0.0).to(tl.float32)
            ddt += tl.load(ddl_ptr + p2, mask=m2, other=0.0).to(tl.float32)
        tl.store(du_ptr + p2, du.to(du_ptr.dtype.element_ty), mask=m2)
        tl.store(ddl_ptr + p2, ddt.to(ddl_ptr.dtype.element_ty), mask=m2)

        dBc = tl.sum(h * dtu[:, None, :], axis=0)
        dCc = tl.sum(g[:, None, :] * x, axis=0)
        _store_bc_partials(bc_ptr, part_off + offs_n[:, None] * L + t[None, :], dBc, dCc, mbc, N, L, ACCUM)

    _store_col_partials(col_ptr, cmat_off, cvec_off, dA_acc, dbias_acc, dD_acc, mask_dn, mask_d, dim, ACCUM, HAS_D)


# ---------------------------------------------------------------------------------------------------------------
# Sequential path, tiled: one step per loop iteration with the (BLOCK_D, N) state in registers -- far fewer
# instructions per element than the associative scan (an exp2 and two FMAs instead of log2(BLOCK_L) combine
# levels) -- around coalesced chunk tiles (see the module docstring and the backward's comment below).


@triton.jit
def _tiled_fwd_step(s, x, v_dt, v_dtu, v_y, v_B, v_C, A2, offs_dl, offs_n, BLOCK_D: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    dts = tl.load(v_dt + s * BLOCK_D + offs_dl)
    dtus = tl.load(v_dtu + s * BLOCK_D + offs_dl)
    Bs = tl.load(v_B + s * BLOCK_N + offs_n)
    Cs = tl.load(v_C + s * BLOCK_N + offs_n)
    x = tl.exp2(dts[:, None] * A2) * x + dtus[:, None] * Bs[None, :]
    tl.store(v_y + s * BLOCK_D + offs_dl, tl.sum(x * Cs[None, :], axis=1))
    return x


@triton.jit
def _tiled_fwd_pass(u_ptr, dl_ptr, B_ptr, C_ptr, z_ptr, out_ptr, ybuf_ptr, state_ptr, last_ptr, seg_state_ptr,
                    seg_sum_ptr, scr, row_off, bc_off, state_off, last_off, seg_row, A2, bias, Dv, d, mask_d, offs_n,
                    mask_n, dim, L, N, NCHUNK, seg, SEG_CHUNKS, REVERSE: tl.constexpr, MODE: tl.constexpr,
                    SEG_PASS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
                    SOFTPLUS: tl.constexpr, SAVE_STATES: tl.constexpr, RETURN_LAST: tl.constexpr,
                    UNROLL: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    # Per chunk: coalesced (CHUNK, BLOCK_D) tile loads into a channel-contiguous scratch, the recurrence one step
    # per iteration reading that scratch (y_t back into it), then the output written as one tile.
    # MODE as in _fwd_pass. This program walks chunks [seg * SEG_CHUNKS, +SEG_CHUNKS) of the sequence (all of it
    # unless the sequence is split into segments, see _tiled_fwd_kernel); SEG_PASS 1 only records the segment's
    # end state from a zero start and its sum of delta; SEG_PASS 2 starts from the state the earlier segments'
    # records compose to.
    SD = CHUNK * BLOCK_D
    SN = CHUNK * BLOCK_N
    v_dt = scr
    v_dtu = scr + SD
    v_y = scr + 2 * SD
    v_B = scr + 3 * SD
    v_C = v_B + SN
    offs_dl = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, CHUNK)
    vec_sd = offs_s[:, None] * BLOCK_D + offs_dl[None, :]
    vec_sn = offs_s[:, None] * BLOCK_N + offs_n[None, :]
    mask_dn = mask_d[:, None] & mask_n[None, :]
    seg_dn = d[:, None] * N + offs_n[None, :]
    x = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    if SEG_PASS == 2:
        # x after segment j = exp(A * sum of delta over j) x before it + (segment j's state from zero)
        for j in range(0, seg):
            end_j = tl.load(seg_state_ptr + (seg_row + j) * dim * N + seg_dn, mask=mask_dn, other=0.0)
            sum_j = tl.load(seg_sum_ptr + (seg_row + j) * dim + d, mask=mask_d, other=0.0)
            x = tl.exp2(sum_j[:, None] * A2) * x + end_j
    dt_sum = tl.zeros((BLOCK_D,), dtype=tl.float32)
    c_lo = seg * SEG_CHUNKS
    for c in range(c_lo, tl.minimum(NCHUNK, c_lo + SEG_CHUNKS)):
        tau = c * CHUNK + offs_s
        mask_s = tau < L
        if REVERSE:
            t = L - 1 - tau
        else:
            t = tau
        m2 = mask_s[:, None] & mask_d[None, :]
        p2 = row_off[None, :] + t[:, None]
        u = tl.load(u_ptr + p2, mask=m2, other=0.0).to(tl.float32)
        dt = tl.load(dl_ptr + p2, mask=m2, other=0.0).to(tl.float32)
        if HAS_BIAS:
            dt += bias[None, :]
        if SOFTPLUS:
            dt = _softplus(dt)
        dt = tl.where(m2, dt, 0.0)
        if SEG_PASS == 1:
            dt_sum += tl.sum(dt, axis=0)
        mbc = mask_s[:, None] & mask_n[None, :]
        pbc = bc_off + offs_n[None, :] * L + t[:, None]
        tl.store(v_dt + vec_sd, dt)
        tl.store(v_dtu + vec_sd, dt * u)
        tl.store(v_B + vec_sn, tl.load(B_ptr + pbc, mask=mbc, other=0.0).to(tl.float32))
        tl.store(v_C + vec_sn, tl.load(C_ptr + pbc, mask=mbc, other=0.0).to(tl.float32))
        if SAVE_STATES and SEG_PASS != 1:
            tl.store(state_ptr + state_off + c * N, x, mask=mask_dn)
        tl.debug_barrier()
        if UNROLL:
            for s in tl.static_range(CHUNK):
                x = _tiled_fwd_step(s, x, v_dt, v_dtu, v_y, v_B, v_C, A2, offs_dl, offs_n, BLOCK_D, BLOCK_N)
        else:
            for s in range(0, CHUNK):
                x = _tiled_fwd_step(s, x, v_dt, v_dtu, v_y, v_B, v_C, A2, offs_dl, offs_n, BLOCK_D, BLOCK_N)
        tl.debug_barrier()
        if SEG_PASS != 1:
            y = tl.load(v_y + vec_sd)
            if MODE == 1:
                tl.store(ybuf_ptr + p2, y, mask=m2)
            else:
                if MODE == 2:
                    y += tl.load(ybuf_ptr + p2, mask=m2, other=0.0)
                if HAS_D:
                    y += Dv[None, :] * u
                if HAS_Z:
                    zt = tl.load(z_ptr + p2, mask=m2, other=0.0).to(tl.float32)
                    y = y * zt * tl.sigmoid(zt)
                tl.store(out_ptr + p2, y.to(out_ptr.dtype.element_ty), mask=m2)
        # the next chunk's prologue overwrites the scratch read here
        tl.debug_barrier()
    if SEG_PASS == 1:
        tl.store(seg_state_ptr + (seg_row + seg) * dim * N + seg_dn, x, mask=mask_dn)
        tl.store(seg_sum_ptr + (seg_row + seg) * dim + d, dt_sum, mask=mask_d)
    if RETURN_LAST:
        # only the segment holding the last token (a tensor comparison: the interpreter rejects a scalar mask)
        is_last = (offs_n[None, :] * 0 + seg * SEG_CHUNKS + SEG_CHUNKS) >= NCHUNK
        tl.store(last_ptr + last_off, x, mask=mask_dn & is_last)


@triton.jit
def _tiled_fwd_kernel(u_ptr, dl_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, out_ptr, ybuf_ptr, state_ptr,
                      last_ptr, seg_state_ptr, seg_sum_ptr, scratch_ptr, dim, L, G, DG, N, NCHUNK, SEG_CHUNKS,
                      BIDIR: tl.constexpr, DIRECTION: tl.constexpr, SEG_PASS: tl.constexpr, HAS_D: tl.constexpr,
                      HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                      SAVE_STATES: tl.constexpr, RETURN_LAST: tl.constexpr, UNROLL: tl.constexpr,
                      CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    # Grid: (channel blocks, batch x groups, segments). Long sequences with too few (batch, channel block)
    # programs to fill the GPU are split into segments of SEG_CHUNKS chunks, one program each, in two launches:
    # SEG_PASS 1 records each segment's end state from a zero start and its sum of delta (the decay over a segment
    # is exp(A * that sum)), SEG_PASS 2 composes the earlier segments' records into its start state and runs the
    # scan. DIRECTION (bidirectional only): -1 runs both directions in this program (y_fwd parked in ybuf, read
    # back by the reverse pass); 0 / 1 only one of them -- segmented, the reverse pass reads y_fwd written by
    # other programs, so it needs a launch of its own.
    pid_d = tl.program_id(0)
    pid_bg = tl.program_id(1)
    seg = tl.program_id(2)
    nseg = tl.num_programs(2)
    i_b = pid_bg // G
    i_g = pid_bg % G
    offs_dg = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_dg < DG
    d = i_g * DG + offs_dg
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    mask_dn = mask_d[:, None] & mask_n[None, :]
    row_off = (i_b * dim + d).to(tl.int64) * L
    bc_off = pid_bg.to(tl.int64) * N * L
    program = (seg * tl.num_programs(1) + pid_bg) * tl.num_programs(0) + pid_d
    scr = scratch_ptr + program.to(tl.int64) * (CHUNK * (3 * BLOCK_D + 2 * BLOCK_N))
    A2 = tl.load(A_ptr + d[:, None] * N + offs_n[None, :], mask=mask_dn, other=0.0).to(tl.float32) * 1.4426950408889634
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
    Dv = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
    last_off = (i_b * dim + d).to(tl.int64)[:, None] * N + offs_n[None, :]
    if BIDIR:
        state_off = ((i_b * 2) * dim + d).to(tl.int64)[:, None] * NCHUNK * N + offs_n[None, :]
        seg_row = (i_b * 2 * nseg).to(tl.int64)
        if DIRECTION != 1:
            _tiled_fwd_pass(u_ptr, dl_ptr, B_ptr, C_ptr, z_ptr, out_ptr, ybuf_ptr, state_ptr, last_ptr,
                            seg_state_ptr, seg_sum_ptr, scr, row_off, bc_off, state_off, last_off, seg_row, A2, bias,
                            Dv, d, mask_d, offs_n, mask_n, dim, L, N, NCHUNK, seg, SEG_CHUNKS,
                            False, 1, SEG_PASS, HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, SAVE_STATES, False, UNROLL, CHUNK,
                            BLOCK_D, BLOCK_N)
        if DIRECTION == -1:
            # the second pass reads back what the first wrote, possibly from other threads of this program
            tl.debug_barrier()
        if DIRECTION != 0:
            _tiled_fwd_pass(u_ptr, dl_ptr, B_ptr, C_ptr, z_ptr, out_ptr, ybuf_ptr, state_ptr, last_ptr,
                            seg_state_ptr, seg_sum_ptr, scr, row_off, bc_off, state_off + dim * NCHUNK * N, last_off,
                            seg_row + nseg, A2, bias, Dv, d, mask_d, offs_n, mask_n, dim, L, N, NCHUNK, seg,
                            SEG_CHUNKS, True, 2, SEG_PASS, HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, SAVE_STATES, False,
                            UNROLL, CHUNK, BLOCK_D, BLOCK_N)
    else:
        state_off = (i_b * dim + d).to(tl.int64)[:, None] * NCHUNK * N + offs_n[None, :]
        _tiled_fwd_pass(u_ptr, dl_ptr, B_ptr, C_ptr, z_ptr, out_ptr, ybuf_ptr, state_ptr, last_ptr, seg_state_ptr,
                        seg_sum_ptr, scr, row_off, bc_off, state_off, last_off, (i_b * nseg).to(tl.int64), A2, bias,
                        Dv, d, mask_d, offs_n, mask_n, dim, L, N, NCHUNK, seg, SEG_CHUNKS,
                        False, 0, SEG_PASS, HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, SAVE_STATES, RETURN_LAST, UNROLL, CHUNK,
                        BLOCK_D, BLOCK_N)


# ---------------------------------------------------------------------------------------------------------------
# Tiled backward. Stepping straight through memory (one token of each channel per step) would hit BLOCK_D cache
# lines per (BLOCK_D,) access (rows of length L) and reduce dB/dC over channels every step. Here only the two
# recurrences stay sequential; per chunk of CHUNK tokens:
#   1. prologue: coalesced (CHUNK, BLOCK_D) tile loads of u, delta, dout (and z); delta's softplus, delta*u and the
#      gated gradient g are written to a per-program scratch with channels contiguous, B and C to (CHUNK, N) rows;
#   2. forward recompute of the chunk's states from the saved chunk-start state, x_t into the scratch;
#   3. reverse walk of the adjoint h_t = a_{t+1} h_{t+1} + g_t C_t, h_t into the scratch;
#   4. epilogue on (CHUNK, BLOCK_D, N) tiles of x and h: every gradient, with the reductions over state (du,
#      ddelta, dz) and over channels (dB, dC partials) done once per chunk and the stores coalesced.
# The scratch (a few tens of KiB per program) is rewritten every chunk, so it stays in L2.


@triton.jit
def _tiled_bwd_state_step(s, x, v_dt, v_dtu, v_B, v_C, v_x, v_y, A2, offs_dl, offs_n, mat_dn, STORE_Y: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    dts = tl.load(v_dt + s * BLOCK_D + offs_dl)
    dtus = tl.load(v_dtu + s * BLOCK_D + offs_dl)
    Bs = tl.load(v_B + s * BLOCK_N + offs_n)
    x = tl.exp2(dts[:, None] * A2) * x + dtus[:, None] * Bs[None, :]
    tl.store(v_x + s * (BLOCK_D * BLOCK_N) + mat_dn, x)
    if STORE_Y:
        Cs = tl.load(v_C + s * BLOCK_N + offs_n)
        tl.store(v_y + s * BLOCK_D + offs_dl, tl.sum(x * Cs[None, :], axis=1))
    return x


@triton.jit
def _tiled_bwd_adjoint_step(s, tau, h, a_next, dA_acc, dlast, v_dt, v_dtu, v_g, v_B, v_C, v_x, v_h, v_hB, v_hxA, A,
                            A2, L, offs_dl, offs_n, mat_dn, LEAN: tl.constexpr, HAS_DLAST: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    dts = tl.load(v_dt + s * BLOCK_D + offs_dl)
    gs = tl.load(v_g + s * BLOCK_D + offs_dl)
    Cs = tl.load(v_C + s * BLOCK_N + offs_n)
    h = a_next * h + gs[:, None] * Cs[None, :]
    if HAS_DLAST:
        h += tl.where((offs_n[None, :] * 0 + tau) == L - 1, dlast, 0.0)
    tl.store(v_h + s * (BLOCK_D * BLOCK_N) + mat_dn, h)
    a_next = tl.exp2(dts[:, None] * A2)
    if LEAN:
        dtus = tl.load(v_dtu + s * BLOCK_D + offs_dl)
        Bs = tl.load(v_B + s * BLOCK_N + offs_n)
        xs = tl.load(v_x + s * (BLOCK_D * BLOCK_N) + mat_dn)
        hxs = h * (xs - dtus[:, None] * Bs[None, :])  # h_t * a_t x_{t-1}
        dA_acc += hxs * dts[:, None]
        tl.store(v_hB + s * BLOCK_D + offs_dl, tl.sum(h * Bs[None, :], axis=1))
        tl.store(v_hxA + s * BLOCK_D + offs_dl, tl.sum(hxs * A, axis=1))
    return h, a_next, dA_acc


@triton.jit
def _tiled_bwd_kernel(u_ptr, dl_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, dout_ptr, state_ptr, dlast_ptr,
                      seg_state_ptr, seg_sum_ptr, scratch_ptr, du_ptr, ddl_ptr, dz_ptr, col_ptr, bc_ptr,
                      dim, L, G, DG, N, NCHUNK, NDBLK, DIR, NDIR, NCOL, SEG_CHUNKS,
                      SEG_PASS: tl.constexpr, REVERSE: tl.constexpr, ACCUM: tl.constexpr, HAS_D: tl.constexpr,
                      HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, LOAD_STATES: tl.constexpr,
                      HAS_DLAST: tl.constexpr, LEAN: tl.constexpr, UNROLL: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    # LEAN: the reverse walk also does the per-step work that reduces over the state only (dA, h.B, hx.A, and y
    # for dz), parking (CHUNK, BLOCK_D) vectors in the scratch, so the epilogue's (CHUNK, BLOCK_D, N) tiles are
    # only x and h for dB and dC (fewer live registers); otherwise the epilogue does all of it.
    # Segments (see _tiled_fwd_kernel): SEG_PASS 1 walks only the adjoint through this program's segment from a
    # zero carry and records a_first * h_first (the carry it hands to the segment before); SEG_PASS 2 composes the
    # later segments' records into its carry, h = (that carry) + g C at its last token, and computes every gradient
    # of its segment. dA, d delta_bias and dD partials get one row per (batch, segment).
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
    offs_s = tl.arange(0, CHUNK)
    row_off = (i_b * dim + d).to(tl.int64) * L
    bc_off = pid_bg.to(tl.int64) * N * L
    part_off = (pid_bg * NDBLK + pid_d).to(tl.int64) * 2 * N * L  # dB's row; dC's follows at + N * L
    # scratch regions: (CHUNK, BLOCK_D) delta, delta*u, g, h.B, hx.A, y; (CHUNK, BLOCK_N) B, C;
    # (CHUNK, BLOCK_D, BLOCK_N) x, h
    SD = CHUNK * BLOCK_D
    SN = CHUNK * BLOCK_N
    SDN = CHUNK * BLOCK_D * BLOCK_N
    program = (seg * tl.num_programs(1) + pid_bg) * NDBLK + pid_d
    scr = scratch_ptr + program.to(tl.int64) * (6 * SD + 2 * SN + 2 * SDN)
    v_dt = scr
    v_dtu = scr + SD
    v_g = scr + 2 * SD
    v_hB = scr + 3 * SD
    v_hxA = scr + 4 * SD
    v_y = scr + 5 * SD
    v_B = scr + 6 * SD
    v_C = v_B + SN
    v_x = v_C + SN
    v_h = v_x + SDN
    vec_sd = offs_s[:, None] * BLOCK_D + offs_dl[None, :]
    vec_sn = offs_s[:, None] * BLOCK_N + offs_n[None, :]
    mat_dn = offs_dl[:, None] * BLOCK_N + offs_n[None, :]
    mat_sdn = offs_s[:, None, None] * (BLOCK_D * BLOCK_N) + mat_dn[None, :, :]

    A = tl.load(A_ptr + d[:, None] * N + offs_n[None, :], mask=mask_dn, other=0.0).to(tl.float32)
    A2 = A * 1.4426950408889634
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
    Dv = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
    state_off = ((i_b * NDIR + DIR) * dim + d).to(tl.int64)[:, None] * NCHUNK * N + offs_n[None, :]
    vec_off = (i_b * dim + d).to(tl.int64)
    mat_off = vec_off[:, None] * N + offs_n[None, :]
    # partial sums, one row of NCOL per (batch, segment): dA (dim x N), then d delta_bias (dim), then dD (dim)
    col_row = (i_b * nseg + seg).to(tl.int64) * NCOL
    cmat_off = col_row + d[:, None] * N + offs_n[None, :]
    cvec_off = col_row + dim * N + d
    seg_row = ((i_b * NDIR + DIR) * nseg).to(tl.int64)
    seg_dn = d[:, None] * N + offs_n[None, :]
    c_lo = seg * SEG_CHUNKS
    seg_chunks = tl.minimum(NCHUNK, c_lo + SEG_CHUNKS) - c_lo
    dlast = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    if HAS_DLAST:
        dlast = tl.load(dlast_ptr + mat_off, mask=mask_dn, other=0.0).to(tl.float32)

    h = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    a_next = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)  # a_{t+1}; zero past the end
    dA_acc = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    dD_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dbias_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if SEG_PASS == 1:
        for i in range(0, seg_chunks):
            c = c_lo + seg_chunks - 1 - i
            tau = c * CHUNK + offs_s
            mask_s = tau < L
            if REVERSE:
                t = L - 1 - tau
            else:
                t = tau
            m2 = mask_s[:, None] & mask_d[None, :]
            p2 = row_off[None, :] + t[:, None]
            dt_in = tl.load(dl_ptr + p2, mask=m2, other=0.0).to(tl.float32)
            if HAS_BIAS:
                dt_in += bias[None, :]
            if SOFTPLUS:
                dt = _softplus(dt_in)
            else:
                dt = dt_in
            dt = tl.where(m2, dt, 0.0)
            do = tl.load(dout_ptr + p2, mask=m2, other=0.0).to(tl.float32)
            if HAS_Z:
                zt = tl.load(z_ptr + p2, mask=m2, other=0.0).to(tl.float32)
                g = do * zt * tl.sigmoid(zt)
            else:
                g = do
            pbc = bc_off + offs_n[None, :] * L + t[:, None]
            tl.store(v_dt + vec_sd, dt)
            tl.store(v_g + vec_sd, g)
            tl.store(v_C + vec_sn, tl.load(C_ptr + pbc, mask=mask_s[:, None] & mask_n[None, :], other=0.0).to(
                tl.float32))
            tl.debug_barrier()
            for s2 in tl.static_range(CHUNK):
                h, a_next, dA_acc = _tiled_bwd_adjoint_step(
                    CHUNK - 1 - s2, c * CHUNK + CHUNK - 1 - s2, h, a_next, dA_acc, dlast, v_dt, v_dtu, v_g, v_B,
                    v_C, v_x, v_h, v_hB, v_hxA, A, A2, L, offs_dl, offs_n, mat_dn, False, HAS_DLAST, BLOCK_D,
                    BLOCK_N)
            tl.debug_barrier()
        tl.store(seg_state_ptr + (seg_row + seg) * dim * N + seg_dn, a_next * h, mask=mask_dn)
    else:
        if SEG_PASS == 2:
            # the carry from the later segments: after segment j, carry = (its record) + exp(A * its sum of delta)
            # times the carry into it
            for jj in range(0, nseg - 1 - seg):
                j = nseg - 1 - jj
                rec_j = tl.load(seg_state_ptr + (seg_row + j) * dim * N + seg_dn, mask=mask_dn, other=0.0)
                sum_j = tl.load(seg_sum_ptr + (seg_row + j) * dim + d, mask=mask_d, other=0.0)
                h = rec_j + tl.exp2(sum_j[:, None] * A2) * h
            a_next = tl.full((BLOCK_D, BLOCK_N), 1.0, dtype=tl.float32)
        for i in range(0, seg_chunks):
            c = c_lo + seg_chunks - 1 - i
            tau = c * CHUNK + offs_s
            mask_s = tau < L
            if REVERSE:
                t = L - 1 - tau
            else:
                t = tau
            # 1. prologue: (CHUNK, BLOCK_D) tiles, time along the first axis
            m2 = mask_s[:, None] & mask_d[None, :]
            p2 = row_off[None, :] + t[:, None]
            u = tl.load(u_ptr + p2, mask=m2, other=0.0).to(tl.float32)
            dt_in = tl.load(dl_ptr + p2, mask=m2, other=0.0).to(tl.float32)
            if HAS_BIAS:
                dt_in += bias[None, :]
            if SOFTPLUS:
                dt = _softplus(dt_in)
            else:
                dt = dt_in
            dt = tl.where(m2, dt, 0.0)
            dtu = dt * u
            do = tl.load(dout_ptr + p2, mask=m2, other=0.0).to(tl.float32)
            if HAS_Z:
                zt = tl.load(z_ptr + p2, mask=m2, other=0.0).to(tl.float32)
                sz = tl.sigmoid(zt)
                g = do * zt * sz
            else:
                g = do
            mbc = mask_s[:, None] & mask_n[None, :]
            pbc = bc_off + offs_n[None, :] * L + t[:, None]
            Bt = tl.load(B_ptr + pbc, mask=mbc, other=0.0).to(tl.float32)
            Ct = tl.load(C_ptr + pbc, mask=mbc, other=0.0).to(tl.float32)
            tl.store(v_dt + vec_sd, dt)
            tl.store(v_dtu + vec_sd, dtu)
            tl.store(v_g + vec_sd, g)
            tl.store(v_B + vec_sn, Bt)
            tl.store(v_C + vec_sn, Ct)
            tl.debug_barrier()

            # 2. the chunk's states (padded steps: delta = 0, so a = 1, b = 0)
            if LOAD_STATES:
                x = tl.load(state_ptr + state_off + c * N, mask=mask_dn, other=0.0)
            else:
                x = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
            # (UNROLL: the step loops unrolled, so the compiler can issue the scratch loads of later steps early)
            if UNROLL:
                for s in tl.static_range(CHUNK):
                    x = _tiled_bwd_state_step(s, x, v_dt, v_dtu, v_B, v_C, v_x, v_y, A2, offs_dl, offs_n, mat_dn,
                                              LEAN and HAS_Z, BLOCK_D, BLOCK_N)
            else:
                for s in range(0, CHUNK):
                    x = _tiled_bwd_state_step(s, x, v_dt, v_dtu, v_B, v_C, v_x, v_y, A2, offs_dl, offs_n, mat_dn,
                                              LEAN and HAS_Z, BLOCK_D, BLOCK_N)

            # 3. the adjoint, last step first (padded steps: g = 0 and h starts at zero, so h stays zero there)
            if UNROLL:
                for s2 in tl.static_range(CHUNK):
                    h, a_next, dA_acc = _tiled_bwd_adjoint_step(
                        CHUNK - 1 - s2, c * CHUNK + CHUNK - 1 - s2, h, a_next, dA_acc, dlast, v_dt, v_dtu, v_g, v_B,
                        v_C, v_x, v_h, v_hB, v_hxA, A, A2, L, offs_dl, offs_n, mat_dn, LEAN, HAS_DLAST, BLOCK_D,
                        BLOCK_N)
            else:
                for s2 in range(0, CHUNK):
                    h, a_next, dA_acc = _tiled_bwd_adjoint_step(
                        CHUNK - 1 - s2, c * CHUNK + CHUNK - 1 - s2, h, a_next, dA_acc, dlast, v_dt, v_dtu, v_g, v_B,
                        v_C, v_x, v_h, v_hB, v_hxA, A, A2, L, offs_dl, offs_n, mat_dn, LEAN, HAS_DLAST, BLOCK_D,
                        BLOCK_N)
            tl.debug_barrier()

            # 4. epilogue on the whole chunk
            X = tl.load(v_x + mat_sdn)
            H = tl.load(v_h + mat_sdn)
            if LEAN:
                hB = tl.load(v_hB + vec_sd)
                ddt = tl.load(v_hxA + vec_sd) + u * hB
            else:
                hx = H * (X - dtu[:, :, None] * Bt[:, None, :])  # h_t * a_t x_{t-1}
                dA_acc += tl.sum(hx * dt[:, :, None], axis=0)
                hB = tl.sum(H * Bt[:, None, :], axis=2)
                ddt = tl.sum(hx * A[None, :, :], axis=2) + u * hB
            du = dt * hB
            if HAS_D and not ACCUM:
                du += g * Dv[None, :]
                dD_acc += tl.sum(g * u, axis=0)
            if HAS_Z:
                if LEAN:
                    y = tl.load(v_y + vec_sd)
                else:
                    y = tl.sum(X * Ct[:, None, :], axis=2)
                if HAS_D and not ACCUM:
                    y += Dv[None, :] * u
                dz = do * sz * (1.0 + zt * (1.0 - sz)) * y
                if ACCUM:
                    dz += tl.load(dz_ptr + p2, mask=m2, other=0.0).to(tl.float32)
                tl.store(dz_ptr + p2, dz.to(dz_ptr.dtype.element_ty), mask=m2)
            if SOFTPLUS:
                ddt = ddt * tl.sigmoid(dt_in)
            ddt = tl.where(m2, ddt, 0.0)
            dbias_acc += tl.sum(ddt, axis=0)
            if ACCUM:
                du += tl.load(du_ptr + p2, mask=m2, other=0.0).to(tl.float32)
                ddt += tl.load(ddl_ptr + p2, mask=m2, other=0.0).to(tl.float32)
            tl.store(du_ptr + p2, du.to(du_ptr.dtype.element_ty), mask=m2)
            tl.store(ddl_ptr + p2, ddt.to(ddl_ptr.dtype.element_ty), mask=m2)
            dBc = tl.sum(H * dtu[:, :, None], axis=1)
            dCc = tl.sum(X * g[:, :, None], axis=1)
            _store_bc_partials(bc_ptr, part_off + offs_n[None, :] * L + t[:, None], dBc, dCc, mbc, N, L, ACCUM)
            # the next chunk's prologue overwrites the scratch this epilogue read
            tl.debug_barrier()

        _store_col_partials(col_ptr, cmat_off, cvec_off, dA_acc, dbias_acc, dD_acc, mask_dn, mask_d, dim, ACCUM,
                            HAS_D)


@triton.jit
def _bwd_finalize_kernel(col_ptr, bc_ptr, dA_ptr, dB_ptr, dC_ptr, dD_ptr, dbias_ptr, batch, NCOL, DN, dim,
                         NBC, NL, NDBLK, NPROG_BC, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # One launch for every reduction the backward leaves (instead of ~8 small PyTorch ops, each a launch on the
    # host): programs [0, NPROG_BC) sum dB/dC over channel blocks, the rest sum dA / d delta_bias / dD over
    # batch; each writes the final gradient in its input's dtype. Fixed summation order: deterministic.
    pid = tl.program_id(0)
    if pid < NPROG_BC:
        offs = pid.to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
        mask = offs < NBC * 2 * NL
        row = offs // (2 * NL)  # (batch, group) row
        rem = offs % (2 * NL)  # dB's (N, L) block, then dC's
        src = row * NDBLK * 2 * NL + rem
        acc_bc = tl.zeros((BLOCK_E,), dtype=tl.float32)
        for blk in range(0, NDBLK):
            acc_bc += tl.load(bc_ptr + src + blk * 2 * NL, mask=mask, other=0.0)
        dst = row * NL + rem % NL
        is_b = rem < NL
        tl.store(dB_ptr + dst, acc_bc.to(dB_ptr.dtype.element_ty), mask=mask & is_b)
        tl.store(dC_ptr + dst, acc_bc.to(dC_ptr.dtype.element_ty), mask=mask & (rem >= NL))
    else:
        cols = (pid - NPROG_BC) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask_c = cols < NCOL
        offs_r = tl.arange(0, BLOCK_R)
        acc_col = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for r0 in range(0, batch, BLOCK_R):
            rows = r0 + offs_r
            m = (rows < batch)[:, None] & mask_c[None, :]
            tile = tl.load(col_ptr + rows.to(tl.int64)[:, None] * NCOL + cols[None, :], mask=m, other=0.0)
            acc_col += tl.sum(tile, axis=0)
        tl.store(dA_ptr + cols, acc_col.to(dA_ptr.dtype.element_ty), mask=cols < DN)
        if HAS_BIAS:
            tl.store(dbias_ptr + tl.maximum(cols - DN, 0), acc_col.to(dbias_ptr.dtype.element_ty),
                     mask=(cols >= DN) & (cols < DN + dim))
        if HAS_D:
            tl.store(dD_ptr + tl.maximum(cols - DN - dim, 0), acc_col.to(dD_ptr.dtype.element_ty),
                     mask=(cols >= DN + dim) & mask_c)


@input_guard
def _forward(u, delta, A, B, C, D, z, delta_bias, softplus, causal, return_last_state, save_states):
    """Returns the output, the last state (or None), the saved chunk-start states (or None), the segments' sums of
    delta (or None) and the launch config, which the backward must reuse (the states are saved every ``block_l``
    tokens, the segments are the forward's)."""
    batch, dim, length = u.shape
    nstate = A.shape[1]
    groups = B.shape[1] if B.dim() == 4 else 1  # (batch, N, L) is one group: the kernels index B and C flat
    per_group = dim // groups
    cfg = _launch_config(length, nstate, per_group, batch * groups)
    block_l, block_d, block_n = cfg["block_l"], cfg["block_d_fwd"], cfg["block_n"]
    nchunk = cdiv(length, block_l)
    ndir = 1 if causal else 2
    save_states = save_states and nchunk > 1
    dev = u.device
    out = empty_output((batch, dim, length), device=dev, dtype=u.dtype)
    ybuf = torch.empty((batch, dim, length), device=dev, dtype=torch.float32) if not causal else out
    states = torch.empty((batch, ndir, dim, nchunk, nstate), device=dev, dtype=torch.float32) if save_states else None
    last = empty_output((batch, dim, nstate), device=dev, dtype=torch.float32) if return_last_state else None
    flags = {"BIDIR": not causal, "HAS_D": D is not None, "HAS_Z": z is not None, "HAS_BIAS": delta_bias is not None,
             "SOFTPLUS": softplus, "SAVE_STATES": save_states, "BLOCK_D": block_d, "BLOCK_N": block_n,
             "num_warps": cfg["warps_fwd"]}
    tensors = (u, delta, A, B, C, D, z, delta_bias, out, ybuf, states, last)
    seg_sum = None
    if cfg["path"] == "seq":
        nseg = cfg["segments"]
        grid = (cdiv(per_group, block_d), batch * groups, nseg)
        scratch = torch.empty((grid[0] * grid[1] * nseg, block_l * (3 * block_d + 2 * block_n)), device=dev,
                              dtype=torch.float32)
        seg_state = (empty_output((batch, ndir, nseg, dim, nstate), device=dev, dtype=torch.float32) if nseg > 1
                     else None)
        seg_sum = empty_output((batch, ndir, nseg, dim), device=dev, dtype=torch.float32) if nseg > 1 else None

        def launch(seg_pass, direction, return_last):
            _tiled_fwd_kernel[grid](*tensors, seg_state, seg_sum, scratch, dim, length, groups, per_group, nstate,
                                    nchunk, cfg["seg_chunks"], DIRECTION=direction, SEG_PASS=seg_pass,
                                    RETURN_LAST=return_last, UNROLL=cfg.get("unroll", False), CHUNK=block_l, **flags)

        if nseg == 1:
            launch(0, -1, return_last_state)
        else:
            launch(1, -1, False)  # both directions' segment records (no program reads another's)
            if causal:
                launch(2, -1, return_last_state)
            else:  # the reverse direction reads y_fwd that other programs wrote
                launch(2, 0, False)
                launch(2, 1, False)
    else:
        grid = (cdiv(per_group, block_d), batch * groups)
        _selective_scan_fwd_kernel[grid](*tensors, dim, length, groups, per_group, nstate, nchunk, BLOCK_L=block_l,
                                         RETURN_LAST=return_last_state, **flags)
    return out, last, states, seg_sum, cfg


@input_guard
def _backward(dout, dlast, u, delta, A, B, C, D, z, delta_bias, states, seg_sum, softplus, causal, cfg):
    batch, dim, length = u.shape
    nstate = A.shape[1]
    groups = B.shape[1] if B.dim() == 4 else 1  # (batch, N, L) is one group: the kernels index B and C flat
    per_group = dim // groups
    block_l, block_d, block_n = cfg["block_l"], cfg["block_d_bwd"], cfg["block_n"]
    nchunk = cdiv(length, block_l)
    ndblk = cdiv(per_group, block_d)
    ndir = 1 if causal else 2
    seq = cfg["path"] == "seq"
    nseg = cfg["segments"] if seq else 1
    dev = u.device
    du = empty_output(u.shape, device=dev, dtype=u.dtype)
    ddelta = empty_output(delta.shape, device=dev, dtype=delta.dtype)
    dz = empty_output(z.shape, device=dev, dtype=z.dtype) if z is not None else None
    # partial sums, reduced by _bwd_finalize_kernel: per (batch, segment), one row of dA, d delta_bias, dD; per
    # (batch, group, channel block), dB's and dC's (N, L) blocks
    ncol = dim * nstate + 2 * dim
    col_part = empty_output((batch * nseg, ncol), device=dev, dtype=torch.float32)
    bc_part = empty_output((batch * groups * ndblk, 2, nstate, length), device=dev, dtype=torch.float32)
    if seq:  # per program: (CHUNK, BLOCK_D) x 6 vectors, (CHUNK, N) x 2 rows, (CHUNK, BLOCK_D, N) x 2 states
        per_program = block_l * (6 * block_d + 2 * block_n + 2 * block_d * block_n)
        scratch = torch.empty((batch * groups * ndblk * nseg, per_program), device=dev, dtype=torch.float32)
        seg_carry = (empty_output((batch, ndir, nseg, dim, nstate), device=dev, dtype=torch.float32) if nseg > 1
                     else None)
    for direction in range(ndir):
        flags = {"REVERSE": direction == 1, "ACCUM": direction == 1, "HAS_D": D is not None, "HAS_Z": z is not None,
                 "HAS_BIAS": delta_bias is not None, "SOFTPLUS": softplus, "LOAD_STATES": states is not None,
                 "HAS_DLAST": dlast is not None, "BLOCK_D": block_d, "BLOCK_N": block_n,
                 "num_warps": cfg["warps_bwd"]}
        sizes = (dim, length, groups, per_group, nstate, nchunk, ndblk, direction, ndir, ncol)
        if seq:
            for seg_pass in (1, 2) if nseg > 1 else (0,):
                _tiled_bwd_kernel[(ndblk, batch * groups, nseg)](
                    u, delta, A, B, C, D, z, delta_bias, dout, states, dlast, seg_carry, seg_sum, scratch, du, ddelta,
                    dz, col_part, bc_part, *sizes, cfg["seg_chunks"], SEG_PASS=seg_pass, LEAN=cfg.get("lean", True),
                    UNROLL=cfg.get("unroll", False), CHUNK=block_l, **flags)
        else:
            _selective_scan_bwd_kernel[(ndblk, batch * groups)](
                u, delta, A, B, C, D, z, delta_bias, dout, states, dlast, du, ddelta, dz, col_part, bc_part, *sizes,
                BLOCK_L=block_l, **flags)
    dA = empty_output(A.shape, device=dev, dtype=A.dtype)
    dB = empty_output(B.shape, device=dev, dtype=B.dtype)
    dC = empty_output(C.shape, device=dev, dtype=C.dtype)
    dD = empty_output(D.shape, device=dev, dtype=D.dtype) if D is not None else None
    dbias = empty_output(delta_bias.shape, device=dev, dtype=delta_bias.dtype) if delta_bias is not None else None
    block_e, block_c = 1024, 64
    nprog_bc = cdiv(batch * groups * 2 * nstate * length, block_e)
    _bwd_finalize_kernel[(nprog_bc + cdiv(ncol, block_c),)](
        col_part, bc_part, dA, dB, dC, dD, dbias, batch * nseg, ncol, dim * nstate, dim, batch * groups,
        nstate * length, ndblk, nprog_bc, HAS_D=D is not None, HAS_BIAS=delta_bias is not None, BLOCK_E=block_e,
        BLOCK_R=32, BLOCK_C=block_c, num_warps=4)
    return du, ddelta, dA, dB, dC, dD, dz, dbias


class SelectiveScanFunction(torch.autograd.Function):
    @staticmethod
    @autocast_custom_fwd
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, softplus, causal, return_last_state):
        save = any(ctx.needs_input_grad[:8])
        out, last, states, seg_sum, cfg = _forward(u, delta, A, B, C, D, z, delta_bias, softplus, causal,
                                                   return_last_state, save)
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, states, seg_sum)
        ctx.flags = (softplus, causal, return_last_state)
        ctx.cfg = cfg
        return (out, last) if return_last_state else out

    @staticmethod
    @autocast_custom_bwd
    def backward(ctx, dout, dlast=None):
        u, delta, A, B, C, D, z, delta_bias, states, seg_sum = ctx.saved_tensors
        softplus, causal, return_last_state = ctx.flags
        if dlast is not None and not return_last_state:
            dlast = None
        grads = _backward(dout, dlast, u, delta, A, B, C, D, z, delta_bias, states, seg_sum, softplus, causal,
                          ctx.cfg)
        return (*grads, None, None, None)


# torch.compile runs the kernels as they are (a graph break): traced, the launch shapes derived from dynamic sizes
# become symbolic, which Triton's launch options cannot take (num_warps), and nothing would be fused anyway.
@torch.compiler.disable
def selective_scan_triton(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, *,
                          causal=True, return_last_state=False):
    """The Triton path of :func:`visionssm.kernels.selective_scan` (arguments already validated)."""
    return SelectiveScanFunction.apply(u, delta, A, B, C, D, z, delta_bias, delta_softplus, causal,
                                       return_last_state)
