"""Shared test set-up.

On a machine without a GPU the suite runs with ``TRITON_INTERPRET=1`` (so kernel tests can run the real Triton
kernels in Triton's interpreter) and ``VISIONSSM_KERNELS=torch`` (so model tests take the fast reference path);
kernel tests opt into the kernels with the ``triton_interpreter`` fixture. Both variables must be set before
visionssm's kernel modules are imported, hence at the top of this file.

The suite runs in parallel (pytest-xdist, ``-n auto --dist loadgroup`` in pyproject.toml): one worker per CPU core
on a machine without a GPU, each with one torch thread per core it has; on a GPU machine it runs in one process, so
the CUDA tests do not share the GPU. Tests that share a module- or class-scoped fixture run on one worker, so the
fixture is built once. ``-n 0`` (or ``--pdb``) runs everything in this process.
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("VISIONSSM_KERNELS", "torch")

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # each worker gets its share of the cores, or the workers' torch thread pools fight over them
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from visionssm.kernels import dispatch  # noqa: E402
from visionssm.kernels.utils import poison_outputs as _poison_outputs  # noqa: E402


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: 0 (this process) on a GPU machine; otherwise pytest-xdist's own count (one per core, or
    ``PYTEST_XDIST_AUTO_NUM_WORKERS``)."""
    if torch.cuda.is_available() and "PYTEST_XDIST_AUTO_NUM_WORKERS" not in os.environ:
        return 0
    return None


def _shared_fixture_group(item) -> str | None:
    """The file of a test that uses a module- or class-scoped fixture: its tests are sent to one worker together."""
    fixture_info = getattr(item, "_fixtureinfo", None)
    if fixture_info is None:
        return None
    for definitions in fixture_info.name2fixturedefs.values():
        if definitions and definitions[-1].scope in ("module", "class"):
            return item.nodeid.split("::")[0]
    return None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = _shared_fixture_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the device machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


@pytest.fixture(autouse=True)
def seed():
    """Every test starts from the same random state, so a failure reproduces."""
    random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture
def poison_outputs():
    """Kernel outputs are allocated NaN-filled, so an element the kernel never writes fails the comparison."""
    with _poison_outputs(True):
        yield


@pytest.fixture
def triton_interpreter():
    """Run the op under test through the Triton kernels in Triton's CPU interpreter."""
    if not dispatch.triton_available():
        pytest.skip("triton is not installed")
    if not dispatch.interpreter_enabled():
        pytest.skip("TRITON_INTERPRET=1 is not set (GPU machine: the cuda-marked tests cover the kernels)")
    with dispatch.backend("triton"):
        yield


@pytest.fixture
def reference_path():
    """Run the op under test through the PyTorch reference path."""
    with dispatch.backend("torch"):
        yield
