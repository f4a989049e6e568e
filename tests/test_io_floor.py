"""benchmarks/io_floor.py: its floor kernels move every byte they are charged for (in Triton's interpreter)."""

import pytest
import torch
from benchmark_scripts import load_script


@pytest.mark.parametrize("n_in, n_gates, D", [(3, 2, 16), (4, 1, 32)])
def test_floor_kernels_use_every_byte(triton_interpreter, n_in, n_gates, D):
    """The forward's output sums every input and gate and the backward writes each input's and gate's gradient, so
    the timed traffic is the op's whole traffic; odd sizes leave a partial last block."""
    io_floor = load_script("io_floor")
    B, T, H = 2, 5, 3
    inputs = torch.randn(n_in, B, T, H, D, dtype=torch.bfloat16)
    gates = torch.rand(n_gates, B, T, H, dtype=torch.bfloat16)
    do = torch.randn(B, T, H, D, dtype=torch.bfloat16)
    # within one bf16 step of the fp32 sums (the interpreter rounds toward zero); a dropped load would be off by O(1)
    close = {"rtol": 2**-7, "atol": 2**-7}
    out = io_floor.floor_fwd(inputs, gates)
    torch.testing.assert_close(out.float(), inputs.float().sum(0) + gates.float().sum(0)[..., None], **close)
    dx, dgate = io_floor.floor_bwd(inputs, gates, do)
    torch.testing.assert_close(dx.float(), inputs.float() + do.float(), **close)
    torch.testing.assert_close(dgate.float(), gates.float() + do[..., 0].float(), **close)
    fwd_bytes, bwd_bytes = io_floor.traffic_bytes(inputs, gates)
    one, gate = B * T * H * D * 2, B * T * H * 2
    assert fwd_bytes == (n_in + 1) * one + n_gates * gate
    assert bwd_bytes == (2 * n_in + 1) * one + 2 * n_gates * gate


def test_floor_kernels_refuse_mismatched_shapes(triton_interpreter):
    io_floor = load_script("io_floor")
    inputs = torch.randn(3, 2, 5, 3, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gates"):
        io_floor.floor_fwd(inputs, torch.rand(2, 2, 5, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="do must be"):
        io_floor.floor_bwd(inputs, torch.rand(2, 2, 5, 3, dtype=torch.bfloat16), torch.randn(2, 5, 3, 8))


def test_cpu_machine_skips(capsys):
    if torch.cuda.is_available():
        pytest.skip("the skip line is a CPU machine's answer")
    assert load_script("io_floor").main(["--out", "unused"]) == 0
    assert "skipped, no CUDA device" in capsys.readouterr().out
