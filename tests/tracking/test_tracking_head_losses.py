"""Centre head decoding, Hann window, heatmap targets and the OSTrack losses."""

import math

import pytest
import torch

from visionssm.tracking.losses import focal_loss, gaussian_heatmap, tracking_loss
from visionssm.tracking.model.head import CenterHead, decode_boxes, hann_window


def _maps(b=2, s=16):
    score = torch.full((b, 1, s, s), 1e-4)
    size = torch.full((b, 2, s, s), 0.1)
    offset = torch.zeros(b, 2, s, s)
    return score, size, offset


def test_decode_reads_the_peak_cell_plus_offset():
    score, size, offset = _maps()
    score[0, 0, 3, 11] = 0.9  # row 3, column 11
    offset[0, :, 3, 11] = torch.tensor([0.25, 0.75])
    size[0, :, 3, 11] = torch.tensor([0.2, 0.3])
    score[1, 0, 15, 0] = 0.5
    boxes, peak = decode_boxes(score, size, offset)
    torch.testing.assert_close(boxes[0], torch.tensor([(11 + 0.25) / 16, (3 + 0.75) / 16, 0.2, 0.3]))
    torch.testing.assert_close(boxes[1], torch.tensor([0 / 16, 15 / 16, 0.1, 0.1]))
    torch.testing.assert_close(peak, torch.tensor([0.9, 0.5]))


def test_window_moves_the_peak_to_the_centre():
    score, size, offset = _maps(1)
    score[0, 0, 0, 0] = 0.9   # a corner peak
    score[0, 0, 8, 7] = 0.6   # a weaker one near the centre
    boxes, _ = decode_boxes(score, size, offset, hann_window(16))
    torch.testing.assert_close(boxes[0, :2], torch.tensor([7 / 16, 8 / 16]))


def test_hann_window():
    w = hann_window(16)
    assert w.shape == (1, 1, 16, 16)
    k = torch.arange(1, 17, dtype=torch.float32)
    w1 = 0.5 * (1 - torch.cos(2 * math.pi * k / 17))
    torch.testing.assert_close(w[0, 0], w1[:, None] * w1[None, :])
    torch.testing.assert_close(w[0, 0], w[0, 0].flip(0).flip(1))


def test_head_shapes_and_ranges():
    head = CenterHead(32, 64)
    out = head(torch.randn(2, 32, 16, 16))
    assert out["score"].shape == (2, 1, 16, 16)
    assert out["size"].shape == (2, 2, 16, 16) and out["offset"].shape == (2, 2, 16, 16)
    assert out["score"].min() >= 1e-4 and out["score"].max() <= 1 - 1e-4
    with pytest.raises(ValueError):
        CenterHead(32, 60)


def test_heatmap_peak_and_radius():
    boxes = torch.tensor([[0.40, 0.40, 0.60, 0.60], [0.0, 0.0, 0.05, 0.05], [0.7, 0.1, 0.99, 0.9]])
    heat = gaussian_heatmap(boxes, 16)
    assert heat.shape == (3, 1, 16, 16)
    assert (heat.flatten(1).max(1).values == 1).all()
    assert (heat.eq(1).flatten(1).sum(1) == 1).all()  # exactly one positive per box
    assert heat[0, 0, 8, 8] == 1  # centre 0.5·16 = 8.0 → cell 8 (offset measured from the cell corner)
    assert heat[1, 0, 0, 0] == 1 and heat[1].sum() == 1  # a tiny box: radius 0, only the peak
    assert heat[2, 0, 8, 13] == 1 and heat[2, 0, 7, 12] > 0 and heat[2, 0, 8, 11] == 0  # radius 1 (floor of 1.9)


def test_focal_loss_edge_cases():
    target = torch.zeros(1, 1, 16, 16)
    pred = torch.full((1, 1, 16, 16), 0.01)
    loss = focal_loss(pred, target)  # no positive at all: normalised by max(1, 0)
    assert torch.isfinite(loss) and loss > 0
    target[0, 0, 4, 4] = 1
    perfect = torch.full((1, 1, 16, 16), 1e-4)
    perfect[0, 0, 4, 4] = 1 - 1e-4
    assert focal_loss(perfect, target) < 1e-3
    assert focal_loss(pred, target) > focal_loss(perfect, target)


def test_tracking_loss_is_zero_box_error_for_an_exact_prediction():
    gt = torch.tensor([[0.30, 0.40, 0.50, 0.70]])  # centre (0.4, 0.55) → cell (6, 8), offset (0.4, 0.8)
    score, size, offset = _maps(1)
    score[0, 0, 8, 6] = 0.99
    size[0, :, 8, 6] = torch.tensor([0.2, 0.3])
    offset[0, :, 8, 6] = torch.tensor([0.4, 0.8])
    loss, stats = tracking_loss({"score": score, "size": size, "offset": offset}, gt)
    assert stats["giou"] < 1e-5 and stats["l1"] < 1e-6 and stats["iou"] > 0.9999
    torch.testing.assert_close(loss, stats["focal"] + 2 * stats["giou"] + 5 * stats["l1"])


def test_loss_gradient_reaches_every_head_parameter():
    head = CenterHead(16, 32)
    out = head(torch.randn(3, 16, 16, 16))
    loss, _ = tracking_loss(out, torch.tensor([[0.1, 0.2, 0.5, 0.6]] * 3))
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in head.parameters())
