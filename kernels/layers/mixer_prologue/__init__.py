"""Mixer prologue op: everything a GKA or Comba layer does between its input projection and its mixer kernel.

``mixer_prologue(proj, conv_weight, *, num_heads, key_dim, value_dim, causal, beta_col, ...) -> Prologue`` reads
the input projection's output in place (column offsets into ``proj``, no split copies) and returns the mixer
kernel's inputs: the short-convolved, SiLU-activated, per-head L2-normalised q and k, the values, Comba's feedback
keys p and corrected queries, and the per-head gates. :mod:`.naive` states the maths (and is the CPU path).

Backends (:mod:`visionssm.kernels.dispatch`): Triton for CUDA tensors (and under ``TRITON_INTERPRET=1``): one
kernel forward, two backward (the per-token chain, then the transposed convolution with the weight gradient);
the PyTorch composition of :mod:`.naive` otherwise. float64 inputs always take the PyTorch path. The launch setting
``reference=True`` (``kernels.tuning.launch_overrides("mixer_prologue", reference=True)``) runs the PyTorch
composition on CUDA too, for side-by-side profiles.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ... import dispatch as _dispatch
from ... import library, tuning
from ...utils import check_bool, check_dtype, check_int
from .custom_op import mixer_prologue_op
from .naive import mixer_prologue_reference

__all__ = ["OP", "Prologue", "TRANSITIONS", "mixer_prologue", "mixer_prologue_reference"]

OP = "mixer_prologue"
#: Comba's state transitions: scalar plus low rank (the paper's default) and identity plus low rank (Table 4).
TRANSITIONS = ("splr", "iplr")
_IO_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_FUSED = None


class Prologue(NamedTuple):
    """The mixer kernel's inputs. q, k, p: (B, L, H, K); v: (B, L, H, V), all in proj's dtype; g, beta, alpha:
    (B, L, H) float32 (float64 for float64 inputs); gate: a view of proj's gate columns. Absent ones are None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    p: torch.Tensor | None
    g: torch.Tensor | None
    beta: torch.Tensor
    alpha: torch.Tensor | None
    gate: torch.Tensor | None


def _check_head_param(name: str, value, heads: int, device, required: bool) -> None:
    if value is None:
        if required:
            raise ValueError(f"{name} must be given")
        return
    check_dtype(name, value, _IO_DTYPES)
    if tuple(value.shape) != (heads,):
        raise ValueError(f"{name} must have shape (num_heads,) = ({heads},), got {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device}, proj on {device}")


def _check_columns(name: str, start, width: int, first_free: int, total: int) -> None:
    check_int(name, start, 0)
    if start < first_free or start + width > total:
        raise ValueError(f"{name}={start}: columns [{start}, {start + width}) must lie in [{first_free}, {total}) "
                         f"(after the q, k, v columns, inside proj)")


def _validate(proj, conv_weight, H, K, V, causal, cols: dict, params: dict, transition, gate_cols, eps) -> None:
    check_dtype("proj", proj, _IO_DTYPES)
    if proj.dim() != 3 or proj.shape[0] < 1 or proj.shape[1] < 1:
        raise ValueError(f"proj must have shape (B, L, N) with B, L >= 1, got {tuple(proj.shape)}")
    for name, value in (("num_heads", H), ("key_dim", K), ("value_dim", V)):
        check_int(name, value, 1)
    check_bool("causal", causal)
    width = 2 * H * K + H * V
    N = proj.shape[2]
    if width > N:
        raise ValueError(f"proj has {N} columns, fewer than the 2·H·K + H·V = {width} of q, k and v")
    check_dtype("conv_weight", conv_weight, _IO_DTYPES)
    if conv_weight.dim() not in (2, 3) or conv_weight.shape[0] != width or conv_weight.numel() % width \
            or (conv_weight.dim() == 3 and conv_weight.shape[1] != 1):
        raise ValueError(f"conv_weight must have shape ({width}, 1, kernel_size) or ({width}, kernel_size), "
                         f"got {tuple(conv_weight.shape)}")
    if conv_weight.device != proj.device:
        raise ValueError(f"conv_weight is on {conv_weight.device}, proj on {proj.device}")
    for name, start in cols.items():
        if start is not None or name == "beta_col":
            _check_columns(name, start, H, width, N)
    if gate_cols is not None:
        if not (isinstance(gate_cols, tuple) and len(gate_cols) == 2):
            raise TypeError(f"gate_cols must be a (start, width) tuple, got {gate_cols!r}")
        check_int("gate_cols width", gate_cols[1], 1)
        _check_columns("gate_cols start", gate_cols[0], gate_cols[1], width, N)
    has_decay = cols["decay_col"] is not None
    _check_head_param("A_log", params["A_log"], H, proj.device, has_decay)
    _check_head_param("dt_bias", params["dt_bias"], H, proj.device, has_decay)
    _check_head_param("beta_bias", params["beta_bias"], H, proj.device, False)
    _check_head_param("alpha_bias", params["alpha_bias"], H, proj.device, False)
    _check_head_param("feedback", params["feedback"], H, proj.device, params["correction"] is not None)
    _check_head_param("correction", params["correction"], H, proj.device, params["feedback"] is not None)
    if params["alpha_bias"] is not None and cols["alpha_col"] is None:
        raise ValueError("alpha_bias is given without alpha_col")
    if transition not in TRANSITIONS:
        raise ValueError(f"transition must be one of {TRANSITIONS}, got {transition!r}")
    if transition == "iplr" and (params["feedback"] is None or not has_decay):
        raise ValueError("transition='iplr' needs feedback/correction and a decay gate (decay_col, A_log, dt_bias)")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0 or eps == float("inf"):
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")


def mixer_prologue(proj: torch.Tensor, conv_weight: torch.Tensor, *, num_heads: int, key_dim: int, value_dim: int,
                   causal: bool, beta_col: int, beta_bias: torch.Tensor | None = None, alpha_col: int | None = None,
                   alpha_bias: torch.Tensor | None = None, decay_col: int | None = None,
                   A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                   feedback: torch.Tensor | None = None, correction: torch.Tensor | None = None,
                   transition: str = "splr", gate_cols: tuple[int, int] | None = None,
                   eps: float = 1e-6) -> Prologue:
    """The fused input side of a GKA / Comba layer (see :mod:`.naive` for the maths).

    Args:
        proj: (B, L, N) output of the layer's input projection; columns ``[0, 2HK + HV)`` are q, k, v (head-major).
        conv_weight: (2HK + HV, 1, kernel_size) depthwise short-convolution weight (no bias).
        num_heads, key_dim, value_dim: H, K (q/k head width), V (value head width).
        causal: left-padded convolution (token t sees t−k+1..t) when True, centred otherwise.
        beta_col: first of the H columns of the input-gate logits; ``beta_bias`` (H,) is added before the sigmoid.
        alpha_col, alpha_bias: the same for an optional second sigmoid gate (GKA's α).
        decay_col, A_log, dt_bias: an optional log forget gate ``g = −exp(A_log)·softplus(logit + dt_bias)``.
        feedback, correction: Comba's per-head b logit and d; with them the op returns p and the corrected q.
        transition: Comba's state transition, ``"splr"`` (p = b·k̂) or ``"iplr"`` (p = 2·b·e^g·k̂).
        gate_cols: (start, width) of columns returned as ``gate`` (a view), so that their gradient is written into
            proj's gradient by this op's backward rather than summed with it.
        eps: epsilon of the L2 normalisation.

    Returns:
        :class:`Prologue` (q, k, v, p, g, beta, alpha, gate).
    """
    cols = {"beta_col": beta_col, "alpha_col": alpha_col, "decay_col": decay_col}
    params = {"beta_bias": beta_bias, "alpha_bias": alpha_bias, "A_log": A_log, "dt_bias": dt_bias,
              "feedback": feedback, "correction": correction}
    _validate(proj, conv_weight, num_heads, key_dim, value_dim, causal, cols, params, transition, gate_cols, eps)
    if library.tracing():
        return _traced(proj, conv_weight, params, num_heads, key_dim, value_dim, causal, cols, transition, gate_cols,
                       float(eps))
    kwargs = {"num_heads": num_heads, "key_dim": key_dim, "value_dim": value_dim, "causal": causal,
              "beta_col": beta_col, "alpha_col": alpha_col, "decay_col": decay_col, "transition": transition,
              "gate_cols": gate_cols, "eps": float(eps)}
    tensors = (proj, conv_weight, *(t for t in params.values() if t is not None))
    if _dispatch.select_backend(*tensors) == "triton" and not tuning.overrides(OP).get("reference", False):
        return Prologue(*_fused()(proj, conv_weight, params, **kwargs))
    return Prologue(*mixer_prologue_reference(proj, conv_weight, **params, **kwargs))


def _traced(proj, conv_weight, params, H, K, V, causal, cols, transition, gate_cols, eps) -> Prologue:
    """The registered op (absent outputs come back empty); the gate columns sliced here, outside it, as a custom
    op's outputs must not alias its inputs."""
    q, k, v, p, g, beta, alpha, _ = mixer_prologue_op(
        proj, conv_weight, params["beta_bias"], params["alpha_bias"], params["A_log"], params["dt_bias"],
        params["feedback"], params["correction"], H, K, V, causal, cols["beta_col"], cols["alpha_col"],
        cols["decay_col"], transition, eps)
    gate = None if gate_cols is None else proj[..., gate_cols[0]:gate_cols[0] + gate_cols[1]]
    return Prologue(q, k, v, None if params["feedback"] is None else p, None if cols["decay_col"] is None else g, beta,
                    None if cols["alpha_col"] is None else alpha, gate)


def _fused():
    """The Triton entry point, imported on first use (importing visionssm never imports Triton)."""
    global _FUSED
    if _FUSED is None:
        from .autograd import fused_mixer_prologue

        _FUSED = fused_mixer_prologue
    return _FUSED
