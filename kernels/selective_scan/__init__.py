"""Mamba-1 selective scan: a drop-in for mamba_ssm's ``selective_scan_fn``, causal and bidirectional.

The semantics (and the float64 specification) live in :mod:`.naive`. The Triton path, split by stage: the kernels in
:mod:`.kernel_fwd` and :mod:`.kernel_bwd` (shared pieces in :mod:`.kernel_common`), their launch settings and
host-side launch code in :mod:`.launch`, the autograd wrapper in :mod:`.autograd` (eager calls); :mod:`.custom_op`
registers the op that ``torch.compile`` and ``torch.export`` take instead.
"""

from __future__ import annotations

import torch

from .. import library
from ..utils import check_bool, check_dtype, check_layout, check_same_device, check_shape, needs_grad
from .custom_op import selective_scan_op

__all__ = ["MAX_STATE", "selective_scan"]

#: Largest state size N the op supports (MambaVision uses 8, Mamba 16).
MAX_STATE = 16


def _validate(u, delta, A, B, C, D, z, delta_bias, delta_softplus, causal, return_last_state):
    check_dtype("u", u)
    batch, dim, length = check_layout("u", u, "(batch, dim, L)", "batch, dim, L")
    check_dtype("delta", delta)
    check_shape("delta", delta, (batch, dim, length), "(batch, dim, L)")
    if not isinstance(A, torch.Tensor):
        raise TypeError(f"A must be a torch.Tensor, got {type(A).__name__}")
    if A.is_complex():
        raise TypeError("A must be real: complex A (Mamba's complex-valued S4D variant) is out of scope for "
                        "visionssm.kernels.selective_scan")
    check_dtype("A", A)
    if A.dim() != 2 or A.shape[0] != dim:
        raise ValueError(f"A must have shape (dim, N) = ({dim}, N), got {tuple(A.shape)}")
    nstate = A.shape[1]
    if not 1 <= nstate <= MAX_STATE:
        raise ValueError(f"A's state size N = A.shape[1] must be in [1, {MAX_STATE}], got {nstate}")
    for name, M in (("B", B), ("C", C)):
        if isinstance(M, torch.Tensor) and M.is_complex():
            raise TypeError(f"{name} must be real: complex B/C are out of scope for visionssm.kernels.selective_scan")
        check_dtype(name, M)
        if M.dim() == 3:
            check_shape(name, M, (batch, nstate, length), "(batch, N, L)")
        elif M.dim() == 4:
            check_shape(name, M, (batch, None, nstate, length), "(batch, G, N, L)")
            groups = M.shape[1]
            if groups < 1 or dim % groups:
                raise ValueError(f"{name}'s group count G = {groups} must divide dim = {dim}")
        else:
            raise ValueError(f"{name} must have shape (batch, N, L) or (batch, G, N, L) with N = {nstate}, "
                             f"got {tuple(M.shape)} (input-independent B/C are not supported)")
    if B.shape != C.shape:
        raise ValueError(f"B and C must have the same shape, got B {tuple(B.shape)} and C {tuple(C.shape)}")
    for name, vec in (("D", D), ("delta_bias", delta_bias)):
        if vec is not None:
            check_dtype(name, vec)
            check_shape(name, vec, (dim,), "(dim,)")
    if z is not None:
        check_dtype("z", z)
        check_shape("z", z, (batch, dim, length), "(batch, dim, L)")
    check_bool("delta_softplus", delta_softplus)
    check_bool("causal", causal)
    check_bool("return_last_state", return_last_state)
    if return_last_state and not causal:
        raise ValueError("return_last_state=True needs causal=True: a bidirectional scan has no single last state")
    check_same_device(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, *, causal=True,
                   return_last_state=False):
    """Mamba-1 selective scan (same positional order and semantics as ``mamba_ssm.selective_scan_fn``).

    Args:
        u: (batch, dim, L) input.
        delta: (batch, dim, L) step sizes (before ``delta_bias`` and softplus).
        A: (dim, N) real state matrix diagonal, N <= 16 (complex A is out of scope).
        B, C: (batch, N, L), or grouped (batch, G, N, L) with G dividing dim (channel d uses group d // (dim/G)).
        D: optional (dim,) skip connection, ``out += D * u``.
        z: optional (batch, dim, L) gate, ``out *= silu(z)``.
        delta_bias: optional (dim,) added to delta before the softplus.
        delta_softplus: apply softplus to delta.
        causal: ``True`` is mamba's forward scan; ``False`` adds the scan over reversed time (bidirectional),
            with ``D * u`` and the gate applied once.
        return_last_state: also return the (batch, dim, N) float32 state after the last token (causal only).

    Returns:
        ``out`` (batch, dim, L) in ``u.dtype``; ``(out, last_state)`` with ``return_last_state``.

    CUDA tensors run the Triton kernels (fp32 state whatever the input dtype); CPU tensors run the vectorised
    PyTorch path (:func:`.naive.selective_scan_torch`). Float64 inputs always take the PyTorch path, which computes
    in float64: the Triton kernels compute in float32.
    """
    _validate(u, delta, A, B, C, D, z, delta_bias, delta_softplus, causal, return_last_state)
    if library.tracing():
        out, last, _ = selective_scan_op(u, delta, A, B, C, D, z, delta_bias, delta_softplus, causal,
                                         return_last_state, needs_grad(u, delta, A, B, C, D, z, delta_bias))
        return (out, last) if return_last_state else out
    from ..dispatch import select_backend

    if select_backend(u, delta, A, B, C, D, z, delta_bias) == "triton":
        from .autograd import selective_scan_triton

        return selective_scan_triton(u, delta, A, B, C, D, z, delta_bias, delta_softplus, causal=causal,
                                     return_last_state=return_last_state)
    from .naive import selective_scan_torch

    return selective_scan_torch(u, delta, A, B, C, D, z, delta_bias, delta_softplus, causal=causal,
                                return_last_state=return_last_state)
