"""The GPU-fed input pipeline (``--data-backend gpu``): loader workers read file bytes, the training process decodes
each batch on the GPU and augments it batched there. The JPEG decoder (``--jpeg-decoder``) is torchvision's nvJPEG
(``decode_jpeg(..., device="cuda")``) or, with that optional extra installed, nvImageCodec's
(:class:`NvImageCodecJpeg`: the GPU's hardware JPEG engines, whose pixels equal PIL's within one grey level where
nvJPEG's differ by up to a hundred at colour edges, but whose batches cost the training process more host time).

Training (:class:`TrainStage`): RandomResizedCrop + flip with timm's parameter draws, resize (antialiased, bilinear
or bicubic per image as timm's ``random``), RandAugment (:mod:`visionssm.data.gpu_augment`) and normalisation.
Random erasing and Mixup/CutMix run on the batch in the training step (timm's own, on the device). Every image's
draws come from a ``random.Random`` seeded by ``(seed, epoch, index)`` as the PIL path's ``augment_seed``, so they do
not depend on workers, processes or where a resumed run restarted. Evaluation (:class:`EvalStage`): timm's eval
transform (shorter side to ``img_size / crop_pct``, centre crop).

Only the draws are per image, on the host. The pixel work is batched: the whole batch's crops, resizes and flips in
one gather and two batched matmuls (:func:`resample`), RandAugment as a fixed set of op families per layer, all
parameters in one host-to-device copy, so the kernel launches per batch do not depend on its size and the host
never waits for the GPU. Why matmuls: the antialiased filter torch and Pillow use is a separable linear map per
axis, so a (n, out, window) weight matrix reproduces it exactly for each image's own window and scale, where
``roi_align`` (a box average of bilinear samples) or ``grid_sample`` (no antialiasing) would only approximate it.

A batch that nvJPEG refuses is decoded image by image; an unreadable file is warned about once (naming it) and
counted, then replaced by the next readable image in training and dropped in evaluation, as ``SafeImageFolder``
does. Files that are not JPEG (a PNG in an ImageFolder) are decoded on the CPU and moved. The stages take any
device: on ``cpu`` they run torchvision's CPU decoder, which is how the tests exercise them.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import random
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torchvision.io import ImageReadMode, decode_image, decode_jpeg, encode_jpeg

from visionssm.data.gpu_augment import (
    PLAN_COLUMNS,
    RandAugmentPolicy,
    apply_rand_augment,
    draw_rand_augment,
    parse_rand_augment,
    plan_rand_augment,
)
from visionssm.data.loader import SafeImageFolder, augment_seed_of
from visionssm.utils.cli import UserValueError, check_choice

__all__ = ["BACKENDS", "JPEG_DECODERS", "EncodedBatch", "EncodedImageFolder", "EvalStage", "NvImageCodecJpeg",
           "TrainStage", "Window", "collate_encoded", "decode_batch", "jpeg_decoder", "nvjpeg_problem",
           "random_resized_crop_params", "resample", "resolve_data_backend"]

BACKENDS = ("auto", "pil", "gpu")
JPEG_DECODERS = ("torchvision", "nvimgcodec")
_INTERPOLATIONS = ("bilinear", "bicubic", "nearest")


def _probe_jpeg() -> torch.Tensor:
    """A small grey JPEG that a working decoder decodes."""
    return encode_jpeg(torch.full((3, 8, 8), 128, dtype=torch.uint8))


def nvjpeg_problem(device: torch.device) -> str | None:
    """Why ``decode_jpeg`` cannot decode on ``device`` (one line), or ``None`` when it can."""
    try:
        decode_jpeg([_probe_jpeg()], mode=ImageReadMode.RGB, device=device)
    except (RuntimeError, ValueError, AssertionError) as error:
        return " ".join(str(error).split())[:200] or type(error).__name__
    return None


class NvImageCodecJpeg:
    """nvImageCodec's batched JPEG decoder on one CUDA device: the GPU's hardware JPEG engines where it has them
    (A100, H100, H200 and later), its CUDA decoder for what they do not take. Called with a batch of JPEG files
    (uint8 tensors), it returns each as a (3, H, W) uint8 RGB view of an interleaved image, or ``None`` where
    nvImageCodec could not decode it, queued on the current stream. No EXIF rotation, as torchvision and PIL."""

    def __init__(self, module, device: torch.device):
        self.codec = module
        self.device = torch.device(device)
        kinds = (module.BackendKind.HW_GPU_ONLY, module.BackendKind.GPU_ONLY)
        self.decoder = module.Decoder(device_id=self.device.index if self.device.index is not None
                                      else torch.cuda.current_device(), backends=[module.Backend(k) for k in kinds])
        self.params = module.DecodeParams(apply_exif_orientation=False, color_spec=module.ColorSpec.SRGB,
                                          allow_any_depth=False, sample_format=module.SampleFormat.I_RGB)

    def __call__(self, data: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        streams = [self.codec.CodeStream(d.numpy()) for d in data]
        stream = torch.cuda.current_stream(self.device).cuda_stream
        images = self.decoder.decode(streams, params=self.params, cuda_stream=stream)
        return [None if image is None else torch.from_dlpack(image).permute(2, 0, 1) for image in images]


def _import_nvimgcodec():
    """nvImageCodec's module, or the reason it cannot be imported. Its import reports each codec library it misses
    (JPEG 2000, TIFF) on stderr; only JPEG is decoded here, so that output is dropped unless the import fails."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            from nvidia import nvimgcodec
        except ImportError as error:
            return None, f"nvImageCodec is not installed ({error})"
        except (OSError, RuntimeError) as error:
            captured.seek(0)
            return None, f"nvImageCodec does not load: {error} {' '.join(captured.read().split())[:200]}"
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    return nvimgcodec, None


def jpeg_decoder(choice: str, device: torch.device, say: Callable[[str], None]) -> NvImageCodecJpeg | None:
    """The gpu backend's batched JPEG decoder on ``device`` for ``--jpeg-decoder choice``: nvImageCodec's for
    ``nvimgcodec`` where it is installed and decodes on ``device`` (else one line through ``say`` saying why), and
    ``None`` (torchvision's nvJPEG) otherwise."""
    if check_choice(choice, JPEG_DECODERS, "--jpeg-decoder") == "torchvision":
        return None
    device = torch.device(device)
    if device.type != "cuda":
        return None  # the CPU stages decode with torchvision's CPU decoder; resolve_data_backend said so already
    module, problem = _import_nvimgcodec()
    if module is not None:
        try:
            decoder = NvImageCodecJpeg(module, device)
            if decoder([_probe_jpeg()])[0] is None:
                raise RuntimeError("it returned no image for a test JPEG")
            return decoder
        except RuntimeError as error:
            problem = f"nvImageCodec cannot decode on {device}: {' '.join(str(error).split())[:200]}"
    say(f"note: --jpeg-decoder nvimgcodec: {problem}; decoding with torchvision's nvJPEG instead (pip install "
        "'visionssm[nvimgcodec-cu13]', or -cu12 for a CUDA 12 build of torch)")
    return None


def resolve_data_backend(choice: str, device: torch.device, say: Callable[[str], None]) -> str:
    """``pil`` or ``gpu`` for ``--data-backend choice`` on ``device``: ``auto`` is gpu on a CUDA device; ``gpu``
    where CUDA or nvJPEG is missing falls back to pil with one line through ``say``."""
    if check_choice(choice, BACKENDS, "--data-backend") == "pil":
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
    return data.numel() > 3 and data[:2].numpy().tobytes() == b"\xff\xd8"  # NumPy: no tensor op per file


def _decode_one(data: torch.Tensor, device: torch.device) -> torch.Tensor:
    if _is_jpeg(data):
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    return decode_image(data, mode=ImageReadMode.RGB).to(device)


def decode_batch(data: Sequence[torch.Tensor], device: torch.device,
                 decoder: Callable[[list[torch.Tensor]], list[torch.Tensor | None]] | None = None,
                 ) -> list[torch.Tensor | Exception]:
    """Each file as a (3, H, W) uint8 RGB tensor on ``device``, or the exception that decoding it raised: the JPEGs
    in one batched call (``decoder``'s, e.g. :class:`NvImageCodecJpeg`, else torchvision's), one by one with
    torchvision those it did not decode (a batch torchvision refuses: all of them), other formats on the CPU."""
    out: list[torch.Tensor | Exception] = [None] * len(data)  # type: ignore[list-item]
    jpegs = [i for i, d in enumerate(data) if _is_jpeg(d)]
    try:
        if decoder is not None and jpegs:
            decoded = decoder([data[i] for i in jpegs])
        else:
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


# A batch's windows are resampled together: each output axis is a matrix product with a (n, out, window) matrix
# of the same antialiased filter weights torch's interpolate(antialias=True) and Pillow's resize use, so one gather
# and two batched matmuls replace a resize per image. Windows are padded to the largest in a chunk; chunks bound
# the padded gather (float32: 4 bytes per element), so a few very large images do not inflate the whole batch.
_CHUNK_ELEMENTS = 2**28
_KINDS = {"bilinear": 0, "bicubic": 1, "nearest": 2}
_WINDOW_COLUMNS = 13  # offset, H*W, W, top, left, h, w, scale_y, scale_x, shift_y, shift_x, kind, flip


@dataclass(frozen=True)
class Window:
    """What one output image reads: the source rows ``top:top + h`` and columns ``left:left + w`` of the image,
    resampled with the filter ``interpolation`` at ``scale`` source pixels per output pixel (per axis), the output
    starting ``shift`` pixels into the resampled grid (per axis); ``flip`` mirrors the output left to right.

    RandomResizedCrop is the crop box with ``scale = box / output`` and no shift; timm's eval transform is the whole
    image with ``scale = image / resized`` and the centre crop's offset as the shift."""

    top: int
    left: int
    h: int
    w: int
    scale: tuple[float, float]
    shift: tuple[float, float] = (0.0, 0.0)
    interpolation: str = "bilinear"
    flip: bool = False

    @classmethod
    def crop(cls, box: tuple[int, int, int, int], size: tuple[int, int], interpolation: str, flip: bool = False):
        top, left, h, w = box
        return cls(top, left, h, w, (h / size[0], w / size[1]), (0.0, 0.0), interpolation, flip)


def _chunks(windows: Sequence[Window], limit: int) -> list[list[int]]:
    """Positions grouped so each group's padded window (count x 3 x max h x max w) stays within ``limit`` elements:
    the whole batch in order when it fits, else largest windows first, greedily."""
    n = len(windows)
    if n * 3 * max(w.h for w in windows) * max(w.w for w in windows) <= limit:
        return [list(range(n))]
    groups: list[list[int]] = []
    rows = cols = 0
    for k in sorted(range(n), key=lambda k: windows[k].h * windows[k].w, reverse=True):
        rows, cols = max(rows, windows[k].h), max(cols, windows[k].w)
        if groups and (len(groups[-1]) + 1) * 3 * rows * cols <= limit:
            groups[-1].append(k)
        else:
            groups.append([k])
            rows, cols = windows[k].h, windows[k].w
    return groups


def _taps(window: Window, axis: int) -> int:
    """How many window pixels one output pixel can read along ``axis``: the filter's support (triangle 2, cubic 4,
    widened by the downscaling factor) plus the rounding of its ends."""
    radius = (2.0 if window.interpolation == "bicubic" else 1.0) * max(window.scale[axis], 1.0)
    return math.ceil(2 * radius) + 2


def _axis_weights(params: torch.Tensor, out: int, length: int, axis: int, taps: int) -> torch.Tensor:
    """(n, out, length) weights along one axis (0: rows, 1: columns) from the windows' parameter rows: output pixel
    ``i`` reads window pixels ``x`` with torch's antialiased filter (Pillow's: triangle or Keys cubic a = -0.5,
    widened by the downscaling factor, clipped to the window, normalised), or ``nearest-exact``'s one pixel. The
    filter is evaluated on its ``taps`` pixels only, then scattered into the dense matrix."""
    extent = params[:, 5 + axis, None, None].float()
    scale = params[:, 7 + axis, None, None].float()
    shift = params[:, 9 + axis, None, None].float()
    kind = params[:, 11, None, None]
    i = torch.arange(out, device=params.device, dtype=torch.float32)[None, :, None]
    if axis == 1:
        i = torch.where(params[:, 12, None, None] > 0, out - 1 - i, i)  # a flipped output reads mirrored columns
    center = (i + shift + 0.5) * scale
    widen = scale.clamp(min=1.0)
    radius = torch.where(kind == _KINDS["bicubic"], 2.0, 1.0) * widen
    x = torch.floor(center - radius + 0.5).clamp(min=0.0) + torch.arange(taps, device=params.device)
    t = ((x - center + 0.5) / widen).abs()
    a = -0.5
    cubic = torch.where(t < 1.0, ((a + 2) * t - (a + 3)) * t * t + 1,
                        torch.where(t < 2.0, ((a * t - 5 * a) * t + 8 * a) * t - 4 * a, 0.0))
    inside = x < torch.minimum(torch.floor(center + radius + 0.5), extent)
    weights = torch.where(inside, torch.where(kind == _KINDS["bicubic"], cubic, (1.0 - t).clamp(min=0.0)), 0.0)
    total = weights.sum(dim=-1, keepdim=True)
    weights = weights / torch.where(total != 0, total, 1.0)
    nearest = (x == torch.minimum(torch.floor(center), extent - 1)).float()
    weights = torch.where(kind == _KINDS["nearest"], nearest, weights)
    dense = torch.zeros(params.shape[0], out, length + taps, device=params.device)  # taps past the window: weight 0
    return dense.scatter_(2, x.long(), weights)[..., :length]


def _resample_chunk(flat: torch.Tensor, params: torch.Tensor, extent: tuple[int, int, int, int],
                    size: tuple[int, int], interleaved: bool) -> torch.Tensor:
    """(n, 3, *size) float from the windows' parameter rows: their pixels gathered into one (n, rows, 3, cols)
    tensor (padded with whatever follows each window row, which gets weight 0), then the columns and the rows
    resampled by two batched matmuls. ``interleaved``: the images are stored (H, W, 3), as torchvision's CPU
    decoder returns them, else (3, H, W), as nvJPEG does."""
    n = params.shape[0]
    rows, cols, row_taps, col_taps = extent
    offset, plane, width, top, left, h = (params[:, k].long() for k in range(6))
    y = torch.minimum(torch.arange(rows, device=flat.device)[None], h[:, None] - 1)  # padding repeats a real row
    if interleaved:
        starts = (offset + 3 * left)[:, None] + (top[:, None] + y) * (3 * width[:, None])
        pixels = flat.unfold(0, 3 * cols, 1)[starts].view(n, rows, cols, 3).permute(0, 1, 3, 2)
        pixels = pixels.to(torch.float32, memory_format=torch.contiguous_format)
    else:
        starts = (offset + left)[:, None, None] + ((top[:, None] + y) * width[:, None])[..., None] + \
            torch.arange(3, device=flat.device) * plane[:, None, None]
        pixels = flat.unfold(0, cols, 1)[starts].float()  # one gather of whole window rows
    across = torch.bmm(pixels.view(n, rows * 3, cols),
                       _axis_weights(params, size[1], cols, 1, col_taps).transpose(1, 2))
    down = torch.bmm(_axis_weights(params, size[0], rows, 0, row_taps), across.view(n, rows, 3 * size[1]))
    return down.view(n, size[0], 3, size[1]).permute(0, 2, 1, 3)


class _Shipment:
    """The numbers a batch needs on the device, gathered on the host and copied in one transfer (pinned and
    asynchronous on CUDA, so the host does not wait for the stream), then handed out as views."""

    def __init__(self):
        self._values: list[float] = []
        self._segments: dict[str, tuple[int, int, int]] = {}

    def add(self, name: str, values: Sequence[float], columns: int = 1) -> None:
        self._segments[name] = (len(self._values), len(values), columns)
        self._values.extend(values)

    def ship(self, device: torch.device) -> dict[str, torch.Tensor]:
        host = torch.tensor(self._values, dtype=torch.float64)
        if device.type == "cuda":
            host = host.pin_memory()
        moved = host.to(device, non_blocking=True)
        return {name: moved[start:start + length].view(-1, columns) if columns > 1 else moved[start:start + length]
                for name, (start, length, columns) in self._segments.items()}


class _Resample:
    """:func:`resample`'s plan for one batch: the host half (parameter rows, chunks) before the shipment, the
    device half after."""

    def __init__(self, images: Sequence[torch.Tensor], windows: Sequence[Window], size: tuple[int, int],
                 shipment: _Shipment, chunk_elements: int):
        unknown = {w.interpolation for w in windows} - set(_KINDS)
        if unknown:
            raise ValueError(f"windows' interpolation must be one of {', '.join(_KINDS)}, got {sorted(unknown)}")
        if len(images) != len(windows) or not windows:
            raise ValueError(f"resample needs one window per image and at least one image, got {len(images)} images "
                             f"and {len(windows)} windows")
        self.size, self.count = size, len(windows)
        self.chunks = _chunks(windows, chunk_elements)
        rows, offset = [], 0
        for k, (image, window) in enumerate(zip(images, windows)):
            height, width = image.shape[-2:]
            if not (window.h > 0 and window.w > 0 and window.top >= 0 and window.left >= 0
                    and window.top + window.h <= height and window.left + window.w <= width):
                raise ValueError(f"windows[{k}] = {window} is not inside its {height} x {width} image")
            rows += [offset, height * width, width, window.top, window.left, window.h, window.w, *window.scale,
                     *window.shift, _KINDS[window.interpolation], float(window.flip)]
            offset += 3 * height * width
        shipment.add("windows", rows, _WINDOW_COLUMNS)
        self.extents = [(max(windows[k].h for k in chunk), max(windows[k].w for k in chunk),
                         max(_taps(windows[k], 0) for k in chunk), max(_taps(windows[k], 1) for k in chunk))
                        for chunk in self.chunks]
        if len(self.chunks) > 1:
            shipment.add("chunks", [k for chunk in self.chunks for k in chunk])

    def run(self, images: Sequence[torch.Tensor], shipped: dict[str, torch.Tensor]) -> torch.Tensor:
        # one concatenation in the images' own layout: viewing each image costs no copy
        interleaved = all(image.stride() == (1, 3 * image.shape[-1], 3) for image in images)
        if interleaved:
            parts = [image.permute(1, 2, 0).reshape(-1) for image in images]
        else:
            parts = [image.reshape(-1) for image in images]  # copies only an image in neither layout
        pad = max(extent[1] for extent in self.extents) * 3  # every window row's padded read stays in the buffer
        flat = torch.cat(parts + [images[0].new_zeros(pad)])
        params = shipped["windows"]
        if len(self.chunks) == 1:
            return _resample_chunk(flat, params, self.extents[0], self.size, interleaved)
        out = torch.full((self.count, 3, *self.size), math.nan, device=flat.device)  # a missed image shows
        order, start = shipped["chunks"].long(), 0
        for chunk, extent in zip(self.chunks, self.extents):
            index = order[start:start + len(chunk)]
            out.index_copy_(0, index, _resample_chunk(flat, params.index_select(0, index), extent, self.size,
                                                      interleaved))
            start += len(chunk)
        return out


def resample(images: Sequence[torch.Tensor], windows: Sequence[Window], size: tuple[int, int], *,
             chunk_elements: int = _CHUNK_ELEMENTS) -> torch.Tensor:
    """Each (3, H, W) uint8 image's window resampled to ``size``, as one (N, 3, *size) float32 batch (unrounded),
    the kernel launches independent of N (one parameter transfer, one concatenation, per chunk a gather and two
    matmuls). Equal to torch's per-image ``interpolate(antialias=True)`` (``nearest-exact`` for nearest) of the
    crop up to float32 summation order."""
    shipment = _Shipment()
    plan = _Resample(images, windows, size, shipment, chunk_elements)
    return plan.run(images, shipment.ship(images[0].device))


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
    """Decodes and transforms the batches of a loader, optionally ahead of it on threads of their own (on CUDA, on
    a stream of their own, so decoding and transforming overlap the training step)."""

    def __init__(self, dataset: EncodedImageFolder, device: torch.device, mean, std, prefetch: bool | None,
                 decoder: NvImageCodecJpeg | None):
        self.dataset = dataset
        self.device = torch.device(device)
        self.decoder = decoder
        self.mean = torch.tensor(mean, dtype=torch.float32, device=self.device)[None, :, None, None]
        self.std = torch.tensor(std, dtype=torch.float32, device=self.device)[None, :, None, None]
        self.prefetch = self.device.type == "cuda" if prefetch is None else prefetch
        self._reported: set[int] = set()
        self.seconds = {"decode": 0.0, "transform": 0.0}  # host time of each part so far (decode blocks until done)

    def process(self, batch: EncodedBatch):
        """``batch`` decoded (:func:`decode_batch`) and transformed (:meth:`from_decoded`)."""
        return self._transform(self._decode(batch), batch)

    def _decode(self, batch: EncodedBatch) -> list[torch.Tensor | Exception]:
        start = time.perf_counter()
        decoded = decode_batch(batch.data, self.device, self.decoder)
        self.seconds["decode"] += time.perf_counter() - start
        return decoded

    def _transform(self, decoded: Sequence[torch.Tensor | Exception], batch: EncodedBatch):
        start = time.perf_counter()
        out = self.from_decoded(decoded, batch)
        self.seconds["transform"] += time.perf_counter() - start
        return out

    def from_decoded(self, decoded: Sequence[torch.Tensor | Exception], batch: EncodedBatch):
        raise NotImplementedError

    def _warn(self, index: int, error: Exception) -> None:
        if index not in self._reported:
            self._reported.add(index)
            warnings.warn(f"skipping unreadable image {self.dataset.samples[index][0]}: {type(error).__name__}: "
                          f"{' '.join(str(error).split())[:200]}", RuntimeWarning, stacklevel=3)

    def __call__(self, loader: Iterable[EncodedBatch]) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        if not self.prefetch:
            return (self.process(batch) for batch in loader)
        return self._prefetched(loader)

    def _prefetched(self, loader):
        """The batches of ``loader`` from two threads sharing one side stream: one decodes batch k + 1 while the
        other transforms batch k (the batched decoders wait for the GPU without holding the interpreter lock, so
        the transform's host work goes on meanwhile), each at most two batches ahead of its consumer."""
        decoded: queue.Queue = queue.Queue(maxsize=2)
        results: queue.Queue = queue.Queue(maxsize=2)
        stop = threading.Event()
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

        def on_stream():
            return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

        def put(target: queue.Queue, entry) -> bool:
            """Hand ``entry`` over unless the consumer has stopped (it may never take another)."""
            while not stop.is_set():
                try:
                    target.put(entry, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def take():
            """The next decoded batch, or None once the consumer has stopped."""
            while not stop.is_set():
                try:
                    return decoded.get(timeout=0.1)
                except queue.Empty:
                    continue
            return None

        def decode():
            try:
                with on_stream():
                    for batch in loader:
                        if not put(decoded, (batch, self._decode(batch))):
                            return
                put(decoded, (None, None))
            except BaseException as error:  # handed on to the consumer, which raises it
                put(decoded, (error, None))

        def transform():
            try:
                with on_stream():
                    while (entry := take()) is not None:
                        batch, images = entry
                        if batch is None or isinstance(batch, BaseException):  # the end, or the decoder's error
                            put(results, (batch, None))
                            return
                        item = self._transform(images, batch)
                        event = None
                        if stream is not None:
                            event = torch.cuda.Event()
                            event.record(stream)
                        if not put(results, (item, event)):
                            return
            except BaseException as error:  # handed to the consumer, which raises it
                put(results, (error, None))

        workers = [threading.Thread(target=work, name=f"visionssm-gpu-stage-{work.__name__}", daemon=True)
                   for work in (decode, transform)]
        for worker in workers:
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
            for worker in workers:
                worker.join()


class TrainStage(_Stage):
    """Training batches: ``(images (N, 3, S, S) float32 normalised, targets (N,) int64, unreadable ())`` on
    ``device``; random erasing and Mixup/CutMix are the training step's."""

    def __init__(self, dataset: EncodedImageFolder, device, img_size: int, mean, std, *, seed: int,
                 scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), hflip: float = 0.5, interpolation: str = "random",
                 auto_augment: str | None = None, prefetch: bool | None = None,
                 decoder: NvImageCodecJpeg | None = None):
        super().__init__(dataset, device, mean, std, prefetch, decoder)
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

    def from_decoded(self, decoded: Sequence[torch.Tensor | Exception], batch: EncodedBatch):
        """The training batch from ``batch``'s decoded images (:func:`decode_batch`'s list, on ``device``). The
        host draws each image's parameters; the pixel work is batched (:func:`resample`, then RandAugment's
        families), with every parameter in one transfer."""
        targets = list(batch.targets)
        unreadable = 0
        images, windows, draws = list(decoded), [], []
        for k, image in enumerate(images):
            index = batch.indices[k]
            if isinstance(image, Exception):
                self._warn(index, image)
                images[k], targets[k], passed = self._replacement(index)
                unreadable += 1 + passed
            # the draw belongs to the position in the epoch (index), whichever file fills it
            draw = self.draw(batch.epochs[k], index, images[k].shape[-1], images[k].shape[-2])
            windows.append(Window.crop(draw["crop"], self.size, draw["interpolation"], draw["flip"]))
            draws.append(draw["ops"])
        shipment = _Shipment()
        plan = _Resample(images, windows, self.size, shipment, _CHUNK_ELEMENTS)
        shipment.add("targets", targets)
        augment = plan_rand_augment(self.policy, draws, self.size) if self.policy is not None else {}
        for key, rows in augment.items():
            shipment.add(key, rows, PLAN_COLUMNS)
        shipped = shipment.ship(self.device)
        out = _to_uint8(plan.run(images, shipped)).contiguous()  # the matmuls leave (n, h, 3, w) order
        if augment:
            out = apply_rand_augment(out, {key: shipped[key] for key in augment}, self.policy.fill)
        targets = shipped["targets"].long()
        return _normalize(out, self.mean, self.std), targets, torch.tensor(unreadable, dtype=torch.long)


class EvalStage(_Stage):
    """Evaluation batches as timm's eval transform makes them (shorter side to ``floor(img_size / crop_pct)``,
    centre crop), the batch resampled at once; unreadable files are dropped and counted."""

    def __init__(self, dataset: EncodedImageFolder, device, img_size: int, mean, std, *, crop_pct: float,
                 interpolation: str = "bicubic", prefetch: bool | None = None, decoder: NvImageCodecJpeg | None = None):
        super().__init__(dataset, device, mean, std, prefetch, decoder)
        self.img_size = img_size
        self.scale_size = math.floor(img_size / crop_pct)
        self.interpolation = _check_interpolation(interpolation, "--interpolation")

    def window(self, height: int, width: int) -> Window:
        """The image resized with its shorter side to ``scale_size`` (torchvision's ``Resize(int)``), then the
        centre ``img_size`` square, as one window."""
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.scale_size, int(self.scale_size * long / short)
        new_h, new_w = (new_long, new_short) if width <= height else (new_short, new_long)
        top = int(round((new_h - self.img_size) / 2.0))
        left = int(round((new_w - self.img_size) / 2.0))
        return Window(0, 0, height, width, (height / new_h, width / new_w), (top, left), self.interpolation)

    def from_decoded(self, decoded: Sequence[torch.Tensor | Exception], batch: EncodedBatch):
        """The evaluation batch from ``batch``'s decoded images (:func:`decode_batch`'s list, on ``device``)."""
        kept, targets, unreadable = [], [], 0
        for k, image in enumerate(decoded):
            if isinstance(image, Exception):
                self._warn(batch.indices[k], image)
                unreadable += 1
                continue
            kept.append(image)
            targets.append(batch.targets[k])
        if not kept:
            empty = torch.empty(0, 3, self.img_size, self.img_size, device=self.device)
            return empty, torch.empty(0, dtype=torch.int64, device=self.device), torch.tensor(unreadable)
        size = (self.img_size, self.img_size)
        shipment = _Shipment()
        plan = _Resample(kept, [self.window(*image.shape[-2:]) for image in kept], size, shipment, _CHUNK_ELEMENTS)
        shipment.add("targets", targets)
        shipped = shipment.ship(self.device)
        images = _to_uint8(plan.run(kept, shipped)).contiguous()  # the matmuls leave (n, h, 3, w) order
        return _normalize(images, self.mean, self.std), shipped["targets"].long(), torch.tensor(unreadable)
