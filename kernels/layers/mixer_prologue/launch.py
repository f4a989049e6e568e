"""Launch layout and cached launch plans of the prologue kernels.

Tiles by head width (:func:`launch_config`), warps by tile size. Tests may force (through
:mod:`visionssm.kernels.tuning`, op ``"mixer_prologue"``) ``block_tokens`` (tokens per program of the forward, a
power of two), ``heads_per_program`` (a power of two; by default the largest dividing H, ≤ 128 channels),
``conv_block_tokens`` and ``conv_block_channels`` (tokens and channels per program of the transposed-convolution
kernel), so that tiny inputs span several programs; ``reference`` runs the PyTorch composition instead.

A plan holds everything that depends only on the call's shapes, dtypes, device and flags (grids, constexprs, the
compiled kernels for direct relaunch), so an eager call allocates its outputs and launches.
"""

from __future__ import annotations

import math

import torch

from ... import tuning
from ...utils import DirectLaunch, aligned16, cdiv, empty_output, heads_per_program, next_pow2, placeholder
from .kernel_bwd import SLOTS, conv_bwd_kernel, prologue_bwd_kernel
from .kernel_fwd import prologue_fwd_kernel

OP = "mixer_prologue"
SETTINGS = ("block_tokens", "heads_per_program", "conv_block_tokens", "conv_block_channels", "reference")
#: Elements of one [tokens, heads, channels] tile, forward and backward: 8 and 4 per thread of four warps. Larger
#: tiles cost registers, not loads, and these kernels stream memory: occupancy is what keeps enough loads in flight.
TILE_FWD, TILE_BWD = 1024, 512
#: Tokens per program of the transposed convolution: programs are independent (the token axis is the grid's), so
#: short ones fill the GPU where a walk over the tokens would not.
CONV_TOKENS = 16


def launch_config(L: int, H: int, K: int, V: int, C: int) -> dict:
    BD = max(next_pow2(K), next_pow2(V))
    # Heads of 64 channels and more: one head per one-warp program (every per-head reduction stays in the warp, no
    # cross-warp round trip), 8 elements per thread.
    wide = BD >= 64
    HB = 1 if wide else heads_per_program(H, BD)
    tile_fwd, tile_bwd = (8 * 32, 8 * 32) if wide else (TILE_FWD, TILE_BWD)
    tokens = lambda tile: max(1, min(next_pow2(L), tile // (HB * BD)))  # noqa: E731
    cfg = {"heads_per_program": HB, "block_tokens": tokens(tile_fwd), "bwd_block_tokens": tokens(tile_bwd),
           "conv_block_tokens": min(CONV_TOKENS, next_pow2(L)), "conv_block_channels": min(64, next_pow2(C))}
    cfg = tuning.apply_overrides(OP, cfg, SETTINGS)
    tile = cfg["block_tokens"] * cfg["heads_per_program"] * BD
    cfg["num_warps"] = 1 if wide else 4 if tile >= 512 else 2 if tile >= 128 else 1
    conv_tile = cfg["conv_block_tokens"] * cfg["conv_block_channels"]
    cfg["conv_num_warps"] = 4 if conv_tile >= 2048 else 2 if conv_tile >= 512 else 1
    return cfg


def row_alignment(*strides: int) -> int:
    """``ROW_ALIGN`` of the kernels: the largest power of two below 16 dividing every stride (in elements) of proj and
    of its gradient, or 1 when 16 divides them all. The kernels take the strides in units of it and multiply them back
    by the constexpr, so that the compiler knows the rows' alignment: of an integer argument Triton proves
    divisibility by 16 itself, and nothing less. Without it a row stride such as 600 (8 divides it, 16 does not) makes
    the kernels read proj 2 bytes at a time instead of 16; strides that 16 divides gain nothing from units of 16.
    """
    common = next(a for a in (16, 8, 4, 2, 1) if all(s % a == 0 for s in strides))
    return 1 if common == 16 else common


class Plan:
    __slots__ = ("B", "L", "N", "H", "K", "V", "C", "KS", "cols", "gate_cols", "flags", "uncovered", "fwd", "bwd",
                 "bwd_args", "conv_bwd", "partial_rows", "conv_rows", "dummy", "dtype")


def build_plan(proj: torch.Tensor, KS: int, H: int, K: int, V: int, causal: bool, cols: tuple, gate_cols,
               flags: dict, eps: float) -> Plan:
    B, L, N = proj.shape
    C = 2 * H * K + H * V
    cfg = launch_config(L, H, K, V, C)
    plan = Plan()
    plan.B, plan.L, plan.N, plan.H, plan.K, plan.V, plan.C, plan.KS = B, L, N, H, K, V, C, KS
    plan.cols, plan.gate_cols, plan.flags, plan.dtype = cols, gate_cols, flags, proj.dtype
    covered = set(range(C))
    for start in cols:
        if start is not None:
            covered.update(range(start, start + H))
    if gate_cols is not None:
        covered.update(range(gate_cols[0], gate_cols[0] + gate_cols[1]))
    # the column ranges of proj's gradient the backward does not write (a layer's alignment padding): zeroed
    plan.uncovered = _ranges(sorted(set(range(N)) - covered))
    plan.dummy = placeholder(proj.device)
    HB = cfg["heads_per_program"]
    grid = (cdiv(L, cfg["block_tokens"]), B, cdiv(H, HB))
    grid_bwd = (cdiv(L, cfg["bwd_block_tokens"]), B, cdiv(H, HB))
    plan.partial_rows = grid_bwd[0] * B
    conv_grid = (cdiv(L, cfg["conv_block_tokens"]), B, cdiv(C, cfg["conv_block_channels"]))
    plan.conv_rows = conv_grid[0] * B
    left = KS - 1 if causal else (KS - 1) // 2
    beta_col, alpha_col, decay_col = (c if c is not None else 0 for c in cols)
    # proj's strides and its gradient's (allocated (B, L, N)), passed in units of row_align elements; a stride of
    # 2^31 elements or more stays as it is (Triton passes it as a 64-bit integer, its units might be 32-bit)
    row_align = row_alignment(*proj.stride()[:2], N) if max(proj.stride(0), L * N) < 2**31 else 1
    units = (proj.stride(0) // row_align, proj.stride(1) // row_align, L * N // row_align, N // row_align)
    constexprs = {"H": H, "K": K, "V": V, "KS": KS, "LEFT": left, "BT": cfg["block_tokens"], "HB": HB,
                  "BK": next_pow2(K), "BV": next_pow2(V), "EPS": eps, "ROW_ALIGN": row_align, **flags}
    options = {"num_warps": cfg["num_warps"]}
    plan.fwd = DirectLaunch(prologue_fwd_kernel, grid, (L, *units[:2], beta_col, alpha_col,
                                                        decay_col), constexprs, options)
    # one backward launch per dtype combination of the incoming gradients (a compiled kernel is typed)
    plan.bwd = {}
    plan.bwd_args = (prologue_bwd_kernel, grid_bwd, (L, *units[:2], beta_col, alpha_col, decay_col, *units[2:]),
                     {**constexprs, "BT": cfg["bwd_block_tokens"]}, options)
    plan.conv_bwd = DirectLaunch(conv_bwd_kernel, conv_grid, (L, *units),
                                 {"C": C, "KS": KS, "LEFT": left, "BT": cfg["conv_block_tokens"],
                                  "BC": cfg["conv_block_channels"],
                                  "BKS": next_pow2(KS), "ROW_ALIGN": row_align},
                                 {"num_warps": cfg["conv_num_warps"]})
    return plan


def _ranges(columns: list[int]) -> list[tuple[int, int]]:
    """Sorted column indices as maximal [start, stop) runs."""
    runs = []
    for c in columns:
        if runs and runs[-1][1] == c:
            runs[-1][1] = c + 1
        else:
            runs.append([c, c + 1])
    return [tuple(r) for r in runs]


def _or(tensor, dummy):
    return dummy if tensor is None else tensor


def _grouped(count: int, shape: tuple, device, dtype, separate: bool = False) -> tuple:
    """``count`` tensors of ``shape`` as views of one allocation (the outputs of one dtype: an eager call is bound
    by host time, and one allocation and its views cost less of it than ``count`` allocations). Where a view would
    not start 16-byte aligned (odd shapes), or ``separate``, separate allocations, so that the kernels keep their
    aligned variants."""
    if separate or math.prod(shape) * dtype.itemsize % 16:
        return tuple(empty_output(shape, device=device, dtype=dtype) for _ in range(count))
    return empty_output((count, *shape), device=device, dtype=dtype).unbind(0)


def run_fwd(plan: Plan, proj, conv_weight, params: tuple, separate: bool = False) -> tuple:
    """(q, k, v, p, g, beta, alpha); p / g / alpha None when the plan has none. ``separate``: each output its own
    allocation (a registered op's outputs must not share memory)."""
    B, L, H, K, V = plan.B, plan.L, plan.H, plan.K, plan.V
    device, dtype, dummy = proj.device, proj.dtype, plan.dummy
    flags = plan.flags
    keyed = 3 if flags["FEEDBACK"] else 2  # q, k (, p)
    if V == K:
        q, k, *rest = _grouped(keyed + 1, (B, L, H, K), device, dtype, separate)
        v = rest.pop()
    else:
        q, k, *rest = _grouped(keyed, (B, L, H, K), device, dtype, separate)
        v = empty_output((B, L, H, V), device=device, dtype=dtype)
    p = rest[0] if rest else None
    gates = _grouped(1 + flags["HAS_DECAY"] + flags["HAS_ALPHA"], (B, L, H), device, torch.float32, separate)
    beta, *rest = gates
    g = rest.pop(0) if flags["HAS_DECAY"] else None
    alpha = rest.pop(0) if flags["HAS_ALPHA"] else None
    params = tuple(_or(t, dummy) for t in params)
    outputs = (q, k, v, _or(p, dummy), _or(g, dummy), beta, _or(alpha, dummy))
    plan.fwd(aligned16(proj, conv_weight, *params, *outputs), proj, conv_weight, *params, *outputs)
    return q, k, v, p, g, beta, alpha


def run_bwd(plan: Plan, proj, conv_weight, params: tuple, grads: tuple, dgate):
    """(dproj, dconv_weight, per-head parameter gradients (feedback, correction, A_log, dt_bias, beta_bias,
    alpha_bias)) for the gradients (dq, dk, dv, dp, dg, dbeta, dalpha) of the outputs (None where absent)."""
    B, L, N, C = plan.B, plan.L, plan.N, plan.C
    device, dummy = proj.device, plan.dummy
    dproj = empty_output((B, L, N), device=device, dtype=proj.dtype)
    for start, stop in plan.uncovered:
        dproj[..., start:stop].zero_()
    dconv = empty_output((B, L, C), device=device, dtype=proj.dtype)
    partials = empty_output((plan.partial_rows, SLOTS, plan.H), device=device, dtype=torch.float32)
    dw_partial = empty_output((plan.conv_rows, plan.KS, C), device=device, dtype=torch.float32)
    params = tuple(_or(t, dummy) for t in params)
    grads = tuple(dummy if t is None else t.contiguous() for t in grads)
    key = tuple(t.dtype for t in grads)
    launch = plan.bwd.get(key)
    if launch is None:
        launch = plan.bwd[key] = DirectLaunch(*plan.bwd_args)
    launch(aligned16(proj, conv_weight, *params, *grads, dconv, dproj, partials), proj, conv_weight, *params,
             *grads, dconv, dproj, partials)
    plan.conv_bwd(aligned16(dconv, proj, conv_weight, dproj, dw_partial), dconv, proj, conv_weight, dproj,
                  dw_partial)
    if plan.gate_cols is not None:
        start, width = plan.gate_cols
        if dgate is None:
            dproj[..., start:start + width].zero_()
        else:
            dproj[..., start:start + width].copy_(dgate)
    dweight = dw_partial.sum(0).t().reshape(conv_weight.shape).to(conv_weight.dtype)
    return dproj, dweight, partials.sum(0)


# Plans per call signature.
_PLANS = tuning.PlanCache()


def get_plan(proj, conv_weight, params: tuple, H: int, K: int, V: int, causal: bool, cols: tuple, gate_cols,
             transition: str, eps: float) -> Plan:
    key = (proj.shape, proj.stride(), proj.dtype, proj.device, conv_weight.shape, conv_weight.dtype,
           tuple(None if t is None else t.dtype for t in params), H, K, V, causal, cols, gate_cols, transition, eps)
    return _PLANS.get_or_build(key, lambda: build_plan(proj, conv_weight.shape[-1], H, K, V, causal, cols, gate_cols,
                                                       _flags(params, cols, transition), eps))


def _flags(params: tuple, cols: tuple, transition: str) -> dict:
    beta_bias, alpha_bias, _, _, feedback, _ = params
    return {"HAS_BETA_BIAS": beta_bias is not None, "HAS_ALPHA": cols[1] is not None,
            "HAS_ALPHA_BIAS": alpha_bias is not None, "HAS_DECAY": cols[2] is not None,
            "FEEDBACK": feedback is not None, "IPLR": transition == "iplr"}
