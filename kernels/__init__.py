"""visionssm.kernels: the sequence-mixer ops, each a Triton kernel with a PyTorch reference beside it.

Each op is a subpackage ``visionssm.kernels.<op>`` whose public function has the op's name (``gka``, ``comba``,
``selective_scan``, ...); the functions are bound here, found by walking the subpackages, so a new op is a new
folder. Each picks its implementation per call (see :mod:`.dispatch`): Triton for CUDA tensors, the PyTorch
reference for CPU tensors, Triton's interpreter for CPU tensors under ``TRITON_INTERPRET=1``, and
``VISIONSSM_KERNELS=triton|torch`` (or :func:`backend`) to force one. Importing this package never imports a Triton
kernel or needs a GPU: each op loads its Triton module on first use.
"""

import importlib
import pkgutil

from .dispatch import backend, interpreter_enabled, select_backend, set_backend, triton_available

#: The op names, one per kernel subpackage.
OPS: list[str] = []
# The functions are bound eagerly (not lazily): a lazy attribute would be shadowed by the subpackage of the same
# name as soon as anything imports e.g. visionssm.kernels.gka.naive.
for _info in pkgutil.iter_modules(__path__):
    if _info.ispkg:
        _op = getattr(importlib.import_module(f"{__name__}.{_info.name}"), _info.name, None)
        if callable(_op):
            globals()[_info.name] = _op
            OPS.append(_info.name)

__all__ = ["OPS", "backend", "interpreter_enabled", "select_backend", "set_backend", "triton_available", *OPS]
