"""LaSOT in its official layout.

::

    <root>/training_set.txt  testing_set.txt          (one sequence name per line, e.g. ``airplane-1``)
    <root>/<category>/<category>-<n>/img/00000001.jpg ...
    <root>/<category>/<category>-<n>/groundtruth.txt  full_occlusion.txt  out_of_view.txt  nlp.txt

A frame is visible when it is neither fully occluded nor out of view and its box is valid (OSTrack's rule).
Split ``test`` is the 280-sequence protocol-II list (``testing_set.txt``), ``train`` the rest (``training_set.txt``
when present), ``all`` every sequence found.
"""

from __future__ import annotations

import glob
import os

import numpy as np

from visionssm.utils.cli import UserFileError, UserValueError

from .base import Sequence, SequenceDataset, read_boxes, read_flags, valid_box_mask

SPLITS = ("train", "test", "all")


def _read_list(path: str) -> list[str]:
    with open(path) as f:
        return [line.strip() for line in f if line.strip()]


class LaSOT(SequenceDataset):
    """The sequences of one LaSOT split; ``dataset[i]`` loads (and caches) one :class:`Sequence`."""

    name = "lasot"
    label = "LaSOT"

    def __init__(self, root: str, split: str = "train", seq_names: list[str] | None = None):
        if split not in SPLITS:
            raise UserValueError(f"split must be one of {SPLITS}, got {split!r}")
        if not os.path.isdir(root):
            raise UserFileError(f"LaSOT: root {root} not found")
        self.root = root
        self.split = split
        found = sorted(
            os.path.basename(d) for d in glob.glob(os.path.join(root, "*", "*-*")) if os.path.isdir(d)
        )
        test_file = os.path.join(root, "testing_set.txt")
        train_file = os.path.join(root, "training_set.txt")
        if split == "all":
            names = found
        elif split == "test":
            if not os.path.isfile(test_file):
                raise UserFileError(f"LaSOT: {test_file} not found (needed for split='test')")
            names = _read_list(test_file)
        elif os.path.isfile(train_file):
            names = _read_list(train_file)
        else:
            test = set(_read_list(test_file)) if os.path.isfile(test_file) else set()
            names = [n for n in found if n not in test]
        self._set_sequences(names, seq_names, "the split")

    def seq_dir(self, name: str) -> str:
        category = name.rsplit("-", 1)[0]
        return os.path.join(self.root, category, name)

    def _load_uncached(self, index: int) -> Sequence:
        name = self.seq_names[index]
        seq_dir = self.seq_dir(name)
        groundtruth = os.path.join(seq_dir, "groundtruth.txt")
        boxes = read_boxes(groundtruth)
        frames = sorted(glob.glob(os.path.join(seq_dir, "img", "*.jpg")))
        if not frames:
            raise UserFileError(f"LaSOT: no frames in {seq_dir}/img")
        if len(frames) < len(boxes):
            raise UserValueError(f"LaSOT {name}: {len(frames)} frames but {len(boxes)} boxes")
        frames = frames[: len(boxes)]
        meta = {"category": name.rsplit("-", 1)[0], "groundtruth": groundtruth}
        flags = {}
        for label in ("full_occlusion", "out_of_view"):
            path = os.path.join(seq_dir, f"{label}.txt")
            if os.path.isfile(path):
                values = read_flags(path)
                if len(values) != len(boxes):
                    raise UserValueError(f"LaSOT {name}: {label}.txt has {len(values)} flags for {len(boxes)} frames")
                flags[label] = values.astype(bool)
            else:
                flags[label] = np.zeros(len(boxes), dtype=bool)
        meta.update(flags)
        nlp = os.path.join(seq_dir, "nlp.txt")
        if os.path.isfile(nlp):
            with open(nlp) as f:
                meta["nlp"] = f.read().strip()
        visible = valid_box_mask(boxes) & ~flags["full_occlusion"] & ~flags["out_of_view"]
        return Sequence(name, frames, boxes, visible, self.name, meta)
