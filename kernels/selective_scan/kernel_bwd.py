"""Backward kernels of the Mamba-1 selective scan: the gradient walk and the finishing reduction.

:func:`selective_scan_bwd_kernel` walks the chunks last to first, recomputes each chunk's states from the state the
forward saved at its start, then walks the chunk backwards with the adjoint ``h_t = a_{t+1} h_{t+1} + g_t C_t``.
Gradients use ``a_t x_{t-1} = x_t - b_t`` (never a division by ``a``).

Stepping straight through memory (one token of each channel per step) would hit BLOCK_D cache lines per (BLOCK_D,)
access (rows of length L) and reduce dB/dC over channels every step. Here only the two recurrences stay
sequential; per chunk of CHUNK tokens:

1. prologue: coalesced (CHUNK, BLOCK_D) tile loads of u, delta, dout (and z); delta's softplus, delta*u and the
   gated gradient g are written to a per-program scratch with channels contiguous, B and C to (CHUNK, N) rows;
2. forward recompute of the chunk's states from the saved chunk-start state, x_t into the scratch;
3. reverse walk of the adjoint, h_t into the scratch;
4. epilogue on (CHUNK, BLOCK_D, N) tiles of x and h: every gradient, with the reductions over state (du, ddelta,
   dz) and over channels (dB, dC partials) done once per chunk and the stores coalesced.

The scratch (a few tens of KiB per program) is rewritten every chunk, so it stays in L2. Bidirectional scans run
one launch per direction, the second (``ACCUM``) adding to the first's gradients.

Reductions over channels (dB, dC) are written per channel block, those over batch and time (dA, dD, d delta_bias)
per (batch, segment); :func:`selective_scan_finish_kernel` sums them in a fixed order and writes every gradient in
its input's dtype (one launch instead of ~8 PyTorch ops: at MambaVision's shapes the eager backward is bound by
host-side launch work). No atomics, so the gradients are deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel_common import chunk_tile, load_channel_params, load_delta, load_gated_grad, program_block

__all__ = ["selective_scan_bwd_kernel", "selective_scan_finish_kernel"]


#: The arguments each kernel stores to (some only under a constexpr flag): all that torch.compile's analysis of a
#: launch may take as written (tools/inductor_check.py, tests/kernels/test_inductor_writes.py).
WRITES = {"selective_scan_bwd_kernel": {"bc_ptr", "col_ptr", "ddl_ptr", "du_ptr", "dz_ptr", "scratch_ptr",
                                        "seg_state_ptr"},
          "selective_scan_finish_kernel": {"dA_ptr", "dB_ptr", "dC_ptr", "dD_ptr", "dbias_ptr"}}


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
def _bwd_state_step(s, x, v_dt, v_dtu, v_B, v_C, v_x, v_y, A2, offs_dl, offs_n, mat_dn, STORE_Y: tl.constexpr,
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
def _bwd_adjoint_step(s, tau, h, a_next, dA_acc, dlast, v_dt, v_dtu, v_g, v_B, v_C, v_x, v_h, v_hB, v_hxA, A, A2, L,
                      offs_dl, offs_n, mat_dn, REDUCE: tl.constexpr, HAS_DLAST: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    # REDUCE: also the per-step reductions over the state (dA, h.B, hx.A), parked in the scratch for the epilogue
    dts = tl.load(v_dt + s * BLOCK_D + offs_dl)
    gs = tl.load(v_g + s * BLOCK_D + offs_dl)
    Cs = tl.load(v_C + s * BLOCK_N + offs_n)
    h = a_next * h + gs[:, None] * Cs[None, :]
    if HAS_DLAST:
        h += tl.where((offs_n[None, :] * 0 + tau) == L - 1, dlast, 0.0)
    tl.store(v_h + s * (BLOCK_D * BLOCK_N) + mat_dn, h)
    a_next = tl.exp2(dts[:, None] * A2)
    if REDUCE:
        dtus = tl.load(v_dtu + s * BLOCK_D + offs_dl)
        Bs = tl.load(v_B + s * BLOCK_N + offs_n)
        xs = tl.load(v_x + s * (BLOCK_D * BLOCK_N) + mat_dn)
        hxs = h * (xs - dtus[:, None] * Bs[None, :])  # h_t * a_t x_{t-1}
        dA_acc += hxs * dts[:, None]
        tl.store(v_hB + s * BLOCK_D + offs_dl, tl.sum(h * Bs[None, :], axis=1))
        tl.store(v_hxA + s * BLOCK_D + offs_dl, tl.sum(hxs * A, axis=1))
    return h, a_next, dA_acc


@triton.jit
def _bwd_segment_record(dl_ptr, C_ptr, z_ptr, dout_ptr, seg_state_ptr, v_dt, v_dtu, v_g, v_B, v_C, v_x, v_h, v_hB,
                        v_hxA, dlast, A, A2, bias, row_off, bc_off, seg_row, seg, seg_dn, c_lo, seg_chunks, mask_d,
                        mask_dn, offs_dl, offs_n, mask_n, offs_s, vec_sd, vec_sn, mat_dn, dim, L, N,
                        REVERSE: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                        HAS_DLAST: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    # SEG_PASS 1: only the adjoint through this program's segment from a zero carry; records a_first * h_first, the
    # carry it hands to the segment before
    h = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    a_next = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)  # a_{t+1}; zero past the end
    dA_acc = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    for i in range(0, seg_chunks):
        c = c_lo + seg_chunks - 1 - i
        mask_s, t, m2, p2 = chunk_tile(c, offs_s, mask_d, row_off, L, REVERSE, CHUNK)
        _, dt = load_delta(dl_ptr, p2, m2, bias, HAS_BIAS, SOFTPLUS)
        _, _, _, g = load_gated_grad(dout_ptr, z_ptr, p2, m2, HAS_Z)
        pbc = bc_off + offs_n[None, :] * L + t[:, None]
        tl.store(v_dt + vec_sd, dt)
        tl.store(v_g + vec_sd, g)
        tl.store(v_C + vec_sn, tl.load(C_ptr + pbc, mask=mask_s[:, None] & mask_n[None, :], other=0.0).to(
            tl.float32))
        tl.debug_barrier()
        for s2 in tl.static_range(CHUNK):
            h, a_next, dA_acc = _bwd_adjoint_step(
                CHUNK - 1 - s2, c * CHUNK + CHUNK - 1 - s2, h, a_next, dA_acc, dlast, v_dt, v_dtu, v_g, v_B,
                v_C, v_x, v_h, v_hB, v_hxA, A, A2, L, offs_dl, offs_n, mat_dn, False, HAS_DLAST, BLOCK_D,
                BLOCK_N)
        tl.debug_barrier()
    tl.store(seg_state_ptr + (seg_row + seg) * dim * N + seg_dn, a_next * h, mask=mask_dn)


@triton.jit
def _bwd_carry_in(seg_state_ptr, seg_sum_ptr, h, seg_row, seg, nseg, seg_dn, A2, d, mask_d, mask_dn, dim, N,
                  BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    # SEG_PASS 2: the carry from the later segments: after segment j, carry = (its record) + exp(A * its sum of
    # delta) times the carry into it
    for jj in range(0, nseg - 1 - seg):
        j = nseg - 1 - jj
        rec_j = tl.load(seg_state_ptr + (seg_row + j) * dim * N + seg_dn, mask=mask_dn, other=0.0)
        sum_j = tl.load(seg_sum_ptr + (seg_row + j) * dim + d, mask=mask_d, other=0.0)
        h = rec_j + tl.exp2(sum_j[:, None] * A2) * h
    a_next = tl.full((BLOCK_D, BLOCK_N), 1.0, dtype=tl.float32)
    return h, a_next


@triton.jit
def _bwd_chunk_load(u_ptr, dl_ptr, B_ptr, C_ptr, z_ptr, dout_ptr, v_dt, v_dtu, v_g, v_B, v_C, mask_s, t, m2, p2, bias,
                    bc_off, offs_n, mask_n, vec_sd, vec_sn, L, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
                    SOFTPLUS: tl.constexpr):
    # step 1, the prologue: (CHUNK, BLOCK_D) tiles, time along the first axis. Their offsets (chunk_tile) come from
    # the caller: torch's mutation analysis of a wrap_triton launch counts every pointer argument of a helper whose
    # result addresses a store as written.
    u = tl.load(u_ptr + p2, mask=m2, other=0.0).to(tl.float32)
    dt_in, dt = load_delta(dl_ptr, p2, m2, bias, HAS_BIAS, SOFTPLUS)
    dtu = dt * u
    do, zt, sz, g = load_gated_grad(dout_ptr, z_ptr, p2, m2, HAS_Z)
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
    return mbc, u, dt_in, dt, dtu, do, zt, sz, g, Bt, Ct


@triton.jit
def _bwd_chunk_walks(state_ptr, v_dt, v_dtu, v_g, v_B, v_C, v_x, v_h, v_y, v_hB, v_hxA, c, h, a_next, dA_acc, dlast,
                     A, A2, state_off, mask_dn, offs_dl, offs_n, mat_dn, L, N, LOAD_STATES: tl.constexpr,
                     HAS_Z: tl.constexpr, HAS_DLAST: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    # step 2, the chunk's states (padded steps: delta = 0, so a = 1, b = 0)
    if LOAD_STATES:
        x = tl.load(state_ptr + state_off + c * N, mask=mask_dn, other=0.0)
    else:
        x = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    # the step loops unrolled, so the compiler can issue the scratch loads of later steps early
    for s in tl.static_range(CHUNK):
        x = _bwd_state_step(s, x, v_dt, v_dtu, v_B, v_C, v_x, v_y, A2, offs_dl, offs_n, mat_dn, HAS_Z, BLOCK_D,
                            BLOCK_N)

    # step 3, the adjoint, last step first (padded steps: g = 0 and h starts at zero, so h stays zero there)
    for s2 in tl.static_range(CHUNK):
        h, a_next, dA_acc = _bwd_adjoint_step(
            CHUNK - 1 - s2, c * CHUNK + CHUNK - 1 - s2, h, a_next, dA_acc, dlast, v_dt, v_dtu, v_g, v_B,
            v_C, v_x, v_h, v_hB, v_hxA, A, A2, L, offs_dl, offs_n, mat_dn, True, HAS_DLAST, BLOCK_D,
            BLOCK_N)
    tl.debug_barrier()
    return h, a_next, dA_acc


@triton.jit
def _bwd_chunk_grads(du_ptr, ddl_ptr, dz_ptr, bc_ptr, v_x, v_h, v_y, v_hB, v_hxA, t, m2, p2, mbc, u, dt_in, dt, dtu,
                     do, zt, sz, g, Bt, Ct, A, Dv, dA_acc, dD_acc, dbias_acc, part_off, offs_n, vec_sd, mat_sdn, N, L,
                     ACCUM: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, SOFTPLUS: tl.constexpr):
    # step 4, the epilogue on the whole chunk: the reductions over the state were done by the reverse walk, so its
    # (CHUNK, BLOCK_D, N) tiles are only x and h for dB and dC (fewer live registers)
    X = tl.load(v_x + mat_sdn)
    H = tl.load(v_h + mat_sdn)
    hB = tl.load(v_hB + vec_sd)
    ddt = tl.load(v_hxA + vec_sd) + u * hB
    du = dt * hB
    if HAS_D and not ACCUM:
        du += g * Dv[None, :]
        dD_acc += tl.sum(g * u, axis=0)
    if HAS_Z:
        y = tl.load(v_y + vec_sd)
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
    return dA_acc, dD_acc, dbias_acc


@triton.jit
def _bwd_scratch(scratch_ptr, program, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    # a program's scratch regions: (CHUNK, BLOCK_D) delta, delta*u, g, h.B, hx.A, y; (CHUNK, BLOCK_N) B, C;
    # (CHUNK, BLOCK_D, BLOCK_N) x, h
    SD = CHUNK * BLOCK_D
    SN = CHUNK * BLOCK_N
    SDN = CHUNK * BLOCK_D * BLOCK_N
    scr = scratch_ptr + tl.cast(program, tl.int64) * (6 * SD + 2 * SN + 2 * SDN)
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
    return v_dt, v_dtu, v_g, v_hB, v_hxA, v_y, v_B, v_C, v_x, v_h


@triton.jit
def _bwd_segment_grads(u_ptr, dl_ptr, B_ptr, C_ptr, z_ptr, dout_ptr, state_ptr, seg_state_ptr, seg_sum_ptr, du_ptr,
                       ddl_ptr, dz_ptr, col_ptr, bc_ptr, v_dt, v_dtu, v_g, v_hB, v_hxA, v_y, v_B, v_C, v_x, v_h, dlast,
                       A, A2, bias, Dv, row_off, bc_off, part_off, state_off, cmat_off, cvec_off, seg_row, seg, nseg,
                       seg_dn, c_lo, seg_chunks, d, mask_d, mask_dn, offs_dl, offs_n, mask_n, offs_s, vec_sd, vec_sn,
                       mat_dn, mat_sdn, dim, L, N, SEG_PASS: tl.constexpr, REVERSE: tl.constexpr,
                       ACCUM: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
                       SOFTPLUS: tl.constexpr, LOAD_STATES: tl.constexpr, HAS_DLAST: tl.constexpr,
                       CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    # every gradient of this program's chunks, last chunk first, and its row of the column partials
    h = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    a_next = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)  # a_{t+1}; zero past the end
    dA_acc = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    dD_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dbias_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if SEG_PASS == 2:
        h, a_next = _bwd_carry_in(seg_state_ptr, seg_sum_ptr, h, seg_row, seg, nseg, seg_dn, A2, d, mask_d, mask_dn,
                                  dim, N, BLOCK_D, BLOCK_N)
    for i in range(0, seg_chunks):
        c = c_lo + seg_chunks - 1 - i
        mask_s, t, m2, p2 = chunk_tile(c, offs_s, mask_d, row_off, L, REVERSE, CHUNK)
        mbc, u, dt_in, dt, dtu, do, zt, sz, g, Bt, Ct = _bwd_chunk_load(
            u_ptr, dl_ptr, B_ptr, C_ptr, z_ptr, dout_ptr, v_dt, v_dtu, v_g, v_B, v_C, mask_s, t, m2, p2, bias, bc_off,
            offs_n, mask_n, vec_sd, vec_sn, L, HAS_Z, HAS_BIAS, SOFTPLUS)
        h, a_next, dA_acc = _bwd_chunk_walks(
            state_ptr, v_dt, v_dtu, v_g, v_B, v_C, v_x, v_h, v_y, v_hB, v_hxA, c, h, a_next, dA_acc, dlast, A, A2,
            state_off, mask_dn, offs_dl, offs_n, mat_dn, L, N, LOAD_STATES, HAS_Z, HAS_DLAST, CHUNK, BLOCK_D,
            BLOCK_N)
        dA_acc, dD_acc, dbias_acc = _bwd_chunk_grads(
            du_ptr, ddl_ptr, dz_ptr, bc_ptr, v_x, v_h, v_y, v_hB, v_hxA, t, m2, p2, mbc, u, dt_in, dt, dtu, do, zt,
            sz, g, Bt, Ct, A, Dv, dA_acc, dD_acc, dbias_acc, part_off, offs_n, vec_sd, mat_sdn, N, L, ACCUM, HAS_D,
            HAS_Z, SOFTPLUS)
    _store_col_partials(col_ptr, cmat_off, cvec_off, dA_acc, dbias_acc, dD_acc, mask_dn, mask_d, dim, ACCUM, HAS_D)


@triton.jit
def selective_scan_bwd_kernel(u_ptr, dl_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, dout_ptr, state_ptr,
                              dlast_ptr, seg_state_ptr, seg_sum_ptr, scratch_ptr, du_ptr, ddl_ptr, dz_ptr, col_ptr,
                              bc_ptr, dim, L, G, DG, N, NCHUNK, NDBLK, DIR, NDIR, NCOL, SEG_CHUNKS,
                              SEG_PASS: tl.constexpr, REVERSE: tl.constexpr, ACCUM: tl.constexpr,
                              HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
                              SOFTPLUS: tl.constexpr, LOAD_STATES: tl.constexpr, HAS_DLAST: tl.constexpr,
                              CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    # The reverse walk also does the per-step work that reduces over the state only (dA, h.B, hx.A, and y for dz),
    # parking (CHUNK, BLOCK_D) vectors in the scratch, so the epilogue's (CHUNK, BLOCK_D, N) tiles are only x and h.
    # Segments (see selective_scan_fwd_kernel): SEG_PASS 1 walks only the adjoint through this program's segment;
    # SEG_PASS 2 composes the later segments' records into its carry, h = (that carry) + g C at its last token, and
    # computes every gradient of its segment. dA, d delta_bias and dD partials get one row per (batch, segment).
    pid_d, pid_bg, seg, nseg, i_b, offs_dl, d, mask_d, offs_n, mask_n, mask_dn, row_off, bc_off = program_block(
        dim, L, G, DG, N, BLOCK_D, BLOCK_N)
    offs_s = tl.arange(0, CHUNK)
    part_off = tl.cast(pid_bg * NDBLK + pid_d, tl.int64) * 2 * N * L  # dB's row; dC's follows at + N * L
    program = (seg * tl.num_programs(1) + pid_bg) * NDBLK + pid_d
    v_dt, v_dtu, v_g, v_hB, v_hxA, v_y, v_B, v_C, v_x, v_h = _bwd_scratch(scratch_ptr, program, CHUNK, BLOCK_D,
                                                                          BLOCK_N)
    vec_sd = offs_s[:, None] * BLOCK_D + offs_dl[None, :]
    vec_sn = offs_s[:, None] * BLOCK_N + offs_n[None, :]
    mat_dn = offs_dl[:, None] * BLOCK_N + offs_n[None, :]
    mat_sdn = offs_s[:, None, None] * (BLOCK_D * BLOCK_N) + mat_dn[None, :, :]

    A, A2, bias, Dv = load_channel_params(A_ptr, bias_ptr, D_ptr, d, offs_n, mask_d, mask_dn, N, HAS_BIAS, HAS_D,
                                          BLOCK_D)
    state_off = tl.cast((i_b * NDIR + DIR) * dim + d, tl.int64)[:, None] * NCHUNK * N + offs_n[None, :]
    vec_off = tl.cast(i_b * dim + d, tl.int64)
    mat_off = vec_off[:, None] * N + offs_n[None, :]
    # partial sums, one row of NCOL per (batch, segment): dA (dim x N), then d delta_bias (dim), then dD (dim)
    col_row = tl.cast(i_b * nseg + seg, tl.int64) * NCOL
    cmat_off = col_row + d[:, None] * N + offs_n[None, :]
    cvec_off = col_row + dim * N + d
    seg_row = tl.cast((i_b * NDIR + DIR) * nseg, tl.int64)
    seg_dn = d[:, None] * N + offs_n[None, :]
    c_lo = seg * SEG_CHUNKS
    seg_chunks = tl.minimum(NCHUNK, c_lo + SEG_CHUNKS) - c_lo
    dlast = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    if HAS_DLAST:
        dlast = tl.load(dlast_ptr + mat_off, mask=mask_dn, other=0.0).to(tl.float32)

    if SEG_PASS == 1:
        _bwd_segment_record(dl_ptr, C_ptr, z_ptr, dout_ptr, seg_state_ptr, v_dt, v_dtu, v_g, v_B, v_C, v_x, v_h, v_hB,
                            v_hxA, dlast, A, A2, bias, row_off, bc_off, seg_row, seg, seg_dn, c_lo, seg_chunks, mask_d,
                            mask_dn, offs_dl, offs_n, mask_n, offs_s, vec_sd, vec_sn, mat_dn, dim, L, N, REVERSE,
                            HAS_Z, HAS_BIAS, SOFTPLUS, HAS_DLAST, CHUNK, BLOCK_D, BLOCK_N)
    else:
        _bwd_segment_grads(u_ptr, dl_ptr, B_ptr, C_ptr, z_ptr, dout_ptr, state_ptr, seg_state_ptr, seg_sum_ptr, du_ptr,
                           ddl_ptr, dz_ptr, col_ptr, bc_ptr, v_dt, v_dtu, v_g, v_hB, v_hxA, v_y, v_B, v_C, v_x, v_h,
                           dlast, A, A2, bias, Dv, row_off, bc_off, part_off, state_off, cmat_off, cvec_off, seg_row,
                           seg, nseg, seg_dn, c_lo, seg_chunks, d, mask_d, mask_dn, offs_dl, offs_n, mask_n, offs_s,
                           vec_sd, vec_sn, mat_dn, mat_sdn, dim, L, N, SEG_PASS, REVERSE, ACCUM, HAS_D, HAS_Z,
                           HAS_BIAS, SOFTPLUS, LOAD_STATES, HAS_DLAST, CHUNK, BLOCK_D, BLOCK_N)


@triton.jit
def selective_scan_finish_kernel(col_ptr, bc_ptr, dA_ptr, dB_ptr, dC_ptr, dD_ptr, dbias_ptr, batch, NCOL, DN, dim,
                                 NBC, NL, NDBLK, NPROG_BC, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr,
                                 BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # One launch for every reduction the backward leaves (instead of ~8 small PyTorch ops, each a launch on the
    # host): programs [0, NPROG_BC) sum dB/dC over channel blocks, the rest sum dA / d delta_bias / dD over
    # batch; each writes the final gradient in its input's dtype. Fixed summation order: deterministic.
    pid = tl.program_id(0)
    if pid < NPROG_BC:
        offs = tl.cast(pid, tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
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
            tile = tl.load(col_ptr + tl.cast(rows, tl.int64)[:, None] * NCOL + cols[None, :], mask=m, other=0.0)
            acc_col += tl.sum(tile, axis=0)
        tl.store(dA_ptr + cols, acc_col.to(dA_ptr.dtype.element_ty), mask=cols < DN)
        if HAS_BIAS:
            tl.store(dbias_ptr + tl.maximum(cols - DN, 0), acc_col.to(dbias_ptr.dtype.element_ty),
                     mask=(cols >= DN) & (cols < DN + dim))
        if HAS_D:
            tl.store(dD_ptr + tl.maximum(cols - DN - dim, 0), acc_col.to(dD_ptr.dtype.element_ty),
                     mask=(cols >= DN + dim) & mask_c)
