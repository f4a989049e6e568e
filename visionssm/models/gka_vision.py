"""GKAVision: the MambaVision macro-architecture with Gated KalmaNet (GKA) layers as the sequence mixer.

Paper: "Gated KalmaNet: A Fading Memory Layer Through Test-Time Ridge Regression", Peng, Chattopadhyay, Zancato,
Nunez, Xia, Soatto, arXiv 2511.21016 (appendix N: GKAVision).

Everything but the mixer is MambaVision (visionssm.models.mamba_vision): conv stem, two conv stages, two windowed
stages whose first ceil(depth / 2) blocks hold a :class:`visionssm.layers.gka.GKAMixer` (causal by default, as
published) and whose remaining blocks hold self-attention, BatchNorm, average pooling and a linear classifier.
Because only the mixer changes, GKAVision-X against MambaVision-X isolates the effect of the mixer. These are
registered presets of :class:`~visionssm.models.mamba_vision.MambaVision` with ``mixer='gka'``; pass
``mixer_causal=False`` for the non-causal variant and ``mixer_kwargs=dict(...)`` to change the layer's settings.

No pretrained weights are published for these models.
"""

from __future__ import annotations

from timm.models import generate_default_cfgs, register_model

from .mamba_vision import MAMBA_VISION_ARCHS, MambaVision, _create_mamba_vision
from .mamba_vision import _cfg as mamba_vision_cfg

__all__: list[str] = []  # register_model appends the entrypoints


def _cfg(url: str = "", **kwargs) -> dict:
    """MambaVision's pretrained config (same stem, head and input), with this family's paper and crop."""
    return mamba_vision_cfg(url, crop_pct=0.875, paper_ids="arXiv:2511.21016",
                            paper_name="Gated KalmaNet: A Fading Memory Layer Through Test-Time Ridge Regression",
                            **kwargs)


default_cfgs = generate_default_cfgs({
    "gka_vision_T": _cfg(),
    "gka_vision_T2": _cfg(),
    "gka_vision_S": _cfg(),
    "gka_vision_B": _cfg(),
})


def _create_gka_vision(variant: str, pretrained: bool = False, **kwargs) -> MambaVision:
    kwargs.setdefault("mixer", "gka")
    kwargs.setdefault("mixer_causal", True)
    return _create_mamba_vision(variant, pretrained, **kwargs)


@register_model
def gka_vision_T(pretrained: bool = False, **kwargs) -> MambaVision:
    return _create_gka_vision("gka_vision_T", pretrained, **dict(MAMBA_VISION_ARCHS["T"], **kwargs))


@register_model
def gka_vision_T2(pretrained: bool = False, **kwargs) -> MambaVision:
    return _create_gka_vision("gka_vision_T2", pretrained, **dict(MAMBA_VISION_ARCHS["T2"], **kwargs))


@register_model
def gka_vision_S(pretrained: bool = False, **kwargs) -> MambaVision:
    return _create_gka_vision("gka_vision_S", pretrained, **dict(MAMBA_VISION_ARCHS["S"], **kwargs))


@register_model
def gka_vision_B(pretrained: bool = False, **kwargs) -> MambaVision:
    return _create_gka_vision("gka_vision_B", pretrained, **dict(MAMBA_VISION_ARCHS["B"], **kwargs))
