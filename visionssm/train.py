"""Train (or evaluate) a timm/visionssm image classifier on ImageNet or any ImageFolder, with accelerate.

    visionssm-train                               # embedded default: small model, generated shapes set, CPU-friendly
    accelerate launch -m visionssm.train --config configs/imagenet/mamba_vision_T.yaml --data-dir DATA --output OUT
    visionssm-train --eval-only --checkpoint OUT/checkpoints/epoch_0012 --output OUT

``python -m visionssm.train`` and a checkout's ``train_imagenet.py`` are the same program. This module is the
command: it parses the configuration before importing torch, timm or the models, so ``--help`` and a mistyped flag
answer at once, then hands it to :func:`visionssm.training.loop.train`. The loop is timm's ``train.py`` shape
(:func:`train_one_epoch`, :func:`validate`, also reachable from here) on timm's data pipeline, optimizers,
schedules and EMA and on accelerate's devices, DDP, mixed precision and checkpoint state.

Every key of the packaged ``configs/imagenet/default.yaml`` can be set by a recipe (``--config``: a file, or the
name of a recipe shipped in ``visionssm.configs``) and overridden on the command line. ``--epochs N`` is the whole
run: warmup and cooldown shrink to fit when they do not (``visionssm.training.setup.fit_schedule``).
OUT receives ``config.yaml`` (the resolved configuration), ``metrics.jsonl`` (one record per epoch), ``curves.png``,
``checkpoints/`` (the last ``keep_last`` plus the best, each complete or absent) and ``model_best.safetensors``
(plain timm state dict of the best weights, model or EMA per ``best_metric``). A run pointed at an OUT holding a
complete checkpoint continues from it (``--resume auto``, the default) and ends exactly where the uninterrupted run
would have.
"""

from __future__ import annotations

import importlib
import sys

from visionssm.training.state import parse_config
from visionssm.utils.cli import run_main

__all__ = ["main", "train_one_epoch", "validate"]  # noqa: F822  (the last two through __getattr__)

PROG = "visionssm-train"


def main(argv=None) -> int:
    """The command line: exit status 0, or 2 with one ``visionssm-train: error: ...`` line for a user error."""
    return run_main(_cli, argv, prog=PROG)


def _cli(argv) -> int:
    cfg = parse_config(argv, prog=PROG)
    from visionssm.training.loop import train  # torch, timm and the models: only once the arguments parse

    return train(cfg)


def __getattr__(name: str):
    """The loop's names (``train_one_epoch``, ``validate``, ``Run``, ...), imported on first use."""
    if not name.startswith("__"):
        loop = importlib.import_module("visionssm.training.loop")
        if hasattr(loop, name):
            return getattr(loop, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    sys.exit(main())
