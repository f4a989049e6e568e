"""Launch plans and host functions of the non-causal GKA kernels (:mod:`.kernel_noncausal`).

Vision calls are small (T = 49–197) and many, so eager calls are bound by host work: everything that depends only
on the problem's shape, dtypes, device, solver and flags (launch settings, constexprs, buffer shapes) is worked out
once into a cached plan, and a plan's later launches call the kernel Triton compiled for it directly
(:class:`visionssm.kernels.utils.DirectLaunch`). A call then allocates its outputs and launches one kernel: one for
the forward, one for the backward, no torch operation in between.

Tile sizes, warps and pipelining follow the head width and dtype (:func:`_launch_config`). Tests may force, through
:mod:`visionssm.kernels.tuning` (op ``"gka"``, names prefixed ``noncausal_``), the layouts that the rule takes only
at other widths:

* ``noncausal_reload`` — re-read the loops' K×V / K×K operands per token tile instead of holding them (the rule:
  heads of 128 and wider, whose operands do not fit registers);
* ``noncausal_split`` — the forward in three launches (statistics; the K×K solve on programs that hold nothing else,
  many to an SM; the read-out) instead of one (the rule: 64-wide 16-bit heads, whose fused program fits two to an
  SM and spends most of its time in the solve's serial steps; their solve is the block inverse);
* ``noncausal_sprec`` / ``noncausal_solve_sprec`` — the precision (``"tf32x3"``, ``"bf16x3"``, ``"ieee"``) of the
  per-(batch, head) products of the read-out and the backward / of those inside the solve (see ``_launch_config``).
"""

from __future__ import annotations

import torch

from .. import tuning
from ..utils import DirectLaunch, aligned16, empty_output_like, launch_options, placeholder
from .kernel_noncausal import gka_noncausal_bwd_kernel, gka_noncausal_fwd_kernel, gka_noncausal_solve_kernel
from .naive import EPS

__all__ = ["SETTINGS", "NoncausalPlan", "noncausal_bwd", "noncausal_fwd", "noncausal_plan", "plan_config",
           "states_shape"]

_PREFIX = "noncausal_"
#: The launch settings tests may force (see the module's docstring).
SETTINGS = ("noncausal_reload", "noncausal_split", "noncausal_sprec", "noncausal_solve_sprec")
_SOLVER_IDS = {"direct": 0, "chebyshev": 1}


def _launch_config(K: int, V: int, T: int, dtype: torch.dtype) -> dict:
    """Launch settings by head width and input dtype (sm_90a compiles: registers, spills, shared memory per program).

    ``prec`` / ``sprec`` / ``solve_sprec``: the precision of the per-token fp32 products (non-bf16 inputs), of the
    per-(batch, head) K×K products of the read-out and the backward, and of those inside the solve. fp32 inputs get
    exact fp32 FMAs where they compile without spilling (heads ≤ 32) and tf32x3 otherwise. bf16 inputs get bf16x3
    outside the solve and tf32x3 inside it, except at 128-wide heads: these re-read their operands per token tile
    (``reload``) and take bf16x3 everywhere (tf32x3's operands alone would need 256 KB of shared memory)."""
    width = max(K, V)
    full = dtype == torch.float32
    cfg = {"block_t": 64, "num_warps": 2 if width <= 16 else 4, "num_stages": 2, "reload": False,
           "prefetch": width <= 32, "split": False, "solve_warps": 4 if full else 2, "block_inverse": False,
           "prec": "tf32x3", "sprec": "tf32x3"}
    if width <= 16 and not full:
        # narrow 16-bit heads are bound by how many programs fit an SM's registers: one warp, small forward tiles
        # (fewer registers), 32-token backward tiles (smaller ones add loop steps)
        cfg.update(block_t=16, block_t_bwd=32, num_warps=1)
    if full and width <= 32:
        cfg.update(block_t=32, prec="ieee", sprec="ieee")
    elif full and width <= 64:
        cfg.update(block_t=32)
    elif K == 64 and V <= 64:
        # the 64-wide solve's serial steps dominate: a launch of its own on one warp, as the block inverse
        cfg.update(split=True, block_inverse=True, solve_warps=1)
    if width >= 128:
        cfg.update(block_t=32, num_warps=8, reload=True, sprec="ieee" if full else "bf16x3",
                   num_stages=1 if full else 2)
    cfg["solve_sprec"] = cfg["sprec"]
    if dtype == torch.bfloat16:
        # bf16x3 (~2⁻¹⁶ relative) is far below the bf16 output's rounding and faster than tf32x3; the solve keeps
        # tf32x3, whose products' cancellation, hence the loss, grows like 1/ridge
        cfg["sprec"] = "bf16x3"
    cfg.setdefault("block_t_bwd", cfg["block_t"])
    forced = {name: value for name, value in tuning.overrides("gka").items() if name.startswith(_PREFIX)}
    if forced:
        tuning.check_names("gka", forced, SETTINGS)
        cfg.update({name[len(_PREFIX):]: value for name, value in forced.items()})
    for name in ("sprec", "solve_sprec"):
        if cfg[name] not in ("tf32x3", "bf16x3", "ieee"):
            raise ValueError(f"gka launch setting {_PREFIX}{name} must be 'tf32x3', 'bf16x3' or 'ieee', got "
                             f"{cfg[name]!r}")
    for name in ("reload", "split"):
        if cfg[name] not in (True, False):
            raise ValueError(f"gka launch setting {_PREFIX}{name} must be True or False, got {cfg[name]!r}")
    # the backward holds P = M Uᵀ through its query-side pass where that costs few registers
    cfg["hold_p"] = width <= 32 and not cfg["reload"]
    return cfg


class NoncausalPlan:
    """Everything about one problem's launches that does not change from call to call."""

    __slots__ = ("fwd", "bwd", "solve", "read_out", "states_shape", "scratch_shape", "dummy", "save")

    def __init__(self, B: int, T: int, H: int, K: int, V: int, *, dtype: torch.dtype, v_dtype: torch.dtype,
                 device: torch.device, has_beta: bool, has_alpha: bool, solver: str, num_iters: int, save: bool):
        full = dtype == torch.float32 or v_dtype == torch.float32
        cfg = plan_config(K, V, T, dtype, v_dtype)
        interpreted = device.type != "cuda"
        # bf16 inputs: split products on bf16 tensor cores; fp32 inputs: exact fp32 FMAs where they fit (tf32x3's
        # 2⁻²¹ per product costs part of the 1e-4 gradient accuracy they are held to); fp16: tf32x3 (no room for a
        # low half in fp16); the interpreter: exact fp32 (bf16x3 state products emulated like the bf16 dots)
        low = dtype == torch.bfloat16 and v_dtype == torch.bfloat16
        prec = "ieee" if interpreted else cfg["prec"]
        sprec = "ieee" if interpreted and cfg["sprec"] != "bf16x3" else cfg["sprec"]
        solve_sprec = "ieee" if interpreted and cfg["solve_sprec"] != "bf16x3" else cfg["solve_sprec"]
        reload = bool(cfg["reload"])
        common = {"K": K, "V": V, "HAS_BETA": has_beta, "HAS_ALPHA": has_alpha, "RELOAD": reload, "LP": low,
                  "PREC": prec, "SPREC": sprec, "EMU": interpreted, "PREFETCH": bool(cfg["prefetch"])}
        # the forward writes the state when a backward follows, as the read-out's operands (RELOAD), or to pass it
        # between its launches (split)
        split = bool(cfg["split"])
        self.save = save
        self.states_shape = states_shape(B, T, H, K, V, dtype, v_dtype, save, cfg)
        self.scratch_shape = (B * H, K * K + V * K) if reload else None
        self.dummy = placeholder(device)
        solve = {"SOLVER": _SOLVER_IDS[solver], "NUM_ITERS": num_iters, "F64": full, "EPS": EPS}
        fwd = {**common, **solve, "BT": cfg["block_t"], "SAVE": save, "SOLVE_SPREC": solve_sprec}
        options = launch_options(cfg["num_warps"], num_stages=cfg["num_stages"])
        self.fwd = DirectLaunch(gka_noncausal_fwd_kernel, (B * H,), (T, H), {**fwd, "PHASE": 1 if split else 0},
                                options)
        self.solve = self.read_out = None
        if split:
            self.solve = DirectLaunch(gka_noncausal_solve_kernel, (B * H,), (),
                                      {**solve, "K": K, "V": V, "RELOAD": reload, "SPREC": solve_sprec,
                                       "EMU": interpreted, "BLOCK_INVERSE": bool(cfg["block_inverse"])},
                                      launch_options(cfg["solve_warps"], num_stages=1))
            self.read_out = DirectLaunch(gka_noncausal_fwd_kernel, (B * H,), (T, H), {**fwd, "PHASE": 2}, options)
        self.bwd = None
        if save:
            self.bwd = DirectLaunch(gka_noncausal_bwd_kernel, (B * H,), (T, H),
                                    {**common, "BT": cfg["block_t_bwd"], "HOLD_P": bool(cfg["hold_p"])}, options)


_PLANS = tuning.PlanCache()


def plan_config(K: int, V: int, T: int, dtype: torch.dtype, v_dtype: torch.dtype) -> dict:
    """The launch settings of a problem with inputs q / k in ``dtype`` and v in ``v_dtype`` (fp32 settings when
    either is fp32)."""
    full = dtype == torch.float32 or v_dtype == torch.float32
    return _launch_config(K, V, T, torch.float32 if full else dtype)


def states_shape(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, v_dtype: torch.dtype, save: bool,
                 cfg: dict | None = None) -> tuple[int, int] | None:
    """Shape of the fp32 states the forward writes (H, M, Uᵀ per (batch, head); None: it writes none): when they are
    saved for the backward, or the read-out re-reads them or the split forward passes them between its launches.
    ``cfg``: :func:`plan_config`'s, computed when not given (a pure function of shapes, dtypes and overrides, so
    the registered op's fake kernel gives the shape the launch allocates)."""
    if cfg is None:
        cfg = plan_config(K, V, T, dtype, v_dtype)
    reload, split = bool(cfg["reload"]), bool(cfg["split"])
    return (B * H, state_words(K, V, reload)) if save or reload or split else None


def state_words(K: int, V: int, reload: bool) -> int:
    """fp32 words of one (batch, head)'s saved state (the kernels' ``_state_blocks``): H and M, Uᵀ, and R only where
    the read-out re-reads it."""
    return 2 * K * K + (2 if reload else 1) * K * V


def noncausal_plan(q, v, beta, alpha, solver: str, num_iters: int, save: bool) -> NoncausalPlan:
    """The cached plan for this call (built on first use of its shape, dtypes, device, flags and overrides)."""
    key = (q.shape, v.shape[3], q.dtype, v.dtype, None if beta is None else beta.dtype,
           None if alpha is None else alpha.dtype, q.device, solver, num_iters, save)
    return _PLANS.get_or_build(key, lambda: _new_plan(q, v, beta, alpha, solver, num_iters, save))


def _new_plan(q, v, beta, alpha, solver: str, num_iters: int, save: bool) -> NoncausalPlan:
    B, T, H, K = q.shape
    if T * H * max(K, v.shape[3]) >= 2**31:
        raise ValueError(f"q: one sequence of T·H·K elements must stay below 2**31 for the Triton kernels, got "
                         f"shape {tuple(q.shape)} with V = {v.shape[3]}")
    return NoncausalPlan(B, T, H, K, v.shape[3], dtype=q.dtype, v_dtype=v.dtype, device=q.device,
                      has_beta=beta is not None, has_alpha=alpha is not None, solver=solver,
                      num_iters=num_iters if solver == "chebyshev" else 0, save=save)


def noncausal_fwd(plan: NoncausalPlan, q, k, v, beta, alpha, ridge: float):
    """``o`` and, when the plan saves them, the per-(batch, head) H, M, Uᵀ for the backward (contiguous inputs)."""
    dummy = plan.dummy
    o = empty_output_like(v)
    shape = plan.states_shape
    states = dummy if shape is None else torch.empty(shape, device=q.device, dtype=torch.float32)
    aligned = aligned16(q, k, v, beta, alpha)
    args = (q, k, v, dummy if beta is None else beta, dummy if alpha is None else alpha, o, states, ridge)
    plan.fwd(aligned, *args)
    if plan.solve is not None:
        plan.solve(aligned, states, ridge)
        plan.read_out(aligned, *args)
    return o, (states if plan.save else None)


def noncausal_bwd(plan: NoncausalPlan, q, k, v, beta, alpha, states, do, ridge: float):
    """(dq, dk, dv, dβ, dα) in the dtypes of their inputs (dβ / dα None where β / α are); contiguous inputs."""
    dummy = plan.dummy
    dq, dk, dv = empty_output_like(q), empty_output_like(k), empty_output_like(v)
    dbeta = None if beta is None else empty_output_like(beta)
    dalpha = None if alpha is None else empty_output_like(alpha)
    shape = plan.scratch_shape
    scratch = dummy if shape is None else torch.empty(shape, device=q.device, dtype=torch.float32)
    args = (q, k, v, dummy if beta is None else beta, dummy if alpha is None else alpha, do, states, scratch, dq, dk,
            dv, dummy if dbeta is None else dbeta, dummy if dalpha is None else dalpha, ridge)
    aligned = aligned16(q, k, v, beta, alpha, do)
    plan.bwd(aligned, *args)
    return dq, dk, dv, dbeta, dalpha
