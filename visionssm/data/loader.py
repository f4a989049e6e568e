"""ImageFolder data for training: unreadable images are skipped and counted, missing or empty splits fail clearly.

``SafeImageFolder`` reads the standard layout (``split/<class>/<image>``). An image that cannot be decoded is
reported once with a warning and then either replaced by the next readable image (training: the batch keeps its
size, which Mixup/CutMix need) or dropped from the batch (evaluation: every image counts once). Each sample carries
the number of unreadable files it stands for, so the count reaches the training loop through the DataLoader
workers (``collate_skipping``), where it is summed over processes and written to the metrics.

With ``augment_seed`` set, each image's random augmentation is drawn from its own generator state, seeded by
``(augment_seed, epoch, index)``, and the global RNGs are left as they were. Augmentation then does not depend on the
number of workers or processes, on what else consumed random numbers, or on where a resumed run restarted.
"""

from __future__ import annotations

import contextlib
import os
import random
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Sampler, default_collate
from torchvision.datasets.folder import IMG_EXTENSIONS, DatasetFolder

from visionssm.utils.cli import UserFileError, UserValueError

__all__ = ["EpochShuffleSampler", "SafeImageFolder", "ShardSampler", "augment_seed_of", "build_split",
           "collate_skipping", "patch_timm_posterize"]

# What a broken or truncated file raises while PIL decodes it.
_DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)


def _load_rgb(path: str) -> Image.Image:
    with open(path, "rb") as f:
        image = Image.open(f)
        return image.convert("RGB")  # forces the full decode, so truncation surfaces here


class SafeImageFolder(DatasetFolder):
    """An ImageFolder whose unreadable images are skipped with a warning instead of stopping training.

    Args:
        root: the split directory (``root/<class>/<image>``).
        transform: applied to the decoded RGB PIL image.
        on_error: ``"replace"`` returns the next readable image (and its label) in place of a broken one;
            ``"drop"`` returns ``None`` as the image so ``collate_skipping`` leaves it out.
        class_to_idx: fix the label mapping (the val split must use the train split's).
        augment_seed: if set, the transform of item ``i`` in epoch ``e`` runs with the RNGs (``random``, NumPy,
            torch CPU) seeded from ``(augment_seed, e, i)``; ``e`` is the index's epoch tag if it has one
            (``dataset[(e, i)]``), else the one given to ``set_epoch``.

    Each item is ``(image, target, n_unreadable)``.
    """

    def __init__(self, root: str | os.PathLike, transform: Callable | None = None, on_error: str = "replace",
                 class_to_idx: dict[str, int] | None = None, augment_seed: int | None = None):
        if on_error not in ("replace", "drop"):
            raise ValueError(f"on_error must be 'replace' or 'drop', got {on_error!r}")
        self._fixed_class_to_idx = class_to_idx
        super().__init__(str(root), loader=_load_rgb, extensions=IMG_EXTENSIONS, transform=transform)
        self.on_error = on_error
        self.augment_seed = augment_seed
        self.epoch = 0
        self._reported: set[int] = set()  # per worker process: warn once per file

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's augmentation draws (call before creating the epoch's DataLoader iterator)."""
        self.epoch = epoch

    def find_classes(self, directory):
        if self._fixed_class_to_idx is None:
            return super().find_classes(directory)
        found = sorted(e.name for e in os.scandir(directory) if e.is_dir())
        unknown = sorted(set(found) - set(self._fixed_class_to_idx))
        if unknown:
            raise UserValueError(f"{directory} has class folders the training split does not have: {unknown[:5]}")
        return sorted(self._fixed_class_to_idx, key=self._fixed_class_to_idx.get), dict(self._fixed_class_to_idx)

    def _try_load(self, index: int):
        path, target = self.samples[index]
        try:
            image = self.loader(path)
        except _DECODE_ERRORS as e:
            if index not in self._reported:
                self._reported.add(index)
                warnings.warn(f"skipping unreadable image {path}: {type(e).__name__}: {e}", RuntimeWarning,
                              stacklevel=2)
            return None, target
        return image, target

    def __getitem__(self, index: int | tuple[int, int]):
        epoch = self.epoch
        if isinstance(index, tuple):  # (epoch, index) from EpochShuffleSampler(tag_epoch=True)
            epoch, index = index
        if self.augment_seed is None:
            return self._get(index)
        with _private_rng(augment_seed_of(self.augment_seed, epoch, index)):
            return self._get(index)

    def _get(self, index: int):
        n = len(self.samples)
        unreadable = 0
        for attempt in range(n):
            image, target = self._try_load((index + attempt) % n)
            if image is not None:
                break
            unreadable += 1
            if self.on_error == "drop":
                return None, target, unreadable
        else:
            raise RuntimeError(f"no image under {self.root} could be read")
        if self.transform is not None:
            image = self.transform(image)
        return image, target, unreadable


def augment_seed_of(seed: int, epoch: int, index: int) -> int:
    """The seed of item ``index``'s augmentation in ``epoch`` (both data backends draw from it)."""
    return ((seed * 1_000_003 + epoch) * 10_000_019 + index) % 2**63


@contextlib.contextmanager
def _private_rng(seed: int):
    """Run the block with ``random``, NumPy and torch (CPU) seeded from ``seed``; restore their states after."""
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def collate_skipping(batch: Sequence[tuple]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stack ``(image, target, n_unreadable)`` items, leaving out dropped ones; returns the unreadable count too."""
    unreadable = torch.tensor(sum(item[2] for item in batch), dtype=torch.long)
    kept = [(item[0], item[1]) for item in batch if item[0] is not None]
    if not kept:
        return torch.empty(0), torch.empty(0, dtype=torch.long), unreadable
    images, targets = default_collate(kept)
    return images, targets, unreadable


def split_root(data_dir: str | os.PathLike, split: str) -> Path:
    """The ``split`` folder of ``data_dir``; a :class:`UserFileError` naming what is missing if it is not there."""
    root = Path(data_dir) / split
    if not Path(data_dir).is_dir():
        raise UserFileError(f"data directory {data_dir} does not exist")
    if not root.is_dir():
        present = sorted(p.name for p in Path(data_dir).iterdir() if p.is_dir())
        raise UserFileError(f"split {split!r} not found: {root} is not a directory "
                            f"(subdirectories of {data_dir}: {present})")
    return root


def build_split(data_dir: str | os.PathLike, split: str, transform: Callable | None, on_error: str,
                class_to_idx: dict[str, int] | None = None, augment_seed: int | None = None,
                encoded: bool = False) -> SafeImageFolder:
    """The ``split`` folder of ``data_dir`` as a ``SafeImageFolder`` (``encoded``: its bytes-reading subclass for
    the gpu data backend), or a clear error if it is missing or empty."""
    root = split_root(data_dir, split)
    folder = SafeImageFolder
    if encoded:
        from visionssm.data.gpu import EncodedImageFolder  # it builds on this module

        folder = EncodedImageFolder
    try:
        return folder(root, transform=transform, on_error=on_error, class_to_idx=class_to_idx,
                      augment_seed=augment_seed)
    except FileNotFoundError as e:  # torchvision: no class folder, or no image with a known extension
        raise UserFileError(f"split {split!r} at {root} is empty: expected {root}/<class>/<image> files with "
                            f"one of the extensions {', '.join(IMG_EXTENSIONS)} ({e})") from None


class EpochShuffleSampler(Sampler):
    """A shuffle that depends only on ``(seed, epoch)``: the same order on every process and after a resume.

    With ``tag_epoch`` it yields ``(epoch, index)`` pairs, which ``SafeImageFolder`` reads as "item ``index`` with
    epoch ``epoch``'s augmentation draws": the epoch then travels with each index, so DataLoader workers can be
    persistent (forking a dozen workers from a process holding a CUDA context costs seconds every epoch).
    """

    def __init__(self, length: int, seed: int, tag_epoch: bool = False):
        self.length = length
        self.seed = seed
        self.tag_epoch = tag_epoch
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int] | Iterator[tuple[int, int]]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.length, generator=generator).tolist()
        return iter([(self.epoch, i) for i in order] if self.tag_epoch else order)

    def __len__(self) -> int:
        return self.length


class ShardSampler(Sampler[int]):
    """Evaluation sharding without padding: process ``rank`` reads items ``rank, rank + world, ...``.

    Unlike ``DistributedSampler`` nothing is duplicated, so counts summed over processes are exact.
    """

    def __init__(self, length: int, rank: int, world: int):
        self.indices = range(rank, length, world)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _posterize_allowing_zero_bits(img, bits_to_keep, **__):
    """timm's posterize, with 0 bits meaning a black image as Pillow < 12 did (Pillow >= 12 raises for it)."""
    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return img.point([0] * 256 * len(img.getbands()))
    from PIL import ImageOps

    return ImageOps.posterize(img, bits_to_keep)


def patch_timm_posterize() -> None:
    """Let timm's RandAugment ``inc1`` policies run under current Pillow.

    ``PosterizeIncreasing`` at magnitude 10 (reached by ``m9-mstd0.5`` noise) asks for 0 bits, which Pillow now
    rejects with ``ValueError`` in the middle of an epoch. Idempotent; a no-op when Pillow accepts 0 bits.
    """
    from PIL import ImageOps
    from timm.data import auto_augment

    try:
        ImageOps.posterize(Image.new("RGB", (1, 1)), 0)
        return
    except ValueError:
        pass
    for name in ("Posterize", "PosterizeIncreasing", "PosterizeOriginal"):
        if auto_augment.NAME_TO_OP.get(name) is auto_augment.posterize:
            auto_augment.NAME_TO_OP[name] = _posterize_allowing_zero_bits
