"""Generated moving-object videos written in the exact GOT-10k and LaSOT layouts.

Each video has a cluttered background (a smooth colour field, noise and static blobs), one textured target
(rectangle or ellipse with its own colour and stripe pattern) that drifts, bounces off the borders and changes
scale, one or two moving distractors of a different appearance and, in some videos, a few frames where the target
disappears (GOT-10k: ``absence=1, cover=0``; LaSOT: ``full_occlusion=1`` and a ``0,0,0,0`` box). The ground truth is
the exact rectangle the target was drawn into, so a perfect tracker scores IoU 1.

Used by the CPU tests (tiny videos), by the smoke config and by the GPU training check::

    python -m visionssm.tracking.data.synthetic got10k /tmp/got10k --train 200 --val 20 --test 5
    python -m visionssm.tracking.data.synthetic lasot /tmp/lasot --categories cube ball --per-category 4
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor

import cv2
import numpy as np

from visionssm.utils.cli import ArgumentParser, UserValueError, run_main


def _smooth_field(rng: np.random.Generator, height: int, width: int, cells: int = 5) -> np.ndarray:
    coarse = rng.uniform(0, 255, size=(cells, cells, 3)).astype(np.float32)
    return cv2.resize(coarse, (width, height), interpolation=cv2.INTER_CUBIC)


def _texture(rng: np.random.Generator, size: int = 32) -> np.ndarray:
    """A colour with stripes or checks of a second colour: an appearance the template can identify."""
    base = rng.uniform(0, 255, size=3)
    second = np.clip(base + rng.choice([-1, 1], size=3) * rng.uniform(60, 140, size=3), 0, 255)
    yy, xx = np.mgrid[0:size, 0:size]
    period = rng.integers(4, 12)
    kind = rng.integers(3)
    if kind == 0:
        pattern = (xx // period) % 2
    elif kind == 1:
        pattern = ((xx + yy) // period) % 2
    else:
        pattern = ((xx // period) + (yy // period)) % 2
    tex = np.where(pattern[..., None] == 1, second, base).astype(np.float32)
    return tex


class _Mover:
    """A textured shape moving with constant velocity, bouncing off the image border, with a drifting scale."""

    def __init__(self, rng: np.random.Generator, width: int, height: int, scale: tuple[float, float]):
        self.rng = rng
        self.W, self.H = width, height
        self.w = rng.uniform(*scale) * width
        self.h = self.w * rng.uniform(0.5, 2.0)
        self.h = float(np.clip(self.h, 8, 0.6 * height))
        self.w = float(np.clip(self.w, 8, 0.6 * width))
        self.x = rng.uniform(0, width - self.w)
        self.y = rng.uniform(0, height - self.h)
        speed = rng.uniform(0.01, 0.04) * min(width, height)
        angle = rng.uniform(0, 2 * np.pi)
        self.vx, self.vy = speed * np.cos(angle), speed * np.sin(angle)
        self.texture = _texture(rng)
        self.ellipse = bool(rng.integers(2))

    def step(self):
        growth = float(np.exp(self.rng.normal(0, 0.02)))
        cx, cy = self.x + self.w / 2, self.y + self.h / 2
        self.w = float(np.clip(self.w * growth, 8, 0.6 * self.W))
        self.h = float(np.clip(self.h * growth, 8, 0.6 * self.H))
        cx, cy = cx + self.vx, cy + self.vy
        # Bounce so that the centre stays inside the image (the box itself may leave it partly).
        if not 0 <= cx < self.W:
            self.vx = -self.vx
            cx = float(np.clip(cx, 0, self.W - 1))
        if not 0 <= cy < self.H:
            self.vy = -self.vy
            cy = float(np.clip(cy, 0, self.H - 1))
        self.x, self.y = cx - self.w / 2, cy - self.h / 2

    def box(self) -> np.ndarray:
        """The integer rectangle the shape is drawn into (x, y, w, h), before clipping to the image."""
        x0, y0 = int(round(self.x)), int(round(self.y))
        return np.array([x0, y0, max(int(round(self.w)), 1), max(int(round(self.h)), 1)], dtype=np.float64)

    def draw(self, image: np.ndarray):
        x0, y0, w, h = (int(v) for v in self.box())
        patch = cv2.resize(self.texture, (w, h), interpolation=cv2.INTER_NEAREST)
        mask = np.ones((h, w), dtype=bool)
        if self.ellipse:
            yy, xx = np.mgrid[0:h, 0:w]
            mask = ((xx + 0.5 - w / 2) / (w / 2)) ** 2 + ((yy + 0.5 - h / 2) / (h / 2)) ** 2 <= 1.0
        ix0, iy0 = max(x0, 0), max(y0, 0)
        ix1, iy1 = min(x0 + w, image.shape[1]), min(y0 + h, image.shape[0])
        if ix1 <= ix0 or iy1 <= iy0:
            return
        sub_mask = mask[iy0 - y0 : iy1 - y0, ix0 - x0 : ix1 - x0]
        region = image[iy0:iy1, ix0:ix1]
        region[sub_mask] = patch[iy0 - y0 : iy1 - y0, ix0 - x0 : ix1 - x0][sub_mask]


def render_video(
    seed: int, num_frames: int, width: int, height: int, occlusion_prob: float = 0.5
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """Frames (RGB uint8), boxes (N, 4), absent flags (N,) and visible eighths (N,) of one generated video."""
    rng = np.random.default_rng(seed)
    background = _smooth_field(rng, height, width)
    for _ in range(int(rng.integers(3, 8))):
        bw, bh = rng.integers(width // 12, width // 4), rng.integers(height // 12, height // 4)
        bx, by = rng.integers(0, width - bw), rng.integers(0, height - bh)
        background[by : by + bh, bx : bx + bw] = rng.uniform(0, 255, size=3)
    target = _Mover(rng, width, height, scale=(0.08, 0.2))
    distractors = [_Mover(rng, width, height, scale=(0.06, 0.2)) for _ in range(int(rng.integers(1, 3)))]
    absent = np.zeros(num_frames, dtype=bool)
    if num_frames >= 10 and rng.uniform() < occlusion_prob:
        start = int(rng.integers(2, num_frames - 4))
        absent[start : start + int(rng.integers(1, 4))] = True
    frames, boxes, cover = [], [], []
    for t in range(num_frames):
        if t > 0:
            target.step()
            for d in distractors:
                d.step()
        image = background + rng.normal(0, 6, size=background.shape).astype(np.float32)
        for d in distractors:
            d.draw(image)
        box = target.box()
        if not absent[t]:
            target.draw(image)
        inside_w = max(0.0, min(box[0] + box[2], width) - max(box[0], 0))
        inside_h = max(0.0, min(box[1] + box[3], height) - max(box[1], 0))
        fraction = 0.0 if absent[t] else inside_w * inside_h / (box[2] * box[3])
        frames.append(np.clip(image, 0, 255).astype(np.uint8))
        boxes.append(box)
        cover.append(int(np.floor(fraction * 8 + 1e-9)) if fraction < 1 else 8)
    cover = np.asarray(cover)
    absent = absent | (cover == 0)
    return frames, np.stack(boxes), absent, cover


def _write_jpg(path: str, rgb: np.ndarray):
    if not cv2.imwrite(path, cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 92]):
        raise OSError(f"could not write {path}")


def _frames_count(rng: np.random.Generator, num_frames: tuple[int, int] | int) -> int:
    if isinstance(num_frames, int):
        return num_frames
    return int(rng.integers(num_frames[0], num_frames[1] + 1))


def _write_got10k_sequence(args):
    seq_dir, seed, n, width, height, split = args
    frames, boxes, absent, cover = render_video(seed, n, width, height)
    os.makedirs(seq_dir, exist_ok=True)
    for t, frame in enumerate(frames):
        _write_jpg(os.path.join(seq_dir, f"{t + 1:08d}.jpg"), frame)
    gt = boxes[:1] if split == "test" else boxes
    np.savetxt(os.path.join(seq_dir, "groundtruth.txt"), gt, fmt="%.4f", delimiter=",")
    if split == "test":
        return
    cut = ((boxes[:, 0] < 0) | (boxes[:, 1] < 0) | (boxes[:, :2] + boxes[:, 2:] > [width, height]).any(1)).astype(int)
    np.savetxt(os.path.join(seq_dir, "absence.label"), absent.astype(int), fmt="%d")
    np.savetxt(os.path.join(seq_dir, "cover.label"), cover, fmt="%d")
    np.savetxt(os.path.join(seq_dir, "cut_by_image.label"), cut, fmt="%d")
    with open(os.path.join(seq_dir, "meta_info.ini"), "w") as f:
        f.write(
            "[METAINFO]\nurl: generated\nbegin: 00:00:00\nend: 00:00:10\nanno_fps: 10Hz\n"
            "object_class: shape\nmotion_class: drifting\nmajor_class: synthetic\nroot_class: object\n"
            f"motion_adverb: linearly\nresolution: ({width}, {height})\n"
        )


def make_got10k(
    root: str,
    num_sequences: dict[str, int] | None = None,
    num_frames: tuple[int, int] | int = (30, 50),
    image_size: tuple[int, int] = (160, 120),
    seed: int = 0,
    workers: int = 0,
) -> str:
    """Write generated videos as ``<root>/{train,val,test}/`` in GOT-10k's layout; returns ``root``."""
    num_sequences = {"train": 4, "val": 2, "test": 1} if num_sequences is None else num_sequences
    width, height = image_size
    jobs = []
    for split_index, (split, count) in enumerate(num_sequences.items()):
        if split not in ("train", "val", "test"):
            raise ValueError(f"GOT-10k split must be train, val or test, got {split!r}")
        split_dir = os.path.join(root, split)
        os.makedirs(split_dir, exist_ok=True)
        names = [f"GOT-10k_{split.capitalize()}_{i + 1:06d}" for i in range(count)]
        with open(os.path.join(split_dir, "list.txt"), "w") as f:
            f.write("\n".join(names) + "\n")
        rng = np.random.default_rng([seed, split_index])
        for i, name in enumerate(names):
            n = _frames_count(rng, num_frames)
            jobs.append((os.path.join(split_dir, name), seed * 1_000_003 + split_index * 100_003 + i, n, width, height,
                         split))
    _run(jobs, _write_got10k_sequence, workers)
    return root


def _write_lasot_sequence(args):
    seq_dir, seed, n, width, height, category = args
    frames, boxes, absent, _ = render_video(seed, n, width, height)
    os.makedirs(os.path.join(seq_dir, "img"), exist_ok=True)
    for t, frame in enumerate(frames):
        _write_jpg(os.path.join(seq_dir, "img", f"{t + 1:08d}.jpg"), frame)
    boxes = boxes.copy()
    # LaSOT marks frames without a visible target with a full-occlusion flag and an all-zero box.
    occluded = absent
    boxes[occluded] = 0
    np.savetxt(os.path.join(seq_dir, "groundtruth.txt"), boxes, fmt="%d", delimiter=",")
    with open(os.path.join(seq_dir, "full_occlusion.txt"), "w") as f:
        f.write(",".join(str(int(v)) for v in occluded) + "\n")
    with open(os.path.join(seq_dir, "out_of_view.txt"), "w") as f:
        f.write(",".join("0" for _ in occluded) + "\n")
    with open(os.path.join(seq_dir, "nlp.txt"), "w") as f:
        f.write(f"the textured {category} moving across the frame\n")


def make_lasot(
    root: str,
    categories: tuple[str, ...] = ("cube", "ball"),
    per_category: int = 3,
    test_per_category: int = 1,
    num_frames: tuple[int, int] | int = (30, 50),
    image_size: tuple[int, int] = (160, 120),
    seed: int = 0,
    workers: int = 0,
) -> str:
    """Write generated videos as ``<root>/<category>/<category>-<n>/`` in LaSOT's layout; returns ``root``."""
    if not 0 <= test_per_category <= per_category:
        raise UserValueError("--test-per-category must be between 0 and --per-category")
    width, height = image_size
    rng = np.random.default_rng([seed, 7])
    jobs, train, test = [], [], []
    for c, category in enumerate(categories):
        for k in range(1, per_category + 1):
            name = f"{category}-{k}"
            (test if k <= test_per_category else train).append(name)
            n = _frames_count(rng, num_frames)
            jobs.append((os.path.join(root, category, name), seed * 1_000_003 + 500_009 + c * 1000 + k, n, width,
                         height, category))
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "training_set.txt"), "w") as f:
        f.write("\n".join(train) + ("\n" if train else ""))
    with open(os.path.join(root, "testing_set.txt"), "w") as f:
        f.write("\n".join(test) + ("\n" if test else ""))
    _run(jobs, _write_lasot_sequence, workers)
    return root


def _run(jobs, fn, workers: int):
    if workers and workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            list(pool.map(fn, jobs, chunksize=4))
    else:
        for job in jobs:
            fn(job)


PROG = "python -m visionssm.tracking.data.synthetic"


def _main(argv=None) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("layout", choices=["got10k", "lasot"], help="which benchmark's folder layout to write")
    parser.add_argument("root", help="folder to write the videos into")
    parser.add_argument("--train", type=int, default=20, help="GOT-10k train sequences")
    parser.add_argument("--val", type=int, default=5, help="GOT-10k val sequences")
    parser.add_argument("--test", type=int, default=2, help="GOT-10k test sequences")
    parser.add_argument("--categories", nargs="+", default=["cube", "ball"], help="LaSOT categories")
    parser.add_argument("--per-category", type=int, default=4, help="LaSOT sequences per category")
    parser.add_argument("--test-per-category", type=int, default=1, help="LaSOT test sequences per category")
    parser.add_argument("--frames", type=int, nargs=2, default=(40, 80), metavar=("MIN", "MAX"),
                        help="frames per video, drawn between MIN and MAX")
    parser.add_argument("--size", type=int, nargs=2, default=(320, 240), metavar=("W", "H"), help="frame size")
    parser.add_argument("--seed", type=int, default=0, help="drawing seed")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes drawing in parallel")
    args = parser.parse_args(argv)
    for flag, value, minimum in (("--train", args.train, 0), ("--val", args.val, 0), ("--test", args.test, 0),
                                 ("--per-category", args.per_category, 1), ("--workers", args.workers, 0),
                                 ("--frames MIN", args.frames[0], 2), ("--size", min(args.size), 8)):
        if value < minimum:
            raise UserValueError(f"{flag} must be >= {minimum}, got {value}")
    if args.frames[0] > args.frames[1]:
        raise UserValueError(f"--frames MIN MAX: MIN {args.frames[0]} is above MAX {args.frames[1]}")
    if os.path.exists(args.root) and not os.path.isdir(args.root):
        raise UserValueError(f"root {args.root} is a file, not a folder to write videos into")
    frames = tuple(args.frames)
    if args.layout == "got10k":
        splits = {k: v for k, v in (("train", args.train), ("val", args.val), ("test", args.test)) if v > 0}
        make_got10k(args.root, splits, frames, tuple(args.size), args.seed, args.workers)
    else:
        make_lasot(args.root, tuple(args.categories), args.per_category, args.test_per_category, frames,
                   tuple(args.size), args.seed, args.workers)
    print(f"wrote {args.layout} layout under {args.root}")
    return 0


def main(argv=None) -> int:
    return run_main(_main, argv, prog=PROG)


if __name__ == "__main__":
    raise SystemExit(main())
