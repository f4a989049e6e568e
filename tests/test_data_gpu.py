"""The gpu data backend (visionssm.data.gpu, gpu_augment) on CPU, where torchvision decodes on the CPU with the same
code path, and its `cuda` twins: backend selection, decoding against PIL, timm's crop draws and RandAugment ops
against timm's PIL ops, the batched resample against the per-image resize, RandAugment batched against image by
image, kernel launches per batch independent of the batch size, label order, sharding, resume order, unreadable
files."""

from __future__ import annotations

import random
import time
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

from visionssm.data.gpu import (
    EncodedImageFolder,
    EvalStage,
    TrainStage,
    Window,
    collate_encoded,
    decode_batch,
    jpeg_decoder,
    random_resized_crop_params,
    resample,
    resolve_data_backend,
)
from visionssm.data.gpu_augment import (
    PLAN_COLUMNS,
    apply_op,
    apply_rand_augment,
    draw_rand_augment,
    level_args,
    parse_rand_augment,
    plan_rand_augment,
)
from visionssm.data.loader import EpochShuffleSampler
from visionssm.training.setup import check_config
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


def _fake_nvimgcodec(decoder_error: str | None = None):
    """A stand-in for nvImageCodec's module: its Decoder raises ``decoder_error`` or is built."""
    class Decoder:
        def __init__(self, **kwargs):
            if decoder_error:
                raise RuntimeError(decoder_error)

    kinds = types.SimpleNamespace(HW_GPU_ONLY="hw", GPU_ONLY="cuda")
    return types.SimpleNamespace(Decoder=Decoder, Backend=lambda kind: kind, BackendKind=kinds,
                                 DecodeParams=lambda **kwargs: kwargs, ColorSpec=types.SimpleNamespace(SRGB=1),
                                 SampleFormat=types.SimpleNamespace(I_RGB=2))


def test_jpeg_decoder_selection_and_fallback_line(monkeypatch):
    """torchvision's decoder (None) when asked for, and off CUDA (the CPU stages' decoder); nvImageCodec's asked for
    but missing or broken: one line naming why and the extra to install, then torchvision's."""
    import visionssm.data.gpu as gpu

    said = []
    assert jpeg_decoder("nvimgcodec", torch.device("cpu"), said.append) is None and said == []
    assert jpeg_decoder("torchvision", torch.device("cuda"), said.append) is None and said == []
    with pytest.raises(ValueError, match="--jpeg-decoder must be one of torchvision, nvimgcodec"):
        jpeg_decoder("dali", torch.device("cuda"), said.append)
    monkeypatch.setattr(gpu, "_import_nvimgcodec", lambda: (None, "nvImageCodec is not installed (no module)"))
    assert jpeg_decoder("nvimgcodec", torch.device("cuda:0"), said.append) is None
    assert len(said) == 1 and "not installed" in said[0] and "visionssm[nvimgcodec-cu13]" in said[0]
    said.clear()
    monkeypatch.setattr(gpu, "_import_nvimgcodec", lambda: (_fake_nvimgcodec("Could not create decoder"), None))
    assert jpeg_decoder("nvimgcodec", torch.device("cuda:0"), said.append) is None
    assert len(said) == 1 and "cannot decode on cuda:0: Could not create decoder" in said[0]
    assert parse_config([])["jpeg_decoder"] == "torchvision"
    assert parse_config(["--jpeg-decoder", "nvimgcodec"])["jpeg_decoder"] == "nvimgcodec"
    with pytest.raises(ValueError, match="--jpeg-decoder must be one of torchvision, nvimgcodec, got 'dali'"):
        check_config(parse_config(["--jpeg-decoder", "dali"]))


def test_decode_batch_takes_the_decoders_images_and_decodes_the_rest_with_torchvision(jpeg_folder):
    """What a batched decoder returns is used as it is; files it returned None for (or a whole batch it raised on)
    are decoded one by one by torchvision, so a corrupt file is still an exception naming itself, not a gap."""
    dataset = _dataset(jpeg_folder)
    data = [dataset.read(i) for i in range(len(dataset))]
    reference = decode_batch(data, torch.device("cpu"))
    marker = torch.zeros(3, 2, 2, dtype=torch.uint8)
    calls = []

    def every_other(jpegs):
        calls.append(len(jpegs))
        return [marker if k % 2 else None for k in range(len(jpegs))]

    got = decode_batch(data, torch.device("cpu"), every_other)
    jpegs = [i for i, (p, _) in enumerate(dataset.samples) if not p.endswith(".png")]
    assert calls == [len(jpegs)]  # one batched call, JPEGs only
    for k, i in enumerate(jpegs):
        if k % 2:
            assert got[i] is marker
        elif isinstance(reference[i], Exception):
            assert type(got[i]) is type(reference[i]), dataset.samples[i][0]
        else:
            assert torch.equal(got[i], reference[i]), dataset.samples[i][0]

    def refuses(jpegs):
        raise RuntimeError("batch refused")

    for a, b in zip(decode_batch(data, torch.device("cpu"), refuses), reference):
        assert type(a) is type(b) and (isinstance(a, Exception) or torch.equal(a, b))


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


def _decode_matches_pil(folder: Path, device: str, decoder=None) -> None:
    """Each decoded file against PIL's decode of it: PNG exactly, JPEG within JPEG_TOLERANCE. One batched call, so a
    batch decoded out of order fails too."""
    dataset = _dataset(folder)
    decoded = decode_batch([dataset.read(i) for i in range(len(dataset))], torch.device(device), decoder)
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


def _per_image_resize(image: torch.Tensor, window: Window, size: tuple[int, int]) -> torch.Tensor:
    """The per-image path the batched resample replaces: crop (or, for the eval transform, resize the whole image
    and crop its centre), torch's antialiased interpolate (nearest-exact for nearest), flip; float, unrounded."""
    x = image[None].float()
    if window.shift != (0.0, 0.0):  # eval: the whole image to the resized size, then the centre crop
        resized = (round(window.h / window.scale[0]), round(window.w / window.scale[1]))
        top, left = int(window.shift[0]), int(window.shift[1])
        box = (top, top + size[0], left, left + size[1])
    else:
        x, resized, box = x[..., window.top:window.top + window.h, window.left:window.left + window.w], size, None
    if window.interpolation == "nearest":
        out = torch.nn.functional.interpolate(x, size=resized, mode="nearest-exact")[0]
    else:
        out = torch.nn.functional.interpolate(x, size=resized, mode=window.interpolation, antialias=True,
                                              align_corners=False)[0]
    if box is not None:
        out = out[:, box[0]:box[1], box[2]:box[3]]
    return out.flip(-1) if window.flip else out


# The batched resample applies the same filter weights as torch's per-image interpolate, as matrices: only float32
# rounding and summation order differ, under 1e-3 grey levels (<= 15 non-zero taps per axis here, each term within
# 2^-24 of ~330). After rounding to uint8 a pixel within that of .5 may round the other way: at most one level,
# on far fewer than 0.1% of the pixels.
RESAMPLE_TOLERANCE = {"float_max": 1e-3, "rounded_max": 1.0, "rounded_mean": 0.01, "rounded_p999": 1.0}


def _rounded(x: torch.Tensor) -> torch.Tensor:
    return torch.floor(x + 0.5).clamp(0, 255)


def _random_windows(layout: str) -> tuple[list[torch.Tensor], list[Window]]:
    """36 random images of the odd sizes above with crops (downscaled, upscaled, some exactly the output size 24 x
    24) in each interpolation, flipped or not, and eval windows (resize then centre crop); stored in the CPU
    decoder's (H, W, 3) layout, nvJPEG's (3, H, W), or a mix of both."""
    gen = torch.Generator().manual_seed(5)
    rng = random.Random(5)
    evaluate = EvalStage(None, "cpu", 24, MEAN, STD, crop_pct=0.875)  # only its window: resize to 27, crop 24
    images, windows = [], []
    for k in range(36):
        width, height = SIZES[k % len(SIZES)]
        image = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=gen).permute(2, 0, 1)
        if layout == "planar" or (layout == "mixed" and k % 2):
            image = image.contiguous()
        kind = ("bilinear", "bicubic", "nearest")[k % 3]
        if k % 6 == 5:
            window = evaluate.window(height, width)
        elif k % 6 == 4:  # the output size exactly: the filter is the identity
            window = Window.crop((rng.randint(0, height - 24), rng.randint(0, width - 24), 24, 24), (24, 24), kind,
                                 True)
        else:
            box = random_resized_crop_params(rng, width, height, (0.02, 1.0), (3 / 4, 4 / 3))
            window = Window.crop(box, (24, 24), kind, rng.random() < 0.5)
        images.append(image)
        windows.append(window)
    assert {w.h < 24 for w in windows} == {True, False}  # upscaled and downscaled crops both
    return images, windows


@pytest.mark.parametrize("layout", ["decoder", "planar", "mixed"])
def test_batched_resample_equals_the_per_image_resize(layout):
    """One batch against the per-image path within RESAMPLE_TOLERANCE (the output-sized crops exactly), and the
    batch split into chunks against one chunk."""
    images, windows = _random_windows(layout)
    size = (24, 24)
    got = resample(images, windows, size)
    expected = torch.stack([_per_image_resize(im, w, size) for im, w in zip(images, windows)])
    assert got.shape == expected.shape == (36, 3, 24, 24)
    assert (got - expected).abs().max() <= RESAMPLE_TOLERANCE["float_max"]
    diff = (_rounded(got) - _rounded(expected)).abs().flatten()
    assert diff.max() <= RESAMPLE_TOLERANCE["rounded_max"] and diff.mean() < RESAMPLE_TOLERANCE["rounded_mean"]
    assert torch.quantile(diff, 0.999) <= RESAMPLE_TOLERANCE["rounded_p999"]
    for k, w in enumerate(windows):
        if w.h == w.w == 24 and w.shift == (0.0, 0.0):
            assert torch.equal(got[k], images[k][:, w.top:w.top + 24, w.left:w.left + 24].flip(-1).float()), k
    chunked = resample(images, windows, size, chunk_elements=3 * 6 * 75 * 64)
    assert not torch.isnan(chunked).any()
    torch.testing.assert_close(chunked, got, rtol=0, atol=RESAMPLE_TOLERANCE["float_max"])


def test_resample_refuses_a_window_outside_its_image():
    image = torch.zeros(3, 10, 12, dtype=torch.uint8)
    inside = Window.crop((0, 0, 10, 12), (4, 4), "bilinear")
    with pytest.raises(ValueError, match=r"windows\[1\] = Window\(top=5.*not inside its 10 x 12 image"):
        resample([image, image], [inside, Window.crop((5, 0, 6, 12), (4, 4), "bilinear")], (4, 4))
    with pytest.raises(ValueError, match="one window per image"):
        resample([image], [inside, inside], (4, 4))


def test_stages_match_the_per_image_path_on_the_test_images(jpeg_folder):
    """The training and evaluation stages against the per-image path on the decoded test JPEGs (the draws are the
    stages' own): the stated resample tolerance after rounding, then normalised the same way."""
    dataset = _dataset(jpeg_folder)
    readable = [i for i, (p, _) in enumerate(dataset.samples) if "broken" not in p]
    batch = collate_encoded([dataset[(4, i)] for i in readable])
    decoded = decode_batch(batch.data, torch.device("cpu"))
    mean, std = torch.tensor(MEAN)[:, None, None], torch.tensor(STD)[:, None, None]
    train = TrainStage(dataset, "cpu", 20, MEAN, STD, seed=9, interpolation="random")
    evaluate = EvalStage(dataset, "cpu", 20, MEAN, STD, crop_pct=0.9, interpolation="bilinear")
    for stage in (train, evaluate):
        images = stage.from_decoded(decoded, batch)[0]
        assert images.is_contiguous() and images.shape == (len(readable), 3, 20, 20), stage
        levels = []
        for k, (i, image) in enumerate(zip(readable, decoded)):
            if stage is train:
                draw = stage.draw(4, i, image.shape[-1], image.shape[-2])
                window = Window.crop(draw["crop"], (20, 20), draw["interpolation"], draw["flip"])
            else:
                window = stage.window(*image.shape[-2:])
            expected = _rounded(_per_image_resize(image, window, (20, 20)))
            levels.append(((images[k] * std + mean) * 255 - expected).abs().flatten())
        diff = torch.cat(levels)
        # normalising and undoing it adds float32 rounding on top of the rounded levels
        assert diff.max() <= RESAMPLE_TOLERANCE["rounded_max"] + 1e-3, stage
        assert diff.mean() < RESAMPLE_TOLERANCE["rounded_mean"] and torch.quantile(diff, 0.999) <= 1.001, stage


class _AtenCounter(TorchDispatchMode):
    """Counts the aten calls that do work (views and other aliasing ops are metadata only): on a GPU each is a
    kernel launch, or a host-side op of the same cost."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _launches(stage, batch, decoded) -> int:
    with _AtenCounter() as counter:
        stage.from_decoded(decoded, batch)
    return counter.count


@pytest.mark.parametrize("policy", [None, "rand-m9-mstd0.5-inc1", "eval"])
def test_aten_calls_per_batch_do_not_grow_with_the_batch_size(jpeg_folder, policy):
    """The stage's pixel work after decoding is the same number of aten calls for 2, 7 and 26 images (the per-image
    path made a crop and a resize per image: 11 + 2N calls without RandAugment); the host only draws."""
    dataset = _dataset(jpeg_folder)
    readable = [i for i, (p, _) in enumerate(dataset.samples) if "broken" not in p]
    if policy == "eval":
        stage = EvalStage(dataset, "cpu", 16, MEAN, STD, crop_pct=0.875)
    else:
        stage = TrainStage(dataset, "cpu", 16, MEAN, STD, seed=0, auto_augment=policy)
    counts = []
    for n in (2, 7, 26):
        items = [dataset[(epoch, i)] for epoch in range(2) for i in readable][:n]
        batch = collate_encoded(items)
        decoded = decode_batch(batch.data, torch.device("cpu"))
        stage.from_decoded(decoded, batch)  # first call: caches, lazy imports
        counts.append(_launches(stage, batch, decoded))
    assert counts[0] == counts[1] == counts[2], counts
    assert counts[0] < 700, counts  # a bound that a launch per image or per drawn op would break at 26 images


@pytest.mark.parametrize("config", ["rand-m9-mstd0.5-inc1", "rand-m9-n3-p1.0-mstd101", "rand-m5-p0.0"])
def test_batched_rand_augment_equals_each_image_alone(config):
    """Per-image draws applied to a batch in one pass per layer and op family equal each image's ops applied to it
    alone, one op at a time (:func:`apply_op`), bit for bit; a layer where a family drew nothing, or where nothing was
    drawn at all (p0), leaves the batch as it was."""
    fill = (124, 116, 104)
    policy = parse_rand_augment(config, fill, None)
    images = _to_tensor(_ra_images(n=9, size=20))
    rng = random.Random(config)
    draws = [draw_rand_augment(policy, rng) for _ in range(len(images))]
    plan = {k: torch.tensor(v, dtype=torch.float64).view(-1, PLAN_COLUMNS)
            for k, v in plan_rand_augment(policy, draws, (20, 20)).items()}
    assert len(plan) == policy.num_layers * 4  # lut, blend, affine-bilinear, affine-bicubic per layer
    got = apply_rand_augment(images.clone(), plan, fill)
    for k, drawn in enumerate(draws):
        expected = images[k:k + 1]
        for op in drawn:
            if op is not None:
                expected = apply_op(op[0], expected, [op[1]], op[2], fill)
        assert torch.equal(got[k:k + 1], expected), (k, drawn)
    if config.endswith("p0.0"):
        assert all(op is None for drawn in draws for op in drawn) and torch.equal(got, images)
    else:
        assert not torch.equal(got, images)
    if config == "rand-m9-mstd0.5-inc1":  # the recipe's policy on 9 images leaves a family empty in a layer
        assert any(len(rows) == 0 for rows in plan.values())


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
            # each batch's decode and transform host time, counted on the thread that ran them
            assert stage.seconds["decode"] > 0 and stage.seconds["transform"] > 0, prefetch
    assert len(batches[0]) == len(batches[1]) == len(dataset) // 4
    for (a, ta, ua), (b, tb, ub) in zip(*batches):
        assert torch.equal(a, b) and torch.equal(ta, tb) and int(ua) == int(ub)


def test_prefetch_decodes_the_next_batch_while_it_transforms_one(jpeg_folder):
    """The prefetching stage decodes batch k + 1 while it transforms batch k: each transform waits until the
    decoder has started on the next batch (a stage that decodes and transforms on one thread would wait in vain)."""
    import threading

    from torchvision.io import decode_jpeg

    dataset = _dataset(jpeg_folder)
    readable = [i for i, (p, _) in enumerate(dataset.samples) if p.endswith(".jpg") and "broken" not in p]
    loader = [collate_encoded([dataset[(0, i)]]) for i in readable[:4]]
    started = [threading.Event() for _ in loader]

    def decoder(jpegs):  # a batched decoder that says when it starts on a batch
        started[sum(event.is_set() for event in started)].set()
        return [decode_jpeg(jpeg) for jpeg in jpegs]

    stage = TrainStage(dataset, "cpu", 16, MEAN, STD, seed=0, prefetch=True, decoder=decoder)
    transform, overlapped = stage.from_decoded, []

    def waits_for_the_next_decode(decoded, batch):
        following = len(overlapped) + 1
        overlapped.append(started[following].wait(timeout=10) if following < len(loader) else True)
        return transform(decoded, batch)

    stage.from_decoded = waits_for_the_next_decode
    assert len(list(stage(loader))) == len(loader) and all(overlapped), overlapped


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


def _nvimgcodec_decoder():
    said = []
    decoder = jpeg_decoder("nvimgcodec", torch.device("cuda"), said.append)
    if decoder is None:
        pytest.skip(said[0] if said else "no nvImageCodec decoder")
    return decoder


@pytest.mark.cuda
def test_cuda_nvimgcodec_decode_equals_pil_and_names_a_corrupt_file(decoder_folder, jpeg_folder):
    """nvImageCodec's decoder (the hardware JPEG engines where the GPU has them) against PIL as nvJPEG's above; its
    images are interleaved views, which the resample reads without a copy. On the test folder with a corrupt JPEG
    and a PNG, the corrupt file is an exception and every other file decodes, in order."""
    decoder = _nvimgcodec_decoder()
    _decode_matches_pil(decoder_folder, "cuda", decoder)
    dataset = _dataset(jpeg_folder)
    decoded = decode_batch([dataset.read(i) for i in range(len(dataset))], torch.device("cuda"), decoder)
    for (path, _), image in zip(dataset.samples, decoded):
        if "broken" in path:
            assert isinstance(image, RuntimeError), path
        else:
            expected = _pil_tensor(path)
            assert image.shape == expected.shape and _spread(image, expected)[0] < 2.0, path
    jpeg = next(d for (p, _), d in zip(dataset.samples, decoded) if p.endswith(".jpg") and "broken" not in p)
    assert jpeg.stride() == (1, 3 * jpeg.shape[-1], 3)


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


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["planar", "mixed"])
def test_cuda_batched_resample_equals_the_cpu_resample(layout):
    """The batched resample on the GPU (cuBLAS float32 matmuls) against the CPU one: the same float tolerance as
    against the per-image path; in one batch and in chunks."""
    images, windows = _random_windows(layout)
    expected = resample(images, windows, (24, 24))
    on_cuda = [image.cuda() for image in images]  # .cuda() keeps each image's layout
    for chunk_elements in (2**28, 3 * 6 * 75 * 64):
        got = resample(on_cuda, windows, (24, 24), chunk_elements=chunk_elements)
        assert got.is_cuda and not torch.isnan(got).any()
        torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=RESAMPLE_TOLERANCE["float_max"])


@pytest.mark.cuda
def test_cuda_stages_queue_their_pixel_work_without_waiting_for_the_gpu(jpeg_folder):
    """After decoding, the training stage (with the recipe's RandAugment) and the evaluation stage issue their
    kernels without a single host-device synchronisation (torch's sync debug mode raises on any): the parameters
    travel in one pinned asynchronous copy, so the host never waits for the stream it feeds."""
    dataset = _dataset(jpeg_folder)
    readable = [i for i, (p, _) in enumerate(dataset.samples) if "broken" not in p]
    batch = collate_encoded([dataset[(0, i)] for i in readable])
    decoded = decode_batch(batch.data, torch.device("cuda"))
    stages = (TrainStage(dataset, "cuda", 32, MEAN, STD, seed=1, auto_augment="rand-m9-mstd0.5-inc1", prefetch=False),
              EvalStage(dataset, "cuda", 32, MEAN, STD, crop_pct=0.875, prefetch=False))
    for stage in stages:
        stage.from_decoded(decoded, batch)  # warm-up: cuBLAS handles, pinned host blocks
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            images, targets, _ = stage.from_decoded(decoded, batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert images.shape == (len(readable), 3, 32, 32) and torch.isfinite(images).all(), stage
        assert targets.tolist() == [dataset.samples[i][1] for i in readable], stage


@pytest.mark.timeout(120, method="thread")  # a regression hangs in join: end it
def test_prefetch_thread_stops_with_its_consumer_and_hands_errors_over(jpeg_folder):
    import threading

    dataset = _dataset(jpeg_folder)
    stage = TrainStage(dataset, "cpu", 16, MEAN, STD, seed=0, prefetch=True)
    readable = [i for i, (p, _) in enumerate(dataset.samples) if "broken" not in p]
    loader = [collate_encoded([dataset[(0, i)]]) for i in readable[:8]]  # one taken, more than both queues hold
    batches = stage(loader)
    next(batches)
    time.sleep(0.5)  # both threads have filled their queues and wait to hand over more
    batches.close()  # a training step that raised: the threads must end, not block the run
    assert not [t for t in threading.enumerate() if t.name.startswith("visionssm-gpu-stage")]
    with pytest.raises(AttributeError, match="no attribute .data"):  # raised while decoding
        list(stage([object()]))

    def broken_transform(decoded, batch):
        raise ValueError("transform failed")

    stage.from_decoded = broken_transform
    with pytest.raises(ValueError, match="transform failed"):  # raised while transforming
        list(stage(loader))
    assert not [t for t in threading.enumerate() if t.name.startswith("visionssm-gpu-stage")]
