"""Inputs and gradient plumbing shared by the GKA kernel tests (test_gka*.py); not a test module."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def make_inputs(B, T, H, K, V, *, dtype=torch.float32, device="cpu", use_beta=True, use_alpha=True, gate_scale=1.0,
                seed=0, causal=True):
    """q, k (unit rows), v, g = logsigmoid(N(3, 1))·gate_scale (causal only), β ∈ (0.05, 0.95), α ∈ (0, 1): fresh
    random values, never zeros. Returns [q, k, v, g, β, α] (causal) or [q, k, v, β, α] (non-causal)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen, dtype=torch.float64) + 3.0) * gate_scale
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.9 + 0.05 if use_beta else None
    alpha = torch.rand(B, T, H, generator=gen, dtype=torch.float64) if use_alpha else None
    tensors = (q, k, v, g, beta, alpha) if causal else (q, k, v, beta, alpha)
    return [None if t is None else t.to(device=device, dtype=dtype) for t in tensors]


def run_with_grads(fn, tensors, do):
    """fn(*leaves) and the leaves' gradients for the output gradient ``do``."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    out.backward(do.to(device=out.device, dtype=out.dtype))
    return out.detach(), [None if t is None else t.grad for t in leaves]


def adversarial_keys(T, K, seed=0):
    """Per head: 0 one repeated key (rank-1 H), 1 keys scaled by 1e3, 2 zero keys for the first half."""
    gen = torch.Generator().manual_seed(seed)
    k = F.normalize(torch.randn(1, T, 3, K, generator=gen, dtype=torch.float64), dim=-1)
    k[:, :, 0] = k[:, :1, 0]
    k[:, :, 1] *= 1e3
    k[:, : T // 2, 2] = 0.0
    return k
