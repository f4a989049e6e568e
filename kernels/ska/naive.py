"""Spectral Koopman Attention (SKA) in plain PyTorch: the specification the Triton kernels are tested against.

Sridhar & Johansen, "Echo: KV-Cache-Free Associative Recall with Spectral Koopman Operators", arXiv 2605.06997
(§3.2, appendices A, D, E, F). Per (batch, head), over a statistics window S of tokens (every token for
``causal=False``; tokens 0..t for query t when ``causal=True``):

    s   = max(max_{τ∈S} ‖k_τ‖, EPS)                 sequence-max normalisation: k̂ = k / s, q̂ = q / s
    G   = Σ_{τ∈S} k̂_τ k̂_τᵀ + λ I                    regularised Gram matrix (R×R), G = L Lᵀ
    M   = Σ_{τ,τ−1∈S} k̂_τ k̂_{τ−1}ᵀ                  lag-one covariance (rows: the later token)
    C   = Σ_{τ∈S} v_τ k̂_τᵀ                          value–key covariance (V×R)
    K_w = L⁻¹ M L⁻ᵀ                                 whitened Koopman operator
    σ̂   = power iteration on K_w (``num_iters`` steps, no gradient; see below), clamped at EPS
    K̄   = K_w / σ̂   (``normalize=False``: K̄ = K_w)  spectral normalisation, the paper's eq. (12) without γ
    o_t = C L⁻ᵀ K̄^p L⁻¹ q̂_t                          the power filter of order p = ``power``, then the readout

The learnable scales of the paper (α on the output, γ on K̄) enter only as the product α·γ^p, which the layer
applies; the op has none. Whitening cancels in the output: ``L⁻ᵀ K̄^p L⁻¹ = G⁻¹ (M G⁻¹ / σ̂)^p``, so the vectorised
path and the kernels use that "G form", and only σ̂ needs the whitened operator.

**Power iteration.** The paper fixes the count (6) but its start vector was lost. Here the iteration starts from the
all-ones vector in *key* coordinates, i.e. from ``w₀ = Lᵀ1 / ‖Lᵀ1‖`` in whitened ones: then the whole iteration can be
run with G⁻¹ and no Cholesky factor (``x ← G⁻¹MᵀG⁻¹M x``, ``σ̂² = (Mx)ᵀG⁻¹(Mx) / xᵀGx``), which is what the kernels do.
Each step is ``u = K_w w / ‖K_w w‖``, ``w = K_wᵀ u / ‖K_wᵀ u‖``; then ``σ̂ = ‖K_w w‖``.

**Sequence-max normalisation** is a data-dependent ridge: ``SKA(q/s, k/s, v; λ) = SKA(q, k, v; λ s²)``. With
``causal=True`` the max runs over the prefix (a running max), so token t uses nothing after t. The gradient of s
goes to the key that holds the max (the last such key when several tie).

Conventions: T = 1 non-causally, and the first token causally, have M = 0, hence o = 0 for ``power ≥ 1``; all-zero
keys give s = EPS, G = λI, C = 0 and o = 0. Both are finite, with finite gradients.

Two implementations:

* :func:`ska_recurrent` — a token loop over the whitened pipeline (Cholesky factor, K_w, the power iteration in
  whitened coordinates), any dtype; float64 makes it the reference. It is slow.
* :func:`ska_parallel` — the same function in G form, vectorised over batch, heads and tokens (one operator per
  (batch, head) non-causally; every prefix's statistics materialised causally). The CPU path of
  :func:`visionssm.kernels.ska`; gradients come from autograd (σ̂ detached).
"""

from __future__ import annotations

import torch

__all__ = ["EPS", "MAX_POWER", "ska_parallel", "ska_recurrent", "sequence_max", "spectral_norm_estimate"]

#: Floor of the sequence max ‖k‖ and of σ̂ (the public code's 1e-6; the paper's value was lost).
EPS = 1e-6
#: Largest filter order the op accepts (the paper uses 2; its public code 4).
MAX_POWER = 8
# Floor of the norms the power iteration divides by: an all-zero iterate (M = 0) stays zero, σ̂ = 0 → EPS.
_TINY = 1e-30


def sequence_max(k: torch.Tensor, causal: bool, eps: float = EPS) -> torch.Tensor:
    """s of shape (B, T, H): the running (``causal``) or whole-sequence max of ‖k_τ‖ over τ, clamped at ``eps``.
    Differentiable; the gradient reaches the key holding the max (the last one on ties)."""
    norms = torch.linalg.vector_norm(k, dim=-1)                          # (B, T, H)
    with torch.no_grad():
        if causal:
            index = torch.cummax(norms, dim=1).indices                   # ties: the later token
        else:
            T = norms.shape[1]
            last = T - 1 - norms.flip(1).argmax(dim=1, keepdim=True)     # ties: the later token
            index = last.expand_as(norms)
    return norms.gather(1, index).clamp(min=eps)


def spectral_norm_estimate(G: torch.Tensor, M: torch.Tensor, num_iters: int, eps: float = EPS) -> torch.Tensor:
    """σ̂ of ``K_w = L⁻¹ M L⁻ᵀ`` (G = L Lᵀ) by ``num_iters`` power-iteration steps from ``w₀ ∝ Lᵀ1``, run in key
    coordinates (``x = L⁻ᵀ w``), without gradient. G, M: (..., R, R); returns (...) clamped at ``eps``."""
    with torch.no_grad():
        L = _cholesky(G)
        x = G.new_ones(G.shape[:-1])
        for _ in range(num_iters):
            y = torch.cholesky_solve((M @ x.unsqueeze(-1)), L)
            x = torch.cholesky_solve(M.transpose(-1, -2) @ y, L).squeeze(-1)
            x = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp(min=_TINY)
        mx = (M @ x.unsqueeze(-1))
        num = (mx * torch.cholesky_solve(mx, L)).sum((-1, -2))
        den = (x * (G @ x.unsqueeze(-1)).squeeze(-1)).sum(-1)
        return (num.clamp(min=0) / den.clamp(min=_TINY)).sqrt().clamp(min=eps)


def _whitened_sigma(Kw: torch.Tensor, w0: torch.Tensor, num_iters: int, eps: float) -> torch.Tensor:
    """The paper's form of the same iteration: alternate K_w and K_wᵀ on unit vectors, σ̂ = ‖K_w w‖."""
    w = w0 / torch.linalg.vector_norm(w0, dim=-1, keepdim=True).clamp(min=_TINY)
    for _ in range(num_iters):
        u = (Kw @ w.unsqueeze(-1)).squeeze(-1)
        u = u / torch.linalg.vector_norm(u, dim=-1, keepdim=True).clamp(min=_TINY)
        w = (Kw.transpose(-1, -2) @ u.unsqueeze(-1)).squeeze(-1)
        w = w / torch.linalg.vector_norm(w, dim=-1, keepdim=True).clamp(min=_TINY)
    return torch.linalg.vector_norm((Kw @ w.unsqueeze(-1)).squeeze(-1), dim=-1).clamp(min=eps)


def _whitened_operator(G, M, num_iters: int, normalize: bool, eps: float):
    """(L, K̄) of one window: the Cholesky factor of G and ``K̄ = K_w / σ̂`` with ``K_w = L⁻¹ M L⁻ᵀ``."""
    L = torch.linalg.cholesky(0.5 * (G + G.transpose(-1, -2)))
    Kw = torch.linalg.solve_triangular(L, torch.linalg.solve_triangular(L, M, upper=False).transpose(-1, -2),
                                       upper=False).transpose(-1, -2)
    if not normalize:
        return L, Kw
    with torch.no_grad():
        w0 = (L.transpose(-1, -2) @ torch.ones_like(G[..., :1])).squeeze(-1)
        sigma = _whitened_sigma(Kw.detach(), w0, num_iters, eps)
    return L, Kw / sigma[..., None, None]


def ska_recurrent(q, k, v, *, causal: bool = True, ridge: float = 1e-3, power: int = 2, num_iters: int = 6,
                  normalize: bool = True, eps: float = EPS) -> torch.Tensor:
    """The spec: for every query token, the statistics of its window and the whitened pipeline of the paper
    (App. F), token by token. Shapes as :func:`visionssm.kernels.ska`; computes in ``q.dtype`` (float64 for the
    reference). The raw sums Σ k kᵀ, Σ k_τ k_{τ−1}ᵀ, Σ v kᵀ are accumulated token by token and normalised by the
    window's s (``k̂ = k/s``)."""
    B, T, H, R = q.shape
    eye = torch.eye(R, dtype=q.dtype, device=q.device)
    s_all = sequence_max(k, causal, eps)                                 # (B, T, H)
    k_prev = torch.cat([torch.zeros_like(k[:, :1]), k[:, :-1]], dim=1)
    outer = lambda a, b: a.unsqueeze(-1) * b.unsqueeze(-2)
    G_raw = torch.zeros(B, H, R, R, dtype=q.dtype, device=q.device)
    M_raw = torch.zeros_like(G_raw)
    C_raw = torch.zeros(B, H, v.shape[-1], R, dtype=q.dtype, device=q.device)
    if not causal:                                                        # one window: every token
        G_raw, M_raw, C_raw = (outer(a, b).sum(1) for a, b in ((k, k), (k, k_prev), (v, k)))
    outputs = []
    for t in range(T):
        if causal or t == 0:
            if causal:                                                    # window 0..t: add token t
                G_raw = G_raw + outer(k[:, t], k[:, t])
                M_raw = M_raw + outer(k[:, t], k_prev[:, t])
                C_raw = C_raw + outer(v[:, t], k[:, t])
            s = s_all[:, t][..., None, None]                              # (B, H, 1, 1)
            C = C_raw / s                                                 # Σ v k̂ᵀ
            L, Kbar = _whitened_operator(G_raw / s ** 2 + ridge * eye, M_raw / s ** 2, num_iters, normalize, eps)
        z = torch.linalg.solve_triangular(L, (q[:, t] / s_all[:, t][..., None]).unsqueeze(-1), upper=False)
        for _ in range(power):
            z = Kbar @ z
        outputs.append((C @ torch.linalg.solve_triangular(L.transpose(-1, -2), z, upper=True)).squeeze(-1))
    return torch.stack(outputs, dim=1).to(v.dtype)


def _filter(L, M, sigma, x, power: int):
    """``G⁻¹ (M G⁻¹ / σ)^p`` applied to the columns of x (..., R, n), G = L Lᵀ: the G form of the filter."""
    x = torch.cholesky_solve(x, L)
    for _ in range(power):
        x = torch.cholesky_solve(M @ x, L) / sigma[..., None, None]
    return x


def _cholesky(G: torch.Tensor) -> torch.Tensor:
    """Cholesky factor of the symmetrised G; where fp32 rounding makes a factorisation fail, retried with 1e-4·I
    added (the paper's jittered fallback; float64 never needs it: λ_min(G) ≥ λ)."""
    G = 0.5 * (G + G.transpose(-1, -2))
    L, info = torch.linalg.cholesky_ex(G)
    if bool((info > 0).any()):
        L = torch.linalg.cholesky(G + 1e-4 * torch.eye(G.shape[-1], dtype=G.dtype, device=G.device))
    return L


def ska_parallel(q, k, v, *, causal: bool = True, ridge: float = 1e-3, power: int = 2, num_iters: int = 6,
                 normalize: bool = True, eps: float = EPS) -> torch.Tensor:
    """Vectorised SKA in G form: float32 inside (float64 for float64 inputs; autocast off), output in ``v.dtype``.

    Non-causal: one G, M, C and σ̂ per (batch, head), ``o = q̂ Ψ`` with ``Ψ = (G⁻¹Mᵀ/σ̂)^p G⁻¹Cᵀ``. Causal: the
    prefix statistics of every token materialised by cumulative sums, one factorisation per token, and the
    readout ``C_t x_t`` written as masked products over the prefix (as linear attention is)."""
    with torch.autocast(q.device.type, enabled=False):
        return _ska_parallel(q, k, v, causal, ridge, power, num_iters, normalize, eps)


def _ska_parallel(q, k, v, causal, ridge, power, num_iters, normalize, eps):
    out_dtype = v.dtype
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = (t.to(dtype).transpose(1, 2) for t in (q, k, v))         # (B, H, T, ·)
    B, H, T, R = q.shape
    eye = torch.eye(R, dtype=dtype, device=q.device)
    s = sequence_max(k.transpose(1, 2), causal, eps).transpose(1, 2)    # (B, H, T)
    k_prev = torch.nn.functional.pad(k, (0, 0, 1, 0))[:, :, :T]         # k_{t−1}, zero for t = 0
    if not causal:
        s1 = s[..., :1]                                                 # one s per (b, h)
        kh, qh = k / s1[..., None], q / s1[..., None]
        G = kh.transpose(-1, -2) @ kh + ridge * eye
        M = kh.transpose(-1, -2) @ (k_prev / s1[..., None])
        Ct = kh.transpose(-1, -2) @ v                                    # Cᵀ, (B, H, R, V)
        L = _cholesky(G)
        sigma = spectral_norm_estimate(G.detach(), M.detach(), num_iters, eps) if normalize \
            else G.new_ones(B, H)
        psi = _filter(L, M.transpose(-1, -2), sigma, Ct, power)
        return (qh @ psi).transpose(1, 2).to(out_dtype)
    # causal: raw prefix sums, then each token's normalisation
    inv_s2 = (1.0 / s.square())[..., None, None]                         # (B, H, T, 1, 1)
    G = torch.cumsum(k.unsqueeze(-1) * k.unsqueeze(-2), dim=2) * inv_s2 + ridge * eye
    M = torch.cumsum(k.unsqueeze(-1) * k_prev.unsqueeze(-2), dim=2) * inv_s2
    L = _cholesky(G)
    sigma = spectral_norm_estimate(G.detach(), M.detach(), num_iters, eps) if normalize else G.new_ones(B, H, T)
    x = _filter(L, M, sigma, (q / s[..., None]).unsqueeze(-1), power).squeeze(-1)   # G_t⁻¹(M_t G_t⁻¹/σ̂_t)^p q̂_t
    # o_t = C_t x_t with C_t = Σ_{τ≤t} v_τ k_τᵀ / s_t (raw keys, this token's s)
    scores = (x @ k.transpose(-1, -2)).tril()                            # [t, τ] = k_τ·x_t, τ ≤ t
    o = (scores @ v) / s[..., None]
    return o.transpose(1, 2).to(out_dtype)
