"""benchmarks/shortcuts.py and benchmarks/before_after.py on the CPU: every shortcut variant builds and runs its model,
and a before/after run of this checkout against a committed revision gives its table."""

import subprocess
import sys

import torch
from benchmark_scripts import BENCHMARKS, load_script

from visionssm.benchmark.config import BenchmarkConfig
from visionssm.kernels import utils
from visionssm.models import comba_vision


def test_shortcut_variants_apply_and_restore():
    """Each variant that applies to comba_vision_T runs a training step under its context, and leaves the shipped
    model's switches as they were (the chain rule, the direct launch)."""
    shortcuts = load_script("shortcuts")
    variants = shortcuts.applicable("comba_vision_T", list(shortcuts.VARIANTS))
    assert variants == list(shortcuts.VARIANTS)  # Comba has every shortcut
    assert shortcuts.applicable("mamba_vision_T", list(shortcuts.VARIANTS)) == ["default", "triton_launch"]
    cfg = BenchmarkConfig(models=[], batch_size=2, img_size=32, dtype="float32", warmup=1, repeats=1, device="cpu")
    can_chain = comba_vision.can_chain
    for variant in variants:
        row = shortcuts.measure("comba_vision_T", variant, cfg, torch.device("cpu"))
        assert row["variant"] == variant and row["infer_img_s"] > 0 and row["train_img_s"] > 0
        assert comba_vision.can_chain is can_chain and utils.DIRECT_LAUNCH


def test_before_after_tables_medians_and_host_marks():
    before_after = load_script("before_after")
    rows = lambda infer, train, host=False: {("backbone", "m", "infer"): (infer, host),
                                              ("backbone", "m", "train"): (train, False),
                                              ("kernel", "op s fwd", "ours"): (1 / 0.5, None)}
    rounds = [{"before": rows(100, 10), "after": rows(110, 9, True)},
              {"before": rows(100, 10), "after": rows(130, 11)},
              {"before": rows(100, 10), "after": rows(120, 12)}]
    lines = before_after.table(rounds)
    infer, train, kernel = (next(line for line in lines if key in line) for key in (" infer ", " train ", "op s fwd"))
    assert infer.split()[-2:] == ["1.200", "‡"]  # median 120 / 100, host-bound in one round
    assert train.split()[-1] == "1.100"
    assert kernel.split()[-3:] == ["0.5", "0.5", "1.000"]  # shown in ms again


def test_before_after_runs_a_revision_against_this_checkout(tmp_path):
    """The whole script on the CPU: the committed HEAD against the checkout, one tiny model, no kernel suites."""
    out = tmp_path / "table.txt"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "before_after.py"), "HEAD", "--models", "comba_vision_T",
                           "--ops", "--batch-size", "2", "--img-size", "32", "--warmup", "1", "--repeats", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = out.read_text().splitlines()
    assert lines[0].startswith("# HEAD (before) against this checkout (after)")
    measured = [line.split() for line in lines[2:]]
    assert [row[:3] for row in measured] == [["backbone", "comba_vision_T", "infer"],
                                             ["backbone", "comba_vision_T", "train"]]
    assert all(float(row[3]) > 0 and float(row[4]) > 0 and float(row[5]) > 0 for row in measured)


def test_before_after_refuses_bad_arguments(tmp_path):
    done = subprocess.run([sys.executable, str(BENCHMARKS / "before_after.py"), "no-such-revision", "--models",
                           "comba_vision_T", "--ops"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0 and "no-such-revision" in done.stderr
    done = subprocess.run([sys.executable, str(BENCHMARKS / "before_after.py"), "HEAD", "--rounds", "0"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0 and "--rounds must be at least 1" in done.stderr

