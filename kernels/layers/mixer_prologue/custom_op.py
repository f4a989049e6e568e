"""``mixer_prologue`` as a registered op (:mod:`visionssm.kernels.library`).

The schema is flat: the six optional per-head parameters as ``Tensor?`` in a fixed order, the flags as scalars.
Outputs the call does not ask for (p, g, alpha) come back as empty tensors (a schema has no optional returns). The
gate columns are not the op's: a custom op's outputs must not alias its inputs, so the public function slices them
from proj itself (autograd adds their gradient into proj's) and the op's backward leaves those columns' gradient zero.
"""

from __future__ import annotations

import torch

from ... import library
from ...utils import device_guard
from .naive import mixer_prologue_reference

#: The per-head parameters in the op's argument order (the kernels' order too).
PARAMS = ("beta_bias", "alpha_bias", "A_log", "dt_bias", "feedback", "correction")
_OUTPUTS = ("q", "k", "v", "p", "g", "beta", "alpha")


def _triton(*tensors) -> bool:
    from . import OP

    return library.runs_triton(OP, *tensors)


def _present(params, alpha_col, decay_col) -> list[bool]:
    """Which of (q, k, v, p, g, beta, alpha) the call returns."""
    return [True, True, True, params[4] is not None, decay_col is not None, True, alpha_col is not None]


def _reference(proj, conv_weight, *args):
    """The present outputs of the reference (the op's attributes after the six parameters)."""
    params, (H, K, V, causal, beta_col, alpha_col, decay_col, transition, eps) = args[:6], args[6:]
    outputs = mixer_prologue_reference(proj, conv_weight, num_heads=H, key_dim=K, value_dim=V, causal=causal,
                                       beta_col=beta_col, alpha_col=alpha_col, decay_col=decay_col,
                                       transition=transition, eps=eps, **dict(zip(PARAMS, params)))
    return tuple(t for t in outputs[:7] if t is not None)


def _absent(proj):
    return proj.new_empty(0, dtype=torch.float32)


def _kernel_inputs(proj, conv_weight, params, attrs):
    """(proj, conv_weight, plan) as the kernels take them; the plan has no gate columns (the public function slices
    the gate from proj itself)."""
    from .launch import get_plan

    num_heads, key_dim, value_dim, causal, beta_col, alpha_col, decay_col, transition, eps = attrs
    if proj.stride(-1) != 1:
        proj = proj.contiguous()
    conv_weight = conv_weight.contiguous()
    plan = get_plan(proj, conv_weight, params, num_heads, key_dim, value_dim, causal,
                    (beta_col, alpha_col, decay_col), None, transition, eps)
    return proj, conv_weight, plan


def mixer_prologue_forward(proj: torch.Tensor, conv_weight: torch.Tensor, beta_bias: torch.Tensor | None,
                           alpha_bias: torch.Tensor | None, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                           feedback: torch.Tensor | None, correction: torch.Tensor | None, num_heads: int,
                           key_dim: int, value_dim: int, causal: bool, beta_col: int, alpha_col: int | None,
                           decay_col: int | None, transition: str, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                      torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    params = (beta_bias, alpha_bias, A_log, dt_bias, feedback, correction)
    attrs = (num_heads, key_dim, value_dim, causal, beta_col, alpha_col, decay_col, transition, eps)
    if not _triton(proj, conv_weight, *params):
        outputs = iter(_reference(proj, conv_weight, *params, *attrs))
    else:
        from .launch import run_fwd

        proj, conv_weight, plan = _kernel_inputs(proj, conv_weight, params, attrs)
        with device_guard(proj):
            outputs = iter(t for t in run_fwd(plan, proj, conv_weight, params, separate=True) if t is not None)
    return (*(next(outputs) if present else _absent(proj) for present in _present(params, alpha_col, decay_col)),
            [])


def _mixer_prologue_fake(proj, conv_weight, beta_bias, alpha_bias, A_log, dt_bias, feedback, correction, num_heads,
                         key_dim, value_dim, causal, beta_col, alpha_col, decay_col, transition, eps):
    params = (beta_bias, alpha_bias, A_log, dt_bias, feedback, correction)
    B, L, _ = proj.shape
    H, K, V = num_heads, key_dim, value_dim
    if _triton(proj, conv_weight, *params):
        g_dtype = beta_dtype = alpha_dtype = torch.float32
    else:  # the reference's dtypes: the gates promote with their biases; the decay in float32 or float64
        wide = [proj.dtype, *(t.dtype for t in (A_log, dt_bias) if t is not None)]
        g_dtype = torch.float64 if torch.float64 in wide else torch.float32
        beta_dtype, alpha_dtype = (proj.dtype if bias is None else torch.promote_types(proj.dtype, bias.dtype)
                                   for bias in (beta_bias, alpha_bias))
    shapes = {"q": ((B, L, H, K), proj.dtype), "k": ((B, L, H, K), proj.dtype), "v": ((B, L, H, V), proj.dtype),
              "p": ((B, L, H, K), proj.dtype), "g": ((B, L, H), g_dtype), "beta": ((B, L, H), beta_dtype),
              "alpha": ((B, L, H), alpha_dtype)}
    return (*(proj.new_empty(shapes[name][0], dtype=shapes[name][1]) if present else _absent(proj)
              for name, present in zip(_OUTPUTS, _present(params, alpha_col, decay_col))), [])


def mixer_prologue_backward(grads: list[torch.Tensor], inputs: list[torch.Tensor | None], saved: list[torch.Tensor],
                            num_heads: int, key_dim: int, value_dim: int, causal: bool, beta_col: int,
                            alpha_col: int | None, decay_col: int | None, transition: str,
                            eps: float) -> list[torch.Tensor]:
    proj, conv_weight, *params = inputs
    attrs = (num_heads, key_dim, value_dim, causal, beta_col, alpha_col, decay_col, transition, eps)
    present = _present(params, alpha_col, decay_col)
    if not _triton(*inputs):
        return library.reference_backward(_reference, [d for d, ok in zip(grads, present) if ok], inputs, *attrs)
    from .autograd import _PARAM_SLOTS
    from .launch import run_bwd

    proj, conv_weight, plan = _kernel_inputs(proj, conv_weight, params, attrs)
    with device_guard(proj):
        dproj, dweight, head_grads = run_bwd(plan, proj, conv_weight, params,
                                             tuple(d if ok else None for d, ok in zip(grads, present)), None)
    return [dproj, dweight, *(head_grads[slot].to(p.dtype) for p, slot in zip(params, _PARAM_SLOTS)
                              if p is not None)]


mixer_prologue_op = library.register("mixer_prologue", mixer_prologue_forward, _mixer_prologue_fake,
                                     mixer_prologue_backward)
