#!/usr/bin/env python
"""Whole-run ImageNet training throughput beside the model step's, per data backend, in one call.

1. Writes an ImageNet-like JPEG ImageFolder once (500x375, quality 90, 100 classes, fixed seed; ``--images`` training
   and ``--val-images`` validation images, drawn in parallel).
2. Measures the model step alone: the recipe's model, optimizer, batch, amp, channels_last and compile setting on
   synthetic tensors already on the GPU (forward, loss, backward, optimizer step).
3. Runs ``visionssm-train`` with each ``--backends`` entry for ``--epochs`` epochs and takes epochs 2..E: the training
   loop's img/s and the whole run's (training images over the wall time between the first and last epoch's
   records: evaluation, checkpoints and loader starts included).

Prints a table with the ratios to the model step and writes JSON and CSV (GPU, CPU cores, versions, date):

    python benchmarks/train_throughput.py --images 12800 --epochs 3 \\
        --models mamba_vision_T gka_vision_T comba_vision_S --batch-size 256 --workers 14 --amp bf16
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WIDTH, HEIGHT, QUALITY = 500, 375, 90


def _draw(job: tuple[Path, int, int, int]) -> None:
    """One photo-like image: a smooth colour field, a few shapes, grain (JPEG sizes near ImageNet's)."""
    from PIL import Image, ImageDraw

    path, seed, label, index = job
    rng = np.random.default_rng([seed, label, index])
    field = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    image = Image.fromarray(field).resize((WIDTH, HEIGHT), Image.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(3, 9))):
        x, y = int(rng.integers(0, WIDTH)), int(rng.integers(0, HEIGHT))
        r = int(rng.integers(10, 120))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x - r, y - r, x + r, y + r), fill=colour)
    grain = rng.integers(-20, 21, (HEIGHT, WIDTH, 3), dtype=np.int16)
    pixels = np.clip(np.asarray(image, dtype=np.int16) + grain, 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(path, quality=QUALITY)


def write_set(root: Path, images: int, val_images: int, classes: int, seed: int, workers: int) -> Path:
    """The JPEG ImageFolder under ``root`` (kept when its manifest matches; written into a temporary folder and
    renamed, so an interrupted write leaves nothing that looks complete)."""
    spec = {"images": images, "val_images": val_images, "classes": classes, "seed": seed, "size": [WIDTH, HEIGHT],
            "quality": QUALITY}
    manifest = root / "manifest.json"
    if manifest.is_file() and json.loads(manifest.read_text()) == spec:
        return root
    tmp = root.with_name(root.name + ".tmp")
    jobs = []
    for split, count, offset in (("train", images, 0), ("val", val_images, 10**7)):
        for k in range(count):
            label = k % classes
            folder = tmp / split / f"n{label:04d}"
            folder.mkdir(parents=True, exist_ok=True)
            jobs.append((folder / f"{offset + k:08d}.JPEG", seed, label, offset + k))
    start = time.perf_counter()
    with Pool(workers) as pool:
        pool.map(_draw, jobs, chunksize=64)
    (tmp / "manifest.json").write_text(json.dumps(spec))
    if root.exists():
        import shutil

        shutil.rmtree(root)
    os.replace(tmp, root)
    print(f"wrote {len(jobs)} JPEGs to {root} in {time.perf_counter() - start:.1f} s", flush=True)
    return root


def model_step(model_name: str, batch: int, amp: str, compile_mode, steps: int, warmup: int, classes: int) -> float:
    """img/s of the recipe's training step on synthetic tensors already on the GPU."""
    import torch

    from visionssm.training.setup import build_optimizer, create_model
    from visionssm.training.state import parse_config

    cfg = parse_config(["--config", model_name, "--batch-size", str(batch)])
    device = torch.device("cuda")
    model = create_model(cfg, classes).to(device).to(memory_format=torch.channels_last)
    if compile_mode:
        model.compile(mode=None if compile_mode is True else compile_mode)
    optimizer, _, _ = build_optimizer(cfg, model, world=1)
    images = torch.randn(batch, 3, 224, 224, device=device).contiguous(memory_format=torch.channels_last)
    targets = torch.randint(0, classes, (batch,), device=device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    scaler = torch.amp.GradScaler("cuda", enabled=amp == "fp16")

    def step():
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(images), targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - start)


def stage_alone(model_name: str, data: Path, batch: int, workers: int, batches: int) -> dict:
    """img/s of the gpu data backend alone on the training split (the recipe's augmentation, no model): nvJPEG
    decode only, and decode + augmentation; what the GPU path can feed at most."""
    import torch
    from torch.utils.data import DataLoader

    from visionssm.data.gpu import EncodedImageFolder, TrainStage, collate_encoded, decode_batch
    from visionssm.data.loader import EpochShuffleSampler
    from visionssm.training.state import parse_config

    cfg = parse_config(["--config", model_name])
    dataset = EncodedImageFolder(data / "train", augment_seed=0)
    loader = DataLoader(dataset, batch_size=batch, sampler=EpochShuffleSampler(len(dataset), 0, tag_epoch=True),
                        num_workers=workers, collate_fn=collate_encoded, drop_last=True, persistent_workers=True)
    stage = TrainStage(dataset, "cuda", 224, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), seed=0,
                       scale=cfg["scale"], ratio=cfg["ratio"], hflip=cfg["hflip"],
                       interpolation=cfg["train_interpolation"], auto_augment=cfg["aa"], prefetch=False)
    encoded = []
    for k, item in enumerate(loader):
        encoded.append(item)
        if k + 1 == batches:
            break
    rates = {}
    for name, work in (("decode_img_per_s", lambda b: decode_batch(b.data, torch.device("cuda"))),
                       ("stage_img_per_s", stage.process)):
        work(encoded[0])  # warm-up: nvJPEG handles, kernels
        torch.cuda.synchronize()
        start = time.perf_counter()
        for item in encoded:
            work(item)
        torch.cuda.synchronize()
        rates[name] = batch * len(encoded) / (time.perf_counter() - start)
    return rates


def whole_run(model_name: str, backend: str, data: Path, args) -> dict:
    """``visionssm-train`` for ``args.epochs`` epochs; the figures of epochs 2..E from its metrics."""
    with tempfile.TemporaryDirectory(prefix=f"tput-{model_name}-{backend}-") as out:
        command = [sys.executable, "-m", "visionssm.train", "--config", model_name, "--data-dir", str(data),
                   "--output", out, "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
                   "--workers", str(args.workers), "--amp", args.amp, "--data-backend", backend,
                   "--log-interval", "1000"]
        if args.compile:
            command += ["--compile"] + ([] if args.compile is True else [args.compile])
        command += shlex.split(args.train_args)
        start = time.perf_counter()
        proc = subprocess.run(command, env=dict(os.environ, TQDM_DISABLE="1"), capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        config = (Path(out) / "config.yaml").read_text()
    later = records[1:]
    per_epoch = _epoch_images(config)
    span = later[-1]["wall_time"] - records[0]["wall_time"]  # epoch 1's checkpoint to epoch E's evaluation
    loop_seconds = sum(per_epoch / r["train_img_per_s"] for r in later)
    return {"model": model_name, "backend": backend, "epochs": args.epochs,
            "loop_img_per_s": per_epoch * len(later) / loop_seconds,
            "whole_run_img_per_s": per_epoch * len(later) / span,
            "fixed_seconds_per_epoch": (span - loop_seconds) / len(later),
            "val_top1_last": records[-1]["val_top1"], "run_wall_s": wall,
            "skipped_images": sum(r["skipped_images"] for r in records)}


def _epoch_images(config_text: str) -> int:
    import yaml

    config = yaml.safe_load(config_text)
    return config["updates_per_epoch"] * config["global_batch"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=12_800, help="training images (validation: --val-images)")
    parser.add_argument("--val-images", type=int, default=None, help="default: images / 10")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", type=Path, default=None, help="default: data/generated/imagenet_like_<N>")
    parser.add_argument("--models", nargs="+", default=["mamba_vision_T", "gka_vision_T", "comba_vision_S"])
    parser.add_argument("--backends", nargs="+", default=["pil", "gpu"], choices=["pil", "gpu"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--amp", default="bf16", choices=["bf16", "fp16", "no"])
    parser.add_argument("--compile", nargs="?", const=True, default=None, metavar="MODE")
    parser.add_argument("--train-args", default="", help="more visionssm-train flags for the whole runs, one string")
    parser.add_argument("--step-iters", type=int, default=30, help="timed model steps (after 10 warm-up steps)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "train")
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error("--epochs must be >= 2 (epoch 1 holds the compile and loader warm-up and is left out)")
    val_images = args.val_images if args.val_images is not None else max(args.classes, args.images // 10)
    data = args.data_dir or Path("data") / "generated" / f"imagenet_like_{args.images}_{val_images}_s{args.seed}"
    write_set(data, args.images, val_images, args.classes, args.seed, workers=os.cpu_count() or 1)

    import timm
    import torch

    import visionssm.models  # noqa: F401  (registers the models)

    if not torch.cuda.is_available():
        raise SystemExit("train_throughput.py measures on a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    rows = []
    for model_name in args.models:
        step = model_step(model_name, args.batch_size, args.amp, args.compile, args.step_iters, 10, args.classes)
        alone = stage_alone(model_name, data, args.batch_size, args.workers, batches=8)
        print(f"{model_name}: model step {step:,.0f} img/s; gpu data stage alone {alone['stage_img_per_s']:,.0f} "
              f"img/s (nvJPEG decode {alone['decode_img_per_s']:,.0f})", flush=True)
        for backend in args.backends:
            row = whole_run(model_name, backend, data, args)
            row.update(model_step_img_per_s=step, **alone, share=row["whole_run_img_per_s"] / step,
                       loop_share=row["loop_img_per_s"] / step)
            rows.append(row)
            print(f"  {backend}: loop {row['loop_img_per_s']:,.0f} img/s, whole run {row['whole_run_img_per_s']:,.0f} "
                  f"img/s ({row['share']:.0%} of the step), {row['fixed_seconds_per_epoch']:.1f} s/epoch outside "
                  "the loop", flush=True)
    date = datetime.date.today().isoformat()
    header = (f"{gpu}, {os.cpu_count()} CPU cores, {date}; {args.images} images 500x375 q{QUALITY}, batch "
              f"{args.batch_size}, {args.workers} workers, amp {args.amp}, compile {args.compile}, epochs 2-"
              f"{args.epochs}")
    print("\n" + header)
    print(f"{'model':<16} {'backend':<7} {'step img/s':>10} {'loop img/s':>10} {'run img/s':>10} {'run/step':>8} "
          f"{'gpu/pil':>7}")
    for row in rows:
        pil = next((r for r in rows if r["model"] == row["model"] and r["backend"] == "pil"), None)
        versus = row["whole_run_img_per_s"] / pil["whole_run_img_per_s"] if pil else math.nan
        row["versus_pil"] = versus
        print(f"{row['model']:<16} {row['backend']:<7} {row['model_step_img_per_s']:>10,.0f} "
              f"{row['loop_img_per_s']:>10,.0f} {row['whole_run_img_per_s']:>10,.0f} {row['share']:>8.2f} "
              f"{versus:>7.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"throughput-{'-'.join(args.models)}-{gpu.lower().replace(' ', '-')}-{date}"
    meta = {"gpu": gpu, "cpu_cores": os.cpu_count(), "date": date, "torch": torch.__version__,
            "timm": timm.__version__, "python": platform.python_version(),
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    stem.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {stem}.json and .csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
