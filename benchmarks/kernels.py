"""Kernel benchmark: every visionssm op next to its anchors, in one run.

    python benchmarks/kernels.py                      # all ops, all shapes (GPU)
    python benchmarks/kernels.py --ops gka --quick    # one op, the first shape only

Each op's cases live in its kernel package, ``visionssm.kernels.<op>.benchmark``: a module with ``ANCHOR`` (the
implementation the ratios are taken against) and ``run(quick: bool, copy_gbps: float | None) -> list[dict]``
returning rows with ``op, shape, mode, impl, ms`` (and optionally ``GB/s``, ``%copy``).
Results go to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from visionssm.layers import mixer_kernel_ops  # noqa: E402
from visionssm.utils.benchmark import copy_bandwidth_gbps, environment, save_results, side_by_side  # noqa: E402

OPS = tuple(mixer_kernel_ops())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--quick", action="store_true", help="first shape only (a smoke run)")
    parser.add_argument("--out-dir", default=None, help="where to write JSON/CSV (default benchmarks/results)")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)

    env = environment()
    copy_gbps = copy_bandwidth_gbps()
    env["copy_GBps"] = copy_gbps
    print(f"# {env['device']}  torch {env['torch']}  triton {env['triton']}  {env['date']}"
          + (f"  copy ceiling {copy_gbps:.0f} GB/s" if copy_gbps else ""), flush=True)
    all_rows, tables = [], []
    for op in args.ops:
        suite = importlib.import_module(f"visionssm.kernels.{op}.benchmark")
        rows = suite.run(quick=args.quick, copy_gbps=copy_gbps)
        all_rows += rows
        tables.append(f"## {op}\n" + side_by_side(rows, keys=["shape", "mode"], baseline=suite.ANCHOR))
    if not args.no_save:
        # A run of a subset of the ops is named after them, so it does not overwrite a full run of the same day.
        name = "kernels" if set(args.ops) == set(OPS) else "kernels-" + "-".join(args.ops)
        paths = save_results(name, all_rows, out_dir=args.out_dir, env=env)
        print("wrote", *paths)
    print("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
