"""The mixer contract, and the registry every list of mixers in visionssm is derived from.

A sequence mixer is a module that mixes information along the token axis of a ``(B, L, C)`` tensor. Every mixer of
visionssm — the selective scan, GKA, Comba, self-attention, SKA — follows one contract, so that any backbone slot
can host any of them (``timm.create_model('mamba_vision_T', mixer='gka')``):

* **Class**: a subclass of :class:`SequenceMixer`, registered with :func:`register_mixer` under a short name, which
  also names the ``visionssm.kernels`` op it runs (``kernel=``), if any.
* **Constructor**: ``Mixer(dim, *, causal, device=None, dtype=None, **options)``. ``dim`` is the model width C; all
  else is keyword-only. A mixer that has heads takes ``num_heads`` (a backbone passes its stage's head count to
  mixers whose constructor has that argument). Bad arguments raise ``TypeError``/``ValueError`` naming them.
* **Attributes**: ``dim`` (int) and ``causal`` (a plain bool, fixed at construction: ``True`` means token t depends
  on tokens ≤ t only, the whole mixer included — short convolutions too; a mixer that must look ahead anyway, as
  MambaVision's layer does to stay weight-exact, says by how many tokens through :meth:`SequenceMixer.lookahead`).
* **forward**: ``(B, L, dim) -> (B, L, dim)`` in the input's dtype, for any ``L ≥ 1``; any other shape raises a
  ``ValueError`` naming ``x`` (:meth:`SequenceMixer.check_input`).
* **Input under autocast**: a mixer whose first use of its input is a linear projection says so with the class
  attribute ``linear_input = True``. Under autocast that projection casts the input to autocast's dtype first, so a
  backbone may hand it the input in that dtype already (its pre-norm writes it so, and the cast is saved).
* **Cost in the sequence length**: ``linear_in_length = True`` (the default) says the mixer's time and memory grow
  linearly with L, so a backbone may run it over a whole feature map instead of windows (MambaVision's
  ``global_mixer=True``); softmax attention sets it ``False``.
* **Weight decay**: parameters that must not decay (decay rates, gate biases, skip scales) are listed by name in the
  class attribute ``no_weight_decay_names``; backbones collect them through :meth:`SequenceMixer.no_weight_decay`.
* **Initialisation**: a mixer initialises its own parameters (``reset_parameters``); backbones leave mixers alone
  when they initialise the rest of the network.

Shared building blocks (short convolution, gated RMSNorm, L2 normalisation, gate initialisation) live in
:mod:`visionssm.layers.common`.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import nn

__all__ = ["MIXERS", "MixerSpec", "SequenceMixer", "build_mixer", "get_mixer", "mixer_kernel_ops",
           "mixer_no_weight_decay", "register_mixer", "resolve_mixer"]


class SequenceMixer(nn.Module):
    """Base class of the mixer contract (see the module docstring). Subclasses call ``super().__init__(dim,
    causal=causal)`` first; it checks both and stores them as plain attributes."""

    #: Names of this mixer's own parameters that are kept out of weight decay.
    no_weight_decay_names: tuple[str, ...] = ()
    #: The mixer's first use of its input is a linear projection (see the module docstring).
    linear_input: bool = False
    #: Time and memory grow linearly with the sequence length (see the module docstring).
    linear_in_length: bool = True

    def __init__(self, dim: int, *, causal: bool) -> None:
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"dim must be an int, got {type(dim).__name__}")
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        self.dim = dim
        self.causal = causal

    def check_input(self, x: torch.Tensor) -> None:
        """``ValueError`` naming ``x`` unless it is ``(B, L, dim)``."""
        if x.dim() != 3 or x.shape[-1] != self.dim or x.shape[1] < 1:
            raise ValueError(f"x must have shape (B, L, {self.dim}) with L >= 1, got {tuple(x.shape)}")

    def lookahead(self) -> int:
        """How many later tokens a ``causal=True`` instance still sees (0: strictly causal)."""
        return 0

    def reset_parameters(self) -> None:
        """(Re-)initialise this mixer's parameters; backbones call it after their own model-wide initialisation."""
        raise NotImplementedError(f"{type(self).__name__} must define reset_parameters (the mixer contract)")

    def no_weight_decay(self) -> set[str]:
        """The names (relative to this module) of the parameters kept out of weight decay."""
        return {name for name in self.no_weight_decay_names if isinstance(getattr(self, name, None), nn.Parameter)}


@dataclasses.dataclass(frozen=True)
class MixerSpec:
    """One registered mixer: its name, its class and the ``visionssm.kernels`` op it runs (``None``: plain torch)."""

    name: str
    cls: type[SequenceMixer]
    kernel: str | None

    def accepts(self, argument: str) -> bool:
        """Whether the constructor takes ``argument`` (e.g. ``num_heads``)."""
        return argument in inspect.signature(self.cls).parameters


#: name -> :class:`MixerSpec` of every registered mixer, in registration order.
MIXERS: dict[str, MixerSpec] = {}


def register_mixer(name: str, *, kernel: str | None = None):
    """Class decorator: register a :class:`SequenceMixer` subclass under ``name``. ``kernel`` names the
    ``visionssm.kernels`` op it runs, which puts that op into the kernel benchmark and the FLOP rule."""

    def register(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, SequenceMixer)):
            raise TypeError(f"mixer {name!r}: {cls!r} must subclass visionssm.layers.base.SequenceMixer")
        parameters = inspect.signature(cls).parameters
        if "causal" not in parameters or parameters["causal"].kind is not inspect.Parameter.KEYWORD_ONLY:
            raise TypeError(f"mixer {name!r}: the constructor must take a keyword-only 'causal' argument")
        if name in MIXERS and MIXERS[name].cls is not cls:
            raise ValueError(f"mixer name {name!r} is already registered for {MIXERS[name].cls.__name__}")
        MIXERS[name] = MixerSpec(name, cls, kernel)
        # The mixers call kernels through Python-level dispatch: FX symbolic tracing keeps them as leaves.
        from timm.models import register_notrace_module

        register_notrace_module(cls)
        return cls

    return register


def get_mixer(name: str, argument: str = "mixer") -> MixerSpec:
    """The registered mixer ``name``; ``ValueError`` naming ``argument`` and the choices otherwise."""
    if name not in MIXERS:
        raise ValueError(f"{argument} must be one of {sorted(MIXERS)} or a SequenceMixer class, got {name!r}")
    return MIXERS[name]


def mixer_kernel_ops() -> list[str]:
    """The ``visionssm.kernels`` ops the registered mixers run, each once, in registration order."""
    return list(dict.fromkeys(spec.kernel for spec in MIXERS.values() if spec.kernel))


def resolve_mixer(mixer, argument: str = "mixer"):
    """A backbone's ``mixer=`` argument as a class or factory: a registered name, a :class:`SequenceMixer` subclass
    (registered or not) or any callable following the contract."""
    if isinstance(mixer, str):
        return get_mixer(mixer, argument).cls
    if not callable(mixer):
        raise TypeError(f"{argument} must be a mixer name or a SequenceMixer class, got {type(mixer).__name__}")
    if isinstance(mixer, type):
        from timm.models import register_notrace_module

        register_notrace_module(mixer)
    return mixer


def build_mixer(mixer, dim: int, *, causal: bool, kwargs: dict | None = None, offered: dict | None = None,
                argument: str = "mixer", **factory_kwargs) -> nn.Module:
    """Construct ``mixer`` (name, class or factory) at width ``dim``. ``offered`` holds settings the host offers to
    any mixer whose constructor takes them (e.g. a stage's ``num_heads``); ``kwargs`` (the user's) win over them."""
    factory = resolve_mixer(mixer, argument)
    try:
        accepted = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        accepted = {}
    options = {k: v for k, v in (offered or {}).items() if k in accepted}
    options.update(kwargs or {})
    return factory(dim, causal=causal, **options, **factory_kwargs)


def mixer_no_weight_decay(model: nn.Module) -> set[str]:
    """Full names of every contained mixer's :meth:`SequenceMixer.no_weight_decay` parameters."""
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, SequenceMixer):
            names.update(f"{prefix}.{name}" if prefix else name for name in module.no_weight_decay())
    return names
