"""End-to-end check on generated videos: train briefly, track held-out videos, compare with a first-box baseline.

::

    python -m visionssm.tracking.synthetic_check --work /tmp/trk --json tracking-synthetic.json --budget-s 380

1. writes generated videos in GOT-10k's layout (``train`` and held-out ``val`` videos from disjoint seeds);
2. trains a tracker with ``visionssm.tracking.train`` (the first backbone of ``--backbones`` that trains; random
   backbone initialisation, since no ImageNet checkpoint is available offline, hence backbone lr × 1 here);
3. runs it and the repeat-the-first-box baseline on ``val`` with ``visionssm.tracking.run`` and scores both with
   ``visionssm.tracking.evaluate`` (GOT-10k rules: AO, SR0.5, SR0.75);
4. measures tracker speed per backbone with ``visionssm.tracking.profile``.

Each step runs as a subprocess with a time limit, and the JSON is rewritten after each step, so a failure or a
timeout in one step still leaves the others' numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .profile import environment

SMOKE_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "tracking", "smoke_synthetic.yaml")


def _sh(cmd: list[str], timeout: float, log) -> tuple[int, float]:
    tic = time.time()
    print("$", " ".join(cmd), flush=True)
    try:
        rc = subprocess.run(cmd, timeout=max(timeout, 1), stdout=log, stderr=subprocess.STDOUT).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    print(f"  -> rc {rc} in {time.time() - tic:.1f}s", flush=True)
    return rc, time.time() - tic


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, help="scratch directory (data, checkpoints, results)")
    parser.add_argument("--json", required=True, help="summary JSON to write")
    parser.add_argument("--budget-s", type=float, default=380, help="wall-clock budget for everything")
    parser.add_argument("--backbones", nargs="+", default=["gka_vision_T", "mamba_vision_T", "comba_vision_T"],
                        help="training candidates, first that works is used")
    parser.add_argument("--fps-backbones", nargs="+", default=["gka_vision_T", "mamba_vision_T", "comba_vision_S"])
    parser.add_argument("--train-videos", type=int, default=300)
    parser.add_argument("--val-videos", type=int, default=16)
    parser.add_argument("--amp", action="store_true", help="track in bf16 autocast (CUDA)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--reserve-s", type=float, default=150, help="time kept for tracking, evaluation and FPS")
    parser.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    start = time.time()
    remaining = lambda: args.budget_s - (time.time() - start)
    os.makedirs(args.work, exist_ok=True)
    log_path = os.path.join(os.path.dirname(os.path.abspath(args.json)), "tracking-synthetic-check.log")
    with open(log_path, "w") as log:
        _check(args, log, start, remaining)


def _check(args, log, start: float, remaining) -> None:
    py = sys.executable
    summary: dict = {"environment": environment(), "protocol": __doc__.split("\n\n")[2], "steps": {}}

    def dump():
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)

    data = os.path.join(args.work, "got10k")
    rc, secs = _sh([py, "-m", "visionssm.tracking.data.synthetic", "got10k", data, "--train", str(args.train_videos),
                    "--val", str(args.val_videos), "--test", "0", "--frames", "60", "100", "--size", "320", "240",
                    "--seed", "11", "--workers", str(os.cpu_count() or 1)], 120, log)
    summary["data"] = {"layout": "GOT-10k", "train_videos": args.train_videos, "val_videos": args.val_videos,
                       "frames_per_video": [60, 100], "image_size": [320, 240], "seconds": secs, "rc": rc}
    dump()
    if rc:
        raise SystemExit("data generation failed (see the log)")

    checkpoint, trained = None, None
    for backbone in args.backbones:
        limit = remaining() - args.reserve_s
        if limit < 40:
            break
        out = os.path.join(args.work, f"train_{backbone}")
        overrides = [
            f"name=synthetic_{backbone}", f"output_dir={out}", f"model.backbone={backbone}", "model.backbone_kwargs={}",
            "model.head_channels=256", "model.drop_path_rate=0.0",
            f"data.train=[{{type: got10k, root: {data}, split: train}}]", "data.pairs_per_epoch=6400",
            f"data.num_workers={args.workers}", "train.epochs=20", f"train.batch_size={args.batch_size}",
            "train.lr=4e-4", "train.backbone_lr_mult=1.0", "train.mixed_precision=bf16", "train.log_every=25",
            "train.checkpoint_every_steps=0", f"train.time_limit_s={int(limit - 45)}",
        ]
        rc, secs = _sh([py, "-m", "visionssm.tracking.train", "--config", SMOKE_CONFIG, "--no-progress", "--set",
                        *overrides], limit, log)
        records = []
        metrics_file = os.path.join(out, "metrics.jsonl")
        if os.path.exists(metrics_file):
            records = [json.loads(line) for line in Path(metrics_file).read_text().splitlines()]
        steps = [r for r in records if not r.get("epoch_summary")]
        summary["steps"][f"train_{backbone}"] = {
            "rc": rc, "seconds": secs, "optimizer_steps": steps[-1]["step"] if steps else 0,
            "batch_size": args.batch_size, "first_log": steps[0] if steps else None,
            "last_log": steps[-1] if steps else None, "overrides": overrides,
        }
        dump()
        if os.path.exists(os.path.join(out, "final.pth")) and steps:
            checkpoint, trained = os.path.join(out, "final.pth"), backbone
            shutil.copy(metrics_file, os.path.join(os.path.dirname(os.path.abspath(args.json)),
                                                   "tracking-synthetic-train-metrics.jsonl"))
            break

    results = os.path.join(args.work, "results")
    reports = os.path.join(args.work, "reports")
    names = []
    if checkpoint:
        rc, secs = _sh([py, "-m", "visionssm.tracking.run", "--dataset", "got10k", "--root", data, "--split", "val",
                        "--checkpoint", checkpoint, "--name", trained, "--results-dir", results,
                        *(["--amp"] if args.amp else [])],
                       max(remaining() - 90, 30), log)
        summary["steps"]["track"] = {"rc": rc, "seconds": secs, "amp_bf16": args.amp}
        run_summary = os.path.join(results, "GOT-10k", f"{trained}_run_summary.json")
        if rc == 0 and os.path.exists(run_summary):
            rs = json.loads(Path(run_summary).read_text())
            summary["steps"]["track"].update(fps=rs["fps"], frames=rs["frames_tracked"], gpu=rs["gpu"])
            names.append(trained)
    rc, _ = _sh([py, "-m", "visionssm.tracking.run", "--dataset", "got10k", "--root", data, "--split", "val",
                 "--baseline", "first-box", "--name", "first_box", "--results-dir", results], 60, log)
    if rc == 0:
        names.append("first_box")
    rc, _ = _sh([py, "-m", "visionssm.tracking.evaluate", "--dataset", "got10k", "--root", data, "--split", "val",
                 "--trackers", *names, "--results-dir", results, "--report-dir", reports], 60, log)
    perf_file = os.path.join(reports, "GOT-10k", "performance.json")
    if rc == 0 and os.path.exists(perf_file):
        perf = json.loads(Path(perf_file).read_text())
        summary["evaluation"] = {
            "conventions": perf["conventions"],
            "trackers": {n: {k: p[k] for k in ("ao", "sr50", "sr75", "frames")} for n, p in perf["trackers"].items()},
            "trained_backbone": trained,
        }
        plot = os.path.join(reports, "GOT-10k", "success_plot.png")
        if os.path.exists(plot):
            shutil.copy(plot, os.path.join(os.path.dirname(os.path.abspath(args.json)),
                                           "tracking-synthetic-success_plot.png"))
    dump()

    fps_json = os.path.join(args.work, "fps.json")
    rc, secs = _sh([py, "-m", "visionssm.tracking.profile", "--backbones", *args.fps_backbones, "--json", fps_json,
                    "--iters", "100", "--warmup", "20", "--frames", "150"], max(remaining() - 5, 20), log)
    if os.path.exists(fps_json):
        summary["speed"] = json.loads(Path(fps_json).read_text())
    summary["steps"]["profile"] = {"rc": rc, "seconds": secs}
    summary["total_seconds"] = time.time() - start
    dump()
    print(json.dumps({k: summary.get(k) for k in ("evaluation", "speed")}, indent=1))


if __name__ == "__main__":
    main()
