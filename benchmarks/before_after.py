"""This checkout's speed against an earlier revision's, in one run: the backbones (eager, and replayed from a CUDA
graph: the GPU's work without the host's) and the first shape of each kernel suite, after/before per row.

    python benchmarks/before_after.py b625226                                  # five backbones, four kernel suites
    python benchmarks/before_after.py HEAD~3 --models comba_vision_T --ops comba --rounds 3 --out before-after.txt

Both trees are installed without dependencies into a temporary folder (the revision from ``git archive``, this
checkout as it is on disk, uncommitted changes included) and each measurement runs in a process of its own with that
folder first on ``PYTHONPATH``: one model or one suite, the two trees one after the other, the models and rounds
interleaved, so that both see the same machine. Every process is run once untimed first (in parallel), so that
Triton's and Inductor's caches are warm when the timed ones run. A row's value is its median over ``--rounds``.

Rows to trust: CUDA-graph rows and plain rows that are not host-bound (‡). A host-bound row is set by the host's
work per call, which moves with the machine's load by 10–30% between runs of the same code.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("comba_vision_T", "comba_vision_S", "gka_vision_T", "mamba_vision_T", "echo_vision_T")
OPS = ("comba", "gka", "ska", "selective_scan")
TREES = ("before", "after")


def install(source: Path, target: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(target), str(source)], check=True, stdout=subprocess.DEVNULL)


def export(rev: str, folder: Path) -> Path:
    """``rev`` of this repository as files under ``folder``."""
    folder.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def measure_backbone(args: argparse.Namespace) -> None:
    """Worker: one model, eager (and from a CUDA graph on a GPU), into ``args.json``."""
    import torch

    from visionssm.benchmark.config import BenchmarkConfig
    from visionssm.benchmark.measure import measure_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for graph in (False, True) if device.type == "cuda" else (False,):
        cfg = BenchmarkConfig(models=[args.worker], batch_size=args.batch_size, img_size=args.img_size,
                              dtype="bfloat16" if device.type == "cuda" else "float32", channels_last=True,
                              modes=("infer", "train"), warmup=args.warmup, repeats=args.repeats, device=device.type,
                              count_flops=False, cuda_graph=graph)
        row = measure_model(args.worker, cfg, device)
        if row["error"]:
            raise SystemExit(f"{args.worker}: {row['error']}")
        rows.append({"row": args.worker + (" (CUDA graph)" if graph else ""), **row})
    Path(args.json).write_text(json.dumps(rows, default=str))


def load_rows(folder: Path) -> dict[tuple[str, str, str], tuple[float, bool | None]]:
    """(kind, row, column) -> (value, host-bound) of every JSON in ``folder``; higher values are faster."""
    rows = {}
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        for r in data if isinstance(data, list) else data["results"]:
            if "row" in r:  # a backbone: img/s
                for mode in ("infer", "train"):
                    rows[("backbone", r["row"], mode)] = (r[f"{mode}_img_s"], r.get(f"{mode}_host_bound"))
            elif r.get("ms"):  # a kernel suite row: ms, inverted
                key = ("kernel", f"{r['op']} {r['shape']} {r['mode']}", r["impl"])
                rows[key] = (1.0 / r["ms"], r.get("host_bound"))
    return rows


def table(rounds: list[dict[str, dict]]) -> list[str]:
    """Lines of the after/before table from each round's {tree: rows}: medians over the rounds."""
    keys = sorted(set.intersection(*(set(r[tree]) for r in rounds for tree in TREES)))
    lines = [f"{'kind':8s} {'row':52s} {'column':24s} {'before':>10s} {'after':>10s} {'after/before':>12s}"]
    for key in keys:
        value = {tree: statistics.median(r[tree][key][0] for r in rounds) for tree in TREES}
        host = any(r[tree][key][1] for r in rounds for tree in TREES)
        shown = {tree: (1.0 / v if key[0] == "kernel" else v) for tree, v in value.items()}  # kernels: ms again
        lines.append(f"{key[0]:8s} {key[1]:52s} {key[2]:24s} {shown['before']:10.4g} {shown['after']:10.4g} "
                     f"{value['after'] / value['before']:12.3f}{' ‡' if host else ''}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", nargs="?", help="the git revision to compare against (e.g. b625226, HEAD~3)")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--ops", nargs="*", default=list(OPS),
                        help="kernel suites (first shape each); none given: no suites")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per process")
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        measure_backbone(args)
        return 0
    if not args.before:
        parser.error("name the revision to compare against")
    for name in ("rounds", "warmup", "repeats", "batch_size", "img_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    known = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{args.before}^{{commit}}"],
                           capture_output=True)
    if known.returncode:
        parser.error(f"before: {args.before!r} is not a commit of {ROOT}")
    with tempfile.TemporaryDirectory(prefix="before-after-") as tmp:
        tmp = Path(tmp)
        sites = {"before": tmp / "site-before", "after": tmp / "site-after"}
        install(export(args.before, tmp / "src-before"), sites["before"])
        install(ROOT, sites["after"])

        def run(tree: str, what: str, out: Path, quick: bool) -> str | None:
            """One measurement in its own process; returns an error line or None."""
            out.mkdir(parents=True, exist_ok=True)
            if what.startswith("kernels:"):
                command = ["-m", "visionssm.benchmark", "kernels", "--ops", what[8:], "--quick", "--out", str(out)]
            else:
                command = [str(Path(__file__).resolve()), "--worker", what, "--json", str(out / f"{what}.json"),
                           "--batch-size", str(args.batch_size), "--img-size", str(args.img_size),
                           "--warmup", str(1 if quick else args.warmup), "--repeats", str(1 if quick else args.repeats)]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(sites[tree]), os.environ.get("PYTHONPATH", "")])}
            try:
                done = subprocess.run([sys.executable, *command], cwd=tmp, env=env, capture_output=True, text=True,
                                      timeout=args.timeout)
            except subprocess.TimeoutExpired:
                return f"{tree} {what}: over {args.timeout:.0f} s"
            return None if done.returncode == 0 else f"{tree} {what}: {done.stderr.strip().splitlines()[-1:]}"

        jobs = [*args.models, *(f"kernels:{op}" for op in args.ops)]
        with ThreadPoolExecutor(max_workers=4) as pool:  # warm the compile caches, untimed
            list(pool.map(lambda job: run(*job, tmp / "warm", True), [(t, j) for t in TREES for j in jobs]))
        rounds = []
        for index in range(args.rounds):
            folders = {tree: tmp / f"round{index}" / tree for tree in TREES}
            for job in jobs:
                for tree in TREES:
                    error = run(tree, job, folders[tree], False)
                    if error:
                        print("failed:", error, file=sys.stderr)
            rounds.append({tree: load_rows(folders[tree]) for tree in TREES})
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    lines = [f"# {args.before} (before) against this checkout (after); {device}, {time.strftime('%Y-%m-%d %H:%M')}; "
             f"median of {args.rounds} round(s); ‡: host-bound in a round", *table(rounds)]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
