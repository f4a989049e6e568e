"""The one-stream tracker network: pair backbone + centre head."""

from __future__ import annotations

import torch
import torch.nn as nn

from .backbones import PairBackbone, build_pair_backbone
from .head import CenterHead


class OneStreamTracker(nn.Module):
    """``forward(template, search)`` → ``{'score', 'size', 'offset'}`` maps on the stride-16 search grid."""

    def __init__(self, backbone: PairBackbone, head_channels: int = 256):
        super().__init__()
        self.backbone = backbone
        self.head = CenterHead(backbone.out_channels, head_channels)

    @property
    def template_size(self) -> int:
        return self.backbone.template_size

    @property
    def search_size(self) -> int:
        return self.backbone.search_size

    def forward(self, template: torch.Tensor, search: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.head(self.backbone(template, search))


def build_model(model_cfg: dict, load_pretrained: bool = True) -> OneStreamTracker:
    """Build from the ``model`` section of a tracking config (see :mod:`visionssm.tracking.config`)."""
    kwargs = dict(model_cfg.get("backbone_kwargs") or {})
    if model_cfg["backbone"] != "tiny":
        kwargs.setdefault("drop_path_rate", model_cfg.get("drop_path_rate", 0.1))
    backbone = build_pair_backbone(
        model_cfg["backbone"],
        pretrained=model_cfg.get("pretrained") if load_pretrained else None,
        template_size=model_cfg.get("template_size", 128),
        search_size=model_cfg.get("search_size", 256),
        **kwargs,
    )
    return OneStreamTracker(backbone, model_cfg.get("head_channels", 256))
