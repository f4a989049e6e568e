"""Launch settings and host-side launch code of the selective-scan kernels.

Launch settings (:func:`launch_config`) are chosen per problem size by the rules below. Tests may force the chunk
size and the segment count (:data:`SETTINGS`) through :mod:`visionssm.kernels.tuning` under the op name
``"selective_scan"`` (``with launch_overrides("selective_scan", chunk=4): ...``); any other name is a
``ValueError``. The backward reuses the config its forward ran with (the saved states are ``chunk`` tokens apart,
the segments are the forward's).

Long sequences (L >= 1024) with too few (sequence, channel block) programs to fill the GPU are split along time
into segments, one program each: the forward first records every segment's end state from a zero start and its
sum of delta (the decay across a segment is ``exp(A * sum delta)``), then each segment composes the earlier records
into its start state and scans; the backward does the same for the adjoint, last segment first. Each pass costs
about one more read of the inputs; it pays when the programs would otherwise be few and long (e.g. 3136 tokens at
batch 2: 12 segments).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from .. import tuning
from ..utils import cdiv, empty_output, input_guard, jit_launch, traced
from .kernel_bwd import selective_scan_bwd_kernel, selective_scan_finish_kernel
from .kernel_fwd import selective_scan_fwd_kernel

__all__ = ["OP", "SETTINGS", "LaunchConfig", "backward", "forward", "launch_config", "saved_shapes"]

OP = "selective_scan"

#: The launch settings tests may force: tokens per chunk (a power of 2: the step loops' unit and the interval of the
#: states saved for the backward) and time segments scanned in parallel (None: the long-sequence rule in
#: :func:`_build_config`).
SETTINGS = {"chunk": 8, "segments": None}
#: Channels per program (capped at the channels per group of B/C) and warps per program (capped at one thread per
#: state element), forward and backward: the fastest of the variants timed at MambaVision's shapes.
BLOCK_D_FWD, BLOCK_D_BWD = 32, 32
NUM_WARPS_FWD, NUM_WARPS_BWD = 1, 2


@dataclass(frozen=True)
class LaunchConfig:
    """One problem size's launch settings (shared between calls: read it, do not modify it)."""

    chunk: int
    block_d_fwd: int
    block_d_bwd: int
    num_warps_fwd: int
    num_warps_bwd: int
    block_n: int  # the state size N rounded up to a power of 2
    segments: int
    seg_chunks: int  # chunks per segment


def _check_values(forced) -> None:
    for name, value in forced.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"launch setting {name!r} for {OP} must be a positive integer, got {value!r}")
        if name == "chunk" and value & (value - 1):
            raise ValueError(f"launch setting {name!r} for {OP} must be a power of 2, got {value}")


def _build_config(length: int, nstate: int, channels_per_group: int, sequences: int, forced) -> LaunchConfig:
    tuning.check_names(OP, forced, SETTINGS)
    _check_values(forced)
    cfg = {**SETTINGS, "block_d_fwd": BLOCK_D_FWD, "block_d_bwd": BLOCK_D_BWD, "num_warps_fwd": NUM_WARPS_FWD,
           "num_warps_bwd": NUM_WARPS_BWD, **forced}
    block_n = triton.next_power_of_2(nstate)
    cap = triton.next_power_of_2(channels_per_group)
    for kind in ("fwd", "bwd"):
        cfg[f"block_d_{kind}"] = min(cfg[f"block_d_{kind}"], cap)
        # no more threads than (BLOCK_D, N) state elements: with the state tile replicated across warps the
        # backward's d delta comes out wrong on the GPU
        elements = cfg[f"block_d_{kind}"] * block_n
        cfg[f"num_warps_{kind}"] = max(1, min(cfg[f"num_warps_{kind}"], elements // 32))
    if cfg["segments"] is None:
        # too few (sequence, channel block) programs to fill the GPU: aim at ~2048 programs, segments >= 256 tokens
        programs = sequences * cdiv(channels_per_group, cfg["block_d_bwd"])
        cfg["segments"] = min(cdiv(2048, programs), length // 256) if length >= 1024 and programs < 1024 else 1
    nchunk = cdiv(length, cfg["chunk"])
    cfg["seg_chunks"] = cdiv(nchunk, cfg["segments"])
    cfg["segments"] = cdiv(nchunk, cfg["seg_chunks"])  # no empty segment
    return LaunchConfig(block_n=block_n, **cfg)


# one config per problem size and override state: rebuilding it costs host time on every call
@functools.lru_cache(maxsize=256)
def _cached_config(length: int, nstate: int, channels_per_group: int, sequences: int, generation: int):
    return _build_config(length, nstate, channels_per_group, sequences, tuning.overrides(OP))


def launch_config(length: int, nstate: int, channels_per_group: int, sequences: int = 1) -> LaunchConfig:
    """Launch settings for ``sequences`` (batch x groups) scans of ``length`` tokens and ``channels_per_group``."""
    return _cached_config(length, nstate, channels_per_group, sequences, tuning.generation())


def _saved_shapes(cfg: LaunchConfig, batch: int, dim: int, length: int, nstate: int, causal: bool,
                  save_states: bool) -> tuple[tuple | None, tuple | None]:
    """The shapes of the forward's chunk-start states and segment sums of delta (None where it keeps none)."""
    nchunk = cdiv(length, cfg.chunk)
    ndir = 1 if causal else 2
    states = (batch, ndir, dim, nchunk, nstate) if save_states and nchunk > 1 else None
    seg_sum = (batch, ndir, cfg.segments, dim) if cfg.segments > 1 else None
    return states, seg_sum


def saved_shapes(batch: int, dim: int, length: int, nstate: int, groups: int, causal: bool,
                 save_states: bool) -> tuple[tuple | None, tuple | None]:
    """What :func:`forward` returns for the backward besides its outputs, as shapes: (chunk-start states, segment
    sums of delta), each None where the launch keeps none (a pure function of the sizes and the launch settings)."""
    cfg = launch_config(length, nstate, dim // groups, batch * groups)
    return _saved_shapes(cfg, batch, dim, length, nstate, causal, save_states)


@input_guard
def forward(u, delta, A, B, C, D, z, delta_bias, softplus, causal, return_last_state, save_states):
    """Returns the output, the last state (or None), the saved chunk-start states (or None), the segments' sums of
    delta (or None) and the launch config, which the backward must reuse."""
    batch, dim, length = u.shape
    nstate = A.shape[1]
    groups = B.shape[1] if B.dim() == 4 else 1  # (batch, N, L) is one group: the kernels index B and C flat
    per_group = dim // groups
    cfg = launch_config(length, nstate, per_group, batch * groups)
    block_l, block_d, block_n = cfg.chunk, cfg.block_d_fwd, cfg.block_n
    nchunk = cdiv(length, block_l)
    ndir = 1 if causal else 2
    states_shape, seg_sum_shape = _saved_shapes(cfg, batch, dim, length, nstate, causal, save_states)
    save_states = states_shape is not None
    dev = u.device
    tracing = traced(u)  # torch.compile traces this body: the launches are recorded for its generated code
    out = empty_output((batch, dim, length), device=dev, dtype=u.dtype)
    ybuf = torch.empty((batch, dim, length), device=dev, dtype=torch.float32) if not causal else out
    states = torch.empty(states_shape, device=dev, dtype=torch.float32) if save_states else None
    last = empty_output((batch, dim, nstate), device=dev, dtype=torch.float32) if return_last_state else None
    flags = {"BIDIR": not causal, "HAS_D": D is not None, "HAS_Z": z is not None, "HAS_BIAS": delta_bias is not None,
             "SOFTPLUS": softplus, "SAVE_STATES": save_states, "BLOCK_D": block_d, "BLOCK_N": block_n,
             "num_warps": cfg.num_warps_fwd}
    tensors = (u, delta, A, B, C, D, z, delta_bias, out, ybuf, states, last)
    nseg = cfg.segments
    grid = (cdiv(per_group, block_d), batch * groups, nseg)
    scratch = torch.empty((grid[0] * grid[1] * nseg, block_l * (3 * block_d + 2 * block_n)), device=dev,
                          dtype=torch.float32)
    seg_state = empty_output((batch, ndir, nseg, dim, nstate), device=dev, dtype=torch.float32) if nseg > 1 else None
    seg_sum = empty_output(seg_sum_shape, device=dev, dtype=torch.float32) if nseg > 1 else None

    def launch(seg_pass, direction, return_last):
        jit_launch(selective_scan_fwd_kernel, grid, traced=tracing)(
            *tensors, seg_state, seg_sum, scratch, dim, length, groups, per_group, nstate, nchunk, cfg.seg_chunks,
            DIRECTION=direction, SEG_PASS=seg_pass, RETURN_LAST=return_last, CHUNK=block_l, **flags)

    if nseg == 1:
        launch(0, -1, return_last_state)
    else:
        launch(1, -1, False)  # both directions' segment records (no program reads another's)
        if causal:
            launch(2, -1, return_last_state)
        else:  # the reverse direction reads y_fwd that other programs wrote
            launch(2, 0, False)
            launch(2, 1, False)
    return out, last, states, seg_sum, cfg


@input_guard
def backward(dout, dlast, u, delta, A, B, C, D, z, delta_bias, states, seg_sum, softplus, causal, cfg):
    """Every input gradient (None for absent D / z / delta_bias), from the forward's saved states and config."""
    batch, dim, length = u.shape
    nstate = A.shape[1]
    groups = B.shape[1] if B.dim() == 4 else 1  # (batch, N, L) is one group: the kernels index B and C flat
    per_group = dim // groups
    block_l, block_d, block_n = cfg.chunk, cfg.block_d_bwd, cfg.block_n
    nchunk = cdiv(length, block_l)
    ndblk = cdiv(per_group, block_d)
    ndir = 1 if causal else 2
    nseg = cfg.segments
    dev = u.device
    tracing = traced(u)  # as in forward
    du = empty_output(u.shape, device=dev, dtype=u.dtype)
    ddelta = empty_output(delta.shape, device=dev, dtype=delta.dtype)
    dz = empty_output(z.shape, device=dev, dtype=z.dtype) if z is not None else None
    # partial sums, reduced by the finishing kernel: per (batch, segment), one row of dA, d delta_bias, dD; per
    # (batch, group, channel block), dB's and dC's (N, L) blocks
    ncol = dim * nstate + 2 * dim
    col_part = empty_output((batch * nseg, ncol), device=dev, dtype=torch.float32)
    bc_part = empty_output((batch * groups * ndblk, 2, nstate, length), device=dev, dtype=torch.float32)
    # per program: (CHUNK, BLOCK_D) x 6 vectors, (CHUNK, N) x 2 rows, (CHUNK, BLOCK_D, N) x 2 states
    per_program = block_l * (6 * block_d + 2 * block_n + 2 * block_d * block_n)
    scratch = torch.empty((batch * groups * ndblk * nseg, per_program), device=dev, dtype=torch.float32)
    seg_carry = empty_output((batch, ndir, nseg, dim, nstate), device=dev, dtype=torch.float32) if nseg > 1 else None
    for direction in range(ndir):
        flags = {"REVERSE": direction == 1, "ACCUM": direction == 1, "HAS_D": D is not None, "HAS_Z": z is not None,
                 "HAS_BIAS": delta_bias is not None, "SOFTPLUS": softplus, "LOAD_STATES": states is not None,
                 "HAS_DLAST": dlast is not None, "BLOCK_D": block_d, "BLOCK_N": block_n,
                 "num_warps": cfg.num_warps_bwd}
        sizes = (dim, length, groups, per_group, nstate, nchunk, ndblk, direction, ndir, ncol)
        for seg_pass in (1, 2) if nseg > 1 else (0,):
            jit_launch(selective_scan_bwd_kernel, (ndblk, batch * groups, nseg), traced=tracing)(
                u, delta, A, B, C, D, z, delta_bias, dout, states, dlast, seg_carry, seg_sum, scratch, du, ddelta,
                dz, col_part, bc_part, *sizes, cfg.seg_chunks, SEG_PASS=seg_pass, CHUNK=block_l, **flags)
    dA = empty_output(A.shape, device=dev, dtype=A.dtype)
    dB = empty_output(B.shape, device=dev, dtype=B.dtype)
    dC = empty_output(C.shape, device=dev, dtype=C.dtype)
    dD = empty_output(D.shape, device=dev, dtype=D.dtype) if D is not None else None
    dbias = empty_output(delta_bias.shape, device=dev, dtype=delta_bias.dtype) if delta_bias is not None else None
    block_e, block_c = 1024, 64
    nprog_bc = cdiv(batch * groups * 2 * nstate * length, block_e)
    jit_launch(selective_scan_finish_kernel, (nprog_bc + cdiv(ncol, block_c),), traced=tracing)(
        col_part, bc_part, dA, dB, dC, dD, dbias, batch * nseg, ncol, dim * nstate, dim, batch * groups,
        nstate * length, ndblk, nprog_bc, HAS_D=D is not None, HAS_BIAS=delta_bias is not None, BLOCK_E=block_e,
        BLOCK_R=32, BLOCK_C=block_c, num_warps=4)
    return du, ddelta, dA, dB, dC, dD, dz, dbias
