"""End-to-end check on generated videos: train briefly, track held-out videos, compare with a first-box baseline.

::

    python benchmarks/tracking_synthetic_check.py --work /tmp/trk --json tracking-synthetic.json --budget-s 380

1. writes generated videos in GOT-10k's layout (``train`` and held-out ``val`` videos from disjoint seeds);
2. trains a tracker with ``visionssm.tracking.train`` (the first backbone of ``--backbones`` that trains; random
   backbone initialisation, since no ImageNet checkpoint is available offline, hence backbone lr × 1 here);
3. runs it and the repeat-the-first-box baseline on ``val`` with ``visionssm.tracking.run`` and scores both with
   ``visionssm.tracking.evaluate`` (GOT-10k rules: AO, SR0.5, SR0.75);
4. measures tracker speed per backbone with ``benchmarks/tracking_profile.py``.

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

from visionssm.benchmark.harness import environment

SMOKE_CONFIG = "smoke_synthetic"  # a recipe shipped with the package: visionssm.tracking.train finds it by name
PROFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tracking_profile.py")


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
    os.makedirs(args.work, exist_ok=True)
    log_path = os.path.join(os.path.dirname(os.path.abspath(args.json)), "tracking-synthetic-check.log")
    with open(log_path, "w") as log:
        _check(args, log, start)


class _Check:
    """The steps of the check, sharing the arguments, the log, the time budget and the summary JSON."""

    def __init__(self, args, log, start: float):
        self.args, self.log, self.start = args, log, start
        self.py = sys.executable
        self.data = os.path.join(args.work, "got10k")
        self.out_dir = os.path.dirname(os.path.abspath(args.json))
        self.summary: dict = {"environment": environment(), "protocol": __doc__.split("\n\n")[2], "steps": {}}

    def remaining(self) -> float:
        return self.args.budget_s - (time.time() - self.start)

    def dump(self) -> None:
        with open(self.args.json, "w") as f:
            json.dump(self.summary, f, indent=2)

    def generate_data(self) -> None:
        args = self.args
        rc, secs = _sh([self.py, "-m", "visionssm.tracking.data.synthetic", "got10k", self.data, "--train",
                        str(args.train_videos), "--val", str(args.val_videos), "--test", "0", "--frames", "60", "100",
                        "--size", "320", "240", "--seed", "11", "--workers", str(os.cpu_count() or 1)], 120, self.log)
        self.summary["data"] = {"layout": "GOT-10k", "train_videos": args.train_videos, "val_videos": args.val_videos,
                                "frames_per_video": [60, 100], "image_size": [320, 240], "seconds": secs, "rc": rc}
        self.dump()
        if rc:
            raise SystemExit("data generation failed (see the log)")

    def train(self, backbone: str, limit: float) -> str | None:
        """Train ``backbone`` within ``limit`` seconds; returns its final.pth if it trained."""
        args = self.args
        out = os.path.join(args.work, f"train_{backbone}")
        overrides = [
            f"name=synthetic_{backbone}", f"output_dir={out}", f"model.backbone={backbone}", "model.backbone_kwargs={}",
            "model.head_channels=256", "model.drop_path_rate=0.0",
            f"data.train=[{{type: got10k, root: {self.data}, split: train}}]", "data.pairs_per_epoch=6400",
            f"data.num_workers={args.workers}", "train.epochs=20", f"train.batch_size={args.batch_size}",
            "train.lr=4e-4", "train.backbone_lr_mult=1.0", "train.mixed_precision=bf16", "train.log_every=25",
            "train.checkpoint_every_steps=0", f"train.time_limit_s={int(limit - 45)}",
        ]
        rc, secs = _sh([self.py, "-m", "visionssm.tracking.train", "--config", SMOKE_CONFIG, "--no-progress",
                        "--set", *overrides], limit, self.log)
        metrics_file = os.path.join(out, "metrics.jsonl")
        records = []
        if os.path.exists(metrics_file):
            records = [json.loads(line) for line in Path(metrics_file).read_text().splitlines()]
        steps = [r for r in records if not r.get("epoch_summary")]
        self.summary["steps"][f"train_{backbone}"] = {
            "rc": rc, "seconds": secs, "optimizer_steps": steps[-1]["step"] if steps else 0,
            "batch_size": args.batch_size, "first_log": steps[0] if steps else None,
            "last_log": steps[-1] if steps else None, "overrides": overrides,
        }
        self.dump()
        if not (os.path.exists(os.path.join(out, "final.pth")) and steps):
            return None
        shutil.copy(metrics_file, os.path.join(self.out_dir, "tracking-synthetic-train-metrics.jsonl"))
        return os.path.join(out, "final.pth")

    def track(self, checkpoint: str | None, trained: str | None, results: str) -> list[str]:
        """Run the trained tracker (if any) and the first-box baseline on val; returns the names that ran."""
        names = []
        if checkpoint:
            rc, secs = _sh([self.py, "-m", "visionssm.tracking.run", "--dataset", "got10k", "--root", self.data,
                            "--split", "val", "--checkpoint", checkpoint, "--name", trained, "--results-dir", results,
                            *(["--amp"] if self.args.amp else [])], max(self.remaining() - 90, 30), self.log)
            self.summary["steps"]["track"] = {"rc": rc, "seconds": secs, "amp_bf16": self.args.amp}
            run_summary = os.path.join(results, "GOT-10k", f"{trained}_run_summary.json")
            if rc == 0 and os.path.exists(run_summary):
                rs = json.loads(Path(run_summary).read_text())
                self.summary["steps"]["track"].update(fps=rs["fps"], frames=rs["frames_tracked"], gpu=rs["gpu"])
                names.append(trained)
        rc, _ = _sh([self.py, "-m", "visionssm.tracking.run", "--dataset", "got10k", "--root", self.data, "--split",
                     "val", "--baseline", "first-box", "--name", "first_box", "--results-dir", results], 60, self.log)
        if rc == 0:
            names.append("first_box")
        return names

    def evaluate(self, names: list[str], trained: str | None, results: str) -> None:
        reports = os.path.join(self.args.work, "reports")
        rc, _ = _sh([self.py, "-m", "visionssm.tracking.evaluate", "--dataset", "got10k", "--root", self.data,
                     "--split", "val", "--trackers", *names, "--results-dir", results, "--report-dir", reports], 60,
                    self.log)
        perf_file = os.path.join(reports, "GOT-10k", "performance.json")
        if rc == 0 and os.path.exists(perf_file):
            perf = json.loads(Path(perf_file).read_text())
            self.summary["evaluation"] = {
                "conventions": perf["conventions"],
                "trackers": {n: {k: p[k] for k in ("ao", "sr50", "sr75", "frames")}
                             for n, p in perf["trackers"].items()},
                "trained_backbone": trained,
            }
            plot = os.path.join(reports, "GOT-10k", "success_plot.png")
            if os.path.exists(plot):
                shutil.copy(plot, os.path.join(self.out_dir, "tracking-synthetic-success_plot.png"))
        self.dump()

    def profile(self) -> None:
        fps_json = os.path.join(self.args.work, "fps.json")
        rc, secs = _sh([self.py, PROFILE, "--backbones", *self.args.fps_backbones, "--json", fps_json,
                        "--iters", "100", "--warmup", "20", "--frames", "150"], max(self.remaining() - 5, 20),
                       self.log)
        if os.path.exists(fps_json):
            self.summary["speed"] = json.loads(Path(fps_json).read_text())
        self.summary["steps"]["profile"] = {"rc": rc, "seconds": secs}
        self.summary["total_seconds"] = time.time() - self.start
        self.dump()


def _check(args, log, start: float) -> None:
    check = _Check(args, log, start)
    check.generate_data()
    checkpoint, trained = None, None
    for backbone in args.backbones:  # the first that trains within the budget is the one tracked
        limit = check.remaining() - args.reserve_s
        if limit < 40:
            break
        checkpoint = check.train(backbone, limit)
        if checkpoint:
            trained = backbone
            break
    results = os.path.join(args.work, "results")
    check.evaluate(check.track(checkpoint, trained, results), trained, results)
    check.profile()
    print(json.dumps({k: check.summary.get(k) for k in ("evaluation", "speed")}, indent=1))


if __name__ == "__main__":
    main()
