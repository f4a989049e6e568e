"""The shared benchmark harness: timing on CPU, result files, the side-by-side table."""

import csv
import json

import pytest
import torch

from visionssm.kernels.utils import assert_close, relative_error
from visionssm.utils.benchmark import Timing, environment, save_results, side_by_side, time_fn


def test_time_fn_on_cpu_counts_repeats():
    calls = []
    timing = time_fn(lambda: calls.append(1), warmup=5, repeats=7, device="cpu")
    assert isinstance(timing, Timing) and timing.repeats == 7
    assert len(calls) == 7 + 1
    assert 0 <= timing.p20_ms <= timing.median_ms <= timing.p80_ms


def test_save_results_writes_stamped_json_and_csv(tmp_path):
    rows = [{"shape": "a", "mode": "fwd", "impl": "ours", "ms": 1.5}]
    json_path, csv_path = save_results("unit", rows, out_dir=tmp_path)
    payload = json.loads(json_path.read_text())
    assert payload["results"] == rows
    for key in ("device", "torch", "triton", "date"):
        assert key in payload["environment"]
    (row,) = list(csv.DictReader(csv_path.open()))
    assert row["impl"] == "ours" and float(row["ms"]) == 1.5 and row["date"] == environment()["date"]


def test_side_by_side_ratios():
    rows = [
        {"shape": "s1", "mode": "fwd", "impl": "anchor", "ms": 2.0},
        {"shape": "s1", "mode": "fwd", "impl": "ours", "ms": 1.0},
        {"shape": "s2", "mode": "fwd", "impl": "anchor", "ms": 4.0},
    ]
    table = side_by_side(rows, keys=["shape", "mode"], baseline="anchor")
    lines = table.splitlines()
    assert "ours/anchor" in lines[0]
    assert lines[2].split()[-1] == "0.50x"
    assert lines[3].split()[-1] == "n/a"


def test_relative_error_and_assert_close():
    expected = torch.tensor([1.0, 2.0, 2.0])
    assert relative_error(expected * 1.001, expected) == pytest.approx(1e-3, rel=1e-3)
    assert_close(expected * (1 + 1e-4), expected, dtype=torch.float32)
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(expected * 1.01, expected, dtype=torch.float32)
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(torch.tensor([1.0, float("nan"), 2.0]), expected, tol=1.0)
    with pytest.raises(AssertionError, match="shape"):
        assert_close(expected[:2], expected)


def test_poisoned_outputs_are_nan():
    from visionssm.kernels.utils import empty_output, poison_outputs

    with poison_outputs():
        out = empty_output((3,), device=torch.device("cpu"), dtype=torch.float32)
    assert torch.isnan(out).all()
