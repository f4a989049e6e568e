"""visionssm: state-space and linear-attention vision backbones on Triton sequence-mixer kernels, registered in timm.

``import visionssm`` registers every model with timm, so ``timm.create_model('gka_vision_T')`` works after it.
Importing needs no GPU and compiles no Triton kernel (the kernels load on first use).

The one exception is a process started as the ``visionssm-train`` command (or ``python -m visionssm.train``): the
command reads its arguments before it loads torch, timm and the models, so ``--help`` and a mistyped flag answer at
once; it imports the models itself once the arguments parse.
"""

import importlib
import sys
from pathlib import Path

from .version import __version__

__all__ = ["__version__", "kernels", "layers", "models"]

_SUBMODULES = ("kernels", "layers", "models")


def _started_as_command() -> bool:
    """Whether this process runs ``visionssm-train``: its console script, or ``-m visionssm.train`` (Python sets
    ``sys.argv[0]`` to ``-m`` while it imports the module's parents)."""
    if Path(sys.argv[0] if sys.argv else "").stem.removesuffix("-script") == "visionssm-train":
        return True
    if sys.argv[:1] == ["-m"] and len(sys.orig_argv) > len(sys.argv):
        module = sys.orig_argv[len(sys.orig_argv) - len(sys.argv)]  # the word after -m, before the arguments
        return module in ("visionssm.train", "-mvisionssm.train")
    return False


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if not _started_as_command():
    from . import kernels, layers, models  # noqa: F401  (importing models registers them with timm)
