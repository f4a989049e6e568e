"""The direct relaunch of compiled Triton kernels (visionssm.kernels.utils.DirectLaunch): launch hooks (profilers)
still see every launch."""

import pytest
import torch

from visionssm.kernels import utils


class _Chain:
    """Triton's hook chain as the launch path sees it: a list of hooks."""

    def __init__(self, *calls):
        self.calls = list(calls)


class _Runtime:
    def __init__(self, enter, leave):
        self.launch_enter_hook, self.launch_exit_hook = enter, leave


@pytest.mark.parametrize("enter, leave, installed", [
    (_Chain(), _Chain(), False),
    (_Chain(print), _Chain(), True),
    (_Chain(), _Chain(print), True),
    (None, None, False),  # older Triton: a hook or None
    (print, None, True),
    (None, print, True),
])
def test_launch_hooks_installed(enter, leave, installed):
    assert utils.launch_hooks_installed(_Runtime(enter, leave)) is installed


def test_launch_hooks_installed_reads_tritons_own_knobs():
    knobs = pytest.importorskip("triton.knobs")
    runtime = knobs.runtime
    assert not utils.launch_hooks_installed(runtime)

    def hook(metadata):
        return None

    runtime.launch_enter_hook.add(hook)
    try:
        assert utils.launch_hooks_installed(runtime)
    finally:
        runtime.launch_enter_hook.remove(hook)
    assert not utils.launch_hooks_installed(runtime)


@pytest.mark.cuda
def test_cuda_direct_launches_and_launch_hooks():
    """After its first call an op's kernels are relaunched directly, with the same results; a launch hook installed
    later (as a profiler does) sees those launches, and stops seeing them once removed."""
    from triton import knobs

    from visionssm import kernels
    from visionssm.kernels.layers.layer_norm import launch

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(37, 192, device="cuda", generator=gen)
    weight, bias = torch.randn(192, device="cuda", generator=gen), torch.randn(192, device="cuda", generator=gen)
    first = kernels.layer_norm(x, weight, bias, eps=1e-6)
    plan = next(p for key, p in launch._PLANS.items() if key[0] == x.shape)
    assert plan.fwd.runner is not None and utils.DIRECT_LAUNCH
    torch.testing.assert_close(kernels.layer_norm(x, weight, bias, eps=1e-6), first, rtol=0, atol=0)

    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        torch.testing.assert_close(kernels.layer_norm(x, weight, bias, eps=1e-6), first, rtol=0, atol=0)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 1 and "layer_norm" in seen[0]
    torch.testing.assert_close(kernels.layer_norm(x, weight, bias, eps=1e-6), first, rtol=0, atol=0)
    assert len(seen) == 1


def test_traced_tensors_with_a_literal_aligned_flag_name_the_kernel(monkeypatch):
    """A direct launch handed traced tensors with ``aligned`` not from aligned16 (SKA's operator launches passed
    True, issue #43) raises naming the kernel, and leaves direct launches on for every other plan."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def runner(*args):
        raise TypeError("Pointer argument must be either uint64 or have data_ptr method")  # Triton's launcher

    kernel = type("Kernel", (), {"fn": test_traced_tensors_with_a_literal_aligned_flag_name_the_kernel,
                                 "arg_names": ["x", "n"]})()
    launch = utils.DirectLaunch(kernel, (1,), (3,), {}, {})
    launch.runner = runner
    monkeypatch.setattr(utils, "_LAUNCH_CONTEXT", [None])  # the runner itself is called
    monkeypatch.setattr(utils, "DIRECT_LAUNCH", True)
    with FakeTensorMode():
        x = torch.empty(3)
    with pytest.raises(TypeError, match="test_traced_tensors_with_a_literal_aligned_flag_name_the_kernel: traced "
                                        "tensors launched with aligned=True"):
        launch(True, x)
    assert utils.DIRECT_LAUNCH
