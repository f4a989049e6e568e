"""OSTrack's training losses: CenterNet focal loss on the score map + 2·GIoU + 5·L1 on the box at the score peak."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchvision.ops import box_convert, box_iou, generalized_box_iou_loss

from .model.head import decode_boxes


def gaussian_radius(height: torch.Tensor, width: torch.Tensor, min_overlap: float = 0.7) -> torch.Tensor:
    """CornerNet's radius: the largest corner shift that keeps IoU ≥ ``min_overlap`` (smallest of three cases)."""
    a1, b1 = 1.0, height + width
    c1 = width * height * (1 - min_overlap) / (1 + min_overlap)
    r1 = (b1 + torch.sqrt(b1**2 - 4 * a1 * c1)) / 2
    a2, b2 = 4.0, 2 * (height + width)
    c2 = (1 - min_overlap) * width * height
    r2 = (b2 + torch.sqrt(b2**2 - 4 * a2 * c2)) / 2
    a3, b3 = 4 * min_overlap, -2 * min_overlap * (height + width)
    c3 = (min_overlap - 1) * width * height
    r3 = (b3 + torch.sqrt(b3**2 - 4 * a3 * c3)) / 2
    return torch.minimum(torch.minimum(r1, r2), r3)


def centre_cells(boxes_xyxy: torch.Tensor, feat_size: int) -> torch.Tensor:
    """(B, 2) integer (ix, iy) of the cell holding each box centre (the cell the offset is measured from)."""
    centre = (boxes_xyxy[:, :2] + boxes_xyxy[:, 2:]) / 2 * feat_size
    return centre.floor().clamp(0, feat_size - 1).long()


def gaussian_heatmap(boxes_xyxy: torch.Tensor, feat_size: int) -> torch.Tensor:
    """(B, 1, S, S) targets: 1 at the centre cell, a Gaussian (σ = (2r+1)/6, CornerNet radius r) cut at radius r."""
    b = boxes_xyxy.shape[0]
    wh = (boxes_xyxy[:, 2:] - boxes_xyxy[:, :2]).clamp(min=0) * feat_size
    radius = gaussian_radius(wh[:, 1], wh[:, 0]).floor().clamp(min=0)
    sigma = (2 * radius + 1) / 6
    cells = centre_cells(boxes_xyxy, feat_size)
    grid = torch.arange(feat_size, device=boxes_xyxy.device, dtype=boxes_xyxy.dtype)
    dx = grid[None, None, :] - cells[:, 0, None, None]
    dy = grid[None, :, None] - cells[:, 1, None, None]
    s = sigma.view(b, 1, 1)
    heat = torch.exp(-(dx**2 + dy**2) / (2 * s**2))
    inside = (dx.abs() <= radius.view(b, 1, 1)) & (dy.abs() <= radius.view(b, 1, 1))
    heat = heat * inside
    return heat.unsqueeze(1)


def focal_loss(pred: torch.Tensor, target: torch.Tensor, alpha: float = 2.0, beta: float = 4.0) -> torch.Tensor:
    """CenterNet's penalty-reduced focal loss, normalised by the number of positives (cells with target 1)."""
    pred = pred.float().clamp(1e-4, 1 - 1e-4)
    pos = target.eq(1).float()
    neg = 1 - pos
    pos_loss = torch.log(pred) * (1 - pred) ** alpha * pos
    neg_loss = torch.log(1 - pred) * pred**alpha * (1 - target) ** beta * neg
    num_pos = pos.sum()
    return -(pos_loss.sum() + neg_loss.sum()) / num_pos.clamp(min=1)


def tracking_loss(
    outputs: dict[str, torch.Tensor],
    gt_xyxy: torch.Tensor,
    weights: tuple[float, float, float] = (1.0, 2.0, 5.0),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``w_focal·focal + w_giou·(1 - GIoU) + w_l1·L1`` with the box decoded at the predicted score peak.

    ``gt_xyxy``: (B, 4) ground-truth boxes normalised to the search crop; clamped to [0, 1] as OSTrack does.
    Returns the loss and detached scalar tensors for logging (components and the mean IoU of the decoded boxes);
    they stay on the device so that a training step does not wait for the GPU.
    """
    score = outputs["score"]
    feat_size = score.shape[-1]
    gt = gt_xyxy.float().clamp(0, 1)
    heat = gaussian_heatmap(gt, feat_size)
    l_focal = focal_loss(score, heat)
    boxes, _ = decode_boxes(score, outputs["size"], outputs["offset"])
    pred = box_convert(boxes, "cxcywh", "xyxy")
    l_giou = generalized_box_iou_loss(pred, gt, reduction="mean")
    l_l1 = F.l1_loss(pred, gt)
    w_focal, w_giou, w_l1 = weights
    loss = w_focal * l_focal + w_giou * l_giou + w_l1 * l_l1
    with torch.no_grad():
        iou = box_iou(pred, gt).diagonal().mean()
    stats = {"loss": loss.detach(), "focal": l_focal.detach(), "giou": l_giou.detach(), "l1": l_l1.detach(),
             "iou": iou}
    return loss, stats
