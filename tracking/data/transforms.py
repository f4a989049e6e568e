"""Training augmentation with albumentations, as in OSTrack.

Joint (one draw for the template and the search frame, on the full frames): grayscale with probability 0.05 and a
horizontal flip with probability 0.5. Per crop: brightness × U[0.8, 1.2]. Boxes are flipped here (``x → W − x − w``
in continuous coordinates), using albumentations' record of which transforms it applied.
"""

from __future__ import annotations

import os

import numpy as np

# albumentations checks PyPI for a newer version when imported; training machines are often offline.
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
import albumentations as A  # noqa: E402

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


class PairAugmentation:
    def __init__(
        self, grayscale_prob: float = 0.05, flip_prob: float = 0.5, brightness: tuple[float, float] = (0.8, 1.2)
    ):
        if not 0 <= grayscale_prob <= 1 or not 0 <= flip_prob <= 1:
            raise ValueError("grayscale_prob and flip_prob must be probabilities")
        self.joint = A.Compose(
            [A.ToGray(p=grayscale_prob), A.HorizontalFlip(p=flip_prob)],
            additional_targets={"image2": "image"},
            save_applied_params=True,
        )
        self.per_crop = A.ColorJitter(brightness=tuple(brightness), contrast=0, saturation=0, hue=0, p=1.0)

    def frames(
        self, template: np.ndarray, search: np.ndarray, template_box: np.ndarray, search_box: np.ndarray, seed: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Joint augmentation of the two full frames (RGB uint8) and their (x, y, w, h) boxes."""
        self.joint.set_random_seed(seed)
        if template.shape != search.shape:
            # albumentations' shared targets must have one shape; apply the same draw to each frame separately.
            a = self.joint(image=template, image2=template)
            self.joint.set_random_seed(seed)
            b = self.joint(image=search, image2=search)
            out_t, out_s, applied = a["image"], b["image"], a["applied_transforms"]
        else:
            r = self.joint(image=template, image2=search)
            out_t, out_s, applied = r["image"], r["image2"], r["applied_transforms"]
        if any(name == "HorizontalFlip" for name, _ in applied):
            template_box = _flip_box(template_box, template.shape[1])
            search_box = _flip_box(search_box, search.shape[1])
        return out_t, out_s, template_box, search_box

    def crop(self, crop: np.ndarray, seed: int) -> np.ndarray:
        self.per_crop.set_random_seed(seed)
        return self.per_crop(image=crop)["image"]


def _flip_box(box: np.ndarray, width: int) -> np.ndarray:
    box = np.asarray(box, dtype=np.float64).copy()
    box[0] = width - box[0] - box[2]
    return box


def to_tensor(crop: np.ndarray):
    """RGB uint8 (H, W, 3) → ImageNet-normalised float32 (3, H, W) torch tensor."""
    import torch

    x = (crop.astype(np.float32) / 255.0 - IMAGENET_MEAN) / IMAGENET_STD
    return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))
