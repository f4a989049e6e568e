"""Comba's chunk-parallel form (kernels/comba/kernel_chunked.py, the split backward at 64-token chunks) against the
float64 per-token loop of kernels/comba/naive.py, forced through ``launch_overrides("comba", chunked=True)``."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_comba import (
    GRAD_NAMES,
    check_against_reference,
    make_aligned_inputs,
    make_inputs,
    make_iplr_inputs,
    reference_with_grads,
)

from visionssm.kernels import comba as comba_op
from visionssm.kernels.comba import comba_recurrent, launch
from visionssm.kernels.tuning import launch_overrides
from visionssm.kernels.utils import assert_close


def _reset_plans():
    launch._FWD_PLANS.clear()
    launch._BWD_PLANS.clear()


def _iplr(B, T, H, K, V):
    assert K == V
    return make_iplr_inputs(B, T, H, K, "cpu", torch.float32)


def _splr(B, T, H, K, V):
    return make_inputs(B=B, T=T, H=H, K=K, V=V)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels in Triton's CPU interpreter


@pytest.mark.parametrize("make", [_splr, _iplr], ids=["splr", "iplr"])
@pytest.mark.parametrize("T", [1, 15, 17, 63, 65, 197])
@pytest.mark.parametrize("causal", [True, False])
def test_triton_interpreter_forward_and_gradients(T, causal, make, triton_interpreter, poison_outputs):
    """One token, partial and whole 16-token blocks, one and several 64-token chunks (the last partial), both
    directions; splr gates, and the iplr transition (A's entries near 2, nearly parallel keys)."""
    _reset_plans()
    x = make(1, T, 1, 16, 16)
    with launch_overrides("comba", chunked=True):
        check_against_reference(comba_op, x, causal=causal, scale=0.8)
        assert {type(plan) for plan in launch._FWD_PLANS.values()} == {launch.ChunkedFwdPlan}


@pytest.mark.parametrize("K,V,T,causal,overrides", [
    (32, 80, 130, True, {"value_block": 16}), (20, 12, 70, False, {}), (16, 32, 129, False, {"value_block": 16}),
    (64, 64, 66, True, {})], ids=["split-V-partials", "padded-dims", "split-V-noncausal", "wide"])
def test_triton_interpreter_head_dims_and_value_split(K, V, T, causal, overrides, triton_interpreter,
                                                      poison_outputs):
    """The walks split over value blocks; V > 64 gives the gradient kernel two blocks (partials summed after);
    head dims that are not powers of two are padded in registers."""
    x = make_inputs(B=1, T=T, H=1, K=K, V=V)
    with launch_overrides("comba", chunked=True, **overrides):
        check_against_reference(comba_op, x, causal=causal, scale=0.7)


@pytest.mark.parametrize("overrides", [{"state_lp": True}, {"state_lp": False}, {"state_lp": True, "fwd_lp": True}],
                         ids=["bf16-states", "fp32-states", "bf16-states-16-bit-forward"])
def test_triton_interpreter_bf16(overrides, triton_interpreter, poison_outputs):
    """bf16 inputs: bf16 states (read by the output kernel and the backward) or fp32 ones, within bf16 tolerances."""
    x = make_inputs(B=1, T=70, H=2, K=16, V=32, dtype=torch.bfloat16)
    with launch_overrides("comba", chunked=True, **overrides):
        check_against_reference(comba_op, x, causal=False, fwd_tol=2e-2, grad_tol=4e-2)


def test_triton_interpreter_hard_chunks(triton_interpreter, poison_outputs):
    """Nearly parallel keys (splr, A's entries near 1): the 64-token inverse merged from 16-token blocks stays
    accurate over two chunks."""
    x = make_aligned_inputs(B=1, T=100, H=1, D=32, device="cpu", dtype=torch.float32)
    with launch_overrides("comba", chunked=True):
        check_against_reference(comba_op, x, causal=False)


@pytest.mark.parametrize("causal", [True, False])
def test_triton_interpreter_hard_chunks_bf16(causal, triton_interpreter, poison_outputs):
    """bf16 iplr gains on nearly parallel keys with bf16 states and 16-bit backward products over 64-token chunks:
    the largest gradient errors of the chunked form (dβ, dp near 3.5e-2 of the 4e-2 allowed)."""
    x = make_iplr_inputs(1, 130, 1, 32, "cpu", torch.bfloat16)
    with launch_overrides("comba", chunked=True):
        check_against_reference(comba_op, x, causal=causal, fwd_tol=2e-2, grad_tol=4e-2)


def test_triton_interpreter_inference(triton_interpreter, poison_outputs):
    """No gradient to compute: the forward keeps nothing and gives the same output."""
    _reset_plans()
    x = make_inputs(B=2, T=80, H=1, K=16, V=16)
    with launch_overrides("comba", chunked=True), torch.no_grad():
        o = comba_op(*x, causal=False)
        (plan,) = launch._FWD_PLANS.values()
    assert not plan.save_state and plan.inv_shape is None
    assert_close(o, comba_recurrent(*[t.double() for t in x], causal=False), tol=1e-3)


@pytest.mark.parametrize("forward_chunked", [True, False])
def test_triton_interpreter_backward_follows_the_forward(forward_chunked, triton_interpreter, poison_outputs):
    """A backward run under the other form than its forward reads the states and inverses as the forward stored
    them (16- or 64-token chunks)."""
    x = make_inputs(B=1, T=70, H=1, K=16, V=16)
    do = torch.randn(1, 70, 1, 16, generator=torch.Generator().manual_seed(1))
    ref_o, ref_grads = reference_with_grads(x, do, causal=False)
    leaves = [t.detach().clone().requires_grad_() for t in x]
    with launch_overrides("comba", chunked=forward_chunked, store_inv=True):
        o = comba_op(*leaves, causal=False)
    with launch_overrides("comba", chunked=not forward_chunked):
        o.backward(do)
    assert_close(o, ref_o, tol=1e-3, name="o")
    for name, leaf, ref in zip(GRAD_NAMES, leaves, ref_grads):
        assert_close(leaf.grad, ref, tol=1e-2, name=f"d{name}")


# ---------------------------------------------------------------------------------------------------------------
# Selection and the registered op


def test_launch_config_selects_the_chunked_form_by_length():
    """The walk below CHUNKED_FROM tokens, the chunk-parallel form from there on; its walks split the value
    dimension until there are CHUNKED_WALKS of them (or 16-wide blocks)."""
    assert not launch.launch_config(64, 64, launch.CHUNKED_FROM - 1, 16 * 6, 2)["chunked"]
    wide = launch.launch_config(64, 64, launch.CHUNKED_FROM, 16 * 6, 2)
    assert wide["chunked"] and wide["BV"] == 32 and 96 * 2 * wide["NV"] >= launch.CHUNKED_WALKS
    assert launch.launch_config(64, 64, 16384, 4 * 6, 2)["BV"] == 16
    assert launch.launch_config(64, 64, 4096, 256 * 6, 2)["BV"] == 64
    with launch_overrides("comba", chunked=False):
        assert not launch.launch_config(64, 64, 4096, 16, 2)["chunked"]


@pytest.mark.parametrize("K,V,T,causal,dtype", [(16, 16, 21, True, torch.float32), (16, 32, 130, False, torch.bfloat16),
                                                (64, 64, 1, False, torch.float32)])
def test_fake_saved_layout_is_the_training_plans(K, V, T, causal, dtype):
    """The fake's saved tensors are what a chunked training forward keeps: the states per 64-token chunk in the
    states' dtype, and the chunks' 64×64 inverses."""
    q, _, v, _, g, beta = make_inputs(B=2, T=T, H=3, K=K, V=V, dtype=dtype)
    with launch_overrides("comba", chunked=True):
        plan = launch.fwd_plan(q, v, g, beta, causal=causal, save_state=True)
        h0_shape, state_dtype, inv_shape = launch.training_saved_layout(2, T, 3, K, V, causal, dtype)
    assert isinstance(plan, launch.ChunkedFwdPlan)
    assert (h0_shape, state_dtype, inv_shape) == (plan.h0_shape, plan.state_dtype, plan.inv_shape)
    assert inv_shape[-2:] == (launch.LONG_CHUNK, launch.LONG_CHUNK) and h0_shape[2] == -(-T // launch.LONG_CHUNK)


@pytest.mark.parametrize("causal,requires_grad", [(True, True), (False, True), (False, False)])
def test_triton_interpreter_opcheck(causal, requires_grad, triton_interpreter, poison_outputs):
    """Schema, fake shapes, autograd registration and the traced op's results (saved tensors included: every state
    and inverse is written) against eager, in the chunked form. T = 70: two chunks, so the backward's state-gradient
    walk runs."""
    op = importlib.import_module("visionssm.kernels.comba.custom_op").comba_op
    x = [t.detach().clone().requires_grad_(requires_grad) for t in make_inputs(B=1, T=70, H=1, K=16, V=16)]
    with launch_overrides("comba", chunked=True):
        _, saved = op(*x, 0.3, causal, requires_grad)
        assert [t.shape[-1] for t in saved] == ([16, launch.LONG_CHUNK] if requires_grad else [])
        torch.library.opcheck(op, (*x, 0.3, causal, requires_grad))


# ---------------------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 63, 65, 197, 4096])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_forward_and_gradients(T, causal, dtype, poison_outputs):
    """The chunk-parallel form, forced below CHUNKED_FROM and taken by default at 4,096 tokens, 64-wide heads."""
    B, H = (2, 2) if T == 4096 else (3, 4)
    x = make_inputs(B=B, T=T, H=H, K=64, V=64, dtype=dtype, device="cuda")
    tols = (1e-3, 1e-2) if dtype == torch.float32 else (2e-2, 4e-2)
    with launch_overrides("comba", chunked=True):
        check_against_reference(comba_op, x, causal=causal, fwd_tol=tols[0], grad_tol=tols[1])


@pytest.mark.cuda
@pytest.mark.parametrize("K,V", [(16, 16), (128, 128), (32, 64)])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_head_dims(K, V, causal, poison_outputs):
    """Other head widths at a length that selects the chunk-parallel form by default (V = 128: two value blocks
    in the gradient kernel, their partials summed)."""
    x = make_inputs(B=2, T=1100, H=2, K=K, V=V, dtype=torch.bfloat16, device="cuda")
    check_against_reference(comba_op, x, causal=causal, fwd_tol=2e-2, grad_tol=4e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("make", [make_aligned_inputs, make_iplr_inputs], ids=["aligned-keys", "iplr"])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_hard_chunks_bf16(make, causal, poison_outputs):
    """bf16 with TF32 products on nearly parallel keys, splr and iplr gains, in the chunk-parallel form."""
    x = make(B=2, T=197, H=2, D=64, device="cuda")
    with launch_overrides("comba", chunked=True):
        check_against_reference(comba_op, x, causal=causal, fwd_tol=2e-2, grad_tol=4e-2)
