"""visionssm.kernels: the sequence-mixer ops and the layer ops around them, Triton kernels with PyTorch references.

Two kinds of op, each a subpackage whose public function has the op's name: the mixers (``visionssm.kernels.<op>``:
``gka``, ``comba``, ``selective_scan``, ``ska``) and the layer ops around them (``visionssm.kernels.layers.<op>``:
``layer_norm``, ``gated_rmsnorm``, ``mixer_prologue``). Every function is bound here (``visionssm.kernels.gka``,
``visionssm.kernels.layer_norm``), found by walking the two folders, so a new op is a new folder. Each picks its
implementation per call (see :mod:`.dispatch`): Triton for CUDA tensors, the PyTorch reference for CPU tensors,
Triton's interpreter for CPU tensors under ``TRITON_INTERPRET=1``, and ``VISIONSSM_KERNELS=triton|torch`` (or
:func:`backend`) to force one. Importing this package never imports a Triton kernel or needs a GPU: each op loads
its Triton module on first use.
"""

import importlib
import pkgutil

from .dispatch import backend, interpreter_enabled, select_backend, set_backend, triton_available

#: The mixer ops: a sequence mixer's kernel each, one subpackage of this folder.
MIXER_OPS: list[str] = []
#: The layer ops (norms, the mixers' input stage): one subpackage of ``layers/`` each.
LAYER_OPS: list[str] = []


def _bind(package: str, names: list[str]) -> None:
    """Binds the public function of every op subpackage of ``package`` here, named after it."""
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if info.ispkg:
            op = getattr(importlib.import_module(f"{package}.{info.name}"), info.name, None)
            if callable(op):
                globals()[info.name] = op
                names.append(info.name)


# The functions are bound eagerly (not lazily): a lazy attribute would be shadowed by the subpackage of the same
# name as soon as anything imports e.g. visionssm.kernels.gka.naive.
_bind(__name__, MIXER_OPS)
_bind(f"{__name__}.layers", LAYER_OPS)
#: Every op: the mixers' and the layers'.
OPS: list[str] = MIXER_OPS + LAYER_OPS

__all__ = ["LAYER_OPS", "MIXER_OPS", "OPS", "backend", "interpreter_enabled", "select_backend", "set_backend",
           "triton_available", *OPS]
