"""A generated image-classification set: procedurally drawn shapes and textures, no download.

Each class is one kind of figure (disc, square, triangle, ring, cross, four stripe/check textures, dots, and a few
more) drawn with a random foreground colour on a random background (flat or a gradient), at a random position,
size and rotation, with a few small distractor blobs and pixel noise. Every image is drawn from its own seed
``(seed, split, class, index)``, so the set is identical however many processes draw it.

The set is written as an ImageFolder (``root/train/<class>/*.png``, ``root/val/<class>/*.png``) plus
``manifest.json`` holding the parameters; it is drawn into a temporary directory and renamed when complete, so an
interrupted generation never leaves a half-written set behind.

    python -m visionssm.data.synthetic --out data/generated/shapes10 --classes 10 --train-per-class 500
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from visionssm.utils.cli import ArgumentParser, UserValueError, run_main

__all__ = ["CLASS_NAMES", "SyntheticSpec", "draw_image", "ensure_synthetic_dataset", "main"]

_SUPERSAMPLE = 2  # drawn at twice the size and downsampled: smooth edges at tiny sizes


def _colour(rng: np.random.Generator) -> tuple[int, int, int]:
    return tuple(int(c) for c in rng.integers(0, 256, size=3))


def _contrasting(rng: np.random.Generator, other: tuple[int, int, int]) -> tuple[int, int, int]:
    """A random colour far enough from ``other`` that the figure stays visible."""
    for _ in range(64):
        colour = _colour(rng)
        if sum(abs(a - b) for a, b in zip(colour, other)) > 200:
            return colour
    return tuple(255 - c for c in other)


def _rotated_polygon(cx, cy, radius, angle, corners):
    return [(cx + radius * math.cos(angle + 2 * math.pi * k / corners),
             cy + radius * math.sin(angle + 2 * math.pi * k / corners)) for k in range(corners)]


def _texture_mask(kind: str, size: int, rng: np.random.Generator) -> np.ndarray:
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float32)
    period = rng.uniform(0.12, 0.25) * size
    phase = rng.uniform(0, 2 * math.pi)
    jitter = rng.uniform(-0.15, 0.15)  # slight tilt, so the direction is a distribution, not one exact angle
    if kind == "hstripes":
        coord = ys + jitter * xs
    elif kind == "vstripes":
        coord = xs + jitter * ys
    elif kind == "diagonal":
        sign = 1.0 if rng.random() < 0.5 else -1.0
        coord = (xs + sign * ys) / math.sqrt(2.0)
    elif kind == "checker":
        a = np.sin(2 * math.pi * xs / period + phase)
        b = np.sin(2 * math.pi * ys / period + rng.uniform(0, 2 * math.pi))
        return (a * b) > 0
    else:
        raise ValueError(f"unknown texture {kind!r}")
    return np.sin(2 * math.pi * coord / period + phase) > 0


def _region(size, rng, lo=0.45, hi=0.9):
    """A random axis-aligned rectangle covering a good part of the image."""
    w = int(size * rng.uniform(lo, hi))
    h = int(size * rng.uniform(lo, hi))
    x0 = int(rng.integers(0, size - w + 1))
    y0 = int(rng.integers(0, size - h + 1))
    return x0, y0, w, h


def _figure(kind: str) -> Callable:
    def draw(canvas: Image.Image, size: int, rng: np.random.Generator, fg) -> None:
        d = ImageDraw.Draw(canvas)
        radius = size * rng.uniform(0.18, 0.34)
        cx = rng.uniform(radius, size - radius)
        cy = rng.uniform(radius, size - radius)
        angle = rng.uniform(0, 2 * math.pi)
        if kind == "disc":
            d.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], fill=fg)
        elif kind == "square":
            d.polygon(_rotated_polygon(cx, cy, radius * 1.2, angle, 4), fill=fg)
        elif kind == "triangle":
            d.polygon(_rotated_polygon(cx, cy, radius * 1.25, angle, 3), fill=fg)
        elif kind == "hexagon":
            d.polygon(_rotated_polygon(cx, cy, radius * 1.15, angle, 6), fill=fg)
        elif kind == "ring":
            width = max(2, int(radius * rng.uniform(0.25, 0.4)))
            d.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], outline=fg, width=width)
        elif kind in ("cross", "xcross"):
            width = radius * rng.uniform(0.28, 0.4)
            base = angle % (math.pi / 2) * 0.25 + (math.pi / 4 if kind == "xcross" else 0.0)
            for arm in (base, base + math.pi / 2):
                dx, dy = math.cos(arm), math.sin(arm)
                px, py = -dy * width / 2, dx * width / 2
                ex, ey = dx * radius, dy * radius
                d.polygon([(cx - ex + px, cy - ey + py), (cx + ex + px, cy + ey + py),
                           (cx + ex - px, cy + ey - py), (cx - ex - px, cy - ey - py)], fill=fg)
        elif kind == "star":
            points = []
            for k in range(10):
                r = radius * (1.2 if k % 2 == 0 else 0.5)
                a = angle + math.pi * k / 5
                points.append((cx + r * math.cos(a), cy + r * math.sin(a)))
            d.polygon(points, fill=fg)
        elif kind == "dots":
            x0, y0, w, h = _region(size, rng)
            step = size * rng.uniform(0.14, 0.22)
            dot = step * rng.uniform(0.22, 0.32)
            y = y0 + step / 2
            while y < y0 + h:
                x = x0 + step / 2
                while x < x0 + w:
                    d.ellipse([x - dot, y - dot, x + dot, y + dot], fill=fg)
                    x += step
                y += step
        else:
            raise ValueError(f"unknown figure {kind!r}")
    return draw


def _texture(kind: str) -> Callable:
    def draw(canvas: Image.Image, size: int, rng: np.random.Generator, fg) -> None:
        x0, y0, w, h = _region(size, rng)
        mask = np.zeros((size, size), dtype=bool)
        mask[y0:y0 + h, x0:x0 + w] = _texture_mask(kind, size, rng)[y0:y0 + h, x0:x0 + w]
        pixels = np.asarray(canvas).copy()
        pixels[mask] = fg
        canvas.paste(Image.fromarray(pixels))
    return draw


# Class order is part of the data set's definition: class i is always the same figure.
CLASS_NAMES: tuple[str, ...] = (
    "disc", "square", "triangle", "ring", "cross", "hstripes", "vstripes", "checker", "diagonal", "dots",
    "star", "hexagon", "xcross",
)
_DRAW = {name: (_texture(name) if name in ("hstripes", "vstripes", "checker", "diagonal") else _figure(name))
         for name in CLASS_NAMES}


def draw_image(class_index: int, size: int, rng: np.random.Generator) -> Image.Image:
    """One image of class ``class_index`` at ``size`` x ``size`` pixels, drawn from ``rng``."""
    if not 0 <= class_index < len(CLASS_NAMES):
        raise ValueError(f"class_index must be in [0, {len(CLASS_NAMES)}), got {class_index}")
    big = size * _SUPERSAMPLE
    bg = _colour(rng)
    canvas = Image.new("RGB", (big, big), bg)
    if rng.random() < 0.5:  # a soft gradient background half of the time
        other = np.array(_colour(rng), dtype=np.float32)
        t = np.linspace(0.0, 1.0, big, dtype=np.float32)
        t = t[None, :, None] if rng.random() < 0.5 else t[:, None, None]
        pixels = np.array(bg, dtype=np.float32) * (1 - 0.5 * t) + other * 0.5 * t
        canvas = Image.fromarray(np.broadcast_to(pixels, (big, big, 3)).astype(np.uint8))
    mean_bg = tuple(int(c) for c in np.asarray(canvas).reshape(-1, 3).mean(0))
    fg = _contrasting(rng, mean_bg)
    _DRAW[CLASS_NAMES[class_index]](canvas, big, rng, fg)
    d = ImageDraw.Draw(canvas)
    for _ in range(int(rng.integers(0, 4))):  # small distractor blobs of other colours
        r = big * rng.uniform(0.03, 0.07)
        x, y = rng.uniform(0, big, size=2)
        d.ellipse([x - r, y - r, x + r, y + r], fill=_colour(rng))
    image = canvas.resize((size, size), Image.Resampling.BILINEAR)
    noisy = np.asarray(image, dtype=np.float32) + rng.normal(0.0, rng.uniform(2.0, 12.0), size=(size, size, 3))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


@dataclass(frozen=True)
class SyntheticSpec:
    """Everything that determines the generated set (stored in ``manifest.json``)."""

    classes: int = 10
    train_per_class: int = 300
    val_per_class: int = 50
    image_size: int = 32
    seed: int = 0
    version: int = 1  # bump when the drawing code changes, so an old set on disk is not silently reused

    def __post_init__(self):
        if not 2 <= self.classes <= len(CLASS_NAMES):
            raise UserValueError(f"classes must be in [2, {len(CLASS_NAMES)}], got {self.classes}")
        for name in ("train_per_class", "val_per_class"):
            if getattr(self, name) < 1:
                raise UserValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.image_size < 8:
            raise UserValueError(f"image_size must be >= 8, got {self.image_size}")


def _draw_class(args) -> None:
    spec, split_index, split, class_index, root = args
    folder = Path(root) / split / f"{class_index:02d}_{CLASS_NAMES[class_index]}"
    folder.mkdir(parents=True, exist_ok=True)
    count = spec.train_per_class if split == "train" else spec.val_per_class
    for i in range(count):
        rng = np.random.default_rng([spec.seed, split_index, class_index, i])
        draw_image(class_index, spec.image_size, rng).save(folder / f"{i:06d}.png")


def ensure_synthetic_dataset(root: str | os.PathLike, spec: SyntheticSpec | None = None, workers: int = 0,
                             verbose: bool = True) -> Path:
    """Return ``root`` holding the set described by ``spec``, drawing it first if it is not there yet.

    An existing ``root`` is reused only when its manifest matches ``spec``; a different set there is an error
    (pick another directory rather than silently training on something else).
    """
    spec = spec or SyntheticSpec()
    root = Path(root)
    manifest = root / "manifest.json"
    if manifest.is_file():
        found = json.loads(manifest.read_text())
        if found != asdict(spec):
            raise UserValueError(f"{root} holds a generated set with different parameters ({found}); "
                             f"wanted {asdict(spec)}: remove it or choose another directory")
        return root
    if root.exists() and not root.is_dir():
        raise UserValueError(f"{root} is a file, not a directory for the generated set")
    if root.exists() and any(root.iterdir()):
        raise UserValueError(f"{root} exists, is not empty and has no manifest.json: not overwriting it")
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserValueError(f"cannot write the generated set to {root}: {error.strerror or error}") from None
    tmp = root.parent / f".tmp-{root.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    start = time.perf_counter()
    jobs = [(spec, split_index, split, c, str(tmp))
            for split_index, split in enumerate(("train", "val")) for c in range(spec.classes)]
    workers = workers or min(len(jobs), os.cpu_count() or 1)
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            list(pool.map(_draw_class, jobs))
    else:
        for job in jobs:
            _draw_class(job)
    (tmp / "manifest.json").write_text(json.dumps(asdict(spec), indent=1))
    if root.exists():
        root.rmdir()  # empty (checked above)
    os.replace(tmp, root)
    if verbose:
        n = spec.classes * (spec.train_per_class + spec.val_per_class)
        print(f"generated {n} images ({spec.classes} classes, {spec.image_size}px) in {root} "
              f"in {time.perf_counter() - start:.1f} s", flush=True)
    return root


def _main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m visionssm.data.synthetic", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory to write (ImageFolder layout)")
    defaults = SyntheticSpec()
    parser.add_argument("--classes", type=int, default=defaults.classes,
                        help=f"number of classes, 2 to {len(CLASS_NAMES)} (default {defaults.classes})")
    parser.add_argument("--train-per-class", type=int, default=defaults.train_per_class,
                        help=f"training images per class (default {defaults.train_per_class})")
    parser.add_argument("--val-per-class", type=int, default=defaults.val_per_class,
                        help=f"validation images per class (default {defaults.val_per_class})")
    parser.add_argument("--image-size", type=int, default=defaults.image_size,
                        help=f"image side in pixels, at least 8 (default {defaults.image_size})")
    parser.add_argument("--seed", type=int, default=defaults.seed, help=f"drawing seed (default {defaults.seed})")
    parser.add_argument("--workers", type=int, default=0, help="processes drawing in parallel (0: all cores)")
    args = parser.parse_args(argv)
    if args.workers < 0:
        raise UserValueError(f"--workers must be >= 0, got {args.workers}")
    spec = SyntheticSpec(classes=args.classes, train_per_class=args.train_per_class,
                         val_per_class=args.val_per_class, image_size=args.image_size, seed=args.seed)
    ensure_synthetic_dataset(args.out, spec, workers=args.workers)


def main(argv=None) -> int:
    return run_main(_main, argv, prog="python -m visionssm.data.synthetic")


if __name__ == "__main__":
    raise SystemExit(main())
