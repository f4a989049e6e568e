"""Running a tracker over a GOT-10k or LaSOT split and writing its results (what ``python -m visionssm.tracking.run``,
:mod:`visionssm.tracking.run`, does once its arguments parse; the layout and the two speeds are described there).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import torch
from tqdm import tqdm

from visionssm.utils.cli import UserFileError, UserValueError

from .data.got10k import Got10k
from .data.lasot import LaSOT
from .data.sampler import load_rgb
from .results import check_boxes, read_result_boxes, write_rows
from .tracker import FirstBoxTracker, load_tracker

DATASET_DIRS = {"got10k": "GOT-10k", "lasot": "LaSOT"}


def open_dataset(dataset: str, root: str, split: str):
    if dataset == "got10k":
        if split not in ("val", "test", "train"):
            raise UserValueError(f"GOT-10k split must be val, test or train, got {split!r}")
        return Got10k(root, split)
    if dataset == "lasot":
        if split not in ("test", "train", "all"):
            raise UserValueError(f"LaSOT split must be test (protocol II), train or all, got {split!r}")
        return LaSOT(root, split)
    raise UserValueError(f"dataset must be got10k or lasot, got {dataset!r}")


def result_paths(results_dir: str, dataset: str, name: str, seq: str, repetition: int = 1) -> tuple[str, str]:
    base = os.path.join(results_dir, DATASET_DIRS[dataset], name)
    if dataset == "got10k":
        seq_dir = os.path.join(base, seq)
        return os.path.join(seq_dir, f"{seq}_{repetition:03d}.txt"), os.path.join(seq_dir, f"{seq}_time.txt")
    return os.path.join(base, f"{seq}.txt"), os.path.join(base, f"{seq}_time.txt")


def track_sequence(tracker, seq) -> tuple[np.ndarray, np.ndarray]:
    """Boxes (N, 4) and per-frame seconds (N,); frame 1 gets the given box (and the initialisation time)."""
    first = seq.boxes[0]
    if not (np.isfinite(first).all() and first[2] > 0 and first[3] > 0):
        raise UserValueError(f"{seq.meta.get('groundtruth', seq.name)}:1: the first frame's box {first.tolist()} is "
                         "not a box to track (NaN, infinite, or not positive in width and height)")
    boxes = np.zeros((len(seq), 4))
    times = np.zeros(len(seq))
    for t, path in enumerate(seq.frames):
        image = load_rgb(path)
        start = time.perf_counter()
        if t == 0:
            tracker.initialize(image, first)
            boxes[0] = first
        else:
            boxes[t] = tracker.track(image)
        times[t] = time.perf_counter() - start
    return boxes, times


def run(
    dataset: str,
    root: str,
    split: str,
    name: str,
    results_dir: str = "results",
    checkpoint: str | None = None,
    baseline: str | None = None,
    device: str | None = None,
    sequences: list[str] | None = None,
    max_sequences: int | None = None,
    amp: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Track every sequence of the split and write the result files; returns the run summary."""
    if (checkpoint is None) == (baseline is None):
        raise UserValueError("give exactly one of checkpoint or baseline")
    data = open_dataset(dataset, root, split)
    names = list(sequences) if sequences else list(data.seq_names)
    if max_sequences:
        names = names[:max_sequences]
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if baseline is not None:
        if baseline != "first-box":
            raise UserValueError(f"unknown baseline {baseline!r} (only 'first-box')")
        tracker = FirstBoxTracker()
    else:
        tracker = load_tracker(checkpoint, device=device, amp=amp)
    total_frames, total_time, inverse_times, per_seq = 0, 0.0, [], {}
    for seq_name in tqdm(names, desc=f"{name} on {dataset}/{split}", disable=not progress):
        box_file, time_file = result_paths(results_dir, dataset, name, seq_name)
        seq = data[seq_name]
        if os.path.exists(box_file) and not overwrite:
            _check_kept(box_file, len(seq))
            continue
        boxes, times = track_sequence(tracker, seq)
        write_rows(box_file, check_boxes(boxes, f"{name} on {seq_name}"), "%.4f")
        write_rows(time_file, times[:, None], "%.8f")
        tracked = times[1:]
        total_frames += len(tracked)
        total_time += float(tracked.sum())
        inverse_times += (1.0 / times[times > 0]).tolist()
        per_seq[seq_name] = {"frames": len(seq), "fps": float(len(tracked) / max(tracked.sum(), 1e-12)),
                             "fps_toolkit_mean_inverse_time": float(np.mean(1.0 / times[times > 0]))}
    summary = {
        "dataset": dataset, "split": split, "name": name, "device": str(device),
        "gpu": torch.cuda.get_device_name() if str(device).startswith("cuda") else None,
        "checkpoint": checkpoint, "baseline": baseline, "sequences": len(per_seq),
        "frames_tracked": total_frames,
        "fps": float(total_frames / total_time) if total_time > 0 else None,
        "fps_toolkit_mean_inverse_time": float(np.mean(inverse_times)) if inverse_times else None,
        "per_sequence": per_seq,
    }
    out_dir = os.path.join(results_dir, DATASET_DIRS[dataset])
    os.makedirs(out_dir, exist_ok=True)
    with open(summary_path(results_dir, dataset, name, split), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def summary_path(results_dir: str, dataset: str, name: str, split: str) -> str:
    """The run summary of one split (val and test runs of a tracker share its result folder, not their summary)."""
    return os.path.join(results_dir, DATASET_DIRS[dataset], f"{name}_{split}_run_summary.json")


def format_speed(fps: float | None, fps_mean_inverse: float | None) -> str:
    """Both speeds, named: the same words in tracking.run's line and tracking.evaluate's table legend."""
    if fps is None:
        return "speed unknown"
    return (f"FPS {fps:.1f} (frames / tracking time, frame 1 and image decoding excluded), toolkit speed "
            f"{fps_mean_inverse:.1f} (mean of 1/t per frame)")


def _check_kept(box_file: str, frames: int) -> None:
    """A result left by an earlier run is kept only when it is a complete, valid one."""
    try:
        read_result_boxes(box_file, frames)
    except ValueError as error:
        raise UserValueError(f"{error}; rerun with --overwrite to track this sequence again") from None


def pack_got10k(results_dir: str, name: str, seq_names: list[str]) -> str:
    """Zip the results of ``seq_names`` (``<seq>/<seq>_NNN.txt`` and ``<seq>_time.txt``, the server's submission
    format) into ``<results>/GOT-10k/<name>.zip``. Val and test results share the tracker folder (as in the toolkit),
    so only the listed sequences go in; every one of them must have results."""
    import zipfile

    base = os.path.join(results_dir, DATASET_DIRS["got10k"], name)
    missing = [s for s in seq_names if not os.path.exists(result_paths(results_dir, "got10k", name, s)[0])]
    if missing:
        raise UserFileError(f"no results for {len(missing)} sequences, e.g. {missing[:3]}")
    archive = os.path.join(results_dir, DATASET_DIRS["got10k"], f"{name}.zip")
    with zipfile.ZipFile(archive + ".tmp", "w", zipfile.ZIP_DEFLATED) as z:
        for seq in seq_names:
            z.write(os.path.join(base, seq), seq + "/")
            for f in sorted(os.listdir(os.path.join(base, seq))):
                z.write(os.path.join(base, seq, f), f"{seq}/{f}")
    os.replace(archive + ".tmp", archive)
    return archive
