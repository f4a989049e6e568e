"""PyTorch reference of the mixer prologue: the plain composition of the layers' own ops, float64-capable.

Given a mixer layer's input-projection output ``proj`` (B, L, N), whose first ``2·H·K + H·V`` columns are the q, k
and v projections::

    q, k, v = SiLU(conv(proj[..., :2HK+HV]))     depthwise short conv over tokens (causal: left padding only;
                                                   else centred, MambaVision's 'same' padding), no bias
    q̂, k̂ = q/√(‖q‖² + eps), k/√(‖k‖² + eps)     per head, in float32 (float64 for float64 inputs)
    β = sigmoid(proj[..., beta_col + h] + beta_bias_h)          per head (bias optional)
    α = sigmoid(proj[..., alpha_col + h] + alpha_bias_h)        per head, optional (GKA)
    g = −exp(A_log_h) · softplus(proj[..., decay_col + h] + dt_bias_h)     per head, optional (log forget gate)

and, with a feedback factor b = sigmoid(feedback_h) and a correction d = correction_h (Comba)::

    q' = q̂ − d·b·k̂                      the output correction
    p  = b·k̂                  (transition "splr": state transition α_t − β_t b k̂ k̂ᵀ)
    p  = 2·b·e^{g_t}·k̂        (transition "iplr": α_t (I − 2 β̃_t k̂ k̂ᵀ) with β̃ = b·β)

Comba's kernel updates ``h_t = (e^{g_t} I − β_t k_t p_tᵀ) h_{t−1} + β_t k_t v_tᵀ``; with p = 2 b e^{g} k̂ the
transition is ``e^{g_t} (I − 2 b β_t k̂ k̂ᵀ)``, the paper's Comba-iplr (eigenvalues α(1 − 2bβ) ∈ (−1, 1)).

This is, op for op, what the layers computed before the fused kernels (``ShortConv1d``, ``l2_normalize``, the gate
expressions), so the CPU path of a layer gives the same numbers as before, bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["mixer_prologue_reference"]


def _short_conv_silu(x: torch.Tensor, weight: torch.Tensor, causal: bool) -> torch.Tensor:
    kernel_size = weight.shape[-1]
    padding = (kernel_size - 1, 0) if causal else ((kernel_size - 1) // 2, kernel_size // 2)
    # the weight in x's dtype, as autocast would give it: inside a registered op autocast is off
    y = F.conv1d(F.pad(x.transpose(1, 2), padding), weight.reshape(weight.shape[0], 1, kernel_size).to(x.dtype),
                 groups=weight.shape[0])
    return F.silu(y).transpose(1, 2)


def _l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float() if x.dtype != torch.float64 else x
    return (x32 * torch.rsqrt(x32.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def _decay(logits: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    wide = torch.float64 if torch.float64 in (logits.dtype, A_log.dtype, dt_bias.dtype) else torch.float32
    return -A_log.to(wide).exp() * F.softplus(logits.to(wide) + dt_bias.to(wide))


def _sigmoid_gate(logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.sigmoid(logits if bias is None else logits + bias)


def mixer_prologue_reference(proj, conv_weight, *, num_heads: int, key_dim: int, value_dim: int, causal: bool,
                             beta_col: int, beta_bias=None, alpha_col: int | None = None, alpha_bias=None,
                             decay_col: int | None = None, A_log=None, dt_bias=None, feedback=None, correction=None,
                             transition: str = "splr", gate_cols: tuple[int, int] | None = None,
                             eps: float = 1e-6) -> tuple:
    """(q, k, v, p, g, beta, alpha, gate) as in the module docstring; entries a call does not ask for are None.
    ``gate`` is ``proj[..., gate_cols[0]:gate_cols[0] + gate_cols[1]]`` (a view)."""
    B, L, _ = proj.shape
    H, K, V = num_heads, key_dim, value_dim
    qkv = _short_conv_silu(proj[..., :2 * H * K + H * V], conv_weight, causal)
    q, k, v = qkv.split([H * K, H * K, H * V], dim=-1)
    q = _l2_normalize(q.reshape(B, L, H, K), eps)
    k = _l2_normalize(k.reshape(B, L, H, K), eps)
    v = v.reshape(B, L, H, V)
    g = None if decay_col is None else _decay(proj[..., decay_col:decay_col + H], A_log, dt_bias)
    beta = _sigmoid_gate(proj[..., beta_col:beta_col + H], beta_bias)
    alpha = None if alpha_col is None else _sigmoid_gate(proj[..., alpha_col:alpha_col + H], alpha_bias)
    p = None
    if feedback is not None:
        kb = k * torch.sigmoid(feedback).to(k.dtype)[:, None]
        q = q - correction.to(q.dtype)[:, None] * kb
        p = kb if transition == "splr" else kb * (2.0 * g.exp()).to(k.dtype)[..., None]
    gate = None if gate_cols is None else proj[..., gate_cols[0]:gate_cols[0] + gate_cols[1]]
    return q, k, v, p, g, beta, alpha, gate
