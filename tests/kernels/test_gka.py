"""GKA op: the CPU path, the Triton kernels (interpreter on CPU, real on GPU) and input validation, all against
the float64 token loop of kernels/gka/naive.py."""

from __future__ import annotations

import pytest
import torch
from gka_inputs import adversarial_keys, make_inputs, run_with_grads

from visionssm.kernels.gka import gka
from visionssm.kernels.gka.naive import gka_chunked, gka_recurrent
from visionssm.kernels.utils import assert_close

FWD_TOL, GRAD_TOL = 2e-3, 2e-2
GRAD_NAMES = ("q", "k", "v", "g", "beta", "alpha")


def check_against_reference(tensors, *, causal, fwd_tol=FWD_TOL, grad_tol=GRAD_TOL, exact_grads=False, num_iters=30,
                            reference=gka_recurrent):
    """Forward of ``gka`` vs the float64 Chebyshev token loop; gradients vs float64 autograd through the
    vectorised reference (equal to the loop's, see test_chebyshev_reference_matches_exact_solve); ``exact_grads``:
    through the exact solve, which is what implicit differentiation computes."""
    ref_inputs = [None if t is None else t.detach().double().cpu() for t in tensors]
    do = torch.randn(tensors[2].shape[:3] + (tensors[2].shape[3],), dtype=torch.float64)
    device = tensors[0].device
    out, grads = run_with_grads(lambda *a: gka(*a, causal=causal, num_iters=num_iters), tensors, do.to(device))
    ref_out = reference(*ref_inputs, causal=causal, num_iters=num_iters)
    assert_close(out, ref_out, tol=fwd_tol, name="o")
    _, ref_grads = run_with_grads(
        lambda *a: gka_chunked(*a, causal=causal, num_iters=num_iters, exact=exact_grads), ref_inputs, do)
    for name, grad, ref in zip(GRAD_NAMES, grads, ref_grads):
        if ref is None:
            continue
        if name == "g" and not causal:
            assert grad is None or not grad.abs().max() > 0, "g is ignored when causal=False"
            continue
        assert grad is not None, f"no gradient for {name}"
        assert_close(grad, ref, tol=grad_tol, name=f"d{name}")


# ----------------------------------------------------------------------------------------------------------------
# The reference itself


def test_chebyshev_reference_matches_exact_solve():
    tensors = make_inputs(2, 40, 2, 16, 16, dtype=torch.float64)
    for causal in (True, False):
        cheb = gka_recurrent(*tensors, causal=causal)
        exact = gka_recurrent(*tensors, causal=causal, exact=True)
        assert_close(cheb, exact, tol=2e-3, name="chebyshev vs exact")
        assert_close(gka_chunked(*tensors, causal=causal, chunk_size=16), cheb, tol=1e-12, name="chunked vs loop")
        do = torch.randn_like(tensors[2])
        for exact in (False, True):
            _, loop_grads = run_with_grads(
                lambda *a, c=causal, e=exact: gka_recurrent(*a, causal=c, exact=e), tensors, do)
            _, vec_grads = run_with_grads(
                lambda *a, c=causal, e=exact: gka_chunked(*a, causal=c, exact=e, chunk_size=16), tensors, do)
            for name, a, b in zip(GRAD_NAMES, vec_grads, loop_grads):
                if b is not None and a is not None:
                    assert_close(a, b, tol=1e-10, name=f"d{name} chunked vs loop (exact={exact})")


# ----------------------------------------------------------------------------------------------------------------
# CPU (PyTorch) path


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 196, 257])
def test_cpu_path_lengths(reference_path, causal, T):
    tensors = make_inputs(1, T, 2, 16, 16, use_beta=T % 2 == 1, use_alpha=T % 3 != 0)
    check_against_reference(tensors, causal=causal)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("K,V", [(16, 32), (32, 16), (64, 64)])
@pytest.mark.parametrize("gates", ["both", "none"])
def test_cpu_path_head_dims(reference_path, causal, K, V, gates):
    use = gates == "both"
    tensors = make_inputs(2, 37, 2, K, V, use_beta=use, use_alpha=use)
    check_against_reference(tensors, causal=causal)


def test_cpu_path_dtypes(reference_path):
    tensors = make_inputs(1, 20, 2, 16, 16, dtype=torch.bfloat16)
    out = gka(*tensors)
    assert out.dtype == torch.bfloat16
    ref = gka_recurrent(*[t.double() for t in tensors])
    assert_close(out, ref, tol=2e-2, name="o bf16")


@pytest.mark.parametrize("causal", [True, False])
def test_zero_keys_finite(reference_path, causal):
    q, k, v, g, beta, alpha = make_inputs(1, 9, 2, 16, 16)
    k = k.clone()
    k[:, :4] = 0.0                                      # ‖H_t‖_F = 0 for the first tokens (all of them if non-causal)
    if not causal:
        k.zero_()
    tensors = [t.requires_grad_(True) for t in (q, k, v, g, beta, alpha)]
    out = gka(*tensors, causal=causal)
    out.sum().backward()
    assert torch.isfinite(out).all()
    if causal:
        assert out[:, :4].abs().max() == 0
    for t in tensors:
        assert t.grad is None or torch.isfinite(t.grad).all()


# ----------------------------------------------------------------------------------------------------------------
# Validation


def test_bad_inputs():
    q, k, v, g, beta, alpha = make_inputs(1, 8, 2, 16, 16)
    with pytest.raises(ValueError, match="k"):
        gka(q, k[:, :4], v, g)
    with pytest.raises(ValueError, match="v"):
        gka(q, k, v[:, :, :1], g)
    with pytest.raises(ValueError, match="head dim"):
        gka(q[..., :8], k[..., :8], v, g)
    with pytest.raises(ValueError, match="head dim"):
        gka(q, k, torch.randn(1, 8, 2, 24), g)
    with pytest.raises(TypeError, match="q"):
        gka(q.long(), k, v, g)
    with pytest.raises(TypeError, match="beta"):
        gka(q, k, v, g, beta.to(torch.int32))
    with pytest.raises(TypeError, match="k"):
        gka(q, k.double(), v, g)
    with pytest.raises(ValueError, match="g"):
        gka(q, k, v, g[:, :3])
    with pytest.raises(ValueError, match="g"):
        gka(q, k, v, None, causal=True)
    with pytest.raises(ValueError, match="alpha"):
        gka(q, k, v, g, beta, alpha[..., :1])
    with pytest.raises(ValueError, match="ridge"):
        gka(q, k, v, g, ridge=0.0)
    with pytest.raises(ValueError, match="ridge"):
        gka(q, k, v, g, ridge=-1.0)
    with pytest.raises(TypeError, match="ridge"):
        gka(q, k, v, g, ridge="0.1")
    with pytest.raises(ValueError, match="num_iters"):
        gka(q, k, v, g, num_iters=0)
    with pytest.raises(TypeError, match="num_iters"):
        gka(q, k, v, g, num_iters=2.5)
    with pytest.raises(TypeError, match="causal"):
        gka(q, k, v, g, causal=1)
    with pytest.raises(ValueError, match="q"):
        gka(q[0], k[0], v[0], g[0])
    assert gka(q, k, v, None, causal=False).shape == v.shape
    meta = torch.empty(1, 8, 2, 16, device="meta")
    with pytest.raises(ValueError, match="device"):
        gka(q, meta, v, g)


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels in Triton's interpreter (tiny shapes; NaN-poisoned outputs catch unwritten elements)


# Non-causal Triton cases are in test_gka_noncausal.py (against the exact and the Chebyshev references). The causal
# lengths 1, 5, 63, 65, 197 and 257 run on the same kernels (solver "auto" is "direct" for 16-wide causal heads) in
# test_gka_causal.py::test_interpreter_direct_lengths, against the exact solve at tighter tolerances: here the "auto"
# default on one partial chunk and on whole chunks only.
@pytest.mark.parametrize("causal", [True])
@pytest.mark.parametrize("T", [1, 64])
def test_triton_interpreter_lengths(triton_interpreter, poison_outputs, causal, T):
    tensors = make_inputs(1, T, 1, 16, 16, use_beta=T % 2 == 1, use_alpha=T % 3 != 0, seed=T)
    check_against_reference(tensors, causal=causal, exact_grads=True)


@pytest.mark.parametrize("causal", [True])
@pytest.mark.parametrize("K,V", [(16, 32), (32, 16), (64, 64)])
@pytest.mark.parametrize("gates", ["both", "none"])
def test_triton_interpreter_head_dims(triton_interpreter, poison_outputs, causal, K, V, gates):
    use = gates == "both"
    tensors = make_inputs(2, 37, 1, K, V, use_beta=use, use_alpha=use, seed=K + V)
    check_against_reference(tensors, causal=causal, exact_grads=True)


def test_triton_interpreter_strong_gates_and_low_precision(triton_interpreter, poison_outputs):
    # Fast forgetting (g down to ~ −20 per token) and bf16 inputs: fp32 math inside, bf16 tolerance outside.
    tensors = make_inputs(1, 40, 2, 16, 16, gate_scale=10.0)
    check_against_reference(tensors, causal=True, exact_grads=True)
    low = [t.to(torch.bfloat16) for t in tensors]
    out = gka(*low)
    assert out.dtype == torch.bfloat16
    assert_close(out, gka_recurrent(*[t.double() for t in low]), tol=2e-2, name="o bf16")


def test_triton_interpreter_zero_keys(triton_interpreter, poison_outputs):
    q, k, v, g, beta, alpha = make_inputs(1, 20, 1, 16, 16)
    k = k.clone()
    k[:, :7] = 0.0
    tensors = [t.requires_grad_(True) for t in (q, k, v, g, beta, alpha)]
    out = gka(*tensors)
    out.sum().backward()
    assert torch.isfinite(out).all() and out[:, :7].abs().max() == 0
    assert all(torch.isfinite(t.grad).all() for t in tensors)
    assert_close(out.detach(), gka_recurrent(*[t.detach().double() for t in tensors]), tol=FWD_TOL, name="o")


# ----------------------------------------------------------------------------------------------------------------
# GPU (cuda-marked): real kernels at larger shapes, bf16, and the stability cases


CUDA_SHAPES = [(2, 196, 4, 16, 16), (4, 49, 8, 16, 16), (1, 300, 2, 32, 64), (1, 1000, 2, 64, 64),
               (1, 517, 2, 128, 128)]


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", CUDA_SHAPES[:4], ids=lambda s: "x".join(map(str, s)))
def test_cuda_fp32(poison_outputs, causal, shape):
    tensors = make_inputs(*shape, device="cuda")
    check_against_reference(tensors, causal=causal, exact_grads=True, reference=gka_chunked)


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cuda_bf16(poison_outputs, causal, shape):
    tensors = make_inputs(*shape, device="cuda", dtype=torch.bfloat16)
    check_against_reference(tensors, causal=causal, fwd_tol=2e-2, grad_tol=3e-2, exact_grads=True,
                            reference=gka_chunked)


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_stability_long_bf16(causal):
    T, K = 8192, 64
    q, _, v, g, beta, alpha = make_inputs(1, T, 3, K, K, dtype=torch.float64)
    k = adversarial_keys(T, K)
    low = [t.to("cuda", torch.bfloat16) for t in (q, k, v, g, beta, alpha)]
    out = gka(*low, causal=causal)
    assert torch.isfinite(out).all()
    ref = gka_chunked(*[t.double() for t in low], causal=causal)
    for head in range(3):
        assert_close(out[:, :, head], ref[:, :, head], tol=1e-2, name=f"o head {head}")
