"""Run a tracker over GOT-10k or LaSOT and write its results in the benchmark's format.

::

    python -m visionssm.tracking.run --dataset got10k --root data/GOT-10k --split val \
        --checkpoint output/track_gka_T_got10k/final.pth --name gka_T
    python -m visionssm.tracking.run --dataset lasot --root data/LaSOT --split test --checkpoint ... --name gka_T

Layout written (floats, comma separated, one ``x,y,w,h`` per frame; per-frame seconds in ``*_time.txt``):

- GOT-10k (the toolkit's / submission layout): ``<results>/GOT-10k/<name>/<seq>/<seq>_001.txt`` and
  ``<seq>_time.txt``; ``--pack`` zips ``<results>/GOT-10k/<name>`` into ``<name>.zip`` for the evaluation server.
- LaSOT: ``<results>/LaSOT/<name>/<seq>.txt`` and ``<seq>_time.txt``.

``--baseline first-box`` writes the results of a tracker that repeats the first box. Speed is given two ways, both
named wherever they appear (here and in ``visionssm.tracking.evaluate``): ``fps`` = frames / tracking time (frame 1,
the initialisation, and image decoding excluded) and ``fps_toolkit_mean_inverse_time`` = the toolkits' mean of 1/t
over per-frame times (every frame); the second is higher when frame times vary. Both are printed and saved in
``<results>/<GOT-10k|LaSOT>/<name>_<split>_run_summary.json`` (beside, not inside, the folder that gets submitted).

This module is the command: it parses its arguments before importing torch; the work is
:mod:`visionssm.tracking.runner`, whose names (``run``, ``result_paths``, ...) are also reachable from here.
"""

from __future__ import annotations

from visionssm.utils.cli import ArgumentParser, forward_attributes, run_main

__all__ = ["main", "run"]  # noqa: F822  (run through __getattr__)

__getattr__ = forward_attributes("visionssm.tracking.runner", __name__)

PROG = "python -m visionssm.tracking.run"


def _main(argv=None) -> int:
    parser = ArgumentParser(prog=PROG, description="Run a visionssm tracker on GOT-10k or LaSOT. Writes result files "
                            "under --results-dir (default ./results).")
    parser.add_argument("--dataset", required=True, choices=["got10k", "lasot"], help="benchmark layout to read")
    parser.add_argument("--root", required=True, help="dataset root (GOT-10k: holds train/val/test; LaSOT: categories)")
    parser.add_argument("--split", required=True, help="got10k: val|test, lasot: test")
    parser.add_argument("--checkpoint", help="training checkpoint (final.pth / last.pth)")
    parser.add_argument("--baseline", choices=["first-box"], help="run a baseline instead of a checkpoint")
    parser.add_argument("--name", required=True, help="tracker name (result folder)")
    parser.add_argument("--results-dir", default="results", help="where result folders go (default ./results)")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--sequences", nargs="*", help="only these sequences")
    parser.add_argument("--max-sequences", type=int, default=None, help="only the first N sequences")
    parser.add_argument("--amp", action="store_true", help="bf16 autocast on CUDA")
    parser.add_argument("--overwrite", action="store_true", help="re-run sequences that already have results")
    parser.add_argument("--pack", action="store_true", help="GOT-10k: zip the results for the evaluation server")
    args = parser.parse_args(argv)
    if args.pack and args.dataset != "got10k":
        parser.error("--pack is for GOT-10k")
    from .runner import format_speed, open_dataset, pack_got10k, run  # torch and the tracker: once the arguments parse

    summary = run(args.dataset, args.root, args.split, args.name, args.results_dir, args.checkpoint, args.baseline,
                  args.device, args.sequences, args.max_sequences, args.amp, args.overwrite)
    if summary["fps"]:
        print(f"{args.name}: {summary['sequences']} sequences, {summary['frames_tracked']} frames tracked, "
              f"{format_speed(summary['fps'], summary['fps_toolkit_mean_inverse_time'])}; device {summary['device']}")
    else:
        print(f"{args.name}: nothing new to track (results exist; --overwrite to redo)")
    if args.pack:
        names = args.sequences or open_dataset("got10k", args.root, args.split).seq_names
        print("submission archive:", pack_got10k(args.results_dir, args.name, list(names)))
    return 0


def main(argv=None) -> int:
    return run_main(_main, argv, prog=PROG)


if __name__ == "__main__":
    raise SystemExit(main())
