"""Launch plans of causal GKA: everything a call does that depends only on the problem's shape, dtypes, flags and
device (layout choice, buffer sizes, grids, constexprs) is worked out once per such key and cached, and a plan's
later launches call the kernels Triton compiled for it directly (:class:`visionssm.kernels.utils.DirectLaunch`).
Between launches nothing but output allocation runs on the host: no reductions, flips or casts.

Forward: state scan → solve (per-token direct solve for 16-wide heads, chunked Chebyshev otherwise) → read-out.
Backward: dz → adjoint solve → adjoint-state scan → gradients (16-wide heads: scan and gradients in one kernel).

Launch settings (heuristics below; overrides through :mod:`visionssm.kernels.tuning`, op ``"gka"``):

* ``chunk``: tokens per chunk (16 or 32) for every stage;
* ``positions``: chunk positions per program of the per-token solve (divides ``chunk``; fewer means shorter loops
  over the chunk's keys, more programs reading the same chunk state);
* ``lane_warps``: warps per program of the per-token solve (32 tokens each);
* ``solve_warps``, ``adjoint_warps``: warps of the Chebyshev forward and backward (adjoint) solves;
* ``tile_warps``, ``grad_warps``, ``scan_warps``: warps of the chunk-parallel read-out and dz kernels, of the gradient
  kernel and of the two scans over the chunks;
* ``state_rows``: rows of the K-wide states one scan program carries (divides K);
* ``columns``: output columns the read-out, dz and gradient kernels compute at a time (divides K and V);
* ``coarse_launch``: ``solver="auto"``'s coarse Chebyshev steps in a launch of their own before the full ones (the
  iterates pass through memory), so that neither launch holds the other's registers; ``coarse_warps``: its warps;
* ``fused_grad``: 16-wide heads only: the adjoint-state scan and the gradient kernel as one program per (b, h)
  walking the chunks backwards (``adjoint_grad_kernel``) instead of a scan plus a chunk-parallel kernel;
  ``fused_stages``: its software-pipelining depth (1: none; 2, 3: the next chunks' loads in flight);
  ``fused_regs``: its register cap per thread (0: none; fewer registers, more programs per SM, some spilled);
  ``fused_warps``: its warps; ``fused_wave_slots``: programs of it the GPU runs at once (None: its SMs ×
  FUSED_PROGRAMS_PER_SM for the default one-warp uncapped kernel, else 0; 0: off): when the grid's last wave would
  be at most half full, its sequences get two programs each, one walking the last ``fused_late_chunks`` chunks
  (None: :func:`late_chunks`), the other the chunks before them.
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

SETTINGS = ("chunk", "positions", "lane_warps", "solve_warps", "adjoint_warps", "tile_warps", "grad_warps",
            "scan_warps", "state_rows", "columns", "coarse_launch", "coarse_warps", "fused_grad", "fused_stages",
            "fused_regs", "fused_warps", "fused_wave_slots", "fused_late_chunks")
#: Relative accuracy the iteration reaches for ``solver="direct"`` on heads the per-token factorisation does not fit.
DIRECT_ITER_TOL = 1e-7
#: Widest heads whose ``solver="auto"`` solve runs its coarse steps in the same launch as the full ones (wider heads:
#: a launch of their own, ``coarse_launch``). H100, 2026-11-24, CUDA graph, bf16
#: (benchmarks/results/gka-wide-solver-*-2026-11-24.log): at B256 T197 H6 D64 29 steps with 10 coarse in one launch
#: took 1.831 / 5.686 ms (fwd / fwd+bwd) against 2.086 / 6.158 for the paper's 30 full ones. At B4 T2048 H8 D128 the
#: one-launch solve kernels already spill (3.8 KB a thread in the forward at sm_90a), and with the coarse loop
#: compiled in the spills doubled and the forward took 2.55 ms against 1.86 without it. In a launch of their own
#: (kernels-gka-coarse-launch-*-2026-11-24.log, same process): D128 fwd / fwd+bwd 1.567 / 3.661 ms against 1.725 /
#: 3.868 with 28 full steps in one launch, the forward solve's spills 208 bytes instead of 3.8 KB; at D64 the
#: separate launch took 2.050 / 5.547 against 1.795 / 5.212 ms.
COARSE_MAX_WIDTH = 64
#: One-warp programs of the fused adjoint-gradient kernel an SM runs at once (255 registers a thread), as its GPU
#: time shows (H100, 132 SMs, B·10 sequences of T196 D16;
#: benchmarks/results/comba-waves-nvidia-h100-80gb-hbm3-2026-11-24.log):
#: 186.4 µs at B211 (2,110 sequences, 2.00 waves of 1,056 programs), 256.3 at B212, 268.3 at B256 (2.42 waves).
FUSED_PROGRAMS_PER_SM = 8
#: Time of a chunk step of the fused adjoint-gradient kernel that only adds the chunk's share to the adjoint states,
#: as a fraction of a full step (gradients and share): the step is bound by its loads, which it shares with the full
#: one. :func:`late_chunks` balances a split sequence's two programs by it. Fitted on an H100 (B256 T196 H10 D16,
#: 13 chunks, 448 sequences split; benchmarks/results/kernels-gka-fused-split-*-2026-11-24.log and
#: kernels-gka-fused-split-late-*-2026-11-24.log): the kernel took 266 µs unsplit and 250 / 246 / 244 / 241 / 237 /
#: 239 / 244 / 250 µs with 5 to 12 late chunks, least at 9-10, where the two programs balance for a share of 0.6.
STATE_STEP_SHARE = 0.6


def converged_iters(ridge: float, tol: float = DIRECT_ITER_TOL) -> int:
    """Chebyshev steps after which the iterate is within ``tol`` (relative) of the exact ridge solution for every
    H_t (:func:`.naive.chebyshev_steps`; 60 steps at ridge 0.02 for the default fp32 tolerance)."""
    return chebyshev_steps(ridge, tol)


def launch_config(K: int, V: int, per_token: bool) -> dict:
    """Launch settings for heads of width K (keys) and V (values); ``per_token``: the per-token direct solve.

    Measured on an H100 (2026-11-23, benchmarks/results/kernels-gka-causal-nvidia-h100-2026-11-23.log): the per-token
    solve with 4 positions per program (programs loop over at most 4, 8, 12 or 16 keys of their chunk) took
    158 / 196 µs (forward / backward kernel) at B256 T196 H10 D16 against 219 / 260 µs with one program covering
    the whole 16-token chunk (8 positions: 178 / 214 µs; fwd+bwd 0.848 / 0.882 / 0.979 ms).

    Heads wider than 32 (H100, 2026-11-24, CUDA graph; benchmarks/results/
    kernels-gka-wide-warps-nvidia-h100-80gb-hbm3-2026-11-24.log): at B4 T2048 H8 D128, with the same Chebyshev
    kernels, every stage on 4 warps with 16 state rows per scan program took 2.00 / 4.81 ms (fwd / fwd+bwd) against
    2.54 / 5.82 ms with 8 warps and 32 rows (gradient kernel 792 vs 1335 µs, read-out 164 vs 328 µs, dz 132 vs
    239 µs, forward solve 1698 vs 2066 µs); at B256 T197 H6 D64 the backward solve took 1697 µs on 4 warps (the current
    Chebyshev kernels) against 2737 µs on 8 (the previous ones). 64-token chunks (every stage on 4
    warps) ran at B1 but ended in an illegal memory access at B4 T2048 H8 D128 and at B256 T197 H6 D64 (Triton 3.6;
    the error surfaced at the backward's first launches, so a forward kernel or dz is at fault). In Triton's
    interpreter with every active load and store checked against its launch's tensors, the kernels' own addresses stay
    in bounds at 64-token chunks (64- and 128-wide heads, partial last chunks), which points to the code Triton 3.6
    generates for these tiles (not established further). Chunks are therefore at most 32 tokens.

    Output columns at a time and the adjoint solve's warps (H100, 2026-11-24, CUDA graph, solver auto; benchmarks/
    results/kernels-gka-wide-launch-nvidia-h100-80gb-hbm3-2026-11-24.log): 64 columns took the gradient kernel from
    1336 to 952 µs and dz from 200 to 158 µs at B256 T197 H6 D64 (fwd+bwd 5.68 → 5.21 ms; 32 columns 5.47), and from
    723 to 614 / 133 to 89 µs at B4 T2048 H8 D128 (128 columns spilled: 7.3 ms); at D128 the adjoint solve on
    8 warps took 1088 against 1288 µs (fwd+bwd with both 4.04 against 4.40 ms), where at D64 it took 2313 against
    1444 µs and the forward solve on 8 warps at D128 1725 against 1553 µs. The coarse launch (``coarse_launch``, on at
    heads wider than COARSE_MAX_WIDTH) on 8 warps at D128 took the forward solve to 1708 against 1273 µs on 4
    (kernels-gka-coarse-launch-nvidia-h100-80gb-hbm3-2026-11-24.log).

    The fused adjoint-scan + gradient kernel (H100, 2026-11-24, same run as the separate kernels,
    benchmarks/results/kernels-gka-causal-fused-grad-nvidia-h100-80gb-hbm3-2026-11-24.log): 278.6 against
    134.2 + 218.5 µs at B256 T196 H10 D16 and 148.0 against 84.3 + 135.4 µs at B256 T49 H20 D16, with 2 pipeline
    stages (1: 320.7 / 167.4 µs); 3 stages and register caps of 152-200 (which spill) were no faster
    (kernels-gka-causal-fused-launch-nvidia-h100-80gb-hbm3-2026-11-24.log); on 2 or 4 warps it took 407 / 773 µs
    against 269 at T196 and 251 / 475 against 143 at T49
    (kernels-gka-causal-fused-warps-nvidia-h100-80gb-hbm3-2026-11-24.log)."""
    width = max(K, V)
    if per_token:
        cfg = {"chunk": 16, "positions": 4, "lane_warps": 4}
    else:
        cfg = {"chunk": 16 if width <= 32 else 32, "lane_warps": 4}
    # warps by width: up to 32-wide heads one or two warps; wider heads 4 warps in every stage (measured, see above;
    # the Chebyshev solve holds 255 registers a thread, so two 4-warp programs share an SM where one 8-warp program
    # sits alone, and 8 warps split a 32-row tile's columns, each warp reading the whole 32×K operand again)
    small = 1 if width <= 16 else 2
    for name in ("solve_warps", "adjoint_warps", "tile_warps", "grad_warps", "scan_warps", "coarse_warps"):
        cfg[name] = small if width <= 32 else 4
    # the scans carry whole states up to 64-wide heads: at B256 T197 H6 D64 the adjoint scan took 562 µs with one
    # program per (b, h) against 883 with four of 16 rows, each reading the chunk's full-width tiles again (fwd+bwd
    # 4.846 against 5.177 ms; 32 rows 4.94); at D128 32 rows took 554 against 405 µs with 16
    # (kernels-gka-scan-rows-nvidia-h100-80gb-hbm3-2026-11-24.log, kernels-gka-wide-launch-*-2026-11-24.log)
    cfg["state_rows"] = K if K <= 64 else 16
    cfg["columns"] = min(K, V, 64)
    cfg["coarse_launch"] = width > COARSE_MAX_WIDTH
    if K >= 128:
        cfg["adjoint_warps"] = 8
    cfg["fused_grad"] = width <= 16
    cfg["fused_stages"] = 2
    cfg["fused_regs"] = 0
    cfg["fused_warps"] = 1
    cfg["fused_wave_slots"] = None
    cfg["fused_late_chunks"] = None
    # "global_*" settings belong to the non-causal plans (global_launch), which check them
    forced = {name: value for name, value in tuning.overrides("gka").items() if not name.startswith("global_")}
    if forced:
        tuning.check_names("gka", forced, SETTINGS)
        cfg.update(forced)
    cfg.setdefault("positions", cfg["chunk"])
    if cfg["chunk"] not in (16, 32) or cfg["chunk"] % cfg["positions"]:
        raise ValueError(f"gka launch settings: chunk must be 16 or 32 and a multiple of positions, got {cfg}")
    if K % cfg["state_rows"] or cfg["state_rows"] < 16:
        raise ValueError(f"gka launch settings: state_rows must divide K = {K} and be >= 16, got {cfg['state_rows']}")
    if cfg["fused_grad"] and width > 16:
        raise ValueError(f"gka launch settings: fused_grad needs heads of at most 16, got K = {K}, V = {V}")
    if cfg["fused_stages"] not in (1, 2, 3):
        raise ValueError(f"gka launch settings: fused_stages must be 1, 2 or 3, got {cfg['fused_stages']}")
    if cfg["fused_regs"] and not 64 <= cfg["fused_regs"] <= 255:
        raise ValueError(f"gka launch settings: fused_regs must be 0 or in [64, 255], got {cfg['fused_regs']}")
    for name, least in (("fused_wave_slots", 0), ("fused_late_chunks", 1)):
        value = cfg[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise ValueError(f"gka launch settings: {name} must be None or an integer >= {least}, got {value!r}")
    if K % cfg["columns"] or V % cfg["columns"] or cfg["columns"] < 16:
        raise ValueError(f"gka launch settings: columns must divide K = {K} and V = {V} and be >= 16, got "
                         f"{cfg['columns']}")
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
    wave) get two, the late one walking the last n_late chunks (:func:`late_chunks` unless set). ``sms``: the GPU's
    SM count (0 off the GPU); the programs it runs at once are ``fused_wave_slots`` if set, else
    FUSED_PROGRAMS_PER_SM per SM for the measured one-warp uncapped kernel. Returns (BH, 0) for no split."""
    slots = wave_slots(cfg["fused_wave_slots"], sms, FUSED_PROGRAMS_PER_SM,
                       cfg["fused_warps"] == 1 and not cfg["fused_regs"])
    last = BH % slots if slots else 0
    if NT < 2 or not last or 2 * last > slots:
        return BH, 0
    late = late_chunks(NT) if cfg["fused_late_chunks"] is None else cfg["fused_late_chunks"]
    return BH - last, min(late, NT - 1)


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
    from .causal_kernels import readout_kernel, state_fwd_kernel

    plan.state = DirectLaunch(state_fwd_kernel, (NKR, B * H), (T, NT),
                              {k: c[k] for k in ("H", "K", "V", "BT", "PREC", "IN_EXACT", "HAS_BETA")}
                              | {"BKR": cfg["state_rows"]}, {"num_warps": cfg["scan_warps"], "num_stages": 2})
    if per_token:
        from .direct_kernels import direct_fwd_kernel

        block = 32 * cfg["lane_warps"]
        n_inst = B * H * NT
        plan.solve = DirectLaunch(direct_fwd_kernel, (BT // cfg["positions"], cdiv(n_inst, block // cfg["positions"])),
                                  (T, H, NT, n_inst), {"BT": BT, "P": cfg["positions"], "BLOCK": block,
                                                       "HAS_BETA": has_beta, "USE_PTX": not interpreter_enabled()},
                                  {"num_warps": cfg["lane_warps"], "num_stages": 1})
    else:
        from .chebyshev_kernels import chebyshev_fwd_kernel

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
    from .causal_kernels import adjoint_grad_kernel, adjoint_scan_kernel, dz_kernel, grad_kernel

    plan = _BwdPlan()
    plan.coarse = None
    plan.dend_shape, plan.eend_shape, plan.offs_shape = (B * H, NT, K, K), (B * H, NT, K, V), (B * H, NT, NKR)
    plan.dz = DirectLaunch(dz_kernel, (NT, B * H), (T, NT),
                           {k: c[k] for k in ("H", "K", "V", "BT", "PREC", "IN_EXACT", "HAS_BETA")}
                           | {"BC": cfg["columns"]}, {"num_warps": cfg["tile_warps"], "num_stages": 1})
    if fwd.per_token:
        from .direct_kernels import direct_bwd_kernel

        block = 32 * cfg["lane_warps"]
        n_inst = B * H * NT
        plan.solve = DirectLaunch(direct_bwd_kernel, (BT // cfg["positions"], cdiv(n_inst, block // cfg["positions"])),
                                  (T, H, NT, n_inst), {"BT": BT, "P": cfg["positions"], "BLOCK": block,
                                                       "HAS_BETA": has_beta, "HAS_ALPHA": has_alpha,
                                                       "USE_PTX": not interpreter_enabled()},
                                  {"num_warps": cfg["lane_warps"], "num_stages": 1})
    else:
        from .chebyshev_kernels import chebyshev_bwd_kernel

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
                                  launch_options(cfg["fused_warps"], num_stages=cfg["fused_stages"],
                                                 max_registers=cfg["fused_regs"] or None))
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
