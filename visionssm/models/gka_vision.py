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

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model

from .mamba_vision import MambaVision, checkpoint_filter_fn

__all__: list[str] = []  # register_model appends the entrypoints


def _cfg(url: str = "", **kwargs) -> dict:
    return {
        "url": url,
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": (7, 7),
        "crop_pct": 0.875,
        "crop_mode": "center",
        "interpolation": "bicubic",
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "stem.conv1",
        "classifier": "head.fc",
        "paper_ids": "arXiv:2511.21016",
        "paper_name": "Gated KalmaNet: A Fading Memory Layer Through Test-Time Ridge Regression",
        **kwargs,
    }


default_cfgs = generate_default_cfgs({
    "gka_vision_T": _cfg(),
    "gka_vision_T2": _cfg(),
    "gka_vision_S": _cfg(),
    "gka_vision_B": _cfg(),
})


def _create_gka_vision(variant: str, pretrained: bool = False, **kwargs) -> MambaVision:
    kwargs.setdefault("mixer", "gka")
    kwargs.setdefault("mixer_causal", True)
    return build_model_with_cfg(
        MambaVision,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg={"out_indices": (0, 1, 2, 3), "flatten_sequential": True},
        **kwargs,
    )


@register_model
def gka_vision_T(pretrained: bool = False, **kwargs) -> MambaVision:
    model_args = {"depths": (1, 3, 8, 4), "dims": 80, "stem_dim": 32, "num_heads": (2, 4, 8, 16),
                  "window_size": (8, 8, 14, 7), "drop_path_rate": 0.2}
    return _create_gka_vision("gka_vision_T", pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def gka_vision_T2(pretrained: bool = False, **kwargs) -> MambaVision:
    model_args = {"depths": (1, 3, 11, 4), "dims": 80, "stem_dim": 32, "num_heads": (2, 4, 8, 16),
                  "window_size": (8, 8, 14, 7), "drop_path_rate": 0.2}
    return _create_gka_vision("gka_vision_T2", pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def gka_vision_S(pretrained: bool = False, **kwargs) -> MambaVision:
    model_args = {"depths": (3, 3, 7, 5), "dims": 96, "stem_dim": 64, "num_heads": (2, 4, 8, 16),
                  "window_size": (8, 8, 14, 7), "drop_path_rate": 0.2}
    return _create_gka_vision("gka_vision_S", pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def gka_vision_B(pretrained: bool = False, **kwargs) -> MambaVision:
    model_args = {"depths": (3, 3, 10, 5), "dims": 128, "stem_dim": 64, "num_heads": (2, 4, 8, 16),
                  "window_size": (8, 8, 14, 7), "drop_path_rate": 0.3, "layer_scale": 1e-5}
    return _create_gka_vision("gka_vision_B", pretrained=pretrained, **dict(model_args, **kwargs))
