"""Launch layout and launch plans of the Comba kernels.

Layout rules (:func:`launch_config`) follow the head widths, the sequence count and whether a backward follows;
each comment there states a rule and why it holds. Every setting can be forced through
:mod:`visionssm.kernels.tuning` under the op name ``"comba"``, e.g. ``launch_overrides("comba", split_bwd=False)``:

================== ====================================================================================================
setting            meaning
================== ====================================================================================================
value_block        value columns per program (a power of two ≥ 16); split only to put more programs on the GPU
num_warps          warps of every kernel but the chunk-parallel inverse pass (one, two or four)
dh_num_warps       warps of the split backward's state-gradient walk
grad_num_warps     warps of the backward's gradient kernel (one pass or per chunk)
dir_loop           non-causal: one program runs both directions (else one per program, fp32 partial outputs)
inv_pass           compute every chunk's inverse in a chunk-parallel pass before the forward walk
pre_wy             also W = inv·pw and U0 = inv·βv in that pass (the walk then skips the K-side products)
prefetch           the forward walk loads chunk i+1 while chunk i is computed
bwd_prefetch       the same in the one-pass backward
wave_slots         training forward walk, ``dir_loop``, one value block: programs the GPU runs at once (None: its SMs ×
                   PROGRAMS_PER_SM; 0: off). When the last wave of both-direction programs would be at most half
                   full, its sequences get one program per direction instead (half as long, twice as many)
split_bwd          backward as a state-gradient walk, then one program per chunk (else one pass per sequence)
store_inv          the forward keeps each chunk's inverse for the backward (else the backward recomputes it)
state_lp           bf16 inputs: the states kept for the backward (h0, dh) are stored in bf16 and every backward
                   product but those with a chunk's inverse runs on 16-bit tensor cores (else fp32 storage and TF32
                   products; the walks carry their state in fp32 either way)
fwd_lp             with state_lp, the forward walk's products (but the inverse's) on 16-bit tensor cores too
walk_max_registers register cap per thread of the forward walk and the split backward's state-gradient walk (None: the
                   compiler's choice)
grad_max_registers register cap per thread of the backward's gradient kernel (None: the compiler's choice)
================== ====================================================================================================

Launch plans: everything a call does that depends only on the problem's shape, dtypes, device and flags (layout,
buffer shapes, grids, the kernels' scalar and constexpr arguments) is worked out once per such key and cached, so
a call only allocates its outputs and launches; after a plan's first launch the compiled kernels are called
directly (:class:`visionssm.kernels.utils.DirectLaunch`). Vision workloads are host-bound in eager mode.
"""

from __future__ import annotations

import torch

from .. import tuning
from ..utils import (
    DirectLaunch,
    aligned16,
    cdiv,
    empty_output,
    empty_output_like,
    launch_options,
    next_pow2,
    placeholder,
    sm_count,
    wave_slots,
)
from .kernel_bwd import comba_bwd_dh_kernel, comba_bwd_kernel
from .kernel_fwd import comba_fwd_kernel, comba_inv_kernel

OP = "comba"
SETTINGS = ("value_block", "num_warps", "dh_num_warps", "grad_num_warps", "dir_loop", "inv_pass", "pre_wy", "prefetch",
            "bwd_prefetch", "split_bwd", "store_inv", "state_lp", "fwd_lp", "walk_max_registers", "grad_max_registers",
            "wave_slots")
#: Tokens per chunk: 32-token chunks (the inverse merged one level further) cost more in the inverse than they save.
CHUNK = 16
#: One-warp programs of the 16-wide forward walk an SM runs at once (the forward's time steps at multiples of this
#: per SM); only the forward is balanced, the backward's extra gradient zeroing eats what balancing would gain.
PROGRAMS_PER_SM = 8


def launch_config(K: int, V: int, T: int, BH: int, ND: int, training: bool = True) -> dict:
    """The layout of one problem: K, V head dims, T tokens, BH = batch·heads sequences, ND directions; ``training``:
    a backward follows (the forward keeps its states)."""
    BK = max(16, next_pow2(K))
    BV = max(16, next_pow2(V))
    # Few (batch, head) sequences: split the value dimension to put more programs on the GPU.
    while BV > 32 and (BH * ND * cdiv(V, BV) < 128 or BK * BV > 64 * 64):
        BV //= 2
    NV = cdiv(V, BV)
    programs = BH * ND * NV
    # warps follow the state tile (one up to 16×16, four from 32×32): more warps split these small tiles too finely
    num_warps = 1 if BK * BV <= 256 else 2 if BK * BV < 1024 else 4
    wide = max(BK, BV) >= 64
    # per-chunk backward programs for 128-wide keys, whose one-pass walk is too long, and for 64-wide ones when the
    # sequences are few (B·H ≤ 80): with one or two walks per SM each one-pass walk is latency-bound, and a light
    # state-gradient walk then chunk-parallel gradients are faster (1.05-1.5x at B·H 18-72; one pass wins from 96)
    long_keys = BK > 64
    split_bwd = long_keys or (BK == 64 and BH <= 80)
    # the gradient kernel keeps the walk's warps (more split small tiles) and no register cap (caps spill); per-chunk
    # programs of 64-wide keys take two (four split their 16-row tiles too finely, one warp does too much alone:
    # fwd+bwd 1.06-1.12x and 1.3x slower at B4 T16384)
    grad_num_warps = 2 if split_bwd and BK == 64 else num_warps
    cfg = {"value_block": BV, "num_warps": num_warps, "dh_num_warps": num_warps, "grad_num_warps": grad_num_warps,
           # non-causal: both directions in one program once sequences fill the GPU (no fp32 partials to add);
           # fewer sequences keep a program per direction for the parallelism
           "dir_loop": ND == 2 and BH * NV >= 768,
           # inverses off the walk's sequential path for wide states only (a separate pass costs 16-wide ones more
           # than it saves); in causal training with one-pass backward the forward's gain is lost in fwd+bwd
           "inv_pass": long_keys or (wide and (ND == 2 or not training)),
           # W and U0 stored up front only when the value dimension is split over programs (the walk would repeat
           # the K-side work per block); with one block the extra memory traffic costs more than it saves
           "pre_wy": NV > 1 and programs < 1024 and T > 64,
           # prefetch except in 16-wide two-direction walks, where holding both next chunks costs more than it hides
           "prefetch": wide or ND == 1,
           # backward prefetch for 16-wide heads only: the 64-wide one-pass backward has no registers left for it
           "bwd_prefetch": not wide,
           "split_bwd": split_bwd,
           # the forward keeps each chunk's inverse for 128-wide keys only: elsewhere recomputing it in the backward is
           # cheaper than storing and reloading it (or costs the same, at 64-wide with the split backward)
           "store_inv": long_keys,
           # bf16 states and backward products halve the state traffic; the gradient error stays within the tests'
           # bf16 tolerance, including their hard cases (nearly parallel keys, iplr gain near 2)
           "state_lp": True,
           # off: 16-bit products in the forward push the output error of those hard cases past the tests' tolerance
           "fwd_lp": False,
           # with more wide walks than SM slots, a cap that fits three walks per SM instead of two (without spills);
           # with fewer walks the cap only costs, and the gradient kernel spills under any cap
           "walk_max_registers": 168 if wide and programs >= 1024 else None,
           "grad_max_registers": None,
           "wave_slots": None}
    tuning.apply_overrides(OP, cfg, SETTINGS)
    cfg["BK"], cfg["BV"] = BK, cfg["value_block"]
    cfg["NV"] = cdiv(V, cfg["BV"])
    return cfg


def _precision(dtype: torch.dtype, device_type: str) -> dict:
    """PREC, LP_DOT: fp32 inputs get exact fp32 products; fp16/bf16 inputs TF32 tensor cores (well inside their
    tolerance; three-pass TF32 for the inverse slows the forward for accuracy no test needs) and the products of two
    input tiles on 16-bit tensor cores (with ``state_lp``, bf16 inputs take every backward product but the inverse's
    there). Triton's interpreter multiplies 16-bit dots wrongly, so LP_DOT is a GPU-only path (cuda tests cover it)."""
    low = dtype in (torch.float16, torch.bfloat16)
    return {"PREC": "tf32" if low else "ieee", "LP_DOT": low and device_type == "cuda"}


def _atomic_add(device_type: str, gate_dtypes: tuple[torch.dtype, ...], dtype: torch.dtype) -> bool:
    """Whether the backward's second direction adds its gradients onto the first's by atomic adds instead of loading
    them first, which stalled the warps on each of its six gradients per chunk: on the GPU, and in Triton's
    interpreter (which has no 16-bit atomics) when every gradient is fp32, so that CPU tests run this path too. The
    forward keeps its load: its one output tile per chunk is cheaper loaded than added atomically."""
    return device_type == "cuda" or all(d == torch.float32 for d in (dtype, *gate_dtypes))


def _state_dtype(cfg: dict, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the stored states: bf16 for bf16 inputs with ``state_lp`` (fp16's range is too small for a
    state), else fp32."""
    return torch.bfloat16 if cfg["state_lp"] and dtype == torch.bfloat16 else torch.float32


def _tail(T: int, BT: int) -> int:
    """1 when the last chunk holds a single token (T = 49 = 3·16 + 1): a rank-1 step instead of a padded chunk."""
    return int(T % BT == 1)


def _pre_pass(cfg: dict, T: int) -> bool:
    """Whether the chunk-parallel inverse (and W/U0) pass runs before the forward walk."""
    return (cfg["inv_pass"] or cfg["pre_wy"]) and cdiv(T, CHUNK) > _tail(T, CHUNK)  # (one token has no chunk)


def saved_layout(cfg: dict, B: int, T: int, H: int, K: int, V: int, ND: int, dtype: torch.dtype,
                 save_state: bool) -> tuple[tuple[int, ...] | None, torch.dtype, tuple[int, ...] | None]:
    """What a forward under ``cfg`` keeps for its backward: (h0's shape, h0's dtype, the fp32 inverses' shape); a
    shape is None for a tensor not kept. The forward plan and the registered op's fake both take it from here."""
    NT = cdiv(T, CHUNK)
    save_inv = save_state and (cfg["store_inv"] or _pre_pass(cfg, T))
    return ((ND, B * H, NT, K, V) if save_state else None, _state_dtype(cfg, dtype),
            (ND, B * H, NT, CHUNK, CHUNK) if save_inv else None)


def training_saved_layout(B: int, T: int, H: int, K: int, V: int, causal: bool,
                          dtype: torch.dtype) -> tuple[tuple[int, ...], torch.dtype, tuple[int, ...] | None]:
    """:func:`saved_layout` of a training forward (the one :func:`fwd_plan` builds with ``save_state``)."""
    ND = 1 if causal else 2
    return saved_layout(launch_config(K, V, T, B * H, ND, training=True), B, T, H, K, V, ND, dtype, True)


def _directions(cfg: dict, ND: int) -> tuple[int, int]:
    """(programs along grid axis 2, directions each program runs)."""
    return (1, ND) if cfg["dir_loop"] else (ND, 1)


def _pairs(cfg: dict, B: int, H: int, ND: int, sms: int, atomic: bool) -> int:
    """Sequences whose forward walk gets one program for both directions (``BALANCE`` in ``comba_fwd_kernel``; all
    B·H unless balancing pays): when the grid's last wave of both-direction programs would be at most half full, the
    sequences of that wave (whole batch entries, so that their outputs are one block of memory to zero) get one
    program per direction instead, which then fill at most one wave of programs half as long. ``sms``: the GPU's
    SM count (0 off the GPU); the programs it runs at once are ``wave_slots`` if set, else PROGRAMS_PER_SM per SM,
    measured for one-warp walks only. ``atomic``: the output takes atomic adds (:func:`_atomic_add`)."""
    BH = B * H
    slots = wave_slots(cfg["wave_slots"], sms, PROGRAMS_PER_SM, cfg["num_warps"] == 1)
    if not (slots and atomic and ND == 2 and cfg["dir_loop"] and cfg["NV"] == 1):
        return BH
    pairs = BH // slots * slots // H * H
    return pairs if pairs and 2 * (BH - pairs) <= slots else BH


class FwdPlan:
    __slots__ = ("save_state", "save_inv", "partial", "o_shape", "h0_shape", "state_dtype", "inv_shape",
                 "w_shape", "u0_shape", "pre", "main", "dummy", "bwd", "cached", "zero_from")


class BwdPlan:
    __slots__ = ("NP", "grid_dirs", "main", "dh_walk", "dh_shape")


def build_fwd(cfg: dict, B: int, T: int, H: int, K: int, V: int, ND: int, dtype: torch.dtype,
              device: torch.device, save_state: bool) -> FwdPlan:
    BT, BV = CHUNK, cfg["BV"]
    NT = cdiv(T, BT)
    TAIL = _tail(T, BT)
    grid_dirs, _ = _directions(cfg, ND)
    pre = _pre_pass(cfg, T)
    plan = FwdPlan()
    plan.save_state, plan.bwd, plan.cached = save_state, None, False
    plan.h0_shape, plan.state_dtype, saved_inv = saved_layout(cfg, B, T, H, K, V, ND, dtype, save_state)
    plan.save_inv = saved_inv is not None
    # one program per direction pair: o directly; one per direction: an fp32 partial per direction, summed after
    plan.partial = grid_dirs > 1
    plan.o_shape = (grid_dirs, B, T, H, V)
    # the pass writes the inverses whether or not the backward keeps them
    plan.inv_shape = (ND, B * H, NT, BT, BT) if plan.save_inv or pre else None
    wy = pre and cfg["pre_wy"]
    plan.w_shape = (ND, B * H, NT, BT, K) if wy else None
    plan.u0_shape = (ND, B * H, NT, BT, V) if wy else None
    plan.dummy = placeholder(device)
    precision = _precision(dtype, device.type)
    dims = (T, NT, B, H)
    common = {"K": K, "V": V, "BT": BT, "LOG2_BT": BT.bit_length() - 1, "BK": cfg["BK"], **precision}
    plan.pre = None
    if pre:
        BVF = max(16, next_pow2(V))
        warps = (4 if cfg["BK"] * BVF >= 64 * 64 else 2) if wy else 1 if BT * cfg["BK"] <= 512 else 2
        plan.pre = DirectLaunch(comba_inv_kernel, (NT - TAIL, B * H), dims,
                                {**common, "BVF": BVF, "N_DIR": ND, "SAVE_WY": wy}, {"num_warps": warps})
    # training only: without stored states the walk is short enough that balancing's extra zeroing does not pay
    sms = sm_count(device, 0)
    pairs = _pairs(cfg, B, H, ND, sms, _atomic_add(device.type, (), dtype)) if save_state else B * H
    # the batch entries whose outputs the one-direction programs add onto (None: every sequence has both directions
    # in one program)
    plan.zero_from = pairs // H if pairs < B * H else None
    plan.main = DirectLaunch(comba_fwd_kernel, (cfg["NV"], 2 * B * H - pairs, grid_dirs), (*dims, pairs),
                             {**common, "BV": BV, "N_DIR": ND, "DIR_LOOP": cfg["dir_loop"], "SAVE_H": save_state,
                              "SAVE_INV": plan.save_inv and not pre, "INV_IN": pre and not wy, "LOAD_WY": wy,
                              "PREFETCH": cfg["prefetch"], "TAIL": TAIL,
                              "STATE_LP": plan.state_dtype != torch.float32 and cfg["fwd_lp"],
                              "BALANCE": plan.zero_from is not None},
                             launch_options(cfg["num_warps"], max_registers=cfg["walk_max_registers"]))
    return plan


def run_fwd(plan: FwdPlan, q, k, v, p, g, beta, scale: float):
    """Returns (o, h0, inv): h0 / inv (None unless the plan saves state) are what the backward reads back."""
    device = q.device
    aligned = aligned16(q, k, v, p, g, beta)
    # empty_like (the cheapest allocation) where no NaN poisoning is asked for; o has v's shape and dtype then
    o = empty_output(plan.o_shape, device=device, dtype=torch.float32) if plan.partial else empty_output_like(v)
    if plan.zero_from is not None:
        o[plan.zero_from:].zero_()
    dummy = plan.dummy
    h0 = dummy if plan.h0_shape is None else empty_output(plan.h0_shape, device=device, dtype=plan.state_dtype)
    inv = dummy if plan.inv_shape is None else empty_output(plan.inv_shape, device=device, dtype=torch.float32)
    w = dummy if plan.w_shape is None else empty_output(plan.w_shape, device=device, dtype=torch.float32)
    u0 = dummy if plan.u0_shape is None else empty_output(plan.u0_shape, device=device, dtype=torch.float32)
    if plan.pre is not None:
        plan.pre(aligned, k, p, g, beta, inv, w, u0, v)
    plan.main(aligned, q, k, v, p, g, beta, o, h0, inv, w, u0, scale)
    if plan.partial:
        o = _sum_partials(o, v.dtype)
    return o, (h0 if plan.save_state else None), (inv if plan.save_inv else None)


def build_bwd(cfg: dict, B: int, T: int, H: int, K: int, V: int, ND: int, dtype: torch.dtype,
              device: torch.device, has_inv: bool, state_dtype: torch.dtype,
              gate_dtypes: tuple[torch.dtype, ...]) -> BwdPlan:
    """``has_inv`` and ``state_dtype`` say what the forward stored (its inverses, its states' dtype): the backward
    follows them, not the settings in force when it runs. ``gate_dtypes``: those of g and β (their gradients')."""
    BT, BV, NV = CHUNK, cfg["BV"], cfg["NV"]
    NT = cdiv(T, BT)
    TAIL = _tail(T, BT)
    # split: one program per full chunk (the single-token chunk goes with the last), and the dh walk when there is
    # more than one of them
    split = cfg["split_bwd"]
    programs = max(1, NT - TAIL) if split else 1
    grid_dirs, _ = _directions(cfg, ND)
    plan = BwdPlan()
    common = {"K": K, "V": V, "BT": BT, "LOG2_BT": BT.bit_length() - 1, "BK": cfg["BK"], "BV": BV, "N_DIR": ND,
              **_precision(dtype, device.type), "LOAD_INV": has_inv, "TAIL": TAIL}
    state_lp = state_dtype != torch.float32
    dims = (T, NT, B, H)
    plan.dh_shape = (ND, B * H, NT, K, V) if programs > 1 else None
    walk_options = launch_options(cfg["dh_num_warps"], max_registers=cfg["walk_max_registers"])
    plan.dh_walk = None if programs == 1 else DirectLaunch(comba_bwd_dh_kernel, (NV, B * H, ND), dims,
                                                           {**common, "STATE_LP": state_lp}, walk_options)
    # partial gradients per value block and grid direction (usually one: the gradients themselves)
    plan.NP, plan.grid_dirs = grid_dirs * NV, grid_dirs
    plan.main = DirectLaunch(comba_bwd_kernel, (programs, B * H, NV * grid_dirs), dims,
                             {**common, "NV": NV, "DIR_LOOP": cfg["dir_loop"], "SPLIT": split,
                              "ATOMIC_ADD": _atomic_add(device.type, gate_dtypes, dtype),
                              "PREFETCH": cfg["bwd_prefetch"] and not split, "STATE_LP": state_lp},
                             launch_options(cfg["grad_num_warps"], max_registers=cfg["grad_max_registers"]))
    return plan


def _sum_partials(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sum over the leading axis of fp32 ``partials``, in ``dtype``. Two partials (the two directions of a
    non-causal call, the usual case) take one kernel that adds and rounds (``torch.add`` into an output of the final
    dtype) where ``sum`` then a cast take two launches and an fp32 intermediate."""
    if partials.shape[0] != 2:
        return partials.sum(0).to(dtype)
    out = empty_output(partials.shape[1:], device=partials.device, dtype=dtype)
    return torch.add(partials[0], partials[1], out=out)


def _partials(count: int, like: torch.Tensor) -> torch.Tensor:
    """The gradient of ``like`` (one partial: in its own dtype) or ``count`` fp32 partials, summed afterwards."""
    if count == 1:
        return empty_output_like(like)
    return empty_output((count, *like.shape), device=like.device, dtype=torch.float32)


def run_bwd(plan: BwdPlan, q, k, v, p, g, beta, h0, inv, do, scale: float):
    aligned = aligned16(q, k, v, p, g, beta, do)
    NP, grid_dirs = plan.NP, plan.grid_dirs
    if NP == 1 and grid_dirs == 1:  # the usual case: each gradient shaped like its (contiguous) input
        dq, dk, dv, dp = empty_output_like(q), empty_output_like(k), empty_output_like(v), empty_output_like(p)
        dg, dbeta = empty_output_like(g), empty_output_like(beta)
    else:
        dq, dk, dp, dg, dbeta = (_partials(NP, t) for t in (q, k, p, g, beta))
        dv = _partials(grid_dirs, v)
    inv = h0 if inv is None else inv  # an unread pointer when the inverses are recomputed
    dh = h0  # an unread pointer without the dh walk
    if plan.dh_walk is not None:
        dh = empty_output(plan.dh_shape, device=h0.device, dtype=h0.dtype)
        plan.dh_walk(aligned, q, k, p, g, beta, inv, do, dh, scale)
    plan.main(aligned, q, k, v, p, g, beta, h0, inv, dh, do, dq, dk, dv, dp, dg, dbeta, scale)
    if NP > 1:
        dq, dk, dp = _sum_partials(dq, q.dtype), _sum_partials(dk, k.dtype), _sum_partials(dp, p.dtype)
        dg, dbeta = _sum_partials(dg, g.dtype), _sum_partials(dbeta, beta.dtype)
    if grid_dirs > 1:
        dv = _sum_partials(dv, v.dtype)
    return dq, dk, dv, dp, dg, dbeta


_FWD_PLANS = tuning.PlanCache()
_BWD_PLANS = tuning.PlanCache()


def fwd_plan(q, v, g, beta, causal: bool, save_state: bool) -> FwdPlan:
    key = (q.shape, v.shape[3], q.dtype, g.dtype, beta.dtype, q.device, causal, save_state)
    return _FWD_PLANS.get_or_build(key, lambda: _build_cached_fwd(q, v, causal, save_state))


def _build_cached_fwd(q, v, causal: bool, save_state: bool) -> FwdPlan:
    B, T, H, K = q.shape
    V = v.shape[3]
    ND = 1 if causal else 2
    plan = build_fwd(launch_config(K, V, T, B * H, ND, training=save_state), B, T, H, K, V, ND, q.dtype, q.device,
                     save_state)
    plan.cached = True
    return plan


def bwd_plan(q, v, g, beta, do, causal: bool, has_inv: bool, state_dtype: torch.dtype) -> BwdPlan:
    key = (q.shape, v.shape[3], q.dtype, g.dtype, beta.dtype, do.dtype, q.device, causal, has_inv, state_dtype)
    return _BWD_PLANS.get_or_build(key, lambda: _build_cached_bwd(q, v, g, beta, causal, has_inv, state_dtype))


def _build_cached_bwd(q, v, g, beta, causal: bool, has_inv: bool, state_dtype: torch.dtype) -> BwdPlan:
    B, T, H, K = q.shape
    V = v.shape[3]
    ND = 1 if causal else 2
    return build_bwd(launch_config(K, V, T, B * H, ND), B, T, H, K, V, ND, q.dtype, q.device, has_inv,
                     state_dtype, (g.dtype, beta.dtype))
