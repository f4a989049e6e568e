"""PyTorch implementations of the Mamba-1 selective scan (the semantics of mamba_ssm's ``selective_scan_ref``).

Per channel ``d`` and state ``n``, with ``δ = softplus(δ + delta_bias)`` when asked::

    x_t[d, n] = exp(δ_t[d] A[d, n]) x_{t-1}[d, n] + δ_t[d] B_t[g(d), n] u_t[d]
    y_t[d]    = Σ_n C_t[g(d), n] x_t[d, n]
    out       = (y + D u) · silu(z)

where ``g(d) = d // (dim / G)`` picks the channel's group of B/C. Non-causal: ``y`` is the sum of the scan above and
the same scan run over reversed time; ``D·u`` and the ``z`` gate are applied once.

Two implementations with identical semantics:

* :func:`selective_scan_ref` -- the per-token loop, the specification the tests compare everything against
  (float64 when any input is float64, else float32, like mamba's reference).
* :func:`selective_scan_torch` -- the CPU path: the same recurrence evaluated with a log-depth (Hillis-Steele)
  scan over time, so the Python loop has ``ceil(log2 L)`` steps of whole-tensor ops instead of ``L``.
  Differentiable by autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["selective_scan_ref", "selective_scan_torch"]


def _prepare(u, delta, A, B, C, D, z, delta_bias, delta_softplus):
    """Promote to the compute dtype, discretise δ and expand grouped B/C to one row per channel."""
    tensors = [t for t in (u, delta, A, B, C, D, z, delta_bias) if t is not None]
    compute = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    dim = u.shape[1]
    u_c = u.to(compute)
    dt = delta.to(compute)
    if delta_bias is not None:
        dt = dt + delta_bias.to(compute)[:, None]
    if delta_softplus:
        dt = F.softplus(dt)

    def per_channel(M):  # (batch, N, L) or (batch, G, N, L) -> (batch, dim, N, L)
        M = M.to(compute)
        if M.dim() == 3:
            return M[:, None]
        return M.repeat_interleave(dim // M.shape[1], dim=1)

    return compute, u_c, dt, A.to(compute), per_channel(B), per_channel(C)


def _finish(y, u_c, D, z, compute, out_dtype):
    out = y if D is None else y + u_c * D.to(compute)[:, None]
    if z is not None:
        out = out * F.silu(z.to(compute))
    return out.to(out_dtype)


def selective_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, *, causal=True,
                       return_last_state=False):
    """The per-token recurrence (the specification). Shapes as in :func:`visionssm.kernels.selective_scan`.

    Returns ``out`` in ``u.dtype`` and, with ``return_last_state`` (causal only), the state after the last token,
    ``(batch, dim, N)`` in the compute dtype (float32, or float64 for float64 inputs)."""
    compute, u_c, dt, A_c, Bc, Cc = _prepare(u, delta, A, B, C, D, z, delta_bias, delta_softplus)
    batch, dim, length = u.shape
    decay = torch.exp(dt[:, :, None, :] * A_c[None, :, :, None])  # (batch, dim, N, L)
    drive = (dt * u_c)[:, :, None, :] * Bc  # (batch, dim, N, L)

    def run(order):
        x = u_c.new_zeros(batch, dim, A.shape[1])
        ys = [None] * length
        for t in order:
            x = decay[..., t] * x + drive[..., t]
            ys[t] = (x * Cc[..., t]).sum(-1)
        return torch.stack(ys, dim=-1), x

    y, last = run(range(length))
    if not causal:
        y = y + run(range(length - 1, -1, -1))[0]
    out = _finish(y, u_c, D, z, compute, u.dtype)
    return (out, last) if return_last_state else out


def _linear_scan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """All prefixes of x_t = a_t x_{t-1} + b_t (x_{-1} = 0) along the last axis, in ceil(log2 L) steps.

    Step k combines every position with the one 2^k before it; products of decays stay in [0, 1] for the usual
    A < 0, so nothing is divided and nothing overflows."""
    length = a.shape[-1]
    step = 1
    while step < length:
        b = torch.cat([b[..., :step], a[..., step:] * b[..., :-step] + b[..., step:]], dim=-1)
        a = torch.cat([a[..., :step], a[..., step:] * a[..., :-step]], dim=-1)
        step *= 2
    return b


def selective_scan_torch(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, *, causal=True,
                         return_last_state=False):
    """Vectorised CPU path with the semantics of :func:`selective_scan_ref` (differentiable by autograd)."""
    compute, u_c, dt, A_c, Bc, Cc = _prepare(u, delta, A, B, C, D, z, delta_bias, delta_softplus)
    decay = torch.exp(dt[:, :, None, :] * A_c[None, :, :, None])  # (batch, dim, N, L)
    drive = (dt * u_c)[:, :, None, :] * Bc
    states = _linear_scan(decay, drive)
    y = (states * Cc).sum(2)
    if not causal:
        rev = _linear_scan(decay.flip(-1), drive.flip(-1)).flip(-1)
        y = y + (rev * Cc).sum(2)
    out = _finish(y, u_c, D, z, compute, u.dtype)
    return (out, states[..., -1]) if return_last_state else out
