"""The benchmark command (visionssm.benchmark: backbones and kernel suites) and the regression check, on CPU with
tiny timm models."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from benchmark_scripts import load_script

from visionssm import benchmark as bench
from visionssm.benchmark import kernel_suites

REPO = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--batch-size", "2", "--img-size", "64", "--warmup", "0", "--repeats", "2"]


check_regression = load_script("check_regression")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One real CPU run of two tiny timm models, shared by the output and regression tests."""
    out = tmp_path_factory.mktemp("bench")
    import contextlib
    import io

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = bench.main(["test_resnet", "test_vit", *TINY, "--baseline", "test_resnet", "--out", str(out)])
    return status, stdout.getvalue(), out


# ---------------------------------------------------------------------------------------------------------------
# Argument handling


def _config(**overrides):
    values = {"models": ["test_resnet"], "batch_size": 2, "img_size": 64, "device": "cpu", "repeats": 1,
              "warmup": 0}
    values.update(overrides)
    return bench.BenchmarkConfig(**values)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"models": []}, "at least one"),
    ({"models": ["resnet_does_not_exist"]}, "unknown model"),
    ({"models": ["no_such_family_*"]}, "matches no timm model"),
    ({"batch_size": 0}, "batch_size"),
    ({"img_size": -1}, "img_size"),
    ({"repeats": 0}, "repeats"),
    ({"warmup": -1}, "warmup"),
    ({"dtype": "int8"}, "dtype"),
    ({"precision": "mixed"}, "precision"),
    ({"modes": ("infer", "backward")}, "modes"),
    ({"modes": ()}, "modes"),
    ({"compile_mode": "fastest"}, "compile_mode"),
    ({"device": "tpu"}, "device"),
    ({"baseline": "resnet50"}, "baseline"),
    ({"data_parallel": 0}, "data_parallel"),
    ({"cuda_graph": True}, "cuda_graph"),
])
def test_bad_arguments_raise_value_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        bench.validate_config(_config(**overrides))


def test_a_count_of_the_wrong_type_raises_type_error():
    with pytest.raises(TypeError, match="batch_size must be an int, got float"):
        bench.validate_config(_config(batch_size=2.5))


def test_unknown_model_suggests_close_names():
    with pytest.raises(ValueError, match="did you mean.*resnet18"):
        bench.resolve_models(["resnet181"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_cuda_without_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        bench.validate_config(_config(device="cuda"))


def test_skip_unknown_leaves_out_names_this_timm_lacks():
    cfg = bench.validate_config(_config(models=["test_resnet", "no_such_model_abc"], skip_unknown=True))
    assert cfg.models == ["test_resnet"] and "no_such_model_abc" in cfg.skipped[0]
    with pytest.raises(ValueError, match="none of the given names"):
        bench.validate_config(_config(models=["no_such_model_abc"], skip_unknown=True))


def test_normalises_dtype_aliases_modes_and_patterns():
    cfg = bench.validate_config(_config(models=["test_vit*", "test_resnet"], dtype="bf16",
                                        modes=("latency", "infer")))
    assert cfg.dtype == "bfloat16" and cfg.torch_dtype is torch.bfloat16
    assert cfg.modes == ("infer", "latency")
    assert "test_vit" in cfg.models and "test_vit2" in cfg.models and cfg.models[-1] == "test_resnet"
    assert cfg.baseline == cfg.models[0]
    assert bench.validate_config(_config(dtype="fp16")).dtype == "float16"


@pytest.mark.parametrize("argv", [
    ["resnet_does_not_exist", "--device", "cpu"],
    ["test_resnet", "--device", "cpu", "--batch-size", "0"],
    ["test_resnet", "--device", "cpu", "--dtype", "float8"],
    ["test_resnet", "--device", "cpu", "--gpus", "many"],
    ["test_resnet", "--device", "cpu", "--chart", "latency"],
    ["test_resnet", "--device", "cpu", "--batch-size", "two"],
])
def test_cli_rejects_bad_arguments_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "compile_", "mode"), [
    ([], False, "default"),
    (["--compile"], True, "default"),
    (["--compile", "reduce-overhead"], True, "reduce-overhead"),
    (["--compile=max-autotune"], True, "max-autotune"),
])
def test_compile_takes_an_optional_mode(argv, compile_, mode):
    cfg = bench.cli._config_from_args(bench.build_parser().parse_args(["test_resnet", "--device", "cpu", *argv]))
    assert (cfg.compile, cfg.compile_mode) == (compile_, mode)
    assert bench.validate_config(cfg).compile_mode == mode


@pytest.mark.parametrize(("argv", "named"), [
    (["test_resnet", "--compile", "fastest"], "unknown mode 'fastest'"),
    (["--compile", "test_resnet"], "model names go before a bare --compile"),
])
def test_an_unknown_compile_mode_is_one_line_naming_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main([*argv, "--device", "cpu"])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "error: argument --compile: " in lines[0] and named in lines[0], lines


def test_module_entry_point_reports_unknown_model():
    result = subprocess.run([sys.executable, "-m", "visionssm.benchmark", "not_a_model_xyz", "--device", "cpu"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2
    assert "unknown model 'not_a_model_xyz'" in result.stderr


def test_kernels_subcommand_reaches_the_kernel_suite(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["kernels", "--help"])
    assert exit_info.value.code == 0
    assert "--ops" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------
# Kernel suites, and where results go


def _command(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``visionssm-benchmark ARGS`` as a user runs it: the installed console script when it sits beside this
    interpreter (``python -m visionssm.benchmark`` otherwise), from ``cwd``."""
    script = Path(sys.executable).with_name("visionssm-benchmark")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "visionssm.benchmark"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_every_kernel_op_of_the_mixer_registry_has_a_suite():
    from visionssm.layers import mixer_kernel_ops

    for op in mixer_kernel_ops():
        suite = kernel_suites.load_suite(op)
        assert isinstance(suite.ANCHOR, str) and callable(suite.run), op
    with pytest.raises(ValueError, match="ops: 'not_an_op'"):
        kernel_suites.load_suite("not_an_op")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_kernels_command_on_cpu_skips_every_suite_in_one_line_and_writes_nothing(tmp_path):
    from visionssm.layers import mixer_kernel_ops

    outside = tmp_path / "elsewhere"  # a working directory outside the repository
    outside.mkdir()
    result = _command("kernels", cwd=outside)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    ops = mixer_kernel_ops()
    assert len(lines) == len(ops), result.stdout
    for op, line in zip(ops, lines):
        assert line.startswith(f"{op}: skipped") and "CUDA" in line
    assert "Traceback" not in result.stderr
    assert list(outside.iterdir()) == []  # no benchmark-results folder, no empty files

    # the model command's --kernels flag runs the same suites into the same --out
    out = tmp_path / "out"
    assert bench.main(["--kernels", "--out", str(out)]) == 0
    assert not out.exists()


@pytest.fixture
def fake_gpu_suites(monkeypatch):
    """The runner on a pretend GPU with stand-in suites: what gets written for measured, empty and failing ones."""
    import types

    suites = {}

    def install(op, rows):
        def run(quick, copy_gbps):
            if isinstance(rows, Exception):
                raise rows
            return [dict(row) for row in rows]

        suites[op] = types.SimpleNamespace(ANCHOR="anchor", run=run)

    monkeypatch.setattr(kernel_suites.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernel_suites, "copy_bandwidth_gbps", lambda: None)
    monkeypatch.setattr(kernel_suites, "environment", lambda: {"device": "Fake GPU", "torch": "t", "triton": "t",
                                                                "date": "2000-01-01"})
    monkeypatch.setattr(kernel_suites, "load_suite", lambda op: suites[op])
    return install


def test_kernel_suites_write_measured_rows_to_out_and_nothing_for_skipped_ones(fake_gpu_suites, tmp_path, capsys):
    measured = [{"op": "a", "shape": "s", "mode": "fwd", "impl": "anchor", "ms": 2.0},
                {"op": "a", "shape": "s", "mode": "fwd", "impl": "ours", "ms": 1.0}]
    fake_gpu_suites("a", measured)
    fake_gpu_suites("b", [])
    fake_gpu_suites("c", RuntimeError("boom"))
    out = tmp_path / "results"
    assert kernel_suites.run_suites(["a", "b"], out=out) == 0
    printed = capsys.readouterr().out
    assert "b: skipped" in printed and "ours/anchor" in printed and "0.50x" in printed
    (json_path,) = out.glob("*.json")
    assert json_path.name == "kernels-a-fake-gpu-2000-01-01.json"  # named after the suites that measured
    assert json.loads(json_path.read_text())["results"] == measured
    assert [p.suffix for p in sorted(out.iterdir())] == [".csv", ".json"]

    # a failing suite is reported, the others still measured, and the exit status says so
    out = tmp_path / "with_failure"
    assert kernel_suites.run_suites(["c", "a"], out=out) == 1
    assert "c: suite failed: RuntimeError: boom" in capsys.readouterr().out
    assert len(list(out.glob("kernels-a-*.json"))) == 1

    # only skipped suites: no folder, no files
    out = tmp_path / "only_skipped"
    assert kernel_suites.run_suites(["b"], out=out) == 0
    assert not out.exists()


def test_model_command_writes_to_benchmark_results_in_the_working_directory(tmp_path):
    result = _command("test_resnet", *TINY, "--modes", "infer", "--no-flops", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    written = sorted(p.name for p in (tmp_path / "benchmark-results").iterdir())
    assert [Path(name).suffix for name in written] == [".csv", ".json", ".png"]
    assert all(name.startswith("throughput-cpu") for name in written)
    assert str(tmp_path / "benchmark-results") in result.stdout  # the "wrote" line names the absolute paths


def test_kernel_script_in_a_checkout_writes_next_to_the_committed_results():
    script = load_script("kernels")
    assert script.RESULTS_DIR == REPO / "benchmarks" / "results"
    parser = kernel_suites.build_parser(script.RESULTS_DIR)
    assert parser.parse_args([]).out == str(REPO / "benchmarks" / "results")
    assert kernel_suites.build_parser().parse_args([]).out == "benchmark-results"


# ---------------------------------------------------------------------------------------------------------------
# Measurements and outputs


def test_flop_rule_is_two_times_macs():
    h = w = 8
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1, bias=False), torch.nn.Flatten(),
                                torch.nn.Linear(4 * h * w, 10))
    macs = 4 * 3 * 9 * h * w + 4 * h * w * 10
    assert bench.count_flops(model, h) == pytest.approx(2 * macs / 1e9)


def test_flop_count_leaves_out_the_sequence_mixer_ops():
    from visionssm import kernels

    class Mixer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 16, bias=False)

        def forward(self, img):
            q = self.proj(img[:, 0].reshape(1, 4, 1, 16))
            return kernels.gka(q, q, q, None, causal=False)

    model = Mixer()
    assert bench.count_flops(model, 8) == pytest.approx(2 * 4 * 16 * 16 / 1e9)
    assert kernels.gka.__name__ == "gka"  # the counting wrapper is removed again


def test_table_json_csv_png(tiny_run):
    status, stdout, out = tiny_run
    assert status == 0, stdout
    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("model "))
    for column in ("params (M)", "GFLOPs", "infer img/s", "train img/s", "lat b1 (ms)", "infer/base"):
        assert column in header
    rows = {line.split()[0]: line for line in lines if line.split()[:1] in (["test_resnet"], ["test_vit"])}
    assert set(rows) == {"test_resnet", "test_vit"}
    assert rows["test_resnet"].split()[-3:] == ["1.00x"] * 3  # the baseline against itself

    (json_path,) = out.glob("throughput-*.json")
    data = json.loads(json_path.read_text())
    env = data["environment"]
    assert env["device"].startswith("CPU") and env["benchmark"]["batch_size"] == 2
    assert env["flop_rule"] == bench.FLOP_RULE and "timm" in env and env["date"]
    by_model = {r["model"]: r for r in data["results"]}
    assert list(by_model) == ["test_resnet", "test_vit"]
    for row in by_model.values():
        assert row["error"] is None
        assert row["family"] == "timm" and row["params_M"] > 0 and row["gflops"] > 0
        for key in ("infer_img_s", "train_img_s", "latency_ms", "infer_ms", "infer_p20_ms", "infer_p80_ms"):
            assert row[key] > 0, key
        assert row["infer_p20_ms"] <= row["infer_ms"] <= row["infer_p80_ms"]
        assert row["infer_img_s"] == pytest.approx(2 / (row["infer_ms"] / 1e3))
        assert row["gpus"] == 1 and row["dp_infer_img_s"] == row["infer_img_s"]
        assert row["infer_peak_MiB"] is None  # no CUDA memory on a CPU run
        assert row["infer_host_ms"] is None and row["infer_host_bound"] is None  # a CPU call is all host
    reference = sum(p.numel() for p in __import__("timm").create_model("test_resnet").parameters()) / 1e6
    assert by_model["test_resnet"]["params_M"] == pytest.approx(reference)

    with json_path.with_suffix(".csv").open() as f:
        csv_rows = list(csv.DictReader(f))
    assert [r["model"] for r in csv_rows] == ["test_resnet", "test_vit"]
    assert float(csv_rows[1]["infer_img_s"]) == pytest.approx(by_model["test_vit"]["infer_img_s"])
    png = json_path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_table_marks_host_bound_throughputs():
    from visionssm.benchmark.report import HOST_BOUND_MARK, format_table

    base = {"model": "anchor", "infer_img_s": 2000.0, "train_img_s": 500.0, "infer_host_bound": False,
            "train_host_bound": False}
    ours = {"model": "ours", "infer_img_s": 1000.0, "train_img_s": 400.0, "infer_host_bound": True,
            "train_host_bound": None}
    lines = format_table([base, ours], "anchor").splitlines()
    row = next(line for line in lines if line.startswith("ours"))
    assert f"1,000{HOST_BOUND_MARK}" in row.split() and "400" in row.split()
    assert HOST_BOUND_MARK not in next(line for line in lines if line.startswith("anchor"))
    assert any(line.startswith(f"({HOST_BOUND_MARK} host-bound") for line in lines)
    unmarked = format_table([base, {**ours, "infer_host_bound": False}], "anchor")
    assert HOST_BOUND_MARK not in unmarked


def test_failing_model_is_recorded_and_others_still_measured(monkeypatch, tmp_path, capsys):
    from visionssm.benchmark import measure

    real_create = measure.create_model

    def create(name, cfg, device):
        if name == "test_vit":
            raise RuntimeError("CUDA out of memory (simulated)")
        return real_create(name, cfg, device)

    monkeypatch.setattr(measure, "create_model", create)
    status = bench.main(["test_resnet", "test_vit", *TINY, "--modes", "infer", "--no-save", "--no-flops"])
    out = capsys.readouterr().out
    assert status == 1
    assert "! test_vit: RuntimeError: CUDA out of memory (simulated)" in out
    resnet_line = next(line for line in out.splitlines() if line.startswith("test_resnet"))
    assert resnet_line.split()[4] != "-"  # infer img/s was measured


def test_modes_subset_and_chart_on_gflops(tmp_path):
    cfg = bench.BenchmarkConfig(models=["test_resnet"], batch_size=2, img_size=64, device="cpu", warmup=0,
                                repeats=2, modes=("latency",))
    seen = []
    rows = bench.run_benchmark(cfg, log=lambda *a, **k: None, on_row=lambda so_far: seen.append(len(so_far)))
    assert seen == [1]  # called after each model, so the command line can save partial results
    assert rows[0]["latency_ms"] > 0 and "infer_img_s" not in rows[0] and "train_img_s" not in rows[0]
    rows[0]["infer_img_s"] = 100.0
    png = bench.plot_results(rows, tmp_path / "chart.png", x="gflops")
    assert png is not None and png.exists()


@pytest.mark.slow
def test_data_parallel_processes_on_cpu():
    """Two gloo processes stand in for two GPUs: the totals come back and are the sum over processes."""
    cfg = bench.BenchmarkConfig(models=["test_resnet"], batch_size=2, img_size=64, device="cpu", warmup=0,
                                repeats=2, modes=("infer", "train"), data_parallel=2, count_flops=False)
    rows = bench.run_benchmark(cfg, log=lambda *a, **k: None)
    row = rows[0]
    assert row["gpus"] == 2 and "dp_error" not in row
    assert row["dp_infer_img_s"] > 0 and row["dp_train_img_s"] > 0


# ---------------------------------------------------------------------------------------------------------------
# Regression check


def _write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_regression_check_passes_unchanged_and_flags_slowed_model(tiny_run, tmp_path, capsys):
    _, _, out = tiny_run
    (committed_path,) = out.glob("throughput-*.json")
    committed = json.loads(committed_path.read_text())

    assert check_regression.main([str(committed_path), "--against", str(committed_path)]) == 0
    assert "no model more than 10% slower" in capsys.readouterr().out

    slowed = json.loads(json.dumps(committed))
    vit = next(r for r in slowed["results"] if r["model"] == "test_vit")
    vit["infer_img_s"] /= 1.25
    resnet = next(r for r in slowed["results"] if r["model"] == "test_resnet")
    resnet["train_img_s"] /= 1.05  # within the 10% allowance
    fresh = _write(tmp_path / "fresh.json", slowed)
    assert check_regression.main([str(fresh), "--against", str(committed_path)]) == 1
    report = capsys.readouterr().out
    assert "1 model(s) more than 10% slower: test_vit" in report
    assert "+25.0%" in report

    slower_latency = json.loads(json.dumps(committed))
    slower_latency["results"][0]["latency_ms"] *= 1.2
    fresh = _write(tmp_path / "latency.json", slower_latency)
    assert check_regression.main([str(fresh), "--against", str(committed_path)]) == 1
    assert "more than 10% slower: test_resnet" in capsys.readouterr().out

    # a looser threshold lets the 25% slowdown through
    assert check_regression.main([str(tmp_path / "fresh.json"), "--against", str(committed_path),
                                  "--threshold", "0.3"]) == 0


def test_regression_check_finds_committed_run_and_refuses_other_devices(tiny_run, tmp_path, capsys):
    _, _, out = tiny_run
    (committed_path,) = out.glob("throughput-*.json")
    committed = json.loads(committed_path.read_text())
    failed = json.loads(json.dumps(committed))
    failed["results"][1]["error"] = "RuntimeError: boom"
    fresh = _write(tmp_path / "fresh.json", failed)
    # no --against: the newest committed run on the same device in --results-dir
    assert check_regression.main([str(fresh), "--results-dir", str(out)]) == 1
    assert "REGRESSION (RuntimeError: boom)" in capsys.readouterr().out

    other = json.loads(json.dumps(committed))
    other["environment"]["device"] = "NVIDIA H200"
    fresh = _write(tmp_path / "other.json", other)
    assert check_regression.main([str(fresh), "--against", str(committed_path)]) == 2
    assert "different devices" in capsys.readouterr().err
    assert check_regression.main([str(fresh), "--results-dir", str(out)]) == 2
    assert check_regression.main([str(fresh), "--against", str(committed_path), "--allow-device-mismatch"]) == 0

    unrelated = _write(tmp_path / "kernels.json", {"environment": {"device": "x"}, "results": []})
    assert check_regression.main([str(unrelated), "--against", str(committed_path)]) == 2


def test_train_scaling_skips_the_compiling_epoch_and_reports_efficiency():
    scaling = load_script("train_scaling")
    records = [{"train_img_per_s": 100.0}, {"train_img_per_s": 900.0}, {"train_img_per_s": 1000.0},
               {"train_img_per_s": 1100.0}]
    assert scaling.steady_throughput(records) == 1000.0  # median of epochs 2..4, the first one compiles
    assert scaling.steady_throughput(records[:1]) == 100.0
    assert scaling.steady_throughput([]) is None
    table = scaling.scaling_table({"m": {1: 1000.0, 2: 1500.0}, "broken": {1: None}})
    row = next(line for line in table.splitlines() if line.startswith("m ") and " 2 " in line)
    assert "1.50x" in row and "75%" in row and "750" in row
    assert "failed" in table


def test_train_scaling_launches_multi_gpu_only_for_several_processes(tmp_path):
    scaling = load_script("train_scaling")
    import argparse

    args = argparse.Namespace(epochs=2, batch=8, extra=["--img-size", "32"])
    single = scaling.launch_command(1, "gka_vision_T", tmp_path / "data", tmp_path / "out", args)
    double = scaling.launch_command(2, "gka_vision_T", tmp_path / "data", tmp_path / "out", args)
    assert "--multi_gpu" not in single and "--multi_gpu" in double
    assert double[double.index("--num_processes") + 1] == "2"
    assert single[-2:] == ["--img-size", "32"]  # extra flags come last, so they override the recipe


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["test_comba_vision", "test_vit"])
def test_cuda_graph_training_step_trains(model):
    """--cuda-graph captures the whole training step: every replay of the graph must run the optimizer's update (a
    capturable AdamW: an uncapturable one refuses the capture), and the run gives a training rate."""
    import timm

    from visionssm.benchmark.harness import capture_graph
    from visionssm.benchmark.measure import measure_model, training_step

    cfg = bench.BenchmarkConfig(models=[model], batch_size=4, img_size=96, device="cuda", repeats=3, warmup=1,
                                cuda_graph=True, modes=["train"], count_flops=False)
    device = torch.device("cuda")
    net = timm.create_model(model).to(device)
    step = training_step(net, net, cfg, cfg.batch_size, device, captured=True)
    graph = capture_graph(step)  # as time_fn captures it
    for _ in range(2):
        before = [p.detach().clone() for p in net.parameters()]
        graph.replay()
        torch.cuda.synchronize()
        moved = [not torch.equal(a, p.detach()) for a, p in zip(before, net.parameters())]
        assert sum(moved) > len(moved) // 2, f"{sum(moved)} of {len(moved)} parameters changed in a replay"
    row = measure_model(model, cfg, device)
    assert row["error"] is None and row["train_img_s"] > 0


# ---------------------------------------------------------------------------------------------------------------
# Resolution scaling: several --img-size values


@pytest.mark.parametrize(("argv", "sizes", "batches"), [
    (["--img-size", "224", "448", "1024", "--batch-size", "256"], (224, 448, 1024), (256, 64, 12)),
    (["--img-size", "224", "512", "--batch-size", "64"], (224, 512), (64, 12)),
    (["--img-size", "64", "96", "--batch-size", "3", "5"], (64, 96), (3, 5)),
    (["--img-size", "300", "--batch-size", "7"], (300,), (7,)),
])
def test_batches_keep_pixels_per_batch_or_follow_the_list(argv, sizes, batches):
    from visionssm.benchmark.cli import _config_from_args

    cfg = bench.validate_config(_config_from_args(bench.build_parser().parse_args(["test_resnet", "--device", "cpu",
                                                                                   *argv])))
    assert (cfg.img_sizes, cfg.batch_sizes) == (sizes, batches)
    assert (cfg.img_size, cfg.batch_size) == (sizes[0], batches[0])


@pytest.mark.parametrize(("overrides", "message"), [
    ({"img_sizes": (64, 0)}, "img_size"),
    ({"img_sizes": (64, 64)}, "img_size"),
    ({"img_sizes": (64, 96, 128), "batch_sizes": (2, 2)}, "batch_size"),
    ({"img_sizes": (64, 96), "batch_sizes": (2, 0)}, "batch_size"),
])
def test_bad_resolutions_or_batches_name_the_argument(overrides, message):
    with pytest.raises(ValueError, match=message):
        bench.validate_config(_config(**overrides))


def test_model_kwargs_parse_as_timm_scripts_take_them(capsys):
    args = bench.build_parser().parse_args(["m", "--model-kwargs", "global_mixer=True", "mixer=gka", "depth=2"])
    assert args.model_kwargs == {"global_mixer": True, "mixer": "gka", "depth": 2}
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["m", "--model-kwargs", "global_mixer"])
    assert "--model-kwargs takes KEY=VALUE" in capsys.readouterr().err


def test_every_model_at_every_resolution_with_files_and_plot(tmp_path, capsys):
    status = bench.main(["test_comba_vision", "test_vit", "--device", "cpu", "--img-size", "32", "48",
                         "--batch-size", "4", "--modes", "infer", "train", "--warmup", "0", "--repeats", "1",
                         "--no-flops", "--model-kwargs", "depth=1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    (json_path,) = tmp_path.glob("throughput-*.json")
    data = json.loads(json_path.read_text())
    rows = [(r["model"], r["img_size"], r["batch_size"]) for r in data["results"]]
    # resolution by resolution; 4 images of 32² hold the pixels of 1.8 of 48²
    assert rows == [("test_comba_vision", 32, 4), ("test_vit", 32, 4), ("test_comba_vision", 48, 2),
                    ("test_vit", 48, 2)]
    for row in data["results"]:
        assert row["error"] is None and row["infer_img_s"] > 0 and row["train_img_s"] > 0
        assert row["infer_peak_MiB"] is None and row["train_peak_MiB"] is None  # CPU: not measured
        assert row["model_kwargs"] == {"depth": 1}
    assert data["environment"]["benchmark"]["img_sizes"] == [32, 48]
    assert data["environment"]["benchmark"]["batch_sizes"] == [4, 2]
    table = [line.split() for line in out.splitlines() if line.split()[:1] in (["test_comba_vision"], ["test_vit"])]
    assert [line[4:6] for line in table] == [["32", "4"], ["32", "4"], ["48", "2"], ["48", "2"]]
    assert all(line.count("n/a") == 2 for line in table)  # peak memory columns off CUDA
    assert [line[-3] for line in table if line[0] == "test_comba_vision"] == ["1.00x", "1.00x"]  # base per size
    with json_path.with_suffix(".csv").open() as f:
        assert [(r["model"], r["img_size"]) for r in csv.DictReader(f)] == [(m, str(s)) for m, s, _ in rows]
    png = json_path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_resolution_plot_needs_two_resolutions_and_draws_memory_where_measured(tmp_path):
    from visionssm.benchmark.report import plot_resolution

    row = lambda model, size, peak: {"model": model, "img_size": size, "infer_img_s": 1e4 / size,
                                     "train_img_s": 3e3 / size, "infer_peak_MiB": peak, "train_peak_MiB": peak}
    assert plot_resolution([row("a", 224, 10.0)], tmp_path / "one.png") is None
    path = plot_resolution([row("a", 224, 10.0), row("a", 512, 40.0), row("b", 224, None), row("b", 512, None)],
                           tmp_path / "two.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
