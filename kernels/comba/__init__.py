"""Comba mixer op: ``comba(q, k, v, p, g, beta, *, scale=None, causal=True) -> o``.

Causal recurrence (state ``h ∈ R^{K×V}``, read before decay)::

    u_t = β_t (v_t − h_{t−1}ᵀ p_t),   h_t = e^{g_t} h_{t−1} + k_t u_tᵀ,   o_t = scale · h_tᵀ q_t

With ``p = b·k`` this is the paper's eq. 5. The output correction ``q − d·p`` and the L2 normalisation of q/k
belong to the layer. Non-causal: ``o = causal(x) + reverse_T(causal(reverse_T(x)))``, both directions computed by
one kernel launch that walks the sequence backwards for the second direction (no reversed copies).

Backends (:mod:`visionssm.kernels.dispatch`): Triton for CUDA tensors (and under ``TRITON_INTERPRET=1``), the
chunked PyTorch form of :mod:`.naive` otherwise. float64 inputs always take the PyTorch path.
"""

from __future__ import annotations

import math
import numbers

import torch

from .. import dispatch as _dispatch
from .. import library
from ..utils import check_bool, check_dtype, check_layout, check_same_device, check_shape, needs_grad
from .custom_op import comba_op
from .naive import comba_chunked, comba_recurrent

__all__ = ["MAX_HEAD_DIM", "comba", "comba_chunked", "comba_recurrent"]

#: Largest key/value head dimension the kernels accept (the state of one head lives on chip).
MAX_HEAD_DIM = 128
_FUSED = None
_IO_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_DTYPE_SET = frozenset(_IO_DTYPES)


def _well_formed(q, k, v, p, g, beta, causal) -> bool:
    """One pass of cheap checks that accepts exactly the arguments :func:`_checked` accepts (the common case, on
    every call of a training step); anything else goes through :func:`_checked`, which names what is wrong."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
            and isinstance(p, torch.Tensor) and isinstance(g, torch.Tensor) and isinstance(beta, torch.Tensor)):
        return False
    shape, vshape = q.shape, v.shape
    if len(shape) != 4 or len(vshape) != 4 or k.shape != shape or p.shape != shape:
        return False
    lead = shape[:3]
    if vshape[:3] != lead or g.shape != lead or beta.shape != lead:
        return False
    if min(shape) < 1 or shape[3] > MAX_HEAD_DIM or not 1 <= vshape[3] <= MAX_HEAD_DIM:
        return False
    dtype = q.dtype
    if dtype not in _DTYPE_SET or k.dtype != dtype or v.dtype != dtype or p.dtype != dtype:
        return False
    if g.dtype not in _DTYPE_SET or beta.dtype not in _DTYPE_SET:
        return False
    device = q.device
    if k.device != device or v.device != device or p.device != device or g.device != device \
            or beta.device != device:
        return False
    return causal is True or causal is False


def _validate(q, k, v, p, g, beta, scale, causal) -> float:
    if _well_formed(q, k, v, p, g, beta, causal):
        if scale is None:
            return q.shape[3] ** -0.5
        if type(scale) is float and math.isfinite(scale):
            return scale
    return _checked(q, k, v, p, g, beta, scale, causal)


def _checked(q, k, v, p, g, beta, scale, causal) -> float:
    for name, t in (("q", q), ("k", k), ("v", v), ("p", p), ("g", g), ("beta", beta)):
        check_dtype(name, t, _IO_DTYPES)
    B, T, H, K = check_layout("q", q, "(B, T, H, K)", "B, T, H")
    check_shape("k", k, (B, T, H, K), "(B, T, H, K)")
    check_shape("p", p, (B, T, H, K), "(B, T, H, K)")
    check_shape("v", v, (B, T, H, None), "(B, T, H, V)")
    check_shape("g", g, (B, T, H), "(B, T, H)")
    check_shape("beta", beta, (B, T, H), "(B, T, H)")
    V = v.shape[-1]
    if not 1 <= K <= MAX_HEAD_DIM:
        raise ValueError(f"q: key head dim K must be in [1, {MAX_HEAD_DIM}], got {K}")
    if not 1 <= V <= MAX_HEAD_DIM:
        raise ValueError(f"v: value head dim V must be in [1, {MAX_HEAD_DIM}], got {V}")
    for name, t in (("k", k), ("v", v), ("p", p)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the same dtype as q ({q.dtype}), got {t.dtype}")
    check_same_device(q=q, k=k, v=v, p=p, g=g, beta=beta)
    check_bool("causal", causal)
    if scale is None:
        return K ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def comba(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor, g: torch.Tensor,
          beta: torch.Tensor, *, scale: float | None = None, causal: bool = True) -> torch.Tensor:
    """Comba (SPLR closed-loop delta rule) mixer.

    Args:
        q, k, p: (B, T, H, K) queries, keys and feedback keys (the layer passes ``p = b·k``).
        v: (B, T, H, V) values, same dtype as q.
        g: (B, T, H) log forget gate (``α_t = e^{g_t}``, normally ≤ 0).
        beta: (B, T, H) input gate.
        scale: output scale, default ``K ** -0.5``.
        causal: ``False`` adds the same recurrence run over reversed time.

    Returns:
        o: (B, T, H, V) in v's dtype. fp16/bf16 inputs are computed with an fp32 state and TF32 products in the
        forward; bf16 inputs keep the states saved for the backward in bf16 and run the backward's products (all but
        the chunks' triangular inverses) on 16-bit tensor cores: gradient error against float64 ≈ 2.5–4.5e-3 on
        random inputs (``launch_overrides("comba", state_lp=False)``: fp32 states and TF32 products, ≈ 2–3.5e-3).
    """
    scale = _validate(q, k, v, p, g, beta, scale, causal)
    if library.tracing():
        return comba_op(q, k, v, p, g, beta, scale, causal, needs_grad(q, k, v, p, g, beta))[0]
    # k, v, p share q's dtype and all six share a device (validated): q, g and beta decide the backend
    if _dispatch.select_backend(q, g, beta) == "triton":
        return _fused_comba()(q, k, v, p, g, beta, scale=scale, causal=causal)
    return comba_chunked(q, k, v, p, g, beta, scale=scale, causal=causal)


def _fused_comba():
    """The Triton entry point, imported on first use (importing visionssm never imports Triton)."""
    global _FUSED
    if _FUSED is None:
        from .autograd import fused_comba

        _FUSED = fused_comba
    return _FUSED
