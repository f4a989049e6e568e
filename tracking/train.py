"""Train a one-stream tracker (OSTrack recipe) under accelerate.

::

    accelerate launch -m visionssm.tracking.train --config configs/tracking/gka_vision_T_got10k_ep100.yaml
    python -m visionssm.tracking.train --config configs/tracking/smoke_synthetic.yaml --set train.epochs=1

Recipe: AdamW (lr 4e-4, backbone lr × 0.1, weight decay 1e-4 on weight matrices and conv kernels; norms, biases,
position / token-type embeddings and 1-D SSM parameters undecayed), gradient-norm clip 0.1, lr ÷ 10 after 80 % of the
epochs (per-epoch step), loss focal + 2·GIoU + 5·L1, backbone initialised from ``model.pretrained`` (an ImageNet
checkpoint file).

Outputs in ``output_dir``: ``config.yaml``; ``metrics.jsonl`` (one JSON line every ``log_every`` steps and one per
epoch with ``epoch_summary: true``); ``checkpoints/epoch_NNNN`` and ``checkpoints/step_NNNNNNNN`` written like the
ImageNet trainer's (accelerate state into a temporary directory, renamed into place once complete, the newest
``keep_last`` kept); ``final.pth`` (tracker weights + config, what ``visionssm.tracking.run`` loads; ``finished``
says whether the schedule completed). Rerunning the same command resumes from the newest complete checkpoint, at
the exact batch: pairs are a deterministic function of (seed, epoch, index); with ``train.deterministic`` the resumed
run equals the uninterrupted one to the last bit on a GPU too. ``--no-resume`` starts over.

This module is the command: it parses the arguments and reads the config (a bad flag, file or key is one error
line) before importing torch; the training itself is :func:`visionssm.tracking.trainer.train`, whose names
(``train``, ``param_groups``, ...) are also reachable from here.
"""

from __future__ import annotations

import json

from visionssm.utils.cli import ArgumentParser, forward_attributes, run_main

from .config import load_config

__all__ = ["main", "train"]  # noqa: F822  (train through __getattr__)

PROG = "python -m visionssm.tracking.train"

__getattr__ = forward_attributes("visionssm.tracking.trainer", __name__)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog=PROG, description="Train a visionssm one-stream tracker. Writes into output_dir "
                            "(default output/tracking/<name> in the working directory).")
    parser.add_argument("--config", required=True,
                        help="YAML experiment config: a file, or a shipped one (configs/tracking/<name>.yaml)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="override config keys (YAML values); a number indexes a list (data.train.0.root=DIR); "
                             "model.pretrained=null trains the backbone from scratch")
    parser.add_argument("--no-resume", action="store_true", help="start over even if checkpoints exist")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def _main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    cfg = load_config(args.config, args.set)
    from .trainer import train  # torch, accelerate and the models: only once the arguments and config are read

    stats = train(cfg, resume=not args.no_resume, progress=not args.no_progress)
    if stats:
        print(json.dumps({"last_epoch_stats": stats, "output_dir": cfg["output_dir"]}))
    return 0


def main(argv=None) -> int:
    return run_main(_main, argv, prog=PROG)


if __name__ == "__main__":
    raise SystemExit(main())
