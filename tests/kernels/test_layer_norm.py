"""LayerNorm op: the Triton kernels against the float64 reference (forward and every gradient, odd row and channel
counts, no bias, 16-bit inputs, NaN-poisoned outputs), alone and with the residual add before them
(``add_layer_norm``), the layers' LayerNorm module against ``nn.LayerNorm`` (same state dict, same results,
autocast's float32 semantics) and its fused add against the composition, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from visionssm.kernels import dispatch, layer_norm
from visionssm.kernels.layers.layer_norm import add_layer_norm, layer_norm_reference
from visionssm.kernels.tuning import launch_overrides
from visionssm.kernels.utils import assert_close
from visionssm.layers.common import LayerNorm, add_and_norm


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
    with launch_overrides("layer_norm", block_rows=4):
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


def check_add_against_reference(shape, x_dtype, residual_dtype, out_dtype, bias, uses, seed=0, tol=(1e-5, 1e-4),
                                device="cpu"):
    """add_layer_norm against the float64 composition, forward and every gradient, through the outputs in ``uses``
    ("y", "summed"): the gradients reaching y and the sum are rounded to their dtypes first, as autograd hands them
    on, so that the comparison measures the kernels alone."""
    x, weight, bias_ = make_problem(shape, bias=bias, device=device, seed=seed)
    residual = (1.0 + torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1))).to(device, residual_dtype)
    leaves = [t.clone().requires_grad_() for t in (x.to(x_dtype), residual, weight, bias_) if t is not None]
    y, summed = add_layer_norm(leaves[0], leaves[1], leaves[2], leaves[3] if bias else None, eps=1e-6,
                               out_dtype=out_dtype)
    assert summed.dtype == torch.promote_types(x_dtype, residual_dtype) and y.dtype == (out_dtype or summed.dtype)
    wide = [t.detach().double().requires_grad_() for t in leaves]
    with dispatch.backend("torch"):
        ref_y, ref_summed = add_layer_norm(*wide[:3], wide[3] if bias else None, eps=1e-6)
    gen = torch.Generator().manual_seed(seed + 2)
    cots = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device, t.dtype).double()
            for t in (y, summed)]
    outs = [(name, got, want, cot) for name, got, want, cot in zip(("y", "summed"), (y, summed), (ref_y, ref_summed),
                                                                    cots) if name in uses]
    grads = torch.autograd.grad(sum((got.double() * cot).sum() for _, got, _, cot in outs), leaves,
                                materialize_grads=True)
    ref_grads = torch.autograd.grad(sum((want * cot).sum() for _, _, want, cot in outs), wide, materialize_grads=True)
    low = lambda t: t.dtype in (torch.bfloat16, torch.float16)  # noqa: E731
    if low(summed):  # the kernels normalise the rounded sum, the float64 reference the exact one
        tol = (1e-2, 2e-2)
    assert_close(y, ref_y, tol=1e-2 if low(y) else tol[0], name="y")
    assert_close(summed, ref_summed, tol=1e-2 if low(summed) else 1e-6, name="summed")
    for name, got, leaf, want in zip(("dx", "dresidual", "dweight", "dbias"), grads, leaves, ref_grads):
        assert got.dtype == leaf.dtype, name
        assert_close(got, want, tol=2e-2 if low(got) else tol[1], name=name)


@pytest.mark.parametrize("x_dtype,residual_dtype,out_dtype", [
    (torch.float32, torch.float32, None),
    (torch.bfloat16, torch.float32, None),  # a block's branch onto its float32 residual stream
    (torch.bfloat16, torch.float32, torch.bfloat16),  # ... with the norm in autocast's dtype
    (torch.float32, torch.bfloat16, None),
    (torch.bfloat16, torch.bfloat16, None),
], ids=str)
@pytest.mark.parametrize("uses", [("y", "summed"), ("y",), ("summed",)], ids="+".join)
def test_triton_interpreter_add_layer_norm(x_dtype, residual_dtype, out_dtype, uses, triton_interpreter,
                                           poison_outputs):
    check_add_against_reference((2, 33, 24), x_dtype, residual_dtype, out_dtype, True, uses)


@pytest.mark.parametrize("shape", [(1, 1, 5), (67, 192), (3, 130)], ids=str)
def test_triton_interpreter_add_layer_norm_shapes(shape, triton_interpreter, poison_outputs):
    check_add_against_reference(shape, torch.bfloat16, torch.float32, None, False, ("y", "summed"), seed=7)
    with launch_overrides("layer_norm", block_rows=2):
        check_add_against_reference(shape, torch.float32, torch.float32, None, True, ("y", "summed"), seed=8)


def test_add_layer_norm_reference_path_is_the_composition():
    x, weight, bias = make_problem((2, 5, 24))
    residual = make_problem((2, 5, 24), seed=9)[0]
    y, summed = add_layer_norm(x.bfloat16(), residual, weight, bias, eps=1e-6, out_dtype=torch.bfloat16)
    want = residual + x.bfloat16()
    assert summed.dtype == torch.float32 and torch.equal(summed, want)
    assert y.dtype == torch.bfloat16 and torch.equal(y, layer_norm(want, weight, bias, eps=1e-6).bfloat16())


@pytest.mark.parametrize("name,error,args", [
    ("residual", TypeError, lambda x, r: (x, r.int())),
    ("residual", TypeError, lambda x, r: (x, r.tolist())),
    ("residual", ValueError, lambda x, r: (x, r[:, :1])),
    ("x", TypeError, lambda x, r: (x.int(), r)),
], ids=lambda c: c if isinstance(c, str) else "")
def test_add_layer_norm_bad_input_raises_naming_the_argument(name, error, args):
    x, weight, bias = make_problem()
    with pytest.raises(error, match=name):
        add_layer_norm(*args(x, x.clone()), weight, bias)


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


def test_module_forward_add_is_the_composition(triton_interpreter, poison_outputs):
    """LayerNorm.forward_add (the kernels' fused add) and add_and_norm equal the norm of the sum, forward and
    gradients; a hooked norm, or another norm class, is called on the sum."""
    module = LayerNorm(40, eps=1e-6)
    with torch.no_grad():
        module.weight.normal_()
        module.bias.normal_()
    x, residual = make_problem((3, 11, 40), seed=10)[0], make_problem((3, 11, 40), seed=11)[0]
    outs = []
    for fused in (True, False):
        leaves = [x.clone().requires_grad_(), residual.clone().requires_grad_()]
        if fused:
            y, summed = module.forward_add(*leaves)
        else:
            summed = leaves[1] + leaves[0]
            y = module(summed)
        (y.square().sum() + summed.sin().sum()).backward()
        outs.append((y, summed, leaves[0].grad, leaves[1].grad, module.weight.grad.clone()))
        module.weight.grad = module.bias.grad = None
    for name, got, want in zip(("y", "summed", "dx", "dresidual", "dweight"), *outs):
        assert_close(got, want, tol=1e-5, name=name)
    seen = []
    hook = module.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    y, summed = add_and_norm(module, x, residual)
    hook.remove()
    assert len(seen) == 1 and torch.equal(seen[0], summed)
    plain = nn.LayerNorm(40, eps=1e-6)
    y, summed = add_and_norm(plain, x, residual)
    assert torch.equal(summed, residual + x) and torch.equal(y, plain(residual + x))


@pytest.mark.cuda
@pytest.mark.parametrize("C", [192, 384])
def test_cuda_add_layer_norm_backbone_shapes(C, poison_outputs):
    # a block's bf16 branch onto its float32 residual stream (batch 64 × 197 tokens), the norm in fp32 and in bf16
    for out_dtype in (None, torch.bfloat16):
        check_add_against_reference((64, 197, C), torch.bfloat16, torch.float32, out_dtype, True, ("y", "summed"),
                                    seed=C, device="cuda")


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
