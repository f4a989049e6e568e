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


def _group_suffix(item) -> str | None:
    """The ``@group`` suffix pytest-xdist's loadgroup gives a node id (from its xdist_group marks), or None."""
    names = {str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
             for mark in item.iter_markers("xdist_group")}
    return f"@{'_'.join(sorted(names))}" if names else None


def _add_group_suffix(item, suffix: str) -> None:
    """What pytest-xdist's worker does to send a group's tests to one worker: it sets ``item._nodeid``, which
    pytest >= 9.2 no longer reads (the id lives in ``item._id``), so without this the groups are silently ignored."""
    nodeid = item.nodeid + suffix
    if hasattr(item, "_id"):
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(nodeid)
    else:
        item._nodeid = nodeid


@pytest.hookimpl(wrapper=True)  # around pytest-xdist's hook: marks before it reads them, its node ids checked after
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = _shared_fixture_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    result = yield
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        for item in items:
            suffix = _group_suffix(item)
            if suffix is not None and not item.nodeid.endswith(suffix):
                _add_group_suffix(item, suffix)
    if torch.cuda.is_available():
        return result
    skip_cuda = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the device machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)
    return result


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
