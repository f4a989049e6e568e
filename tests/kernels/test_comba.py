"""Comba op: every implementation against the float64 per-token loop of kernels/comba/naive.py (the spec)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from visionssm.kernels import comba as comba_op
from visionssm.kernels.comba import comba_chunked, comba_recurrent
from visionssm.kernels.tuning import launch_overrides
from visionssm.kernels.utils import assert_close

GRAD_NAMES = ("q", "k", "v", "p", "g", "beta")
LENGTHS = (1, 5, 63, 64, 65, 196, 320)


def make_inputs(B=2, T=5, H=2, K=16, V=16, dtype=torch.float32, device="cpu", gate_scale=1.0, seed=0):
    """Inputs shaped like the layer's: unit q/k, p = b·k with b ∈ (0, 1), β ∈ (0, 1), g = log α ≤ 0."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q = F.normalize(rand(B, T, H, K), dim=-1)
    k = F.normalize(rand(B, T, H, K), dim=-1)
    p = k * torch.sigmoid(rand(B, T, H, 1))
    v = rand(B, T, H, V)
    g = F.logsigmoid(rand(B, T, H)) / gate_scale
    beta = torch.sigmoid(rand(B, T, H))
    gate_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return [t.to(device=device, dtype=dtype if i < 4 else gate_dtype) for i, t in enumerate((q, k, v, p, g, beta))]


def reference_with_grads(inputs, do, *, causal, scale=None):
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    o = comba_recurrent(*leaves, scale=scale, causal=causal)
    o.backward(do.double())
    return o.detach(), [t.grad for t in leaves]


def run_with_grads(fn, inputs, do, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    o = fn(*leaves, **kwargs)
    o.backward(do.to(o.dtype))
    return o.detach(), [t.grad for t in leaves]


def check_against_reference(fn, inputs, *, causal, fwd_tol=1e-3, grad_tol=1e-2, **kwargs):
    B, T, H, _ = inputs[0].shape
    do = torch.randn(B, T, H, inputs[2].shape[-1], generator=torch.Generator().manual_seed(1)).to(inputs[2])
    ref_o, ref_grads = reference_with_grads([t.cpu() for t in inputs], do.cpu(), causal=causal,
                                            scale=kwargs.get("scale"))
    o, grads = run_with_grads(fn, inputs, do, causal=causal, **kwargs)
    assert o.dtype == inputs[2].dtype
    assert_close(o, ref_o, tol=fwd_tol, name="o")
    for name, grad, ref in zip(GRAD_NAMES, grads, ref_grads):
        assert grad is not None, f"no gradient reached {name}"
        assert_close(grad, ref, tol=grad_tol, name=f"d{name}")
    return (o, *grads)


# ---------------------------------------------------------------------------------------------------------------
# The spec itself


def test_recurrent_matches_hand_unrolled_steps():
    """Two tokens by hand: read before decay, then decay, then write."""
    q, k, v, p, g, beta = make_inputs(B=1, T=2, H=1, K=4, V=3, dtype=torch.float64)
    h = torch.zeros(4, 3, dtype=torch.float64)
    expected = []
    for t in range(2):
        u = beta[0, t, 0] * (v[0, t, 0] - h.T @ p[0, t, 0])
        h = g[0, t, 0].exp() * h + torch.outer(k[0, t, 0], u)
        expected.append(0.5 * h.T @ q[0, t, 0])
    o = comba_recurrent(q, k, v, p, g, beta, scale=0.5)
    torch.testing.assert_close(o[0, :, 0], torch.stack(expected), rtol=1e-12, atol=1e-12)


def test_noncausal_is_causal_plus_reversed_causal():
    x = make_inputs(T=7, dtype=torch.float64)
    o = comba_recurrent(*x, causal=False)
    expected = comba_recurrent(*x) + comba_recurrent(*[t.flip(1) for t in x]).flip(1)
    torch.testing.assert_close(o, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 130])
@pytest.mark.parametrize("causal", [True, False])
def test_chunked_float64_equals_recurrent(T, causal):
    x = [t.double() for t in make_inputs(T=T, K=8, V=4)]
    for chunk_size in (16, 64):
        assert_close(comba_chunked(*x, causal=causal, chunk_size=chunk_size), comba_recurrent(*x, causal=causal),
                     tol=1e-10, name=f"o (chunk {chunk_size})")


# ---------------------------------------------------------------------------------------------------------------
# CPU path of the public op


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("causal", [True, False])
def test_cpu_path_forward_and_gradients(T, causal, reference_path):
    x = make_inputs(B=2, T=T, H=2, K=16, V=16)
    check_against_reference(comba_op, x, causal=causal)


@pytest.mark.parametrize("gate_scale", [0.1, 10.0])
def test_cpu_path_gate_extremes(gate_scale, reference_path):
    x = make_inputs(T=70, gate_scale=gate_scale)
    check_against_reference(comba_op, x, causal=True)


def test_cpu_path_custom_scale_and_head_dims(reference_path):
    x = make_inputs(T=33, K=32, V=8)
    check_against_reference(comba_op, x, causal=False, scale=0.3)


def test_cpu_path_low_precision_output_dtype(reference_path):
    x = make_inputs(T=20, dtype=torch.bfloat16)
    o = comba_op(*x)
    assert o.dtype == torch.bfloat16
    assert_close(o, comba_recurrent(*[t.double() for t in x]), dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels in Triton's CPU interpreter (tiny shapes: B·H = 2, head dims 16 unless stated)


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("causal", [True, False])
def test_triton_interpreter_forward_and_gradients(T, causal, triton_interpreter, poison_outputs):
    x = make_inputs(B=1, T=T, H=2, K=16, V=16)
    check_against_reference(comba_op, x, causal=causal)


@pytest.mark.parametrize("K,V,T,causal", [(32, 16, 37, False), (64, 64, 33, True), (20, 12, 17, True),
                                          (128, 128, 18, False)])
def test_triton_interpreter_head_dims_and_value_split(K, V, T, causal, triton_interpreter, poison_outputs):
    """Non-power-of-two dims are padded in registers; V = 64, 128 with few heads splits V over programs."""
    x = make_inputs(B=1, T=T, H=1, K=K, V=V)
    check_against_reference(comba_op, x, causal=causal, scale=0.7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_interpreter_low_precision(dtype, triton_interpreter, poison_outputs):
    x = make_inputs(B=2, T=23, H=1, dtype=dtype)
    check_against_reference(comba_op, x, causal=False, fwd_tol=2e-2, grad_tol=4e-2)


@pytest.mark.parametrize("overrides", [{"split_bwd": True}, {"split_bwd": False}, {"split_bwd": True, "fwd_lp": True}],
                         ids=["split", "one-pass", "split-16-bit-forward"])
@pytest.mark.parametrize("causal", [True, False])
def test_triton_interpreter_bf16_states(overrides, causal, triton_interpreter, poison_outputs):
    """bf16 inputs keep the states saved for the backward in bf16 and multiply on 16-bit tensor cores (here the
    rounding alone): the float64 spec within bf16 tolerances, the single-token tail (T = 49) and the split backward's
    bf16 state gradients included. The setting is live: fp32 states give different bits."""
    x = make_inputs(B=1, T=49, H=2, K=16, V=32, dtype=torch.bfloat16)
    with launch_overrides("comba", state_lp=True, **overrides):
        low = check_against_reference(comba_op, x, causal=causal, fwd_tol=2e-2, grad_tol=4e-2)
    with launch_overrides("comba", state_lp=False, **overrides):
        full = check_against_reference(comba_op, x, causal=causal, fwd_tol=2e-2, grad_tol=4e-2)
    assert not all(torch.equal(a, b) for a, b in zip(low, full))


@pytest.mark.parametrize("forward_lp", [True, False])
def test_triton_interpreter_backward_follows_the_stored_states(forward_lp, triton_interpreter, poison_outputs):
    """A backward run under another ``state_lp`` than its forward reads the states as the forward stored them."""
    x = make_inputs(B=1, T=33, H=2, K=16, V=16, dtype=torch.bfloat16)
    do = torch.randn(1, 33, 2, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ref_o, ref_grads = reference_with_grads(x, do, causal=False)
    leaves = [t.detach().clone().requires_grad_() for t in x]
    with launch_overrides("comba", state_lp=forward_lp, split_bwd=True):
        o = comba_op(*leaves, causal=False)
    with launch_overrides("comba", state_lp=not forward_lp, split_bwd=True):
        o.backward(do)
    assert_close(o, ref_o, tol=2e-2, name="o")
    for name, leaf, ref in zip(GRAD_NAMES, leaves, ref_grads):
        assert_close(leaf.grad, ref, tol=4e-2, name=f"d{name}")


def test_triton_interpreter_gate_extremes_and_no_grad(triton_interpreter, poison_outputs):
    x = make_inputs(B=1, T=40, H=1, gate_scale=0.05)
    check_against_reference(comba_op, x, causal=True)
    with torch.no_grad():
        assert_close(comba_op(*x, causal=False), comba_recurrent(*[t.double() for t in x], causal=False), tol=1e-3)


@pytest.mark.parametrize("overrides", [
    {"dir_loop": True}, {"dir_loop": False, "store_inv": True}, {"dir_loop": True, "value_block": 16},
    {"pre_wy": True, "dir_loop": False, "value_block": 16}, {"pre_wy": True, "dir_loop": True},
    {"inv_pass": True, "dir_loop": True, "store_inv": False}, {"inv_pass": True, "dir_loop": False, "value_block": 16},
    {"prefetch": True, "bwd_prefetch": False, "dir_loop": True},
    {"bwd_prefetch": False, "dir_loop": False, "value_block": 16},
    {"split_bwd": True, "value_block": 16, "store_inv": True}, {"split_bwd": True, "store_inv": False},
    {"split_bwd": True, "dir_loop": False, "inv_pass": True}],
    ids=["directions-in-program", "directions-in-grid-stored-inverse", "directions-in-program-split-V",
         "chunk-parallel-wy-grid-split-V", "chunk-parallel-wy", "inverse-pass", "inverse-pass-grid-split-V",
         "prefetch-swapped", "no-backward-prefetch-grid-split-V", "split-backward-split-V-stored-inverse",
         "split-backward-recomputed-inverse", "split-backward-grid-inverse-pass"])
def test_triton_interpreter_launch_variants(overrides, triton_interpreter, poison_outputs):
    """Every launch layout the heuristics can pick computes the same thing (forced here on small shapes): directions
    in one program or over the grid, split value blocks, the chunk-parallel inverse and W/U0 passes, the backward
    with the forward's stored inverses or recomputing them, in one pass or split (a state-gradient walk, then one
    program per chunk)."""
    x = make_inputs(B=1, T=45, H=2, K=16, V=32)
    with launch_overrides("comba", **overrides):
        check_against_reference(comba_op, x, causal=False)


@pytest.mark.parametrize("overrides", [{}, {"dir_loop": False, "value_block": 16, "store_inv": True},
                                       {"inv_pass": True}, {"pre_wy": True, "bwd_prefetch": False},
                                       {"split_bwd": True, "value_block": 16}, {"split_bwd": True, "inv_pass": True}],
                         ids=["default", "grid-split-V-stored-inverse", "inverse-pass", "chunk-parallel-wy",
                              "split-backward", "split-backward-inverse-pass"])
@pytest.mark.parametrize("causal", [True, False])
def test_triton_interpreter_single_token_tail(overrides, causal, triton_interpreter, poison_outputs):
    """T = 49 = 3·16 + 1: the last chunk holds one token, a rank-1 step at the end of the forward walk and at the
    start of the reversed one (from the zero state)."""
    x = make_inputs(B=1, T=49, H=2, K=16, V=32)
    with launch_overrides("comba", **overrides):
        check_against_reference(comba_op, x, causal=causal, scale=0.8)


@pytest.mark.parametrize("T", [1, 17])
def test_triton_interpreter_single_token_edge_cases(T, triton_interpreter, poison_outputs):
    """One token in all (no chunk at all), and one full chunk before the single-token one."""
    x = make_inputs(B=2, T=T, H=1, K=16, V=16)
    with launch_overrides("comba", split_bwd=True, inv_pass=True):
        check_against_reference(comba_op, x, causal=False)
    check_against_reference(comba_op, x, causal=False)


@pytest.mark.parametrize("T", [45, 49])
def test_triton_interpreter_balanced_last_wave(T, triton_interpreter, poison_outputs):
    """With room for 4 programs at once, 3 batch entries of 2 heads fill one wave of both-direction forward walks
    (of a training call) with the first 2 entries; the last entry's sequences get one walk per direction, adding
    onto a zeroed output by atomic adds (fp32 here: Triton's interpreter has no 16-bit atomics). T = 49 adds the
    single-token tail."""
    launch = _reset_plans()
    x = make_inputs(B=3, T=T, H=2, K=16, V=16)
    with launch_overrides("comba", wave_slots=4, dir_loop=True):
        check_against_reference(comba_op, x, causal=False, scale=0.8)
        plan = launch.fwd_plan(x[0], x[2], x[4], x[5], causal=False, save_state=True)
        assert plan.zero_from == 2
        # forward-only calls keep both directions in every program (balancing measured slower there)
        assert launch.fwd_plan(x[0], x[2], x[4], x[5], causal=False, save_state=False).zero_from is None


@pytest.mark.parametrize("B, H, slots, pairs", [(3, 2, 4, 4), (5, 2, 4, 8), (3, 1, 2, 2), (2, 4, 4, 8),
                                                 (3, 2, 5, 4), (4, 2, 5, 8), (3, 2, 0, 6)])
def test_balanced_sequences(B, H, slots, pairs):
    """Which sequences keep both directions of the forward walk in one program: those of the full waves, in whole
    batch entries, and only where the rest then fits one wave of one-direction programs (B·H otherwise, and with
    ``wave_slots`` 0, without atomic adds, for causal calls)."""
    from visionssm.kernels.comba import launch

    with launch_overrides("comba", wave_slots=slots, dir_loop=True):
        cfg = launch.launch_config(16, 16, 196, B * H, 2)
    assert launch._pairs(cfg, B, H, 2, 0, atomic=True) == pairs
    assert launch._pairs(cfg, B, H, 2, 0, atomic=False) == B * H
    assert launch._pairs(cfg, B, H, 1, 0, atomic=True) == B * H


def test_balanced_sequences_by_sm_count():
    """Without ``wave_slots``: 8 one-warp walks per SM, so 2,110 of B256 H10's 2,560 sequences keep both directions on
    132 SMs; 64-wide heads (four-warp walks, whose count per SM was not measured) and CPU tensors are not balanced."""
    from visionssm.kernels.comba import launch

    cfg = launch.launch_config(16, 16, 196, 2560, 2)
    assert launch._pairs(cfg, 256, 10, 2, 132, atomic=True) == 2110
    assert launch._pairs(cfg, 256, 10, 2, 0, atomic=True) == 2560
    wide = launch.launch_config(64, 64, 197, 1536, 2)
    assert wide["num_warps"] > 1 and launch._pairs(wide, 256, 6, 2, 132, atomic=True) == 1536


@pytest.mark.parametrize("K,BH,split,grad_warps", [(64, 18, True, 2), (64, 80, True, 2), (64, 96, False, 4),
                                                    (64, 1536, False, 4), (128, 1536, True, 4), (32, 18, False, 4)])
@pytest.mark.parametrize("causal", [True, False])
def test_split_backward_rule(K, BH, split, grad_warps, causal):
    """The backward splits into a state-gradient walk and per-chunk programs for 128-wide keys, and for 64-wide ones
    up to 80 sequences (those per-chunk programs on two warps); the forward's layout does not follow it (no inverse
    pass nor stored inverses added to causal 64-wide training)."""
    from visionssm.kernels.comba import launch

    ND = 1 if causal else 2
    cfg = launch.launch_config(K, K, 4096, BH, ND)
    assert cfg["split_bwd"] is split
    assert cfg["grad_num_warps"] == grad_warps
    assert cfg["store_inv"] is (K > 64)
    if K == 64:
        assert cfg["inv_pass"] is not causal


def test_unknown_launch_setting_is_rejected(triton_interpreter):
    x = make_inputs(B=1, T=5, H=1)
    with launch_overrides("comba", chunk=32), pytest.raises(ValueError, match="chunk"):
        comba_op(*x)


def test_float64_takes_the_reference_path_under_triton(triton_interpreter):
    x = make_inputs(T=9, dtype=torch.float64)
    assert_close(comba_op(*x), comba_recurrent(*x), tol=1e-10)


# ---------------------------------------------------------------------------------------------------------------
# GPU (bf16 and fp32 at vision and LM sizes)


@pytest.mark.cuda
@pytest.mark.parametrize("B,T,H,K,V", [(8, 196, 4, 16, 16), (4, 49, 8, 64, 64), (2, 320, 2, 128, 128),
                                       (2, 1000, 2, 64, 32), (3, 7, 2, 32, 64)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_forward_and_gradients(B, T, H, K, V, causal, dtype, poison_outputs):
    x = make_inputs(B=B, T=T, H=H, K=K, V=V, dtype=dtype, device="cuda")
    tols = (1e-3, 1e-2) if dtype == torch.float32 else (2e-2, 4e-2)
    check_against_reference(comba_op, x, causal=causal, fwd_tol=tols[0], grad_tol=tols[1])


@pytest.mark.cuda
@pytest.mark.parametrize("overrides", [{"pre_wy": True}, {"store_inv": True, "inv_pass": False},
                                       {"dir_loop": False, "inv_pass": True, "store_inv": False},
                                       {"prefetch": False, "bwd_prefetch": False},
                                       {"split_bwd": False}, {"split_bwd": True, "store_inv": False}],
                         ids=["chunk-parallel-wy", "stored-inverse", "directions-in-grid-inverse-pass",
                              "no-prefetch", "one-pass-backward", "split-backward-recomputed-inverse"])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_launch_variants(overrides, causal, poison_outputs):
    """The layouts the heuristics pick for other shapes, forced on a small-head and a large-head shape in bf16 (the
    second with a single-token last chunk)."""
    for B, T, H, K, V in ((4, 196, 3, 16, 16), (1, 161, 2, 128, 64)):
        x = make_inputs(B=B, T=T, H=H, K=K, V=V, dtype=torch.bfloat16, device="cuda")
        with launch_overrides("comba", **overrides):
            check_against_reference(comba_op, x, causal=causal, fwd_tol=2e-2, grad_tol=4e-2)


def make_aligned_inputs(B, T, H, D, device, dtype=torch.bfloat16):
    """Nearly identical keys (neighbouring patches), b·β ≈ 0.8, slow decay: the chunk matrix A has entries near 1,
    where the product form of (I + A)^{-1} cancels terms in the thousands (single-pass TF32 loses ~10%)."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(B, 1, H, D, generator=gen, dtype=torch.float64)
    k = F.normalize(base + 0.05 * torch.randn(B, T, H, D, generator=gen, dtype=torch.float64), dim=-1)
    q = F.normalize(torch.randn(B, T, H, D, generator=gen, dtype=torch.float64), dim=-1)
    p = 0.9 * k
    v = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64)
    g = torch.full((B, T, H), -0.01, dtype=torch.float64)
    beta = 0.85 + 0.1 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return [t.to(device=device, dtype=dtype if i < 4 else torch.float32) for i, t in enumerate((q, k, v, p, g, beta))]


def test_aligned_keys_reference_paths_agree():
    """The hard case below is well posed: the chunked CPU path agrees with the token loop in float64."""
    x = [t.double() for t in make_aligned_inputs(1, 70, 1, 16, "cpu", torch.float64)]
    assert_close(comba_chunked(*x, chunk_size=16), comba_recurrent(*x), tol=1e-10)


def make_iplr_inputs(B, T, H, D, device, dtype=torch.bfloat16, seed=4):
    """Comba-iplr through the kernel's per-token p: the transition α(I − 2β̃ k kᵀ) with write gate β is
    e^g I − β k pᵀ for p = 2 e^g β̃ k / β. Aligned keys and β̃ near 1 put the chunk matrix A's entries near 2 (the
    transition's eigenvalue along k near −1), where a power series for (I + A)^{-1} cancels terms of ~10⁶."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(B, 1, H, D, generator=gen, dtype=torch.float64)
    k = F.normalize(base + 0.05 * torch.randn(B, T, H, D, generator=gen, dtype=torch.float64), dim=-1)
    q = F.normalize(torch.randn(B, T, H, D, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64)
    g = -0.02 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen, dtype=torch.float64))
    beta_tilde = 0.9 + 0.1 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    p = k * (2 * g.exp() * beta_tilde / beta)[..., None]
    return [t.to(device=device, dtype=dtype if i < 4 else torch.float32) for i, t in enumerate((q, k, v, p, g, beta))]


@pytest.mark.parametrize("T", [40, 65])
def test_iplr_transition_through_p(T, reference_path):
    """The iplr reading of p is the same recurrence: the reference loop with p = 2e^gβ̃k/β equals the loop over
    h ← α(I − 2β̃ k kᵀ) h + β k vᵀ."""
    q, k, v, p, g, beta = (t.double() for t in make_iplr_inputs(1, T, 2, 8, "cpu", torch.float64))
    beta_tilde = (p / k).mean(-1) * beta / (2 * g.exp())
    h = torch.zeros(1, 2, 8, 8, dtype=torch.float64)
    eye = torch.eye(8, dtype=torch.float64)
    outputs = []
    for t in range(T):
        kt = k[:, t]
        transition = g[:, t].exp()[..., None, None] * (eye - 2 * beta_tilde[:, t, :, None, None]
                                                       * kt[..., :, None] * kt[..., None, :])
        h = transition @ h + beta[:, t, :, None, None] * kt[..., :, None] * v[:, t, :, None, :]
        outputs.append(8 ** -0.5 * torch.einsum("bhkv,bhk->bhv", h, q[:, t]))
    assert_close(comba_recurrent(q, k, v, p, g, beta), torch.stack(outputs, 1), tol=1e-10)


@pytest.mark.parametrize("make", [make_aligned_inputs, make_iplr_inputs], ids=["aligned-keys", "iplr"])
@pytest.mark.parametrize("split_bwd,causal", [(False, False), (True, True)])
def test_triton_interpreter_hard_chunks(make, split_bwd, causal, triton_interpreter, poison_outputs):
    """Nearly parallel keys, fp32: the chunk inverse must stay accurate as A's entries approach 1 (splr) or 2
    (iplr; a power series for the inverse loses 8% of the output here)."""
    x = make(B=1, T=70, H=1, D=64, device="cpu", dtype=torch.float32)
    with launch_overrides("comba", split_bwd=split_bwd):
        check_against_reference(comba_op, x, causal=causal)


@pytest.mark.cuda
@pytest.mark.parametrize("make", [make_aligned_inputs, make_iplr_inputs], ids=["aligned-keys", "iplr"])
@pytest.mark.parametrize("D", [16, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_hard_chunks_bf16(make, D, causal, poison_outputs):
    """bf16 with TF32 products (the inverse's included) on nearly parallel keys, splr and iplr gains."""
    x = make(B=2, T=196, H=2, D=D, device="cuda")
    check_against_reference(comba_op, x, causal=causal, fwd_tol=2e-2, grad_tol=4e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("T", [196, 49])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_vision_shape(T, causal, poison_outputs):
    """B·H = 1024 small heads: (non-causal) both directions in one program, and for T = 49 the single-token
    tail."""
    x = make_inputs(B=128, T=T, H=8, K=16, V=16, dtype=torch.bfloat16, device="cuda")
    check_against_reference(comba_op, x, causal=causal, fwd_tol=2e-2, grad_tol=4e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("T", [196, 49])
def test_cuda_balanced_last_wave(T, poison_outputs):
    """1,280 sequences with room for 1,000 programs at once: 1,000 keep both directions of the forward walk in one
    program, the other 280 get one program per direction (bf16 atomic adds onto a zeroed output); the benchmark
    shape B256 T196 H10 D16 runs this way on an H100."""
    launch = _reset_plans()
    x = make_inputs(B=160, T=T, H=8, K=16, V=16, dtype=torch.bfloat16, device="cuda")
    with launch_overrides("comba", wave_slots=1000):
        check_against_reference(comba_op, x, causal=False, fwd_tol=2e-2, grad_tol=4e-2)
        plan = launch.fwd_plan(x[0], x[2], x[4], x[5], causal=False, save_state=True)
        assert plan.zero_from == 125


# ---------------------------------------------------------------------------------------------------------------
# Host side: cached launch plans, launch choice under CUDA graph capture, direct relaunch


def _reset_plans():
    from visionssm.kernels.comba import launch

    launch._FWD_PLANS.clear()
    launch._BWD_PLANS.clear()
    return launch


def test_triton_interpreter_repeated_calls_reuse_the_launch_plan(triton_interpreter):
    """Without NaN poisoning (outputs from empty_like), a second call of a shape reuses the first call's cached
    plan and gives the same result; a launch override starts from fresh plans and leaves the cached ones behind."""
    launch = _reset_plans()
    x = make_inputs(B=1, T=20, H=2, K=16, V=16)
    first = check_against_reference(comba_op, x, causal=False)
    plans = dict(launch._FWD_PLANS)
    assert len(plans) == 1 and len(launch._BWD_PLANS) == 1
    again = check_against_reference(comba_op, x, causal=False)
    assert plans == launch._FWD_PLANS
    for a, b in zip(first, again):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with launch_overrides("comba", inv_pass=True):
        check_against_reference(comba_op, x, causal=False)
        assert all(plan.pre is not None for plan in launch._FWD_PLANS.values())
    check_against_reference(comba_op, x, causal=False)
    assert all(plan.pre is None for plan in launch._FWD_PLANS.values())


def test_wide_heads_take_the_inverse_pass_where_it_was_measured_faster(triton_interpreter):
    """64-wide heads: a forward with no backward to follow runs the chunk-parallel inverse pass, causal or not; a
    causal training forward does not (fwd+bwd 1.02x with it); the backward of one sequence splits (a state-gradient
    walk, then per-chunk programs: test_split_backward_rule has the rule)."""
    launch = _reset_plans()
    x = make_inputs(B=1, T=20, H=1, K=64, V=64)
    with torch.no_grad():
        comba_op(*x, causal=True)
    assert [plan.pre is not None for plan in launch._FWD_PLANS.values()] == [True]
    for causal in (True, False):
        _reset_plans()
        leaves = [t.clone().requires_grad_() for t in x]
        comba_op(*leaves, causal=causal).sum().backward()
        assert [plan.pre is not None for plan in launch._FWD_PLANS.values()] == [not causal]
        assert [plan.dh_walk is not None for plan in launch._BWD_PLANS.values()] == [True]


def _fwd_bwd(leaves, do, causal):
    o = comba_op(*leaves, causal=causal)
    return (o, *torch.autograd.grad(o, leaves, do))


@pytest.mark.cuda
@pytest.mark.parametrize("B,T,H", [(64, 196, 10), (64, 49, 20)])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_graph_capture_forward_and_backward(B, T, H, causal):
    """Forward + autograd backward captured in one CUDA graph (as torch.compile(mode="reduce-overhead") and
    time_fn(cuda_graph=True) do) and replayed on new inputs equals eager, at small-head vision shapes: once after an
    eager warm-up (plans built and kernels compiled before the capture) and once with nothing cached when the capture
    begins."""
    shape = {"B": B, "T": T, "H": H, "K": 16, "V": 16, "dtype": torch.bfloat16, "device": "cuda"}
    for warm_up in (True, False):
        _reset_plans()
        leaves = [t.requires_grad_() for t in make_inputs(**shape, seed=0)]
        do = torch.randn(B, T, H, 16, device="cuda", dtype=torch.bfloat16)
        if warm_up:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    _fwd_bwd(leaves, do, causal)
            torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = _fwd_bwd(leaves, do, causal)
        for seed in (1, 2):  # new inputs written into the captured ones
            new = make_inputs(**shape, seed=seed)
            new_do = torch.randn(B, T, H, 16, generator=torch.Generator().manual_seed(seed)).to(do)
            with torch.no_grad():
                for leaf, t in zip(leaves, new):
                    leaf.copy_(t)
                do.copy_(new_do)
            graph.replay()
            eager = _fwd_bwd([t.requires_grad_() for t in new], new_do, causal)
            for name, got, want in zip(("o", *GRAD_NAMES), static, eager):
                assert_close(got, want, tol=1e-3, name=f"{name} (warm-up: {warm_up}, replay {seed})")
        del graph


@pytest.mark.cuda
def test_cuda_repeated_calls_and_unaligned_inputs(poison_outputs):
    """Later calls of a shape relaunch the compiled kernels directly: same results as the first call. Inputs whose
    data pointers are not 16-byte aligned need another compiled specialization, which the direct path must not
    reuse."""
    from visionssm.kernels import utils
    from visionssm.kernels.comba import launch

    x = make_inputs(B=4, T=65, H=3, K=16, V=32, dtype=torch.bfloat16, device="cuda")
    do = torch.randn(4, 65, 3, 32, generator=torch.Generator().manual_seed(1)).to(x[2])
    first = run_with_grads(comba_op, x, do, causal=False)
    for _ in range(2):
        for a, b in zip(first, run_with_grads(comba_op, x, do, causal=False)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    plans = [plan for key, plan in launch._FWD_PLANS.items() if key[0] == x[0].shape]
    assert utils.DIRECT_LAUNCH and plans
    assert all(plan.main.runner is not None and (plan.pre is None or plan.pre.runner is not None) for plan in plans)

    def unaligned(t):
        view = torch.empty(t.numel() + 1, device=t.device, dtype=t.dtype)[1:].view(t.shape)
        return view.copy_(t)

    for _ in range(2):
        leaves = [unaligned(t).requires_grad_() for t in x]
        assert all(t.data_ptr() % 16 for t in leaves)
        o = comba_op(*leaves, causal=False)
        o.backward(do)
        for name, got, want in zip(("o", *GRAD_NAMES), (o, *(t.grad for t in leaves)), (first[0], *first[1])):
            assert_close(got, want, tol=1e-3, name=f"{name} (unaligned inputs)")


# ---------------------------------------------------------------------------------------------------------------
# The registered op (visionssm::comba): what torch.compile and torch.export take


def _custom_op():
    return importlib.import_module("visionssm.kernels.comba.custom_op")


def _leaves(x, requires_grad=True):
    return [t.detach().clone().requires_grad_(requires_grad) for t in x]


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_opcheck_reference_path(causal, requires_grad, reference_path):
    x = make_inputs(B=1, T=17, H=1, K=8, V=4)
    torch.library.opcheck(_custom_op().comba_op, (*_leaves(x, requires_grad), 0.3, causal, requires_grad))


@pytest.mark.parametrize("overrides", [{}, {"store_inv": True}], ids=["states", "states-and-inverses"])
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_triton_interpreter_opcheck(causal, requires_grad, overrides, triton_interpreter, poison_outputs):
    """Schema, fake shapes, autograd registration and the traced op's results against eager: with the chunk states
    alone saved, and with the chunks' inverses beside them. T = 19: two chunks, the last one partial."""
    x = make_inputs(B=1, T=19, H=1, K=16, V=16)
    with launch_overrides("comba", **overrides):
        torch.library.opcheck(_custom_op().comba_op, (*_leaves(x, requires_grad), 0.3, causal, requires_grad))


def test_triton_interpreter_opcheck_bf16_states(triton_interpreter, poison_outputs):
    """bf16 inputs save bf16 states (``state_lp``): the fake says so too."""
    x = make_inputs(B=1, T=7, H=1, K=16, V=16, dtype=torch.bfloat16)
    torch.library.opcheck(_custom_op().comba_op, (*_leaves(x), 0.3, False, True))


def test_triton_interpreter_opcheck_single_token_tail(triton_interpreter, poison_outputs):
    """T = 17, non-causal: the reversed walk starts from the zero state at the single-token chunk and does not store
    that state (its backward never reads it), so that slot of the saved states is unwritten memory, and opcheck's
    comparison of traced and eager outputs, which includes the saved tensors, is left out here."""
    x = make_inputs(B=1, T=17, H=2, K=16, V=16)
    _, saved = _custom_op().comba_op(*x, 0.3, False, True)
    assert saved[0][1, :, -1].isnan().all() and not saved[0][0].isnan().any()
    torch.library.opcheck(_custom_op().comba_op, (*_leaves(x), 0.3, False, True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("K,V,T,causal,dtype,overrides", [
    (16, 16, 21, True, torch.float32, {}), (16, 32, 49, False, torch.bfloat16, {}),
    (64, 64, 33, False, torch.float32, {}), (64, 64, 33, True, torch.float32, {}),
    (128, 64, 40, True, torch.bfloat16, {}), (128, 64, 1, False, torch.float32, {}),
    (16, 16, 33, False, torch.bfloat16, {"state_lp": False, "store_inv": True}),
    (16, 16, 17, True, torch.float32, {"pre_wy": True, "value_block": 16})])
def test_fake_saved_layout_is_the_training_plans(K, V, T, causal, dtype, overrides):
    """The fake's saved tensors are those a training forward's launch plan allocates and keeps: the states, and the
    inverses where the plan keeps them (64-wide non-causal and 128-wide heads by default), in the plan's dtype."""
    from visionssm.kernels.comba import launch

    q, _, v, _, g, beta = make_inputs(B=2, T=T, H=3, K=K, V=V, dtype=dtype)
    with launch_overrides("comba", **overrides):
        plan = launch.fwd_plan(q, v, g, beta, causal=causal, save_state=True)
        h0_shape, state_dtype, inv_shape = launch.training_saved_layout(2, T, 3, K, V, causal, dtype)
    assert (h0_shape, state_dtype) == (plan.h0_shape, plan.state_dtype)
    assert inv_shape == (plan.inv_shape if plan.save_inv else None)


def test_triton_interpreter_inference_keeps_no_states(triton_interpreter):
    """Traced without a gradient to compute (``save`` false), the op keeps nothing for a backward."""
    x = make_inputs(B=1, T=19, H=1, K=16, V=16)
    o, saved = _custom_op().comba_op(*x, 0.3, False, False)
    assert saved == []
    assert_close(o, comba_op(*x, causal=False, scale=0.3), tol=0)


def _compile_check(x, causal, tol):
    """torch.compile(fullgraph=True, backend="aot_eager") of the public function: no graph break, and the output and
    gradients of eager."""
    def fn(q, k, v, p, g, beta):
        return comba_op(q, k, v, p, g, beta, causal=causal, scale=0.6)

    assert torch._dynamo.explain(fn)(*_leaves(x)).graph_break_count == 0
    do = torch.randn(*x[2].shape, generator=torch.Generator().manual_seed(1)).to(x[2])
    compiled = run_with_grads(torch.compile(fn, fullgraph=True, backend="aot_eager"), x, do)
    eager = run_with_grads(fn, x, do)
    for name, got, want in zip(("o", *GRAD_NAMES), (compiled[0], *compiled[1]), (eager[0], *eager[1])):
        assert_close(got, want, tol=tol, name=f"{name} (compiled)")


@pytest.mark.parametrize("causal", [True, False])
def test_compile_reference_path(causal, reference_path):
    torch._dynamo.reset()
    _compile_check(make_inputs(B=1, T=17, H=2, K=8, V=4), causal, 1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_triton_interpreter_compile(causal, triton_interpreter, poison_outputs):
    torch._dynamo.reset()
    _compile_check(make_inputs(B=1, T=17, H=1, K=16, V=16), causal, 1e-6)


def test_triton_interpreter_export(triton_interpreter):
    """torch.export keeps the op whole, and the exported program computes the same output."""
    class Mixer(torch.nn.Module):
        def forward(self, q, k, v, p, g, beta):
            return comba_op(q, k, v, p, g, beta, causal=False)

    x = make_inputs(B=1, T=21, H=2, K=16, V=16)
    program = torch.export.export(Mixer(), tuple(x))
    assert "torch.ops.visionssm.comba.default" in program.graph_module.code
    torch.testing.assert_close(program.module()(*x), Mixer()(*x), rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("K,T", [(16, 196), (64, 49)])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_compile_inductor_bf16(K, T, causal, mode, poison_outputs):
    """Inductor (and CUDA graphs) on bf16 inputs at vision shapes, 16-wide heads (states alone saved) and 64-wide
    (inverses too when non-causal): no graph break, eager's output and gradients (the backward's atomic adds may
    sum in another order)."""
    def fn(q, k, v, p, g, beta):
        return comba_op(q, k, v, p, g, beta, causal=causal)

    torch._dynamo.reset()
    x = make_inputs(B=16, T=T, H=4, K=K, V=K, dtype=torch.bfloat16, device="cuda")
    assert torch._dynamo.explain(fn)(*_leaves(x)).graph_break_count == 0
    compiled = torch.compile(fn, fullgraph=True, mode=mode)
    for seed in (1, 2):  # the second call replays the CUDA graph
        do = torch.randn(*x[2].shape, generator=torch.Generator().manual_seed(seed)).to(x[2])
        got = run_with_grads(compiled, x, do)
        want = run_with_grads(fn, x, do)
        for name, a, b in zip(("o", *GRAD_NAMES), (got[0], *got[1]), (want[0], *want[1])):
            assert_close(a, b, tol=1e-3, name=f"{name} (compiled, {mode})")


# ---------------------------------------------------------------------------------------------------------------
# Bad input


def _bad_input_cases():
    def change(index, tensor):
        def build():
            x = make_inputs(T=4)
            x[index] = tensor(x)
            return x, {}
        return build

    def kw(**kwargs):
        return lambda: (make_inputs(T=4), kwargs)

    return [
        ("q", ValueError, change(0, lambda x: x[0][0])),
        ("k", ValueError, change(1, lambda x: x[1][:, :3])),
        ("p", ValueError, change(3, lambda x: x[3][..., :8])),
        ("v", ValueError, change(2, lambda x: x[2][:, :, :1])),
        ("g", ValueError, change(4, lambda x: x[4][..., None])),
        ("beta", ValueError, change(5, lambda x: x[5][:1])),
        ("q", TypeError, change(0, lambda x: x[0].to(torch.int32))),
        ("v", TypeError, change(2, lambda x: x[2].half())),
        ("beta", TypeError, change(5, lambda x: x[5].numpy())),
        ("g", TypeError, change(4, lambda x: x[4].to(torch.int64))),
        ("K", ValueError, lambda: (make_inputs(T=2, K=256), {})),
        ("V", ValueError, lambda: (make_inputs(T=2, V=129), {})),
        ("q must have B, T, H >= 1", ValueError, lambda: ([t[:, :0] for t in make_inputs(T=2)], {})),
        ("q must have B, T, H >= 1", ValueError, lambda: ([t[:0] for t in make_inputs(T=2)], {})),
        ("q must have B, T, H >= 1", ValueError, lambda: ([t[:, :, :0] for t in make_inputs(T=2)], {})),
        ("q must have shape \\(B, T, H, K\\)", ValueError, change(0, lambda x: x[0][None])),
        ("causal", TypeError, kw(causal=1)),
        ("scale", TypeError, kw(scale="0.5")),
        ("scale", ValueError, kw(scale=float("nan"))),
    ]


@pytest.mark.parametrize("name,error,build", _bad_input_cases(), ids=lambda c: c if isinstance(c, str) else "")
def test_bad_input_raises_naming_the_argument(name, error, build):
    args, kwargs = build()
    with pytest.raises(error, match=name):
        comba_op(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Cross-check with flash-linear-attention's chunk reference (read-before-decay, like ours)


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="flash-linear-attention is not installed")
@pytest.mark.parametrize("T", [5, 65])
def test_matches_fla_naive_chunk_comba(T):
    naive_chunk_comba = pytest.importorskip("fla.ops.comba.naive").naive_chunk_comba

    q, k, v, p, g, beta = make_inputs(B=1, T=T, H=2, K=16, V=16)
    scale = 16 ** -0.5
    ours = comba_recurrent(q, k, v, p, g, beta, scale=scale)
    theirs = naive_chunk_comba(q=q, k=k, v=v, p=p, g=g, beta=beta, scale=scale, chunk_size=16)
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    assert_close(theirs.float(), ours, tol=1e-4)
