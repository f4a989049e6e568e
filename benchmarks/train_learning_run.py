"""Training throughput and a short learning run through ``train_imagenet.py``, for the models side by side.

1. Training img/s: forward + backward + AdamW step at batch ``--batch`` (bf16 autocast, channels_last, fp32
   weights) on random 224x224 inputs, timed over ``--steps`` steps after warm-up (synchronized), for
   ``--throughput-models`` (on a GPU, or on CPU with ``--throughput-on-cpu``).
2. Learning: the generated 10-class shapes set (``python -m visionssm.data.synthetic``, fixed seed) and the same
   budget for every model in ``--models`` (same epochs, images, recipe), each trained from scratch by
   ``train_imagenet.py``; the per-epoch metrics and a side-by-side curves PNG go to ``--out``.
3. Data backends: with ``--image-format jpeg`` the set is a JPEG copy (quality 90) so that ``--data-backends pil gpu``
   compares PIL decoding with nvJPEG at the same budget; with several ``--seeds`` each backend's last top-1 is given
   with its spread over the seeds, the noise the backends' difference is read against (``--parallel`` runs start
   side by side, the loader workers split between them).

    python benchmarks/train_learning_run.py --out benchmarks/results/train
    python benchmarks/train_learning_run.py --throughput-models --models mamba_vision_T --epochs 5 \\
        --image-format jpeg --data-backends pil gpu --seeds 0 1 --parallel 2 --name backends
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from PIL import Image

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


def main(argv=None) -> None:
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
    parser.add_argument("--image-format", choices=["png", "jpeg"], default="png",
                        help="jpeg: train on a quality-90 JPEG copy of the set (what nvJPEG decodes)")
    parser.add_argument("--data-backends", nargs="+", default=["auto"], choices=["auto", "pil", "gpu"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="one learning run per seed")
    parser.add_argument("--parallel", type=int, default=1, help="learning runs at once")
    parser.add_argument("--name", default="", help="a word in the result files' names (learning-NAME-...)")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more train_imagenet.py flags")
    args = parser.parse_args(argv)
    if args.parallel < 1:
        parser.error(f"--parallel must be >= 1, got {args.parallel}")
    script_start = time.perf_counter()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    stamp = (f"{args.name}-" if args.name else "") + slug(env["device"]) + "-" + env["date"]
    report = {"environment": env, "cpu_cores": os.cpu_count(), "throughput": [], "learning": {},
              "recipe": SHORT_RECIPE + args.extra, "epochs": args.epochs,
              "data": {"classes": 10, "train_per_class": args.train_per_class, "val_per_class": args.val_per_class,
                       "image_size": args.image_size, "seed": 0, "format": args.image_format}}
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
    if args.image_format == "jpeg":
        data = jpeg_copy(data, quality=90)
    several = len(args.data_backends) > 1 or len(args.seeds) > 1
    # seed by seed, the backends side by side: parallel runs share the CPU between a PIL run and a GPU-fed one
    jobs = [(name, backend, seed) for name in args.models for seed in args.seeds for backend in args.data_backends]
    workers = max(1, args.workers // args.parallel)
    active = []
    while jobs or active:
        while jobs and len(active) < args.parallel:
            name, backend, seed = jobs.pop(0)
            key = f"{name} {backend} seed {seed}" if several else name
            timeout = args.run_timeout
            if args.budget_s:  # an equal share of what is left, per round of --parallel runs
                left = args.budget_s - (time.perf_counter() - script_start)
                rounds = -(-(len(jobs) + 1 + len(active)) // args.parallel)
                timeout = max(10.0, min(timeout, left / rounds))
            run_dir = Path(args.work) / "runs" / key.replace(" ", "_")
            log = run_dir.parent / f"{run_dir.name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, str(ROOT / "train_imagenet.py"), "--model", name, "--data-dir", str(data),
                   "--output", str(run_dir), "--epochs", str(args.epochs), "--workers", str(workers),
                   "--resume", "never", *SHORT_RECIPE, *args.extra, "--data-backend", backend, "--seed", str(seed)]
            with open(log, "w") as f:
                proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
            active.append({"key": key, "model": name, "backend": backend, "seed": seed, "proc": proc, "log": log,
                           "run_dir": run_dir, "start": time.perf_counter(), "timeout": timeout})
        time.sleep(0.2)
        for job in list(active):
            rc = job["proc"].poll()
            if rc is None and time.perf_counter() - job["start"] > job["timeout"]:
                job["proc"].kill()
                job["proc"].wait()
                rc = "timeout"
            if rc is None:
                continue
            active.remove(job)
            metrics = job["run_dir"] / "metrics.jsonl"
            records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
            runs[job["key"]] = records
            wall = time.perf_counter() - job["start"]
            report["learning"][job["key"]] = {
                "model": job["model"], "data_backend": job["backend"], "seed": job["seed"], "returncode": rc,
                "wall_s": wall, "cap_s": job["timeout"], "records": records,
                "log_tail": job["log"].read_text()[-1500:] if rc != 0 else ""}
            save()
            last = records[-1] if records else {}
            print(f"{job['key']}: rc={rc} epochs={len(records)} val_top1={last.get('val_top1')} "
                  f"ema_val_top1={last.get('ema_val_top1')} wall={wall:.0f}s", flush=True)
    if len(args.data_backends) > 1:
        report["backends"] = compare_backends(report["learning"], args.data_backends)
        save()

    print(f"\nmodel                     train img/s (batch {args.batch}, bf16)")
    for r in report["throughput"]:
        print(f"{r['model']:<25} {r.get('img_per_s', float('nan')):10.0f}  {r.get('error', '')}")
    print("\nrun                                 epochs  val top-1  EMA top-1  wall s")
    for name, info in report["learning"].items():
        last = info["records"][-1] if info["records"] else {}
        print(f"{name:<35} {len(info['records']):6d}  {last.get('val_top1', float('nan')):9.2f}  "
              f"{last.get('ema_val_top1') or float('nan'):9.2f}  {info['wall_s']:6.0f}")
    for row in report.get("backends", []):
        spread = ", ".join(f"{b} {row[b]['mean']:.2f} ({row[b]['min']:.2f}-{row[b]['max']:.2f})"
                           for b in args.data_backends)
        print(f"{row['model']}: last val top-1 over seeds {row['seeds']}: {spread}; {row['versus']} "
              f"{row['difference']:+.2f} against a seed spread of {row['noise']:.2f}: "
              + ("within noise" if row["within_noise"] else "outside the noise"))


def _to_jpeg(job: tuple[Path, Path, int]) -> None:
    source, target, quality = job
    with Image.open(source) as image:
        image.convert("RGB").save(target, quality=quality)


def jpeg_copy(data: Path, quality: int) -> Path:
    """``data``'s ImageFolder as JPEGs (same folders and names, ``.jpg``) beside it; made once, kept when complete."""
    target = data.with_name(f"{data.name}_jpeg_q{quality}")
    if (target / "complete").is_file():
        return target
    sources = sorted(p for p in data.rglob("*") if p.is_file() and p.parent != data)
    jobs = []
    for source in sources:
        dest = target / source.relative_to(data).with_suffix(".jpg")
        dest.parent.mkdir(parents=True, exist_ok=True)
        jobs.append((source, dest, quality))
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # Pillow encodes without the GIL
        list(pool.map(_to_jpeg, jobs))
    (target / "complete").write_text(f"{len(jobs)} images\n")
    return target


def compare_backends(learning: dict, backends: list[str]) -> list[dict]:
    """Per model, each backend's last val top-1 over the seeds (mean, min, max), the difference of the first two
    backends' means and the noise it is read against: the larger spread (max - min) of the two over the seeds."""
    rows = []
    for model in dict.fromkeys(info["model"] for info in learning.values()):
        row = {"model": model}
        for backend in backends:
            top1 = [info["records"][-1]["val_top1"] for info in learning.values()
                    if info["model"] == model and info["data_backend"] == backend and info["records"]]
            if not top1:
                break
            row[backend] = {"mean": statistics.fmean(top1), "min": min(top1), "max": max(top1), "runs": len(top1)}
        else:
            first, second = backends[:2]
            row["seeds"] = min(row[first]["runs"], row[second]["runs"])
            row["versus"] = f"{second} - {first}"
            row["difference"] = row[second]["mean"] - row[first]["mean"]
            row["noise"] = max(row[b]["max"] - row[b]["min"] for b in (first, second))
            row["within_noise"] = abs(row["difference"]) <= row["noise"]
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
