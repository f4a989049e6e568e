"""The gpu data backend (visionssm.data.gpu, gpu_augment) on CPU, where torchvision decodes on the CPU with the same
code path, and its `cuda` twins: backend selection, decoding against PIL, timm's crop draws and RandAugment ops
against timm's PIL ops, label order, sharding, resume order, unreadable files."""

from __future__ import annotations

import random
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from visionssm.data.gpu import (
    EncodedImageFolder,
    EvalStage,
    TrainStage,
    collate_encoded,
    decode_batch,
    random_resized_crop_params,
    resolve_data_backend,
)
from visionssm.data.gpu_augment import apply_op, level_args, parse_rand_augment
from visionssm.data.loader import EpochShuffleSampler
from visionssm.training.state import parse_config

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SIZES = [(57, 41), (40, 64), (33, 33), (75, 50), (48, 61)]  # odd and even sides, both orientations


def _picture(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """Smooth colour fields with edges: structure a half-pixel shift or a wrong channel would show."""
    small = rng.integers(0, 256, (5, 6, 3), dtype=np.uint8)
    image = np.asarray(Image.fromarray(small).resize((width, height), Image.BICUBIC)).copy()
    image[height // 3: height // 2, width // 4: width // 2] = rng.integers(0, 256, 3)
    return Image.fromarray(image)


@pytest.fixture(scope="module")
def jpeg_folder(tmp_path_factory) -> Path:
    """3 classes x 5 JPEGs (quality 90) of the sizes above, one PNG, and one corrupt JPEG in class b."""
    root = tmp_path_factory.mktemp("jpegs") / "train"
    rng = np.random.default_rng(4)
    for c, name in enumerate(("a", "b", "c")):
        (root / name).mkdir(parents=True)
        for i, (w, h) in enumerate(SIZES):
            _picture(rng, w + c, h).save(root / name / f"{i}.jpg", quality=90)
    _picture(rng, 30, 26).save(root / "c" / "9.png")
    (root / "b" / "2_broken.jpg").write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF truncated")
    return root


def _dataset(root: Path) -> EncodedImageFolder:
    return EncodedImageFolder(root, augment_seed=0)


# ---------------------------------------------------------------------------------------------------------------
# Backend selection


def test_backend_selection_and_fallback_line():
    said = []
    assert resolve_data_backend("auto", torch.device("cpu"), said.append) == "pil" and said == []
    assert resolve_data_backend("pil", torch.device("cpu"), said.append) == "pil" and said == []
    assert resolve_data_backend("gpu", torch.device("cpu"), said.append) == "pil"
    assert len(said) == 1 and "--data-backend gpu needs a CUDA device" in said[0] and "PIL" in said[0]
    with pytest.raises(ValueError, match="--data-backend must be one of auto, pil, gpu"):
        resolve_data_backend("dali", torch.device("cpu"), said.append)
    assert parse_config([])["data_backend"] == "auto"
    assert parse_config(["--data-backend", "gpu"])["data_backend"] == "gpu"
    if not torch.cuda.is_available():  # a CUDA device this build cannot decode on: nvJPEG's probe fails
        said.clear()
        assert resolve_data_backend("auto", torch.device("cuda"), said.append) == "pil"
        assert len(said) == 1 and "cannot decode JPEG on cuda" in said[0]


# ---------------------------------------------------------------------------------------------------------------
# Decoding and the transforms against PIL / timm


# JPEG leaves chroma upsampling and the IDCT's precision to the decoder: each tolerance is 1.5x (mean) and 2x (99.9th
# percentile) the spread between libjpeg's default and fast decodes of these images (re-measured by a test below).
JPEG_TOLERANCE = {"sharp444": (1.75, 8.0), "natural420": (2.0, 14.0)}  # class folder: (mean, 99.9th pct) grey levels


def _smooth_picture(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """A smooth photo-like colour field (bicubic from a 6 x 8 grid), where correct 4:2:0 decoders differ little."""
    return Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((width, height), Image.BICUBIC)


@pytest.fixture(scope="module")
def decoder_folder(tmp_path_factory) -> Path:
    """Decoder fixtures: the sharp-edged pictures at 4:4:4 (no chroma upsampling, so decoders agree closely and a
    channel swap, a one-pixel shift, a flip or a wrong YCbCr matrix shows), 500 x 375 smooth pictures at 4:2:0 (the
    benchmark's size and subsampling), one PNG (lossless: exact)."""
    root = tmp_path_factory.mktemp("decoders") / "val"
    rng = np.random.default_rng(11)
    for name in JPEG_TOLERANCE:
        (root / name).mkdir(parents=True)
    for i, (w, h) in enumerate(SIZES):
        _picture(rng, w, h).save(root / "sharp444" / f"{i}.jpg", quality=90, subsampling=0)
    for i in range(3):
        _smooth_picture(rng, 500, 375).save(root / "natural420" / f"{i}.jpg", quality=90, subsampling=2)
    _picture(rng, 30, 26).save(root / "natural420" / "9.png")
    return root


def _spread(got: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """Mean and 99.9th percentile of the absolute difference, in grey levels."""
    diff = (got.cpu().float() - expected.cpu().float()).abs().flatten()
    return float(diff.mean()), float(torch.quantile(diff, 0.999))


def _within_jpeg_tolerance(path: str, got: torch.Tensor, expected: torch.Tensor) -> bool:
    if got.shape != expected.shape:
        return False
    mean, top = JPEG_TOLERANCE[Path(path).parent.name]
    spread = _spread(got, expected)
    return spread[0] < mean and spread[1] <= top


def _pil_tensor(path: str, fast: bool = False) -> torch.Tensor:
    """PIL's decode as (3, H, W) uint8; ``fast``: libjpeg's draft decode (no fancy upsampling, fast IDCT)."""
    with Image.open(path) as image:
        if fast:
            image.decoderconfig = (1, 1)  # (scale, draft): Pillow's JPEG decoder turns both off for a draft
        return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)


def _decode_matches_pil(folder: Path, device: str) -> None:
    """Each decoded file against PIL's decode of it: PNG exactly, JPEG within JPEG_TOLERANCE. One batched call, so a
    batch decoded out of order fails too."""
    dataset = _dataset(folder)
    decoded = decode_batch([dataset.read(i) for i in range(len(dataset))], torch.device(device))
    for (path, _), image in zip(dataset.samples, decoded):
        expected = _pil_tensor(path)
        assert image.device.type == device and image.dtype == torch.uint8 and image.shape == expected.shape, path
        if path.endswith(".png"):
            assert torch.equal(image.cpu(), expected), path
        else:
            assert _within_jpeg_tolerance(path, image, expected), (path, _spread(image, expected))


def test_decoded_pixels_equal_pil_within_jpeg_tolerance(decoder_folder, jpeg_folder):
    _decode_matches_pil(decoder_folder, "cpu")
    dataset = _dataset(jpeg_folder)  # torchvision's CPU decoder is libjpeg's default decode: PIL's pixels exactly
    readable = [i for i, (p, _) in enumerate(dataset.samples) if "broken" not in p]
    for i, image in zip(readable, decode_batch([dataset.read(i) for i in readable], torch.device("cpu"))):
        assert torch.equal(image, _pil_tensor(dataset.samples[i][0])), dataset.samples[i][0]


def _ycbcr_to_rgb(ycbcr: torch.Tensor, kr: float, kb: float, limited: bool = False) -> torch.Tensor:
    """(3, H, W) YCbCr -> RGB with luma weights ``kr``, ``kb`` (JPEG's: BT.601's 0.299 and 0.114, full range)."""
    y, cb, cr = ycbcr.double().unbind(0)
    cb, cr = cb - 128, cr - 128
    if limited:  # studio swing: Y in [16, 235], chroma within +-112
        y, cb, cr = (y - 16) * 255 / 219, cb * 255 / 224, cr * 255 / 224
    r, b = y + 2 * (1 - kr) * cr, y + 2 * (1 - kb) * cb
    g = (y - kr * r - kb * b) / (1 - kr - kb)
    return torch.stack([r, g, b]).round().clamp(0, 255).to(torch.uint8)


def test_jpeg_tolerance_admits_libjpegs_fast_decode_and_rejects_decoding_bugs(decoder_folder):
    """JPEG_TOLERANCE admits another conforming decode (libjpeg's fast mode, with its 1.5x / 2x margin) and rejects,
    on every JPEG, each decoding bug: RGB/BGR or Cb/Cr swapped, a one-pixel shift either way, a flip, a transpose,
    BT.709 luma weights, limited-range YCbCr."""
    jpegs = sorted(str(p) for p in decoder_folder.rglob("*.jpg"))
    assert {Path(p).parent.name for p in jpegs} == set(JPEG_TOLERANCE)
    for path in jpegs:
        expected = _pil_tensor(path)
        fast = _pil_tensor(path, fast=True)
        assert not torch.equal(fast, expected), path  # the draft decode really is another decoder
        mean, top = JPEG_TOLERANCE[Path(path).parent.name]
        spread = _spread(fast, expected)
        assert spread[0] * 1.5 <= mean and spread[1] * 2 <= top, (path, spread)
        with Image.open(path) as image:
            image.draft("YCbCr", None)  # libjpeg's YCbCr, before its colour conversion
            ycbcr = torch.from_numpy(np.array(image)).permute(2, 0, 1)
        # the conversion the bugs alter, to libjpeg's fixed-point rounding
        assert (_ycbcr_to_rgb(ycbcr, 0.299, 0.114).int() - expected.int()).abs().max() <= 1, path
        bugs = {"BGR": expected.flip(0), "Cb/Cr swapped": _ycbcr_to_rgb(ycbcr[[0, 2, 1]], 0.299, 0.114),
                "shifted right": expected.roll(1, dims=2), "shifted down": expected.roll(1, dims=1),
                "flipped": expected.flip(2), "transposed": expected.transpose(1, 2),
                "BT.709": _ycbcr_to_rgb(ycbcr, 0.2126, 0.0722),
                "limited range": _ycbcr_to_rgb(ycbcr, 0.299, 0.114, limited=True)}
        for bug, got in bugs.items():
            assert not _within_jpeg_tolerance(path, got, expected), (path, bug, _spread(got, expected))


def test_crop_draws_are_timms_and_inside_the_image():
    from timm.data.transforms import RandomResizedCropAndInterpolation

    for seed in range(200):
        width, height = SIZES[seed % len(SIZES)]
        random.seed(seed)
        expected = RandomResizedCropAndInterpolation.get_params(Image.new("RGB", (width, height)), (0.08, 1.0),
                                                                 (3 / 4, 4 / 3))
        got = random_resized_crop_params(random.Random(seed), width, height, (0.08, 1.0), (3 / 4, 4 / 3))
        assert got == expected
        top, left, h, w = got
        assert top >= 0 and top + h <= height and left >= 0 and left + w <= width and h > 0 and w > 0
    # the fallback (a strip no crop of the ratio range fits): centre crop
    assert random_resized_crop_params(random.Random(0), 200, 10, (0.9, 1.0), (3 / 4, 4 / 3)) == (0, 93, 10, 13)


def test_train_crop_and_resize_equal_pil(jpeg_folder):
    """No RandAugment: each output is PIL's crop, resize (the drawn interpolation) and flip of the decoded image,
    normalised; labels in the batch's order."""
    dataset = _dataset(jpeg_folder)
    stage = TrainStage(dataset, "cpu", 24, MEAN, STD, seed=3, scale=(0.08, 1.0))
    readable = [i for i, (p, _) in enumerate(dataset.samples) if p.endswith(".jpg") and "broken" not in p]
    batch = collate_encoded([dataset[(1, i)] for i in readable])
    images, targets, unreadable = stage.process(batch)
    assert images.shape == (len(readable), 3, 24, 24) and int(unreadable) == 0
    assert targets.tolist() == [dataset.samples[i][1] for i in readable]
    mean, std = torch.tensor(MEAN)[:, None, None], torch.tensor(STD)[:, None, None]
    flips = 0
    for k, i in enumerate(readable):
        decoded = decode_batch([dataset.read(i)], torch.device("cpu"))[0]
        draw = stage.draw(1, i, decoded.shape[-1], decoded.shape[-2])
        top, left, h, w = draw["crop"]
        pil = Image.fromarray(decoded.permute(1, 2, 0).numpy()).crop((left, top, left + w, top + h))
        pil = pil.resize((24, 24), {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}[draw["interpolation"]])
        if draw["flip"]:
            pil, flips = pil.transpose(Image.FLIP_LEFT_RIGHT), flips + 1
        expected = torch.from_numpy(np.array(pil)).permute(2, 0, 1).float()
        got = (images[k] * std + mean) * 255
        diff = (got - expected).abs()
        assert diff.max() <= 2.01 and diff.mean() < 0.3, (i, draw, diff.max(), diff.mean())
    assert 0 < flips < len(readable)


def test_eval_transform_equals_timms(jpeg_folder):
    from timm.data import create_transform

    dataset = _dataset(jpeg_folder)
    stage = EvalStage(dataset, "cpu", 24, MEAN, STD, crop_pct=0.875, interpolation="bicubic")
    transform = create_transform(24, is_training=False, interpolation="bicubic", mean=MEAN, std=STD, crop_pct=0.875)
    readable = [i for i, (p, _) in enumerate(dataset.samples) if "broken" not in p]
    images, targets, unreadable = stage.process(collate_encoded([dataset[i] for i in readable]))
    assert targets.tolist() == [dataset.samples[i][1] for i in readable] and int(unreadable) == 0
    std = torch.tensor(STD)[:, None, None]
    for k, i in enumerate(readable):
        decoded = decode_batch([dataset.read(i)], torch.device("cpu"))[0]
        expected = transform(Image.fromarray(decoded.permute(1, 2, 0).numpy()))
        diff = ((images[k] - expected) * std * 255).abs()
        assert diff.max() <= 2.01 and diff.mean() < 0.3, (i, diff.max(), diff.mean())


# timm's RandAugment ops, each against the Pillow function timm calls, at a few magnitudes and both signs
_EXACT_OPS = ["AutoContrast", "Equalize", "Invert", "Posterize", "PosterizeIncreasing", "Solarize",
              "SolarizeIncreasing", "SolarizeAdd", "Color", "ColorIncreasing", "Contrast", "ContrastIncreasing",
              "Brightness", "BrightnessIncreasing", "Sharpness", "SharpnessIncreasing"]
_GEOMETRIC_OPS = ["Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel"]


def _ra_images(n: int = 3, size: int = 32) -> list[Image.Image]:
    rng = np.random.default_rng(7)
    return [_picture(rng, size, size) for _ in range(n)]


def _to_tensor(images: list[Image.Image]) -> torch.Tensor:
    return torch.stack([torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1) for im in images])


@pytest.mark.parametrize("name", _EXACT_OPS + _GEOMETRIC_OPS)
def test_rand_augment_op_equals_timms_pil_op(name):
    from timm.data.auto_augment import LEVEL_TO_ARG, NAME_TO_OP

    from visionssm.data.loader import patch_timm_posterize

    patch_timm_posterize()  # 0-bit posterize (magnitude 10) under current Pillow, as the PIL path runs it
    images = _ra_images()
    batch = _to_tensor(images)
    fill = (124, 116, 104)
    for magnitude in (0.0, 3.7, 9.0, 10.0):
        for negate in (False, True):
            args = level_args(name, magnitude, negate)
            level_fn = LEVEL_TO_ARG[name]
            if level_fn is not None:  # timm's argument for this magnitude, its random sign forced
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(random, "random", lambda v=0.9 if negate else 0.1: v)
                    assert args == pytest.approx(level_fn(magnitude, {})), (name, magnitude, negate)
            got = apply_op(name, batch, [args] * len(images), "bilinear", fill)
            expected = _to_tensor([NAME_TO_OP[name](im, *args, fillcolor=fill, resample=Image.BILINEAR)
                                   for im in images])
            diff = (got.int() - expected.int()).abs()
            if name in _GEOMETRIC_OPS:
                # Pillow switches to the fill where the source leaves the image, grid_sample blends the last pixel
                # with it: compared where the source is inside the image (white on black fill), one pixel in
                white = NAME_TO_OP[name](Image.new("RGB", (32, 32), (255, 255, 255)), *args, fillcolor=(0, 0, 0),
                                         resample=Image.NEAREST)
                inside = torch.from_numpy(np.array(white)[..., 0] == 255)[None, None].float()
                inside = -torch.nn.functional.max_pool2d(-inside, 3, stride=1, padding=1) > 0
                inner = diff.float()[inside.expand_as(diff)]
                assert inside.sum() > 100 and inner.mean() < 0.6 and torch.quantile(inner, 0.99) <= 3, (
                    name, magnitude, negate, inner.mean(), inner.max())
            else:
                assert diff.max() <= 1, (name, magnitude, negate, diff.max())


def test_rand_augment_policy_is_timms():
    from timm.data.auto_augment import rand_augment_transform

    fill = (124, 116, 104)
    for config in ("rand-m9-mstd0.5-inc1", "rand-m7-n3-p0.7-mstd1", "rand-m9-mstd101"):
        ours = parse_rand_augment(config, fill, None)
        theirs = rand_augment_transform(config, {"img_mean": fill, "translate_const": 100})
        assert list(ours.ops) == [op.name for op in theirs.ops]
        assert ours.num_layers == theirs.num_layers and ours.prob == theirs.ops[0].prob
        assert ours.magnitude == theirs.ops[0].magnitude and ours.magnitude_std == theirs.ops[0].magnitude_std
    with pytest.raises(ValueError, match="--aa 'v0'"):
        parse_rand_augment("v0", fill, None)


# ---------------------------------------------------------------------------------------------------------------
# Order, sharding, resume, unreadable files


def _loader(dataset, batch_size=4):
    sampler = EpochShuffleSampler(len(dataset), seed=5, tag_epoch=True)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, collate_fn=collate_encoded,
                      num_workers=0), sampler


def test_sharding_is_disjoint_and_resume_continues_the_same_order(jpeg_folder):
    """Through accelerate's own sharding and skip_first_batches, as the trainer uses them: two processes see
    disjoint batches covering the epoch's shuffle; a run resumed after batch 1 gets the uninterrupted run's later
    batches, pixels included, and no image twice."""
    from accelerate.data_loader import prepare_data_loader, skip_first_batches

    dataset = _dataset(jpeg_folder)
    stage = TrainStage(dataset, "cpu", 16, MEAN, STD, seed=2, auto_augment="rand-m9-mstd0.5-inc1")
    shards = []
    for rank in (0, 1):
        shard = prepare_data_loader(_loader(dataset)[0], num_processes=2, process_index=rank, put_on_device=False)
        shard.set_epoch(1)  # as the trainer: accelerate hands the epoch to the sampler at each iterator
        shards.append(shard)
    indices = [[i for batch in shard for i in batch.indices] for shard in shards]
    assert not set(indices[0]) & set(indices[1])
    assert len(indices[0]) == len(set(indices[0])) == len(indices[1])
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(5 * 1_000_003 + 1)).tolist()
    assert sorted(indices[0] + indices[1]) == sorted(order[:len(indices[0]) * 2])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the corrupt file
        shards[0].set_epoch(1)
        full = list(stage(shards[0]))
        shards[0].set_epoch(1)
        resumed = list(stage(skip_first_batches(shards[0], 1)))
    assert len(resumed) == len(full) - 1
    for (a, ta, _), (b, tb, _) in zip(full[1:], resumed):
        assert torch.equal(ta, tb)
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_prefetch_thread_yields_the_inline_batches(jpeg_folder):
    dataset = _dataset(jpeg_folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        batches = []
        for prefetch in (False, True):
            stage = TrainStage(dataset, "cpu", 16, MEAN, STD, seed=2, auto_augment="rand-m9-mstd0.5-inc1",
                               prefetch=prefetch)
            dl, sampler = _loader(dataset)
            sampler.set_epoch(0)
            batches.append(list(stage(dl)))
    assert len(batches[0]) == len(batches[1]) == len(dataset) // 4
    for (a, ta, ua), (b, tb, ub) in zip(*batches):
        assert torch.equal(a, b) and torch.equal(ta, tb) and int(ua) == int(ub)


def test_unreadable_file_is_named_counted_replaced_in_training_dropped_in_evaluation(jpeg_folder):
    dataset = _dataset(jpeg_folder)
    broken = next(i for i, (p, _) in enumerate(dataset.samples) if "broken" in p)
    neighbours = [broken - 1, broken, broken + 1]
    batch = collate_encoded([dataset[(0, i)] for i in neighbours])
    train = TrainStage(dataset, "cpu", 16, MEAN, STD, seed=0)
    with pytest.warns(RuntimeWarning, match=r"skipping unreadable image .*2_broken\.jpg"):
        images, targets, unreadable = train.process(batch)
    assert int(unreadable) == 1 and images.shape[0] == 3 and torch.isfinite(images).all()
    assert targets.tolist() == [dataset.samples[i][1] for i in (broken - 1, broken + 1, broken + 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # warned once per file; still counted every time
        assert int(train.process(batch)[2]) == 1

    evaluate = EvalStage(dataset, "cpu", 16, MEAN, STD, crop_pct=0.875)
    with pytest.warns(RuntimeWarning, match="2_broken"):
        images, targets, unreadable = evaluate.process(batch)
    assert int(unreadable) == 1 and images.shape[0] == 2
    assert targets.tolist() == [dataset.samples[i][1] for i in (broken - 1, broken + 1)]


# ---------------------------------------------------------------------------------------------------------------
# On the GPU


@pytest.mark.cuda
def test_cuda_nvjpeg_decode_equals_pil(decoder_folder):
    assert resolve_data_backend("auto", torch.device("cuda"), print) == "gpu"
    _decode_matches_pil(decoder_folder, "cuda")


@pytest.mark.cuda
def test_cuda_stages_equal_the_cpu_stages(jpeg_folder):
    """The GPU stages against the CPU stages on the same decoded pixels (nvJPEG's, given to both), so only the
    kernels' rounding differs: crop, resize, flip and evaluation within one grey level; RandAugment's thresholds
    (solarize, posterize) may turn a rounding step into a large one on a few pixels. The same draws, labels and
    counts; then the prefetching GPU pipeline (nvJPEG on its own stream) equals the GPU stage run inline."""
    dataset = _dataset(jpeg_folder)
    broken = {i for i, (p, _) in enumerate(dataset.samples) if "broken" in p}
    levels = torch.tensor(STD)[None, :, None, None] * 255  # normalised units -> grey levels
    cuda = torch.device("cuda")

    def stage(policy, device, prefetch=None):
        if policy == "eval":
            return EvalStage(dataset, device, 32, MEAN, STD, crop_pct=0.875, prefetch=prefetch)
        return TrainStage(dataset, device, 32, MEAN, STD, seed=1, auto_augment=policy, prefetch=prefetch)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the corrupt file
        for policy in (None, "eval", "rand-m9-mstd0.5-inc1"):
            dl, sampler = _loader(dataset)
            sampler.set_epoch(2)
            batches = list(dl)
            on_cpu, on_cuda = stage(policy, "cpu"), stage(policy, cuda)
            inline = []
            for batch in batches:
                decoded = decode_batch(batch.data, cuda)
                a, ta, ua = on_cpu.from_decoded([d.cpu() if isinstance(d, torch.Tensor) else d for d in decoded],
                                                batch)
                b, tb, ub = on_cuda.from_decoded(decoded, batch)
                inline.append((b, tb, ub))
                assert torch.equal(ta, tb.cpu()) and int(ua) == int(ub) and a.shape == b.shape
                # a corrupt file's stand-in is decoded again by each stage's own decoder: left out
                keep = [k for k in range(len(ta)) if policy == "eval" or batch.indices[k] not in broken]
                diff = ((a - b.cpu()).abs() * levels)[keep]
                if policy == "rand-m9-mstd0.5-inc1":
                    assert diff.mean() < 0.5 and (diff > 1.01).float().mean() < 0.01, (policy, diff.mean())
                else:
                    assert diff.max() <= 1.01, (policy, diff.max())
            piped = list(stage(policy, cuda, prefetch=True)(batches))
            assert len(piped) == len(inline) == len(dataset) // 4
            for (a, ta, ua), (b, tb, ub) in zip(piped, inline):
                assert torch.equal(a, b) and torch.equal(ta, tb) and int(ua) == int(ub), policy


@pytest.mark.timeout(120, method="thread")  # a regression hangs in join: end it
def test_prefetch_thread_stops_with_its_consumer_and_hands_errors_over(jpeg_folder):
    import threading

    dataset = _dataset(jpeg_folder)
    stage = TrainStage(dataset, "cpu", 16, MEAN, STD, seed=0, prefetch=True)
    readable = [i for i, (p, _) in enumerate(dataset.samples) if "broken" not in p]
    loader = [collate_encoded([dataset[(0, i)]]) for i in readable[:3]]  # one taken, two fill the queue, then its end
    batches = stage(loader)
    next(batches)
    time.sleep(0.5)  # the thread has filled the queue and waits to hand over the end
    batches.close()  # a training step that raised: the thread must end, not block the run
    assert not [t for t in threading.enumerate() if t.name == "visionssm-gpu-stage"]
    with pytest.raises(AttributeError, match="no attribute .data"):
        list(stage([object()]))
