#!/usr/bin/env python
"""Whole-run ImageNet training throughput beside the model step's, per data backend, in one call.

1. Writes an ImageNet-like JPEG ImageFolder once (500x375, quality 90, 100 classes, fixed seed; ``--images`` training
   and ``--val-images`` validation images, drawn in parallel; kept for the next call when its manifest matches).
2. Per model, measures the recipe's training step alone (forward, loss, backward, its gradient clipping, optimizer,
   EMA) on synthetic tensors already on the GPU, with the whole run's model, batch, size, amp, channels_last and
   compile setting.
3. Runs ``visionssm-train`` with each ``--backends`` entry (the gpu backend once per ``--jpeg-decoders`` entry,
   after its data stage alone: decode, decode + augmentation) for ``--epochs`` epochs and takes epochs 2..E: the
   training loop's img/s, the whole run's (training images over the wall time from epoch 1's record to the last:
   evaluation, checkpoints and loader starts included), the seconds per epoch spent in evaluation and in
   checkpointing and the rest, and those extrapolated to an ImageNet epoch (1,281,167 training and 50,000 validation
   images).

Prints a table with the ratios to the model step and writes JSON and CSV (GPU, CPU cores, versions, date):

    python benchmarks/train_throughput.py --images 12800 --epochs 3 \\
        --models mamba_vision_T gka_vision_T comba_vision_S --batch-size 256 --workers 14 --amp bf16
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
WIDTH, HEIGHT, QUALITY = 500, 375, 90
IMAGENET_TRAIN, IMAGENET_VAL = 1_281_167, 50_000


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


def run_config(model_name: str, args) -> list[str]:
    """The visionssm-train flags every measurement of ``model_name`` shares (recipe, batch, size, amp, compile and
    ``--train-args``), so the model step builds the same model and optimizer as the whole run."""
    flags = ["--config", model_name, "--batch-size", str(args.batch_size), "--img-size", str(args.img_size),
             "--amp", args.amp]
    if args.compile:
        flags += ["--compile"] + ([] if args.compile is True else [args.compile])
    return flags + shlex.split(args.train_args)


def model_step(model_name: str, args, classes: int, device) -> float:
    """img/s of the recipe's training step (forward, loss, backward, its gradient clipping, optimizer, EMA) on
    synthetic tensors already on ``device``."""
    import torch
    from timm.utils import ModelEmaV3

    from visionssm.training.setup import build_optimizer, create_model
    from visionssm.training.state import parse_config
    from visionssm.utils.cli import compile_mode

    cfg = parse_config(run_config(model_name, args))
    model = create_model(cfg, classes).to(device)
    if cfg["channels_last"]:
        model.to(memory_format=torch.channels_last)
    ema = ModelEmaV3(model, decay=cfg["model_ema_decay"]) if cfg["model_ema"] else None
    mode = compile_mode(cfg["compile"], "--compile")
    if mode is not None:
        model.compile(mode=mode)
    optimizer, _, _ = build_optimizer(cfg, model, world=1)
    batch, size = cfg["batch_size"], cfg["img_size"]
    images = torch.randn(batch, 3, size, size, device=device)
    if cfg["channels_last"]:
        images = images.contiguous(memory_format=torch.channels_last)
    targets = torch.randint(0, classes, (batch,), device=device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # the recipe's clipping, as the training loop applies it
    clip = torch.nn.utils.clip_grad_value_ if cfg["clip_mode"] == "value" else torch.nn.utils.clip_grad_norm_

    def step(k: int):
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(images), targets)
        scaler.scale(loss).backward()
        if cfg["clip_grad"]:
            scaler.unscale_(optimizer)
            clip(model.parameters(), cfg["clip_grad"])
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update(model, step=k)

    for k in range(args.step_warmup):
        step(k)
    sync()
    start = time.perf_counter()
    for k in range(args.step_iters):
        step(args.step_warmup + k)
    sync()
    return batch * args.step_iters / (time.perf_counter() - start)


def stage_alone(model_name: str, data: Path, args, device, batches: int, decoder_choice: str) -> dict:
    """img/s of the gpu data backend alone on the training split (the recipe's augmentation, no model) with
    ``--jpeg-decoder decoder_choice``: decode only, and decode + augmentation; what the GPU path can feed at most."""
    import torch
    from torch.utils.data import DataLoader

    from visionssm.data.gpu import EncodedImageFolder, TrainStage, collate_encoded, decode_batch, jpeg_decoder
    from visionssm.data.loader import EpochShuffleSampler
    from visionssm.training.state import parse_config

    cfg = parse_config(run_config(model_name, args))
    decoder = jpeg_decoder(decoder_choice, device, print)
    dataset = EncodedImageFolder(data / "train", augment_seed=0)
    loader = DataLoader(dataset, batch_size=cfg["batch_size"], sampler=EpochShuffleSampler(len(dataset), 0,
                                                                                          tag_epoch=True),
                        num_workers=args.workers, collate_fn=collate_encoded, drop_last=True)
    stage = TrainStage(dataset, device, cfg["img_size"], (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), seed=0,
                       scale=cfg["scale"], ratio=cfg["ratio"], hflip=cfg["hflip"],
                       interpolation=cfg["train_interpolation"], auto_augment=cfg["aa"], prefetch=False,
                       decoder=decoder)
    encoded = []
    for k, item in enumerate(loader):
        encoded.append(item)
        if k + 1 == batches:
            break
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rates = {"jpeg_decoder": "nvimgcodec" if decoder is not None else "torchvision"}
    for name, work in (("decode_img_per_s", lambda b: decode_batch(b.data, device, decoder)),
                       ("stage_img_per_s", stage.process)):
        work(encoded[0])  # warm-up: nvJPEG handles, kernels
        sync()
        start = time.perf_counter()
        for item in encoded:
            work(item)
        sync()
        rates[name] = sum(len(item) for item in encoded) / (time.perf_counter() - start)
    return rates


def whole_run(model_name: str, backend: str, decoder_choice: str | None, data: Path, args) -> dict:
    """``visionssm-train`` for ``args.epochs`` epochs; the figures of epochs 2..E from its metrics, and where the
    time outside the training loop goes, extrapolated to an ImageNet epoch."""
    with tempfile.TemporaryDirectory(prefix=f"tput-{model_name}-{backend}-") as out:
        command = [sys.executable, "-m", "visionssm.train", *run_config(model_name, args), "--data-dir", str(data),
                   "--output", out, "--epochs", str(args.epochs), "--workers", str(args.workers),
                   "--data-backend", backend, "--log-interval", "1000"]
        if decoder_choice is not None:
            command += ["--jpeg-decoder", decoder_choice]
        start = time.perf_counter()
        proc = subprocess.run(command, env=dict(os.environ, TQDM_DISABLE="1"), capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        config = yaml.safe_load((Path(out) / "config.yaml").read_text())
    return {"model": model_name, "backend": config["data_backend"], "epochs": args.epochs, "run_wall_s": wall,
            **epoch_costs(records, config["updates_per_epoch"] * config["global_batch"]),
            "val_top1_last": records[-1]["val_top1"], "skipped_images": sum(r["skipped_images"] for r in records)}


def epoch_costs(records: list[dict], per_epoch: int) -> dict:
    """Throughput and per-epoch fixed cost over epochs 2..E of a run's metrics records (epoch 1 holds the
    start-up). The span from epoch 1's record to epoch E's covers each later epoch whole: the previous epoch's
    checkpoint, the loader's start, the training loop, evaluation. Evaluation is measured; checkpointing and the
    rest is the span less the loops and evaluations. The ImageNet extrapolation scales evaluation with the
    validation images (50,000 against the run's) and keeps the rest per epoch. Where the loop's time went, as shares
    of it: waiting for batches, and (gpu data backend) the stage thread's decode and transform time."""
    later = records[1:]
    span = later[-1]["wall_time"] - records[0]["wall_time"]
    loop = sum(per_epoch / r["train_img_per_s"] for r in later)
    val = sum(r["val_seconds"] for r in later)
    val_images = later[-1]["val_images"]
    rest_per_epoch = (span - loop - val) / len(later)
    imagenet_loop = IMAGENET_TRAIN / (per_epoch * len(later) / loop)
    imagenet_val = val / len(later) * IMAGENET_VAL / max(val_images, 1)
    imagenet_epoch = imagenet_loop + imagenet_val + rest_per_epoch
    shares = {f"loop_share_{name}": sum(r[key] for r in later) / loop
              for name, key in (("data_wait", "train_data_wait_s"), ("stage_decode", "data_stage_decode_s"),
                                ("stage_transform", "data_stage_transform_s")) if key in later[-1]}
    return {"epoch_images": per_epoch, "loop_img_per_s": per_epoch * len(later) / loop, **shares,
            "whole_run_img_per_s": per_epoch * len(later) / span,
            "eval_s_per_epoch": val / len(later), "val_images": val_images,
            "checkpoint_and_rest_s_per_epoch": rest_per_epoch,
            "imagenet_epoch_s": imagenet_epoch,
            "imagenet_fixed_share": (imagenet_val + rest_per_epoch) / imagenet_epoch,
            "imagenet_whole_run_img_per_s": IMAGENET_TRAIN / imagenet_epoch}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=12_800, help="training images (validation: --val-images)")
    parser.add_argument("--val-images", type=int, default=None, help="default: images / 10")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", type=Path, default=None, help="default: data/generated/imagenet_like_<N>")
    parser.add_argument("--models", nargs="+", default=["mamba_vision_T", "gka_vision_T", "comba_vision_S"])
    parser.add_argument("--backends", nargs="+", default=["gpu"], choices=["pil", "gpu"])
    parser.add_argument("--jpeg-decoders", nargs="+", default=["torchvision"],
                        help="the gpu backend's runs, one per visionssm-train --jpeg-decoder value")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--amp", default="bf16", choices=["bf16", "fp16", "no"])
    parser.add_argument("--compile", nargs="?", const=True, default=None, metavar="MODE")
    parser.add_argument("--train-args", default="", help="more visionssm-train flags for every measurement, one "
                                                         "string (the model step builds its model from them too)")
    parser.add_argument("--step-iters", type=int, default=30, help="timed model steps")
    parser.add_argument("--step-warmup", type=int, default=10, help="model steps before the timed ones")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to try the script out")
    parser.add_argument("--name", default="whole-run", help="results file name: NAME-<device>-<date>.{json,csv}")
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
    from visionssm.benchmark.harness import environment, save_results

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("train_throughput.py measures on a CUDA GPU (--device cpu only tries the script out)")
    env = {**environment(device), "cpu_cores": os.cpu_count(), "timm": timm.__version__,
           "benchmark": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    rows = []
    for model_name in args.models:
        step = model_step(model_name, args, args.classes, device)
        print(f"{model_name}: model step {step:,.0f} img/s", flush=True)
        for backend, decoder in [(b, d) for b in args.backends for d in (args.jpeg_decoders if b == "gpu" else [None])]:
            alone = {}
            if backend == "gpu":
                alone = stage_alone(model_name, data, args, device, 8, decoder)
                print(f"  gpu data stage alone ({alone['jpeg_decoder']} decoding) {alone['stage_img_per_s']:,.0f} "
                      f"img/s (decode {alone['decode_img_per_s']:,.0f})", flush=True)
            row = whole_run(model_name, backend, decoder, data, args)
            if row["backend"] == "gpu":  # the decoder the run chose, as the stage alone resolved it
                row["backend"] = f"gpu/{alone['jpeg_decoder']}"
            row.update(model_step_img_per_s=step, **alone, whole_run_share=row["whole_run_img_per_s"] / step,
                       loop_share=row["loop_img_per_s"] / step,
                       imagenet_whole_run_share=row["imagenet_whole_run_img_per_s"] / step)
            rows.append(row)
            print(f"  {row['backend']}: loop {row['loop_img_per_s']:,.0f} img/s, whole run "
                  f"{row['whole_run_img_per_s']:,.0f} img/s ({row['whole_run_share']:.0%} of the step); per epoch "
                  f"{row['eval_s_per_epoch']:.1f} s evaluation, {row['checkpoint_and_rest_s_per_epoch']:.1f} s "
                  f"checkpoint and the rest; of the loop: {_loop_split(row)}", flush=True)
            json_path, csv_path = save_results(args.name, rows, out_dir=args.out, env=env)  # a cut-short call keeps it
    print("\n" + table(rows, env, args))
    print(f"wrote {json_path} and {csv_path}")
    return 0


def _loop_split(row: dict) -> str:
    """The loop's time shares a row holds, in words."""
    names = {"data_wait": "waiting for batches", "stage_decode": "stage decoding",
             "stage_transform": "stage transforming"}
    return ", ".join(f"{row['loop_share_' + key]:.0%} {words}" for key, words in names.items()
                     if "loop_share_" + key in row) or "no split recorded"


def table(rows: list[dict], env: dict, args) -> str:
    """The run's figures, one line per model and backend, under a line saying where and how they were measured."""
    lines = [f"{env['device']}, {env['cpu_cores']} CPU cores, {env['date']}; {args.images} + "
             f"{rows[0]['val_images'] if rows else 0} images {WIDTH}x{HEIGHT} q{QUALITY}, batch {args.batch_size}, "
             f"{args.img_size} px, {args.workers} workers, amp {args.amp}, compile {args.compile}, epochs 2-"
             f"{args.epochs}; ImageNet epoch: {IMAGENET_TRAIN:,} training, {IMAGENET_VAL:,} validation images",
             f"{'model':<16} {'backend':<15} {'step img/s':>10} {'loop img/s':>10} {'run img/s':>10} {'run/step':>8} "
             f"{'eval s/ep':>9} {'ckpt+rest':>9} {'IN fixed':>8} {'IN run/step':>11}"]
    for row in rows:
        lines.append(f"{row['model']:<16} {row['backend']:<15} {row['model_step_img_per_s']:>10,.0f} "
                     f"{row['loop_img_per_s']:>10,.0f} {row['whole_run_img_per_s']:>10,.0f} "
                     f"{row['whole_run_share']:>8.2f} {row['eval_s_per_epoch']:>9.1f} "
                     f"{row['checkpoint_and_rest_s_per_epoch']:>9.1f} {row['imagenet_fixed_share']:>8.1%} "
                     f"{row['imagenet_whole_run_share']:>11.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
