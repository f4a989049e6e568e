"""Backbone adapters: run a visionssm classifier backbone over a (template, search) pair as one token sequence.

Every adapter maps ``(z, x)`` — template (B, 3, 128, 128) and search (B, 3, 256, 256) — to the stride-16 search
feature map (B, C, 16, 16) the head reads, with the template tokens first in the joint sequence and the sequence
mixers built non-causal (``mixer_causal=False``) so that search tokens see the template and each other in both
directions.

- Isotropic backbones (``comba_vision_*``): the backbone's patch embedding is applied to each image; each image gets
  its own position embedding, initialised by resampling the ImageNet one to its token grid (OSTrack's
  ``pos_embed_z``/``pos_embed_x``); the 64 + 256 tokens are concatenated and run through all blocks and the final
  norm.
- Hierarchical backbones (``mamba_vision_*``, ``gka_vision_*``): the stem and the stages before the stride-16 stage
  run on each image with shared weights (as does that stage's downsampling conv); the stride-16 stage's blocks then
  run once on the joint sequence, with its windows off (one window holding all 64 + 256 tokens). The stride-32
  stage is not used. A learned token-type embedding (zero-initialised) tells template from search tokens, since these
  backbones have no position embedding, and a LayerNorm ends the stage (the classifier's BatchNorm belongs to the
  dropped stride-32 stage).
- ``tiny``: a two-block attention backbone with no dependencies, for tests.
"""

from __future__ import annotations

import sys

import timm
import torch
import torch.nn as nn
from timm.layers import resample_abs_pos_embed
from timm.models import checkpoint_seq

from visionssm.models.comba_vision import blocks_then_norm
from visionssm.utils.checkpoint import read_state_dict
from visionssm.utils.cli import UserValueError


def create_classifier(name: str, **kwargs) -> nn.Module:
    """The timm-registered visionssm model ``name`` without classifier, its mixers non-causal."""
    from visionssm.models import FAMILIES  # importing the package registers every family with timm

    known = sorted(model for models in FAMILIES.values() for model in models)
    if name not in known:
        raise UserValueError(f"unknown backbone {name!r}: expected one of {known} or 'tiny'")
    kwargs.setdefault("mixer_causal", False)
    return timm.create_model(name, pretrained=False, num_classes=0, **kwargs)


def load_imagenet_weights(model: nn.Module, path: str) -> dict:
    """Load an ImageNet checkpoint file into a classifier backbone (classifier weights dropped).

    Goes through the model file's ``checkpoint_filter_fn`` (which converts official/foreign layouts). Every
    backbone weight must be present; returns ``{'missing': [...], 'unexpected': [...]}`` for the log.
    """
    state = read_state_dict(path)
    module = sys.modules[type(model).__module__]
    filter_fn = getattr(module, "checkpoint_filter_fn", None)
    if filter_fn is not None:
        state = filter_fn(state, model)
    state = {k: v for k, v in state.items() if not k.startswith("head.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("head.")]
    if missing:
        raise RuntimeError(f"ImageNet checkpoint {path} lacks backbone weights: {missing[:8]} ({len(missing)} in all)")
    return {"missing": missing, "unexpected": list(unexpected)}


class PairBackbone(nn.Module):
    """Base: ``forward(z, x) -> (B, out_channels, Hx/16, Wx/16)``."""

    out_channels: int
    stride: int = 16

    def __init__(self):
        super().__init__()
        self.grad_checkpointing = False

    def set_grad_checkpointing(self, enable: bool = True):
        self.grad_checkpointing = enable

    def _blocks_then_norm(self, blocks: nn.Module, norm: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """``norm(blocks(tokens))``: checkpointed when set and training; otherwise Comba blocks run chained, their
        residual adds inside the norms (:func:`blocks_then_norm`), and any other blocks one after another."""
        if self.grad_checkpointing and self.training and not torch.jit.is_scripting():
            return norm(checkpoint_seq(blocks, tokens))
        return blocks_then_norm(blocks, norm, tokens)


def _check_sizes(z: torch.Tensor, x: torch.Tensor, template_size: int, search_size: int):
    if z.ndim != 4 or x.ndim != 4 or z.shape[0] != x.shape[0]:
        raise ValueError(f"expected template (B, 3, H, W) and search (B, 3, H, W), got {tuple(z.shape)}, "
                         f"{tuple(x.shape)}")
    if tuple(z.shape[-2:]) != (template_size, template_size) or tuple(x.shape[-2:]) != (search_size, search_size):
        raise ValueError(f"expected template {template_size}² and search {search_size}², got {tuple(z.shape[-2:])} "
                         f"and {tuple(x.shape[-2:])}")


class IsotropicPairBackbone(PairBackbone):
    """One-stream pair adapter for a ViT-like backbone exposing ``patch_embed``, ``pos_embed``, ``blocks``, ``norm``."""

    def __init__(self, model: nn.Module, template_size: int = 128, search_size: int = 256):
        super().__init__()
        self.patch_embed = model.patch_embed
        patch = self.patch_embed.patch_size[0]
        if template_size % patch or search_size % patch:
            raise ValueError(f"template/search sizes must be multiples of the patch size {patch}")
        self.stride = patch
        self.template_size, self.search_size = template_size, search_size
        grid = tuple(self.patch_embed.grid_size)
        pos = model.pos_embed.detach()
        gz, gx = template_size // patch, search_size // patch
        self.pos_embed_z = nn.Parameter(resample_abs_pos_embed(pos, (gz, gz), old_size=grid, num_prefix_tokens=0))
        self.pos_embed_x = nn.Parameter(resample_abs_pos_embed(pos, (gx, gx), old_size=grid, num_prefix_tokens=0))
        self.blocks = model.blocks
        self.norm = model.norm
        self.out_channels = int(model.num_features)

    def _embed(self, image: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        t = self.patch_embed(image)
        if t.ndim == 4:  # NHWC
            t = t.flatten(1, 2)
        return t + pos

    def forward(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        _check_sizes(z, x, self.template_size, self.search_size)
        tz, tx = self._embed(z, self.pos_embed_z), self._embed(x, self.pos_embed_x)
        tokens = self._blocks_then_norm(self.blocks, self.norm, torch.cat([tz, tx], dim=1))
        g = self.search_size // self.stride
        return tokens[:, tz.shape[1]:].reshape(x.shape[0], g, g, -1).permute(0, 3, 1, 2).contiguous()


class HierarchicalPairBackbone(PairBackbone):
    """Pair adapter for MambaVision-style backbones (``stem``, ``stages`` with ``downsample``/``blocks``)."""

    def __init__(self, model: nn.Module, template_size: int = 128, search_size: int = 256):
        super().__init__()
        if template_size % 16 or search_size % 16:
            raise ValueError("template/search sizes must be multiples of 16")
        reductions = [info["reduction"] for info in model.feature_info]
        if 16 not in reductions:
            raise ValueError(f"backbone has no stride-16 stage (reductions {reductions})")
        joint = reductions.index(16)
        stage = model.stages[joint]
        if getattr(stage, "conv", False):
            raise ValueError("the stride-16 stage must be a token stage")
        self.template_size, self.search_size = template_size, search_size
        self.stem = model.stem
        self.per_image = nn.Sequential(*list(model.stages[:joint]))
        self.downsample = stage.downsample
        self.blocks = stage.blocks
        channels = int(model.feature_info[joint]["num_chs"])
        self.token_type = nn.Parameter(torch.zeros(2, channels))
        self.norm = nn.LayerNorm(channels)
        self.out_channels = channels

    def _tokens(self, image: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        f = self.downsample(self.per_image(self.stem(image)))
        return f.flatten(2).transpose(1, 2), (f.shape[-2], f.shape[-1])

    def forward(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        _check_sizes(z, x, self.template_size, self.search_size)
        tz, _ = self._tokens(z)
        tx, (h, w) = self._tokens(x)
        tokens = torch.cat([tz + self.token_type[0], tx + self.token_type[1]], dim=1)
        tokens = self._blocks_then_norm(self.blocks, self.norm, tokens)
        return tokens[:, tz.shape[1]:].transpose(1, 2).reshape(x.shape[0], -1, h, w).contiguous()


class TinyPairBackbone(PairBackbone):
    """A dependency-free one-stream backbone (patch 16, two attention blocks) for tests and smoke runs."""

    def __init__(self, template_size: int = 128, search_size: int = 256, dim: int = 32, depth: int = 2):
        super().__init__()
        self.template_size, self.search_size = template_size, search_size
        self.patch_embed = nn.Conv2d(3, dim, 16, stride=16)
        self.pos_embed_z = nn.Parameter(torch.randn(1, (template_size // 16) ** 2, dim) * 0.02)
        self.pos_embed_x = nn.Parameter(torch.randn(1, (search_size // 16) ** 2, dim) * 0.02)
        layer = lambda: nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.Sequential(*[layer() for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.out_channels = dim

    def forward(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        _check_sizes(z, x, self.template_size, self.search_size)
        tz = self.patch_embed(z).flatten(2).transpose(1, 2) + self.pos_embed_z
        fx = self.patch_embed(x)
        tx = fx.flatten(2).transpose(1, 2) + self.pos_embed_x
        tokens = self._blocks_then_norm(self.blocks, self.norm, torch.cat([tz, tx], dim=1))
        return tokens[:, tz.shape[1]:].transpose(1, 2).reshape(fx.shape).contiguous()


def build_pair_backbone(
    name: str,
    pretrained: str | None = None,
    template_size: int = 128,
    search_size: int = 256,
    **kwargs,
) -> PairBackbone:
    """The pair adapter for backbone ``name``; ``pretrained`` is an ImageNet checkpoint file (or None: random init).

    ``kwargs`` go to the timm entrypoint (e.g. ``drop_path_rate``, ``mixer_kwargs``); ``tiny`` takes ``dim``/``depth``.
    """
    if name == "tiny":
        if pretrained:
            raise UserValueError("the 'tiny' test backbone has no ImageNet checkpoint")
        return TinyPairBackbone(template_size, search_size, **kwargs)
    model = create_classifier(name, **kwargs)
    if pretrained:
        load_imagenet_weights(model, pretrained)
    if hasattr(model, "pos_embed") and hasattr(model, "blocks"):
        return IsotropicPairBackbone(model, template_size, search_size)
    if hasattr(model, "stages") and hasattr(model, "stem"):
        return HierarchicalPairBackbone(model, template_size, search_size)
    raise ValueError(f"backbone {name!r} has neither an isotropic nor a MambaVision-style layout")
