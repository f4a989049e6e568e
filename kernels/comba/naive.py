"""PyTorch references for the Comba mixer (the Comba paper, §3).

State ``h ∈ R^{K×V}`` per (batch, head), read *before* the decay (the order FLA's Triton kernels use; FLA's own
``naive_recurrent_comba`` decays first and is a different recurrence):

    u_t = β_t (v_t − h_{t−1}ᵀ p_t)
    h_t = e^{g_t} h_{t−1} + k_t u_tᵀ
    o_t = scale · h_tᵀ q_t

Non-causal: ``o = causal(x) + reverse_T(causal(reverse_T(x)))`` with every time-indexed input reversed.

Two implementations, both differentiable with autograd:

* :func:`comba_recurrent` — the per-token loop. It *is* the spec: readable, float64-capable, slow.
* :func:`comba_chunked` — the same recurrence in chunks of ``chunk_size`` tokens (WY/UT form, one unit-lower
  triangular solve per chunk, batched over batch × head × chunk). This is the CPU path of
  :func:`visionssm.kernels.comba`.

Chunk algebra (within one chunk, ``G`` = inclusive cumulative sum of ``g`` inside the chunk, ``E = G − g``,
``h0`` = the state entering the chunk):

    A_ts = β_t e^{E_t − G_s} (p_t · k_s) for s < t (0 elsewhere),   T = (I + A)^{-1}
    W = T (β e^{E} ⊙ P),   U0 = T (β ⊙ V),   U = U0 − W h0           (U stacks the u_t)
    O = scale · [e^{G} ⊙ (Q h0) + (Q Kᵀ ⊙ D) U],   D_ts = e^{G_t − G_s} for s ≤ t
    h_end = e^{G_C} h0 + (e^{G_C − G} ⊙ K)ᵀ U
"""

from __future__ import annotations

import torch

__all__ = ["comba_chunked", "comba_recurrent"]


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _reverse_time(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.flip(1) for t in tensors]


def comba_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, *, scale: float | None = None, causal: bool = True) -> torch.Tensor:
    """Token-by-token Comba. Shapes: q, k, p (B, T, H, K); v (B, T, H, V); g, beta (B, T, H).

    Computes in float64 when any input is float64, else float32; returns v's dtype."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if not causal:
        forward = comba_recurrent(q, k, v, p, g, beta, scale=scale, causal=True)
        backward = comba_recurrent(*_reverse_time(q, k, v, p, g, beta), scale=scale, causal=True)
        return forward + backward.flip(1)
    dtype = _compute_dtype(q, k, v, p, g, beta)
    q, k, v, p, g, beta = (t.to(dtype) for t in (q, k, v, p, g, beta))
    B, T, H, K = q.shape
    V = v.shape[-1]
    h = q.new_zeros(B, H, K, V)
    outputs = []
    for t in range(T):
        read = torch.einsum("bhkv,bhk->bhv", h, p[:, t])
        u = beta[:, t, :, None] * (v[:, t] - read)
        h = g[:, t].exp()[..., None, None] * h + k[:, t, :, :, None] * u[:, :, None, :]
        outputs.append(scale * torch.einsum("bhkv,bhk->bhv", h, q[:, t]))
    return torch.stack(outputs, dim=1).to(v.dtype)


def _chunked_causal(q, k, v, p, g, beta, scale: float, chunk_size: int) -> torch.Tensor:
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T

    def chunks(x: torch.Tensor) -> torch.Tensor:
        # (B, T, H, ...) -> (B, H, N, C, ...); padded tokens have k = p = v = beta = 0 and g = 0, so they neither
        # change the state nor decay it, and they only follow the real tokens.
        x = x.transpose(1, 2)
        if pad:
            x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
        return x.reshape(B, H, N, C, *x.shape[3:])

    q, k, v, p, g, beta = (chunks(t) for t in (q, k, v, p, g, beta))
    G = g.cumsum(-1)
    E = G - g
    idx = torch.arange(C, device=q.device)
    strictly_lower = idx[:, None] > idx[None, :]
    lower = idx[:, None] >= idx[None, :]
    neg_inf = torch.tensor(float("-inf"), dtype=q.dtype, device=q.device)
    # Differences are masked before exp so the upper triangle never overflows (and never carries a gradient).
    decay_a = torch.where(strictly_lower, E[..., :, None] - G[..., None, :], neg_inf).exp()
    decay_o = torch.where(lower, G[..., :, None] - G[..., None, :], neg_inf).exp()

    A = beta[..., None] * (p @ k.transpose(-1, -2)) * decay_a
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    rhs = torch.cat([(beta * E.exp())[..., None] * p, beta[..., None] * v], dim=-1)
    solved = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    W, U0 = solved[..., :K], solved[..., K:]
    QK = (q @ k.transpose(-1, -2)) * decay_o
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]
    chunk_decay = G[..., -1].exp()

    h = q.new_zeros(B, H, K, V)
    outputs = []
    for n in range(N):
        U = U0[:, :, n] - W[:, :, n] @ h
        outputs.append(q_decayed[:, :, n] @ h + QK[:, :, n] @ U)
        h = chunk_decay[:, :, n, None, None] * h + k_to_end[:, :, n].transpose(-1, -2) @ U
    o = scale * torch.stack(outputs, dim=2).reshape(B, H, N * C, V)[:, :, :T]
    return o.transpose(1, 2)


def comba_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, *, scale: float | None = None, causal: bool = True,
                  chunk_size: int = 64) -> torch.Tensor:
    """Chunked (WY/UT) Comba in PyTorch: same result as :func:`comba_recurrent`, vectorised over batch, heads and
    chunk-local work. Computes in float64 when any input is float64, else float32; returns v's dtype."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out_dtype = v.dtype
    dtype = _compute_dtype(q, k, v, p, g, beta)
    q, k, v, p, g, beta = (t.to(dtype) for t in (q, k, v, p, g, beta))
    C = max(1, min(chunk_size, q.shape[1]))
    if causal:
        return _chunked_causal(q, k, v, p, g, beta, scale, C).to(out_dtype)
    # Both directions in one batched call: the reversed sequences ride along the batch axis.
    B = q.shape[0]
    both = [torch.cat([t, t.flip(1)], dim=0) for t in (q, k, v, p, g, beta)]
    o = _chunked_causal(*both, scale, C)
    return (o[:B] + o[B:].flip(1)).to(out_dtype)
