"""The backbone run's outputs: the side-by-side table with ratios to the baseline, the throughput chart, and the
JSON/CSV/PNG files."""

from __future__ import annotations

from pathlib import Path

from .harness import HOST_BOUND_MARK, host_bound_note, save_results

__all__ = ["HOST_BOUND_MARK", "format_table", "numerics", "plot_results", "write_outputs"]


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


def numerics(bench: dict) -> str:
    """What the numbers were computed in: ``float32``, ``bfloat16 autocast`` (fp32 weights) or ``bfloat16 weights``
    (``--precision pure``); float32 under ``amp`` runs no autocast at all."""
    dtype, precision = bench.get("dtype"), bench.get("precision")
    if dtype == "float32":
        return "float32"
    return f"{dtype} autocast" if precision == "amp" else f"{dtype} weights and inputs"


def format_table(rows: list[dict], baseline: str, env: dict | None = None) -> str:
    """One line per model: params, GFLOPs, img/s, latency, memory, and ratios to ``baseline``."""
    base = next((r for r in rows if r["model"] == baseline), {})
    multi = any((r.get("gpus") or 1) > 1 for r in rows)
    columns = [("model", "model", None), ("family", "family", None), ("params (M)", "params_M", 1),
               ("GFLOPs", "gflops", 2), ("infer img/s", "infer_img_s", 0), ("±spread", "infer_spread", None),
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
        cells = []
        for _, key, digits in columns:
            value = row.get(key)
            if key == "infer_spread":
                cells.append("-" if value is None else f"{100 * value:.0f}%")
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
                   f"timm {env.get('timm')}  {env['time_utc']}  batch {bench.get('batch_size')}  "
                   f"{bench.get('img_size')}px  {numerics(bench)}"
                   f"{'  channels_last' if bench.get('channels_last') else ''}"
                   f"{_compiled(bench)}")
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
        ax.set_title(f"{env['device']}, batch {bench.get('batch_size')}, {bench.get('img_size')}px, "
                     f"{numerics(bench)}{', channels_last' if bench.get('channels_last') else ''}"
                     f"{', compiled' if bench.get('compile') else ''} ({env['date']})", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_outputs(rows: list[dict], env: dict, *, name: str, out_dir: str | Path, chart: str = "params"
                  ) -> tuple[Path, Path, Path | None]:
    """JSON + CSV through :func:`save_results`, and the PNG chart beside them."""
    json_path, csv_path = save_results(name, rows, out_dir=out_dir, env=env)
    png_path = plot_results(rows, json_path.with_suffix(".png"), x=chart, env=env)
    return json_path, csv_path, png_path
