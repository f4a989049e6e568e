"""Gated per-head RMSNorm op: the reference against the layers' GatedRMSNorm module, the Triton kernels against the
reference in float64 (forward and every gradient, odd row counts, strided gates, NaN-poisoned outputs), bad input."""

from __future__ import annotations

import pytest
import torch

from visionssm.kernels import dispatch, gated_rmsnorm
from visionssm.kernels.gated_rmsnorm import gated_rmsnorm_reference
from visionssm.kernels.tuning import launch_overrides
from visionssm.kernels.utils import assert_close
from visionssm.layers.common import GatedRMSNorm


def make_problem(B=2, L=5, H=3, D=8, gate="plain", dtype=torch.float32, device="cpu", seed=0):
    """(o, gate source, weight): the gate source is None, a (B, L, H·D) tensor, or a wider tensor whose columns
    [3, 3 + H·D) are the gate (``gate="strided"``)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)  # noqa: E731
    o = rand(B, L, H, D)
    source = None if gate is None else rand(B, L, H * D + (9 if gate == "strided" else 0))
    weight = (1 + 0.3 * torch.randn(D, generator=gen, dtype=torch.float64)).to(device=device, dtype=torch.float32
                                                                                 if dtype != torch.float64 else dtype)
    return o, source, weight


def run_with_grads(o, source, weight, *, activation, eps=1e-5, double=False, seed=1):
    cast = (lambda t: t.detach().double()) if double else (lambda t: t.detach().clone())
    leaves = [cast(o).requires_grad_(), cast(weight).requires_grad_()]
    src = None if source is None else cast(source).requires_grad_()
    gate = None if src is None else (src[..., 3:3 + o.shape[2] * o.shape[3]] if src.shape[-1] != o.shape[2] * o.shape[3]
                                     else src)
    y = gated_rmsnorm(leaves[0], gate, leaves[1], activation=activation, eps=eps)
    cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(y.device)
    (y.double() * cot).sum().backward()
    return y, [leaves[0].grad, leaves[1].grad, None if src is None else src.grad]


def check_against_reference(o, source, weight, *, activation, fwd_tol=1e-5, grad_tol=1e-4):
    with dispatch.backend("torch"):
        ref_y, ref_grads = run_with_grads(o.cpu(), None if source is None else source.cpu(), weight.cpu(),
                                          activation=activation, double=True)
    y, grads = run_with_grads(o, source, weight, activation=activation)
    assert y.dtype == o.dtype and y.shape == ref_y.shape
    assert_close(y, ref_y, tol=fwd_tol, name="y")
    for name, got, want in zip(("do", "dweight", "dgate"), grads, ref_grads):
        if want is not None:
            assert got is not None, name
            assert_close(got, want, tol=grad_tol, name=name)


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_reference_equals_the_layers_module(activation):
    o, gate, weight = make_problem()
    module = GatedRMSNorm(8, activation=activation, eps=1e-5)
    with torch.no_grad():
        module.weight.copy_(weight)
    expected = module(o, gate.reshape(o.shape)).reshape(2, 5, 24)
    torch.testing.assert_close(gated_rmsnorm_reference(o, gate, weight, activation=activation, eps=1e-5), expected,
                               rtol=0, atol=0)


@pytest.mark.parametrize("L", [1, 7, 33])
@pytest.mark.parametrize("activation,gate", [("silu", "plain"), ("sigmoid", "strided"), ("silu", None)])
def test_triton_interpreter_forward_and_gradients(L, activation, gate, triton_interpreter, poison_outputs):
    o, source, weight = make_problem(L=L, gate=gate)
    check_against_reference(o, source, weight, activation=activation)


@pytest.mark.parametrize("H,D", [(5, 12), (4, 64), (1, 3)])
def test_triton_interpreter_head_shapes(H, D, triton_interpreter, poison_outputs):
    o, source, weight = make_problem(L=3, H=H, D=D, gate="strided", seed=2)
    check_against_reference(o, source, weight, activation="sigmoid")


def test_triton_interpreter_low_precision(triton_interpreter, poison_outputs):
    o, source, weight = make_problem(L=9, dtype=torch.bfloat16, gate="strided")
    check_against_reference(o, source, weight, activation="silu", fwd_tol=1e-2, grad_tol=2e-2)


def test_triton_interpreter_launch_variants_and_overrides(triton_interpreter, poison_outputs):
    o, source, weight = make_problem(L=9)
    with launch_overrides("gated_rmsnorm", block_rows=2, heads_per_program=1, num_warps=1):
        check_against_reference(o, source, weight, activation="silu")
    with torch.no_grad(), launch_overrides("gated_rmsnorm", reference=True):
        assert_close(gated_rmsnorm(o, source, weight), gated_rmsnorm_reference(o, source, weight, activation="silu",
                                                                              eps=1e-6), tol=0)
    with pytest.raises(ValueError, match="unknown launch setting"), launch_overrides("gated_rmsnorm", rows=4):
        gated_rmsnorm(o, source, weight)


@pytest.mark.cuda
@pytest.mark.parametrize("L,H,D,activation", [(196, 6, 64, "sigmoid"), (197, 3, 64, "sigmoid"),
                                              (196, 10, 16, "silu"), (49, 20, 16, "silu")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_vision_shapes(L, H, D, activation, dtype, poison_outputs):
    o, source, weight = make_problem(B=16, L=L, H=H, D=D, gate="strided", dtype=dtype, device="cuda")
    tols = (1e-5, 1e-4) if dtype == torch.float32 else (1e-2, 2e-2)
    check_against_reference(o, source, weight, activation=activation, fwd_tol=tols[0], grad_tol=tols[1])


@pytest.mark.parametrize("name,error,args", [
    ("o", ValueError, lambda o, g, w: (o[0], g, w)),
    ("o", TypeError, lambda o, g, w: (o.int(), g, w)),
    ("gate", ValueError, lambda o, g, w: (o, g[..., :-1], w)),
    ("weight", ValueError, lambda o, g, w: (o, g, w[:-1])),
    ("activation", ValueError, lambda o, g, w: (o, g, w, "relu")),
], ids=lambda c: c if isinstance(c, str) else "")
def test_bad_input_raises_naming_the_argument(name, error, args):
    o, gate, weight = make_problem()
    built = args(o, gate, weight)
    with pytest.raises(error, match=name):
        gated_rmsnorm(*built[:3], activation=built[3] if len(built) > 3 else "silu")
