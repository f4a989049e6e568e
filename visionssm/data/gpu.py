"""The GPU-fed input pipeline (``--data-backend gpu``): loader workers read file bytes, the training process decodes
each batch with nvJPEG (``torchvision.io.decode_jpeg(..., device="cuda")``) and augments it batched on the GPU.

Training (:class:`TrainStage`): RandomResizedCrop + flip with timm's parameter draws, resize (antialiased, bilinear
or bicubic per image as timm's ``random``), RandAugment (:mod:`visionssm.data.gpu_augment`) and normalisation.
Random erasing and Mixup/CutMix run on the batch in the training step (timm's own, on the device). Every image's
draws come from a ``random.Random`` seeded by ``(seed, epoch, index)`` as the PIL path's ``augment_seed``, so they do
not depend on workers, processes or where a resumed run restarted. Evaluation (:class:`EvalStage`): timm's eval
transform (shorter side to ``img_size / crop_pct``, centre crop), batched.

A batch that nvJPEG refuses is decoded image by image; an unreadable file is warned about once (naming it) and
counted, then replaced by the next readable image in training and dropped in evaluation, as ``SafeImageFolder``
does. Files that are not JPEG (a PNG in an ImageFolder) are decoded on the CPU and moved. The stages take any
device: on ``cpu`` they run torchvision's CPU decoder, which is how the tests exercise them.
"""

from __future__ import annotations

import contextlib
import math
import queue
import random
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchvision.io import ImageReadMode, decode_image, decode_jpeg, encode_jpeg

from visionssm.data.gpu_augment import RandAugmentPolicy, apply_rand_augment, draw_rand_augment, parse_rand_augment
from visionssm.data.loader import SafeImageFolder, augment_seed_of
from visionssm.utils.cli import UserValueError

__all__ = ["BACKENDS", "EncodedBatch", "EncodedImageFolder", "EvalStage", "TrainStage", "collate_encoded",
           "decode_batch", "nvjpeg_problem", "random_resized_crop_params", "resolve_data_backend"]

BACKENDS = ("auto", "pil", "gpu")
_INTERPOLATIONS = ("bilinear", "bicubic", "nearest")


def nvjpeg_problem(device: torch.device) -> str | None:
    """Why ``decode_jpeg`` cannot decode on ``device`` (one line), or ``None`` when it can."""
    probe = encode_jpeg(torch.full((3, 8, 8), 128, dtype=torch.uint8))
    try:
        decode_jpeg([probe], mode=ImageReadMode.RGB, device=device)
    except (RuntimeError, ValueError, AssertionError) as error:
        return " ".join(str(error).split())[:200] or type(error).__name__
    return None


def resolve_data_backend(choice: str, device: torch.device, say: Callable[[str], None]) -> str:
    """``pil`` or ``gpu`` for ``--data-backend choice`` on ``device``: ``auto`` is gpu on a CUDA device; ``gpu``
    where CUDA or nvJPEG is missing falls back to pil with one line through ``say``."""
    if choice not in BACKENDS:
        raise UserValueError(f"--data-backend must be one of {', '.join(BACKENDS)}, got {choice!r}")
    if choice == "pil":
        return "pil"
    device = torch.device(device)
    if device.type != "cuda":
        if choice == "gpu":
            say(f"note: --data-backend gpu needs a CUDA device and this run is on {device}: decoding with PIL on "
                "the CPU instead")
        return "pil"
    problem = nvjpeg_problem(device)
    if problem is not None:
        say(f"note: --data-backend {choice}: torchvision cannot decode JPEG on {device} ({problem}): decoding with "
            "PIL on the CPU instead")
        return "pil"
    return "gpu"


# ----------------------------------------------------------------------------------------------------------------
# What the loader workers do: read bytes


class EncodedImageFolder(SafeImageFolder):
    """``SafeImageFolder``'s files and labels, each item the file's bytes: ``(uint8 tensor, target, epoch, index)``
    (``epoch`` from the sampler's tag, as ``SafeImageFolder`` reads it)."""

    def read(self, index: int) -> torch.Tensor:
        with open(self.samples[index][0], "rb") as f:
            data = f.read()
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)

    def __getitem__(self, index: int | tuple[int, int]):
        epoch = self.epoch
        if isinstance(index, tuple):
            epoch, index = index
        return self.read(index), self.samples[index][1], epoch, index


@dataclass
class EncodedBatch:
    """A batch of undecoded files, concatenated into one tensor (one shared-memory handle per batch from a worker,
    not one per file). No ``.to``: accelerate's device placement and pinning leave it on the CPU, where the decoder
    reads it."""

    blob: torch.Tensor
    sizes: list[int]
    targets: list[int]
    epochs: list[int]
    indices: list[int]

    @property
    def data(self) -> list[torch.Tensor]:
        """Each file's bytes (views of ``blob``)."""
        return list(torch.split(self.blob, self.sizes))

    def __len__(self) -> int:
        return len(self.sizes)


def collate_encoded(items: Sequence[tuple]) -> EncodedBatch:
    data, targets, epochs, indices = zip(*items) if items else ((), (), (), ())
    blob = torch.cat(data) if data else torch.empty(0, dtype=torch.uint8)
    return EncodedBatch(blob, [int(d.numel()) for d in data], list(targets), list(epochs), list(indices))


# ----------------------------------------------------------------------------------------------------------------
# Decoding


def _is_jpeg(data: torch.Tensor) -> bool:
    return data.numel() > 3 and int(data[0]) == 0xFF and int(data[1]) == 0xD8


def _decode_one(data: torch.Tensor, device: torch.device) -> torch.Tensor:
    if _is_jpeg(data):
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    return decode_image(data, mode=ImageReadMode.RGB).to(device)


def decode_batch(data: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor | Exception]:
    """Each file as a (3, H, W) uint8 RGB tensor on ``device``, or the exception that decoding it raised: the JPEGs
    in one batched call, the batch again one by one when that call fails, other formats on the CPU."""
    out: list[torch.Tensor | Exception] = [None] * len(data)  # type: ignore[list-item]
    jpegs = [i for i, d in enumerate(data) if _is_jpeg(d)]
    try:
        decoded = decode_jpeg([data[i] for i in jpegs], mode=ImageReadMode.RGB, device=device) if jpegs else []
    except RuntimeError:
        decoded = None  # which file broke the batch is known only one by one
    if decoded is not None:
        for i, image in zip(jpegs, decoded):
            out[i] = image
    for i, d in enumerate(data):
        if out[i] is None:
            try:
                out[i] = _decode_one(d, device)
            except (RuntimeError, ValueError) as error:
                out[i] = error
    return out


# ----------------------------------------------------------------------------------------------------------------
# Crops and resizing


def random_resized_crop_params(rng: random.Random, width: int, height: int, scale: Sequence[float],
                               ratio: Sequence[float]) -> tuple[int, int, int, int]:
    """timm's ``RandomResizedCropAndInterpolation.get_params``: ``(top, left, h, w)``, with ``rng`` for its
    ``random``."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = rng.uniform(*scale) * area
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if w <= width and h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _resize(image: torch.Tensor, size: tuple[int, int], interpolation: str) -> torch.Tensor:
    """(3, h, w) uint8 -> (3, *size) float, antialiased as PIL's resize (torch's filters follow Pillow's); rounded
    to uint8 by :func:`_to_uint8` once per batch."""
    x = image[None].float()
    if tuple(image.shape[-2:]) == tuple(size):
        return x[0]
    if interpolation == "nearest":
        return F.interpolate(x, size=size, mode="nearest-exact")[0]
    return F.interpolate(x, size=size, mode=interpolation, antialias=True, align_corners=False)[0]


def _to_uint8(images: torch.Tensor) -> torch.Tensor:
    return torch.floor(images + 0.5).clamp_(0, 255).to(torch.uint8)


def _normalize(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return (images.float() / 255.0 - mean) / std


def _check_interpolation(name: str, setting: str) -> str:
    if name not in _INTERPOLATIONS:
        raise UserValueError(f"{setting} {name!r}: the gpu data backend resizes with {', '.join(_INTERPOLATIONS)}; "
                             "use one of them or --data-backend pil")
    return name


# ----------------------------------------------------------------------------------------------------------------
# The stages


class _Stage:
    """Decodes and transforms the batches of a loader, optionally one batch ahead on a thread of its own (on CUDA,
    with its own stream, so decoding overlaps the training step)."""

    def __init__(self, dataset: EncodedImageFolder, device: torch.device, mean, std, prefetch: bool | None):
        self.dataset = dataset
        self.device = torch.device(device)
        self.mean = torch.tensor(mean, dtype=torch.float32, device=self.device)[None, :, None, None]
        self.std = torch.tensor(std, dtype=torch.float32, device=self.device)[None, :, None, None]
        self.prefetch = self.device.type == "cuda" if prefetch is None else prefetch
        self._reported: set[int] = set()

    def _warn(self, index: int, error: Exception) -> None:
        if index not in self._reported:
            self._reported.add(index)
            warnings.warn(f"skipping unreadable image {self.dataset.samples[index][0]}: {type(error).__name__}: "
                          f"{' '.join(str(error).split())[:200]}", RuntimeWarning, stacklevel=3)

    def process(self, batch: EncodedBatch):
        raise NotImplementedError

    def __call__(self, loader: Iterable[EncodedBatch]) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        if not self.prefetch:
            return (self.process(batch) for batch in loader)
        return self._prefetched(loader)

    def _prefetched(self, loader):
        results: queue.Queue = queue.Queue(maxsize=2)
        stop = threading.Event()
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

        def put(entry) -> bool:
            """Hand ``entry`` over unless the consumer has stopped (it may never take another)."""
            while not stop.is_set():
                try:
                    results.put(entry, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce():
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    for batch in loader:
                        item = self.process(batch)
                        event = None
                        if stream is not None:
                            event = torch.cuda.Event()
                            event.record(stream)
                        if not put((item, event)):
                            return
                put((None, None))
            except BaseException as error:  # handed to the consumer, which raises it
                put((error, None))

        worker = threading.Thread(target=produce, name="visionssm-gpu-stage", daemon=True)
        worker.start()
        try:
            while True:
                item, event = results.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                if event is not None:
                    current = torch.cuda.current_stream(self.device)
                    current.wait_event(event)
                    for tensor in item:
                        if tensor.is_cuda:
                            tensor.record_stream(current)  # made on the side stream, freed on this one
                yield item
        finally:
            stop.set()
            worker.join()


class TrainStage(_Stage):
    """Training batches: ``(images (N, 3, S, S) float32 normalised, targets (N,) int64, unreadable ())`` on
    ``device``; random erasing and Mixup/CutMix are the training step's."""

    def __init__(self, dataset: EncodedImageFolder, device, img_size: int, mean, std, *, seed: int,
                 scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), hflip: float = 0.5, interpolation: str = "random",
                 auto_augment: str | None = None, prefetch: bool | None = None):
        super().__init__(dataset, device, mean, std, prefetch)
        self.size = (img_size, img_size)
        self.seed, self.scale, self.ratio, self.hflip = seed, tuple(scale), tuple(ratio), hflip
        self.interpolation = interpolation if interpolation == "random" else _check_interpolation(
            interpolation, "--train-interpolation")
        fill = tuple(min(255, round(255 * m)) for m in mean)  # timm's img_mean for the geometric ops
        self.policy: RandAugmentPolicy | None = None
        if auto_augment:
            ra_interpolation = None if interpolation == "random" else self.interpolation
            self.policy = parse_rand_augment(auto_augment, fill, ra_interpolation)

    def draw(self, epoch: int, index: int, width: int, height: int) -> dict:
        """Image ``index``'s augmentation in epoch ``epoch``: crop, interpolation, flip, RandAugment ops."""
        rng = random.Random(augment_seed_of(self.seed, epoch, index))
        top, left, h, w = random_resized_crop_params(rng, width, height, self.scale, self.ratio)
        interpolation = self.interpolation
        if interpolation == "random":
            interpolation = ("bilinear", "bicubic")[rng.randrange(2)]
        flip = rng.random() < self.hflip
        ops = draw_rand_augment(self.policy, rng) if self.policy is not None else []
        return {"crop": (top, left, h, w), "interpolation": interpolation, "flip": flip, "ops": ops}

    def _replacement(self, index: int) -> tuple[torch.Tensor, int, int]:
        """The next readable image after a broken one (as ``SafeImageFolder(on_error='replace')``), its label and
        how many unreadable files were passed."""
        n = len(self.dataset)
        for attempt in range(1, n):
            candidate = (index + attempt) % n
            try:
                return _decode_one(self.dataset.read(candidate), self.device), self.dataset.samples[candidate][1], \
                    attempt - 1
            except (RuntimeError, ValueError) as error:
                self._warn(candidate, error)
        raise RuntimeError(f"no image under {self.dataset.root} could be read")

    def process(self, batch: EncodedBatch):
        return self.from_decoded(decode_batch(batch.data, self.device), batch)

    def from_decoded(self, decoded: Sequence[torch.Tensor | Exception], batch: EncodedBatch):
        """The training batch from ``batch``'s decoded images (:func:`decode_batch`'s list, on ``device``)."""
        targets = list(batch.targets)
        unreadable = 0
        crops, flips, draws = [], [], []
        for k, image in enumerate(decoded):
            index = batch.indices[k]
            if isinstance(image, Exception):
                self._warn(index, image)
                image, targets[k], passed = self._replacement(index)
                unreadable += 1 + passed
            # the draw belongs to the position in the epoch (index), whichever file fills it
            draw = self.draw(batch.epochs[k], index, image.shape[-1], image.shape[-2])
            top, left, h, w = draw["crop"]
            crops.append(_resize(image[:, top:top + h, left:left + w], self.size, draw["interpolation"]))
            flips.append(draw["flip"])
            draws.append(draw["ops"])
        images = _to_uint8(torch.stack(crops))
        flip = torch.tensor(flips).to(self.device, non_blocking=True)[:, None, None, None]
        images = torch.where(flip, images.flip(-1), images)
        if self.policy is not None:
            images = apply_rand_augment(images, draws, self.policy.fill)
        targets = torch.tensor(targets, dtype=torch.int64).to(self.device, non_blocking=True)
        return _normalize(images, self.mean, self.std), targets, torch.tensor(unreadable, dtype=torch.long)


class EvalStage(_Stage):
    """Evaluation batches as timm's eval transform makes them (shorter side to ``floor(img_size / crop_pct)``,
    centre crop); unreadable files are dropped and counted."""

    def __init__(self, dataset: EncodedImageFolder, device, img_size: int, mean, std, *, crop_pct: float,
                 interpolation: str = "bicubic", prefetch: bool | None = None):
        super().__init__(dataset, device, mean, std, prefetch)
        self.img_size = img_size
        self.scale_size = math.floor(img_size / crop_pct)
        self.interpolation = _check_interpolation(interpolation, "--interpolation")

    def transform(self, image: torch.Tensor) -> torch.Tensor:
        h, w = image.shape[-2:]
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = self.scale_size, int(self.scale_size * long / short)  # torchvision's Resize(int)
        size = (new_long, new_short) if w <= h else (new_short, new_long)
        image = _resize(image, size, self.interpolation)
        h, w = size
        top = int(round((h - self.img_size) / 2.0))
        left = int(round((w - self.img_size) / 2.0))
        return image[:, top:top + self.img_size, left:left + self.img_size]

    def process(self, batch: EncodedBatch):
        return self.from_decoded(decode_batch(batch.data, self.device), batch)

    def from_decoded(self, decoded: Sequence[torch.Tensor | Exception], batch: EncodedBatch):
        """The evaluation batch from ``batch``'s decoded images (:func:`decode_batch`'s list, on ``device``)."""
        kept, targets, unreadable = [], [], 0
        for k, image in enumerate(decoded):
            if isinstance(image, Exception):
                self._warn(batch.indices[k], image)
                unreadable += 1
                continue
            kept.append(self.transform(image))
            targets.append(batch.targets[k])
        if not kept:
            empty = torch.empty(0, 3, self.img_size, self.img_size, device=self.device)
            return empty, torch.empty(0, dtype=torch.int64, device=self.device), torch.tensor(unreadable)
        targets = torch.tensor(targets, dtype=torch.int64).to(self.device, non_blocking=True)
        return _normalize(_to_uint8(torch.stack(kept)), self.mean, self.std), targets, torch.tensor(unreadable)
