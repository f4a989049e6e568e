"""OSTrack's centre head: a score map, a size map and an offset map on the stride-16 search feature map."""

from __future__ import annotations

import torch
import torch.nn as nn


def _tower(in_channels: int, channels: int, out_channels: int) -> nn.Sequential:
    widths = [in_channels, channels, channels // 2, channels // 4, channels // 8]
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Conv2d(a, b, 3, padding=1, bias=False), nn.BatchNorm2d(b), nn.ReLU(inplace=True)]
    layers.append(nn.Conv2d(widths[-1], out_channels, 1))
    return nn.Sequential(*layers)


class CenterHead(nn.Module):
    """Three conv towers (C → 256 → 128 → 64 → 32 → k) over the (B, C, H, W) search map.

    ``score``: target-centre probability per cell (sigmoid, clamped to [1e-4, 1 - 1e-4]);
    ``size``: box (w, h) as a fraction of the search crop (sigmoid, clamped);
    ``offset``: sub-cell position of the centre, in cells, measured from the cell's top-left corner.
    """

    def __init__(self, in_channels: int, channels: int = 256):
        super().__init__()
        if channels % 8:
            raise ValueError(f"channels must be a multiple of 8, got {channels}")
        self.score_tower = _tower(in_channels, channels, 1)
        self.size_tower = _tower(in_channels, channels, 2)
        self.offset_tower = _tower(in_channels, channels, 2)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.xavier_uniform_(m.weight)
        # Start the centre scores near the prior of one positive among H·W cells (CenterNet's bias trick).
        nn.init.constant_(self.score_tower[-1].bias, -4.6)

    def forward(self, feat: torch.Tensor) -> dict[str, torch.Tensor]:
        score = torch.sigmoid(self.score_tower(feat).float()).clamp(1e-4, 1 - 1e-4)
        size = torch.sigmoid(self.size_tower(feat).float()).clamp(1e-4, 1 - 1e-4)
        offset = self.offset_tower(feat).float()
        return {"score": score, "size": size, "offset": offset}


def decode_boxes(
    score: torch.Tensor, size: torch.Tensor, offset: torch.Tensor, window: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Box at the (optionally windowed) score peak, as normalised (cx, cy, w, h) in search-crop units.

    Returns the boxes (B, 4) and the peak's raw score (B,).
    """
    b, _, h, w = score.shape
    response = score if window is None else score * window
    idx = response.flatten(1).argmax(dim=1)
    iy, ix = torch.div(idx, w, rounding_mode="floor"), idx % w
    gather = lambda m: m.flatten(2).gather(2, idx.view(b, 1, 1).expand(b, m.shape[1], 1)).squeeze(2)
    off, wh = gather(offset), gather(size)
    cx = (ix.to(off.dtype) + off[:, 0]) / w
    cy = (iy.to(off.dtype) + off[:, 1]) / h
    peak = score.flatten(1).gather(1, idx[:, None]).squeeze(1)
    return torch.stack([cx, cy, wh[:, 0], wh[:, 1]], dim=1), peak


def hann_window(size: int, device=None) -> torch.Tensor:
    """OSTrack's 2-D Hann window ``0.5·(1 - cos(2πk/(n+1)))``, k = 1..n, outer product, shape (1, 1, n, n)."""
    k = torch.arange(1, size + 1, dtype=torch.float32, device=device)
    w1 = 0.5 * (1 - torch.cos(2 * torch.pi * k / (size + 1)))
    return (w1[:, None] * w1[None, :])[None, None]
