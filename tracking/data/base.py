"""What every tracking dataset returns: a sequence of frames with one box and one visibility flag per frame."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import numpy as np

from visionssm.utils.cli import UserValueError


@dataclass
class Sequence:
    """One video with its annotation.

    Boxes are ``(x, y, w, h)`` in pixels, continuous coordinates (pixel ``i`` covers ``[i, i+1)``), as the
    benchmarks' ``groundtruth.txt`` files store them. ``visible[t]`` is False where the target is absent, fully
    occluded, out of view or its box is not a valid box; such frames are never used as a template or search
    frame in training, and the evaluators apply their own rules to them.
    """

    name: str
    frames: list[str]
    boxes: np.ndarray
    visible: np.ndarray
    dataset: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.boxes = np.asarray(self.boxes, dtype=np.float64).reshape(-1, 4)
        self.visible = np.asarray(self.visible, dtype=bool).reshape(-1)
        if len(self.visible) != len(self.boxes):
            raise UserValueError(f"sequence {self.name}: {len(self.boxes)} boxes but {len(self.visible)} visibility "
                                 "flags")

    def __len__(self) -> int:
        return len(self.frames)

    @cached_property
    def visible_ids(self) -> np.ndarray:
        return np.flatnonzero(self.visible)


class SequenceDataset:
    """The sequences of one split of a benchmark: ``dataset[i]`` or ``dataset[name]`` loads (and caches) one
    :class:`Sequence`. Subclasses list the split's names and pass them to :meth:`_set_sequences`, and implement
    ``_load_uncached(index)``."""

    name = ""  # short id used in file names and configs
    label = ""  # the benchmark's own spelling, for messages
    split = ""
    seq_names: list[str]

    def _set_sequences(self, names: list[str], seq_names: list[str] | None, where: str) -> None:
        """Keep the split's ``names``, or the caller's subset ``seq_names`` of them (an error names the strays)."""
        if seq_names is not None:
            unknown = sorted(set(seq_names) - set(names))
            if unknown:
                raise UserValueError(f"{self.label} {self.split}: sequences not in {where}: {unknown[:5]}")
            names = list(seq_names)
        self.seq_names = names
        self._load = lru_cache(maxsize=4096)(self._load_uncached)

    def _load_uncached(self, index: int) -> Sequence:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.seq_names)

    def __getitem__(self, index: int | str) -> Sequence:
        if isinstance(index, str):
            index = self.seq_names.index(index)
        return self._load(index)

    def __iter__(self) -> Iterator[Sequence]:
        for i in range(len(self)):
            yield self[i]


def valid_box_mask(boxes: np.ndarray) -> np.ndarray:
    """Frames whose box is finite with positive width and height."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    finite = np.isfinite(boxes).all(axis=1)
    with np.errstate(invalid="ignore"):
        return finite & (boxes[:, 2] > 0) & (boxes[:, 3] > 0)


def read_boxes(path: str) -> np.ndarray:
    """Read an ``x,y,w,h`` per line file (comma, tab or space separated; ``NaN`` allowed) as an (N, 4) array."""
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            parts = line.replace("\t", ",").replace(" ", ",").split(",")
            parts = [p for p in parts if p != ""]
            if len(parts) != 4:
                raise UserValueError(f"{path}:{line_no}: expected 4 numbers (x,y,w,h), got {line!r}")
            rows.append([float(p) for p in parts])
    return np.asarray(rows, dtype=np.float64).reshape(-1, 4)


def read_flags(path: str) -> np.ndarray:
    """Read per-frame integer flags stored one per line (GOT-10k labels) or on one comma-separated line (LaSOT)."""
    with open(path) as f:
        text = f.read()
    tokens = [t for t in text.replace(",", " ").split() if t]
    return np.asarray([int(float(t)) for t in tokens], dtype=np.int64)
