"""The dispatch rules of visionssm.kernels (see kernels/dispatch.py)."""

import pytest
import torch

from visionssm.kernels import dispatch


@pytest.fixture
def automatic(monkeypatch):
    """Automatic dispatch: no override in the environment, no interpreter."""
    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_cpu_tensors_take_the_reference_path(automatic):
    x = torch.zeros(2)
    assert dispatch.select_backend(x, None) == "torch"


def test_interpreter_runs_triton_on_cpu(automatic, monkeypatch):
    if not dispatch.triton_available():
        pytest.skip("triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.select_backend(torch.zeros(2)) == "triton"


@pytest.mark.parametrize("value, expected", [("torch", "torch"), ("TORCH", "torch"), ("auto", "torch"), ("", "torch")])
def test_environment_override(automatic, monkeypatch, value, expected):
    monkeypatch.setenv(dispatch.BACKEND_ENV, value)
    assert dispatch.select_backend(torch.zeros(2)) == expected


def test_environment_override_triton_with_interpreter(automatic, monkeypatch):
    if not dispatch.triton_available():
        pytest.skip("triton is not installed")
    monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.select_backend(torch.zeros(2)) == "triton"


def test_forcing_triton_on_cpu_without_interpreter_is_an_error(automatic, monkeypatch):
    if not dispatch.triton_available():
        pytest.skip("triton is not installed")
    monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        dispatch.select_backend(torch.zeros(2))


def test_float64_always_takes_the_reference_path(automatic, monkeypatch):
    # The kernels compute in fp32; float64 callers (references, gradient checks) get float64 math even when forced.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
    assert dispatch.select_backend(torch.zeros(2), torch.zeros(2, dtype=torch.float64)) == "torch"


def test_bad_override_names_the_variable(automatic, monkeypatch):
    monkeypatch.setenv(dispatch.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match=dispatch.BACKEND_ENV):
        dispatch.select_backend(torch.zeros(2))
    with pytest.raises(ValueError, match="backend"):
        dispatch.set_backend("fast")


def test_code_override_beats_environment_and_is_restored(automatic, monkeypatch):
    monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with dispatch.backend("torch"):
        assert dispatch.select_backend(torch.zeros(2)) == "torch"
    assert dispatch.get_forced_backend() == "triton"


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:FutureWarning")  # the TorchScript path is tested on purpose
def test_export_tracing_takes_the_reference_path(automatic, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(dispatch.select_backend(x))
            return x + 1

    torch.jit.trace(Probe(), torch.zeros(2), check_trace=False)
    assert seen and set(seen) == {"torch"}


def test_import_needs_no_gpu_and_compiles_no_kernels():
    """Importing visionssm with CUDA hidden works, and defines no Triton kernel (they load on first use)."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, visionssm, visionssm.kernels, timm\n"
        "from triton.runtime.jit import KernelInterface\n"
        "jitted = [f'{m}.{k}' for m, mod in list(sys.modules.items()) if m.startswith('visionssm')\n"
        "          for k, v in vars(mod).items() if isinstance(v, KernelInterface)]\n"
        "assert not jitted, jitted\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.cuda
def test_cuda_tensors_take_triton(automatic):
    assert dispatch.select_backend(torch.zeros(2, device="cuda")) == "triton"


def test_plan_cache_builds_once_and_forgets_plans_across_overrides():
    """Every op's launch-plan cache (kernels.tuning.PlanCache): one build per key; a launch override starting or
    ending empties it, so no plan built under an override outlives it and no earlier plan serves inside it."""
    from visionssm.kernels import tuning

    cache = tuning.PlanCache()
    builds = []

    def build(tag):
        builds.append(tag)
        return object()

    first = cache.get_or_build("key", lambda: build("first"))
    assert cache.get_or_build("key", lambda: build("again")) is first and builds == ["first"]
    with tuning.launch_overrides("comba", num_warps=2):
        inside = cache.get_or_build("key", lambda: build("inside"))
        assert inside is not first and len(cache) == 1
    after = cache.get_or_build("key", lambda: build("after"))
    assert after is not inside and builds == ["first", "inside", "after"]
