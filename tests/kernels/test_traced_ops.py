"""The registered ops traced through under ``torch.compile`` (issue #43), checked on CPU with fake CUDA tensors.

On a GPU with static shapes, AOTAutograd runs a registered op's body on traced tensors and records each Triton launch
(``library._decompose_static``, ``utils.DirectLaunch``). :mod:`tools.traced_check` does that with fake CUDA tensors:
tiny models of every family traced whole (eval), and each op of their training step traced forward and backward.
A launch that runs instead of being recorded fails the trace (as SKA's operator launches did on the GPU, called with a
literal ``aligned=True``); an op left whole, a launch whose analysed writes name an input (Inductor clones it on every
call) or one tensor passed to two written arguments (the clones replace it in turn) is reported. Runs in a process of
its own: the kernels must be Triton's JIT functions, not this process's interpreter ones.
"""

from __future__ import annotations

import pytest
from test_inductor_writes import PRESETS, run_jit_script

_SCRIPT = """
import json, sys
from tools import traced_check
print("RESULT " + json.dumps(traced_check.check(json.loads(sys.argv[1]))))
"""


@pytest.fixture(scope="module")
def report() -> dict:
    pytest.importorskip("triton")
    import torch

    if not hasattr(torch.library, "wrap_triton"):
        pytest.skip("this torch cannot record Triton launches (torch.library.wrap_triton)")
    return run_jit_script(_SCRIPT, PRESETS)


def test_every_op_of_the_training_steps_is_traced_through(report):
    launched = {}
    for key, entry in report.items():
        for graph, count in entry["launches"].items():
            launched[f"{key}: {graph}"] = count
    assert all(launched.values()), [graph for graph, count in launched.items() if not count]
    traced = {graph.split()[2] for graph in launched if " train: " in graph}
    # (under torch.compile the models' norms are torch's: layer_norm and add_layer_norm are not called)
    for op in ("ska", "comba", "gka_causal", "selective_scan", "mixer_prologue", "gated_rmsnorm"):
        assert f"visionssm::{op}" in traced, f"{op} was not called: the presets no longer reach it"


def test_traced_launches_are_recorded_and_write_only_their_outputs(report):
    problems = [f"{key}: {problem}" for key, entry in report.items() for problem in entry["problems"]]
    assert not problems, "\n".join(problems)


def test_write_analysis_is_memoised_per_kernel_and_argument_key():
    """torch analyses every recorded launch's writes by building its kernel's IR (``utils._memoize_write_analysis``);
    launches that differ only in their traced tensors' sizes share one analysis, any other difference gets its own."""
    import types

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from visionssm.kernels import utils

    calls = []

    def analyse(kernel, kwargs, tma_descriptor_metadata):
        calls.append(kwargs)
        return ["out"]

    memoised = utils._memoized(analyse)
    jit, other = types.SimpleNamespace(), types.SimpleNamespace()

    def tuned(kernel, **config):  # what launch options make of a JIT function: a new one-config Autotuner per launch
        return types.SimpleNamespace(fn=kernel, configs=[types.SimpleNamespace(kwargs=config)])

    with FakeTensorMode():
        small, large = torch.empty(4, 8), torch.empty(64, 8)
        half = torch.empty(4, 8, dtype=torch.bfloat16)
    same = [(jit, {"x": small, "out": small, "n": 4}), (jit, {"x": large, "out": large, "n": 4}),
            (tuned(jit, BLOCK=16), {"x": small, "out": small, "n": 4}),
            (tuned(jit, BLOCK=16), {"x": large, "out": large, "n": 4})]
    for kernel, kwargs in same:
        assert memoised(kernel, kwargs, {}) == ["out"]
    assert len(calls) == 2  # the plain launch and the one with BLOCK=16
    different = [(other, {"x": small, "out": small, "n": 4}), (jit, {"x": half, "out": small, "n": 4}),
                 (jit, {"x": small, "out": small, "n": 5}), (jit, {"x": small, "out": small, "n": True}),
                 (tuned(jit, BLOCK=32), {"x": small, "out": small, "n": 4})]
    for kernel, kwargs in different:
        memoised(kernel, kwargs, {})
    assert len(calls) == 2 + len(different)
    real = torch.empty(4, 8)  # a real tensor's address specialises the IR: never memoised
    memoised(jit, {"x": real, "out": real, "n": 4}, {})
    memoised(jit, {"x": real, "out": real, "n": 4}, {})
    assert len(calls) == 4 + len(different)
    memoised(jit, {"x": small, "out": small, "n": 4}, {"x": ("stable", ([8, 8],))})  # TMA descriptors: not memoised
    assert len(calls) == 5 + len(different)
    for _ in range(2):  # nor an argument of another kind (it would be kept alive by the memo)
        memoised(jit, {"x": small, "out": small, "n": object()}, {})
    assert len(calls) == 7 + len(different)
