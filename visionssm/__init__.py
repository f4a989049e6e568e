"""visionssm: state-space and linear-attention vision backbones on Triton sequence-mixer kernels, registered in timm.

``import visionssm`` registers every model with timm, so ``timm.create_model('gka_vision_T')`` works after it.
Importing needs no GPU and compiles no Triton kernel (the kernels load on first use).

The one exception is a process started as one of visionssm's commands (:data:`COMMANDS`: ``visionssm-train``,
``visionssm-benchmark``, ``python -m visionssm.tracking.train`` ...): a command reads its arguments before it loads
torch, timm and the models, so ``--help`` and a mistyped flag answer at once; it imports what it needs once the
arguments parse.
"""

import importlib
import sys
from pathlib import Path

from .version import __version__

__all__ = ["__version__", "kernels", "layers", "models"]

_SUBMODULES = ("kernels", "layers", "models")

#: visionssm's command lines, each module (run as ``python -m MODULE``) with its console script (None: none). The
#: package's one list: a process started as one of them skips the eager import below; pyproject.toml's
#: ``[project.scripts]`` must name the same scripts (tests/test_cli.py checks both).
COMMANDS = {
    "visionssm.train": "visionssm-train",
    "visionssm.benchmark": "visionssm-benchmark",
    "visionssm.benchmark.memory": None,
    "visionssm.data.synthetic": None,
    "visionssm.tracking.train": None,
    "visionssm.tracking.run": None,
    "visionssm.tracking.evaluate": None,
    "visionssm.tracking.data.synthetic": None,
}
#: A checkout's scripts that run one of the commands (path in the checkout -> module).
CHECKOUT_SCRIPTS = {"train_imagenet.py": "visionssm.train"}


def _started_as_command() -> bool:
    """Whether this process runs one of :data:`COMMANDS`: its console script, the checkout's script
    (:data:`CHECKOUT_SCRIPTS`), or ``-m MODULE`` (Python sets ``sys.argv[0]`` to ``-m`` while it imports the module's
    parents). Read from ``sys.orig_argv``, the process's own command line: a multiprocessing spawn child carries its
    parent's ``sys.argv`` but runs no command's parser, so it imports the models."""
    argv, orig_argv = sys.argv, getattr(sys, "orig_argv", [])
    if not argv or len(orig_argv) < len(argv):
        return False
    started = orig_argv[len(orig_argv) - len(argv)]  # the word Python ran: a script's path, or the module after -m
    if argv[0] == "-m":
        return started.removeprefix("-m") in COMMANDS
    if started != argv[0]:  # sys.argv was replaced after start-up (a spawn child's is its parent's)
        return False
    path = Path(started)
    if path.stem.removesuffix("-script") in COMMANDS.values():  # Windows names it NAME-script.py
        return True
    # only this checkout's file, not a user's script of the same name
    return path.name in CHECKOUT_SCRIPTS and path.resolve() == Path(__file__).resolve().parents[1] / path.name


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if not _started_as_command():
    from . import kernels, layers, models  # noqa: F401  (importing models registers them with timm)
