"""Causal GKA with the chunked Chebyshev solve on wide heads (kernels/gka/chebyshev_kernels.py) under the wide-head
launch settings of causal_launch.launch_config and variants of them (state rows per scan program, chunk size), in
Triton's interpreter on tiny shapes: forward and every gradient against the float64 specification
(kernels/gka/naive.py) at the tolerances of test_gka_causal.py."""

from __future__ import annotations

import pytest
import torch
from gka_inputs import make_inputs, run_with_grads

from visionssm.kernels.gka import gka
from visionssm.kernels.gka.causal_launch import launch_config
from visionssm.kernels.gka.naive import gka_chunked, gka_recurrent
from visionssm.kernels.tuning import launch_overrides
from visionssm.kernels.utils import assert_close

GRAD_NAMES = ("q", "k", "v", "g", "beta", "alpha")


def _check(tensors, settings: dict, fwd_tol: float, grad_tol: float) -> None:
    """gka (Chebyshev-30) under ``settings`` against the float64 Chebyshev-30 output and the exact solve's gradients
    (what implicit differentiation computes)."""
    B, T, H, V = tensors[2].shape
    do = torch.randn(B, T, H, V, dtype=torch.float64, generator=torch.Generator().manual_seed(T))
    with launch_overrides("gka", **settings):
        out, grads = run_with_grads(lambda *a: gka(*a, causal=True, solver="chebyshev"), tensors, do)
    ref_in = [None if t is None else t.detach().double() for t in tensors]
    ref_out = gka_recurrent(*ref_in, causal=True, num_iters=30, exact=False)
    _, ref_grads = run_with_grads(lambda *a: gka_chunked(*a, causal=True, exact=True, chunk_size=16), ref_in, do)
    assert_close(out, ref_out, tol=fwd_tol, name=f"o {settings}")
    for name, grad, expected in zip(GRAD_NAMES, grads, ref_grads):
        if expected is None:
            continue
        assert grad is not None, f"no gradient for {name}"
        assert_close(grad, expected, tol=grad_tol, name=f"d{name} {settings}")


def test_launch_config_wide_heads():
    """The wide-head defaults pass the settings' own checks (state rows divide K, columns divide K and V); 64-token
    chunks are refused with the setting named (they end in an illegal memory access on the GPU)."""
    for K, V in ((64, 64), (128, 128), (128, 64)):
        cfg = launch_config(K, V, False)
        assert K % cfg["state_rows"] == 0 and K % cfg["columns"] == 0 and V % cfg["columns"] == 0
    with launch_overrides("gka", chunk=64), pytest.raises(ValueError, match="chunk"):
        launch_config(128, 128, False)


@pytest.mark.parametrize("settings", [{}, {"state_rows": 32, "chunk": 16}, {"state_rows": 64}],
                         ids=["defaults", "rows32-chunk16", "rows64"])
def test_interpreter_head128(triton_interpreter, poison_outputs, settings):
    tensors = make_inputs(1, 37, 1, 128, 128, seed=13)
    _check(tensors, settings, 2e-3, 2e-2)


@pytest.mark.parametrize("T", [33, 70])
def test_interpreter_head64_bf16(triton_interpreter, poison_outputs, T):
    """bf16 inputs take the hi/lo split products (emulated in fp32 in the interpreter); odd lengths, no β for one."""
    tensors = make_inputs(1, T, 2, 64, 64, dtype=torch.bfloat16, use_beta=T % 2 == 0, seed=T)
    _check(tensors, {}, 2e-2, 3e-2)
