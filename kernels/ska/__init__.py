"""Spectral Koopman Attention (SKA) op: ``ska(q, k, v, *, causal=True, ridge=1e-3, power=2, num_iters=6,
normalize=True) -> o``.

The definition (and the float64 specification) lives in :mod:`.naive`. The Triton path, split by stage: the
non-causal kernels (one operator per (batch, head)) in :mod:`.kernel_noncausal`, the causal ones (per-token prefix
operators, chunked) in :mod:`.kernel_causal`, the small dense algebra both share in :mod:`.kernel_common`, launch
plans in :mod:`.launch` and the autograd wrapper in :mod:`.autograd` (eager calls); :mod:`.custom_op` registers the op
that ``torch.compile`` and ``torch.export`` take instead.
"""

from __future__ import annotations

import torch

from .. import dispatch as _dispatch
from .. import library
from ..utils import (
    check_bool,
    check_dtype,
    check_int,
    check_layout,
    check_positive,
    check_same_device,
    check_shape,
    needs_grad,
)
from .custom_op import ska_op
from .naive import EPS, MAX_POWER, ska_parallel, ska_recurrent

__all__ = ["EPS", "MAX_POWER", "SUPPORTED_HEAD_DIMS", "SUPPORTED_RANKS", "ska", "ska_parallel", "ska_recurrent"]

#: Widths R of q and k (the Koopman rank) the kernels are compiled for.
SUPPORTED_RANKS = (16, 32, 64)
#: Widths V of v the kernels are compiled for.
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_FUSED = None


def _validate(q, k, v, causal, ridge, power, num_iters, normalize) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_dtype(name, t, _DTYPES)
    B, T, H, R = check_layout("q", q, "(B, T, H, R)", "B, T, H")
    check_shape("k", k, (B, T, H, R), "(B, T, H, R)")
    check_shape("v", v, (B, T, H, None), "(B, T, H, V)")
    if R not in SUPPORTED_RANKS:
        raise ValueError(f"q/k width R (the Koopman rank) must be one of {SUPPORTED_RANKS}, got {R}")
    if v.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"v head dim V must be one of {SUPPORTED_HEAD_DIMS}, got {v.shape[-1]}")
    if k.dtype != q.dtype:
        raise TypeError(f"k must have the dtype of q ({q.dtype}), got {k.dtype}")
    check_same_device(q=q, k=k, v=v)
    check_bool("causal", causal)
    check_bool("normalize", normalize)
    check_positive("ridge", ridge)
    check_int("power", power, 0, MAX_POWER)
    check_int("num_iters", num_iters, 1, 64)


def ska(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, ridge: float = 1e-3,
        power: int = 2, num_iters: int = 6, normalize: bool = True) -> torch.Tensor:
    """Spectral Koopman Attention.

    Args:
        q, k: ``(B, T, H, R)`` raw queries and keys, R in {16, 32, 64} (not L2-normalised: the op divides both by
            the sequence max of ‖k‖ itself).
        v: ``(B, T, H, V)`` values, V in {16, 32, 64, 128}, any of the input dtypes (the output takes it).
        causal: ``False``: one operator per (batch, head) from all T tokens, queried by every token (the vision
            default). ``True``: token t uses the statistics of tokens ≤ t with a running sequence max.
        ridge: λ on the max-normalised keys (the effective ridge on raw keys is λ·s²).
        power: order p of the power filter K̄^p (0: plain ridge retrieval ``C G⁻¹ q̂``), at most ``MAX_POWER``.
        num_iters: power-iteration steps for σ̂ (the paper: 6).
        normalize: divide K_w by σ̂ (the paper's eq. 12); ``False`` uses K_w as it is (its norm is below 1 when
            G and M come from the same tokens).

    Returns:
        ``o``: ``(B, T, H, V)`` in v's dtype. Statistics and factorisations in fp32 (float64 inputs: the PyTorch
        path in float64). Gradients reach q, k and v (through the sequence max too); σ̂ is detached, as in the
        paper. The learnable α and γ are the layer's: multiply ``o`` by α·γ^p.
    """
    _validate(q, k, v, causal, ridge, power, num_iters, normalize)
    if library.tracing():
        return ska_op(q, k, v, causal, float(ridge), power, num_iters, normalize, needs_grad(q, k, v))[0]
    if _dispatch.select_backend(q, k, v) == "triton":
        return _fused_ska()(q, k, v, causal=causal, ridge=float(ridge), power=power, num_iters=num_iters,
                            normalize=normalize)
    return ska_parallel(q, k, v, causal=causal, ridge=float(ridge), power=power, num_iters=num_iters,
                        normalize=normalize)


def _fused_ska():
    """The Triton entry point, imported on first use (importing visionssm never imports Triton)."""
    global _FUSED
    if _FUSED is None:
        from .autograd import fused_ska

        _FUSED = fused_ska
    return _FUSED
