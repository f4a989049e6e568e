"""The registration machinery of the ops (visionssm.kernels.library): every public op is a registered custom op with
a backward, the PyTorch path's backward is the reference's, outputs never alias inputs, tracing is detected."""

from __future__ import annotations

import pytest
import torch

import visionssm.kernels as kernels
from visionssm.kernels import dispatch, library


@pytest.mark.parametrize("name", kernels.OPS)
def test_every_public_op_is_a_registered_op_with_a_backward(name):
    """``visionssm::<name>``, or one registered op per variant (``visionssm::<name>_<variant>``), each with its
    backward op."""
    namespace = getattr(torch.ops, library.NAMESPACE)
    registered = [op for op in library.REGISTERED if op == name or op.startswith(f"{name}_")]
    assert registered, f"visionssm.kernels.{name} has no registered op"
    for op in registered:
        assert getattr(namespace, op).default is library.REGISTERED[op]
        assert hasattr(namespace, f"{op}_backward")


def test_reference_backward_equals_autograd_and_skips_absent_inputs():
    def reference(a, b, c, power):
        out = a * b.sin() if c is None else a * b.sin() + c
        return out.pow(power), a.exp()

    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    grads = [torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)]
    found = library.reference_backward(reference, grads, [a, b, None], 2)
    leaves = [a.clone().requires_grad_(), b.clone().requires_grad_()]
    expected = torch.autograd.grad(reference(*leaves, None, 2), leaves, grads)
    assert len(found) == 2
    for f, e in zip(found, expected):
        torch.testing.assert_close(f, e)


def test_an_input_the_outputs_do_not_depend_on_gets_a_zero_gradient():
    a, b = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    found = library.reference_backward(lambda a, b: a * 3, [torch.ones(5, dtype=torch.float64)], [a, b])
    torch.testing.assert_close(found[0], torch.full_like(a, 3.0))
    torch.testing.assert_close(found[1], torch.zeros_like(b))


def test_outputs_sharing_memory_with_inputs_or_each_other_are_copied():
    x = torch.randn(4, 3)
    y = torch.randn(4, 3)
    out = library._fresh([x, y, y, y.t()], [x])
    assert out[0] is not x and torch.equal(out[0], x)
    assert out[1] is y
    storages = {t.untyped_storage().data_ptr() for t in out}
    assert len(storages) == 4 and all(t.is_contiguous() for t in out)


def test_tracing_is_true_under_torch_compile_only():
    def fn(x):
        return x + 1 if library.tracing() else x - 1

    x = torch.zeros(2)
    assert torch.equal(fn(x), x - 1)
    assert torch.equal(torch.compile(fn, fullgraph=True, backend="eager")(x), x + 1)


def test_registered_ops_choose_their_kernels_without_the_export_rule(monkeypatch):
    """Inductor (and torch 2.11's AOTAutograd) run the fakes while FX traces, which select_backend's export rule would
    send to the reference: the fakes would then promise the reference's (empty) saved tensors and the compiled
    backward would recompute the reference. The registered ops ask op_backend, which has no export rule."""
    x = torch.randn(3, device="cuda" if torch.cuda.is_available() else "cpu")
    if not dispatch.triton_available() or not (x.is_cuda or dispatch.interpreter_enabled()):
        pytest.skip("the Triton kernels cannot run here")
    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)
    monkeypatch.setattr(dispatch, "fx_tracing", lambda: True)
    with dispatch.backend(None):
        assert dispatch.select_backend(x) == "torch"
        assert dispatch.op_backend(x) == "triton"
        assert dispatch.op_backend(x.double()) == "torch"


def test_launch_plans_share_one_placeholder_per_device():
    """Plans keep no word of their own for unused pointer arguments: one per device, allocated once (on a CUDA device
    outside any CUDA-graph pool, which the cuda-marked reduce-overhead tests exercise)."""
    from visionssm.kernels.utils import placeholder

    word = placeholder(torch.device("cpu"))
    assert word is placeholder(torch.device("cpu"))
    assert word.shape == (1,) and word.dtype == torch.float32


def test_outputs_not_starting_16_byte_aligned_are_copied():
    """Inductor takes a custom op's outputs as aligned as their fakes (offset 0) and asserts 16-byte alignment when the
    compiled graph runs: a row of a shared buffer (mixer_prologue's per-head gradients, 3 heads) must be copied."""
    rows = torch.randn(6, 3)
    out = library._fresh([rows[2], rows[4:], torch.empty(0)[0:0]], [])
    assert all(t.storage_offset() * t.element_size() % 16 == 0 for t in out)
    assert torch.equal(out[0], rows[2]) and torch.equal(out[1], rows[4:])
    aligned = torch.randn(2, 4)
    assert library._fresh([aligned[1]], [])[0].data_ptr() == aligned[1].data_ptr()
