"""LayerNorm op: the Triton kernels against the float64 reference (forward and every gradient, odd row and channel
counts, no bias, 16-bit inputs, NaN-poisoned outputs), the layers' LayerNorm module against ``nn.LayerNorm``
(same state dict, same results, autocast's float32 semantics), bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from visionssm.kernels import dispatch, layer_norm
from visionssm.kernels.layer_norm import layer_norm_reference
from visionssm.kernels.tuning import launch_overrides
from visionssm.kernels.utils import assert_close
from visionssm.layers.common import LayerNorm


def make_problem(shape=(3, 7, 24), bias=True, dtype=torch.float32, device="cpu", seed=0):
    """(x, weight, bias): x off-centre and scaled, so that the mean and variance matter."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    C = shape[-1]
    x = (2.0 + 3.0 * rand(*shape)).to(device=device, dtype=dtype)
    weight = (1 + 0.3 * rand(C)).to(device=device, dtype=torch.float32)
    return x, weight, ((0.2 * rand(C)).to(device=device, dtype=torch.float32) if bias else None)


def run_with_grads(x, weight, bias, *, eps, double=False, seed=1):
    cast = (lambda t: t.detach().double()) if double else (lambda t: t.detach().clone())
    leaves = [cast(t).requires_grad_() for t in (x, weight, bias) if t is not None]
    y = layer_norm(leaves[0], leaves[1], leaves[2] if bias is not None else None, eps=eps)
    cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(y.device)
    (y.double() * cot).sum().backward()
    return y, [t.grad for t in leaves]


def check_against_reference(x, weight, bias, *, eps=1e-6, fwd_tol=1e-5, grad_tol=1e-4):
    with dispatch.backend("torch"):
        ref_y, ref_grads = run_with_grads(x.cpu(), weight.cpu(), None if bias is None else bias.cpu(), eps=eps,
                                          double=True)
    y, grads = run_with_grads(x, weight, bias, eps=eps)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, ref_y, tol=fwd_tol, name="y")
    for name, got, want in zip(("dx", "dweight", "dbias"), grads, ref_grads):
        assert_close(got, want, tol=grad_tol, name=name)


@pytest.mark.parametrize("shape", [(1, 1, 5), (2, 33, 24), (67, 192), (3, 130)], ids=str)
@pytest.mark.parametrize("bias", [True, False])
def test_triton_interpreter_forward_and_gradients(shape, bias, triton_interpreter, poison_outputs):
    check_against_reference(*make_problem(shape, bias=bias))


def test_triton_interpreter_low_precision(triton_interpreter, poison_outputs):
    check_against_reference(*make_problem((5, 9, 40), dtype=torch.bfloat16), fwd_tol=1e-2, grad_tol=2e-2)


def test_triton_interpreter_backward_programs_cover_the_rows(triton_interpreter, poison_outputs):
    # more rows than one backward program walks, a last program with a partial tile, the weight gradient summed over
    # the programs' partial rows
    x, weight, bias = make_problem((301, 24), seed=3)
    with launch_overrides("layer_norm", block_rows=4, bwd_programs_per_sm=3):
        check_against_reference(x, weight, bias)
    with torch.no_grad(), launch_overrides("layer_norm", reference=True):
        assert_close(layer_norm(x, weight, bias), layer_norm_reference(x, weight, bias, eps=1e-5), tol=0)
    with pytest.raises(ValueError, match="unknown launch setting"), launch_overrides("layer_norm", rows=4):
        layer_norm(x, weight, bias)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_triton_interpreter_out_dtype(out_dtype, triton_interpreter, poison_outputs):
    """A 16-bit result from float32 input: the float32 result rounded once (within one unit in the last place here:
    Triton's interpreter rounds toward zero, the GPU to nearest, as the cuda test checks), and every gradient through
    a gradient in that dtype equal to the float64 reference's for the same output gradient."""
    x, weight, bias = make_problem((2, 33, 24), seed=5)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    y = layer_norm(*leaves, eps=1e-6, out_dtype=out_dtype)
    assert y.dtype == out_dtype and y.shape == x.shape
    with torch.no_grad():
        y32 = layer_norm(x, weight, bias, eps=1e-6)
        assert ((y.float() - y32).abs() <= torch.finfo(out_dtype).eps * y32.abs()).all()
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(6)).to(out_dtype)
    grads = torch.autograd.grad(y, leaves, dy)
    wide = [t.double().requires_grad_() for t in (x, weight, bias)]
    with dispatch.backend("torch"):
        ref_y = layer_norm(*wide, eps=1e-6)
        assert layer_norm(x, weight, bias, eps=1e-6, out_dtype=out_dtype).dtype == out_dtype  # the reference path
    ref_grads = torch.autograd.grad(ref_y, wide, dy.double())
    assert_close(y, ref_y, tol=1e-2, name="y")
    for name, got, want in zip(("dx", "dweight", "dbias"), grads, ref_grads):
        assert got.dtype == torch.float32
        assert_close(got, want, tol=1e-4, name=name)


@pytest.mark.parametrize("elementwise_affine,bias", [(True, True), (True, False), (False, False)])
def test_module_is_nn_layernorm(elementwise_affine, bias):
    reference = nn.LayerNorm(24, eps=1e-6, elementwise_affine=elementwise_affine, bias=bias)
    module = LayerNorm(24, eps=1e-6, elementwise_affine=elementwise_affine, bias=bias)
    if elementwise_affine:
        with torch.no_grad():
            reference.weight.normal_()
            if bias:
                reference.bias.normal_()
    module.load_state_dict(reference.state_dict())
    assert module.state_dict().keys() == reference.state_dict().keys() and isinstance(module, nn.LayerNorm)
    x = make_problem((2, 5, 24))[0]
    torch.testing.assert_close(module(x), reference(x), rtol=1e-6, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU autocast's own rule for layer_norm, whatever it is
        got, want = module(x.bfloat16()), reference(x.bfloat16())
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_triton_interpreter_module_gradients_match_nn_layernorm(triton_interpreter, poison_outputs):
    reference = nn.LayerNorm(40, eps=1e-6)
    with torch.no_grad():
        reference.weight.normal_()
        reference.bias.normal_()
    module = LayerNorm(40, eps=1e-6)
    module.load_state_dict(reference.state_dict())
    x = make_problem((3, 11, 40), seed=4)[0]
    outs = []
    for m in (module, reference):
        leaf = x.clone().requires_grad_()
        y = m(leaf)
        y.square().sum().backward()
        outs.append((y, leaf.grad, m.weight.grad, m.bias.grad))
    for name, got, want in zip(("y", "dx", "dweight", "dbias"), *outs):
        assert_close(got, want, tol=1e-5, name=name)


@pytest.mark.cuda
@pytest.mark.parametrize("C", [192, 384, 65])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_backbone_shapes(C, dtype, poison_outputs):
    # the isotropic backbones' rows (batch 64 × 197 tokens), fp32 as autocast runs the norm, and bf16
    x, weight, bias = make_problem((64, 197, C), dtype=dtype, device="cuda", seed=C)
    tols = (1e-5, 1e-4) if dtype == torch.float32 else (1e-2, 2e-2)
    check_against_reference(x, weight, bias, fwd_tol=tols[0], grad_tol=tols[1])


@pytest.mark.cuda
def test_cuda_module_under_autocast_is_nn_layernorm():
    # CUDA autocast runs layer_norm in float32: the module takes the kernels with the same result dtype
    reference = nn.LayerNorm(192, eps=1e-6).cuda()
    with torch.no_grad():
        reference.weight.normal_()
        reference.bias.normal_()
    module = LayerNorm(192, eps=1e-6).cuda()
    module.load_state_dict(reference.state_dict())
    x = make_problem((8, 197, 192), device="cuda")[0].bfloat16()
    outs = []
    for m in (module, reference):
        leaf = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = m(leaf)
        y.square().sum().backward()
        outs.append((y, leaf.grad, m.weight.grad, m.bias.grad))
    assert outs[0][0].dtype == outs[1][0].dtype == torch.float32
    for name, got, want in zip(("y", "dx", "dweight", "dbias"), *outs):
        assert_close(got, want, tol=1e-2 if name == "dx" else 1e-4, name=name)


@pytest.mark.cuda
def test_cuda_module_autocast_output():
    """``autocast_output=True`` under CUDA autocast returns autocast's dtype, the float32 result rounded to nearest
    (all but a few elements exactly; the rest within one unit in the last place, or float32 rounding near zero: the
    two compiled kernels may sum a row in different orders), with or without a gradient; outside autocast float32 as
    before. A gradient arriving in that dtype gives the gradients of the float32 module fed the same values."""
    module = LayerNorm(192, eps=1e-6).cuda()
    with torch.no_grad():
        module.weight.normal_()
        module.bias.normal_()
    direct = LayerNorm(192, eps=1e-6, autocast_output=True).cuda()
    direct.load_state_dict(module.state_dict())
    assert "autocast_output=True" in repr(direct)
    x = make_problem((8, 197, 192), device="cuda")[0]
    with torch.no_grad():
        want = module(x)
        for dtype in (torch.bfloat16, torch.float16):
            with torch.autocast("cuda", dtype=dtype):
                got = direct(x)
            assert got.dtype == dtype
            off = (got.float() - want).abs() > torch.finfo(dtype).eps * want.abs() + 1e-5
            assert not off.any() and (got != want.to(dtype)).float().mean() < 1e-3
        assert direct(x).dtype == torch.float32
    dy = torch.randn(x.shape, device="cuda").bfloat16()
    outs = []
    for m in (direct, module):
        leaf = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = m(leaf)
        y.backward(dy.to(y.dtype))
        outs.append((y.dtype, leaf.grad, m.weight.grad, m.bias.grad))
    assert (outs[0][0], outs[1][0]) == (torch.bfloat16, torch.float32)
    for name, got, want in zip(("dx", "dweight", "dbias"), outs[0][1:], outs[1][1:]):
        assert got.dtype == torch.float32
        assert_close(got, want, tol=1e-5, name=name)


def test_bad_out_dtype_raises_naming_it():
    x, weight, bias = make_problem()
    for bad in (torch.int32, "bfloat16", [torch.float32]):
        with pytest.raises(TypeError, match="out_dtype"):
            layer_norm(x, weight, bias, out_dtype=bad)
    with pytest.raises(TypeError, match="autocast_output"):
        LayerNorm(8, autocast_output=1)


@pytest.mark.parametrize("name,error,args", [
    ("x", TypeError, lambda x, w, b: (x.int(), w, b)),
    ("weight", ValueError, lambda x, w, b: (x, w[:-1], b)),
    ("bias", ValueError, lambda x, w, b: (x, w, b[:-1])),
    ("bias", TypeError, lambda x, w, b: (x, w, b.int())),
    ("eps", ValueError, lambda x, w, b: (x, w, b, 0.0)),
], ids=lambda c: c if isinstance(c, str) else "")
def test_bad_input_raises_naming_the_argument(name, error, args):
    built = args(*make_problem())
    with pytest.raises(error, match=name):
        layer_norm(*built[:3], eps=built[3] if len(built) > 3 else 1e-5)
