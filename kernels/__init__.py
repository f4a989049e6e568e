"""visionssm.kernels: the sequence-mixer ops, each a Triton kernel with a PyTorch reference beside it.

``gka``, ``comba`` and ``selective_scan`` pick their implementation per call (see :mod:`.dispatch`): Triton for
CUDA tensors, the PyTorch reference for CPU tensors, Triton's interpreter for CPU tensors under
``TRITON_INTERPRET=1``, and ``VISIONSSM_KERNELS=triton|torch`` (or :func:`backend`) to force one.
Importing this package never imports a Triton kernel or needs a GPU: each op loads its Triton module on first use.
"""

# The functions are bound here eagerly (not lazily): a lazy attribute would be shadowed by the subpackage of the
# same name as soon as anything imports e.g. visionssm.kernels.gka.naive.
from .comba import comba
from .dispatch import backend, interpreter_enabled, select_backend, set_backend, triton_available
from .gka import gka
from .selective_scan import selective_scan

__all__ = ["backend", "comba", "gka", "interpreter_enabled", "select_backend", "selective_scan", "set_backend",
           "triton_available"]
