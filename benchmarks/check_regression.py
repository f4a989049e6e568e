"""Regression check: compare a fresh ``visionssm-benchmark`` JSON with the committed results.

    python benchmarks/check_regression.py fresh.json                       # against the newest committed run
    python benchmarks/check_regression.py fresh.json --against benchmarks/results/throughput-nvidia-h200-<date>.json

A model is flagged when it is more than ``--threshold`` (default 10%) slower than the committed number in any
metric both runs measured: for throughputs (img/s) slowdown = committed / fresh - 1, for latency (ms)
slowdown = fresh / committed - 1. A model that fails in the fresh run but has committed numbers is flagged too.
Rows are matched on model, batch size, resolution, dtype, precision, channels_last and compile; data-parallel
totals only when the GPU count matches. Without ``--against`` the newest committed backbone JSON measured on the
same device is used. Exit status: 0 no regression, 1 regression, 2 nothing comparable (or bad arguments).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MATCH_KEYS = ("model", "batch_size", "img_size", "dtype", "precision", "channels_last", "compile")
# metric -> True when higher is better
METRICS = {"infer_img_s": True, "train_img_s": True, "latency_ms": False, "dp_infer_img_s": True,
           "dp_train_img_s": True}


class ComparisonError(ValueError):
    """The two runs cannot be compared (different device, nothing in common, unreadable file)."""


def load_run(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ComparisonError(f"cannot read {path}: {error}") from None
    if not isinstance(data, dict) or "results" not in data or "environment" not in data:
        raise ComparisonError(f"{path} is not a benchmark results JSON (needs 'environment' and 'results')")
    if "benchmark" not in data["environment"]:
        raise ComparisonError(f"{path} was not written by visionssm-benchmark (no 'benchmark' settings)")
    return data


def find_committed(fresh_path: Path, fresh: dict, results_dir: Path = RESULTS_DIR) -> Path:
    """The newest backbone results JSON under ``results_dir`` measured on the fresh run's device."""
    device = fresh["environment"].get("device")
    candidates = []
    for path in sorted(results_dir.glob("*.json")):
        if path.resolve() == fresh_path.resolve():
            continue
        try:
            data = load_run(path)
        except ComparisonError:
            continue
        if data["environment"].get("device") == device:
            candidates.append((data["environment"].get("time_utc") or data["environment"].get("date") or "", path))
    if not candidates:
        raise ComparisonError(f"no committed backbone results for device {device!r} in {results_dir}")
    return max(candidates)[1]


def _key(row: dict) -> tuple:
    return tuple(row.get(k) for k in MATCH_KEYS)


def compare(fresh: dict, committed: dict, threshold: float = 0.10, allow_device_mismatch: bool = False
            ) -> list[dict]:
    """One entry per (model, metric) both runs have: committed, fresh, slowdown and whether it regressed."""
    if not threshold > 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    fresh_device, committed_device = fresh["environment"].get("device"), committed["environment"].get("device")
    if fresh_device != committed_device and not allow_device_mismatch:
        raise ComparisonError(f"the runs are from different devices ({fresh_device!r} vs {committed_device!r}); "
                              "pass --allow-device-mismatch to compare anyway")
    old_rows = {_key(r): r for r in committed["results"]}
    entries = []
    for row in fresh["results"]:
        old = old_rows.get(_key(row))
        if old is None:
            continue
        if row.get("error"):
            if not old.get("error"):
                entries.append({"model": row["model"], "metric": "error", "committed": None, "fresh": None,
                                "slowdown": None, "regressed": True, "note": row["error"]})
            continue
        for metric, higher_is_better in METRICS.items():
            if metric.startswith("dp_") and row.get("gpus") != old.get("gpus"):
                continue
            new_value, old_value = row.get(metric), old.get(metric)
            if not isinstance(new_value, (int, float)) or not isinstance(old_value, (int, float)):
                continue
            if new_value <= 0 or old_value <= 0:
                continue
            slowdown = old_value / new_value - 1 if higher_is_better else new_value / old_value - 1
            entries.append({"model": row["model"], "metric": metric, "committed": old_value, "fresh": new_value,
                            "slowdown": slowdown, "regressed": slowdown > threshold, "note": ""})
    if not entries:
        raise ComparisonError("the runs have no model measured under the same settings "
                              f"({', '.join(MATCH_KEYS)}) in common")
    return entries


def format_report(entries: list[dict], threshold: float) -> str:
    header = ["model", "metric", "committed", "fresh", "slower by", "status"]
    lines = []
    for e in entries:
        slow = "-" if e["slowdown"] is None else f"{100 * e['slowdown']:+.1f}%"
        status = "REGRESSION" if e["regressed"] else "ok"
        lines.append([e["model"], e["metric"], "-" if e["committed"] is None else f"{e['committed']:.4g}",
                      "-" if e["fresh"] is None else f"{e['fresh']:.4g}", slow,
                      status + (f" ({e['note']})" if e["note"] else "")])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    render = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))
    flagged = sorted({e["model"] for e in entries if e["regressed"]})
    summary = (f"{len(flagged)} model(s) more than {100 * threshold:.0f}% slower: {', '.join(flagged)}" if flagged
               else f"no model more than {100 * threshold:.0f}% slower")
    return "\n".join([render(header), render(["-" * w for w in widths]), *map(render, lines), summary])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("fresh", help="results JSON of the new run")
    parser.add_argument("--against", default=None, help="committed results JSON (default: the newest one in "
                        "benchmarks/results measured on the same device)")
    parser.add_argument("--results-dir", default=str(RESULTS_DIR), help="where committed results are searched")
    parser.add_argument("--threshold", type=float, default=0.10, help="allowed slowdown (default 0.10 = 10%%)")
    parser.add_argument("--allow-device-mismatch", action="store_true")
    args = parser.parse_args(argv)
    if not args.threshold > 0:
        parser.error(f"--threshold must be > 0, got {args.threshold}")
    try:
        fresh_path = Path(args.fresh)
        fresh = load_run(fresh_path)
        committed_path = Path(args.against) if args.against else find_committed(fresh_path, fresh,
                                                                                   Path(args.results_dir))
        committed = load_run(committed_path)
        entries = compare(fresh, committed, args.threshold, args.allow_device_mismatch)
    except ComparisonError as error:
        print(f"check_regression: {error}", file=sys.stderr)
        return 2
    print(f"fresh:     {fresh_path} ({fresh['environment'].get('device')}, {fresh['environment'].get('date')})")
    print(f"committed: {committed_path} ({committed['environment'].get('device')}, "
          f"{committed['environment'].get('date')})")
    print(format_report(entries, args.threshold))
    return 1 if any(e["regressed"] for e in entries) else 0


if __name__ == "__main__":
    raise SystemExit(main())
