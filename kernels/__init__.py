"""visionssm.kernels: the sequence-mixer ops, each a Triton kernel with a PyTorch reference beside it.

``gka``, ``comba`` and ``selective_scan`` pick their implementation per call (see :mod:`.dispatch`): Triton for
CUDA tensors, the PyTorch reference for CPU tensors, Triton's interpreter for CPU tensors under
``TRITON_INTERPRET=1``, and ``VISIONSSM_KERNELS=triton|torch`` (or :func:`backend`) to force one.
Importing this package never imports Triton or needs a GPU: the Triton modules load on first use.
"""

import importlib

from .dispatch import backend, interpreter_enabled, select_backend, set_backend, triton_available

_OPS = {"gka": ".gka", "comba": ".comba", "selective_scan": ".selective_scan"}

__all__ = ["backend", "comba", "gka", "interpreter_enabled", "select_backend", "selective_scan", "set_backend",
           "triton_available"]


def __getattr__(name: str):
    # Ops load on first access, so importing visionssm.kernels stays cheap and Triton-free.
    if name in _OPS:
        op = getattr(importlib.import_module(_OPS[name], __name__), name)
        globals()[name] = op
        return op
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_OPS))
