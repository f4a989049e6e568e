"""EchoVision: the MambaVision macro-architecture with Spectral Koopman Attention (SKA) in place of self-attention.

Paper: "Echo: KV-Cache-Free Associative Recall with Spectral Koopman Operators", Sridhar and Johansen,
arXiv 2605.06997. Echo pairs SSM blocks with SKA layers that replace attention; MambaVision's stages 3–4 pair
selective-scan blocks with attention blocks, so the vision analogue keeps everything of MambaVision (conv stem, two
conv stages, the selective-scan blocks of the windowed stages, BatchNorm, pooling, classifier) and swaps only the
attention blocks for :class:`visionssm.layers.ska.SKAMixer` — an attention-free hybrid. These are registered presets
of :class:`~visionssm.models.mamba_vision.MambaVision` with ``attn_mixer='ska'`` (non-causal: one operator per
window, queried by all of its tokens); ``attn_mixer_kwargs=dict(...)`` changes the layer's settings.

Each SKA layer takes the stage's head count (8 heads in stage 3, 16 in stage 4) with rank 16 and value width 64,
i.e. ``dim·H·160`` parameters: for T (dim/H = 40) exactly the 4·dim² of the attention block it replaces, so
echo_vision_T has 31.78 M parameters against mamba_vision_T's 31.79 M (the attention biases); for S (dim/H = 48)
5/6 of it, 49.05 M against 50.14 M. The paper has no vision experiments
and no weights are published for these models.
"""

from __future__ import annotations

from timm.models import generate_default_cfgs, register_model

from .mamba_vision import MAMBA_VISION_ARCHS, MambaVision, _create_mamba_vision
from .mamba_vision import _cfg as mamba_vision_cfg

__all__: list[str] = []  # register_model appends the entrypoints


def _cfg(url: str = "", **kwargs) -> dict:
    """MambaVision's pretrained config (same stem, head and input), with this family's paper and crop."""
    return mamba_vision_cfg(url, crop_pct=0.875, paper_ids="arXiv:2605.06997",
                            paper_name="Echo: KV-Cache-Free Associative Recall with Spectral Koopman Operators",
                            **kwargs)


default_cfgs = generate_default_cfgs({
    "echo_vision_T": _cfg(),
    "echo_vision_S": _cfg(),
})


def _create_echo_vision(variant: str, pretrained: bool = False, **kwargs) -> MambaVision:
    kwargs.setdefault("attn_mixer", "ska")
    return _create_mamba_vision(variant, pretrained, **kwargs)


@register_model
def echo_vision_T(pretrained: bool = False, **kwargs) -> MambaVision:
    return _create_echo_vision("echo_vision_T", pretrained, **dict(MAMBA_VISION_ARCHS["T"], **kwargs))


@register_model
def echo_vision_S(pretrained: bool = False, **kwargs) -> MambaVision:
    return _create_echo_vision("echo_vision_S", pretrained, **dict(MAMBA_VISION_ARCHS["S"], **kwargs))
