"""Launch settings and cached launch plans of the SKA kernels.

Launch settings follow the key and value widths and the sequence length (:func:`launch_config`); none can be forced
(``launch_overrides("ska", ...)`` raises).

The causal chunk is 16 tokens (the smallest tile ``tl.dot`` takes). A plan holds everything that depends only on the
problem's shape, dtype, device and options (buffer shapes, grids, the kernels' scalar and constexpr arguments), so a
call only allocates and launches; after a plan's first launch the compiled kernels are relaunched directly
(:class:`visionssm.kernels.utils.DirectLaunch`), which matters at vision shapes, where eager calls are host-bound.
"""

from __future__ import annotations

import torch

from .. import tuning
from ..utils import DirectLaunch, aligned16, cdiv, empty_output, empty_output_like
from .kernel_causal import (
    ska_causal_bwd_token_kernel,
    ska_causal_bwd_walk_kernel,
    ska_causal_fwd_kernel,
    ska_causal_state_kernel,
)
from .kernel_noncausal import (
    ska_noncausal_dkv_kernel,
    ska_noncausal_dq_kernel,
    ska_noncausal_operator_bwd_kernel,
    ska_noncausal_operator_kernel,
    ska_noncausal_out_kernel,
    ska_noncausal_stats_kernel,
)
from .naive import EPS

OP = "ska"
#: Tokens per chunk of the causal kernels.
CHUNK = 16


def launch_config(R: int, V: int, T: int) -> dict:
    """Launch settings of one problem (R: key width, V: value width, T: tokens)."""
    wide = R * V >= 64 * 64 or R >= 64
    cfg = {
        # non-causal passes over the sequence: tokens per tile (a power of two >= 16) and warps; short sequences
        # take 32-token tiles on two warps (more programs per SM), longer ones 64 on four (64 spill on two)
        "block_t": 64 if T > 256 else 32 if T > 16 else 16,
        "num_warps": 8 if wide else 2 if T <= 256 and R * V <= 1024 else 4,
        # The non-causal operator kernels are latency-bound (a sequential inverse and power iteration per operator),
        # so the fewer warps share one operator, the fewer of its reductions cross warps and the more operators are
        # in flight: one operator per one-warp program up to R = 16, per two-warp program up to R·V = 1024 (one
        # warp spills there), then as many operators of R·V floats as fit 4096 per eight-warp program.
        "operators": 1 if R * V <= 1024 else max(1, 4096 // (R * V)),
        "operator_warps": 1 if R <= 16 and V <= 64 else 2 if R * V <= 1024 else 8,
        # the causal backward walk keeps three suffix sums and a dozen 16-token tiles live: eight warps (four spill)
        "walk_warps": 8,
        # the causal per-token kernels: eight warps (four spill)
        "chunk_warps": 8,
        # causal: tokens whose R×R operators are held at once, one [BS, R, R] block of 4096 floats: every token of
        # a chunk at R = 16, 4 at R = 32, 1 at R = 64
        "block_tokens": max(1, min(CHUNK, 4096 // (R * R))),
    }
    tuning.apply_overrides(OP, cfg, ())
    return cfg


def saved_shapes(B, T, H, R, V, causal: bool) -> tuple[tuple, ...]:
    """The shapes of the float32 tensors the forward keeps for the backward (:func:`run_noncausal_fwd`: the raw
    statistics, Ψ/s and the operators' factors; :func:`run_causal_fwd`: the chunk states), from the sizes alone."""
    BH = B * H
    if causal:
        NT = cdiv(T, CHUNK)
        return (BH, NT, R, R), (BH, NT, R, R), (BH, NT, R, V), (BH, NT, 2)
    stats = (BH, R, R), (BH, R, R), (BH, R, V), (BH, 2)
    # what the forward's operator kernel keeps for the backward: G_n⁻¹, N, W₀, 1/σ̂
    factors = (BH, R, R), (BH, R, R), (BH, R, V), (BH,)
    return (*stats, (BH, R, V), *factors)


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs: exact fp32 products (the 1e-4 tolerance of the fp32 tests); 16-bit inputs: TF32 tensor cores
    for the products of fp32 operands (far inside their tolerance). The R×R algebra is always exact fp32."""
    return "ieee" if dtype == torch.float32 else "tf32"


class NoncausalPlan:
    __slots__ = ("stats_shapes", "psi_shape", "factor_shapes", "grad_shapes", "stats", "operator", "operator_save",
                 "out", "dq", "operator_bwd", "dkv")


class CausalPlan:
    __slots__ = ("NT", "state_shapes", "factor_shape", "tok_shape", "ds_shape", "state", "fwd", "bwd_token",
                 "bwd_walk")


def build_noncausal(B, T, H, R, V, dtype, device, ridge, power, num_iters, normalize, strides) -> NoncausalPlan:
    """``strides``: (batch, token) strides of q, k and v, which may be views of one projection's output."""
    cfg = launch_config(R, V, T)
    q_strides, k_strides, v_strides = strides
    BH, NB = B * H, cfg["operators"]
    plan = NoncausalPlan()
    saved = saved_shapes(B, T, H, R, V, False)
    plan.stats_shapes, plan.psi_shape, plan.factor_shapes = saved[:4], saved[4], saved[5:]
    plan.grad_shapes = ((BH, R, R), (BH, R, R), (BH, R, V), (BH,))
    stream = {"R": R, "V": V, "BT": cfg["block_t"], "PREC": _precision(dtype)}
    operator = {"R": R, "V": V, "NB": NB, "POWER": power, "NUM_ITERS": num_iters, "NORMALIZE": normalize, "EPS": EPS}
    warps = {"num_warps": cfg["num_warps"]}
    operator_warps = {"num_warps": cfg["operator_warps"]}
    plan.stats = DirectLaunch(ska_noncausal_stats_kernel, (BH,), (T, H, *k_strides, *v_strides), stream, warps)
    plan.operator = DirectLaunch(ska_noncausal_operator_kernel, (cdiv(BH, NB),), (BH, ridge),
                                 {**operator, "SAVE": False}, operator_warps)
    plan.operator_save = DirectLaunch(ska_noncausal_operator_kernel, (cdiv(BH, NB),), (BH, ridge),
                                      {**operator, "SAVE": True}, operator_warps)
    plan.out = DirectLaunch(ska_noncausal_out_kernel, (BH,), (T, H, *q_strides), stream, warps)
    plan.dq = DirectLaunch(ska_noncausal_dq_kernel, (BH,), (T, H, *q_strides), stream, warps)
    plan.operator_bwd = DirectLaunch(ska_noncausal_operator_bwd_kernel, (cdiv(BH, NB),), (BH, ridge),
                                     {"R": R, "V": V, "NB": NB, "POWER": power, "EPS": EPS}, operator_warps)
    plan.dkv = DirectLaunch(ska_noncausal_dkv_kernel, (BH,), (T, H, *k_strides, *v_strides), stream, warps)
    return plan


def run_noncausal_fwd(plan: NoncausalPlan, q, k, v, save: bool):
    """o, and what the backward needs (the raw statistics, Ψ/s and the operators' factors; ``None`` unless
    ``save``)."""
    device = v.device
    stats = [empty_output(shape, device=device, dtype=torch.float32) for shape in plan.stats_shapes]
    psi = empty_output(plan.psi_shape, device=device, dtype=torch.float32)
    aligned = aligned16(q, k, v)
    plan.stats(aligned, k, v, *stats)
    own = aligned16(psi)  # the operator kernels take only the op's own buffers: aligned, None while traced
    if save:
        factors = [empty_output(shape, device=device, dtype=torch.float32) for shape in plan.factor_shapes]
        plan.operator_save(own, *stats, psi, *factors)
    else:
        plan.operator(own, *stats, psi, psi, psi, psi, psi)   # the factor pointers are not written without SAVE
    o = empty_output_like(v)
    plan.out(aligned, q, psi, o)
    return o, ([*stats, psi, *factors] if save else None)


def run_noncausal_bwd(plan: NoncausalPlan, q, k, v, do, saved):
    device = v.device
    stats, psi, factors = saved[:4], saved[4], saved[5:]
    dq, dk, dv = empty_output_like(q), empty_output_like(k), empty_output_like(v)
    qdo = empty_output(plan.psi_shape, device=device, dtype=torch.float32)
    grads = [empty_output(shape, device=device, dtype=torch.float32) for shape in plan.grad_shapes]
    aligned = aligned16(q, k, v, do)
    plan.dq(aligned, q, do, psi, dq, qdo)
    plan.operator_bwd(aligned16(qdo), *stats[1:], *factors, qdo, *grads)
    plan.dkv(aligned, k, v, stats[3], *grads, dk, dv)
    return dq, dk, dv


def build_causal(B, T, H, R, V, dtype, device, ridge, power, num_iters, normalize) -> CausalPlan:
    cfg = launch_config(R, V, T)
    BH, NT = B * H, cdiv(T, CHUNK)
    plan = CausalPlan()
    plan.NT = NT
    plan.state_shapes = saved_shapes(B, T, H, R, V, True)
    plan.factor_shape = (power + 1, BH, T, R)
    plan.tok_shape = (BH, T, 2)
    plan.ds_shape = (BH, T)
    prec = _precision(dtype)
    chunk = {"R": R, "V": V, "BT": CHUNK, "BS": cfg["block_tokens"], "POWER": power, "NUM_ITERS": num_iters,
             "NORMALIZE": normalize, "PREC": prec, "EPS": EPS}
    walk = {"num_warps": cfg["walk_warps"], "num_stages": 1}
    plan.state = DirectLaunch(ska_causal_state_kernel, (BH,), (T, H, NT),
                              {"R": R, "V": V, "BT": CHUNK, "PREC": prec}, walk)
    chunk_warps = {"num_warps": cfg["chunk_warps"]}
    plan.fwd = DirectLaunch(ska_causal_fwd_kernel, (NT, BH), (T, H, NT, ridge), chunk, chunk_warps)
    plan.bwd_token = DirectLaunch(ska_causal_bwd_token_kernel, (NT, BH), (T, H, NT, ridge), chunk, chunk_warps)
    plan.bwd_walk = DirectLaunch(ska_causal_bwd_walk_kernel, (BH,), (T, H, NT),
                                 {"R": R, "V": V, "BT": CHUNK, "POWER": power, "PREC": prec, "EPS": EPS}, walk)
    return plan


def run_causal_fwd(plan: CausalPlan, q, k, v, save: bool):
    """o, and the chunk states the backward reads again (``None`` unless ``save``)."""
    device = v.device
    states = [empty_output(shape, device=device, dtype=torch.float32) for shape in plan.state_shapes]
    aligned = aligned16(q, k, v)
    plan.state(aligned, k, v, *states)
    o = empty_output_like(v)
    plan.fwd(aligned, q, k, v, o, *states)
    return o, (states if save else None)


def run_causal_bwd(plan: CausalPlan, q, k, v, do, states):
    device = v.device
    dq, dk, dv = empty_output_like(q), empty_output_like(k), empty_output_like(v)
    xs = empty_output(plan.factor_shape, device=device, dtype=torch.float32)
    gas = empty_output(plan.factor_shape, device=device, dtype=torch.float32)
    tok = empty_output(plan.tok_shape, device=device, dtype=torch.float32)
    ds = torch.zeros(plan.ds_shape, device=device, dtype=torch.float32)   # accumulated into
    aligned = aligned16(q, k, v, do)
    plan.bwd_token(aligned, q, k, v, do, dq, *states, xs, gas, tok, ds)
    plan.bwd_walk(aligned, k, v, do, dk, dv, xs, gas, tok, ds)
    return dq, dk, dv


_PLANS = tuning.PlanCache()


def kernel_inputs(q, k, v, causal: bool):
    """q, k, v as the kernels read them. The non-causal kernels take any batch and token strides as long as each
    token's (H, D) block is contiguous, so the q, k, v views a layer splits off one projection's output are read in
    place (copies of them would cost about as much memory traffic as the forward's own passes); everything else,
    and every input of the causal kernels, is made contiguous."""
    if causal:
        return q.contiguous(), k.contiguous(), v.contiguous()
    return tuple(t if t.stride(3) == 1 and t.stride(2) == t.shape[3] else t.contiguous() for t in (q, k, v))


def get_plan(q, k, v, causal: bool, ridge: float, power: int, num_iters: int, normalize: bool):
    """The plan of inputs as :func:`kernel_inputs` returns them."""
    strides = None if causal else tuple(t.stride()[:2] for t in (q, k, v))
    key = (q.shape, v.shape[3], q.dtype, v.dtype, q.device, causal, ridge, power, num_iters, normalize, strides)
    return _PLANS.get_or_build(key, lambda: _build(q, v, causal, (ridge, power, num_iters, normalize), strides))


def _build(q, v, causal: bool, options: tuple, strides):
    problem = (*q.shape, v.shape[3], q.dtype, q.device, *options)
    # the causal kernels take contiguous inputs (kernel_inputs), so only the non-causal plan has strides
    return build_causal(*problem) if causal else build_noncausal(*problem, strides)
