"""benchmarks/train_learning_run.py's data-backend comparison: the JPEG copy of the generated set, the comparison
of the backends' last top-1 against the seeds' spread, and the script end to end on CPU (two backends, two seeds,
all four runs at once, a tiny model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from benchmark_scripts import BENCHMARKS, load_script
from PIL import Image

TINY_MODEL = "{dims: 8, depths: [1, 1, 1, 1], stem_dim: 8, num_heads: [1, 1, 2, 2], window_size: [8, 8, 2, 2]}"


def test_jpeg_copy_mirrors_the_image_folder_once(tmp_path):
    learning = load_script("train_learning_run")
    data = tmp_path / "shapes"
    rng = np.random.default_rng(0)
    for split, name in (("train", "disc"), ("train", "ring"), ("val", "disc")):
        (data / split / name).mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(data / split / name / "0.png")
    (data / "manifest.json").write_text("{}")  # the set's own files outside the class folders stay behind
    copy = learning.jpeg_copy(data, quality=90)
    assert copy == tmp_path / "shapes_jpeg_q90"
    jpegs = sorted(str(p.relative_to(copy)) for p in copy.rglob("*.jpg"))
    assert jpegs == ["train/disc/0.jpg", "train/ring/0.jpg", "val/disc/0.jpg"]
    with Image.open(copy / "train" / "ring" / "0.jpg") as image:
        assert image.format == "JPEG" and image.size == (24, 20)
    stamp = (copy / "complete").stat().st_mtime_ns
    assert learning.jpeg_copy(data, quality=90) == copy and (copy / "complete").stat().st_mtime_ns == stamp


def _learning(model: str, backend: str, top1: list[float]) -> dict:
    return {f"{model} {backend} seed {seed}": {"model": model, "data_backend": backend, "seed": seed,
                                                "records": [{"val_top1": 1.0}, {"val_top1": value}]}
            for seed, value in enumerate(top1)}


def test_compare_backends_reads_the_difference_against_the_seed_spread():
    learning = load_script("train_learning_run")
    runs = {**_learning("a", "pil", [80.0, 84.0]), **_learning("a", "gpu", [83.0, 83.5]),
            **_learning("b", "pil", [90.0, 90.5]), **_learning("b", "gpu", [85.0, 86.0])}
    a, b = learning.compare_backends(runs, ["pil", "gpu"])
    assert a["model"] == "a" and a["pil"] == {"mean": 82.0, "min": 80.0, "max": 84.0, "runs": 2}
    assert a["difference"] == pytest.approx(1.25) and a["noise"] == 4.0 and a["within_noise"]
    assert a["versus"] == "gpu - pil" and a["seeds"] == 2
    assert b["difference"] == pytest.approx(-4.75) and b["noise"] == 1.0 and not b["within_noise"]
    # a backend without a finished run gives no comparison for that model
    assert learning.compare_backends({**_learning("a", "pil", [80.0])}, ["pil", "gpu"]) == []


def test_two_backends_two_seeds_in_parallel_on_cpu(tmp_path):
    """On CPU the gpu backend falls back to PIL with its one line; the runs, their records and the comparison are
    written, and the JPEG copy is what they trained on."""
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, str(BENCHMARKS / "train_learning_run.py"), "--out", str(out), "--work", str(work),
           "--throughput-models", "--models", "mamba_vision_T", "--epochs", "1", "--train-per-class", "4",
           "--val-per-class", "2", "--image-size", "16", "--workers", "4", "--image-format", "jpeg",
           "--data-backends", "pil", "gpu", "--seeds", "0", "1", "--parallel", "4", "--name", "backends",
           "--run-timeout", "240", "--extra", "--model-kwargs", TINY_MODEL, "--img-size", "16", "--batch-size", "8",
           "--model-ema-decay", "0.9"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (report_file,) = out.glob("learning-backends-*.json")
    report = json.loads(report_file.read_text())
    assert report["data"]["format"] == "jpeg" and sorted(report["learning"]) == [
        f"mamba_vision_T {b} seed {s}" for b in ("gpu", "pil") for s in (0, 1)]
    for key, info in report["learning"].items():
        assert info["returncode"] == 0 and len(info["records"]) == 1, (key, info["log_tail"])
        log = (work / "runs" / f"{key.replace(' ', '_')}.log").read_text()
        assert "_jpeg_q90" in log and ("--data-backend gpu needs a CUDA device" in log) == (info["data_backend"] ==
                                                                                            "gpu")
    (row,) = report["backends"]
    assert row["model"] == "mamba_vision_T" and row["seeds"] == 2 and row["versus"] == "gpu - pil"
    assert "last val top-1 over seeds 2: pil" in proc.stdout and "against a seed spread of" in proc.stdout
