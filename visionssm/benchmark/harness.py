"""Timing and reporting shared by every benchmark (kernel suites, backbones, ``visionssm-benchmark``).

Timing uses CUDA events (warm-up, then the median of many runs; optionally replaying a captured CUDA graph to take
launch gaps out). On CPU it falls back to ``time.perf_counter`` so the scripts can be tried anywhere; such numbers
are labelled with the CPU as the device. Results are written as JSON and CSV stamped with the device name,
software versions and date, and printed as a side-by-side table with ratios to an anchor implementation.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as _dt
import json
import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

__all__ = ["GRAPH_SUFFIX", "HOST_BOUND_MARK", "HOST_BOUND_SHARE", "HOST_REPEATS", "HOST_SLOWDOWN", "Timing",
           "capture_graph", "host_bound_note", "host_fields", "settle_host_bound", "copy_bandwidth_gbps",
           "environment", "save_results", "sdpa_graph_ms", "side_by_side", "slug", "time_fn", "kernel_row",
           "kernel_times_us", "measure_row", "print_ratios", "time_op", "with_bandwidth"]


#: A call whose host side alone (the GPU idle when it starts) takes at least this share of its measured time per call
#: is host-bound: the CPU that enqueues its work sets the rate, or comes close to it, and moves it with its own load.
HOST_BOUND_SHARE = 0.9
#: Calls timed on the host alone (each from an idle GPU) per eager measurement.
HOST_REPEATS = 10
#: Appended to a table cell whose measurement was host-bound (:attr:`Timing.host_bound`).
HOST_BOUND_MARK = "‡"
#: The name suffix of an implementation's CUDA-graph rows in the kernel suites (its GPU time alone).
GRAPH_SUFFIX = " (CUDA graph)"
#: A plain call that takes at least this factor of its CUDA-graph replay's time was held back by its host.
HOST_SLOWDOWN = 1.1


def host_bound_note(graph_twins: bool = False) -> str:
    """The footnote of a table with :data:`HOST_BOUND_MARK` cells; ``graph_twins``: the kernel suites' rule
    (:func:`settle_host_bound`)."""
    rule = (f"one call's host side alone, started with the GPU idle, took at least {HOST_BOUND_SHARE:.0%} of the "
            f"measured time per call")
    if graph_twins:
        rule = (f"the plain call took at least {HOST_SLOWDOWN:.1f}x the time of its CUDA-graph replay (the same GPU "
                f"work without the host's per-call work), or, without a graph row, {rule}")
    return (f"({HOST_BOUND_MARK} host-bound: {rule}, so this machine's CPU sets the rate or comes close to it; host "
            f"ms per call are in the CSV/JSON)")


@dataclasses.dataclass
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    repeats: int
    #: median host time of one call started with the GPU idle (``time_fn(host_repeats=...)``), else None
    host_ms: float | None = None

    @property
    def spread(self) -> float:
        """(p80 − p20) / median: how noisy the measurement was."""
        return (self.p80_ms - self.p20_ms) / self.median_ms if self.median_ms > 0 else 0.0

    @property
    def host_bound(self) -> bool | None:
        """Whether the host's work per call is (nearly) the whole measured time per call; None when not measured."""
        if self.host_ms is None:
            return None
        return self.host_ms >= HOST_BOUND_SHARE * self.median_ms


def host_fields(timing: Timing) -> dict:
    """A result row's ``host_ms`` / ``host_bound`` for ``timing`` (nothing when its host side was not measured)."""
    if timing.host_ms is None:
        return {}
    return {"host_ms": round(timing.host_ms, 4), "host_bound": timing.host_bound}


def settle_host_bound(rows: list[dict]) -> list[dict]:
    """Decide ``host_bound`` on each plain row of ``rows`` (one with ``host_ms``) that has a CUDA-graph twin (same
    shape and mode, implementation name + :data:`GRAPH_SUFFIX`): the same GPU work timed without the host's per-call
    work. The plain call was held back by its host where it took at least :data:`HOST_SLOWDOWN` times the graph's
    time. There that comparison replaces the host-time test: the host time of one call from an idle GPU moves with
    the machine's load and can exceed a GPU-bound call's time (an H200's SDPA fwd+bwd at B4 T2048 H8 D128: 0.345 ms
    from an idle GPU, 0.336 per call back to back, as fast as its graph), and a call whose host side alone stays
    under :data:`HOST_BOUND_SHARE` of its time can still leave the GPU waiting between launches. Rows without a twin
    keep the host-time test. Returns ``rows``."""
    graph_ms = {(r["shape"], r["mode"], r["impl"]): r["ms"] for r in rows if r["impl"].endswith(GRAPH_SUFFIX)}
    for row in rows:
        graph = graph_ms.get((row["shape"], row["mode"], row["impl"] + GRAPH_SUFFIX))
        if graph is not None and "host_ms" in row:
            row["host_bound"] = row["ms"] >= HOST_SLOWDOWN * graph
    return rows


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def capture_graph(fn: Callable[[], object], *, warmup_calls: int = 3) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after ``warmup_calls`` eager calls on a side stream (lazy initialisation,
    allocator pools and Triton compiles happen outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup_calls):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_fn(fn: Callable[[], object], *, warmup: int = 10, repeats: int = 50, cuda_graph: bool = False,
            device: torch.device | str | None = None, host_repeats: int = 0) -> Timing:
    """Time ``fn()`` (no arguments; close over the inputs). ``device`` defaults to the current CUDA device when
    CUDA is available, else the CPU. With ``cuda_graph=True`` the call is captured once and the graph replayed.

    ``host_repeats`` > 0 (CUDA, no graph): also time that many calls on the host alone, each started with the GPU idle
    (synchronised before, not after), into :attr:`Timing.host_ms`. Back to back, a GPU-bound call's host side waits
    for the launch queue and looks as long as the GPU's; from an idle GPU it is the host's own work, so comparing
    it with the back-to-back time per call says which side sets the rate (:attr:`Timing.host_bound`)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        for _ in range(max(1, warmup // 5)):
            fn()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return Timing(statistics.median(samples), _quantile(samples, 0.2), _quantile(samples, 0.8), repeats)

    if cuda_graph:
        run = capture_graph(fn).replay
    else:
        run = fn
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for start, end in zip(starts, ends):
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    samples = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    host_ms = None
    if host_repeats > 0 and not cuda_graph:
        host = []
        for _ in range(host_repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            host.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        host_ms = statistics.median(host)
    return Timing(statistics.median(samples), _quantile(samples, 0.2), _quantile(samples, 0.8), repeats, host_ms)


def sdpa_graph_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                  causal: bool) -> tuple[float, float]:
    """CUDA-graph median ms (forward alone, forward + backward) of ``scaled_dot_product_attention`` on ``q, k, v``
    and the output gradient ``do``, all given in the mixer ops' (B, T, H, D) layout and copied to SDPA's
    (B, H, T, D): the anchor the kernel benchmarks time beside ours on the same data."""
    import torch.nn.functional as F

    timing = {"warmup": 3, "repeats": 20}
    q, k, v = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    do = do.transpose(1, 2).contiguous()
    attend = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    with torch.no_grad():
        fwd = time_fn(attend, cuda_graph=True, **timing).median_ms
    both = time_fn(lambda: torch.autograd.grad(attend(), [q, k, v], do), cuda_graph=True, **timing).median_ms
    return fwd, both


def environment(device: torch.device | str | None = None) -> dict:
    """Where and with what a result was measured: on ``device`` (default: the first GPU where there is one, else the
    CPU). A CPU run on a machine with a GPU is stamped with the CPU, not the GPU it did not use."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    device = torch.device(device) if device is not None else None
    if (device is None or device.type == "cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0 if device is None or device.index is None else device.index)
        device_name, device_count = props.name, torch.cuda.device_count()
    else:
        device_name, device_count = f"CPU ({platform.processor() or platform.machine()})", 0
    return {
        "device": device_name,
        "device_count": device_count,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def time_op(fn: Callable[[list], object], args: Sequence, grad_out: torch.Tensor | None, *, backward: bool,
            cuda_graph: bool, warmup: int = 5, repeats: int = 30, host_repeats: int = 0) -> Timing:
    """Time an op the way the kernel suites compare implementations: ``fn(leaves)`` on detached copies of ``args``
    (``None`` entries kept), forward under ``no_grad``, or with ``backward`` the forward plus the gradient of
    ``grad_out`` with respect to every floating-point argument. ``host_repeats``: see :func:`time_fn`."""
    leaves = [None if a is None else a.detach().requires_grad_(backward and a.is_floating_point()) for a in args]
    wrt = [x for x in leaves if x is not None and x.requires_grad]

    def call():
        out = fn(leaves)
        return torch.autograd.grad(out, wrt, grad_out) if backward else out

    with torch.enable_grad() if backward else torch.no_grad():
        return time_fn(call, warmup=warmup, repeats=repeats, cuda_graph=cuda_graph, host_repeats=host_repeats)


def with_bandwidth(row: dict, bytes_moved: int, copy_gbps: float | None) -> dict:
    """``row`` with ``GB/s`` (``bytes_moved`` over its ``ms``) and, given the copy ceiling, ``%copy``."""
    gbps = bytes_moved / (row["ms"] * 1e-3) / 1e9
    row["GB/s"] = round(gbps, 1)
    if copy_gbps:
        row["%copy"] = round(100 * gbps / copy_gbps, 1)
    return row


def measure_row(op: str, shape: str, mode: str, impl: str, fn: Callable[[list], object], args: Sequence,
                grad_out: torch.Tensor | None, *, backward: bool, cuda_graph: bool, bytes_moved: int | None = None,
                copy_gbps: float | None = None) -> dict | None:
    """One row of a kernel suite: :func:`time_op`, with the bandwidth when ``bytes_moved`` is given, printed as it
    is measured. A plain (not graphed) call also has its host side timed alone (:func:`host_fields`). A failing
    implementation is reported and gives ``None``, so the suite goes on with the others."""
    try:
        timing = time_op(fn, args, grad_out, backward=backward, cuda_graph=cuda_graph, host_repeats=HOST_REPEATS)
    except Exception as exc:  # noqa: BLE001 - one failing implementation must not lose the others' numbers
        print(f"# {impl} {shape} {mode} failed: {type(exc).__name__}: {exc}", flush=True)
        return None
    row = kernel_row(op, shape, mode, impl, timing)
    if bytes_moved is not None:
        with_bandwidth(row, bytes_moved, copy_gbps)
    return row


def kernel_row(op: str, shape: str, mode: str, impl: str, timing: Timing) -> dict:
    """A kernel suite's result row for ``timing`` (with its host time where measured), printed."""
    row = {"op": op, "shape": shape, "mode": mode, "impl": impl, "ms": timing.median_ms,
           "spread": round(timing.spread, 3), **host_fields(timing)}
    host = "" if timing.host_ms is None else \
        f"  host {timing.host_ms:8.4f} ms{' ' + HOST_BOUND_MARK if timing.host_bound else ''}"
    print(f"{shape:>26} {mode:>18} {impl:>24} {timing.median_ms:8.4f} ms{host}", flush=True)
    return row


def measure_impls(op: str, shape: str, tag: str, impls: dict, *, ours: Sequence[str], graphed: Sequence[str],
                  bytes_moved: Callable[[bool], int], copy_gbps: float | None = None,
                  forward_only: Sequence[str] = ()) -> list[dict]:
    """The rows of one suite shape: for every implementation ``name: (args, fn, grad_out)`` of ``impls``, the
    forward (mode ``"fwd <tag>"``) and, unless it is in ``forward_only``, forward+backward (``"fwdbwd <tag>"``),
    replayed from a CUDA graph where its name is in ``graphed``; ``ours`` get the bandwidth of
    ``bytes_moved(backward)``. Failing implementations are reported and left out (:func:`measure_row`)."""
    rows = []
    for impl, (args, fn, grad_out) in impls.items():
        for backward in (False,) if impl in forward_only else (False, True):
            row = measure_row(op, shape, f"{'fwdbwd' if backward else 'fwd'} {tag}", impl, fn, args, grad_out,
                              backward=backward, cuda_graph=impl in graphed, copy_gbps=copy_gbps,
                              bytes_moved=bytes_moved(backward) if impl in ours else None)
            if row is not None:
                rows.append(row)
    return rows


def print_ratios(rows: list[dict], pairs: Sequence[tuple[str, str, str]]) -> None:
    """For each ``(ours, anchor, label)`` of ``pairs``, print ``# visionssm / <label>  <shape> <mode>: <ratio>x`` for
    every row of implementation ``ours`` whose shape and mode also have a row of ``anchor`` (the kernel suites'
    summary lines, e.g. CUDA graph against CUDA graph)."""
    by_key = {(r["shape"], r["mode"], r["impl"]): r["ms"] for r in rows}
    for (shape, mode, impl), ms in by_key.items():
        for ours, anchor, label in pairs:
            theirs = by_key.get((shape, mode, anchor))
            if impl == ours and theirs:
                print(f"# visionssm / {label}  {shape} {mode}: {ms / theirs:.2f}x")


def kernel_times_us(step: Callable[[], object], reps: int = 10) -> dict[str, float]:
    """GPU µs per call of every kernel ``step()`` launches (torch.profiler over ``reps`` calls after one warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        # the attribute's name changed across torch versions
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", None) or 0.0
        if us > 0:
            times[event.key] = float(us) / reps
    return times


def slug(text: str) -> str:
    """A file-name piece: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def save_results(name: str, rows: list[dict], *, out_dir: str | Path, env: dict | None = None) -> tuple[Path, Path]:
    """Write ``rows`` to ``<out_dir>/<name>-<device>-<date>.json`` (with the environment stamp) and ``.csv``
    (one row per measurement, the stamp repeated in columns so each CSV stands alone). Returns both paths.
    ``out_dir`` has no default: an installed package has no results folder of its own, so the caller says where."""
    env = env or environment()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-{slug(env['device'])}-{env['date']}"
    json_path, csv_path = out / f"{stem}.json", out / f"{stem}.csv"
    json_path.write_text(json.dumps({"environment": env, "results": rows}, indent=2, default=str) + "\n")
    columns = list(dict.fromkeys(k for row in rows for k in row)) + ["device", "torch", "triton", "date"]
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, **{k: env.get(k) for k in ("device", "torch", "triton", "date")}})
    return json_path, csv_path


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return "" if value is None else str(value)


def side_by_side(rows: list[dict], *, keys: Sequence[str], impl: str = "impl", value: str = "ms",
                 baseline: str, lower_is_better: bool = True) -> str:
    """Pivot ``rows`` to one line per ``keys`` combination with one column per implementation, plus
    ``<impl>/<baseline>`` ratio columns. For times (``lower_is_better``) a ratio < 1 means faster than the
    baseline; for throughputs a ratio > 1 means faster. A value whose row is ``host_bound`` is marked
    :data:`HOST_BOUND_MARK`, with a footnote."""
    impls = list(dict.fromkeys(r[impl] for r in rows))
    groups: dict[tuple, dict] = {}
    marked: set[tuple] = set()
    for r in rows:
        key = tuple(r[k] for k in keys)
        groups.setdefault(key, {})[r[impl]] = r.get(value)
        if r.get("host_bound"):
            marked.add((key, r[impl]))
    others = [i for i in impls if i != baseline]
    header = [*keys, *[f"{i} ({value})" for i in impls], *[f"{i}/{baseline}" for i in others]]
    lines = []
    for key, by_impl in groups.items():
        base = by_impl.get(baseline)
        ratios = []
        for i in others:
            v = by_impl.get(i)
            ratios.append(f"{v / base:.2f}x" if isinstance(v, (int, float)) and isinstance(base, (int, float))
                          and base > 0 else "n/a")
        cells = [_fmt(by_impl.get(i)) + (HOST_BOUND_MARK if (key, i) in marked else "") for i in impls]
        lines.append([*map(_fmt, key), *cells, *ratios])
    widths = [max(len(h), *(len(line[c]) for line in lines)) if lines else len(h) for c, h in enumerate(header)]
    render = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    note = "lower is better" if lower_is_better else "higher is better"
    notes = [f"({value}: {note}; ratios are each implementation over {baseline})"]
    if marked:
        notes.append(host_bound_note(graph_twins=any(i.endswith(GRAPH_SUFFIX) for i in impls)))
    return "\n".join([render(header), render(["-" * w for w in widths]), *map(render, lines), *notes])


def copy_bandwidth_gbps(nbytes: int = 1 << 30) -> float | None:
    """Measured device-to-device copy bandwidth (bytes read + written per second, in GB/s): the ceiling that
    memory-bound kernels are compared against. ``None`` without CUDA."""
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    timing = time_fn(lambda: dst.copy_(src), warmup=5, repeats=20)
    return nbytes / (timing.median_ms * 1e-3) / 1e9
