"""The shared benchmark harness: timing on CPU, result files, the side-by-side table."""

import csv
import json

import pytest
import torch
from benchmark_scripts import load_script

from visionssm.benchmark.harness import (
    HOST_BOUND_MARK,
    HOST_BOUND_SHARE,
    Timing,
    environment,
    kernel_row,
    measure_row,
    print_ratios,
    save_results,
    settle_host_bound,
    side_by_side,
    time_fn,
)
from visionssm.kernels.utils import assert_close, relative_error


def test_time_fn_on_cpu_counts_repeats():
    calls = []
    timing = time_fn(lambda: calls.append(1), warmup=5, repeats=7, device="cpu")
    assert isinstance(timing, Timing) and timing.repeats == 7
    assert len(calls) == 7 + 1
    assert 0 <= timing.p20_ms <= timing.median_ms <= timing.p80_ms


def test_host_bound_compares_the_host_side_with_the_time_per_call():
    assert Timing(2.0, 1.9, 2.1, 5).host_bound is None  # not measured (CPU runs, CUDA graphs)
    assert Timing(2.0, 1.9, 2.1, 5, host_ms=2.0 * HOST_BOUND_SHARE).host_bound is True
    assert Timing(2.0, 1.9, 2.1, 5, host_ms=2.0 * HOST_BOUND_SHARE - 0.01).host_bound is False
    assert time_fn(lambda: None, warmup=1, repeats=3, device="cpu", host_repeats=3).host_ms is None


@pytest.mark.cuda
def test_host_time_tells_a_host_bound_call_from_a_gpu_bound_one():
    """A call that waits on the host (a sleep) is host-bound; one that queues a long GPU job and returns is not,
    although back to back its host side would wait for the launch queue as long as the GPU takes."""
    import time

    x = torch.randn(2048, 2048, device="cuda")

    def gpu_heavy():
        for _ in range(20):
            x @ x

    def host_heavy():
        time.sleep(0.003)
        x[:8] @ x[:, :8]

    gpu = time_fn(gpu_heavy, warmup=3, repeats=10, host_repeats=5)
    host = time_fn(host_heavy, warmup=3, repeats=10, host_repeats=5)
    assert gpu.host_bound is False and gpu.host_ms < 0.5 * gpu.median_ms, gpu
    assert host.host_bound is True and host.host_ms >= 3.0, host
    assert time_fn(host_heavy, warmup=1, repeats=3, cuda_graph=False).host_ms is None  # not asked for


def test_a_cpu_run_is_stamped_with_the_cpu_even_beside_a_gpu():
    env = environment("cpu")
    assert env["device"].startswith("CPU") and env["device_count"] == 0
    if torch.cuda.is_available():
        assert environment("cuda")["device"] == torch.cuda.get_device_name(0)


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


def test_side_by_side_marks_host_bound_values():
    """A value measured host-bound gets the mark and the table a footnote; the ratios stay plain numbers."""
    rows = [
        {"shape": "s1", "mode": "fwd", "impl": "anchor", "ms": 2.0, "host_ms": 0.5, "host_bound": False},
        {"shape": "s1", "mode": "fwd", "impl": "ours", "ms": 1.0, "host_ms": 0.95, "host_bound": True},
        {"shape": "s2", "mode": "fwd", "impl": "anchor", "ms": 4.0},
        {"shape": "s2", "mode": "fwd", "impl": "ours", "ms": 3.0, "host_bound": None},
    ]
    lines = side_by_side(rows, keys=["shape", "mode"], baseline="anchor").splitlines()
    assert lines[2].split()[2:] == ["2", f"1{HOST_BOUND_MARK}", "0.50x"]
    assert lines[3].split()[2:] == ["4", "3", "0.75x"]
    assert lines[-1].startswith(f"({HOST_BOUND_MARK} host-bound: one call's host side alone")
    unmarked = side_by_side([{**row, "host_bound": False} for row in rows], keys=["shape", "mode"], baseline="anchor")
    assert HOST_BOUND_MARK not in unmarked


def test_a_plain_call_is_host_bound_where_its_graph_shows_it():
    """Where a plain row has a CUDA-graph twin, the twin decides: host-bound where the plain call took at least 1.1x
    the graph's GPU time, whatever the host time from an idle GPU read; rows without a twin keep that test."""
    rows = settle_host_bound([
        {"shape": "s", "mode": "fwd", "impl": "ours", "ms": 1.05, "host_ms": 1.0, "host_bound": True},
        {"shape": "s", "mode": "fwd", "impl": "ours (CUDA graph)", "ms": 1.0},
        {"shape": "s", "mode": "fwd", "impl": "anchor", "ms": 0.7, "host_ms": 0.5, "host_bound": False},
        {"shape": "s", "mode": "fwd", "impl": "anchor (CUDA graph)", "ms": 0.3},
        {"shape": "s", "mode": "fwd", "impl": "other", "ms": 0.5, "host_ms": 0.49, "host_bound": True},  # no twin
        {"shape": "t", "mode": "fwd", "impl": "ours", "ms": 1.05, "host_ms": 1.0, "host_bound": True},  # other shape
    ])
    assert [row.get("host_bound") for row in rows] == [False, None, True, None, True, True]
    assert rows[0]["host_ms"] == 1.0 and rows[2]["host_ms"] == 0.5  # the measurements themselves are kept
    lines = side_by_side(rows, keys=["shape", "mode"], baseline="anchor").splitlines()
    assert "graph replay" in lines[-1] and f"0.7{HOST_BOUND_MARK}" in lines[2].split()


def test_kernel_rows_carry_the_host_time_where_it_was_measured(capsys):
    timed = kernel_row("op", "B1", "fwd", "ours", Timing(1.0, 0.9, 1.1, 5, host_ms=0.95))
    assert timed["host_ms"] == 0.95 and timed["host_bound"] is True
    assert HOST_BOUND_MARK in capsys.readouterr().out
    graphed = kernel_row("op", "B1", "fwd", "ours (CUDA graph)", Timing(1.0, 0.9, 1.1, 5))
    assert "host_ms" not in graphed and "host_bound" not in graphed
    # on the CPU the whole call is host time: nothing to tell apart, no host columns
    x = torch.randn(4, 4)
    row = measure_row("op", "B1", "fwd", "ours", lambda leaves: leaves[0] * 2, [x], None, backward=False,
                      cuda_graph=False)
    assert row["ms"] >= 0 and "host_ms" not in row


def test_print_ratios_pairs_each_row_with_its_anchor(capsys):
    rows = [
        {"shape": "s1", "mode": "fwd", "impl": "ours (graph)", "ms": 1.0},
        {"shape": "s1", "mode": "fwd", "impl": "anchor (graph)", "ms": 4.0},
        {"shape": "s1", "mode": "fwd", "impl": "ours", "ms": 3.0},
        {"shape": "s1", "mode": "fwd", "impl": "anchor", "ms": 2.0},
        {"shape": "s2", "mode": "fwd", "impl": "ours (graph)", "ms": 1.0},  # no anchor row: no line
    ]
    print_ratios(rows, (("ours (graph)", "anchor (graph)", "anchor, both graph"), ("ours", "anchor", "anchor, plain")))
    assert capsys.readouterr().out.splitlines() == ["# visionssm / anchor, both graph  s1 fwd: 0.25x",
                                                    "# visionssm / anchor, plain  s1 fwd: 1.50x"]


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


def test_time_op_differentiates_every_floating_argument_and_keeps_none():
    """The kernel suites' timing call: forward without grad, backward through every floating-point argument."""
    from visionssm.benchmark.harness import time_op, with_bandwidth

    x, w = torch.randn(4, 3), torch.randn(3)
    seen = []

    def fn(args):
        a, missing, b = args
        assert missing is None
        seen.append((a.requires_grad, b.requires_grad, torch.is_grad_enabled()))
        return a * b

    fwd = time_op(fn, (x, None, w), None, backward=False, cuda_graph=False, warmup=1, repeats=2)
    assert fwd.median_ms > 0 and set(seen) == {(False, False, False)}
    seen.clear()
    both = time_op(fn, (x, None, w), torch.ones(4, 3), backward=True, cuda_graph=False, warmup=1, repeats=2)
    assert both.median_ms > 0 and set(seen) == {(True, True, True)}
    assert not x.requires_grad and not w.requires_grad  # the caller's tensors are left alone

    row = with_bandwidth({"ms": 2.0}, 4_000_000, copy_gbps=4.0)
    assert row == {"ms": 2.0, "GB/s": 2.0, "%copy": 50.0}
    assert "%copy" not in with_bandwidth({"ms": 1.0}, 10**9, copy_gbps=None)


def test_measure_row_reports_a_failing_implementation_and_goes_on(capsys):
    from visionssm.benchmark.harness import measure_row

    def broken(args):
        raise RuntimeError("no kernel for this shape")

    assert measure_row("op", "S", "fwd", "broken", broken, (torch.randn(3),), None, backward=False,
                       cuda_graph=False) is None
    assert "broken S fwd failed: RuntimeError: no kernel for this shape" in capsys.readouterr().out
    row = measure_row("op", "S", "fwdbwd", "ours", lambda a: a[0].sin(), (torch.randn(3),), torch.ones(3),
                      backward=True, cuda_graph=False, bytes_moved=24, copy_gbps=None)
    assert row["op"] == "op" and row["impl"] == "ours" and row["ms"] > 0 and "GB/s" in row and "%copy" not in row


def test_measure_impls_rows_in_order_with_forward_only_and_bandwidth_for_ours(capsys):
    from visionssm.benchmark.harness import measure_impls

    x = (torch.randn(3),)

    def broken(args):
        raise RuntimeError("no kernel")

    impls = {"ours": (x, lambda a: a[0].sin(), torch.ones(3)), "anchor": (x, lambda a: a[0].cos(), torch.ones(3)),
             "fwd_only": (x, lambda a: a[0].exp(), torch.ones(3)), "broken": (x, broken, torch.ones(3))}
    asked = []
    rows = measure_impls("op", "S", "causal", impls, ours=("ours",), graphed=(),
                         bytes_moved=lambda backward: asked.append(backward) or 24, forward_only=("fwd_only",))
    assert [(r["impl"], r["mode"]) for r in rows] == [("ours", "fwd causal"), ("ours", "fwdbwd causal"),
                                                      ("anchor", "fwd causal"), ("anchor", "fwdbwd causal"),
                                                      ("fwd_only", "fwd causal")]
    assert asked == [False, True]
    assert all(("GB/s" in r) == (r["impl"] == "ours") for r in rows)
    assert "broken S fwd causal failed" in capsys.readouterr().out


def test_layer_profile_counts_kernels_not_annotations():
    """The optimizer's record_function range shows up on the GPU timeline as an event of its own; counted as a kernel
    it added the optimizer's time a second time (3.8-6.5 ms of a comba_vision_T step)."""
    from types import SimpleNamespace

    def event(name, us, annotation=False):
        return SimpleNamespace(name=name, device_type="DeviceType.CUDA", device_time_total=us,
                               is_user_annotation=annotation)

    events = [event("comba_bwd_kernel", 700.0), event("comba_bwd_kernel", 300.0),
              event("Optimizer.step#AdamW.step", 3800.0, annotation=True), event("multi_tensor_apply_kernel", 500.0)]
    times = load_script("profile_layers").kernel_times(events, "cuda")
    assert times == {"comba_bwd_kernel": [1.0, 2], "multi_tensor_apply_kernel": [0.5, 1]}


def test_layer_profile_categories_match_whole_kernel_names():
    """benchmarks/profile_layers.py files a kernel under an op only for that op's whole kernel names: a Triton helper
    called ``mm`` once put cuBLAS GEMMs and LayerNorm's GammaBeta kernel under "mixer kernel"."""
    profile_layers = load_script("profile_layers")
    mixer, layer = {"mm", "comba_bwd_kernel"}, {"prologue_fwd_kernel"}
    cases = {"comba_bwd_kernel": "mixer kernel", "prologue_fwd_kernel": "fused layer ops",
             "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_bf16_256x128_64x3_tn_align2>": "GEMM",
             "void at::native::GammaBetaBackwardCUDAKernelTemplate<float, float, 256>": "elementwise / norm / other",
             # what a compiled model launches: our kernels renamed <name>_<index>, and Inductor's own
             "comba_bwd_kernel_3": "mixer kernel", "triton_per_fused_add_native_layer_norm_12": "Inductor-generated",
             "triton_poi_fused_mul_0": "Inductor-generated"}
    for name, category in cases.items():
        assert profile_layers.categorise(name, mixer, layer) == category, name


def test_compiled_runs_report_the_first_calls_seconds_and_the_mode():
    from visionssm.benchmark.config import BenchmarkConfig
    from visionssm.benchmark.measure import _first_call_s
    from visionssm.benchmark.report import format_table

    calls = []
    step = lambda: calls.append(1)
    assert _first_call_s(step, BenchmarkConfig(models=["m"], compile=False), torch.device("cpu")) is None
    seconds = _first_call_s(step, BenchmarkConfig(models=["m"], compile=True), torch.device("cpu"))
    assert calls == [1] and seconds >= 0
    row = {"model": "m", "infer_img_s": 10.0, "train_img_s": 5.0, "infer_compile_s": 12.4, "train_compile_s": 30.6}
    env = {"device": "cpu", "torch": torch.__version__, "time_utc": "now",
           "benchmark": {"compile": True, "compile_mode": "reduce-overhead", "batch_size": 2, "img_size": 32}}
    table = format_table([row], "m", env)
    assert "train compile (s)" in table and "30.6" in table
    assert "torch.compile(mode='reduce-overhead')" in table
