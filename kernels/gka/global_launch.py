"""Launch plans and host functions of the non-causal GKA kernels (:mod:`.global_kernels`).

Vision calls are small (T = 49–197) and many, so eager calls are bound by host work: everything that depends only
on the problem's shape, dtypes, device, solver and flags (launch settings, constexprs, buffer shapes) is worked out
once into a cached plan, and a plan's later launches call the kernel Triton compiled for it directly
(:class:`visionssm.kernels.utils.DirectLaunch`). A call then allocates its outputs and launches one kernel: one for
the forward, one for the backward, no torch operation in between.

Launch settings can be forced for tuning through :mod:`visionssm.kernels.tuning`, op ``"gka"``, names prefixed
``global_`` (the causal kernels read the op's other names):

* ``global_block_t`` / ``global_block_t_bwd`` — tokens per tile (16, 32, 64 or 128) of the forward / backward;
* ``global_num_warps`` / ``global_num_warps_bwd`` — warps of the forward / backward program;
* ``global_max_registers`` / ``global_max_registers_bwd`` — a cap on the registers per thread of the forward /
  backward program (Triton's ``maxnreg``; ``None``: the compiler's choice);
* ``global_num_stages`` — software pipelining depth of the token loops;
* ``global_passes`` — bf16 inputs: 2 (default) multiplies the exact operand by both bf16 halves of the fp32
  matrix, 1 by the matrix rounded to bf16 (see :mod:`.global_kernels`). One pass takes 0.87× the fwd+bwd time at
  B256 T196 H10 D16 (H100) for 2.7–3.5e-3 relative error against the float64 solve where two give 1.7e-3 (SDPA in
  bf16: 2.1–2.4e-3; ``benchmarks/gka_global_timing.py --precision``), but on gradients that are cancelling sums over
  the tokens (the layer's β bias) it loses up to 2.7× more than the same layer composed of plain bf16 ops, so it
  stays an opt-in;
* ``global_reload`` — re-read the loops' K×V / K×K operands per token tile instead of holding them (wide heads);
* ``global_prefetch`` / ``global_prefetch_bwd`` — the forward's / backward's token loops load one tile ahead and each
  pass's first tile is read before the work that precedes it (Triton does not pipeline these loads itself); for heads
  up to 32 wide, whose tiles take few registers;
* ``global_split`` — the forward in three launches (statistics; the K×K solve on programs of
  ``global_solve_warps`` warps that hold nothing else, many to an SM; the read-out) instead of one: meant for 64-wide
  heads, whose fused program fits two to an SM and spends most of its time in the solve's serial steps. On by
  default for 64-wide heads (bf16 / fp16 inputs) with the block inverse (``global_solve_leaf``); with the 64-step
  sweep it was 0.99–1.00× the fused program's fwd+bwd at B256 T197 H6 D64 (H100, the sweep of
  benchmarks/gka_global_timing.py), 1.34× with one solve warp;
* ``global_solve_leaf`` — the width of the Gauss–Jordan sweeps of the direct solve (inputs other than fp32, which
  sweep the whole matrix in fp64): K sweeps the whole K×K matrix, K/2 and K/4 invert by one or two levels of 2×2
  Schur complements (:mod:`.inverse_kernels`); default K/2 for 64-wide heads (with ``global_split``), K otherwise;
* ``global_split_bwd`` — the backward in two launches: the query side and the state gradients (S and dU stored in a
  scratch buffer), then the key side on one program per (batch·head, token tile), which sums nothing over the
  tokens. Meant for 64-wide heads, whose one-launch backward takes 255 registers with spills at sm_90a (two programs
  per SM); off by default: fwd+bwd 0.628 against 0.534 ms at B256 T197 H6 D64 (H100, the block-inverse sweep of
  benchmarks/gka_global_timing.py);
* ``global_hold_p`` — the backward keeps P = M Uᵀ, computed for its query-side pass, in registers for the state
  gradients instead of computing it again there; not with ``global_reload``. Default: heads up to 32 wide without
  ``global_reload`` (a K×V fp32 tile, 8 registers a thread at 16-wide heads on one warp). H100, bf16, fwd+bwd from
  a CUDA graph (benchmarks/results/kernels-gka-global-held-p-*): 0.0781–0.0789 against 0.0794–0.0804 ms at B256
  T49 H20 D16, 0.1036–0.1040 against 0.1048–0.1051 at T196 H10; wider heads would hold it through a pass that
  already spills;
* ``global_sprec`` / ``global_solve_sprec`` — the precision (``"tf32x3"``, ``"bf16x3"``, ``"ieee"``) of the
  per-(batch, head) products of the read-out and the backward / of those inside the solve (see ``_launch_config``);
* ``global_packed`` — save H and M (symmetric) as packed upper triangles, K(K+1)/2 words each instead of K²: at 16-wide
  heads 0.94 KB less written by the forward and read by the backward per (batch, head). Heads up to 32 wide only
  (wider ones spill on the index tile); off by default: 0.99× at B256 T196 H10 / T49 H20 D16 in the same sweep,
  within that run's noise.
"""

from __future__ import annotations

import torch

from .. import tuning
from ..utils import DirectLaunch, aligned16, empty_output_like, launch_options, placeholder
from .global_kernels import gka_global_bwd_kernel, gka_global_fwd_kernel, gka_global_solve_kernel
from .naive import EPS

__all__ = ["GlobalPlan", "global_bwd", "global_fwd", "global_plan", "plan_config", "states_shape"]

_PREFIX = "global_"
_KNOWN = ("global_block_t", "global_block_t_bwd", "global_num_warps", "global_num_warps_bwd", "global_max_registers",
          "global_max_registers_bwd", "global_num_stages", "global_passes", "global_reload", "global_prefetch",
          "global_prefetch_bwd", "global_split", "global_solve_warps", "global_packed", "global_solve_leaf",
          "global_split_bwd", "global_hold_p", "global_sprec", "global_solve_sprec")
_SOLVER_IDS = {"direct": 0, "chebyshev": 1}


def _launch_config(K: int, V: int, T: int, dtype: torch.dtype) -> dict:
    """Launch settings by head width, sequence length and input dtype, chosen from sm_90a compiles (registers, spills,
    shared memory per program) and, for bf16 at the vision shapes, the H100 launch sweeps of
    benchmarks/gka_global_timing.py (64-wide heads: 32-token tiles, reload or 8 warps were all slower than the
    settings below).

    ``prec`` / ``sprec`` / ``solve_sprec``: the precision of the per-token fp32 products (non-bf16 inputs), of the
    per-(batch, head) K×K products of the read-out and the backward, and of those inside the solve. fp32 inputs get
    exact fp32 FMAs where they compile without spilling (heads ≤ 32) and tf32x3 otherwise. bf16 inputs get bf16x3
    outside the solve and tf32x3 inside it, except at 128-wide heads: these re-read their operands per token tile
    (``reload``) and take bf16x3 everywhere (tf32x3's operands alone would need 256 KB of shared memory)."""
    width = max(K, V)
    full = dtype == torch.float32
    cfg = {"block_t": 64, "num_warps": 2 if width <= 16 else 4, "num_stages": 2, "passes": 2, "reload": False,
           "prefetch": width <= 32, "split": False, "solve_warps": 4 if full else 2,
           "packed": False, "solve_leaf": K, "split_bwd": False, "hold_p": None,
           "prec": "tf32x3", "sprec": "tf32x3", "max_registers": None, "max_registers_bwd": None}
    if width <= 16 and not full:
        # H100 sweep (2026-11-23, bf16, fwd+bwd in a CUDA graph): 32-token tiles and one warp per (batch, head)
        # take 0.141 / 0.091 ms at B256 T196 H10 / B256 T49 H20 against 0.187 / 0.149 for 64 tokens and two warps
        # (more programs resident per SM to hide the per-program latency); 4 warps or 128 tokens are slower still.
        # Then (2026-11-24) the same for the two programs apart, which are bound by how many of them fit an SM's
        # registers: the forward in 16-token tiles (86 registers, 23 programs per SM, against 128 and 16) takes
        # 0.052 ms at T196 against 0.058 (no change at T49); the backward keeps 32-token tiles (16: 1.17x, more
        # loop steps) and at T196 is capped at 176 registers (11 programs per SM against 9, no spills at sm_90a;
        # fwd+bwd 0.121 against 0.127 ms), while at T49 the cap cost 1.06x. With the loads one tile ahead
        # (``prefetch``, same run): 0.106 / 0.080 ms, the backward then uncapped (capped at 176 it spills: 0.106 /
        # 0.115 without its prefetch)
        cfg.update(block_t=16, block_t_bwd=32, num_warps=1)
    if full and width <= 32:
        cfg.update(block_t=32, prec="ieee", sprec="ieee")
    elif full and width <= 64:
        cfg.update(block_t=32)
    elif K == 64 and V <= 64:
        # the solve in its own launch as 2x2 Schur complements on 32-step sweeps (see global_solve_leaf), on one
        # warp; H100, bf16, B256 T197 H6 D64, fwd+bwd from a CUDA graph (2026-11-24, SDPA 0.421 ms in the same call,
        # kernels-gka-global-blockinverse-final-*): one solve warp 0.534 ms (its solve kernel 69 µs), two 0.547
        # (85 µs), four 0.622 (157 µs); 16-wide leaves on two warps 0.539; the 64-step sweep 0.600 (140 µs); the
        # forward in one launch 0.640 with the block inverse held in registers (255 registers), 0.607 with the sweep
        cfg.update(split=True, solve_leaf=32, solve_warps=1)
    if width >= 128:
        cfg.update(block_t=32, num_warps=8, reload=True, sprec="ieee" if full else "bf16x3",
                   num_stages=1 if full else 2)
    cfg["solve_sprec"] = cfg["sprec"]
    if dtype == torch.bfloat16:
        # the read-out's and the backward's K×K / K×V products (not the solve's) in bf16x3 (~2⁻¹⁶ relative, against
        # the bf16 output's 2⁻⁹): H100, fwd+bwd from a CUDA graph (benchmarks/gka_global_timing.py --precision,
        # kernels-gka-global-sprec-*-2026-11-24.log), tf32x3 → bf16x3 took B256 T197 H6 D64 from 0.506 to
        # 0.426 ms, T49 H20 D16 0.0777 → 0.0752, T196 H10 D16 0.1047 → 0.1036, with the errors of o and of every
        # gradient against the float64 closed form unchanged in their three digits (1.66e-3 relative). The solve's
        # products (the 64-wide block inverse's Schur complements) in bf16x3 too took 0.416 ms at D64 with the same
        # errors at ridge 0.02; they keep tf32x3, because their cancellation, hence the loss, grows like 1/ridge
        cfg["sprec"] = "bf16x3"
    cfg.setdefault("block_t_bwd", cfg["block_t"])
    cfg.setdefault("prefetch_bwd", cfg["prefetch"])
    cfg["num_warps_bwd"] = cfg["num_warps"]
    forced = {name: value for name, value in tuning.overrides("gka").items() if name.startswith(_PREFIX)}
    if forced:
        tuning.check_names("gka", forced, _KNOWN)
        cfg.update({name[len(_PREFIX):]: value for name, value in forced.items()})
    for name in ("block_t", "block_t_bwd"):
        if cfg[name] not in (16, 32, 64, 128):
            raise ValueError(f"gka launch setting global_{name} must be 16, 32, 64 or 128, got {cfg[name]}")
    if cfg["passes"] not in (1, 2):
        raise ValueError(f"gka launch setting global_passes must be 1 or 2, got {cfg['passes']}")
    if cfg["solve_warps"] not in (1, 2, 4, 8):
        raise ValueError(f"gka launch setting global_solve_warps must be 1, 2, 4 or 8, got {cfg['solve_warps']}")
    if cfg["solve_leaf"] not in (K, K // 2, K // 4) or cfg["solve_leaf"] < 16:
        raise ValueError(f"gka launch setting global_solve_leaf must be K, K/2 or K/4 and at least 16 (K = {K}), got "
                         f"{cfg['solve_leaf']}")
    if cfg["solve_leaf"] != K and K != 64:
        # built and measured for 64-wide heads; at K = 128 the split forward with 32-wide leaves ran out of GPU
        # resources (H100, Triton 3.6) where Triton's interpreter had run it
        raise ValueError(f"gka launch setting global_solve_leaf below K needs 64-wide heads, got K = {K}")
    if cfg["packed"] and max(K, V) > 32:
        raise ValueError(f"gka launch setting global_packed needs heads up to 32 wide, got K = {K}, V = {V}")
    for name in ("sprec", "solve_sprec"):
        if cfg[name] not in ("tf32x3", "bf16x3", "ieee"):
            raise ValueError(f"gka launch setting global_{name} must be 'tf32x3', 'bf16x3' or 'ieee', got "
                             f"{cfg[name]!r}")
    if cfg["hold_p"] is None:
        cfg["hold_p"] = width <= 32 and not cfg["reload"]
    if cfg["hold_p"] and cfg["reload"]:
        raise ValueError("gka launch setting global_hold_p cannot be combined with global_reload")
    for name in ("prefetch", "prefetch_bwd", "split", "packed", "split_bwd", "hold_p"):
        if cfg[name] not in (True, False):
            raise ValueError(f"gka launch setting global_{name} must be True or False, got {cfg[name]!r}")
    return cfg


class GlobalPlan:
    """Everything about one problem's launches that does not change from call to call."""

    __slots__ = ("fwd", "bwd", "bwd_keys", "solve", "read_out", "states_shape", "scratch_shape", "dummy", "save")

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
        common = {"K": K, "V": V, "HAS_BETA": has_beta, "HAS_ALPHA": has_alpha,
                  "RELOAD": reload, "LP": low, "PASSES": cfg["passes"], "PREC": prec, "SPREC": sprec,
                  "EMU": interpreted, "PACKED": bool(cfg["packed"])}
        # the forward writes the state when a backward follows, as the read-out's operands (RELOAD), or to pass it
        # between its launches (split)
        split = bool(cfg["split"])
        self.save = save
        self.states_shape = states_shape(B, T, H, K, V, dtype, v_dtype, save, cfg)
        split_bwd = bool(cfg["split_bwd"])
        self.scratch_shape = (B * H, K * K + V * K) if reload or split_bwd else None
        self.dummy = placeholder(device)
        solve = {"SOLVER": _SOLVER_IDS[solver], "NUM_ITERS": num_iters, "F64": full, "EPS": EPS,
                 "LEAF": cfg["solve_leaf"]}
        fwd = {**{n: c for n, c in common.items() if n != "RELOAD"}, **solve, "BT": cfg["block_t"], "SAVE": save,
               "RELOAD": reload, "PREFETCH": bool(cfg["prefetch"]), "SOLVE_SPREC": solve_sprec}
        options = launch_options(cfg["num_warps"], num_stages=cfg["num_stages"], max_registers=cfg["max_registers"])
        self.fwd = DirectLaunch(gka_global_fwd_kernel, (B * H,), (T, H), {**fwd, "PHASE": 1 if split else 0}, options)
        self.solve = self.read_out = None
        if split:
            self.solve = DirectLaunch(gka_global_solve_kernel, (B * H,), (),
                                      {**solve, "K": K, "V": V, "RELOAD": reload, "SPREC": solve_sprec,
                                       "EMU": interpreted, "PACKED": common["PACKED"]},
                                      launch_options(cfg["solve_warps"], num_stages=1))
            self.read_out = DirectLaunch(gka_global_fwd_kernel, (B * H,), (T, H), {**fwd, "PHASE": 2}, options)
        self.bwd = self.bwd_keys = None
        if save:
            bwd = {**common, "BT": cfg["block_t_bwd"], "PREFETCH": bool(cfg["prefetch_bwd"]),
                   "HOLD_P": bool(cfg["hold_p"])}
            bwd_options = launch_options(cfg["num_warps_bwd"], num_stages=cfg["num_stages"],
                                         max_registers=cfg["max_registers_bwd"])
            self.bwd = DirectLaunch(gka_global_bwd_kernel, (B * H,), (T, H), {**bwd, "STAGE": 1 if split_bwd else 0},
                                    bwd_options)
            if split_bwd:
                tiles = -(-T // cfg["block_t_bwd"])
                self.bwd_keys = DirectLaunch(gka_global_bwd_kernel, (B * H, tiles), (T, H),
                                             {**bwd, "PREFETCH": False, "STAGE": 2}, bwd_options)


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
    return (B * H, state_words(K, V, reload, bool(cfg["packed"]))) if save or reload or split else None


def state_words(K: int, V: int, reload: bool, packed: bool) -> int:
    """fp32 words of one (batch, head)'s saved state (the kernels' ``_state_blocks``): H and M (symmetric; the upper
    triangle only when ``packed``), Uᵀ, and R only where the read-out re-reads it."""
    symmetric = K * (K + 1) // 2 if packed else K * K
    return 2 * symmetric + (2 if reload else 1) * K * V


def global_plan(q, v, beta, alpha, solver: str, num_iters: int, save: bool) -> GlobalPlan:
    """The cached plan for this call (built on first use of its shape, dtypes, device, flags and overrides)."""
    key = (q.shape, v.shape[3], q.dtype, v.dtype, None if beta is None else beta.dtype,
           None if alpha is None else alpha.dtype, q.device, solver, num_iters, save)
    return _PLANS.get_or_build(key, lambda: _new_plan(q, v, beta, alpha, solver, num_iters, save))


def _new_plan(q, v, beta, alpha, solver: str, num_iters: int, save: bool) -> GlobalPlan:
    B, T, H, K = q.shape
    if T * H * max(K, v.shape[3]) >= 2**31:
        raise ValueError(f"q: one sequence of T·H·K elements must stay below 2**31 for the Triton kernels, got "
                         f"shape {tuple(q.shape)} with V = {v.shape[3]}")
    return GlobalPlan(B, T, H, K, v.shape[3], dtype=q.dtype, v_dtype=v.dtype, device=q.device,
                      has_beta=beta is not None, has_alpha=alpha is not None, solver=solver,
                      num_iters=num_iters if solver == "chebyshev" else 0, save=save)


def global_fwd(plan: GlobalPlan, q, k, v, beta, alpha, ridge: float):
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


def global_bwd(plan: GlobalPlan, q, k, v, beta, alpha, states, do, ridge: float):
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
    if plan.bwd_keys is not None:
        plan.bwd_keys(aligned, *args)
    return dq, dk, dv, dbeta, dalpha
