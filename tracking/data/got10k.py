"""GOT-10k in its official layout.

::

    <root>/train|val|test/list.txt
    <root>/<split>/<seq>/00000001.jpg ...  groundtruth.txt  absence.label  cover.label  cut_by_image.label
    <root>/<split>/<seq>/meta_info.ini

``test`` sequences carry only the first frame's box and no labels. A frame is visible when it is not marked absent,
its cover (visible fraction in eighths) is above 0 and its box is valid (OSTrack's rule).
"""

from __future__ import annotations

import ast
import glob
import os

import numpy as np

from visionssm.utils.cli import UserFileError, UserValueError

from .base import Sequence, SequenceDataset, read_boxes, read_flags, valid_box_mask

SPLITS = ("train", "val", "test")


def read_meta_info(path: str) -> dict:
    """``meta_info.ini``: a ``[METAINFO]`` header then ``key: value`` lines. ``resolution`` is parsed to (W, H)."""
    meta = {}
    with open(path) as f:
        for line in f.read().strip().splitlines()[1:]:
            if ": " in line:
                key, value = line.split(": ", 1)
                meta[key.strip()] = value.strip()
    if "resolution" in meta:
        meta["resolution"] = tuple(int(v) for v in ast.literal_eval(meta["resolution"]))
    return meta


class Got10k(SequenceDataset):
    """The sequences of one GOT-10k split; ``dataset[i]`` loads (and caches) one :class:`Sequence`."""

    name = "got10k"
    label = "GOT-10k"

    def __init__(self, root: str, split: str = "train", seq_names: list[str] | None = None):
        if split not in SPLITS:
            raise UserValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.root = root
        self.split = split
        self.split_dir = os.path.join(root, split)
        list_file = os.path.join(self.split_dir, "list.txt")
        if not os.path.isfile(list_file):
            raise UserFileError(f"GOT-10k: {list_file} not found (expected <root>/{split}/list.txt)")
        with open(list_file) as f:
            names = [line.strip() for line in f if line.strip()]
        self._set_sequences(names, seq_names, "list.txt")

    def _load_uncached(self, index: int) -> Sequence:
        name = self.seq_names[index]
        seq_dir = os.path.join(self.split_dir, name)
        groundtruth = os.path.join(seq_dir, "groundtruth.txt")
        boxes = read_boxes(groundtruth)
        frames = sorted(glob.glob(os.path.join(seq_dir, "*.jpg")))
        if not frames:
            raise UserFileError(f"GOT-10k: no frames in {seq_dir}")
        meta = {"groundtruth": groundtruth}
        meta_file = os.path.join(seq_dir, "meta_info.ini")
        if os.path.isfile(meta_file):
            meta.update(read_meta_info(meta_file))
        if self.split == "test":
            # Only the first frame is annotated; the other frames are unknown, not absent.
            first = boxes[:1]
            boxes = np.full((len(frames), 4), np.nan)
            boxes[0] = first[0]
            visible = np.zeros(len(frames), dtype=bool)
            visible[0] = True
            return Sequence(name, frames, boxes, visible, self.name, meta)
        if len(boxes) != len(frames):
            raise UserValueError(f"GOT-10k {name}: {len(frames)} frames but {len(boxes)} boxes")
        visible = valid_box_mask(boxes)
        for label in ("absence", "cover", "cut_by_image"):
            path = os.path.join(seq_dir, f"{label}.label")
            if os.path.isfile(path):
                flags = read_flags(path)
                if len(flags) != len(frames):
                    raise UserValueError(f"GOT-10k {name}: {label}.label has {len(flags)} entries for "
                                         f"{len(frames)} frames")
                meta[label] = flags
        if "absence" in meta:
            visible &= meta["absence"] == 0
        if "cover" in meta:
            visible &= meta["cover"] > 0
        return Sequence(name, frames, boxes, visible, self.name, meta)
