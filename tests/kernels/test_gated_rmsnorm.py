"""Gated per-head RMSNorm op: the reference against the layers' GatedRMSNorm module, the Triton kernels against the
reference in float64 (forward and every gradient, odd row counts, strided gates, NaN-poisoned outputs), bad input;
the same for the low-rank gate (up-projected inside the op)."""

from __future__ import annotations

import pytest
import torch

from visionssm.kernels import dispatch, gated_rmsnorm
from visionssm.kernels.layers.gated_rmsnorm import gated_rmsnorm_reference
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
    with launch_overrides("gated_rmsnorm", block_rows=2, heads_per_program=1):
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


# ---------------------------------------------------------------------------------------------------------------
# Low-rank gate: gate = gate_low @ gate_weightᵀ + gate_bias inside the op


def make_low_rank_problem(B=2, L=5, H=3, D=8, R=16, *, bias=True, strided=True, dtype=torch.float32, device="cpu",
                          seed=0):
    """(o, gate source, gate_weight, gate_bias, weight): the source is (B, L, R) or, ``strided``, a wider tensor
    whose columns [3, 3 + R) are the gate (3 elements in, so its pointer is not 16-byte aligned)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    params = torch.float64 if dtype == torch.float64 else torch.float32
    o = rand(B, L, H, D).to(device=device, dtype=dtype)
    source = rand(B, L, R + (9 if strided else 0)).to(device=device, dtype=dtype)
    gate_weight = (rand(H * D, R) / R ** 0.5).to(device=device, dtype=params)
    gate_bias = (0.5 * rand(H * D)).to(device=device, dtype=params) if bias else None
    weight = (1 + 0.3 * rand(D)).to(device=device, dtype=params)
    return o, source, gate_weight, gate_bias, weight


def run_low_rank_with_grads(problem, *, activation, eps=1e-5, double=False, seed=1):
    """Output and the gradients of (o, gate source, gate_weight, gate_bias, weight) under a random cotangent."""
    cast = (lambda t: t.detach().double()) if double else (lambda t: t.detach().clone())
    leaves = [None if t is None else cast(t).requires_grad_() for t in problem]
    o, source, gate_weight, gate_bias, weight = leaves
    R = gate_weight.shape[1]
    gate = source[..., 3:3 + R] if source.shape[-1] != R else source
    y = gated_rmsnorm(o, gate, weight, activation=activation, eps=eps, gate_weight=gate_weight, gate_bias=gate_bias)
    cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(y.device)
    (y.double() * cot).sum().backward()
    return y, [None if t is None else t.grad for t in leaves]


def check_low_rank_against_reference(problem, *, activation, fwd_tol=1e-5, grad_tol=1e-4):
    with dispatch.backend("torch"):
        ref_y, ref_grads = run_low_rank_with_grads([None if t is None else t.cpu() for t in problem],
                                                   activation=activation, double=True)
    y, grads = run_low_rank_with_grads(problem, activation=activation)
    assert y.dtype == problem[0].dtype and y.shape == ref_y.shape
    assert_close(y, ref_y, tol=fwd_tol, name="y")
    for name, got, want in zip(("do", "dgate", "dgate_weight", "dgate_bias", "dweight"), grads, ref_grads):
        if want is None:
            assert got is None, name
            continue
        assert got is not None, name
        assert_close(got, want, tol=grad_tol, name=name)


def test_low_rank_reference_is_the_linear_then_the_op():
    """The reference's low-rank gate is exactly ``F.linear`` of the gate (float32), then the full-gate op."""
    o, source, gate_weight, gate_bias, weight = make_low_rank_problem()
    gate = source[..., 3:19]
    full = torch.nn.functional.linear(gate, gate_weight, gate_bias)
    want = gated_rmsnorm_reference(o, full, weight, activation="sigmoid", eps=1e-5)
    got = gated_rmsnorm_reference(o, gate, weight, activation="sigmoid", eps=1e-5, gate_weight=gate_weight,
                                  gate_bias=gate_bias)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the projection stays float32 under autocast
        torch.testing.assert_close(gated_rmsnorm_reference(o, gate, weight, activation="sigmoid", eps=1e-5,
                                                           gate_weight=gate_weight, gate_bias=gate_bias), want,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("L", [5, 1])
@pytest.mark.parametrize("R,activation,bias,strided", [(16, "sigmoid", True, True), (8, "silu", False, False),
                                                       (8, "sigmoid", True, True), (16, "silu", True, False)])
def test_triton_interpreter_low_rank_forward_and_gradients(L, R, activation, bias, strided, triton_interpreter,
                                                           poison_outputs):
    problem = make_low_rank_problem(L=L, R=R, bias=bias, strided=strided, seed=L + R)
    check_low_rank_against_reference(problem, activation=activation)


def test_triton_interpreter_low_rank_launch_variants(triton_interpreter, poison_outputs):
    """Backward head groups (the gate gradient summed over groups), several row tiles per backward program, more
    than one forward head program, odd head width, rank 5 (padded to 16), 32 rows per tile."""
    problem = make_low_rank_problem(B=3, L=11, H=3, D=12, R=5, seed=3)
    with launch_overrides("gated_rmsnorm", heads_per_program_bwd=1, programs_bwd=2, heads_per_program=2):
        check_low_rank_against_reference(problem, activation="sigmoid")
    with launch_overrides("gated_rmsnorm", block_rows=32, heads_per_program_bwd=2, programs_bwd=1):
        check_low_rank_against_reference(problem, activation="silu")
    for setting in ({"block_rows": 8}, {"heads_per_program": 8}, {"heads_per_program_bwd": 3}):
        name = next(iter(setting))
        with pytest.raises(ValueError, match=name), launch_overrides("gated_rmsnorm", **setting):
            check_low_rank_against_reference(problem, activation="silu")


def test_triton_interpreter_low_rank_beyond_the_kernels(triton_interpreter, poison_outputs):
    """A rank too wide for the kernels' registers takes the projection in PyTorch, then the full-gate kernels."""
    problem = make_low_rank_problem(L=3, H=1, D=64, R=80, seed=4)
    check_low_rank_against_reference(problem, activation="sigmoid")


def test_triton_interpreter_low_rank_low_precision(triton_interpreter, poison_outputs):
    problem = make_low_rank_problem(L=9, dtype=torch.bfloat16, seed=5)
    check_low_rank_against_reference(problem, activation="sigmoid", fwd_tol=1e-2, grad_tol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("H,R", [(3, 16), (6, 32), (3, 8)], ids=["comba_vision_T", "comba_vision_S", "rank8"])
@pytest.mark.parametrize("L", [196, 197])
def test_cuda_low_rank_model_shapes(H, R, L, poison_outputs):
    """comba_vision_T/S's output gate in bf16 (the gate a column slice of a wider tensor) against float64; float32
    too, where the kernels' products are exact float32."""
    for dtype, tols in ((torch.bfloat16, (1e-2, 2e-2)), (torch.float32, (1e-5, 1e-4))):
        problem = make_low_rank_problem(B=4, L=L, H=H, D=64, R=R, dtype=dtype, device="cuda", seed=H + R)
        check_low_rank_against_reference(problem, activation="sigmoid", fwd_tol=tols[0], grad_tol=tols[1])


_BAD = {"none": lambda t: None, "narrow": lambda t: t[..., :-1], "short": lambda t: t[:-1], "int": lambda t: t.int(),
        "meta": lambda t: t.to("meta")}


@pytest.mark.parametrize("name,error,key,how", [
    ("gate_bias", ValueError, "gate_weight", "none"),
    ("gate", ValueError, "gate", "none"),
    ("gate", ValueError, "gate", "narrow"),
    ("gate_weight", ValueError, "gate_weight", "short"),
    ("gate_weight", TypeError, "gate_weight", "int"),
    ("gate_weight", ValueError, "gate_weight", "meta"),
    ("gate_bias", ValueError, "gate_bias", "short"),
    ("gate_bias", TypeError, "gate_bias", "int"),
    ("gate_bias", ValueError, "gate_bias", "meta"),
])
def test_low_rank_bad_input_raises_naming_the_argument(name, error, key, how):
    o, source, gate_weight, gate_bias, weight = make_low_rank_problem(strided=False)
    args = {"gate": source, "gate_weight": gate_weight, "gate_bias": gate_bias}
    args[key] = _BAD[how](args[key])
    with pytest.raises(error, match=name):
        gated_rmsnorm(o, args["gate"], weight, activation="sigmoid", gate_weight=args["gate_weight"],
                      gate_bias=args["gate_bias"])


# ---------------------------------------------------------------------------------------------------------------
# The registered op (torch.compile / torch.export take it): opcheck on both paths, compiled against eager

_VARIANTS = {  # full-width gate ("plain", "strided": a column slice, None) or low-rank (rank, bias, a column slice)
    "plain": {"gate": "plain"}, "strided": {"gate": "strided"}, "no_gate": {"gate": None},
    "low_rank": {"R": 16, "bias": True, "strided": True}, "low_rank_no_bias": {"R": 5, "bias": False, "strided": False},
    "low_rank_beyond_the_kernels": {"H": 1, "D": 64, "R": 80, "bias": True, "strided": True},
}


def _op_args(variant, L, requires_grad):
    """The registered op's arguments (o, gate, weight, gate_weight, gate_bias, activation, eps)."""
    kw = _VARIANTS[variant]
    if "R" in kw:
        o, source, gate_weight, gate_bias, weight = make_low_rank_problem(L=L, seed=L, **kw)
        R = gate_weight.shape[1]
        gate = source[..., 3:3 + R] if kw["strided"] else source
        tensors, activation = [o, gate, weight, gate_weight, gate_bias], "sigmoid"
    else:
        o, source, weight = make_problem(L=L, seed=L, **kw)
        gate = None if source is None else source[..., 3:3 + o.shape[2] * o.shape[3]] if kw["gate"] == "strided" \
            else source
        tensors, activation = [o, gate, weight, None, None], "silu"
    if requires_grad:
        tensors = [None if t is None else t.detach().requires_grad_() for t in tensors]
    return (*tensors, activation, 1e-5)


@pytest.mark.parametrize("path", ["reference_path", "triton_interpreter"])
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_registered_op_opcheck(variant, requires_grad, path, request, poison_outputs):
    from visionssm.kernels.layers.gated_rmsnorm.custom_op import gated_rmsnorm_op

    request.getfixturevalue(path)
    torch.library.opcheck(gated_rmsnorm_op, _op_args(variant, 3, requires_grad))


def _sliced(o, source, weight, gate_weight, gate_bias):
    """The op on a column slice of a wider gate tensor (the layers' use), so its gradient reaches the whole tensor."""
    width = o.shape[2] * o.shape[3] if gate_weight is None else gate_weight.shape[1]
    return gated_rmsnorm(o, source[..., 3:3 + width], weight, activation="sigmoid", eps=1e-5, gate_weight=gate_weight,
                         gate_bias=gate_bias)


def _compiled_against_eager(problem, *, backend="aot_eager", tol=0.0):
    torch._dynamo.reset()
    assert torch._dynamo.explain(_sliced)(*problem).graph_break_count == 0
    compiled = torch.compile(_sliced, fullgraph=True, backend=backend)
    results = []
    for fn in (_sliced, compiled):
        leaves = [None if t is None else t.detach().clone().requires_grad_() for t in problem]
        y = fn(*leaves)
        cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(device=y.device, dtype=y.dtype)
        (y * cot).sum().backward()
        results.append([y, *(None if t is None else t.grad for t in leaves)])
    for name, got, want in zip(("y", "do", "dsource", "dweight", "dgate_weight", "dgate_bias"), *results[::-1]):
        assert (got is None) == (want is None), name
        if want is not None:
            torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("path", ["reference_path", "triton_interpreter"])
@pytest.mark.parametrize("low_rank", [False, True])
def test_compiled_equals_eager(low_rank, path, request, poison_outputs):
    request.getfixturevalue(path)
    if low_rank:
        problem = make_low_rank_problem(L=3, R=5, seed=6)
        problem = (problem[0], problem[1], problem[4], problem[2], problem[3])
    else:
        o, source, weight = make_problem(L=3, gate="strided", seed=6)
        problem = (o, source, weight, None, None)
    _compiled_against_eager(problem)


@pytest.mark.cuda
@pytest.mark.parametrize("low_rank", [False, True])
def test_cuda_compiled_equals_eager(low_rank, poison_outputs):
    """Inductor around the registered op, bf16: the same kernels run, so the same result up to bf16 rounding."""
    if low_rank:
        problem = make_low_rank_problem(B=4, L=197, H=3, D=64, R=16, dtype=torch.bfloat16, device="cuda", seed=7)
        problem = (problem[0], problem[1], problem[4], problem[2], problem[3])
    else:
        o, source, weight = make_problem(B=4, L=197, H=6, D=64, gate="strided", dtype=torch.bfloat16, device="cuda")
        problem = (o, source, weight, None, None)
    _compiled_against_eager(problem, backend="inductor", tol=2e-2)
