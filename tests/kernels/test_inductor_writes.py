"""What torch's mutation analysis says our Triton kernels write (issue #43).

For ``torch.compile`` to trace through the registered ops' bodies and record their launches with
``torch.library.wrap_triton`` (Inductor then launches our kernels from its own code), Inductor clones, before every
launch, each tensor the analysis of that launch (``identify_mutated_tensors``, ``identify_accessed_tensors`` in newer
torch) takes as written; a weight among them fails compilation (a leaf that requires grad modified in place). The
analysis follows a store's address back through every argument of a helper call whose result it uses, so a helper that
takes input pointers must not hand back what addresses a store. This test runs tiny models' eager steps, and causal
SKA's forward and backward (no preset uses it), with every launch captured (:func:`tools.inductor_check.capture`,
Triton's JIT functions in a process of their own: the analysis reads their source, which the interpreter's kernels of
this process do not offer) and checks each launch's analysed writes against the arguments its kernel stores to (the
``WRITES`` of its kernel module).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_compile import TINY

ROOT = Path(__file__).resolve().parents[2]

# a tiny network of every family (tests/test_compile.py's, for its _T model): every block type, a few blocks
PRESETS = {f"{family}_T": preset for family, preset in TINY.items()}

# causal SKA, which no model preset uses, called directly: (R, V, dtype) with one R whose per-token blocks hold the
# whole chunk (BS == BT) and one whose blocks hold part of it
CAUSAL_SKA = [(16, 32, "float32"), (32, 16, "bfloat16")]

_SCRIPT = """
import json, sys
from tools import inductor_check as ic
import torch
import triton

triton.runtime.driver.set_active(ic._Driver())
presets = {name: (kwargs, side) for name, (kwargs, side) in json.loads(sys.argv[1]).items()}


def causal_ska(R, V, dtype):
    from visionssm import kernels

    q, k = (torch.randn(1, 19, 2, R, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 19, 2, V, dtype=dtype, requires_grad=True)
    kernels.ska(q, k, v, causal=True).float().sum().backward()


steps = [lambda R=R, V=V, d=d: causal_ska(R, V, getattr(torch, d)) for R, V, d in json.loads(sys.argv[2])]
found = []
for (name, key), (kernel, bound, _) in sorted(ic.capture(list(presets), presets, steps).items(), key=lambda i: i[0]):
    declared = ic.declared_writes(kernel)
    found.append([name, str(key), ic.analysed_writes(kernel, bound), None if declared is None else sorted(declared)])
print("RESULT " + json.dumps(found))
"""


def run_jit_script(script: str, *args) -> object:
    """The JSON that ``script`` prints after ``RESULT `` when run in a process of its own with Triton's JIT functions
    (no ``TRITON_INTERPRET``) and the kernels' default backend, each of ``args`` passed as JSON."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "VISIONSSM_KERNELS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-c", script, *map(json.dumps, args)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def _analysis_available() -> bool:
    try:
        from torch._higher_order_ops import triton_kernel_wrap
    except ImportError:
        return False
    return any(hasattr(triton_kernel_wrap, f) for f in ("identify_mutated_tensors", "identify_accessed_tensors"))


@pytest.fixture(scope="module")
def analysed() -> list:
    """[kernel name, constexprs, analysed writes or None, its WRITES entry or None] of every distinct launch of the
    presets' steps (tools.inductor_check is imported there only: it clears TRITON_INTERPRET for its process)."""
    if not _analysis_available():
        pytest.skip("this torch has no mutation analysis of user Triton kernels")
    return run_jit_script(_SCRIPT, PRESETS, CAUSAL_SKA)


def test_every_family_launches_its_kernels(analysed):
    names = {name for name, *_ in analysed}
    for kernel in ("selective_scan_fwd_kernel", "selective_scan_bwd_kernel", "direct_fwd_kernel", "direct_bwd_kernel",
                   "adjoint_grad_kernel", "comba_fwd_kernel", "comba_bwd_kernel", "ska_noncausal_operator_kernel",
                   "gated_rmsnorm_lowrank_bwd_kernel", "prologue_fwd_kernel", "prologue_bwd_kernel",
                   "ska_causal_state_kernel", "ska_causal_fwd_kernel", "ska_causal_bwd_token_kernel",
                   "ska_causal_bwd_walk_kernel"):
        assert kernel in names, f"{kernel} was not launched: the presets no longer reach it"
    blocks = {dict(ast.literal_eval(key))["BS"] for name, key, *_ in analysed if name == "ska_causal_fwd_kernel"}
    assert len(blocks) == 2, f"the causal SKA calls reach one per-token block size only: {blocks}"


def test_analysis_names_only_what_each_kernel_writes(analysed):
    bad = []
    for name, key, written, declared in analysed:
        if written is None:
            bad.append(f"{name} {key}: the analysis failed (every tensor argument taken as written)")
        elif declared is None:
            bad.append(f"{name}: no entry in its kernel module's WRITES (analysed writes {written})")
        elif set(written) - set(declared):
            bad.append(f"{name} {key}: {sorted(set(written) - set(declared))} taken as written")
    assert not bad, "\n".join(bad)


_COMPILE_TIMES = """
import json
from tools import compile_times, inductor_check as ic
import torch
import triton

triton.runtime.driver.set_active(ic._Driver())


def step():
    from visionssm.kernels import layer_norm

    x = torch.randn(3, 40, requires_grad=True)
    w, b = torch.randn(40, requires_grad=True), torch.randn(40, requires_grad=True)
    layer_norm(x, w, b).sum().backward()


rows = compile_times.compile_all(ic.capture([], steps=[step]))
print("RESULT " + json.dumps(rows))
"""


def test_compile_times_compiles_every_captured_launch_for_hopper():
    """tools.compile_times on one op's forward and backward: each distinct launch compiled to a cubin for sm_90a
    (a failure to compile fails the script), with its seconds, longest first."""
    rows = run_jit_script(_COMPILE_TIMES)
    names = [name for _, name in rows]
    assert len(names) >= 2 and any("fwd" in n for n in names) and any("bwd" in n for n in names), names
    seconds = [s for s, _ in rows]
    assert all(s > 0 for s in seconds) and seconds == sorted(seconds, reverse=True)
