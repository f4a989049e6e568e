"""Square crops around a box, the box mapping into and out of a crop, and box jitter.

Coordinates are continuous: pixel ``i`` covers ``[i, i + 1)``. A crop of ``factor`` times the box's geometric mean
side, centred on the box, is resized to ``out_size`` with one affine map ``v = (u - origin) * scale``; regions outside
the image are zero (OSTrack's constant padding) and reported in a padding mask. Because the same affine map is used
to warp pixels, to map boxes into the crop and (inverted) to map predictions back, the round trip is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np


@dataclass(frozen=True)
class CropTransform:
    """The affine map image → crop: ``crop = (image - origin) * scale`` on both axes."""

    origin_x: float
    origin_y: float
    scale: float
    out_size: int

    def box_to_crop(self, box: np.ndarray) -> np.ndarray:
        """(x, y, w, h) in image pixels → (x, y, w, h) in crop pixels."""
        box = np.asarray(box, dtype=np.float64)
        out = box.copy()
        out[..., 0] = (box[..., 0] - self.origin_x) * self.scale
        out[..., 1] = (box[..., 1] - self.origin_y) * self.scale
        out[..., 2:] = box[..., 2:] * self.scale
        return out

    def box_to_image(self, box: np.ndarray) -> np.ndarray:
        """(x, y, w, h) in crop pixels → (x, y, w, h) in image pixels."""
        box = np.asarray(box, dtype=np.float64)
        out = box.copy()
        out[..., 0] = box[..., 0] / self.scale + self.origin_x
        out[..., 1] = box[..., 1] / self.scale + self.origin_y
        out[..., 2:] = box[..., 2:] / self.scale
        return out


def crop_side(box: np.ndarray, factor: float) -> float:
    """Side of the square search/template region: ``factor * sqrt(w * h)`` (OSTrack's ``sample_target``)."""
    w, h = float(box[2]), float(box[3])
    if not (np.isfinite(w) and np.isfinite(h)) or w <= 0 or h <= 0:
        raise ValueError(f"box must have positive finite width and height, got {box}")
    return float(np.sqrt(w * h) * factor)


def crop_transform(box: np.ndarray, factor: float, out_size: int) -> CropTransform:
    """The crop of ``factor`` × the box's mean side centred on the box, resized to ``out_size``."""
    side = crop_side(box, factor)
    cx, cy = box[0] + box[2] / 2, box[1] + box[3] / 2
    return CropTransform(cx - side / 2, cy - side / 2, out_size / side, int(out_size))


def crop_image(image: np.ndarray, transform: CropTransform) -> tuple[np.ndarray, np.ndarray]:
    """Warp ``image`` (H, W, C) into the crop; returns the crop (S, S, C) and its padding mask (S, S, True = pad)."""
    s, ox, oy, size = transform.scale, transform.origin_x, transform.origin_y, transform.out_size
    # cv2 addresses pixel centres at integer coordinates: crop index j ↔ image index (j + 0.5) / s + o - 0.5.
    inverse = np.array([[1 / s, 0, 0.5 / s + ox - 0.5], [0, 1 / s, 0.5 / s + oy - 0.5]], dtype=np.float64)
    interpolation = cv2.INTER_AREA if s < 1 else cv2.INTER_LINEAR
    if interpolation == cv2.INTER_AREA:
        # warpAffine has no area filter; pre-shrink the region that maps into the crop, then warp the rest.
        return _crop_downscaled(image, transform)
    crop = cv2.warpAffine(
        image, inverse, (size, size), flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
        borderMode=cv2.BORDER_CONSTANT, borderValue=0,
    )
    return crop, _padding_mask(image.shape[1], image.shape[0], transform)


def _crop_downscaled(image: np.ndarray, transform: CropTransform) -> tuple[np.ndarray, np.ndarray]:
    # Shrink the whole image by an integer-free factor close to the crop's scale with area averaging, then
    # warp that smaller image with the (re-expressed) transform. Keeps aliasing low for big crops.
    h, w = image.shape[:2]
    s = transform.scale
    small_w, small_h = max(1, int(round(w * s))), max(1, int(round(h * s)))
    small = cv2.resize(image, (small_w, small_h), interpolation=cv2.INTER_AREA)
    sx, sy = small_w / w, small_h / h
    # In the small image, u' = u * sx; crop v = (u - o) * s = (u' / sx - o) * s.
    inverse = np.array(
        [[sx / s, 0, sx * transform.origin_x + 0.5 * sx / s - 0.5],
         [0, sy / s, sy * transform.origin_y + 0.5 * sy / s - 0.5]],
        dtype=np.float64,
    )
    size = transform.out_size
    crop = cv2.warpAffine(
        small, inverse, (size, size), flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
        borderMode=cv2.BORDER_CONSTANT, borderValue=0,
    )
    return crop, _padding_mask(w, h, transform)


def _padding_mask(width: int, height: int, transform: CropTransform) -> np.ndarray:
    centres = (np.arange(transform.out_size) + 0.5) / transform.scale
    xs = centres + transform.origin_x
    ys = centres + transform.origin_y
    outside_x = (xs < 0) | (xs >= width)
    outside_y = (ys < 0) | (ys >= height)
    return outside_y[:, None] | outside_x[None, :]


def jitter_box(
    box: np.ndarray, center_jitter: float, scale_jitter: float, rng: np.random.Generator
) -> np.ndarray:
    """OSTrack's jitter: ``wh·exp(N(0,1)·scale_jitter)``, centre moved by ``sqrt(w'h')·center_jitter·U(-0.5, 0.5)``."""
    box = np.asarray(box, dtype=np.float64)
    wh = box[2:] * np.exp(rng.standard_normal(2) * scale_jitter)
    max_offset = np.sqrt(wh.prod()) * center_jitter
    centre = box[:2] + box[2:] / 2 + max_offset * (rng.uniform(size=2) - 0.5)
    return np.concatenate([centre - wh / 2, wh])


def clip_box(box: np.ndarray, width: int, height: int, margin: float = 10.0) -> np.ndarray:
    """Keep a tracker's (x, y, w, h) inside the image with at least ``margin`` pixels of width and height.

    Follows OSTrack's ``clip_box``: the left/top edge stays within ``[0, size - margin]``, the right/bottom edge
    within ``[margin, size]``; degenerate results are widened to ``margin``.
    """
    margin = min(margin, width, height)
    x1, y1 = box[0], box[1]
    x2, y2 = box[0] + box[2], box[1] + box[3]
    x1 = min(max(0.0, x1), width - margin)
    x2 = min(max(margin, x2), width)
    y1 = min(max(0.0, y1), height - margin)
    y2 = min(max(margin, y2), height)
    w = max(margin, x2 - x1)
    h = max(margin, y2 - y1)
    return np.array([x1, y1, w, h], dtype=np.float64)
