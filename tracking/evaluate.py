"""Evaluate tracking results: GOT-10k AO / SR0.5 / SR0.75 and LaSOT success AUC / P@20 / NP@0.20, with plots.

::

    python -m visionssm.tracking.evaluate --dataset got10k --root data/GOT-10k --split val --trackers gka_T first_box
    python -m visionssm.tracking.evaluate --dataset lasot --root data/LaSOT --trackers gka_T

Reads the layout :mod:`visionssm.tracking.run` writes under ``--results-dir``; writes ``performance.json`` and PNG
plots (GOT-10k: success; LaSOT: success, precision, normalised precision) under ``<report-dir>/<GOT-10k|LaSOT>/``.
The conventions used are printed with the numbers and stored in the JSON (see :mod:`visionssm.tracking.metrics`).
Result files are read strictly (:mod:`visionssm.tracking.results`): a malformed, NaN, negative-size or short one
stops the evaluation with its file and line.

This module is the command: it parses its arguments before importing torch; the work is
:mod:`visionssm.tracking.evaluation`, whose names (``evaluate``, ``format_report``, ...) are also reachable from
here.
"""

from __future__ import annotations

import os

from visionssm.utils.cli import ArgumentParser, forward_attributes, run_main

__all__ = ["evaluate", "format_report", "main"]  # noqa: F822  (the first two through __getattr__)

__getattr__ = forward_attributes("visionssm.tracking.evaluation", __name__)

PROG = "python -m visionssm.tracking.evaluate"


def _main(argv=None) -> int:
    parser = ArgumentParser(prog=PROG, description="Evaluate tracking results on GOT-10k val or LaSOT test. Writes "
                            "performance.json and plots under --report-dir (default ./reports).")
    parser.add_argument("--dataset", required=True, choices=["got10k", "lasot"], help="benchmark layout to read")
    parser.add_argument("--root", required=True, help="dataset root (the ground truth)")
    parser.add_argument("--split", default=None, help="got10k: val (default); lasot: test (default)")
    parser.add_argument("--trackers", nargs="+", required=True, help="result folder names")
    parser.add_argument("--results-dir", default="results", help="where the result folders are (default ./results)")
    parser.add_argument("--report-dir", default="reports", help="where the report goes (default ./reports)")
    parser.add_argument("--no-plots", action="store_true", help="write performance.json only")
    args = parser.parse_args(argv)
    from .evaluation import evaluate, format_report  # torch (the metrics' thresholds): once the arguments parse
    from .runner import DATASET_DIRS

    split = args.split or ("val" if args.dataset == "got10k" else "test")
    report = evaluate(args.dataset, args.root, split, args.results_dir, args.trackers, args.report_dir,
                      not args.no_plots)
    print(format_report(report))
    print("report:", os.path.join(args.report_dir, DATASET_DIRS[args.dataset], "performance.json"))
    return 0


def main(argv=None) -> int:
    return run_main(_main, argv, prog=PROG)


if __name__ == "__main__":
    raise SystemExit(main())
