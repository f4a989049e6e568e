"""Multi-GPU scaling of ``train_imagenet.py``: the same run through ``accelerate launch`` on 1 and on N GPUs.

Each model trains for ``--epochs`` epochs on the generated 10-class set (``visionssm.data.synthetic``, fixed seed)
with the same per-GPU batch, once per process count. The first epoch holds Triton compilation and cuDNN tuning, so
throughput is the median ``train_img_per_s`` (all processes' images over the epoch's training seconds, data loading
included) of the later epochs. Scaling efficiency = img/s on N GPUs / (N x img/s on 1 GPU).

    python benchmarks/train_scaling.py --models gka_vision_T mamba_vision_T --gpus 1 2 --out benchmarks/results/train
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Light augmentation keeps the data loader off the critical path: this measures the training engine, not JPEG decode.
RECIPE = ["--img-size", "224", "--opt", "adamw", "--lr", "1e-3", "--weight-decay", "0.05", "--warmup-epochs", "1",
          "--mixup", "0", "--cutmix", "0", "--aa", "null", "--reprob", "0", "--amp", "bf16", "--keep-last", "1",
          "--seed", "0", "--resume", "never", "--log-interval", "1000"]


def steady_throughput(records: list[dict]) -> float | None:
    """Median img/s over the epochs after the first (the first one compiles); the only epoch if there is one."""
    rates = [r["train_img_per_s"] for r in records if r.get("train_img_per_s")]
    if not rates:
        return None
    return statistics.median(rates[1:] if len(rates) > 1 else rates)


def scaling_table(results: dict[str, dict[int, float | None]]) -> str:
    """Rows per model and process count: img/s, img/s per GPU, speed-up and efficiency against 1 GPU."""
    lines = [f"{'model':<22}{'GPUs':>5}{'img/s':>11}{'per GPU':>10}{'speed-up':>10}{'efficiency':>12}"]
    for model, by_gpus in results.items():
        single = by_gpus.get(1)
        for gpus, rate in sorted(by_gpus.items()):
            if rate is None:
                lines.append(f"{model:<22}{gpus:>5}{'failed':>11}")
                continue
            speedup = rate / single if single else None
            lines.append(f"{model:<22}{gpus:>5}{rate:>11.0f}{rate / gpus:>10.0f}"
                         + (f"{speedup:>9.2f}x{speedup / gpus:>11.0%}" if speedup else ""))
    return "\n".join(lines)


def launch_command(gpus: int, model: str, data: Path, out: Path, args: argparse.Namespace) -> list[str]:
    workers = max(1, min(16, (os.cpu_count() or 2) // gpus - 1))
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(gpus),
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    if gpus > 1:
        launcher.append("--multi_gpu")
    return launcher + [str(ROOT / "train_imagenet.py"), "--model", model, "--data-dir", str(data), "--output",
                       str(out), "--epochs", str(args.epochs), "--batch-size", str(args.batch), "--workers",
                       str(workers), *RECIPE, *args.extra]


def main() -> None:
    import torch

    from visionssm.benchmark import visionssm_models
    from visionssm.benchmark.harness import environment, slug
    from visionssm.data.synthetic import SyntheticSpec, ensure_synthetic_dataset

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=visionssm_models(["T"]),
                        help="default: every visionssm family's T model")
    parser.add_argument("--gpus", nargs="+", type=int, default=None,
                        help="process counts to run (default: 1 and every visible GPU)")
    parser.add_argument("--batch", type=int, default=256, help="per GPU")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-per-class", type=int, default=2000)
    parser.add_argument("--image-size", type=int, default=64, help="stored size; training crops to 224")
    parser.add_argument("--work", default="/tmp/visionssm_scaling")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train"))
    parser.add_argument("--name", default="scaling", help="result file prefix")
    parser.add_argument("--run-timeout", type=float, default=150.0, help="wall-clock cap per launch (s)")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more train_imagenet.py flags")
    args = parser.parse_args()
    visible = torch.cuda.device_count()
    gpu_counts = args.gpus or sorted({1, max(1, visible)})
    if visible and max(gpu_counts) > visible:
        raise ValueError(f"gpus asks for {max(gpu_counts)} processes but {visible} GPU(s) are visible")
    if min(gpu_counts) < 1:
        raise ValueError(f"gpus must be positive, got {gpu_counts}")

    env = environment()
    env["device_count"] = visible
    stamp = f"{slug(env['device'])}-x{max(gpu_counts)}-{env['date']}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.work) / f"shapes10_{args.image_size}px_{args.train_per_class}"
    ensure_synthetic_dataset(data, SyntheticSpec(classes=10, train_per_class=args.train_per_class, val_per_class=50,
                                                 image_size=args.image_size, seed=0))
    report = {"environment": env, "recipe": RECIPE + args.extra, "batch_per_gpu": args.batch, "epochs": args.epochs,
              "data": {"classes": 10, "train_per_class": args.train_per_class, "image_size": args.image_size},
              "runs": []}
    results: dict[str, dict[int, float | None]] = {}
    report_path = out / f"{args.name}-{stamp}.json"
    for model in args.models:
        for gpus in gpu_counts:
            run_dir = Path(args.work) / "runs" / f"{model}-x{gpus}"
            cmd = launch_command(gpus, model, data, run_dir, args)
            print(f"== {model} on {gpus} GPU(s): {' '.join(cmd[1:])}", flush=True)
            start = time.perf_counter()
            try:
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.run_timeout)
                rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
            except subprocess.TimeoutExpired as error:
                rc, tail = "timeout", str(error.stdout or "")[-2000:]
            metrics = run_dir / "metrics.jsonl"
            records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
            rate = steady_throughput(records)
            results.setdefault(model, {})[gpus] = rate
            report["runs"].append({"model": model, "gpus": gpus, "returncode": rc, "img_per_s": rate,
                                   "wall_s": time.perf_counter() - start, "records": records,
                                   "log_tail": tail if rc != 0 else ""})
            print(f"   rc={rc} epochs={len(records)} img/s={rate} wall={time.perf_counter() - start:.0f}s"
                  + (f"\n{tail}" if rc != 0 else ""), flush=True)
            report_path.write_text(json.dumps(report, indent=1))  # after every run: a cut-short call keeps them
    table = scaling_table(results)
    report["table"] = table
    report_path.write_text(json.dumps(report, indent=1))
    print(f"\ntrain_imagenet.py, batch {args.batch} per GPU, bf16, {env['device']} x{max(gpu_counts)}, "
          f"{env['date']}\n{table}")


if __name__ == "__main__":
    main()
