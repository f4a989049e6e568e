"""Choose, per call, which implementation of a kernel op runs.

Rules, first match wins:

0. float64 inputs take the PyTorch reference path, which computes in float64 (the Triton kernels compute in fp32).
1. A backend forced in code (``set_backend`` / the ``backend(...)`` context manager).
2. The environment variable ``VISIONSSM_KERNELS=triton|torch`` (``auto`` or unset: no override).
3. Tracing for export (TorchScript, ONNX, FX) takes the PyTorch reference path: Triton kernels cannot be exported.
4. CUDA tensors run the Triton kernels.
5. CPU tensors run the Triton kernels when ``TRITON_INTERPRET=1`` (Triton's interpreter; this is how CI tests the
   real kernels on a CPU machine), and the PyTorch reference otherwise.

Forcing ``triton`` for CPU tensors without ``TRITON_INTERPRET=1`` is an error rather than a silent fallback, so a
test that thinks it exercises the kernels really does.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import threading
from collections.abc import Iterator

import torch

__all__ = ["BACKENDS", "backend", "exporting", "fx_tracing", "get_forced_backend", "interpreter_enabled",
           "op_backend", "select_backend", "set_backend", "triton_available"]

BACKENDS = ("triton", "torch")
BACKEND_ENV = "VISIONSSM_KERNELS"
_state = threading.local()


@functools.cache
def triton_available() -> bool:
    """True when the ``triton`` package can be imported (it is not installed on macOS or Windows)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """True when Triton kernels will run through Triton's CPU interpreter.

    Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, so it must be set before the kernel modules are
    first imported (visionssm imports them lazily, on the first call that needs them)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_name(name: str | None, source: str) -> str | None:
    if name is None:
        return None
    value = name.strip().lower()
    if value in ("", "auto"):
        return None
    if value not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS} or 'auto', got {name!r}")
    return value


def set_backend(name: str | None) -> None:
    """Force every op in this thread onto one backend (``'triton'`` or ``'torch'``); ``None`` restores automatic."""
    _state.forced = _check_name(name, "backend")


def get_forced_backend() -> str | None:
    """The backend forced in code or by ``VISIONSSM_KERNELS``, or ``None`` when dispatch is automatic."""
    forced = getattr(_state, "forced", None)
    if forced is not None:
        return forced
    return _check_name(os.environ.get(BACKEND_ENV), BACKEND_ENV)


@contextlib.contextmanager
def backend(name: str | None) -> Iterator[None]:
    """Context manager form of :func:`set_backend`; restores the previous choice on exit."""
    previous = getattr(_state, "forced", None)
    set_backend(name)
    try:
        yield
    finally:
        _state.forced = previous


def fx_tracing() -> bool:
    """True while FX traces symbolically (timm's feature extraction), where tensors are proxies."""
    # Newer torch splits symbolic tracing (export-hostile) from dynamo/export; older torch has one flag.
    symbolic = torch.fx._symbolic_trace
    is_symbolic_tracing = getattr(symbolic, "is_fx_symbolic_tracing", None) or getattr(symbolic, "is_fx_tracing", None)
    return bool(is_symbolic_tracing and is_symbolic_tracing())


def exporting() -> bool:
    """True while TorchScript, ONNX or FX symbolic tracing runs: those take the PyTorch reference path."""
    if torch.jit.is_scripting() or torch.jit.is_tracing():
        return True
    if torch.onnx.is_in_onnx_export():
        return True
    return fx_tracing()


def select_backend(*tensors: torch.Tensor | None) -> str:
    """Return ``'triton'`` or ``'torch'`` for an op called on ``tensors`` (``None`` entries are ignored)."""
    return _choose(tensors, exporting())


def op_backend(*tensors: torch.Tensor | None) -> str:
    """:func:`select_backend` for the kernels of a registered op (:mod:`.library`) and their fakes: without the export
    rule, since AOTAutograd traces a compiled graph with FX (the public functions send exports to the reference
    before any registered op is reached)."""
    return _choose(tensors, False)


def _choose(tensors, export: bool) -> str:
    present = [t for t in tensors if t is not None]
    on_cuda = any(t.is_cuda for t in present)
    forced = get_forced_backend()
    if forced == "torch" or any(t.dtype == torch.float64 for t in present):
        return "torch"
    if forced == "triton":
        if not triton_available():
            raise RuntimeError("the triton backend was forced but the 'triton' package is not installed")
        if not on_cuda and not interpreter_enabled():
            raise ValueError("the triton backend was forced for CPU tensors: set TRITON_INTERPRET=1 before importing "
                             "visionssm to run the Triton kernels in Triton's interpreter, or move the tensors to CUDA")
        return "triton"
    if export or not triton_available():
        return "torch"
    if on_cuda or interpreter_enabled():
        return "triton"
    return "torch"
