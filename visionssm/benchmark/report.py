"""The backbone run's outputs: the side-by-side table with ratios to the baseline, the throughput chart, and the
JSON/CSV/PNG files."""

from __future__ import annotations

from pathlib import Path

from .harness import HOST_BOUND_MARK, host_bound_note, save_results

__all__ = ["HOST_BOUND_MARK", "format_table", "numerics", "plot_resolution", "plot_results", "write_outputs"]


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if digits == 0 and abs(value) < 100:  # small throughputs (CPU runs) keep three significant digits
            return f"{value:.3g}"
        return f"{value:,.{digits}f}"
    return str(value)


def _ratio(value, base) -> str:
    if not isinstance(value, (int, float)) or not isinstance(base, (int, float)) or not base or not value:
        return "-"
    return f"{value / base:.2f}x"


def _compiled(bench: dict) -> str:
    if not bench.get("compile"):
        return ""
    mode = bench.get("compile_mode") or "default"
    return f"  torch.compile({'' if mode == 'default' else f'mode={mode!r}'})"


def _kwargs(bench: dict) -> str:
    kwargs = bench.get("model_kwargs")
    return "  " + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) if kwargs else ""


def numerics(bench: dict) -> str:
    """What the numbers were computed in: ``float32``, ``bfloat16 autocast`` (fp32 weights) or ``bfloat16 weights``
    (``--precision pure``); float32 under ``amp`` runs no autocast at all."""
    dtype, precision = bench.get("dtype"), bench.get("precision")
    if dtype == "float32":
        return "float32"
    return f"{dtype} autocast" if precision == "amp" else f"{dtype} weights and inputs"


def _resolutions(rows: list[dict]) -> list[int]:
    return list(dict.fromkeys(r["img_size"] for r in rows if r.get("img_size") is not None))


def _sizes_and_batches(bench: dict) -> str:
    sizes = bench.get("img_sizes") or [bench.get("img_size")]
    batches = bench.get("batch_sizes") or [bench.get("batch_size")]
    if len(sizes) == 1:
        return f"batch {batches[0]}  {sizes[0]}px"
    return "batch " + ", ".join(f"{b} at {s}px" for s, b in zip(sizes, batches))


def format_table(rows: list[dict], baseline: str, env: dict | None = None) -> str:
    """One line per model (and resolution, when several were measured): params, GFLOPs, img/s, latency, memory, and
    ratios to ``baseline`` at the same resolution. Peak memory reads n/a off CUDA (not measured there)."""
    bases = {}
    for r in rows:
        if r["model"] == baseline:
            bases.setdefault(r.get("img_size"), r)
    multi = any((r.get("gpus") or 1) > 1 for r in rows)
    on_cuda = env is None or "cuda" in str(env.get("benchmark", {}).get("device", "cuda"))
    columns = [("model", "model", None), ("family", "family", None), ("params (M)", "params_M", 1),
               ("GFLOPs", "gflops", 2)]
    if len(_resolutions(rows)) > 1:
        columns += [("px", "img_size", None), ("batch", "batch_size", None)]
    columns += [("infer img/s", "infer_img_s", 0), ("±spread", "infer_spread", None),
                ("train img/s", "train_img_s", 0), ("lat b1 (ms)", "latency_ms", 2),
                ("infer MiB", "infer_peak_MiB", 0), ("train MiB", "train_peak_MiB", 0)]
    if any(r.get("infer_compile_s") or r.get("train_compile_s") for r in rows):
        columns += [("infer compile (s)", "infer_compile_s", 0), ("train compile (s)", "train_compile_s", 0)]
    if multi:
        columns += [("GPUs", "gpus", None), ("DP infer img/s", "dp_infer_img_s", 0),
                    ("DP train img/s", "dp_train_img_s", 0)]
    header = [c[0] for c in columns] + ["infer/base", "train/base", "latency/base"]
    host_bound_keys = {"infer_img_s": "infer_host_bound", "train_img_s": "train_host_bound"}
    lines = []
    for row in rows:
        base = bases.get(row.get("img_size"), {})
        cells = []
        for _, key, digits in columns:
            value = row.get(key)
            if key == "infer_spread":
                cells.append("-" if value is None else f"{100 * value:.0f}%")
            elif key.endswith("_peak_MiB") and value is None and not on_cuda:
                cells.append("n/a")
            else:
                cell = _fmt(value, digits) if digits is not None else _fmt(value)
                cells.append(cell + HOST_BOUND_MARK if row.get(host_bound_keys.get(key, "")) else cell)
        cells += [_ratio(row.get(key), base.get(key)) for key in ("infer_img_s", "train_img_s", "latency_ms")]
        lines.append(cells)
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    render = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                                     enumerate(zip(cells, widths)))
    out = []
    if env is not None:
        bench = env.get("benchmark", {})
        out.append(f"# {env['device']} x{max(1, env.get('device_count') or 1)}  torch {env['torch']}  "
                   f"timm {env.get('timm')}  {env['time_utc']}  {_sizes_and_batches(bench)}  {numerics(bench)}"
                   f"{'  channels_last' if bench.get('channels_last') else ''}"
                   f"{_compiled(bench)}{_kwargs(bench)}")
    out += [render(header), render(["-" * w for w in widths]), *map(render, lines)]
    out.append(f"(base = {baseline}. img/s: higher is better, ratio > 1 is faster than the base; latency: lower is "
               f"better, ratio < 1 is faster; spread = (p80 - p20) / median of the inference timing)")
    if any(row.get(key) for row in rows for key in host_bound_keys.values()):
        out.append(host_bound_note())
    for row in rows:
        if row.get("error"):
            out.append(f"! {row['model']}: {row['error']}")
        if row.get("dp_error"):
            out.append(f"! {row['model']} (data-parallel): {row['dp_error']}")
    return "\n".join(out)


def plot_results(rows: list[dict], path: str | Path, *, x: str = "params", env: dict | None = None) -> Path | None:
    """Scatter of inference img/s against parameters (``x='params'``) or GFLOPs; visionssm models highlighted.
    Returns the PNG path, or ``None`` when no model has numbers to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, label = ("params_M", "parameters (M)") if x == "params" else ("gflops", "GFLOPs (2 x MACs, batch 1)")
    points = [r for r in rows if r.get(key) is not None and r.get("infer_img_s") is not None]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=150)
    for family, colour, marker in (("visionssm", "tab:red", "o"), ("timm", "tab:blue", "s")):
        group = [r for r in points if (r.get("family") or "timm") == family]
        if group:
            ax.scatter([r[key] for r in group], [r["infer_img_s"] for r in group], c=colour, marker=marker,
                       label=family, zorder=3)
    for r in points:
        ax.annotate(r["model"], (r[key], r["infer_img_s"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel(label)
    ax.set_ylabel("inference throughput (img/s)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    if env is not None:
        bench = env.get("benchmark", {})
        ax.set_title(_plot_title(env, f"batch {bench.get('batch_size')}, {bench.get('img_size')}px"), fontsize=9)
    return _save(fig, path)


def plot_resolution(rows: list[dict], path: str | Path, *, env: dict | None = None) -> Path | None:
    """Two panels against resolution: img/s (log scale) and peak MiB, one line per model and mode (inference solid,
    training dashed). Returns the PNG path, or ``None`` without matplotlib or without two resolutions to plot."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len(_resolutions(rows)) < 2:
        return None
    models = list(dict.fromkeys(r["model"] for r in rows))
    colours = plt.get_cmap("tab10")
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=150)
    for i, model in enumerate(models):
        ours = sorted((r for r in rows if r["model"] == model and not r.get("error")), key=lambda r: r["img_size"])
        for mode, style in (("infer", "-"), ("train", "--")):
            for ax, key in ((speed, f"{mode}_img_s"), (memory, f"{mode}_peak_MiB")):
                points = [(r["img_size"], r[key]) for r in ours if r.get(key) is not None]
                if points:
                    ax.plot(*zip(*points), style, marker="o", markersize=3, color=colours(i % 10),
                            label=f"{model} {mode}")
    speed.set_yscale("log")
    speed.set_ylabel("img/s")
    memory.set_ylabel("peak memory (MiB)")
    if not memory.lines:
        memory.text(0.5, 0.5, "n/a: peak memory is measured on CUDA only", ha="center", transform=memory.transAxes)
    for ax in (speed, memory):
        ax.set_xlabel("resolution (px a side)")
        ax.set_xticks(_resolutions(rows))
        ax.grid(True, alpha=0.3)
    speed.legend(loc="best", fontsize=6)
    if env is not None:
        bench = env.get("benchmark", {})
        fig.suptitle(_plot_title(env, _sizes_and_batches(bench), _kwargs(bench)), fontsize=8)
    return _save(fig, path)


def _plot_title(env: dict, setting: str, kwargs: str = "") -> str:
    """A chart's caption: device, ``setting`` (batch and size), numerics, layout, compile, model kwargs, date."""
    bench = env.get("benchmark", {})
    return (f"{env['device']}, {setting}, {numerics(bench)}{', channels_last' if bench.get('channels_last') else ''}"
            f"{', compiled' if bench.get('compile') else ''}{kwargs} ({env['date']})")


def _save(fig, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_outputs(rows: list[dict], env: dict, *, name: str, out_dir: str | Path, chart: str = "params"
                  ) -> tuple[Path, Path, Path | None]:
    """JSON + CSV through :func:`save_results`, and the PNG chart beside them: against ``chart`` at one resolution,
    against resolution (:func:`plot_resolution`) when several were measured."""
    json_path, csv_path = save_results(name, rows, out_dir=out_dir, env=env)
    if len(_resolutions(rows)) > 1:
        png_path = plot_resolution(rows, json_path.with_suffix(".png"), env=env)
    else:
        png_path = plot_results(rows, json_path.with_suffix(".png"), x=chart, env=env)
    return json_path, csv_path, png_path
