"""Pieces the mixer layers share: argument checks, the depthwise short convolution over tokens, the per-head
L2 normalisation, the gated per-head RMSNorm, the blocks' LayerNorm, and Mamba2's forgetting-gate initialisation."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from timm.models import register_notrace_module
from torch import nn
from torch.nn.modules import module as _module_state

from visionssm import kernels
from visionssm.kernels.dispatch import fx_tracing
from visionssm.kernels.layers.layer_norm import add_layer_norm
from visionssm.kernels.utils import check_int, check_positive

__all__ = ["GatedRMSNorm", "LayerNorm", "ShortConv1d", "add_and_norm", "aligned_projection", "init_log_decay_",
           "is_hooked", "is_plain_linear", "l2_normalize", "observe_saves", "recompute_saved", "require_int",
           "require_positive"]


# the kernels' own argument checks: one rule for the ops and the layers
require_int = check_int


require_positive = check_positive


#: Callbacks shown every tensor a :class:`recompute_saved` keeps (its hooks hide them from outer ones).
_SAVE_OBSERVERS: list = []


@contextlib.contextmanager
def observe_saves(callback):
    """Within: ``callback(tensor)`` for every tensor that a :class:`recompute_saved` region keeps for the backward.
    Saved-tensor hooks do not nest (the innermost pair alone sees a save), so a tool that counts saves through its
    own hooks (with ``callback`` as their pack hook) registers here to see those made inside such a region too
    (``visionssm.benchmark.memory``); other outer hooks (checkpointing) switch the regions off."""
    _SAVE_OBSERVERS.append(callback)
    try:
        yield
    finally:
        _SAVE_OBSERVERS.remove(callback)


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class recompute_saved:  # noqa: N801 - used as a context manager, like torch's
    """Context manager: a save for the backward of one of ``tensors`` (or a view with its layout: the same memory)
    made inside keeps a token instead, and ``recompute()`` rebuilds all of them, once, when the backward first reads
    one. For a mixer's kernel inputs that a cheap op computes from a tensor autograd keeps anyway (the prologue from
    the projection it saves): they are not kept twice across the forward. ``recompute`` must give the same values
    (it runs under the forward's autocast state, without grad). Inside ``torch.compile`` or FX tracing it does
    nothing (a compiled graph plans its own saves)."""

    def __init__(self, tensors, recompute) -> None:
        self.active = (not torch.compiler.is_compiling() and not fx_tracing() and torch.is_grad_enabled()
                       and not _outer_save_hooks())
        self.keys = {_tensor_key(t): i for i, t in enumerate(tensors) if t is not None} if self.active else {}
        self.active = bool(self.keys)
        self.recompute = recompute
        self.hooks = None

    def __enter__(self):
        if not self.active:
            return self
        device = next(iter(self.keys))[0].type
        autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        built: list = []

        def pack(t):
            index = self.keys.get(_tensor_key(t))
            if index is not None:
                return _Recomputed(index)
            for observe in _SAVE_OBSERVERS:
                observe(t)
            return t

        def unpack(saved):
            if not isinstance(saved, _Recomputed):
                return saved
            if not built:
                with torch.no_grad(), torch.autocast(device, dtype=autocast[1], enabled=autocast[0]):
                    built.append(self.recompute())
            return built[0][saved.index]

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        if self.hooks is not None:
            self.hooks.__exit__(*exc)
            self.hooks = None
        return False


def _outer_save_hooks() -> bool:
    """Whether saved-tensor hooks other than an observer's (:func:`observe_saves`) are active: gradient
    checkpointing or offloading decide what is kept there, and hooks of ours inside would keep it all."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # no way to tell: stay out of the way
        return True
    try:
        hooks = top(True)  # ignore_is_tracing
    except TypeError:
        hooks = top()
    return hooks is not None and hooks[0] not in _SAVE_OBSERVERS


class _Recomputed:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(‖x‖² + eps)`` over the last axis, computed in float32 and returned in x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def is_plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a plain ``nn.Linear`` that no forward hook (its own or a global one) watches: only then
    may a layer read its weight and bias directly instead of calling it. A subclass or a wrapper in its place (LoRA,
    quantisation) or a hook (feature extraction, FLOP counters) must see the call."""
    return type(module) is nn.Linear and not is_hooked(module)


def is_hooked(module: nn.Module) -> bool:
    """Whether a forward hook (``module``'s own or a global one) watches calls of ``module``."""
    return bool(module._forward_hooks or module._forward_pre_hooks or _module_state._global_forward_hooks
                or _module_state._global_forward_pre_hooks)


def aligned_projection(x: torch.Tensor, linear: nn.Linear, multiple: int = 8) -> torch.Tensor:
    """``linear(x)``, padded with zero columns to a multiple of ``multiple`` features when ``linear`` is a plain
    ``nn.Linear`` that nothing hooks; callers read their columns by offset and never the padding.

    Why: a row of N 16-bit features starts 16-byte aligned only when N % 8 == 0; otherwise cuBLAS takes its slower
    2-element-aligned GEMM kernels (Comba-S's input projection has N = 1180). The padding is a few zero rows of the
    weight built per call (a copy of the weight's size, not the activations'), so the parameter, and every
    checkpoint, keeps its N rows. A subclass or a wrapper in the Linear's place (LoRA, quantisation) or a forward
    hook on it (feature extraction, FLOP counters) is called as it is, unpadded: the padded path reads the weight
    directly and would go around them."""
    pad = -linear.out_features % multiple
    if not pad or not is_plain_linear(linear):
        return linear(x)
    bias = None if linear.bias is None else F.pad(linear.bias, (0, pad))
    return F.linear(x, F.pad(linear.weight, (0, 0, 0, pad)), bias)


class ShortConv1d(nn.Module):
    """Depthwise 1-D convolution over the token axis of a (B, L, C) tensor, followed by SiLU.

    ``causal=True`` pads on the left only, so token t sees tokens t−k+1..t; ``causal=False`` centres the window
    (MambaVision's 'same' padding), so the causal switch of a mixer covers its short convolution too.
    """

    def __init__(self, channels: int, kernel_size: int = 3, *, device=None, dtype=None) -> None:
        super().__init__()
        self.channels = require_int("channels", channels, 1)
        self.kernel_size = require_int("kernel_size", kernel_size, 1)
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, device=device, dtype=dtype))
        # nn.Conv1d's default initialisation (kaiming-uniform with a = sqrt(5), fan_in = kernel_size).
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        k = self.kernel_size
        padding = (k - 1, 0) if causal else ((k - 1) // 2, k // 2)
        y = F.conv1d(F.pad(x.transpose(1, 2), padding), self.weight, groups=self.channels)
        return F.silu(y).transpose(1, 2)

    def extra_repr(self) -> str:
        return f"{self.channels}, kernel_size={self.kernel_size}"


# it branches on its input (device, autocast): FX symbolic tracing (timm's feature extraction) keeps it as a leaf
@register_notrace_module
class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same arguments, parameters and state dict) computed by :func:`visionssm.kernels.layer_norm`
    when it normalises over the last axis with a weight: the Triton kernels for CUDA tensors (PyTorch's weight-gradient
    kernel is slow for the backbones' narrow rows), ``F.layer_norm`` otherwise. Under CUDA autocast the input is taken
    in float32 and the result is float32, as autocast runs ``F.layer_norm`` there (other devices' autocast keeps its
    own rules: plain ``nn.LayerNorm``); under ``torch.compile`` the module is plain ``nn.LayerNorm`` (the compiler
    fuses it itself).

    ``autocast_output=True``: under CUDA autocast, the kernels' result comes in autocast's dtype instead of float32
    (rounded to nearest once; the gradient then arrives in that dtype). For a norm whose result goes only into linear
    layers, which cast it to that dtype first (a pre-norm block's norm before its MLP), that saves the cast's pass over
    the activations, and in training the cast's backward too; the values the linear layers see, and the gradients,
    are the same. It is not part of the state dict."""

    def __init__(self, *args, autocast_output: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(autocast_output, bool):
            raise TypeError(f"autocast_output must be a bool, got {type(autocast_output).__name__}")
        self.autocast_output = autocast_output

    def _kernel_out_dtype(self, x: torch.Tensor) -> tuple[bool, torch.dtype | None]:
        """(whether the kernels take this call, the dtype they write under autocast or None)."""
        autocast = torch.is_autocast_enabled(x.device.type)
        if (self.weight is None or len(self.normalized_shape) != 1 or torch.compiler.is_compiling()
                or (autocast and x.device.type != "cuda")):
            return False, None
        if autocast and x.dtype != torch.float64:  # autocast leaves float64 alone
            return True, torch.get_autocast_dtype("cuda") if self.autocast_output else torch.float32
        return True, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused, out_dtype = self._kernel_out_dtype(x)
        if not fused:
            return super().forward(x)
        if out_dtype is not None:  # autocast: the norm of the float32 input, as F.layer_norm there
            x = x.float()
        return kernels.layer_norm(x, self.weight, self.bias, eps=self.eps, out_dtype=out_dtype)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(residual + x), residual + x)``, the add done inside the norm's kernels where :meth:`forward`
        would run them (a pre-norm block's residual add before its second norm: one pass over the residual stream
        fewer each way, and no add or gradient cast of its own)."""
        fused, out_dtype = self._kernel_out_dtype(residual)
        if not fused or residual.shape != x.shape:
            summed = residual + x
            return self(summed), summed
        return add_layer_norm(x, residual, self.weight, self.bias, eps=self.eps, out_dtype=out_dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", autocast_output=True" if self.autocast_output else "")


def add_and_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(residual + x), residual + x)``: fused by :meth:`LayerNorm.forward_add` for this package's LayerNorm
    that no forward hook watches, the plain composition (``norm`` called) otherwise and under FX tracing (which keeps
    the norm as one call)."""
    if isinstance(norm, LayerNorm) and not is_hooked(norm) and not fx_tracing():
        return norm.forward_add(x, residual)
    summed = residual + x
    return norm(summed), summed


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last axis (one head), multiplied by ``activation(gate)`` when a gate is given; float32
    inside, result in x's dtype."""

    def __init__(self, dim: int, *, activation: str = "silu", eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        if activation not in ("silu", "sigmoid"):
            raise ValueError(f"activation must be 'silu' or 'sigmoid', got {activation!r}")
        self.activation = activation
        self.eps = require_positive("eps", eps)
        self.weight = nn.Parameter(torch.ones(require_int("dim", dim, 1), device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps) * self.weight.float()
        if gate is not None:
            gate32 = gate.float()
            y = y * (F.silu(gate32) if self.activation == "silu" else torch.sigmoid(gate32))
        return y.to(x.dtype)


def init_log_decay_(A_log: torch.Tensor, dt_bias: torch.Tensor, *, a_range: tuple[float, float] = (1.0, 16.0),
                    dt_range: tuple[float, float] = (1e-3, 1e-1), dt_floor: float = 1e-4) -> None:
    """Mamba2's initialisation of ``g = −exp(A_log)·softplus(W x + dt_bias)``: A ~ U(a_range), dt log-uniform in
    dt_range with ``dt_bias = softplus⁻¹(dt)``, so that the forget gates start close to 1."""
    with torch.no_grad():
        A = torch.empty_like(A_log, dtype=torch.float32).uniform_(*a_range)
        A_log.copy_(A.log())
        lo, hi = math.log(dt_range[0]), math.log(dt_range[1])
        dt = torch.exp(torch.rand_like(dt_bias, dtype=torch.float32) * (hi - lo) + lo).clamp(min=dt_floor)
        dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
