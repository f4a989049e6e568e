"""Launch plans of causal GKA: everything a call does that depends only on the problem's shape, dtypes, flags and
device (layout choice, buffer sizes, grids, constexprs) is worked out once per such key and cached, and a plan's
later launches call the kernels Triton compiled for it directly (:class:`visionssm.kernels.utils.DirectLaunch`).
Between launches nothing but output allocation runs on the host: no reductions, flips or casts.

Forward: state scan → solve (per-token direct solve for 16-wide heads, chunked Chebyshev otherwise) → read-out.
Backward: dz → adjoint solve → adjoint-state scan → gradients (16-wide heads: scan and gradients in one kernel).

Chunk size, warps and tile widths follow the head width (:func:`launch_config`). Tests may force, through
:mod:`visionssm.kernels.tuning` (op ``"gka"``), the layouts that the rule takes only at other widths or on a GPU:

* ``chunk``: tokens per chunk (16 or 32) for every stage;
* ``coarse_launch``: ``solver="auto"``'s coarse Chebyshev steps in a launch of their own before the full ones (the
  iterates pass through memory), so that neither launch holds the other's registers;
* ``fused_grad``: 16-wide heads only: the adjoint-state scan and the gradient kernel as one program per (b, h)
  walking the chunks backwards (``adjoint_grad_kernel``) instead of a scan plus a chunk-parallel kernel;
* ``fused_wave_slots``: programs of the fused kernel the GPU runs at once (None: its SMs × FUSED_PROGRAMS_PER_SM;
  0: off): when the grid's last wave would be at most half full, its sequences get two programs each, one walking
  the last :func:`late_chunks` chunks, the other the chunks before them.
"""

from __future__ import annotations

import torch

from .. import tuning
from ..dispatch import interpreter_enabled
from ..utils import (
    DirectLaunch,
    aligned16,
    cdiv,
    empty_output,
    empty_output_like,
    launch_options,
    placeholder,
    sm_count,
    wave_slots,
)
from .naive import EPS, auto_chebyshev_steps, chebyshev_steps

__all__ = ["SETTINGS", "causal_bwd", "causal_fwd", "converged_iters", "fused_split", "fwd_plan", "late_chunks",
           "launch_config", "per_token_solve", "saved_shapes"]

#: The launch settings tests may force (see the module's docstring).
SETTINGS = ("chunk", "coarse_launch", "fused_grad", "fused_wave_slots")
#: Relative accuracy the iteration reaches for ``solver="direct"`` on heads the per-token factorisation does not fit.
DIRECT_ITER_TOL = 1e-7
#: Widest heads whose ``solver="auto"`` solve runs its coarse steps in the same launch as the full ones: wider heads'
#: solve kernels already spill, and the coarse loop compiled in beside the full one would double that.
COARSE_MAX_WIDTH = 64
#: One-warp programs of the fused adjoint-gradient kernel an SM runs at once (255 registers a thread), as its GPU
#: time shows: the wave size that :func:`fused_split` balances.
FUSED_PROGRAMS_PER_SM = 8
#: Time of a chunk step of the fused adjoint-gradient kernel that only adds the chunk's share to the adjoint states,
#: as a fraction of a full step (gradients and share): the step is bound by its loads, which it shares with the full
#: one. :func:`late_chunks` balances a split sequence's two programs by it (fitted to the kernel's time by the split).
STATE_STEP_SHARE = 0.6
#: Positions of a chunk per program of the per-token solve: shorter loops over the chunk's keys than one program per
#: chunk, each program reading the same chunk state.
POSITIONS = 4
#: Warps per program of the per-token solve (32 tokens each).
LANE_WARPS = 4


def converged_iters(ridge: float, tol: float = DIRECT_ITER_TOL) -> int:
    """Chebyshev steps after which the iterate is within ``tol`` (relative) of the exact ridge solution for every
    H_t (:func:`.naive.chebyshev_steps`; 60 steps at ridge 0.02 for the default fp32 tolerance)."""
    return chebyshev_steps(ridge, tol)


def launch_config(K: int, V: int, per_token: bool) -> dict:
    """Launch settings for heads of width K (keys) and V (values); ``per_token``: the per-token direct solve.

    Chunks are 16 tokens up to 32-wide heads and 32 beyond (never 64: Triton 3.6 generates out-of-bounds accesses for
    those tiles where the interpreter finds none). Warps follow the width: one or two up to 32-wide heads, four
    beyond in every stage (the Chebyshev solve holds 255 registers a thread, so two 4-warp programs share an SM where
    one 8-warp program sits alone), eight for the adjoint solve of 128-wide keys. The scans carry whole states up to
    64-wide heads (more programs per (b, h) would each read the chunk's full-width tiles again) and 16 rows beyond;
    the read-out, dz and gradient kernels compute up to 64 output columns at a time (128 spill). 16-wide heads walk
    the adjoint scan and the gradients in one program per (b, h) on one warp, two pipeline stages."""
    width = max(K, V)
    cfg = {"chunk": 16 if per_token or width <= 32 else 32}
    small = 1 if width <= 16 else 2
    for name in ("solve_warps", "adjoint_warps", "tile_warps", "grad_warps", "scan_warps", "coarse_warps"):
        cfg[name] = small if width <= 32 else 4
    if K >= 128:
        cfg["adjoint_warps"] = 8
    cfg["state_rows"] = K if K <= 64 else 16
    cfg["columns"] = min(K, V, 64)
    cfg["coarse_launch"] = width > COARSE_MAX_WIDTH
    cfg["fused_grad"] = width <= 16
    cfg["fused_wave_slots"] = None
    # "noncausal_*" settings belong to the non-causal plans (launch_noncausal), which check them
    forced = {name: value for name, value in tuning.overrides("gka").items() if not name.startswith("noncausal_")}
    if forced:
        tuning.check_names("gka", forced, SETTINGS)
        cfg.update(forced)
    if cfg["chunk"] not in (16, 32):
        raise ValueError(f"gka launch setting chunk must be 16 or 32, got {cfg['chunk']!r}")
    if cfg["fused_grad"] and width > 16:
        raise ValueError(f"gka launch setting fused_grad needs heads of at most 16, got K = {K}, V = {V}")
    value = cfg["fused_wave_slots"]
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"gka launch setting fused_wave_slots must be None or an integer >= 0, got {value!r}")
    return cfg


def per_token_solve(solver: str, K: int) -> bool:
    """Whether ``solver`` (resolved) runs as the per-token direct solve (16-wide heads) rather than a Chebyshev one."""
    return solver == "direct" and K == 16


def saved_shapes(B: int, T: int, H: int, K: int, V: int, per_token: bool, cfg: dict | None = None) -> tuple:
    """Shapes of the fp32 tensors :func:`causal_fwd` keeps for the backward: x (B, T, H, K), ‖H_t‖_F (B, T, H; None
    for the per-token solve, which does not save it), H0 (B·H, NT, K, K) and S0 (B·H, NT, K, V) over NT chunks.
    ``cfg``: :func:`launch_config`'s settings, computed when not given (a pure function of shapes and overrides, so
    the registered op's fake kernel gives the shapes the launch allocates)."""
    if cfg is None:
        cfg = launch_config(K, V, per_token)
    NT = cdiv(T, cfg["chunk"])
    return (B, T, H, K), None if per_token else (B, T, H), (B * H, NT, K, K), (B * H, NT, K, V)


def late_chunks(NT: int) -> int:
    """Chunks the late program of a split sequence walks (of NT): its NT − L steps as long as the early program's L
    state-only steps (STATE_STEP_SHARE of a step each) and NT − L full ones, within [1, NT − 1]."""
    return min(max(round(NT / (2.0 - STATE_STEP_SHARE)), 1), NT - 1)


def fused_split(cfg: dict, BH: int, NT: int, sms: int) -> tuple[int, int]:
    """(n_whole, n_late) of the fused adjoint-gradient kernel: sequences [0, n_whole) get one program each; when the
    grid's last wave would be at most half full, the sequences of that wave (all of them on a grid of less than half a
    wave) get two, the late one walking the last n_late chunks (:func:`late_chunks`). ``sms``: the GPU's SM count (0
    off the GPU); the programs it runs at once are ``fused_wave_slots`` if set, else FUSED_PROGRAMS_PER_SM per SM.
    Returns (BH, 0) for no split."""
    slots = wave_slots(cfg["fused_wave_slots"], sms, FUSED_PROGRAMS_PER_SM, True)
    last = BH % slots if slots else 0
    if NT < 2 or not last or 2 * last > slots:
        return BH, 0
    return BH - last, late_chunks(NT)


def _precision(dtype: torch.dtype, v_dtype: torch.dtype, device: torch.device, width: int) -> tuple[str, bool]:
    """(PREC, IN_EXACT): fp32 queries and keys get exact fp32 products (tf32x3 on the GPU for heads of 64 and more,
    where fp32 FMA tiles would not fit registers); 16-bit ones bf16 hi/lo splits, on CPU (Triton's interpreter)
    emulated in fp32. ``IN_EXACT`` (input tiles need no low part) holds every input tile to it, v's and dO's (which
    takes v's dtype) included, so it needs bf16 values as well as bf16 queries and keys: an fp32 v would otherwise be
    rounded to bf16 in the read-out and the gradients."""
    if dtype == torch.float32:
        return ("tf32x3" if device.type == "cuda" and width >= 64 else "ieee"), False
    exact = dtype == torch.bfloat16 and v_dtype == torch.bfloat16
    return ("split" if device.type == "cuda" else "split_emulated"), exact


class _FwdPlan:
    __slots__ = ("BT", "NT", "NKR", "per_token", "num_iters", "num_coarse", "state", "coarse", "solve", "readout",
                 "h0_shape", "s0_shape", "dummy", "bwd", "key", "cfg")


class _BwdPlan:
    __slots__ = ("dz", "coarse", "solve", "scan", "grad", "fused", "dend_shape", "eend_shape", "offs_shape")


def _common(cfg: dict, q: torch.Tensor, v: torch.Tensor, has_beta: bool, has_alpha: bool) -> dict:
    B, T, H, K = q.shape
    prec, exact = _precision(q.dtype, v.dtype, q.device, max(K, v.shape[3]))
    return {"H": H, "K": K, "V": v.shape[3], "BT": cfg["chunk"], "PREC": prec, "IN_EXACT": exact,
            "HAS_BETA": has_beta, "HAS_ALPHA": has_alpha}


def _chebyshev_launches(kernel, grid: tuple, dims: tuple, constexprs: dict, num_coarse: int, cfg: dict,
                        num_warps: int) -> tuple:
    """(coarse launch or None, solve launch) of a Chebyshev solve kernel: with coarse steps and ``coarse_launch``,
    stage 1 runs them (on ``coarse_warps``) and stage 2 the full steps; otherwise one launch runs every step
    (stage 0)."""
    options = {"num_warps": num_warps, "num_stages": 1}
    if num_coarse > 0 and cfg["coarse_launch"]:
        return (DirectLaunch(kernel, grid, dims, constexprs | {"HAS_COARSE": True, "STAGE": 1},
                             {"num_warps": cfg["coarse_warps"], "num_stages": 1}),
                DirectLaunch(kernel, grid, dims, constexprs | {"HAS_COARSE": False, "STAGE": 2}, options))
    return None, DirectLaunch(kernel, grid, dims, constexprs | {"HAS_COARSE": num_coarse > 0, "STAGE": 0}, options)


def _per_token_grid(n_inst: int, BT: int) -> tuple[int, int]:
    """The grid of the per-token solve over ``n_inst`` (b, h, chunk) instances: a program takes POSITIONS positions
    of 32·LANE_WARPS / POSITIONS instances."""
    return BT // POSITIONS, cdiv(n_inst, 32 * LANE_WARPS // POSITIONS)


def _build_fwd(key, cfg: dict, q, v, has_beta: bool, has_alpha: bool, per_token: bool, num_iters: int,
               num_coarse: int) -> _FwdPlan:
    B, T, H, K = q.shape
    V = v.shape[3]
    plan = _FwdPlan()
    plan.key, plan.cfg, plan.bwd = key, cfg, None
    BT = plan.BT = cfg["chunk"]
    plan.per_token, plan.num_iters, plan.num_coarse = per_token, num_iters, num_coarse
    plan.NT = NT = cdiv(T, BT)
    plan.NKR = NKR = K // cfg["state_rows"]
    _, _, plan.h0_shape, plan.s0_shape = saved_shapes(B, T, H, K, V, per_token, cfg)
    plan.dummy = placeholder(q.device)
    c = _common(cfg, q, v, has_beta, has_alpha)
    plan.coarse = None
    from .kernel_causal import readout_kernel, state_fwd_kernel

    plan.state = DirectLaunch(state_fwd_kernel, (NKR, B * H), (T, NT),
                              {k: c[k] for k in ("H", "K", "V", "BT", "PREC", "IN_EXACT", "HAS_BETA")}
                              | {"BKR": cfg["state_rows"]}, {"num_warps": cfg["scan_warps"], "num_stages": 2})
    if per_token:
        from .kernel_causal_direct import direct_fwd_kernel

        plan.solve = DirectLaunch(direct_fwd_kernel, _per_token_grid(B * H * NT, BT), (T, H, NT, B * H * NT),
                                  {"BT": BT, "P": POSITIONS, "BLOCK": 32 * LANE_WARPS, "HAS_BETA": has_beta,
                                   "USE_PTX": not interpreter_enabled()}, {"num_warps": LANE_WARPS, "num_stages": 1})
    else:
        from .kernel_causal_chebyshev import chebyshev_fwd_kernel

        plan.coarse, plan.solve = _chebyshev_launches(
            chebyshev_fwd_kernel, (NT, B * H), (num_iters, num_coarse, T, NT),
            {k: c[k] for k in ("H", "K", "BT", "PREC", "IN_EXACT", "HAS_BETA")}, num_coarse, cfg, cfg["solve_warps"])
    plan.readout = DirectLaunch(readout_kernel, (NT, B * H), (T, NT), c | {"BC": cfg["columns"]},
                                {"num_warps": cfg["tile_warps"], "num_stages": 1})
    return plan


def _build_bwd(fwd: _FwdPlan, q, v, has_beta: bool, has_alpha: bool) -> _BwdPlan:
    B, T, H, K = q.shape
    V = v.shape[3]
    cfg, BT, NT, NKR = fwd.cfg, fwd.BT, fwd.NT, fwd.NKR
    c = _common(cfg, q, v, has_beta, has_alpha)
    from .kernel_causal import adjoint_grad_kernel, adjoint_scan_kernel, dz_kernel, grad_kernel

    plan = _BwdPlan()
    plan.coarse = None
    plan.dend_shape, plan.eend_shape, plan.offs_shape = (B * H, NT, K, K), (B * H, NT, K, V), (B * H, NT, NKR)
    plan.dz = DirectLaunch(dz_kernel, (NT, B * H), (T, NT),
                           {k: c[k] for k in ("H", "K", "V", "BT", "PREC", "IN_EXACT", "HAS_BETA")}
                           | {"BC": cfg["columns"]}, {"num_warps": cfg["tile_warps"], "num_stages": 1})
    if fwd.per_token:
        from .kernel_causal_direct import direct_bwd_kernel

        plan.solve = DirectLaunch(direct_bwd_kernel, _per_token_grid(B * H * NT, BT), (T, H, NT, B * H * NT),
                                  {"BT": BT, "P": POSITIONS, "BLOCK": 32 * LANE_WARPS, "HAS_BETA": has_beta,
                                   "HAS_ALPHA": has_alpha, "USE_PTX": not interpreter_enabled()},
                                  {"num_warps": LANE_WARPS, "num_stages": 1})
    else:
        from .kernel_causal_chebyshev import chebyshev_bwd_kernel

        plan.coarse, plan.solve = _chebyshev_launches(
            chebyshev_bwd_kernel, (NT, B * H), (fwd.num_iters, fwd.num_coarse, T, NT),
            {k: c[k] for k in ("H", "K", "BT", "PREC", "IN_EXACT", "HAS_BETA", "HAS_ALPHA")}, fwd.num_coarse, cfg,
            cfg["adjoint_warps"])
    plan.fused = None
    if cfg["fused_grad"]:
        sms = sm_count(q.device, 0)
        n_whole, n_late = fused_split(cfg, B * H, NT, sms)
        plan.fused = DirectLaunch(adjoint_grad_kernel, (2 * B * H - n_whole,), (T, NT, n_whole, n_late),
                                  {k: c[k] for k in ("H", "K", "V", "BT", "PREC", "IN_EXACT", "HAS_BETA", "HAS_ALPHA")}
                                  | {"SPLIT": n_whole < B * H, "TAIL": T % BT == 1},
                                  launch_options(1, num_stages=2))
        return plan
    plan.scan = DirectLaunch(adjoint_scan_kernel, (NKR, B * H), (T, NT),
                             c | {"BKR": cfg["state_rows"], "NKR": NKR},
                             {"num_warps": cfg["scan_warps"], "num_stages": 2})
    plan.grad = DirectLaunch(grad_kernel, (NT, B * H), (T, NT), c | {"BC": cfg["columns"], "NKR": NKR},
                             {"num_warps": cfg["grad_warps"], "num_stages": 1})
    return plan


_FWD_PLANS = tuning.PlanCache()


def fwd_plan(q, k, v, g, beta, alpha, solver: str, num_iters: int, ridge: float) -> _FwdPlan:
    """The cached forward plan of this problem (``solver`` resolved: "direct", "chebyshev" or "chebyshev_auto")."""
    key = (q.shape, v.shape[3], q.dtype, v.dtype, g.dtype, None if beta is None else beta.dtype,
           None if alpha is None else alpha.dtype, q.device, solver, num_iters,
           None if solver == "chebyshev" else ridge)
    return _FWD_PLANS.get_or_build(key, lambda: _new_fwd_plan(key, q, v, beta, alpha, solver, num_iters, ridge))


def _new_fwd_plan(key, q, v, beta, alpha, solver: str, num_iters: int, ridge: float) -> _FwdPlan:
    K, V = q.shape[3], v.shape[3]
    per_token = per_token_solve(solver, K)
    cfg = launch_config(K, V, per_token)
    if solver == "chebyshev":
        iters, coarse = num_iters, 0
    elif solver == "chebyshev_auto":
        iters, coarse = auto_chebyshev_steps(ridge, coarse=max(K, V) <= COARSE_MAX_WIDTH or cfg["coarse_launch"])
    else:
        iters, coarse = converged_iters(ridge), 0
    return _build_fwd(key, cfg, q, v, beta is not None, alpha is not None, per_token, iters, coarse)


def causal_fwd(plan: _FwdPlan, q, k, v, g, beta, alpha, ridge: float, save: bool):
    """o, and (x, ‖H_t‖_F or None, H0, S0) for the backward when ``save``. Contiguous inputs expected."""
    aligned = aligned16(q, k, v, g, beta, alpha)
    dev = q.device
    dummy = plan.dummy
    beta_ = dummy if beta is None else beta
    alpha_ = dummy if alpha is None else alpha
    h0 = empty_output(plan.h0_shape, device=dev, dtype=torch.float32)
    s0 = empty_output(plan.s0_shape, device=dev, dtype=torch.float32)
    plan.state(aligned, k, v, g, beta_, h0, s0)
    x = empty_output(q.shape, device=dev, dtype=torch.float32)
    if plan.per_token:
        fro = None
        plan.solve(aligned, q, k, g, beta_, h0, x, ridge, EPS)
    else:
        fro = empty_output(q.shape[:3], device=dev, dtype=torch.float32)
        x_prev = dummy
        if plan.coarse is not None:
            x_prev = empty_output(q.shape, device=dev, dtype=torch.float32)
            plan.coarse(aligned, q, k, g, beta_, h0, x, fro, x_prev, ridge, EPS)
        plan.solve(aligned, q, k, g, beta_, h0, x, fro, x_prev, ridge, EPS)
    o = empty_output_like(v)
    plan.readout(aligned, q, k, v, g, beta_, alpha_, x, s0, o)
    return o, ((x, fro, h0, s0) if save else None)


def causal_bwd(fwd: _FwdPlan, q, k, v, g, beta, alpha, x, fro, h0, s0, do, ridge: float):
    """(dq, dk, dv, dg, dβ or None, dα or None); contiguous inputs expected."""
    plan = fwd.bwd
    if plan is None:
        plan = fwd.bwd = _build_bwd(fwd, q, v, beta is not None, alpha is not None)
    aligned = aligned16(q, k, v, g, beta, alpha, do)
    dev = q.device
    f32 = torch.float32
    dummy = fwd.dummy
    beta_ = dummy if beta is None else beta
    alpha_ = dummy if alpha is None else alpha
    dz = empty_output(q.shape, device=dev, dtype=f32)
    plan.dz(aligned, k, v, g, beta_, do, s0, dz)
    dq, y = empty_output_like(q), empty_output(q.shape, device=dev, dtype=f32)
    c, dgp = empty_output(q.shape[:3], device=dev, dtype=f32), empty_output(q.shape[:3], device=dev, dtype=f32)
    dalpha = None if alpha is None else empty_output_like(alpha)
    dalpha_ = dummy if dalpha is None else dalpha
    if fwd.per_token:
        plan.solve(aligned, q, k, g, beta_, alpha_, h0, x, dz, dq, dalpha_, y, c, dgp, ridge, EPS)
    else:
        y_prev = dummy
        if plan.coarse is not None:
            y_prev = empty_output(q.shape, device=dev, dtype=f32)
            plan.coarse(aligned, q, k, g, beta_, alpha_, h0, x, fro, dz, dq, dalpha_, y, c, dgp, y_prev, ridge, EPS)
        plan.solve(aligned, q, k, g, beta_, alpha_, h0, x, fro, dz, dq, dalpha_, y, c, dgp, y_prev, ridge, EPS)
    dk, dv, dg = empty_output_like(k), empty_output_like(v), empty_output_like(g)
    dbeta = None if beta is None else empty_output_like(beta)
    dbeta_ = dummy if dbeta is None else dbeta
    if plan.fused is not None:
        plan.fused(aligned, q, k, v, g, beta_, alpha_, do, x, y, c, dgp, h0, s0, dk, dv, dbeta_, dg)
        return dq, dk, dv, dg, dbeta, dalpha
    dend = empty_output(plan.dend_shape, device=dev, dtype=f32)
    eend = empty_output(plan.eend_shape, device=dev, dtype=f32)
    offs = empty_output(plan.offs_shape, device=dev, dtype=f32)
    plan.scan(aligned, q, k, g, beta_, alpha_, do, x, y, c, h0, s0, dend, eend, offs)
    plan.grad(aligned, q, k, v, g, beta_, alpha_, do, x, y, c, dgp, h0, dend, eend, offs, dk, dv, dbeta_, dg)
    return dq, dk, dv, dg, dbeta, dalpha
