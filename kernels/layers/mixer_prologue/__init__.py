"""Mixer prologue op: what a mixer layer does between its input projection and its mixer kernel.

``mixer_prologue(proj, conv_weight, spec, *, beta_bias, ...) -> Prologue`` reads the input projection's output in
place (column offsets into ``proj``, no split copies) and returns the mixer kernel's inputs. The layer describes
what it needs once, when it is built, as a :class:`PrologueSpec`:

- the core, shared by every mixer: q, k, v from the first ``2HK + HV`` columns (short convolution, SiLU, per-head
  L2 norm of q and k), the per-head input gate β, optionally a log forget gate g and gate columns passed through;
- the parts a mixer adds, declared by its layer: a second sigmoid gate α (GKA), key feedback p with the corrected
  queries under a state transition (Comba).

A mixer that needs only the core builds a spec and edits nothing here. :mod:`.naive` states the maths (and is the
CPU path).

Backends (:mod:`visionssm.kernels.dispatch`): Triton for CUDA tensors (and under ``TRITON_INTERPRET=1``): one
kernel forward, two backward (the per-token chain, then the transposed convolution with the weight gradient);
the PyTorch composition of :mod:`.naive` otherwise. float64 inputs always take the PyTorch path. The launch setting
``reference=True`` (``kernels.tuning.launch_overrides("mixer_prologue", reference=True)``) runs the PyTorch
composition on CUDA too, for side-by-side profiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ... import dispatch as _dispatch
from ... import library, tuning
from ...utils import check_bool, check_dtype, check_int, check_layout
from .custom_op import PARAMS, mixer_prologue_op
from .naive import mixer_prologue_reference

__all__ = ["OP", "PARAMS", "Prologue", "PrologueSpec", "TRANSITIONS", "mixer_prologue", "mixer_prologue_reference"]

OP = "mixer_prologue"
#: State transitions of the key-feedback part: scalar plus low rank (Comba's default) and identity plus low rank
#: (Comba-iplr, its Table 4).
TRANSITIONS = ("splr", "iplr")
_IO_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_DTYPE_SET = frozenset(_IO_DTYPES)
# whether a spec wants each of the per-head PARAMS (the registered op's order, which the call keeps)
_ABSENT, _OPTIONAL, _REQUIRED = 0, 1, 2
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


def _check_columns(name: str, start, width: int, first_free: int) -> int:
    """The end of a spec's column range [start, start + width), which must lie after the q, k, v columns."""
    check_int(name, start, 0)
    if start < first_free:
        raise ValueError(f"{name}={start}: columns [{start}, {start + width}) must lie after the q, k, v columns "
                         f"[0, {first_free})")
    return start + width


@dataclass(frozen=True)
class PrologueSpec:
    """What a mixer layer takes from its input projection ``proj`` (B, L, N): built and checked once, when the layer
    is built (a call then checks only its tensors), and passed with every call of :func:`mixer_prologue`.

    The core, every mixer:
        num_heads, key_dim, value_dim: H, K (q/k head width), V (value head width); columns ``[0, 2HK + HV)`` of
            proj are q, k, v (head-major), short-convolved, SiLU-activated, q and k L2-normalised per head.
        causal: left-padded convolution (token t sees t−k+1..t) when True, centred otherwise.
        beta_col: first of the H columns of the input-gate logits: ``β = sigmoid(logit + beta_bias)``.
        decay_col: first of the H columns of an optional log forget gate ``g = −exp(A_log)·softplus(logit +
            dt_bias)`` (then the call takes ``A_log`` and ``dt_bias``).
        gate_cols: (start, width) of columns returned as ``gate`` (a view), so that their gradient is written into
            proj's gradient by this op's backward rather than summed with it.
        eps: epsilon of the L2 normalisation.

    The parts a mixer adds (None: without):
        alpha_col: first of the H columns of a second sigmoid gate ``α = sigmoid(logit + alpha_bias)`` (GKA's α).
        transition: key feedback and output correction (Comba): with the call's per-head ``feedback`` (b's logit)
            and ``correction`` (d), ``p = b·k̂`` (``"splr"``) or ``p = 2·b·e^g·k̂`` (``"iplr"``, needs the forget
            gate), and q becomes ``q̂ − d·b·k̂``.
    """

    num_heads: int
    key_dim: int
    value_dim: int
    causal: bool
    beta_col: int
    decay_col: int | None = None
    gate_cols: tuple[int, int] | None = None
    eps: float = 1e-6
    alpha_col: int | None = None
    transition: str | None = None
    # derived once: q/k/v width, the columns proj must have and the spec field that reaches furthest, which of the
    # PARAMS the call passes (and the field that decides it), the flat attributes of the registered op and of the
    # reference
    width: int = field(init=False, repr=False, compare=False)
    columns: tuple[int, str] = field(init=False, repr=False, compare=False)
    presence: tuple[tuple[int, str], ...] = field(init=False, repr=False, compare=False)
    attrs: tuple = field(init=False, repr=False, compare=False)
    reference_kwargs: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_heads", "key_dim", "value_dim"):
            check_int(name, getattr(self, name), 1)
        check_bool("causal", self.causal)
        H, K, V = self.num_heads, self.key_dim, self.value_dim
        width = 2 * H * K + H * V
        ends = [(width, "the q, k, v columns"), (_check_columns("beta_col", self.beta_col, H, width), "beta_col")]
        for name in ("alpha_col", "decay_col"):
            if getattr(self, name) is not None:
                ends.append((_check_columns(name, getattr(self, name), H, width), name))
        if self.gate_cols is not None:
            if not (isinstance(self.gate_cols, tuple) and len(self.gate_cols) == 2):
                raise TypeError(f"gate_cols must be a (start, width) tuple, got {self.gate_cols!r}")
            check_int("gate_cols width", self.gate_cols[1], 1)
            ends.append((_check_columns("gate_cols start", self.gate_cols[0], self.gate_cols[1], width),
                         "gate_cols"))
        if self.transition is not None and self.transition not in TRANSITIONS:
            raise ValueError(f"transition must be None or one of {TRANSITIONS}, got {self.transition!r}")
        if self.transition == "iplr" and self.decay_col is None:
            raise ValueError("transition='iplr' needs the forget gate (decay_col)")
        eps = self.eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0 or not math.isfinite(eps):
            raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
        # the kernels' and the reference's flat arguments; without feedback the transition is unused ("splr")
        transition = self.transition or "splr"
        static = {"num_heads": H, "key_dim": K, "value_dim": V, "causal": self.causal, "beta_col": self.beta_col,
                  "alpha_col": self.alpha_col, "decay_col": self.decay_col, "transition": transition,
                  "gate_cols": self.gate_cols, "eps": float(eps)}
        decay = _REQUIRED if self.decay_col is not None else _ABSENT
        feedback = _REQUIRED if self.transition is not None else _ABSENT
        presence = ((_OPTIONAL, "beta_col"), (_OPTIONAL if self.alpha_col is not None else _ABSENT, "alpha_col"),
                    (decay, "decay_col"), (decay, "decay_col"), (feedback, "transition"), (feedback, "transition"))
        for name, value in (("width", width), ("columns", max(ends)), ("presence", presence),
                            ("reference_kwargs", static),
                            ("attrs", (H, K, V, self.causal, self.beta_col, self.alpha_col, self.decay_col,
                                       transition, float(eps)))):
            object.__setattr__(self, name, value)


def _well_formed(proj, conv_weight, spec, params) -> bool:
    """One pass of cheap checks that accepts exactly the arguments :func:`_checked` accepts (the common case, on
    every call of a training step); anything else goes through :func:`_checked`, which names what is wrong."""
    if type(spec) is not PrologueSpec or not isinstance(proj, torch.Tensor) \
            or not isinstance(conv_weight, torch.Tensor):
        return False
    shape, wshape = proj.shape, conv_weight.shape
    if len(shape) != 3 or shape[0] < 1 or shape[1] < 1 or shape[2] < spec.columns[0] or proj.dtype not in _DTYPE_SET:
        return False
    device = proj.device
    if wshape[0] != spec.width or not (len(wshape) == 2 or (len(wshape) == 3 and wshape[1] == 1)) \
            or conv_weight.dtype not in _DTYPE_SET or conv_weight.device != device:
        return False
    heads = (spec.num_heads,)
    for value, (want, _) in zip(params, spec.presence):
        if value is None:
            if want == _REQUIRED:
                return False
        elif want == _ABSENT or not isinstance(value, torch.Tensor) or value.shape != heads \
                or value.dtype not in _DTYPE_SET or value.device != device:
            return False
    return True


def _checked(proj, conv_weight, spec, params) -> None:
    if not isinstance(spec, PrologueSpec):
        raise TypeError(f"spec must be a PrologueSpec, got {type(spec).__name__}")
    check_dtype("proj", proj, _IO_DTYPES)
    check_layout("proj", proj, "(B, L, N)", "B, L")
    end, reach = spec.columns
    if proj.shape[2] < end:
        raise ValueError(f"proj has {proj.shape[2]} columns, fewer than the {end} that {reach} of the spec reads")
    width = spec.width
    check_dtype("conv_weight", conv_weight, _IO_DTYPES)
    if conv_weight.dim() not in (2, 3) or conv_weight.shape[0] != width \
            or (conv_weight.dim() == 3 and conv_weight.shape[1] != 1):
        raise ValueError(f"conv_weight must have shape ({width}, 1, kernel_size) or ({width}, kernel_size), "
                         f"got {tuple(conv_weight.shape)}")
    if conv_weight.device != proj.device:
        raise ValueError(f"conv_weight is on {conv_weight.device}, proj on {proj.device}")
    H = spec.num_heads
    for name, value, (want, field_name) in zip(PARAMS, params, spec.presence):
        if value is None:
            if want == _REQUIRED:
                raise ValueError(f"{name} must be given: the spec has {field_name}")
            continue
        if want == _ABSENT:
            raise ValueError(f"{name} is given, but the spec has no {field_name}")
        check_dtype(name, value, _IO_DTYPES)
        if tuple(value.shape) != (H,):
            raise ValueError(f"{name} must have shape (num_heads,) = ({H},), got {tuple(value.shape)}")
        if value.device != proj.device:
            raise ValueError(f"{name} is on {value.device}, proj on {proj.device}")


def mixer_prologue(proj: torch.Tensor, conv_weight: torch.Tensor, spec: PrologueSpec, *,
                   beta_bias: torch.Tensor | None = None, alpha_bias: torch.Tensor | None = None,
                   A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                   feedback: torch.Tensor | None = None, correction: torch.Tensor | None = None) -> Prologue:
    """The fused input side of a mixer layer (see :mod:`.naive` for the maths).

    Args:
        proj: (B, L, N) output of the layer's input projection, laid out as ``spec`` says.
        conv_weight: (2HK + HV, 1, kernel_size) depthwise short-convolution weight (no bias).
        spec: the layer's :class:`PrologueSpec`.
        beta_bias, alpha_bias: optional (H,) biases of the sigmoid gates (``alpha_bias`` with ``spec.alpha_col``).
        A_log, dt_bias: (H,) parameters of the forget gate, exactly when ``spec.decay_col`` is set.
        feedback, correction: (H,) b's logit and d of the key feedback, exactly when ``spec.transition`` is set.

    Returns:
        :class:`Prologue` (q, k, v, p, g, beta, alpha, gate).
    """
    params = (beta_bias, alpha_bias, A_log, dt_bias, feedback, correction)
    if not _well_formed(proj, conv_weight, spec, params):
        _checked(proj, conv_weight, spec, params)
    if library.tracing():
        return _traced(proj, conv_weight, params, spec)
    if _dispatch.select_backend(proj, conv_weight, *(t for t in params if t is not None)) == "triton" \
            and not tuning.overrides(OP).get("reference", False):
        return Prologue(*_fused()(proj, conv_weight, params, spec))
    return Prologue(*mixer_prologue_reference(proj, conv_weight, beta_bias=beta_bias, alpha_bias=alpha_bias,
                                              A_log=A_log, dt_bias=dt_bias, feedback=feedback,
                                              correction=correction, **spec.reference_kwargs))


def _traced(proj, conv_weight, params, spec: PrologueSpec) -> Prologue:
    """The registered op (absent outputs come back empty); the gate columns sliced here, outside it, as a custom
    op's outputs must not alias its inputs."""
    q, k, v, p, g, beta, alpha, _ = mixer_prologue_op(proj, conv_weight, *params, *spec.attrs)
    gate_cols = spec.gate_cols
    gate = None if gate_cols is None else proj[..., gate_cols[0]:gate_cols[0] + gate_cols[1]]
    return Prologue(q, k, v, None if spec.transition is None else p, None if spec.decay_col is None else g, beta,
                    None if spec.alpha_col is None else alpha, gate)


def _fused():
    """The Triton entry point, imported on first use (importing visionssm never imports Triton)."""
    global _FUSED
    if _FUSED is None:
        from .autograd import fused_mixer_prologue

        _FUSED = fused_mixer_prologue
    return _FUSED
