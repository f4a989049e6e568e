"""Forward kernel of the Mamba-1 selective scan, causal and bidirectional.

One program per (block of ``BLOCK_D`` channels, batch x group of B/C, time segment) keeps the ``(BLOCK_D, N)`` state
in fp32 registers; inputs may be fp32/fp16/bf16 and are upcast on load. The recurrence walks time one token per
loop iteration (``x = exp2(δA') x + δuB``, ``y = Σ_n C x``): an exp2 and two FMAs per state element per step.

Rows are L tokens apart, so stepping straight through memory would touch BLOCK_D cache lines per access (the
load/store unit, not DRAM, would be the limit). Instead, per chunk of ``CHUNK`` tokens, coalesced (CHUNK, BLOCK_D)
tile loads fill a small per-program scratch (L2-resident) laid out channel-contiguous; the step loop reads one
contiguous row per step, and the output is written as one tile. With a gradient pending, the state entering every
chunk is saved for the backward.

Bidirectional (``BIDIR``): the reverse-time direction is the same loop with time indices mirrored
(``t = L - 1 - τ``); the first pass parks ``y_fwd`` in an fp32 buffer, the second adds ``y_rev`` and applies ``D·u``
and the gate once.

Long sequences with few programs are split along time into segments (see :func:`selective_scan_fwd_kernel`); the
launch code in :mod:`.launch` decides when.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel_common import chunk_tile, load_channel_params, load_delta, program_block

__all__ = ["selective_scan_fwd_kernel"]


#: The arguments each kernel stores to (some only under a constexpr flag): all that torch.compile's analysis of a
#: launch may take as written (tools/inductor_check.py, tests/kernels/test_inductor_writes.py).
WRITES = {"selective_scan_fwd_kernel": {"last_ptr", "out_ptr", "scratch_ptr", "seg_state_ptr", "seg_sum_ptr",
                                        "state_ptr", "ybuf_ptr"}}


@triton.jit
def _fwd_step(s, x, v_dt, v_dtu, v_y, v_B, v_C, A2, offs_dl, offs_n, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    dts = tl.load(v_dt + s * BLOCK_D + offs_dl)
    dtus = tl.load(v_dtu + s * BLOCK_D + offs_dl)
    Bs = tl.load(v_B + s * BLOCK_N + offs_n)
    Cs = tl.load(v_C + s * BLOCK_N + offs_n)
    x = tl.exp2(dts[:, None] * A2) * x + dtus[:, None] * Bs[None, :]
    tl.store(v_y + s * BLOCK_D + offs_dl, tl.sum(x * Cs[None, :], axis=1))
    return x


@triton.jit
def _fwd_segment_start(seg_state_ptr, seg_sum_ptr, seg_row, seg, seg_dn, A2, d, mask_d, mask_dn, dim, N,
                       BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    # x after segment j = exp(A * sum of delta over j) x before it + (segment j's state from zero)
    x = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    for j in range(0, seg):
        end_j = tl.load(seg_state_ptr + (seg_row + j) * dim * N + seg_dn, mask=mask_dn, other=0.0)
        sum_j = tl.load(seg_sum_ptr + (seg_row + j) * dim + d, mask=mask_d, other=0.0)
        x = tl.exp2(sum_j[:, None] * A2) * x + end_j
    return x


@triton.jit
def _fwd_chunk_load(u_ptr, dl_ptr, B_ptr, C_ptr, state_ptr, v_dt, v_dtu, v_B, v_C, x, dt_sum, c, mask_s, t, m2, p2,
                    bc_off, state_off, bias, mask_dn, offs_n, mask_n, vec_sd, vec_sn, L, N, SEG_PASS: tl.constexpr,
                    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, SAVE_STATES: tl.constexpr):
    # Coalesced (CHUNK, BLOCK_D) tile loads into the channel-contiguous scratch; saves the state entering chunk c.
    # The tile's offsets (chunk_tile) come from the caller: torch's mutation analysis of a wrap_triton launch counts
    # every pointer argument of a helper whose result addresses a store as written.
    u = tl.load(u_ptr + p2, mask=m2, other=0.0).to(tl.float32)
    _, dt = load_delta(dl_ptr, p2, m2, bias, HAS_BIAS, SOFTPLUS)
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
    return u, dt_sum


@triton.jit
def _fwd_chunk_store(z_ptr, out_ptr, ybuf_ptr, v_y, u, Dv, m2, p2, vec_sd, MODE: tl.constexpr, HAS_D: tl.constexpr,
                     HAS_Z: tl.constexpr):
    # MODE 0: write the final output; 1: park y in ybuf (first direction); 2: add ybuf, then write the output.
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


@triton.jit
def _fwd_pass(u_ptr, dl_ptr, B_ptr, C_ptr, z_ptr, out_ptr, ybuf_ptr, state_ptr, last_ptr, seg_state_ptr, seg_sum_ptr,
              scr, row_off, bc_off, state_off, last_off, seg_row, A2, bias, Dv, d, mask_d, offs_n, mask_n, dim, L, N,
              NCHUNK, seg, SEG_CHUNKS, REVERSE: tl.constexpr, MODE: tl.constexpr, SEG_PASS: tl.constexpr,
              HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
              SAVE_STATES: tl.constexpr, RETURN_LAST: tl.constexpr, CHUNK: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    # One direction over chunks [seg * SEG_CHUNKS, +SEG_CHUNKS) of the sequence (all of it unless the sequence is
    # split into segments, see selective_scan_fwd_kernel). Per chunk: tile loads into the scratch, the recurrence
    # one step per iteration reading that scratch (y_t back into it), then the output written as one tile.
    # SEG_PASS 1 only records the segment's end state from a zero start and its sum of delta; SEG_PASS 2 starts from
    # the state the earlier segments' records compose to.
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
    if SEG_PASS == 2:
        x = _fwd_segment_start(seg_state_ptr, seg_sum_ptr, seg_row, seg, seg_dn, A2, d, mask_d, mask_dn, dim, N,
                               BLOCK_D, BLOCK_N)
    else:
        x = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    dt_sum = tl.zeros((BLOCK_D,), dtype=tl.float32)
    c_lo = seg * SEG_CHUNKS
    for c in range(c_lo, tl.minimum(NCHUNK, c_lo + SEG_CHUNKS)):
        mask_s, t, m2, p2 = chunk_tile(c, offs_s, mask_d, row_off, L, REVERSE, CHUNK)
        u, dt_sum = _fwd_chunk_load(u_ptr, dl_ptr, B_ptr, C_ptr, state_ptr, v_dt, v_dtu, v_B, v_C, x, dt_sum, c,
                                    mask_s, t, m2, p2, bc_off, state_off, bias, mask_dn, offs_n, mask_n, vec_sd,
                                    vec_sn, L, N, SEG_PASS, HAS_BIAS, SOFTPLUS, SAVE_STATES)
        for s in tl.static_range(CHUNK):
            x = _fwd_step(s, x, v_dt, v_dtu, v_y, v_B, v_C, A2, offs_dl, offs_n, BLOCK_D, BLOCK_N)
        tl.debug_barrier()
        if SEG_PASS != 1:
            _fwd_chunk_store(z_ptr, out_ptr, ybuf_ptr, v_y, u, Dv, m2, p2, vec_sd, MODE, HAS_D, HAS_Z)
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
def selective_scan_fwd_kernel(u_ptr, dl_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, out_ptr, ybuf_ptr,
                              state_ptr, last_ptr, seg_state_ptr, seg_sum_ptr, scratch_ptr, dim, L, G, DG, N, NCHUNK,
                              SEG_CHUNKS, BIDIR: tl.constexpr, DIRECTION: tl.constexpr, SEG_PASS: tl.constexpr,
                              HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
                              SOFTPLUS: tl.constexpr, SAVE_STATES: tl.constexpr, RETURN_LAST: tl.constexpr,
                              CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    # Grid: (channel blocks, batch x groups, segments). Long sequences with too few (batch, channel block)
    # programs to fill the GPU are split into segments of SEG_CHUNKS chunks, one program each, in two launches:
    # SEG_PASS 1 records each segment's end state from a zero start and its sum of delta (the decay over a segment
    # is exp(A * that sum)), SEG_PASS 2 composes the earlier segments' records into its start state and runs the
    # scan. DIRECTION (bidirectional only): -1 runs both directions in this program (y_fwd parked in ybuf, read
    # back by the reverse pass); 0 / 1 only one of them -- segmented, the reverse pass reads y_fwd written by
    # other programs, so it needs a launch of its own.
    pid_d, pid_bg, seg, nseg, i_b, _, d, mask_d, offs_n, mask_n, mask_dn, row_off, bc_off = program_block(
        dim, L, G, DG, N, BLOCK_D, BLOCK_N)
    program = (seg * tl.num_programs(1) + pid_bg) * tl.num_programs(0) + pid_d
    scr = scratch_ptr + tl.cast(program, tl.int64) * (CHUNK * (3 * BLOCK_D + 2 * BLOCK_N))
    _, A2, bias, Dv = load_channel_params(A_ptr, bias_ptr, D_ptr, d, offs_n, mask_d, mask_dn, N, HAS_BIAS, HAS_D,
                                          BLOCK_D)
    last_off = tl.cast(i_b * dim + d, tl.int64)[:, None] * N + offs_n[None, :]
    if BIDIR:
        state_off = tl.cast((i_b * 2) * dim + d, tl.int64)[:, None] * NCHUNK * N + offs_n[None, :]
        seg_row = tl.cast(i_b * 2 * nseg, tl.int64)
        if DIRECTION != 1:
            _fwd_pass(u_ptr, dl_ptr, B_ptr, C_ptr, z_ptr, out_ptr, ybuf_ptr, state_ptr, last_ptr, seg_state_ptr,
                      seg_sum_ptr, scr, row_off, bc_off, state_off, last_off, seg_row, A2, bias, Dv, d, mask_d,
                      offs_n, mask_n, dim, L, N, NCHUNK, seg, SEG_CHUNKS,
                      False, 1, SEG_PASS, HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, SAVE_STATES, False, CHUNK, BLOCK_D,
                      BLOCK_N)
        if DIRECTION == -1:
            # the second pass reads back what the first wrote, possibly from other threads of this program
            tl.debug_barrier()
        if DIRECTION != 0:
            _fwd_pass(u_ptr, dl_ptr, B_ptr, C_ptr, z_ptr, out_ptr, ybuf_ptr, state_ptr, last_ptr, seg_state_ptr,
                      seg_sum_ptr, scr, row_off, bc_off, state_off + dim * NCHUNK * N, last_off, seg_row + nseg, A2,
                      bias, Dv, d, mask_d, offs_n, mask_n, dim, L, N, NCHUNK, seg, SEG_CHUNKS,
                      True, 2, SEG_PASS, HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, SAVE_STATES, False, CHUNK, BLOCK_D,
                      BLOCK_N)
    else:
        state_off = tl.cast(i_b * dim + d, tl.int64)[:, None] * NCHUNK * N + offs_n[None, :]
        seg_base = tl.cast(i_b * nseg, tl.int64)
        _fwd_pass(u_ptr, dl_ptr, B_ptr, C_ptr, z_ptr, out_ptr, ybuf_ptr, state_ptr, last_ptr, seg_state_ptr,
                  seg_sum_ptr, scr, row_off, bc_off, state_off, last_off, seg_base, A2, bias, Dv, d,
                  mask_d, offs_n, mask_n, dim, L, N, NCHUNK, seg, SEG_CHUNKS,
                  False, 0, SEG_PASS, HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, SAVE_STATES, RETURN_LAST, CHUNK,
                  BLOCK_D, BLOCK_N)
