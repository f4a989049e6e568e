"""GKA as registered ops (kernels/gka/custom_op.py): ``torch.library.opcheck`` of ``gka_causal`` (each solver) and
``gka_noncausal`` on the PyTorch path and through the Triton kernels in the interpreter, and ``torch.compile`` of the
public function against its eager calls (outputs and every gradient, no graph break)."""

from __future__ import annotations

import pytest
import torch
from gka_inputs import make_inputs, run_with_grads

from visionssm.kernels.gka import gka, resolve_solver
from visionssm.kernels.gka.custom_op import gka_causal_op, gka_noncausal_op
from visionssm.kernels.utils import assert_close

# (solver as the public function takes it, K, V, T, H): the per-token direct solve, the paper's iteration (two
# chunks, two heads), the auto iteration of wider heads (coarse steps on the GPU) and the direct solve run as the
# converged iteration; odd lengths, tiny for the interpreter (the per-token solve is its slowest kernel)
CAUSAL = [("direct", 16, 16, 5, 1), ("chebyshev", 16, 32, 19, 2), ("auto", 32, 16, 5, 1), ("direct", 32, 16, 7, 1)]
GLOBAL = [("direct", 16, 16), ("chebyshev", 16, 32)]
T_ODD = 19
NUM_ITERS = 7


@pytest.fixture(params=["reference", "interpreter"])
def path(request):
    """The op's PyTorch path or its Triton kernels in the interpreter (dynamo's caches emptied: a graph traced on
    one path holds the other's saved-tensor shapes)."""
    torch._dynamo.reset()
    fixture = "reference_path" if request.param == "reference" else "triton_interpreter"
    request.getfixturevalue(fixture)
    yield request.param
    torch._dynamo.reset()


def _args(tensors, requires_grad):
    return [None if t is None else t.detach().clone().requires_grad_(requires_grad) for t in tensors]


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("solver,K,V,T,H", CAUSAL)
def test_opcheck_causal(path, poison_outputs, solver, K, V, T, H, requires_grad):
    tensors = make_inputs(1, T, H, K, V, use_alpha=solver != "chebyshev", seed=K + V)
    resolved = resolve_solver(solver, True, K)
    torch.library.opcheck(gka_causal_op, (*_args(tensors, requires_grad), 0.02, NUM_ITERS, resolved))


@pytest.mark.parametrize("save", [False, True])
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("solver,K,V", GLOBAL)
def test_opcheck_noncausal(path, poison_outputs, solver, K, V, requires_grad, save):
    if requires_grad and not save:
        pytest.skip("a call whose gradient is needed saves its states")
    tensors = make_inputs(1, T_ODD, 2, K, V, causal=False, use_beta=solver == "direct", seed=K + V)
    torch.library.opcheck(gka_noncausal_op, (*_args(tensors, requires_grad), 0.02, NUM_ITERS, solver, save))


def test_noncausal_backward_without_saved_states_raises(triton_interpreter):
    q, k, v, beta, alpha = _args(make_inputs(1, 5, 1, 16, 16, causal=False), True)
    o = gka_noncausal_op(q, k, v, beta, alpha, 0.02, NUM_ITERS, "direct", False)[0]
    with pytest.raises(RuntimeError, match="save=False"):
        o.sum().backward()


def _check_compiled(tensors, *, causal, solver, tol=1e-6):
    """torch.compile(fullgraph, aot_eager) of ``gka`` equals the eager call, forward and every gradient, with no
    graph break; also with nothing to differentiate."""

    def fn(*args):
        return gka(*args, causal=causal, solver=solver, num_iters=NUM_ITERS)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    do = torch.randn(tensors[2].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    do = do.to(tensors[2].device)
    out, grads = run_with_grads(fn, tensors, do)
    compiled_out, compiled_grads = run_with_grads(compiled, tensors, do)
    assert_close(compiled_out, out, tol=tol, name="o")
    for name, got, expected in zip(("q", "k", "v", "g", "beta", "alpha"), compiled_grads, grads):
        if expected is None:
            assert got is None or not got.abs().max() > 0, f"d{name}: eager has none"
            continue
        assert got is not None, f"no gradient for {name} when compiled"
        assert_close(got, expected, tol=tol, name=f"d{name}")
    with torch.no_grad():
        assert_close(compiled(*tensors), out, tol=tol, name="o (no grad)")
    assert torch._dynamo.explain(fn)(*tensors).graph_break_count == 0


@pytest.mark.parametrize("solver,K,V,T,H", CAUSAL)
def test_compile_causal_matches_eager(path, poison_outputs, solver, K, V, T, H):
    tensors = make_inputs(1, T, H, K, V, use_beta=K == V, seed=K)
    _check_compiled(tensors, causal=True, solver=solver)


@pytest.mark.parametrize("solver", ["direct", "chebyshev"])
def test_compile_noncausal_matches_eager(path, poison_outputs, solver):
    # g is given and ignored (no gradient), as models pass it
    tensors = make_inputs(1, T_ODD, 2, 16, 32, use_alpha=solver == "direct", seed=3)
    _check_compiled(tensors, causal=False, solver=solver)


@pytest.mark.cuda
@pytest.mark.parametrize("causal,solver,K", [(True, "direct", 16), (True, "auto", 32), (True, "auto", 64),
                                             (True, "chebyshev", 32), (False, "direct", 16), (False, "direct", 64)])
def test_cuda_inductor_bf16_matches_eager(poison_outputs, causal, solver, K):
    torch._dynamo.reset()
    tensors = make_inputs(2, 65, 3, K, K, dtype=torch.bfloat16, device="cuda", seed=K)

    def fn(q, k, v, g, beta, alpha):
        # PyTorch ops around the op, for Inductor to fuse
        return gka(q * 1.0, k, v.float().to(v.dtype), g, beta, alpha, causal=causal, solver=solver) * 2.0

    compiled = torch.compile(fn, fullgraph=True)
    gen = torch.Generator("cuda").manual_seed(1)
    do = torch.randn(tensors[2].shape, dtype=torch.float32, device="cuda", generator=gen)
    out, grads = run_with_grads(fn, tensors, do)
    compiled_out, compiled_grads = run_with_grads(compiled, tensors, do)
    assert_close(compiled_out, out, tol=1e-2, name="o")
    for name, got, expected in zip(("q", "k", "v", "g", "beta", "alpha"), compiled_grads, grads):
        if expected is None or (name == "g" and not causal):
            continue
        assert_close(got, expected, tol=2e-2, name=f"d{name}")
    with torch.no_grad():
        assert_close(compiled(*tensors), out, tol=1e-2, name="o (no grad)")
    assert torch._dynamo.explain(fn)(*tensors).graph_break_count == 0
    torch._dynamo.reset()


@pytest.mark.cuda
@pytest.mark.parametrize("causal,K", [(True, 16), (True, 32), (False, 16)])
def test_cuda_graphs_inference(causal, K):
    """mode="reduce-overhead" (CUDA graphs) replays the op: the same output as eager on fresh inputs."""
    torch._dynamo.reset()

    def fn(*args):
        return gka(*args, causal=causal)

    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for seed in range(3):
            tensors = make_inputs(2, 49, 3, K, K, dtype=torch.bfloat16, device="cuda", seed=seed)
            assert_close(compiled(*tensors).clone(), fn(*tensors), tol=1e-2, name=f"o (call {seed})")
    torch._dynamo.reset()


@pytest.mark.parametrize("causal,solver,K", [(True, "direct", 16), (True, "auto", 32), (False, "direct", 16)])
def test_a_call_keeps_nothing_it_allocated(triton_interpreter, causal, solver, K):
    """What the ops' Triton path allocates during a call (plans built on first use included) is gone afterwards,
    except its outputs and the per-device placeholder: under CUDA graphs (mode="reduce-overhead") anything else
    would stay in the graph's pool untracked ('Detected 1 tensor(s) in the cudagraph pool not tracked as outputs')."""
    import gc
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    from visionssm.kernels.gka import custom_op
    from visionssm.kernels.tuning import launch_overrides
    from visionssm.kernels.utils import placeholder

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.made += [weakref.ref(t) for t in (out if isinstance(out, (tuple, list)) else [out])
                          if isinstance(t, torch.Tensor)]
            return out

    tensors = make_inputs(2, 9, 3, K, K, causal=causal, seed=K)
    args = (0.02, NUM_ITERS, resolve_solver(solver, causal, K)) + (() if causal else (False,))
    forward = custom_op.gka_causal_forward if causal else custom_op.gka_noncausal_forward
    with torch.no_grad(), launch_overrides("gka_test_fresh_plans"), Allocations() as allocations:
        *outputs, saved = forward(*tensors, *args)
    kept = {t.untyped_storage().data_ptr() for t in (*outputs, *saved, placeholder(tensors[0].device))}
    del outputs, saved
    gc.collect()
    alive = [ref() for ref in allocations.made if ref() is not None]
    assert [tuple(t.shape) for t in alive if t.untyped_storage().data_ptr() not in kept] == []
