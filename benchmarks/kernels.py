"""Kernel benchmark from a checkout: ``visionssm-benchmark kernels`` with the results next to the committed ones.

    python benchmarks/kernels.py                      # every op, every shape (GPU)
    python benchmarks/kernels.py --ops gka --quick    # one op, its first shape only

The suites and their runner live in the package (:mod:`visionssm.benchmark.kernel_suites`, one suite per kernel
op in ``visionssm.kernels.<op>.benchmark``); this script only changes where the results go: ``benchmarks/results/``
of this checkout unless ``--out`` says otherwise. Without CUDA every suite prints one skip line and nothing is
written.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from visionssm.benchmark import kernel_suites  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    return kernel_suites.main(argv, default_out=RESULTS_DIR)


if __name__ == "__main__":
    raise SystemExit(main())
