"""Shared test set-up.

On a machine without a GPU the suite runs with ``TRITON_INTERPRET=1`` (so kernel tests can run the real Triton
kernels in Triton's interpreter) and ``VISIONSSM_KERNELS=torch`` (so model tests take the fast reference path);
kernel tests opt into the kernels with the ``triton_interpreter`` fixture. Both variables must be set before
visionssm's kernel modules are imported, hence at the top of this file.
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("VISIONSSM_KERNELS", "torch")

from visionssm.kernels import dispatch  # noqa: E402
from visionssm.kernels.utils import poison_outputs as _poison_outputs  # noqa: E402


def pytest_collection_modifyitems(config, items):
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
