"""benchmarks/train_throughput.py: its per-epoch cost arithmetic, and the script end to end on CPU (a tiny generated
JPEG set, a tiny MambaVision, the pil backend and the gpu one, which falls back to it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from benchmark_scripts import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "train_throughput.py"

TINY_MODEL = "{dims: 8, depths: [1, 1, 1, 1], stem_dim: 8, num_heads: [1, 1, 2, 2], window_size: [8, 8, 2, 2]}"


def test_epoch_costs_split_the_time_outside_the_loop_and_extrapolate_to_imagenet():
    """Epochs 2 and 3 of 1,000 images: loops of 2 s and 4 s (500 and 250 img/s), evaluations of 1 s and 3 s over
    100 images, records 10 s and 12 s apart, so 7 s and 5 s of checkpoint and the rest; ImageNet: its loop at the
    runs' loop rate, 500 evaluations' worth of the mean evaluation, the rest kept per epoch; the loop's 6 s split
    into 1.5 s of waiting for batches and 3 s each of the data stage's decoding and transforming."""
    throughput = load_script("train_throughput")
    records = [{"wall_time": 100.0, "train_img_per_s": 50.0, "val_seconds": 9.0, "val_images": 100},
               {"wall_time": 110.0, "train_img_per_s": 500.0, "val_seconds": 1.0, "val_images": 100,
                "train_data_wait_s": 0.5, "data_stage_decode_s": 1.0, "data_stage_transform_s": 2.0},
               {"wall_time": 122.0, "train_img_per_s": 250.0, "val_seconds": 3.0, "val_images": 100,
                "train_data_wait_s": 1.0, "data_stage_decode_s": 2.0, "data_stage_transform_s": 1.0}]
    costs = throughput.epoch_costs(records, per_epoch=1000)
    assert costs["loop_share_data_wait"] == pytest.approx(1.5 / 6)
    assert costs["loop_share_stage_decode"] == costs["loop_share_stage_transform"] == pytest.approx(3 / 6)
    assert costs["loop_img_per_s"] == pytest.approx(2000 / 6)
    assert costs["whole_run_img_per_s"] == pytest.approx(2000 / 22)
    assert costs["eval_s_per_epoch"] == pytest.approx(2.0)
    assert costs["checkpoint_and_rest_s_per_epoch"] == pytest.approx(6.0)
    loop, evaluation = 1_281_167 * 6 / 2000, 2.0 * 50_000 / 100
    assert costs["imagenet_epoch_s"] == pytest.approx(loop + evaluation + 6.0)
    assert costs["imagenet_fixed_share"] == pytest.approx((evaluation + 6.0) / (loop + evaluation + 6.0))
    assert costs["imagenet_whole_run_img_per_s"] == pytest.approx(1_281_167 / (loop + evaluation + 6.0))


def _run(argv: list[str]) -> str:
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def test_script_measures_a_tiny_run_on_cpu(tmp_path):
    data, out = tmp_path / "set", tmp_path / "results"
    argv = ["--device", "cpu", "--images", "24", "--val-images", "6", "--classes", "3", "--epochs", "3",
            "--batch-size", "4", "--img-size", "16", "--workers", "1", "--amp", "no", "--backends", "pil", "gpu",
            "--jpeg-decoders", "torchvision", "--models", "mamba_vision_T", "--step-iters", "2", "--step-warmup", "1",
            "--data-dir", str(data),
            "--out", str(out), "--train-args", f"--model-kwargs '{TINY_MODEL}' --warmup-epochs 0"]
    printed = _run(argv)
    assert "wrote 30 JPEGs" in printed and "mamba_vision_T: model step" in printed
    assert len(list((data / "train").rglob("*.JPEG"))) == 24 and len(list((data / "val").rglob("*.JPEG"))) == 6
    (json_file,) = out.glob("whole-run-cpu-*.json")
    assert json_file.with_suffix(".csv").is_file()
    result = json.loads(json_file.read_text())
    assert result["environment"]["cpu_cores"] >= 1 and result["environment"]["date"] in json_file.name
    row, gpu_row = result["results"]
    # the gpu backend's run: its data stage alone measured with the decoder asked for; on a CPU the run takes PIL
    assert gpu_row["jpeg_decoder"] == "torchvision" and gpu_row["stage_img_per_s"] > 0 and gpu_row["backend"] == "pil"
    assert row["model"] == "mamba_vision_T" and row["backend"] == "pil" and row["epoch_images"] == 24
    assert row["val_images"] == 6 and row["skipped_images"] == 0
    assert 0 < row["whole_run_img_per_s"] < row["loop_img_per_s"] and row["eval_s_per_epoch"] > 0
    assert row["whole_run_share"] == pytest.approx(row["whole_run_img_per_s"] / row["model_step_img_per_s"])
    assert 0 < row["imagenet_fixed_share"] < 1 and row["model_step_img_per_s"] > 0
    assert 0 <= row["loop_share_data_wait"] < 1 and "waiting for batches" in printed  # the pil run: no stage split
    assert "loop_share_stage_decode" not in row
    assert f"{row['whole_run_share']:.2f}" in printed.split("IN run/step")[1]  # the table holds the row
    assert torch.isfinite(torch.tensor(row["val_top1_last"]))
    manifest = json.loads((data / "manifest.json").read_text())  # what lets the next call reuse the set
    assert manifest == {"images": 24, "val_images": 6, "classes": 3, "seed": 0, "size": [500, 375], "quality": 90}
