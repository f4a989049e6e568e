"""Causal GKA on the stage-split Triton kernels (kernels/gka/kernel_causal*.py, launch_causal.py):
every solver's forward and every gradient against the float64 specification of kernels/gka/naive.py, in Triton's
interpreter (tiny shapes) and on the GPU (cuda-marked), plus the generated per-token solve and the launch plans."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gka_inputs import adversarial_keys, make_inputs, run_with_grads

from visionssm.kernels import dispatch
from visionssm.kernels.gka import gka, resolve_solver
from visionssm.kernels.gka.naive import gka_chunked, gka_recurrent
from visionssm.kernels.tuning import launch_overrides
from visionssm.kernels.utils import assert_close, relative_error

GRAD_NAMES = ("q", "k", "v", "g", "beta", "alpha")
# direct: the exact ridge solution in fp32; chebyshev: the paper's iteration (the tolerances of test_gka.py)
TOL = {"direct": (1e-5, 1e-4), "chebyshev": (2e-3, 2e-2)}


def reference(tensors, do, solver, num_iters=30):
    """float64 output (the token loop) and gradients (autograd through the exact solve: what implicit
    differentiation computes, for either solver's forward), on the inputs' device (float64 on the GPU keeps the
    full-size target shapes inside a test's time). Only ``"chebyshev"`` is compared with its own iteration: every
    other solver promises closeness to the exact solve."""
    ref_in = [None if t is None else t.detach().double() for t in tensors]
    out = gka_recurrent(*ref_in, causal=True, num_iters=num_iters, exact=solver != "chebyshev")
    _, grads = run_with_grads(lambda *a: gka_chunked(*a, causal=True, exact=True, chunk_size=16), ref_in,
                              do.to(ref_in[0].device))
    return out, grads


def check(tensors, solver, *, fwd_tol=None, grad_tol=None, num_iters=30, ref=None):
    fwd_tol = fwd_tol or TOL[solver][0]
    grad_tol = grad_tol or TOL[solver][1]
    B, T, H, V = tensors[2].shape
    do = torch.randn(B, T, H, V, dtype=torch.float64, generator=torch.Generator().manual_seed(T))
    out, grads = run_with_grads(lambda *a: gka(*a, causal=True, solver=solver, num_iters=num_iters), tensors,
                                do.to(tensors[0].device))
    ref_out, ref_grads = ref if ref is not None else reference(tensors, do, solver, num_iters)
    assert_close(out, ref_out, tol=fwd_tol, name=f"o ({solver})")
    for name, grad, expected in zip(GRAD_NAMES, grads, ref_grads):
        if expected is None:
            continue
        assert grad is not None, f"no gradient for {name}"
        assert_close(grad, expected, tol=grad_tol, name=f"d{name} ({solver})")
    return out


# ----------------------------------------------------------------------------------------------------------------
# The generated per-token solve


def test_generated_module_is_current():
    from visionssm.kernels.gka import codegen

    assert codegen.TARGET.read_text() == codegen.generate(), \
        "kernel_causal_direct.py is stale: run python kernels/gka/codegen.py"


def test_cholesky_operation_list_solves_spd_systems():
    """The factorisation's operation list (rendered as PTX on the GPU and as Triton code in the interpreter) solves
    (H + λI) x = b to float64 accuracy, also for the near rank-1 systems of a single key."""
    from visionssm.kernels.gka.codegen import K, cholesky_ops, evaluate

    rng = np.random.default_rng(0)
    n = 64
    keys = rng.standard_normal((n, 8, K))
    keys[:16, 1:] = keys[:16, :1]                               # rank-1 H for the first systems
    H = np.einsum("nsi,nsj->nij", keys, keys)
    lam = 0.02 * np.linalg.norm(H, axis=(1, 2))
    A = H + lam[:, None, None] * np.eye(K)
    b = rng.standard_normal((n, K))
    inputs, ops, outputs = cholesky_ops("v", "x")
    values = {f"a{i}_{j}": A[:, i, j] for i in range(K) for j in range(i + 1)}
    values.update({f"v{i}": b[:, i] for i in range(K)})
    result = evaluate(ops, values)
    x = np.stack([result[name] for name in outputs], axis=1)
    expected = np.linalg.solve(A, b[..., None])[..., 0]
    assert np.abs(x - expected).max() / np.abs(expected).max() < 1e-10


# ----------------------------------------------------------------------------------------------------------------
# Interpreter (CPU): tiny shapes, NaN-poisoned outputs


@pytest.mark.parametrize("T", [1, 5, 63, 65, 197, 257])
def test_interpreter_direct_lengths(triton_interpreter, poison_outputs, T):
    # two heads: one token's output β v (k·z) can nearly cancel, and then its relative error is bound by the
    # conditioning for any fp32 solve (a rank-1 H at T = 1: ~1e-5 in LAPACK's fp32 Cholesky too)
    tensors = make_inputs(1, T, 2, 16, 16, use_beta=T % 2 == 1, use_alpha=T % 3 != 0, seed=T)
    check(tensors, "direct")


@pytest.mark.parametrize("T", [49, 52])
def test_interpreter_direct_programs_past_the_last_chunk(triton_interpreter, poison_outputs, T):
    """Enough (batch, head) pairs that the per-token solve's programs for positions past the last chunk's length
    cover only the chunks before it, and whole programs have no token (chunk-major instances): T = 49 leaves one
    token in the last chunk, T = 52 four (one position block)."""
    from visionssm.kernels.gka.launch_causal import LANE_WARPS, POSITIONS, launch_config

    B, H = 2, 10
    cfg = launch_config(16, 16, True)
    per_program = 32 * LANE_WARPS // POSITIONS
    chunks = -(-T // cfg["chunk"])
    n_inst = B * H * chunks
    programs = -(-n_inst // per_program)
    assert (programs - 1) * per_program >= n_inst - B * H, "no program would be skipped at this shape"
    check(make_inputs(B, T, H, 16, 16, use_beta=T % 2 == 1, seed=T), "direct")


@pytest.mark.parametrize("T", [1, 5, 63, 65, 197])
def test_interpreter_chebyshev_lengths(triton_interpreter, poison_outputs, T):
    tensors = make_inputs(1, T, 1, 16, 16, use_beta=T % 2 == 0, use_alpha=T % 3 == 0, seed=T)
    check(tensors, "chebyshev")


@pytest.mark.parametrize("solver", ["direct", "chebyshev"])
@pytest.mark.parametrize("K,V", [(16, 32), (32, 16), (64, 64)])
def test_interpreter_head_dims(triton_interpreter, poison_outputs, solver, K, V):
    # direct at K ≥ 32 is the iteration run to fp32 convergence; at K = 16 the per-token factorisation
    tensors = make_inputs(2, 21, 1, K, V, seed=K + V)
    check(tensors, solver)


@pytest.mark.parametrize("K", [16, 64])
def test_interpreter_direct_vs_chebyshev(triton_interpreter, K):
    tensors = make_inputs(1, 40, 2, K, K, seed=7)
    direct = gka(*tensors, solver="direct")
    cheb = gka(*tensors, solver="chebyshev", num_iters=30)
    assert_close(cheb, direct, tol=1e-3, name="chebyshev-30 vs direct")
    assert relative_error(gka(*tensors, solver="chebyshev", num_iters=10), direct) > 1e-3  # the check can fail


def test_interpreter_bf16_split_products(triton_interpreter, poison_outputs):
    """16-bit inputs take the bf16 hi/lo split products (emulated in fp32 in the interpreter)."""
    tensors = make_inputs(1, 45, 1, 16, 32, dtype=torch.bfloat16, seed=3)
    for solver in ("direct", "chebyshev"):
        out = check(tensors, solver, fwd_tol=2e-2, grad_tol=3e-2)
        assert out.dtype == torch.bfloat16


def check_bf16_keys_fp32_values(shape, device, seed):
    """bf16 queries and keys with fp32 values and gates: the value-side products must keep v (and dO, which takes
    v's dtype) in fp32, so the output and the fp32 gradients stay at fp32 accuracy for the keys the kernels were
    given (rounding v to bf16 in those products puts ≈ 2⁻⁹ into them: 3.3e-3 on o). dq and dk come back in bf16."""
    tensors = make_inputs(*shape, device=device, seed=seed)
    tensors[0], tensors[1] = tensors[0].bfloat16(), tensors[1].bfloat16()
    B, T, H, V = tensors[2].shape
    do = torch.randn(B, T, H, V, dtype=torch.float64, generator=torch.Generator().manual_seed(T))
    out, grads = run_with_grads(lambda *a: gka(*a, causal=True, solver="direct"), tensors, do.to(device))
    ref_out, ref_grads = reference(tensors, do, "direct")
    assert out.dtype == torch.float32
    assert_close(out, ref_out, tol=1e-4, name="o")
    for name, grad, expected in zip(GRAD_NAMES, grads, ref_grads):
        assert grad.dtype == (torch.bfloat16 if name in "qk" else torch.float32), name
        assert_close(grad, expected, tol=1e-2 if name in "qk" else 1e-3, name=f"d{name}")


def test_interpreter_bf16_keys_fp32_values(triton_interpreter, poison_outputs):
    check_bf16_keys_fp32_values((1, 37, 2, 16, 16), "cpu", seed=11)


def test_interpreter_strong_gates(triton_interpreter, poison_outputs):
    # fast forgetting (g down to ≈ −20 per token): every decay weight underflows to 0 within a few tokens
    tensors = make_inputs(1, 40, 2, 16, 16, gate_scale=10.0)
    check(tensors, "direct")
    check(tensors, "chebyshev")


@pytest.mark.parametrize("solver", ["direct", "chebyshev"])
def test_interpreter_zero_keys(triton_interpreter, poison_outputs, solver):
    q, k, v, g, beta, alpha = make_inputs(1, 20, 1, 16, 16)
    k = k.clone()
    k[:, :7] = 0.0                                       # ‖H_t‖_F = 0 for the first 7 tokens
    tensors = [t.requires_grad_(True) for t in (q, k, v, g, beta, alpha)]
    out = gka(*tensors, solver=solver)
    out.sum().backward()
    assert torch.isfinite(out).all() and out[:, :7].abs().max() == 0
    assert all(torch.isfinite(t.grad).all() for t in tensors)
    ref = gka_recurrent(*[t.detach().double() for t in tensors], exact=solver == "direct")
    assert_close(out.detach(), ref, tol=TOL[solver][0], name="o")


def test_interpreter_launch_settings(triton_interpreter, poison_outputs):
    """32-token chunks of the per-token solve give the same result; unknown settings fail."""
    tensors = make_inputs(1, 37, 1, 16, 16, seed=11)
    base = gka(*tensors, solver="direct")
    with launch_overrides("gka", chunk=32):
        assert_close(gka(*tensors, solver="direct"), base, tol=1e-6, name="chunk 32")
    with launch_overrides("gka", wrong=1), pytest.raises(ValueError, match="wrong"):
        gka(*tensors, solver="direct")
    with launch_overrides("gka", positions=4), pytest.raises(ValueError, match="positions"):
        gka(*tensors, solver="direct")


@pytest.mark.parametrize("solver", ["direct", "chebyshev"])
def test_interpreter_fused_adjoint_grad(triton_interpreter, poison_outputs, solver):
    """The fused adjoint-scan + gradient kernel (16-wide heads' default) and the separate scan and chunk-parallel
    gradient kernels compute the same gradients; the fused kernel refuses wider heads."""
    tensors = make_inputs(2, 37, 2, 16, 16, seed=13)
    do = torch.randn(2, 37, 2, 16, dtype=torch.float32, generator=torch.Generator().manual_seed(2))
    _, fused = run_with_grads(lambda *a: gka(*a, solver=solver), tensors, do)
    with launch_overrides("gka", fused_grad=False):
        _, split = run_with_grads(lambda *a: gka(*a, solver=solver), tensors, do)
    for name, a, b in zip(GRAD_NAMES, fused, split):
        assert_close(a, b, tol=1e-5, name=f"d{name} fused vs separate")
    wide = make_inputs(1, 9, 1, 16, 32, seed=1)
    with launch_overrides("gka", fused_grad=True), pytest.raises(ValueError, match="fused_grad"):
        gka(*wide, solver=solver)


@pytest.mark.parametrize("T", [17, 37, 49])
def test_interpreter_fused_split_walks(triton_interpreter, poison_outputs, T):
    """Sequences of a last wave split in two programs (the late chunks; their adjoint-state shares, then the early
    chunks) give the gradients of one program per sequence: all six sequences split, or some of them (4 or 5 slots),
    with the rule's late chunk count; at T = 17 and 49 the last chunk is a single token (the vector step), at T = 17
    (one late chunk) that token alone."""
    tensors = make_inputs(2, T, 3, 16, 16, seed=T)
    do = torch.randn(2, T, 3, 16, dtype=torch.float32, generator=torch.Generator().manual_seed(3))
    with launch_overrides("gka", fused_wave_slots=0):
        _, whole = run_with_grads(lambda *a: gka(*a, solver="direct"), tensors, do)
    for slots in (12, 4, 5):
        with launch_overrides("gka", fused_wave_slots=slots):
            _, split = run_with_grads(lambda *a: gka(*a, solver="direct"), tensors, do)
        for name, a, b in zip(GRAD_NAMES, split, whole):
            assert_close(a, b, tol=1e-5, name=f"d{name} split ({slots} slots) vs whole")


def test_fused_split_rule():
    """The last wave's sequences are split only when it would be at most half full, by the SM count on the default
    one-warp kernel, never on sequences of a single chunk; bad settings are refused by name."""
    from visionssm.kernels.gka.launch_causal import fused_split, late_chunks, launch_config

    cfg = launch_config(16, 16, per_token=True)
    assert fused_split(cfg, 2560, 13, 132) == (2112, late_chunks(13))   # 2.42 waves of 1,056
    assert fused_split(cfg, 5120, 4, 132) == (5120, 0)                 # last wave 85% full
    assert fused_split(cfg, 2112, 13, 132) == (2112, 0)                # whole waves
    assert fused_split(cfg, 8, 13, 132) == (0, late_chunks(13))        # less than half a wave: all split
    assert fused_split(cfg, 8, 1, 132) == (8, 0)                       # one chunk: nothing to split
    assert fused_split(cfg, 8, 13, 0) == (8, 0)                        # off the GPU unless slots are set
    assert fused_split({**cfg, "fused_wave_slots": 4}, 6, 13, 0) == (4, late_chunks(13))
    assert all(1 <= late_chunks(n) < n for n in range(2, 40))
    for name, value in (("fused_wave_slots", -1), ("fused_wave_slots", 2.5), ("chunk", 64)):
        with launch_overrides("gka", **{name: value}), pytest.raises(ValueError, match=name):
            launch_config(16, 16, per_token=True)


def test_converged_iteration_count():
    from visionssm.kernels.gka.launch_causal import converged_iters

    assert converged_iters(0.02) == 60
    assert converged_iters(0.5) < converged_iters(0.02) < converged_iters(1e-3)


def test_auto_solver_rule():
    assert resolve_solver("auto", True, 16) == "direct"
    assert resolve_solver("auto", True, 32) == "chebyshev_auto"
    assert resolve_solver("auto", True, 128) == "chebyshev_auto"
    assert resolve_solver("auto", False, 128) == "direct"
    assert resolve_solver("chebyshev", True, 128) == "chebyshev"


def coarse_step_errors(D: int, ridge: float, coarse: list[int], n: int = 2000, seed: int = 0,
                       steps: int | None = None) -> dict:
    """Worst relative error of x̂ against the exact ridge solve, in float64, when the first ``c`` of ``steps``
    Chebyshev steps (default: those of :func:`.naive.auto_chebyshev_steps`), for each ``c`` in ``coarse``, round H
    and the iterate to bf16 in their product, as the kernels' one-pass bf16 steps do (they round H0, the iterate and
    the in-chunk scores).
    The matrices are decayed sums of 1 to 300 unit keys, a third of them strongly correlated; the rank-one ones
    attain the bound."""
    from visionssm.kernels.gka.naive import auto_chebyshev_steps, chebyshev_solve

    gen = torch.Generator().manual_seed(seed)
    mats = []
    for i in range(n):
        m = (1, 2, 3, 5, 10, 30, 100, 300)[i % 8]
        keys = torch.randn(m, D, dtype=torch.float64, generator=gen)
        if i % 3 == 0:
            keys = keys + 3 * torch.randn(1, D, dtype=torch.float64, generator=gen)
        keys = keys / keys.norm(dim=1, keepdim=True)
        weights = torch.rand(m, dtype=torch.float64, generator=gen) ** (1 + i % 5)
        mats.append((keys.T * weights) @ keys)
    H = torch.stack(mats)
    rhs = torch.randn(n, D, dtype=torch.float64, generator=gen)
    fro = torch.linalg.matrix_norm(H)
    lam = ridge * fro
    A = H + lam[:, None, None] * torch.eye(D, dtype=torch.float64)
    exact = torch.linalg.solve(A, rhs)
    bf16 = lambda t: t.to(torch.bfloat16).double()
    H_bf16 = bf16(H)
    full = lambda x: (A @ x.unsqueeze(-1)).squeeze(-1)
    rough = lambda x: (H_bf16 @ bf16(x).unsqueeze(-1)).squeeze(-1) + lam[:, None] * x
    steps = steps or auto_chebyshev_steps(ridge)[0]
    errors = {}
    for c in coarse:
        x = chebyshev_solve(full, rhs, lam, fro, steps, rough, c)
        errors[c] = ((x - exact).norm(dim=1) / exact.norm(dim=1)).max().item()
    return errors


@pytest.mark.parametrize("ridge", [0.005, 0.02, 0.1])
def test_auto_chebyshev_steps_keep_the_promise(ridge):
    """The steps and coarse steps ``auto`` runs keep x̂ within AUTO_TOLERANCE of the exact solve in a float64 model
    of the one-pass bf16 rounding (rank-one and correlated-key matrices included), where running every step coarse
    would not; the step count grows as the ridge shrinks (κ = 1 + 1/ridge), unlike the paper's fixed 30."""
    from visionssm.kernels.gka.naive import AUTO_TOLERANCE, auto_chebyshev_steps, chebyshev_steps

    steps, coarse = auto_chebyshev_steps(ridge)
    assert 0 < coarse < steps and chebyshev_steps(ridge, AUTO_TOLERANCE) <= steps
    errors = coarse_step_errors(64, ridge, [coarse, steps], n=400)
    assert errors[coarse] <= AUTO_TOLERANCE < errors[steps]
    assert auto_chebyshev_steps(0.02) == (29, 10)
    full, none = auto_chebyshev_steps(ridge, coarse=False)
    assert none == 0 and steps - 3 <= full < steps
    assert coarse_step_errors(64, ridge, [0], n=400, steps=full)[0] <= AUTO_TOLERANCE


def test_inference_path_matches_autograd_path(triton_interpreter):
    tensors = make_inputs(1, 19, 1, 16, 16, seed=5)
    with torch.no_grad():
        plain = gka(*tensors)
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    assert torch.equal(gka(*leaves).detach(), plain)


def test_launch_config_wide_heads():
    """The wide-head defaults pass the settings' own checks (state rows divide K, columns divide K and V); 64-token
    chunks are refused with the setting named (they end in an illegal memory access on the GPU)."""
    from visionssm.kernels.gka.launch_causal import launch_config

    for K, V in ((64, 64), (128, 128), (128, 64)):
        cfg = launch_config(K, V, False)
        assert K % cfg["state_rows"] == 0 and K % cfg["columns"] == 0 and V % cfg["columns"] == 0
    with launch_overrides("gka", chunk=64), pytest.raises(ValueError, match="chunk"):
        launch_config(128, 128, False)


@pytest.mark.parametrize("settings", [{}, {"chunk": 16}], ids=["defaults", "chunk16"])
def test_interpreter_chebyshev_head128(triton_interpreter, poison_outputs, settings):
    """The chunked Chebyshev solve on 128-wide heads (scans on 16-row blocks) in both chunk sizes."""
    tensors = make_inputs(1, 37, 1, 128, 128, seed=13)
    with launch_overrides("gka", **settings):
        check(tensors, "chebyshev")


@pytest.mark.parametrize("T", [33, 70])
@pytest.mark.parametrize("solver", ["chebyshev", "auto"])
def test_interpreter_chebyshev_head64_bf16(triton_interpreter, poison_outputs, T, solver):
    """bf16 inputs take the hi/lo split products (emulated in fp32 in the interpreter), and ``auto``'s coarse steps
    their one-pass products; odd lengths, no β for one. ``auto`` against the exact solve."""
    tensors = make_inputs(1, T, 2, 64, 64, dtype=torch.bfloat16, use_beta=T % 2 == 0, seed=T)
    check(tensors, solver, fwd_tol=2e-2, grad_tol=3e-2)


@pytest.mark.parametrize("T", [33, 50])
def test_interpreter_coarse_launch_matches_one_launch(triton_interpreter, poison_outputs, T):
    """The coarse steps in a launch of their own (the iterates and ‖H_t‖_F through memory, ω again from its
    recurrence) give what one launch running both loops gives, outputs and every gradient bit for bit; odd lengths,
    no β for one. (A resumed iterate, ω or norm that were off by anything would show.)"""
    from visionssm.kernels.gka import launch_causal

    tensors = make_inputs(1, T, 2, 64, 64, dtype=torch.bfloat16, use_beta=T % 2 == 1, seed=T)
    do = torch.randn(1, T, 2, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(T))
    results = {}
    for separate in (False, True):
        with launch_overrides("gka", coarse_launch=separate):  # entering and leaving empty the plan cache
            plan = launch_causal.fwd_plan(*tensors, "chebyshev_auto", 30, 0.02)
            assert plan.num_coarse > 0 and (plan.coarse is not None) == separate
            results[separate] = run_with_grads(lambda *a: gka(*a, causal=True, solver="auto"), tensors, do)
    (out0, grads0), (out1, grads1) = results[False], results[True]
    assert torch.equal(out0, out1)
    for name, g0, g1 in zip(GRAD_NAMES, grads0, grads1):
        assert (g0 is None) == (g1 is None) and (g0 is None or torch.equal(g0, g1)), f"d{name}"


@pytest.mark.parametrize("K", [32, 64])
def test_interpreter_coarse_steps_alone(triton_interpreter, poison_outputs, monkeypatch, K):
    """Every step coarse (one-pass products) against the same number of float64 steps: the coarse product itself is
    checked here, which the full steps after it would otherwise correct. Twelve one-pass steps land 2-5e-2 from the
    float64 iterate (3e-3 with full-precision steps); a product missing a term lands far off."""
    from visionssm.kernels.gka import launch_causal

    monkeypatch.setattr(launch_causal, "auto_chebyshev_steps", lambda ridge, coarse: (12, 12 if coarse else 0))
    launch_causal._FWD_PLANS.clear()
    tensors = make_inputs(1, 37, 1, K, K, dtype=torch.bfloat16, seed=K)
    with torch.no_grad():
        out = gka(*tensors)
    launch_causal._FWD_PLANS.clear()
    ref = gka_recurrent(*[t.double() for t in tensors], causal=True, num_iters=12)
    assert_close(out, ref, tol=8e-2, name="o (12 coarse steps)")


# ----------------------------------------------------------------------------------------------------------------
# GPU (cuda-marked)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(2, 196, 4, 16, 16), (4, 49, 8, 16, 16), (1, 300, 2, 16, 32), (3, 65, 2, 32, 16)],
                         ids=lambda s: "x".join(map(str, s)))
def test_cuda_direct_fp32(poison_outputs, shape):
    check(make_inputs(*shape, device="cuda"), "direct")


@pytest.mark.cuda
@pytest.mark.parametrize("T", [196, 49])
def test_cuda_fused_split_walks(poison_outputs, T):
    """On the GPU, with the SM count's rule: 330 sequences (less than half a wave) all split, against one program per
    sequence (fp32 inputs, so that both are fp32-exact)."""
    from visionssm.kernels.gka.launch_causal import fused_split, launch_config
    from visionssm.kernels.utils import sm_count

    sms = sm_count(torch.device("cuda"), 0)
    assert fused_split(launch_config(16, 16, per_token=True), 330, -(-T // 16), sms)[0] == 0
    tensors = make_inputs(33, T, 10, 16, 16, device="cuda", seed=T)
    do = torch.randn(33, T, 10, 16, device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    _, split = run_with_grads(lambda *a: gka(*a, solver="direct"), tensors, do)
    with launch_overrides("gka", fused_wave_slots=0):
        _, whole = run_with_grads(lambda *a: gka(*a, solver="direct"), tensors, do)
    for name, a, b in zip(GRAD_NAMES, split, whole):
        assert_close(a, b, tol=1e-5, name=f"d{name} split vs whole")


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(2, 196, 4, 16, 16), (1, 300, 2, 32, 64), (1, 1000, 2, 64, 64),
                                   (1, 117, 2, 128, 128)], ids=lambda s: "x".join(map(str, s)))
def test_cuda_chebyshev_fp32(poison_outputs, shape):
    check(make_inputs(*shape, device="cuda"), "chebyshev")


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(2, 197, 4, 16, 16), (1, 129, 2, 64, 64)], ids=lambda s: "x".join(map(str, s)))
def test_cuda_bf16_keys_fp32_values(poison_outputs, shape):
    check_bf16_keys_fp32_values(shape, "cuda", seed=12)


@pytest.mark.cuda
@pytest.mark.parametrize("K", [16, 64])
def test_cuda_direct_vs_chebyshev(K):
    tensors = make_inputs(2, 197, 3, K, K, device="cuda", seed=K)
    assert_close(gka(*tensors, solver="chebyshev"), gka(*tensors, solver="direct"), tol=1e-3,
                 name="chebyshev-30 vs direct")


@pytest.mark.cuda
@pytest.mark.parametrize("K", [32, 64, 128])
@pytest.mark.parametrize("ridge", [0.005, 0.02])
def test_cuda_auto_within_promise_of_exact(K, ridge):
    """Causal heads wider than 16: ``auto`` (fewer steps, the first ones one-pass: TF32 for fp32 inputs) against
    the fp32-converged solve: the output within the 1e-3 it promises; the gradients, whose sums cancel more (dk
    measured 3-5e-3 at ridge 0.005, κ = 201), within 1e-2."""
    tensors = make_inputs(2, 197, 3, K, K, device="cuda", seed=K)
    do = torch.randn_like(tensors[2])
    auto, auto_grads = run_with_grads(lambda *a: gka(*a, ridge=ridge), tensors, do)
    exact, exact_grads = run_with_grads(lambda *a: gka(*a, ridge=ridge, solver="direct"), tensors, do)
    assert_close(auto, exact, tol=1e-3, name="o auto vs direct")
    for name, grad, expected in zip(GRAD_NAMES, auto_grads, exact_grads):
        assert_close(grad, expected, tol=1e-2, name=f"d{name} auto vs direct")


# the benchmark's target shapes, bf16, at full size; the reference runs on the first batch entries
TARGET_SHAPES = [(256, 196, 10, 16, 16), (256, 49, 20, 16, 16), (256, 197, 6, 64, 64), (4, 2048, 8, 128, 128)]


@pytest.mark.cuda
@pytest.mark.parametrize("shape", TARGET_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cuda_bf16_target_shapes(poison_outputs, shape):
    B, T, H, K, V = shape
    tensors = make_inputs(*shape, dtype=torch.bfloat16, device="cuda", seed=B + T)
    do = torch.randn(B, T, H, V, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out, grads = run_with_grads(lambda *a: gka(*a, causal=True), tensors, do.to("cuda"))
    assert torch.isfinite(out).all() and all(torch.isfinite(g_).all() for g_ in grads)
    # the chunked reference holds a K×K matrix per token: at 128-wide heads one sequence of two heads (0.5 GB each)
    n, h = (1, 2) if K >= 128 else (min(B, 4), H)
    solver = resolve_solver("auto", True, K)
    ref_out, ref_grads = reference([t[:n, :, :h] for t in tensors], do[:n, :, :h], solver)
    assert_close(out[:n, :, :h], ref_out, tol=2e-2, name="o")
    for name, grad, expected in zip(GRAD_NAMES, grads, ref_grads):
        assert_close(grad[:n, :, :h], expected, tol=3e-2, name=f"d{name}")


@pytest.mark.cuda
@pytest.mark.parametrize("K", [16, 32, 64, 128])
def test_cuda_stability_long_bf16(K):
    """T = 8192 with adversarial keys for the solver ``auto`` picks at this width (direct at 16, Chebyshev wider;
    at 128 its coarse steps in a launch of their own)."""
    T = 8192
    q, _, v, g, beta, alpha = make_inputs(1, T, 3, K, K, dtype=torch.float64)
    k = adversarial_keys(T, K)
    low = [t.to("cuda", torch.bfloat16) for t in (q, k, v, g, beta, alpha)]
    solver = resolve_solver("auto", True, K)
    leaves = [t.clone().requires_grad_(True) for t in low]
    out = gka(*leaves)
    out.float().square().mean().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in leaves)
    ref = gka_chunked(*[t.double() for t in low], causal=True, exact=solver != "chebyshev")
    for head in range(3):
        assert_close(out[:, :, head], ref[:, :, head], tol=1e-2, name=f"o head {head} ({solver})")


def _max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.cuda
def test_cuda_graph_replay_matches_eager():
    tensors = make_inputs(8, 49, 4, 16, 16, dtype=torch.bfloat16, device="cuda")
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    do = torch.randn_like(tensors[2])

    def step():
        # the output is returned detached: a live autograd graph would keep the leaves' gradient nodes on the stream
        # of the eager call, and a capture on another stream may not depend on it
        out = gka(*leaves)
        return (out.detach(), *torch.autograd.grad(out, leaves, do))

    names = ("o", "dq", "dk", "dv", "dg", "dbeta", "dalpha")
    eager = step()
    for name, a, b in zip(names, step(), eager):  # run to run: the kernels are deterministic
        assert torch.equal(a, b), f"{name}: a second eager run differs by {_max_diff(a, b):.3g}"
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
        with torch.cuda.graph(graph):
            captured = step()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(names, captured, eager):
        assert torch.equal(a, b), f"{name}: replay differs from eager by {_max_diff(a, b):.3g}"


def test_backend_is_interpreter_or_cuda():
    """Guard: the interpreter tests above really run the kernels (not the PyTorch path)."""
    if not dispatch.interpreter_enabled():
        pytest.skip("GPU machine")
    with dispatch.backend("triton"):
        assert dispatch.select_backend(torch.zeros(1)) == "triton"
