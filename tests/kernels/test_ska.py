"""Spectral Koopman Attention (visionssm.kernels.ska) against its float64 spec (``ska_recurrent``: the paper's
whitened pipeline, token by token), forward and every gradient: the vectorised CPU path and the Triton kernels in
Triton's interpreter (fp32, tiny shapes), and the Triton kernels on the GPU (cuda-marked: bf16 and fp32, real shapes).

Tolerances (relative, ‖actual − expected‖ / ‖expected‖): fp32 forward 1e-4, gradients 1e-3, with ridge 1e-2 (and
0.1 for T ≤ 2, where the output is a near-cancellation of G⁻¹-amplified terms and fp32 rounding alone reaches 1e-3
at ridge 1e-2: the spec run in fp32 is that far from itself in float64) — the design note's advice for tight tests,
since the error of any fp32 solve grows with κ(G) ≤ 1 + T/λ. The paper's ridge (1e-3) is covered at T = 196.
"""

from __future__ import annotations

import pytest
import torch

from visionssm.kernels import dispatch
from visionssm.kernels.ska import EPS, MAX_POWER, ska
from visionssm.kernels.ska.naive import ska_parallel, ska_recurrent, spectral_norm_estimate
from visionssm.kernels.utils import assert_close

LENGTHS = (1, 2, 5, 49, 64, 65, 196, 257)
FWD_TOL, GRAD_TOL = 1e-4, 1e-3
BF16_TOL = 2e-2


def ridge_for(T: int) -> float:
    return 0.1 if T <= 2 else 1e-2


def make_inputs(B, T, H, R, V, *, seed=0, dtype=torch.float32, device="cpu"):
    """Raw (not normalised) q, k, v with keys of varied norms, fresh random values."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, R, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, H, R, generator=gen, dtype=torch.float64) * (0.5 + torch.rand(B, T, H, 1, generator=gen,
                                                                                          dtype=torch.float64))
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


def with_grads(fn, tensors, do):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    out.backward(do.to(device=out.device, dtype=out.dtype))
    return out.detach(), [t.grad for t in leaves]


def check_against_spec(tensors, *, fwd_tol=FWD_TOL, grad_tol=GRAD_TOL, reference=ska_recurrent, **options):
    """``ska(*tensors, **options)`` (whatever backend is selected) against ``reference`` in float64 on the same
    (rounded) inputs: forward and the gradients of q, k and v."""
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(tensors[2].shape, generator=gen, dtype=torch.float64)
    out, grads = with_grads(lambda q, k, v: ska(q, k, v, **options), tensors, do)
    ref_in = [t.detach().to(device=tensors[0].device, dtype=torch.float64) for t in tensors]
    ref_out, ref_grads = with_grads(lambda q, k, v: reference(q, k, v, **options), ref_in, do.to(ref_in[0].device))
    assert out.dtype == tensors[2].dtype
    assert_close(out, ref_out, tol=fwd_tol, name="o")
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert g.dtype == tensors[0].dtype
        assert_close(g, rg, tol=grad_tol, name=f"d{name}")


# ---------------------------------------------------------------------------------------------------------------
# The CPU path (vectorised PyTorch, fp32) and the Triton kernels in the interpreter, against the spec


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T", LENGTHS)
def test_cpu_path_matches_spec(reference_path, causal, T):
    check_against_spec(make_inputs(2, T, 2, 16, 32, seed=T), causal=causal, ridge=ridge_for(T))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T", LENGTHS)
def test_interpreter_matches_spec(triton_interpreter, poison_outputs, causal, T):
    check_against_spec(make_inputs(1, T, 1 if T > 100 else 2, 16, 16, seed=T), causal=causal, ridge=ridge_for(T))


def projection_views(q, k, v, batch_pad=0, token_pad=3):
    """q, k, v as views of one (B, T, ·) buffer, each token's (H, D) blocks side by side (how a layer splits one
    projection's output), with padding columns and batch rows so that every stride differs from a contiguous one;
    the buffer's padding holds NaN (a read outside the views shows)."""
    B, T, H, R = q.shape
    V = v.shape[3]
    width = H * (2 * R + V) + token_pad
    buf = torch.full((B + batch_pad, T, width), float("nan"), dtype=q.dtype)[batch_pad:]
    views = []
    start = 0
    for t in (q, k, v):
        view = buf[:, :, start:start + H * t.shape[3]].unflatten(2, (H, t.shape[3]))
        view.copy_(t)
        views.append(view)
        start += H * t.shape[3]
    return views


@pytest.mark.parametrize("causal", [False, True])
def test_interpreter_reads_projection_views(triton_interpreter, poison_outputs, causal):
    """Non-causal kernels read q, k, v views of one projection's output in place (the causal ones copy them): same
    forward and gradients as contiguous inputs."""
    tensors = make_inputs(2, 21, 2, 16, 32, seed=21)
    views = projection_views(*tensors, batch_pad=1)
    assert not any(view.is_contiguous() for view in views)
    do = torch.randn(tensors[2].shape, generator=torch.Generator().manual_seed(2))
    fn = lambda q, k, v: ska(q, k, v, causal=causal, ridge=1e-2)  # noqa: E731
    out, grads = with_grads(fn, tensors, do)
    view_leaves = [view.detach().requires_grad_(True) for view in views]
    view_out = fn(*view_leaves)
    view_out.backward(do)
    assert_close(view_out.detach(), out, tol=1e-6, name="o")
    for name, leaf, g in zip("qkv", view_leaves, grads):
        assert_close(leaf.grad, g, tol=1e-6, name=f"d{name}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("R, V, T", [(32, 32, 37), (64, 128, 11), (16, 64, 33), (16, 128, 18)])
def test_interpreter_ranks_and_value_widths(triton_interpreter, poison_outputs, causal, R, V, T):
    check_against_spec(make_inputs(1, T, 1, R, V, seed=R + V), causal=causal, ridge=1e-2)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("power, normalize, num_iters", [(0, True, 6), (1, True, 3), (4, False, 6), (3, True, 10)])
def test_interpreter_filter_options(triton_interpreter, poison_outputs, causal, power, normalize, num_iters):
    check_against_spec(make_inputs(2, 40, 1, 16, 16, seed=power), causal=causal, ridge=1e-2, power=power,
                       normalize=normalize, num_iters=num_iters)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_paper_ridge_long_window(backend, poison_outputs):
    """The paper's ridge 1e-3 at a vision window (T = 196, non-causal): well-conditioned for random keys."""
    if backend == "triton" and not (dispatch.triton_available() and dispatch.interpreter_enabled()):
        pytest.skip("needs TRITON_INTERPRET=1")
    with dispatch.backend(backend):
        check_against_spec(make_inputs(1, 196, 2, 16, 16, seed=3), causal=False, ridge=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# Documented edge cases


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("causal", [False, True])
def test_zero_keys_and_single_token(backend, causal, poison_outputs):
    """All-zero keys: s = EPS, G = λI, C = 0, so o = 0 with finite gradients. T = 1 (and causally the first
    token): M = 0, so o = 0 for power ≥ 1, while power = 0 is plain ridge retrieval ``v kᵀ(k kᵀ/s² + λ)⁻¹ q/s``."""
    if backend == "triton" and not (dispatch.triton_available() and dispatch.interpreter_enabled()):
        pytest.skip("needs TRITON_INTERPRET=1")
    with dispatch.backend(backend):
        q, k, v = make_inputs(1, 9, 2, 16, 16)
        leaves = [t.clone().requires_grad_(True) for t in (q, torch.zeros_like(k), v)]
        o = ska(*leaves, causal=causal)
        o.sum().backward()
        assert torch.equal(o, torch.zeros_like(o))
        assert all(torch.isfinite(t.grad).all() for t in leaves)

        o1 = ska(q[:, :1], k[:, :1], v[:, :1], causal=causal)
        assert torch.equal(o1, torch.zeros_like(o1))
        assert torch.equal(ska(q, k, v, causal=True)[:, 0], torch.zeros_like(v[:, 0]))
        ridge = 0.1
        o0 = ska(q[:, :1], k[:, :1], v[:, :1], causal=causal, power=0, ridge=ridge)
        s = k[:, 0].norm(dim=-1, keepdim=True)
        kh, qh = k[:, 0] / s, q[:, 0] / s                                    # (B, H, R)
        # (k̂k̂ᵀ + λI)⁻¹ q̂ = (q̂ − k̂ (k̂·q̂)/(λ + 1)) / λ, and C = v k̂ᵀ
        x = (qh - kh * (kh * qh).sum(-1, keepdim=True) / (ridge + 1.0)) / ridge
        assert_close(o0[:, 0], v[:, 0] * (kh * x).sum(-1, keepdim=True), tol=1e-5, name="T=1 ridge retrieval")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("causal", [False, True])
def test_nearly_singular_gram_stays_finite(backend, causal, poison_outputs):
    """Keys in a 2-dimensional subspace and ridge 1e-4: G has 14 eigenvalues at λ (κ ≈ 1e6). Finite outputs and
    gradients, close to the float64 spec (fp32 cannot do better than about κ·ε here)."""
    if backend == "triton" and not (dispatch.triton_available() and dispatch.interpreter_enabled()):
        pytest.skip("needs TRITON_INTERPRET=1")
    q, k, v = make_inputs(1, 33, 2, 16, 16)
    basis = torch.randn(2, 16)
    k = torch.einsum("bthi,ir->bthr", k[..., :2], basis)
    with dispatch.backend(backend):
        check_against_spec([q, k, v], causal=causal, ridge=1e-4, fwd_tol=5e-2, grad_tol=5e-1)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        o = ska(*leaves, causal=causal, ridge=1e-6)
        o.square().sum().backward()
        assert torch.isfinite(o).all() and all(torch.isfinite(t.grad).all() for t in leaves)


# ---------------------------------------------------------------------------------------------------------------
# Properties of the definition (float64, the spec and the vectorised path)


def f64(B, T, H, R, V, seed=0):
    return make_inputs(B, T, H, R, V, seed=seed, dtype=torch.float64)


@pytest.mark.parametrize("causal", [False, True])
def test_whitened_pipeline_equals_g_form(causal):
    q, k, v = f64(2, 23, 3, 16, 8)
    for power in (0, 1, 2, 4):
        for normalize in (True, False):
            assert_close(ska_parallel(q, k, v, causal=causal, power=power, normalize=normalize, ridge=1e-2),
                         ska_recurrent(q, k, v, causal=causal, power=power, normalize=normalize, ridge=1e-2),
                         tol=1e-10, name=f"p={power} normalize={normalize}")


@pytest.mark.parametrize("causal", [False, True])
def test_power_zero_is_ridge_regression(causal):
    q, k, v = f64(1, 17, 2, 16, 8)
    o = ska_recurrent(q, k, v, causal=causal, power=0, ridge=0.05)
    for t in range(17):
        window = slice(0, t + 1) if causal else slice(0, 17)
        s = k[:, window].norm(dim=-1).amax(dim=1)                          # (B, H)
        kh = k[:, window] / s[:, None, :, None]
        G = torch.einsum("bshi,bshj->bhij", kh, kh) + 0.05 * torch.eye(16, dtype=torch.float64)
        C = torch.einsum("bshi,bshj->bhij", v[:, window], kh)
        ridge_map = C @ torch.linalg.inv(G)                                 # argmin_W Σ‖v − W k̂‖² + λ‖W‖²
        expected = (ridge_map @ (q[:, t] / s[..., None]).unsqueeze(-1)).squeeze(-1)
        assert_close(o[:, t], expected, tol=1e-10, name=f"t={t}")


@pytest.mark.parametrize("causal", [False, True])
def test_scale_of_queries_and_keys_cancels(causal):
    """Sequence-max normalisation: scaling q and k together leaves o unchanged."""
    q, k, v = f64(1, 29, 2, 16, 8)
    expected = ska_parallel(q, k, v, causal=causal)
    for c in (1e-3, 7.0, 1e4):
        assert_close(ska_parallel(q * c, k * c, v, causal=causal), expected, tol=1e-9, name=f"c={c}")


def test_sequence_max_is_a_data_dependent_ridge():
    """SKA(q/s, k/s; λ) = SKA(q, k; λ s²) for the whole-sequence s, written out with raw statistics."""
    q, k, v = f64(1, 31, 1, 16, 8)
    s = k.norm(dim=-1).amax()
    G = torch.einsum("bthi,bthj->bhij", k, k) + 1e-2 * s ** 2 * torch.eye(16, dtype=torch.float64)
    M = torch.einsum("bthi,bthj->bhij", k[:, 1:], k[:, :-1])
    C = torch.einsum("bthi,bthj->bhij", v, k)
    sigma = spectral_norm_estimate(G, M, 6)
    Gi = torch.linalg.inv(G)
    Phi = C @ Gi @ torch.linalg.matrix_power(M @ Gi / sigma[..., None, None], 2)
    expected = torch.einsum("bhvr,bthr->bthv", Phi, q)
    assert_close(ska_recurrent(q, k, v, causal=False, ridge=1e-2), expected, tol=1e-9)


def test_causal_output_ignores_later_tokens():
    q, k, v = f64(1, 40, 2, 16, 8)
    o = ska_parallel(q, k, v, causal=True)
    t = 17
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, t + 1:] = torch.randn_like(x[:, t + 1:]) * 5.0     # larger keys later: the running max must not see them
    o2 = ska_parallel(q2, k2, v2, causal=True)
    assert_close(o2[:, :t + 1], o[:, :t + 1], tol=1e-12)
    assert (o2[:, t + 1:] - o[:, t + 1:]).abs().max() > 1e-3


def test_token_order_matters_only_through_the_filter():
    """Non-causal, power 0 (ridge regression) is invariant to permuting the tokens; power ≥ 1 is not (M pairs
    each token with its predecessor)."""
    q, k, v = f64(1, 25, 2, 16, 8)
    perm = torch.randperm(25)
    for power, invariant in ((0, True), (2, False)):
        o = ska_parallel(q, k, v, causal=False, power=power)
        o_perm = ska_parallel(q[:, perm], k[:, perm], v[:, perm], causal=False, power=power)
        diff = (o_perm - o[:, perm]).abs().max().item()
        assert (diff < 1e-10) == invariant, (power, diff)


def test_power_iteration_estimate():
    """σ̂ is the whitened power iteration of the spec (from w₀ ∝ Lᵀ1): below the true ‖K_w‖₂ and converging to it;
    ‖K_w‖₂ < 1 when G and M come from the same tokens."""
    from visionssm.kernels.ska.naive import _whitened_sigma

    k = torch.randn(4, 49, 16, dtype=torch.float64)
    k = k / k.norm(dim=-1).amax(dim=-1)[:, None, None]
    G = k.transpose(1, 2) @ k + 1e-3 * torch.eye(16, dtype=torch.float64)
    M = k[:, 1:].transpose(1, 2) @ k[:, :-1]
    L = torch.linalg.cholesky(G)
    Kw = torch.linalg.solve_triangular(L, torch.linalg.solve_triangular(L, M, upper=False).transpose(1, 2),
                                       upper=False).transpose(1, 2)
    exact = torch.linalg.matrix_norm(Kw, ord=2)
    w0 = (L.transpose(1, 2) @ torch.ones(4, 16, 1, dtype=torch.float64)).squeeze(-1)
    for n in (1, 6, 30):
        assert_close(spectral_norm_estimate(G, M, n), _whitened_sigma(Kw, w0, n, EPS), tol=1e-12)
    assert (spectral_norm_estimate(G, M, 6) <= exact * (1 + 1e-12)).all()
    assert_close(spectral_norm_estimate(G, M, 500), exact, tol=1e-6)
    assert (exact < 1).all()


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_without_normalisation(causal):
    """With normalize=False nothing is detached: the vectorised path's gradients pass finite differences (with
    normalize=True they cannot, by design: finite differences see σ̂ move)."""
    q, k, v = (t.requires_grad_(True) for t in f64(1, 5, 1, 16, 16))
    assert torch.autograd.gradcheck(lambda a, b, c: ska_parallel(a, b, c, causal=causal, normalize=False, ridge=0.1),
                                    (q, k, v))


# ---------------------------------------------------------------------------------------------------------------
# Arguments


def test_bad_arguments_name_the_argument():
    q, k, v = make_inputs(1, 8, 2, 16, 16)
    cases = [
        ({"q": q.to(torch.int32)}, TypeError, "q"),
        ({"k": k.double()}, TypeError, "k"),
        ({"q": q[0]}, ValueError, "q"),
        ({"k": k[:, :7]}, ValueError, "k"),
        ({"v": v[:, :, :1]}, ValueError, "v"),
        ({"q": torch.randn(1, 8, 2, 24), "k": torch.randn(1, 8, 2, 24)}, ValueError, "R"),
        ({"v": torch.randn(1, 8, 2, 48)}, ValueError, "V"),
        ({"q": q[:, :0], "k": k[:, :0], "v": v[:, :0]}, ValueError, "q"),
        ({"causal": 1}, TypeError, "causal"),
        ({"normalize": "yes"}, TypeError, "normalize"),
        ({"ridge": 0.0}, ValueError, "ridge"),
        ({"ridge": float("nan")}, ValueError, "ridge"),
        ({"ridge": "1e-3"}, TypeError, "ridge"),
        ({"power": -1}, ValueError, "power"),
        ({"power": MAX_POWER + 1}, ValueError, "power"),
        ({"power": 2.0}, TypeError, "power"),
        ({"num_iters": 0}, ValueError, "num_iters"),
        ({"num_iters": True}, TypeError, "num_iters"),
    ]
    for override, error, name in cases:
        args = {"q": q, "k": k, "v": v, **override}
        tensors = {key: args.pop(key) for key in ("q", "k", "v")}
        with pytest.raises(error, match=name):
            ska(**tensors, **args)


def test_float64_takes_the_reference_path(triton_interpreter):
    q, k, v = make_inputs(1, 12, 2, 16, 16, dtype=torch.float64)
    assert dispatch.select_backend(q, k, v) == "torch"
    assert_close(ska(q, k, v, causal=True), ska_recurrent(q, k, v, causal=True), tol=1e-10)


def test_output_takes_the_value_dtype():
    q, k, v = make_inputs(1, 6, 1, 16, 16)
    assert ska(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=False).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------------------------
# GPU: the Triton kernels at real shapes (bf16 and fp32) against the float64 vectorised path (equal to the spec,
# test_whitened_pipeline_equals_g_form), including the launch plans' direct relaunch and CUDA-graph capture


GPU_SHAPES = [(16, 196, 8, 16, 64), (16, 49, 16, 16, 64), (2, 1024, 4, 16, 64), (4, 196, 4, 32, 32),
              (2, 77, 2, 64, 128), (3, 5, 2, 16, 16)]


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "B{}-T{}-H{}-R{}-V{}".format(*s))
def test_gpu_bf16_matches_spec(poison_outputs, causal, shape):
    B, T, H, R, V = shape
    tensors = make_inputs(B, T, H, R, V, seed=T, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # the second call relaunches the compiled kernels directly
        check_against_spec(tensors, causal=causal, ridge=ridge_for(T), fwd_tol=BF16_TOL, grad_tol=BF16_TOL,
                           reference=ska_parallel)


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T", [1, 2, 49, 65, 196, 257])
def test_gpu_fp32_matches_spec(poison_outputs, causal, T):
    check_against_spec(make_inputs(2, T, 4, 16, 64, seed=T, device="cuda"), causal=causal, ridge=ridge_for(T),
                       reference=ska_parallel)


@pytest.mark.cuda
def test_gpu_paper_ridge_bf16(poison_outputs):
    check_against_spec(make_inputs(16, 196, 8, 16, 64, device="cuda", dtype=torch.bfloat16), causal=False,
                       ridge=1e-3, fwd_tol=BF16_TOL, grad_tol=BF16_TOL, reference=ska_parallel)


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_cuda_graph_replay(causal):
    q, k, v = (t.requires_grad_(True) for t in make_inputs(8, 196, 8, 16, 64, device="cuda", dtype=torch.bfloat16))
    do = torch.randn_like(v)
    step = lambda: torch.autograd.grad(ska(q, k, v, causal=causal), (q, k, v), do)
    expected = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, expected):
        assert torch.isfinite(a).all()
        assert_close(a, b, tol=1e-2)


# ---------------------------------------------------------------------------------------------------------------
# The registered op (torch.compile / torch.export)


def _op():
    import importlib

    return importlib.import_module("visionssm.kernels.ska.custom_op").ska_op


def _opcheck(causal, requires_grad, T, *, power=2, num_iters=3, normalize=True, V=16):
    q, k, v = (t.requires_grad_(requires_grad) for t in make_inputs(1, T, 1, 16, V, seed=T))
    torch.library.opcheck(_op(), (q, k, v, causal, 1e-2, power, num_iters, normalize, requires_grad))


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("causal", [False, True], ids=["global", "causal"])
def test_opcheck_reference(reference_path, causal, requires_grad):
    _opcheck(causal, requires_grad, 7)


@pytest.mark.parametrize("options", [{"power": 0}, {"normalize": False, "power": 1}], ids=["power0", "unnormalized"])
def test_opcheck_reference_options(reference_path, options):
    _opcheck(True, True, 5, **options)


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("causal, T", [(False, 5), (True, 17)], ids=["global", "causal"])
def test_opcheck_interpreter(triton_interpreter, poison_outputs, causal, T, requires_grad):
    """Causal: two chunks of 16 tokens, so the saved chunk states have more than one row each."""
    _opcheck(causal, requires_grad, T)


def test_op_without_saved_tensors_refuses_the_backward(triton_interpreter):
    q, k, v = (t.requires_grad_(True) for t in make_inputs(1, 5, 1, 16, 16))
    out = _op()(q, k, v, False, 1e-2, 2, 3, True, False)[0]
    with pytest.raises(RuntimeError, match="save=False"):
        out.sum().backward()


def _compiled_against_eager(compile_kwargs, *, causal, views=False, dtype=torch.float32, device="cpu", tol=0.0,
                            shape=(1, 7, 2, 16, 16)):
    tensors = make_inputs(*shape, seed=shape[1], dtype=dtype, device=device)
    fn = lambda q, k, v: ska(q, k, v, causal=causal, ridge=1e-2)  # noqa: E731
    inputs = projection_views(*tensors) if views else tensors
    assert torch._dynamo.explain(fn)(*inputs).graph_break_count == 0
    do = torch.randn(tensors[2].shape, generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(fn, fullgraph=True, **compile_kwargs)
    results = []
    for f in (compiled, fn):
        leaves = [t.detach().requires_grad_(True) for t in inputs]
        out = f(*leaves)
        out.backward(do.to(device=out.device, dtype=out.dtype))
        results.append([out.detach(), *(t.grad for t in leaves)])
    for name, got, want in zip(("o", "dq", "dk", "dv"), *results):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("causal", [False, True], ids=["global", "causal"])
def test_compile_fullgraph_reference(reference_path, causal):
    """No graph break: the reference's data-dependent Cholesky retry runs inside the op, not in the traced code."""
    _compiled_against_eager({"backend": "aot_eager"}, causal=causal)


@pytest.mark.parametrize("causal, views", [(False, True), (True, False)], ids=["global-views", "causal"])
def test_compile_fullgraph_interpreter(triton_interpreter, poison_outputs, causal, views):
    """Non-causal with q, k, v views of one projection's output, read in place by the op as by the eager path."""
    _compiled_against_eager({"backend": "aot_eager"}, causal=causal, views=views,
                            shape=(1, 7 if views else 17, 2, 16, 16))


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True], ids=["global", "causal"])
def test_gpu_compile_inductor_bf16(poison_outputs, causal):
    _compiled_against_eager({}, causal=causal, views=not causal, dtype=torch.bfloat16, device="cuda",
                            shape=(4, 49, 4, 16, 64))


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True], ids=["global", "causal"])
def test_gpu_compile_cuda_graphs(causal):
    """mode="reduce-overhead": the op runs inside the captured CUDA graph (replays after the warm-up calls)."""
    q, k, v = make_inputs(4, 49, 4, 16, 64, device="cuda", dtype=torch.bfloat16)
    fn = lambda q, k, v: ska(q, k, v, causal=causal)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        expected = fn(q, k, v)
        for _ in range(3):
            got = compiled(q, k, v).clone()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
