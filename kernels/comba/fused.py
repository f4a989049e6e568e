"""Triton kernels for Comba: one program walks a whole (batch, head[, value block]) sequence chunk by chunk.

Each chunk of ``BT`` tokens is done in the WY/UT form (one unit-lower triangular inverse per chunk, see
:mod:`.naive` for the algebra; the inverse is a product of log2(BT) factors, all small tensor-core products); the
state ``h ∈ R^{K×BV}`` stays in registers (fp32) between chunks, so nothing but the inputs, the outputs and — when a
backward will follow — one fp32 state per chunk ever touches global memory. Vision workloads (T ≈ 49–320,
batch × heads in the thousands) fill the GPU with programs; long sequences with few heads split the value
dimension over programs (the K-side chunk work is then repeated per value block: the long-sequence path is not
FLA's parallel-over-chunks split, see the benchmark results).

Non-causal calls run the reversed recurrence in the same launch, addressing tokens as ``T − 1 − j`` (no reversed
copies of the inputs): with many programs each one runs both directions and adds the second onto its own output
(``DIR_LOOP``); with few, a second grid slice (``program_id(2) == 1``) takes the reversed direction and the two
partial outputs are summed afterwards.

Backward: the forward stores the state entering every chunk (``h0``); the backward walks the chunks in reverse,
recomputes the chunk's WY quantities from ``h0`` and carries ``dh`` in registers. Gradients that sum over the value
dimension (dq, dk, dp, dβ, dg) are written per value block (and grid direction) and reduced afterwards.

Launch layout (chunk size, warps, direction handling) comes from a heuristic; for large small-head problems on CUDA
a few candidates are timed once per problem shape and the fastest kept (``_pick``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils import autocast_custom_bwd, autocast_custom_fwd, empty_output, input_guard

__all__ = ["CombaFunction", "fused_comba"]


@triton.jit
def _unit_lower_inverse(A, BT: tl.constexpr, LOG2_BT: tl.constexpr):
    """(I + A)^{-1} for a strictly lower triangular [BT, BT] tile.

    A is nilpotent, so with N = −A: (I + A)^{-1} = I + N + … + N^{BT−1} = (I + N)(I + N²)(I + N⁴)…(I + N^{BT/2}):
    2·log2(BT) − 2 small matrix products on tensor cores instead of BT dependent row updates. Always exact fp32
    products: the factors cancel each other."""
    rows = tl.arange(0, BT)
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    power = -A
    inv = eye + power
    for _ in tl.static_range(LOG2_BT - 1):
        power = tl.dot(power, power, input_precision="ieee")
        inv += tl.dot(inv, power, input_precision="ieee")
    return inv


@triton.jit
def _load_chunk(q, k, p, v, g, beta, i_b, i_h, i_d, i_c, o_k, o_v, T, H, K: tl.constexpr,
                V: tl.constexpr, BT: tl.constexpr):
    o_t = tl.arange(0, BT)
    j = i_c * BT + o_t
    m_t = j < T
    t_idx = tl.where(i_d == 0, j, T - 1 - j)
    row = (i_b.to(tl.int64) * T + t_idx) * H + i_h
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
    b_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
    b_p = tl.load(p + row[:, None] * K + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
    b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_tv, other=0).to(tl.float32)
    b_g = tl.load(g + row, mask=m_t, other=0).to(tl.float32)
    b_beta = tl.load(beta + row, mask=m_t, other=0).to(tl.float32)
    return b_q, b_k, b_p, b_v, b_g, b_beta, row, m_t, m_tk, m_tv


@triton.jit
def _chunk_wy(b_k, b_p, b_v, b_g, b_beta, BT: tl.constexpr, LOG2_BT: tl.constexpr, PREC: tl.constexpr):
    """Gate cumsums and the chunk's WY quantities: Gi, Ge, A, (I+A)^{-1}, W, U0."""
    o_t = tl.arange(0, BT)
    strict = o_t[:, None] > o_t[None, :]
    b_Gi = tl.cumsum(b_g, 0)
    b_Ge = b_Gi - b_g
    b_pk = tl.dot(b_p, tl.trans(b_k), input_precision=PREC)
    b_E = tl.where(strict, tl.exp(tl.where(strict, b_Ge[:, None] - b_Gi[None, :], 0.0)), 0.0)
    b_A = b_beta[:, None] * b_pk * b_E
    b_inv = _unit_lower_inverse(b_A, BT, LOG2_BT)
    b_pw = b_p * (b_beta * tl.exp(b_Ge))[:, None]
    b_W = tl.dot(b_inv, b_pw, input_precision=PREC)
    b_U0 = tl.dot(b_inv, b_v * b_beta[:, None], input_precision=PREC)
    return b_Gi, b_Ge, b_pk, b_E, b_A, b_inv, b_W, b_U0


@triton.jit
def _accumulate(ptr, value, mask, ACC):
    """Store ``value``, adding what is already there when ``ACC`` (the second direction of a program)."""
    if ACC:
        value += tl.load(ptr, mask=mask, other=0).to(tl.float32)
    tl.store(ptr, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def comba_fwd_kernel(q, k, v, p, g, beta, o, h0, scale, T, NT, B, H, K: tl.constexpr,
                     V: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     SAVE_H: tl.constexpr, DIR_LOOP: tl.constexpr, N_DIR: tl.constexpr, PREC: tl.constexpr):
    # DIR_LOOP: this program runs every direction itself, adding the reversed pass onto its own forward output
    # (no partial buffers); otherwise program_id(2) picks the direction and each writes its own slot.
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    lower = o_t[:, None] >= o_t[None, :]
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    for i_dd in range(0, N_DIR):
        i_d = i_dd + tl.program_id(2)
        if DIR_LOOP:
            o_base = o
        else:
            o_base = o + i_d.to(tl.int64) * B * T * H * V
        h_base = h0 + (i_d.to(tl.int64) * B * H + i_bh) * NT * K * V
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
        for i_c in range(0, NT):
            b_q, b_k, b_p, b_v, b_g, b_beta, row, m_t, m_tk, m_tv = _load_chunk(
                q, k, p, v, g, beta, i_b, i_h, i_d, i_c, o_k, o_v, T, H, K, V, BT)
            if SAVE_H:
                tl.store(h_base + i_c * K * V + o_k[:, None] * V + o_v[None, :], b_h, mask=m_kv)
            b_Gi, b_Ge, b_pk, b_E, b_A, b_inv, b_W, b_U0 = _chunk_wy(b_k, b_p, b_v, b_g, b_beta, BT, LOG2_BT,
                                                                     PREC)
            b_u = b_U0 - tl.dot(b_W, b_h, input_precision=PREC)
            b_q = b_q * scale
            b_D = tl.where(lower, tl.exp(tl.where(lower, b_Gi[:, None] - b_Gi[None, :], 0.0)), 0.0)
            b_qk = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * b_D
            b_o = tl.dot(b_q * tl.exp(b_Gi)[:, None], b_h, input_precision=PREC)
            b_o += tl.dot(b_qk, b_u, input_precision=PREC)
            p_o = o_base + row[:, None] * V + o_v[None, :]
            _accumulate(p_o, b_o, m_tv, i_dd > 0)
            b_Gl = tl.sum(tl.where(o_t == BT - 1, b_Gi, 0.0), 0)
            b_kd = b_k * tl.exp(b_Gl - b_Gi)[:, None]
            b_h = b_h * tl.exp(b_Gl) + tl.dot(tl.trans(b_kd), b_u, input_precision=PREC)
        # the next direction reads back what other threads of this program stored
        tl.debug_barrier()


@triton.jit
def comba_bwd_kernel(q, k, v, p, g, beta, h0, do, dq, dk, dv, dp, dg, dbeta, scale, T, NT, B,
                     H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, DIR_LOOP: tl.constexpr,
                     N_DIR: tl.constexpr, PREC: tl.constexpr):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    lower = o_t[:, None] >= o_t[None, :]
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    BTH = B * T * H
    for i_dd in range(0, N_DIR):
        i_d = i_dd + tl.program_id(2)
        if DIR_LOOP:
            i_slot = i_dd * 0
        else:
            i_slot = i_d
        acc = i_dd > 0
        i_part = (i_slot * NV + i_v).to(tl.int64)
        h_base = h0 + (i_d.to(tl.int64) * B * H + i_bh) * NT * K * V
        dk_base = dk + i_part * BTH * K
        dq_base = dq + i_part * BTH * K
        dp_base = dp + i_part * BTH * K
        dv_base = dv + i_slot.to(tl.int64) * BTH * V
        dg_base = dg + i_part * BTH
        db_base = dbeta + i_part * BTH
        b_dh = tl.zeros([BK, BV], dtype=tl.float32)
        for i_r in range(0, NT):
            i_c = NT - 1 - i_r
            b_q, b_k, b_p, b_v, b_g, b_beta, row, m_t, m_tk, m_tv = _load_chunk(
                q, k, p, v, g, beta, i_b, i_h, i_d, i_c, o_k, o_v, T, H, K, V, BT)
            b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0).to(tl.float32)
            b_h = tl.load(h_base + i_c * K * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0)
            b_Gi, b_Ge, b_pk, b_E, b_A, b_inv, b_W, b_U0 = _chunk_wy(b_k, b_p, b_v, b_g, b_beta, BT, LOG2_BT,
                                                                     PREC)
            b_u = b_U0 - tl.dot(b_W, b_h, input_precision=PREC)
            b_qs = b_q * scale
            b_eG = tl.exp(b_Gi)
            b_Gl = tl.sum(tl.where(o_t == BT - 1, b_Gi, 0.0), 0)
            b_eGl = tl.exp(b_Gl)
            b_D = tl.where(lower, tl.exp(tl.where(lower, b_Gi[:, None] - b_Gi[None, :], 0.0)), 0.0)
            b_Mq = tl.dot(b_qs, tl.trans(b_k), input_precision=PREC) * b_D
            b_kd = b_k * tl.exp(b_Gl - b_Gi)[:, None]

            # o = e^{G} ⊙ (q_s h0) + Mq u;  h_end = e^{G_last} h0 + kdᵀ u
            b_du = tl.dot(tl.trans(b_Mq), b_do, input_precision=PREC) + tl.dot(b_kd, b_dh, input_precision=PREC)
            b_dMq = tl.dot(b_do, tl.trans(b_u), input_precision=PREC)
            b_dMqD = b_dMq * b_D
            b_doh = tl.dot(b_do, tl.trans(b_h), input_precision=PREC)
            b_dq = scale * (b_eG[:, None] * b_doh + tl.dot(b_dMqD, b_k, input_precision=PREC))
            b_udh = tl.dot(b_u, tl.trans(b_dh), input_precision=PREC)
            b_dk = tl.dot(tl.trans(b_dMqD), b_qs, input_precision=PREC) + tl.exp(b_Gl - b_Gi)[:, None] * b_udh
            b_term = b_dMq * b_Mq
            b_c = tl.sum(b_kd * b_udh, 1)
            b_dGi = (tl.sum(b_qs * b_doh, 1) * b_eG + tl.sum(b_term, 1) - tl.sum(b_term, 0) - b_c)
            b_dGl = b_eGl * tl.sum(tl.sum(b_dh * b_h, 1), 0) + tl.sum(b_c, 0)
            b_dGi += tl.where(o_t == BT - 1, b_dGl, 0.0)
            b_dh_prev = (tl.dot(tl.trans(b_qs * b_eG[:, None]), b_do, input_precision=PREC) + b_eGl * b_dh
                         - tl.dot(tl.trans(b_W), b_du, input_precision=PREC))

            # u = U0 − W h0,  W = inv (β e^{Ge} p),  U0 = inv (β v),  A = strict(β_t e^{Ge_t − Gi_s} p_t·k_s)
            b_dW = -tl.dot(b_du, tl.trans(b_h), input_precision=PREC)
            b_dRp = tl.dot(tl.trans(b_inv), b_dW, input_precision=PREC)
            b_dRv = tl.dot(tl.trans(b_inv), b_du, input_precision=PREC)
            b_dA = -(tl.dot(b_dRp, tl.trans(b_W), input_precision=PREC)
                     + tl.dot(b_dRv, tl.trans(b_U0), input_precision=PREC))
            b_wscale = b_beta * tl.exp(b_Ge)
            b_rp = tl.sum(b_dRp * b_p, 1)
            b_dp = b_dRp * b_wscale[:, None]
            b_dv = b_dRv * b_beta[:, None]
            b_dS = b_dA * b_E
            b_dbeta = b_rp * tl.exp(b_Ge) + tl.sum(b_dRv * b_v, 1) + tl.sum(b_dS * b_pk, 1)
            b_dS = b_dS * b_beta[:, None]
            b_dp += tl.dot(b_dS, b_k, input_precision=PREC)
            b_dk += tl.dot(tl.trans(b_dS), b_p, input_precision=PREC)
            b_Aterm = b_dA * b_A
            b_dGe = b_wscale * b_rp + tl.sum(b_Aterm, 1)
            b_dGi -= tl.sum(b_Aterm, 0)
            # Gi = inclusive cumsum(g), Ge = exclusive cumsum(g), both chunk-local
            b_dg = (tl.sum(b_dGi, 0) - tl.cumsum(b_dGi, 0) + b_dGi) + (tl.sum(b_dGe, 0) - tl.cumsum(b_dGe, 0))

            _accumulate(dq_base + row[:, None] * K + o_k[None, :], b_dq, m_tk, acc)
            _accumulate(dk_base + row[:, None] * K + o_k[None, :], b_dk, m_tk, acc)
            _accumulate(dp_base + row[:, None] * K + o_k[None, :], b_dp, m_tk, acc)
            _accumulate(dv_base + row[:, None] * V + o_v[None, :], b_dv, m_tv, acc)
            _accumulate(dg_base + row, b_dg, m_t, acc)
            _accumulate(db_base + row, b_dbeta, m_t, acc)
            b_dh = b_dh_prev
        tl.debug_barrier()


def _next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


#: Launch choices forced for tuning sweeps (keys of :func:`_launch_config`'s result); empty in normal use.
CONFIG_OVERRIDES: dict = {}


def _launch_config(K: int, V: int, T: int, BH: int, ND: int, backward: bool) -> dict:
    BK = max(16, _next_pow2(K))
    BV = max(16, _next_pow2(V))
    BT = 16 if max(BK, BV) <= 32 or T <= 16 else 32
    # Few (batch, head) sequences: split the value dimension to put more programs on the GPU.
    while BV > 32 and (BH * ND * triton.cdiv(V, BV) < 264 or BK * BV > 64 * 64):
        BV //= 2
    big = BK * BV >= 64 * 64 or (backward and BK * BV >= 32 * 64)
    cfg = {"BT": BT, "BK": BK, "BV": BV, "num_warps": 8 if big else 4 if BK * BV >= 32 * 32 else 2,
           # Enough programs already: run both directions in one program (no partial buffers to reduce).
           "dir_loop": ND == 2 and BH * triton.cdiv(V, BV) >= 1024}
    cfg.update({key: val for key, val in CONFIG_OVERRIDES.items() if not (backward and key == "BT")})
    cfg["NV"] = triton.cdiv(V, cfg["BV"])
    return cfg


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 products; fp16/bf16 inputs use TF32 tensor cores (well inside their tolerance).
    return "ieee" if dtype == torch.float32 else "tf32"


def _directions(cfg: dict, ND: int) -> tuple[int, int]:
    """(programs along grid axis 2, directions each program runs)."""
    return (1, ND) if cfg["dir_loop"] else (ND, 1)


# Measured choice among a few launch layouts, per problem, for the large small-head workloads where the heuristic
# could be off by a lot (vision shapes). Filled on first use; ``TUNING_LOG`` keeps the timings for the benchmark.
_TUNED: dict = {}
TUNING_LOG: dict = {}


def _candidates(cfg: dict, K: int, V: int, BH: int, device: torch.device, backward: bool) -> list[dict]:
    if device.type != "cuda" or max(K, V) > 32 or BH < 512 or CONFIG_OVERRIDES:
        return [cfg]
    if backward:
        return [{**cfg, "num_warps": w} for w in (2, 4)]
    return [{**cfg, "BT": bt, "num_warps": w} for bt, w in ((16, 1), (16, 2), (16, 4), (32, 4))]


def _pick(key: tuple, candidates: list[dict], launch) -> dict:
    if len(candidates) == 1:
        return candidates[0]
    if key not in _TUNED:
        timings = []
        for cfg in candidates:
            launch(cfg)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(3):
                launch(cfg)
            end.record()
            torch.cuda.synchronize()
            timings.append(start.elapsed_time(end) / 3)
        _TUNED[key] = candidates[min(range(len(candidates)), key=timings.__getitem__)]
        TUNING_LOG[key] = [({k: c[k] for k in ("BT", "num_warps", "dir_loop")}, ms)
                           for c, ms in zip(candidates, timings)]
    return _TUNED[key]


def comba_fwd(q, k, v, p, g, beta, scale: float, causal: bool, save_state: bool):
    B, T, H, K = q.shape
    V = v.shape[-1]
    ND = 1 if causal else 2

    def launch(cfg):
        BT, BV = cfg["BT"], cfg["BV"]
        NT = triton.cdiv(T, BT)
        grid_dirs, loop_dirs = _directions(cfg, ND)
        o = empty_output((grid_dirs, B, T, H, V), device=q.device,
                         dtype=v.dtype if grid_dirs == 1 else torch.float32)
        h0 = (empty_output((ND, B * H, NT, K, V), device=q.device, dtype=torch.float32) if save_state
              else q.new_empty(1, dtype=torch.float32))
        grid = (cfg["NV"], B * H, grid_dirs)
        comba_fwd_kernel[grid](q, k, v, p, g, beta, o, h0, scale, T, NT, B, H, K=K, V=V, BT=BT,
                               LOG2_BT=BT.bit_length() - 1, BK=cfg["BK"], BV=BV, SAVE_H=save_state,
                               DIR_LOOP=cfg["dir_loop"], N_DIR=loop_dirs, PREC=_dot_precision(q.dtype),
                               num_warps=cfg["num_warps"])
        out = o[0] if grid_dirs == 1 else o.sum(0).to(v.dtype)
        return out, (h0 if save_state else None)

    base = _launch_config(K, V, T, B * H, ND, backward=False)
    key = ("fwd", K, V, T, B * H, ND, q.dtype, save_state)
    cfg = _pick(key, _candidates(base, K, V, B * H, q.device, backward=False), launch)
    out, h0 = launch(cfg)
    return out, h0, cfg["BT"]


def comba_bwd(q, k, v, p, g, beta, h0, do, scale: float, causal: bool, BT: int):
    B, T, H, K = q.shape
    V = v.shape[-1]
    ND = 1 if causal else 2
    NT = triton.cdiv(T, BT)

    def reduce(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (x[0] if x.shape[0] == 1 else x.sum(0)).to(dtype)

    def launch(cfg):
        BV, NV = cfg["BV"], cfg["NV"]
        grid_dirs, loop_dirs = _directions(cfg, ND)
        NP = grid_dirs * NV
        kdtype = q.dtype if NP == 1 else torch.float32
        dq, dk, dp = (empty_output((NP, B, T, H, K), device=q.device, dtype=kdtype) for _ in range(3))
        dv = empty_output((grid_dirs, B, T, H, V), device=q.device,
                          dtype=v.dtype if grid_dirs == 1 else torch.float32)
        dg, dbeta = (empty_output((NP, B, T, H), device=q.device, dtype=torch.float32) for _ in range(2))
        grid = (NV, B * H, grid_dirs)
        comba_bwd_kernel[grid](q, k, v, p, g, beta, h0, do, dq, dk, dv, dp, dg, dbeta, scale, T, NT, B, H, K=K, V=V,
                               BT=BT, LOG2_BT=BT.bit_length() - 1, BK=cfg["BK"], BV=BV, NV=NV,
                               DIR_LOOP=cfg["dir_loop"], N_DIR=loop_dirs, PREC=_dot_precision(q.dtype),
                               num_warps=cfg["num_warps"])
        return (reduce(dq, q.dtype), reduce(dk, k.dtype), reduce(dv, v.dtype), reduce(dp, p.dtype),
                reduce(dg, g.dtype), reduce(dbeta, beta.dtype))

    base = {**_launch_config(K, V, T, B * H, ND, backward=True), "BT": BT}
    key = ("bwd", K, V, T, B * H, ND, q.dtype, BT)
    cfg = _pick(key, _candidates(base, K, V, B * H, q.device, backward=True), launch)
    return launch(cfg)


class CombaFunction(torch.autograd.Function):
    @staticmethod
    @input_guard
    @autocast_custom_fwd
    def forward(ctx, q, k, v, p, g, beta, scale: float, causal: bool):
        save = any(ctx.needs_input_grad[:6])
        o, h0, BT = comba_fwd(q, k, v, p, g, beta, scale, causal, save_state=save)
        if save:
            ctx.save_for_backward(q, k, v, p, g, beta, h0)
        ctx.scale, ctx.causal, ctx.BT = scale, causal, BT
        return o

    @staticmethod
    @input_guard
    @autocast_custom_bwd
    def backward(ctx, do):
        q, k, v, p, g, beta, h0 = ctx.saved_tensors
        grads = comba_bwd(q, k, v, p, g, beta, h0, do, ctx.scale, ctx.causal, ctx.BT)
        return (*grads, None, None)


def fused_comba(q, k, v, p, g, beta, *, scale: float, causal: bool) -> torch.Tensor:
    """Triton Comba (validated arguments expected; see :func:`visionssm.kernels.comba`)."""
    return CombaFunction.apply(q, k, v, p, g, beta, scale, causal)
