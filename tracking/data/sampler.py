"""Training pairs: a template frame and a later search frame of one video, cropped and augmented.

Sampling (OSTrack's causal mode, with a strict gap): pick a dataset by its ratio, a video with at least two
visible frames, a template frame among the visible frames that have another visible frame at most ``max_gap``
frames later, and a search frame uniformly among the visible frames in ``(t, t + max_gap]``. The template is cropped
at ``template_factor`` × the box (no jitter) to ``template_size``; the search frame at ``search_factor`` × a
jittered box (centre jitter 3, scale jitter 0.25) to ``search_size``. A pair whose target centre falls outside the
search crop is drawn again.

Every item is a deterministic function of (seed, epoch, index), so training resumes reproducibly.
"""

from __future__ import annotations

import cv2
import numpy as np
import torch
from torch.utils.data import Dataset

from .base import Sequence
from .processing import crop_image, crop_transform, jitter_box
from .transforms import PairAugmentation, to_tensor


def load_rgb(path: str) -> np.ndarray:
    image = cv2.imread(path, cv2.IMREAD_COLOR)
    if image is None:
        raise OSError(f"could not read image {path}")
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


class PairDataset(Dataset):
    def __init__(
        self,
        datasets: list,
        ratios: list[float] | None = None,
        pairs_per_epoch: int = 60000,
        max_gap: int = 200,
        template_size: int = 128,
        search_size: int = 256,
        template_factor: float = 2.0,
        search_factor: float = 4.0,
        center_jitter: float = 3.0,
        scale_jitter: float = 0.25,
        grayscale_prob: float = 0.05,
        flip_prob: float = 0.5,
        brightness: tuple[float, float] = (0.8, 1.2),
        seed: int = 0,
        max_tries: int = 100,
    ):
        if not datasets:
            raise ValueError("datasets must not be empty")
        ratios = [1.0] * len(datasets) if ratios is None else list(ratios)
        if len(ratios) != len(datasets) or any(r < 0 for r in ratios) or sum(ratios) <= 0:
            raise ValueError(f"ratios must be {len(datasets)} non-negative numbers with a positive sum, got {ratios}")
        if max_gap < 1:
            raise ValueError(f"max_gap must be ≥ 1, got {max_gap}")
        self.datasets = datasets
        self.probs = np.asarray(ratios, dtype=np.float64) / sum(ratios)
        self.pairs_per_epoch = int(pairs_per_epoch)
        self.max_gap = int(max_gap)
        self.template_size, self.search_size = int(template_size), int(search_size)
        self.template_factor, self.search_factor = float(template_factor), float(search_factor)
        self.center_jitter, self.scale_jitter = float(center_jitter), float(scale_jitter)
        self.augment = PairAugmentation(grayscale_prob, flip_prob, brightness)
        self.seed = int(seed)
        self.epoch = 0
        self.max_tries = int(max_tries)

    def set_epoch(self, epoch: int):
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.pairs_per_epoch

    def sample_frames(self, seq: Sequence, rng: np.random.Generator) -> tuple[int, int] | None:
        """(template id, search id) with both visible and ``0 < search - template ≤ max_gap``, or None."""
        vis = seq.visible_ids
        if len(vis) < 2:
            return None
        eligible = vis[:-1][np.diff(vis) <= self.max_gap]
        if len(eligible) == 0:
            return None
        t = int(rng.choice(eligible))
        lo, hi = np.searchsorted(vis, t, side="right"), np.searchsorted(vis, t + self.max_gap, side="right")
        return t, int(rng.choice(vis[lo:hi]))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.epoch, int(index)])
        for _ in range(self.max_tries):
            dataset = self.datasets[int(rng.choice(len(self.datasets), p=self.probs))]
            seq = dataset[int(rng.integers(len(dataset)))]
            ids = self.sample_frames(seq, rng)
            if ids is None:
                continue
            item = self._make_pair(seq, ids, rng)
            if item is not None:
                return item
        raise RuntimeError(f"no valid training pair after {self.max_tries} tries: do the datasets have visible frames?")

    def _make_pair(self, seq: Sequence, ids: tuple[int, int], rng: np.random.Generator):
        t_id, s_id = ids
        template, search = load_rgb(seq.frames[t_id]), load_rgb(seq.frames[s_id])
        t_box, s_box = seq.boxes[t_id].copy(), seq.boxes[s_id].copy()
        template, search, t_box, s_box = self.augment.frames(template, search, t_box, s_box, int(rng.integers(2**31)))
        t_tf = crop_transform(t_box, self.template_factor, self.template_size)
        jittered = jitter_box(s_box, self.center_jitter, self.scale_jitter, rng)
        if not np.isfinite(jittered).all() or (jittered[2:] <= 0).any():
            return None
        s_tf = crop_transform(jittered, self.search_factor, self.search_size)
        box_in_crop = s_tf.box_to_crop(s_box) / self.search_size
        centre = box_in_crop[:2] + box_in_crop[2:] / 2
        if not ((centre >= 0) & (centre < 1)).all():
            return None
        t_crop, _ = crop_image(template, t_tf)
        s_crop, s_pad = crop_image(search, s_tf)
        if s_pad.all():
            return None
        t_crop = self.augment.crop(t_crop, int(rng.integers(2**31)))
        s_crop = self.augment.crop(s_crop, int(rng.integers(2**31)))
        xyxy = np.concatenate([box_in_crop[:2], box_in_crop[:2] + box_in_crop[2:]])
        return {
            "template": to_tensor(t_crop),
            "search": to_tensor(s_crop),
            "search_box": torch.from_numpy(xyxy.astype(np.float32)),
        }
