"""Scoring tracking results (what ``python -m visionssm.tracking.evaluate``, :mod:`visionssm.tracking.evaluate`, does
once its arguments parse; the metrics, files and conventions are described there).
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from visionssm.utils.cli import UserFileError, UserValueError

from . import metrics
from .results import read_result_boxes, read_result_times
from .runner import DATASET_DIRS, open_dataset, result_paths


def evaluate_got10k(root: str, split: str, results_dir: str, trackers: list[str]) -> dict:
    if split == "test":
        raise UserValueError("GOT-10k test ground truth is withheld: pack the results (run.py --pack) and submit them")
    data = open_dataset("got10k", root, split)
    out = {}
    for name in trackers:
        pooled, times, seq_wise = [], [], {}
        for seq in data:
            seq_dir = os.path.join(results_dir, DATASET_DIRS["got10k"], name, seq.name)
            files = sorted(glob.glob(os.path.join(seq_dir, f"{seq.name}_[0-9]*.txt")))
            if not files:
                raise UserFileError(f"{name}: no results for {seq.name} in {seq_dir}")
            if "cover" not in seq.meta or "resolution" not in seq.meta:
                raise UserValueError(f"{seq.name}: cover.label and meta_info.ini (resolution) are needed to evaluate")
            runs = [read_result_boxes(f, len(seq.boxes)) for f in files]
            ious = metrics.got10k_sequence_ious(runs, seq.boxes, seq.meta["cover"], seq.meta["resolution"])
            seq_times = np.zeros((0, 1))
            time_file = result_paths(results_dir, "got10k", name, seq.name)[1]
            if os.path.exists(time_file):
                seq_times = read_result_times(time_file, len(seq.boxes)).reshape(len(seq.boxes), -1)
            pooled.append(ious)
            times.append(seq_times)
            seq_wise[seq.name] = {"ao": float(ious.mean()) if len(ious) else None, "frames": int(len(ious))}
        summary = metrics.got10k_summary(np.concatenate(pooled), np.concatenate([t.reshape(-1) for t in times]))
        summary["fps"] = frames_per_tracking_second(times)
        summary["seq_wise"] = seq_wise
        out[name] = summary
    return out


def evaluate_lasot(root: str, split: str, results_dir: str, trackers: list[str]) -> dict:
    data = open_dataset("lasot", root, split)
    out = {}
    for name in trackers:
        curves, seq_wise, times = [], {}, []
        for seq in data:
            box_file, time_file = result_paths(results_dir, "lasot", name, seq.name)
            if not os.path.exists(box_file):
                raise UserFileError(f"{name}: no results for {seq.name} ({box_file})")
            boxes = read_result_boxes(box_file, len(seq.boxes), allow_longer=True)  # pytracking cuts longer ones
            c = metrics.lasot_sequence_curves(boxes, seq.boxes, seq.visible)
            curves.append(c)
            seq_wise[seq.name] = {"auc": float(100 * c["success"].mean())}
            if os.path.exists(time_file):
                times.append(read_result_times(time_file, len(seq.boxes)).reshape(len(seq.boxes), -1))
        summary = metrics.lasot_summary(curves)
        if times:
            t = np.concatenate([t.reshape(-1) for t in times])
            t = t[t > 0]
            summary["speed_fps"] = float(np.mean(1.0 / t)) if len(t) else -1.0
            summary["fps"] = frames_per_tracking_second(times)
        summary["seq_wise"] = seq_wise
        out[name] = summary
    return out


def frames_per_tracking_second(times: list[np.ndarray]) -> float:
    """``tracking.run``'s FPS from per-sequence ``(frames, repetitions)`` times: frames after the first over their
    summed time (frame 1 is the initialisation); -1 without times."""
    tracked = [t[1:] for t in times if len(t) > 1]
    seconds = sum(float(t.sum()) for t in tracked)
    return sum(t.size for t in tracked) / seconds if seconds > 0 else -1.0


def plot_curves(performance: dict, dataset: str, report_dir: str) -> list[str]:
    """Success (and for LaSOT precision / normalised precision) plots as PNG; returns the file paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(report_dir, exist_ok=True)
    if dataset == "got10k":
        specs = [("success_plot.png", "succ_curve", metrics.GOT10K_THRESHOLDS, "ao", "AO", 1.0,
                  "Overlap threshold", "Success rate", "GOT-10k success plot")]
    else:
        specs = [
            ("success_plot.png", "success", metrics.SUCCESS_THRESHOLDS, "auc", "AUC %", 1.0, "Overlap threshold",
             "Success rate", "LaSOT success plot"),
            ("precision_plot.png", "precision", metrics.PRECISION_THRESHOLDS, "precision_20px", "P@20 %", 1.0,
             "Location error threshold (px)", "Precision", "LaSOT precision plot"),
            ("norm_precision_plot.png", "norm_precision", metrics.NORM_PRECISION_THRESHOLDS, "norm_precision_0.20",
             "NP@0.20 %", 1.0, "Normalised location error threshold", "Normalised precision",
             "LaSOT normalised precision plot"),
        ]
    paths = []
    for filename, key, xs, score_key, label, scale, xlabel, ylabel, title in specs:
        fig, ax = plt.subplots(figsize=(5, 4), dpi=120)
        order = sorted(performance, key=lambda n: -performance[n][score_key])
        for name in order:
            perf = performance[name]
            ys = perf["succ_curve"] if dataset == "got10k" else perf["curves"][key]
            value = perf[score_key] * scale
            # the table's digits: AO as a fraction (.3f), LaSOT scores in percent (.2f)
            ax.plot(xs, ys, label=f"{name} [{label} {value:.3f}]" if dataset == "got10k" else
                    f"{name} [{label} {value:.2f}]")
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title, xlim=(xs[0], xs[-1]), ylim=(0, 1.0))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower left" if key in ("success", "succ_curve") else "lower right", fontsize=8)
        path = os.path.join(report_dir, filename)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def evaluate(dataset: str, root: str, split: str, results_dir: str, trackers: list[str], report_dir: str = "reports",
             plots: bool = True) -> dict:
    """Compute the metrics, write ``performance.json`` (+ plots) and return the report dict."""
    if dataset == "got10k":
        performance = evaluate_got10k(root, split, results_dir, trackers)
        conventions = metrics.GOT10K_CONVENTIONS
    elif dataset == "lasot":
        performance = evaluate_lasot(root, split, results_dir, trackers)
        conventions = metrics.LASOT_CONVENTIONS
    else:
        raise UserValueError(f"dataset must be got10k or lasot, got {dataset!r}")
    out_dir = os.path.join(report_dir, DATASET_DIRS[dataset])
    report = {"dataset": dataset, "split": split, "conventions": conventions, "trackers": performance}
    if plots:
        report["plots"] = plot_curves(performance, dataset, out_dir)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "performance.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report


def format_report(report: dict) -> str:
    lines = [f"{report['dataset']} / {report['split']}"]
    if report["dataset"] == "got10k":
        lines.append(f"{'tracker':<24}{'AO':>8}{'SR0.5':>8}{'SR0.75':>8}{'FPS':>12}{'mean 1/t':>12}{'frames':>9}")
        for name, p in report["trackers"].items():
            lines.append(f"{name:<24}{p['ao']:>8.3f}{p['sr50']:>8.3f}{p['sr75']:>8.3f}{p.get('fps', -1):>12.1f}"
                         f"{p.get('speed_fps', -1):>12.1f}{p['frames']:>9d}")
    else:
        lines.append(f"{'tracker':<24}{'AUC %':>8}{'P@20':>8}{'NP@0.2':>8}{'OP50':>8}{'OP75':>8}{'FPS':>12}"
                     f"{'mean 1/t':>12}{'seqs':>6}")
        for name, p in report["trackers"].items():
            lines.append(f"{name:<24}{p['auc']:>8.2f}{p['precision_20px']:>8.2f}{p['norm_precision_0.20']:>8.2f}"
                         f"{p['op50']:>8.2f}{p['op75']:>8.2f}{p.get('fps', -1):>12.1f}{p.get('speed_fps', -1):>12.1f}"
                         f"{p['sequences']:>6d}")
    lines.append("Speed: FPS = frames / tracking time (frame 1 excluded, as tracking.run prints it); mean 1/t = the "
                 "toolkit's speed, mean of 1/t over per-frame times (-1: no time files).")
    lines.append("Conventions: " + report["conventions"])
    return "\n".join(lines)
