"""Training throughput and a short learning run through ``train_imagenet.py``, for the models side by side.

1. Training img/s: forward + backward + AdamW step at batch ``--batch`` (bf16 autocast, channels_last, fp32
   weights) on random 224x224 inputs, timed over ``--steps`` steps after warm-up (synchronized), for
   ``--throughput-models`` (on a GPU, or on CPU with ``--throughput-on-cpu``).
2. Learning: the generated 10-class shapes set (``python -m visionssm.data.synthetic``, fixed seed) and the same
   budget for every model in ``--models`` (same epochs, images, recipe), each trained from scratch by
   ``train_imagenet.py``; the per-epoch metrics and a side-by-side curves PNG go to ``--out``.

    python benchmarks/train_learning_run.py --out benchmarks/results/train
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from visionssm.benchmark import visionssm_models  # noqa: E402
from visionssm.benchmark.harness import environment, slug  # noqa: E402
from visionssm.training.state import plot_runs  # noqa: E402

# The short recipe shared by all models: light augmentation, so that a few epochs show learning.
SHORT_RECIPE = ["--img-size", "224", "--batch-size", "128", "--opt", "adamw", "--lr", "1e-3", "--weight-decay", "0.05",
                "--warmup-epochs", "1", "--min-lr", "1e-5", "--mixup", "0", "--cutmix", "0", "--smoothing", "0.1",
                "--aa", "null", "--reprob", "0", "--scale", "[0.35, 1.0]", "--model-ema-decay", "0.99",
                "--drop-path", "0.1", "--clip-grad", "5.0", "--amp", "bf16", "--keep-last", "1", "--seed", "0"]


def training_throughput(name: str, batch: int, steps: int, warmup: int, img_size: int = 224) -> dict:
    import timm

    import visionssm.models  # noqa: F401

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model = timm.create_model(name, num_classes=1000).to(device).to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, 3, img_size, img_size, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    start = time.perf_counter()
    step()
    sync()
    first_step_s = time.perf_counter() - start  # includes Triton compilation / autotuning
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    ms = (time.perf_counter() - start) * 1000 / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"model": name, "batch": batch, "img_size": img_size, "amp": "bf16", "channels_last": True,
            "img_per_s": batch / (ms / 1000), "ms_per_step": ms, "peak_memory_gib": peak,
            "first_step_s": first_step_s, "params_m": sum(p.numel() for p in model.parameters()) / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train"))
    parser.add_argument("--work", default="/tmp/visionssm_learning")
    # every visionssm family's T model (from the model registry), and DeiT-Ti as the timm yardstick for learning
    parser.add_argument("--throughput-models", nargs="*", default=visionssm_models(["T"]))
    parser.add_argument("--models", nargs="*", default=[*visionssm_models(["T"]), "deit_tiny_patch16_224"])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--throughput-img-size", type=int, default=224)
    parser.add_argument("--throughput-on-cpu", action="store_true", help="measure on CPU too (a smoke test)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--train-per-class", type=int, default=400)
    parser.add_argument("--val-per-class", type=int, default=100)
    parser.add_argument("--image-size", type=int, default=96)
    parser.add_argument("--workers", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--run-timeout", type=float, default=90.0, help="wall-clock cap per learning run (s)")
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="if set, the whole script's wall-clock budget: each learning run is capped at an equal "
                             "share of what is left (and at --run-timeout)")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more train_imagenet.py flags")
    args = parser.parse_args()
    script_start = time.perf_counter()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    stamp = slug(env["device"]) + "-" + env["date"]
    report = {"environment": env, "throughput": [], "learning": {}, "recipe": SHORT_RECIPE + args.extra,
              "epochs": args.epochs, "data": {"classes": 10, "train_per_class": args.train_per_class,
                                              "val_per_class": args.val_per_class, "image_size": args.image_size,
                                              "seed": 0}}
    runs = {}

    def save():  # after every stage, so a run cut short still leaves its results
        (out / f"learning-{stamp}.json").write_text(json.dumps(report, indent=1))
        if runs:
            plot_runs(runs, out / f"learning-curves-{stamp}.png",
                      title=f"generated 10-class shapes, {args.epochs} epochs each ({env['device']}, {env['date']})")

    if torch.cuda.is_available() or args.throughput_on_cpu:
        for name in args.throughput_models:
            try:
                r = training_throughput(name, args.batch, args.steps, warmup=3, img_size=args.throughput_img_size)
            except Exception as e:  # report and go on: the learning runs still count
                r = {"model": name, "error": f"{type(e).__name__}: {e}"}
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            print(json.dumps(r), flush=True)
            report["throughput"].append(r)
            save()

    data = Path(args.work) / f"shapes10_{args.image_size}px_{args.train_per_class}x{args.val_per_class}"
    subprocess.run([sys.executable, "-m", "visionssm.data.synthetic", "--out", str(data), "--classes", "10",
                    "--train-per-class", str(args.train_per_class), "--val-per-class", str(args.val_per_class),
                    "--image-size", str(args.image_size), "--seed", "0"], check=True, cwd=ROOT)
    for i, name in enumerate(args.models):
        timeout = args.run_timeout
        if args.budget_s:
            left = args.budget_s - (time.perf_counter() - script_start)
            timeout = max(10.0, min(timeout, left / (len(args.models) - i)))
        run_dir = Path(args.work) / "runs" / name
        cmd = [sys.executable, str(ROOT / "train_imagenet.py"), "--model", name, "--data-dir", str(data),
               "--output", str(run_dir), "--epochs", str(args.epochs), "--workers", str(args.workers),
               "--resume", "never", *SHORT_RECIPE, *args.extra]
        start = time.perf_counter()
        log = run_dir.parent / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        metrics = run_dir / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
        runs[name] = records
        report["learning"][name] = {"returncode": rc, "wall_s": time.perf_counter() - start, "cap_s": timeout,
                                    "records": records,
                                    "log_tail": log.read_text()[-1500:] if rc != 0 else ""}
        save()
        last = records[-1] if records else {}
        print(f"{name}: rc={rc} epochs={len(records)} val_top1={last.get('val_top1')} "
              f"ema_val_top1={last.get('ema_val_top1')} wall={time.perf_counter() - start:.0f}s", flush=True)

    print(f"\nmodel                     train img/s (batch {args.batch}, bf16)")
    for r in report["throughput"]:
        print(f"{r['model']:<25} {r.get('img_per_s', float('nan')):10.0f}  {r.get('error', '')}")
    print("\nmodel                     epochs  val top-1  EMA top-1  wall s")
    for name, info in report["learning"].items():
        last = info["records"][-1] if info["records"] else {}
        print(f"{name:<25} {len(info['records']):6d}  {last.get('val_top1', float('nan')):9.2f}  "
              f"{last.get('ema_val_top1') or float('nan'):9.2f}  {info['wall_s']:6.0f}")


if __name__ == "__main__":
    main()
