"""visionssm.kernels.selective_scan against the float64 per-token loop (naive.selective_scan_ref).

CPU path: the vectorised PyTorch scan. Interpreter: the Triton kernels under TRITON_INTERPRET=1 (tiny shapes).
GPU (cuda-marked): the Triton kernels at MambaVision sizes, bf16 tolerances.
"""

from __future__ import annotations

import math

import pytest
import torch

from visionssm.kernels import selective_scan
from visionssm.kernels.selective_scan.naive import selective_scan_ref
from visionssm.kernels.tuning import launch_overrides
from visionssm.kernels.utils import assert_close

LENGTHS = (1, 5, 49, 63, 196, 257)
NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
FULL = {"groups": 2, "has_D": True, "has_z": True, "has_bias": True, "softplus": True}
BARE = {"groups": 0, "has_D": False, "has_z": False, "has_bias": False, "softplus": False}


def make_inputs(batch=2, dim=4, nstate=3, length=7, *, groups=0, has_D=True, has_z=True, has_bias=True,
                softplus=True, device="cpu", seed=0):
    """float64 master inputs; groups=0 means ungrouped (batch, N, L) B/C."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    bc_shape = (batch, nstate, length) if groups == 0 else (batch, groups, nstate, length)
    if softplus:
        delta = rand(batch, dim, length) * 0.5 - 1.0
    else:  # positive step sizes keep exp(δA) < 1 over long sequences
        delta = torch.rand(batch, dim, length, generator=g, dtype=torch.float64) * 0.2 + 0.02
    inputs = {
        "u": rand(batch, dim, length),
        "delta": delta,
        "A": -torch.exp(rand(dim, nstate) * 0.5),
        "B": rand(*bc_shape),
        "C": rand(*bc_shape),
        "D": rand(dim) if has_D else None,
        "z": rand(batch, dim, length) if has_z else None,
        "delta_bias": (rand(dim) * 0.5 if softplus else torch.rand(dim, generator=g, dtype=torch.float64) * 0.1)
        if has_bias else None,
    }
    return {k: (v.to(device) if v is not None else None) for k, v in inputs.items()}, softplus


def run_with_grads(fn, inputs, softplus, *, dtype, causal=True, return_last_state=False, seed=1):
    """Call ``fn`` on ``inputs`` cast to ``dtype``; return the output, last state and every input gradient."""
    leaves = {k: (v.detach().to(dtype).requires_grad_(True) if v is not None else None) for k, v in inputs.items()}
    result = fn(*(leaves[k] for k in NAMES), delta_softplus=softplus, causal=causal,
                return_last_state=return_last_state)
    out, last = (result if return_last_state else (result, None))
    g = torch.Generator().manual_seed(seed)
    loss = (out.double() * torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device)).sum()
    if last is not None:
        loss = loss + (last.double() * torch.randn(last.shape, generator=g, dtype=torch.float64).to(out.device)).sum()
    loss.backward()
    grads = {k: v.grad for k, v in leaves.items() if v is not None}
    return out, last, grads


def compare(inputs, softplus, *, dtype, causal=True, return_last_state=False, fwd_tol=1e-4, grad_tol=1e-3):
    expected = run_with_grads(selective_scan_ref, inputs, softplus, dtype=torch.float64, causal=causal,
                              return_last_state=return_last_state)
    actual = run_with_grads(selective_scan, inputs, softplus, dtype=dtype, causal=causal,
                            return_last_state=return_last_state)
    assert actual[0].dtype == dtype
    assert_close(actual[0], expected[0], tol=fwd_tol, name="out")
    if return_last_state:
        assert actual[1].dtype == torch.float32
        assert_close(actual[1], expected[1], tol=fwd_tol, name="last_state")
    for name, grad in expected[2].items():
        got = actual[2][name]
        if got is None:  # autograd's "zero": only acceptable where the true gradient is zero (dA at L = 1)
            assert not grad.any(), f"no gradient for {name}"
            continue
        assert got.dtype == dtype
        assert_close(got, grad, tol=grad_tol, name=f"d{name}")


# ---------------------------------------------------------------------------------------------------------------
# Specification sanity


def test_reference_matches_scalar_recurrence():
    """The batched token loop equals a scalar transcription of the recurrence (one channel, grouped B/C)."""
    inputs, softplus = make_inputs(batch=1, dim=4, nstate=2, length=4, groups=2)
    out = selective_scan_ref(*(inputs[k] for k in NAMES), delta_softplus=softplus)
    u, dl, A, B, C, D, z, bias = (inputs[k] for k in NAMES)
    for d in range(4):
        gi = d // 2
        x = [0.0, 0.0]
        for t in range(4):
            dt = torch.nn.functional.softplus(dl[0, d, t] + bias[d]).item()
            y = 0.0
            for n in range(2):
                x[n] = math.exp(dt * A[d, n].item()) * x[n] + dt * B[0, gi, n, t].item() * u[
                    0, d, t].item()
                y += x[n] * C[0, gi, n, t].item()
            expect = (y + D[d].item() * u[0, d, t].item()) * torch.nn.functional.silu(z[0, d, t]).item()
            assert abs(out[0, d, t].item() - expect) < 1e-12


def test_noncausal_is_forward_plus_reversed():
    inputs, softplus = make_inputs(length=9, has_D=False, has_z=False)
    args = [inputs[k] for k in NAMES]
    both = selective_scan_ref(*args, delta_softplus=softplus, causal=False)
    fwd = selective_scan_ref(*args, delta_softplus=softplus)
    flip = [a.flip(-1) if a is not None and a.dim() >= 3 else a for a in args]
    rev = selective_scan_ref(*flip, delta_softplus=softplus).flip(-1)
    torch.testing.assert_close(both, fwd + rev)


# ---------------------------------------------------------------------------------------------------------------
# CPU path (vectorised PyTorch scan)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("config", ["full", "bare"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_cpu_path(reference_path, length, config, causal):
    inputs, softplus = make_inputs(length=length, **(FULL if config == "full" else BARE))
    compare(inputs, softplus, dtype=torch.float32, causal=causal)


@pytest.mark.parametrize("groups", [0, 1, 4])
@pytest.mark.parametrize("flags", [(True, False, False), (False, True, False), (False, False, True)],
                         ids=["D", "z", "bias"])
def test_cpu_path_options(reference_path, groups, flags):
    has_D, has_z, has_bias = flags
    inputs, softplus = make_inputs(length=63, groups=groups, has_D=has_D, has_z=has_z, has_bias=has_bias)
    compare(inputs, softplus, dtype=torch.float32, causal=groups != 1)


@pytest.mark.parametrize("length", [1, 49])
def test_cpu_path_last_state(reference_path, length):
    inputs, softplus = make_inputs(length=length, groups=2)
    compare(inputs, softplus, dtype=torch.float32, return_last_state=True)


def test_cpu_path_float64_and_bf16(reference_path):
    inputs, softplus = make_inputs(length=49, groups=2)
    compare(inputs, softplus, dtype=torch.float64, fwd_tol=1e-12, grad_tol=1e-10)
    args = [v.to(torch.bfloat16) if v is not None else None for v in (inputs[k] for k in NAMES)]
    out = selective_scan(*args, delta_softplus=softplus)
    assert out.dtype == torch.bfloat16
    assert_close(out, selective_scan_ref(*(inputs[k] for k in NAMES), delta_softplus=softplus), tol=3e-2)


def test_cpu_path_mamba_vision_size(reference_path):
    """The mixer's stage-2 call (B/C shared, D, delta_bias, softplus, z=None) runs on CPU at full width."""
    inputs, softplus = make_inputs(batch=1, dim=160, nstate=8, length=196, has_z=False)
    args = [inputs[k].float() if inputs[k] is not None else None for k in NAMES]
    with torch.no_grad():
        out = selective_scan(*args, delta_softplus=softplus)
    expected = selective_scan_ref(*(inputs[k] for k in NAMES), delta_softplus=softplus)
    assert_close(out, expected, tol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# Bad input


def _bad_cases():
    good, _ = make_inputs(batch=2, dim=4, nstate=3, length=5, groups=2)
    f32 = {k: (v.float() if v is not None else None) for k, v in good.items()}

    def with_(**changes):
        return {**f32, **changes}

    return [
        ("u-dim", with_(u=f32["u"][0]), {}, ValueError, "u must have shape"),
        ("u-empty", with_(u=f32["u"][:, :, :0]), {}, ValueError, "u must have batch, dim, L >= 1"),
        ("u-type", with_(u=f32["u"].numpy()), {}, TypeError, "u must be a torch.Tensor"),
        ("u-int", with_(u=f32["u"].long()), {}, TypeError, "u must have dtype"),
        ("delta-shape", with_(delta=f32["delta"][..., :4]), {}, ValueError, "delta must have shape"),
        ("A-complex", with_(A=f32["A"].to(torch.complex64)), {}, TypeError, "complex A .* out of scope"),
        ("A-shape", with_(A=f32["A"][:3]), {}, ValueError, "A must have shape"),
        ("A-big-N", with_(A=torch.zeros(4, 17), B=torch.zeros(2, 17, 5), C=torch.zeros(2, 17, 5)), {}, ValueError,
         "N = A.shape"),
        ("B-shape", with_(B=f32["B"][:, :, :2]), {}, ValueError, "B must have shape"),
        ("B-2d", with_(B=torch.zeros(4, 3)), {}, ValueError, "B must have shape"),
        ("C-groups", with_(B=torch.zeros(2, 3, 3, 5), C=torch.zeros(2, 3, 3, 5)), {}, ValueError, "must divide dim"),
        ("C-mismatch", with_(C=torch.zeros(2, 3, 5)), {}, ValueError, "B and C must have the same shape"),
        ("D-shape", with_(D=torch.zeros(3)), {}, ValueError, "D must have shape"),
        ("z-shape", with_(z=torch.zeros(2, 4, 4)), {}, ValueError, "z must have shape"),
        ("bias-dtype", with_(delta_bias=torch.zeros(4, dtype=torch.int32)), {}, TypeError, "delta_bias must have"),
        ("softplus-type", f32, {"delta_softplus": 1}, TypeError, "delta_softplus must be a bool"),
        ("causal-type", f32, {"causal": "yes"}, TypeError, "causal must be a bool"),
        ("last-bidir", f32, {"causal": False, "return_last_state": True}, ValueError, "return_last_state"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input(case):
    _, inputs, kwargs, exc, match = case
    with pytest.raises(exc, match=match):
        selective_scan(*(inputs[k] for k in NAMES), **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_bad_input_device():
    inputs, _ = make_inputs()
    args = [v.float() if v is not None else None for v in (inputs[k] for k in NAMES)]
    args[3] = args[3].cuda()
    with pytest.raises(ValueError, match="one device"):
        selective_scan(*args)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels in the interpreter (tiny shapes)


def launch_config(*sizes):
    """The Triton path's launch settings for a problem size (imported here: that module imports Triton)."""
    pytest.importorskip("triton")
    from visionssm.kernels.selective_scan.launch import launch_config as config

    return config(*sizes)


@pytest.fixture
def chunked():
    """Short chunks, so short sequences exercise the multi-chunk path (saved states, carries between chunks)."""
    with launch_overrides("selective_scan", chunk=8):
        yield


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("config", ["full", "bare"])
def test_interpreter(triton_interpreter, poison_outputs, length, config):
    causal = config == "full" if length % 2 else config != "full"
    options = dict(FULL if config == "full" else BARE)
    if length > 100:  # one program: the interpreter pays per time step
        options["groups"] = 1 if options["groups"] else 0
    inputs, softplus = make_inputs(batch=1 if length > 100 else 2, length=length, **options)
    compare(inputs, softplus, dtype=torch.float32, causal=causal)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("groups", [0, 2])
def test_interpreter_chunked(triton_interpreter, poison_outputs, chunked, causal, groups):
    inputs, softplus = make_inputs(dim=6, length=37, groups=groups)
    compare(inputs, softplus, dtype=torch.float32, causal=causal)


@pytest.mark.parametrize("length", [5, 37])
def test_interpreter_last_state(triton_interpreter, poison_outputs, chunked, length):
    inputs, softplus = make_inputs(length=length, groups=2, has_z=False)
    compare(inputs, softplus, dtype=torch.float32, return_last_state=True)


@pytest.mark.parametrize("flags", [(True, False, False), (False, True, False), (False, False, True)],
                         ids=["D", "z", "bias"])
def test_interpreter_options(triton_interpreter, poison_outputs, flags):
    has_D, has_z, has_bias = flags
    inputs, softplus = make_inputs(dim=3, nstate=8, length=20, has_D=has_D, has_z=has_z, has_bias=has_bias,
                                   softplus=has_bias)
    compare(inputs, softplus, dtype=torch.float32, causal=not has_z)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_interpreter_many_channels(triton_interpreter, poison_outputs, causal):
    """More channels than one program's block, not a multiple of it: several partial dB/dC blocks, masked rows."""
    inputs, softplus = make_inputs(batch=1, dim=70, nstate=3, length=9, groups=0, has_z=causal)
    compare(inputs, softplus, dtype=torch.float32, causal=causal)


@pytest.mark.parametrize("segments", [2, 3])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_interpreter_segments(triton_interpreter, poison_outputs, segments, causal):
    """The long-sequence path: time split into segments scanned in parallel (two passes each way), forced on a
    short sequence; uneven segments (19 tokens = 5 chunks of 4, the last one partial), grouped B/C, D, z, delta_bias,
    the last state's gradient, and both directions; then 3 chunks (one per segment at 3 segments) without options."""
    with launch_overrides("selective_scan", chunk=4, segments=segments):
        assert launch_config(19, 3, 6).segments == segments
        inputs, softplus = make_inputs(dim=6, length=19, groups=2)
        compare(inputs, softplus, dtype=torch.float32, causal=causal, return_last_state=causal)
        inputs, softplus = make_inputs(dim=3, length=10, **BARE)
        compare(inputs, softplus, dtype=torch.float32, causal=causal)


def test_segments_heuristic():
    """Segments only for long sequences with few (sequence, channel block) programs, >= 256 tokens each."""
    assert launch_config(196, 8, 160, 256).segments == 1  # MambaVision: enough programs, short
    assert launch_config(3136, 8, 80, 1024).segments == 1  # long, but 3072 programs already
    assert launch_config(3136, 8, 80, 256).segments == 3  # 768 programs -> ~2048
    cfg = launch_config(3136, 8, 64, 4)  # 8 programs: split into 256-token segments
    assert cfg.segments == 3136 // 256 and cfg.seg_chunks * cfg.chunk >= 256
    assert launch_config(1024, 8, 64, 1).segments == 4


def test_launch_overrides():
    """Forced settings apply inside the block only (cached configs follow the override state), capped like the
    heuristic's own; unknown names and impossible values are ValueErrors naming the setting."""
    default = launch_config(196, 8, 160, 256)
    assert (default.chunk, default.block_d_bwd, default.num_warps_bwd, default.segments) == (8, 32, 2, 1)
    with launch_overrides("selective_scan", chunk=4, segments=2):
        forced = launch_config(196, 8, 160, 256)
        assert (forced.chunk, forced.block_d_bwd, forced.segments) == (4, 32, 2)
    narrow = launch_config(196, 2, 4, 256)
    assert narrow.block_d_bwd == 4  # no wider than the channels per group
    assert narrow.num_warps_bwd == 1  # one thread per state element at most
    assert launch_config(196, 8, 160, 256) == default
    bad = [({"block_l": 8}, "unknown launch setting 'block_l'"), ({"chunk": 6}, "'chunk' .* power of 2"),
           ({"chunk": 0}, "'chunk' .* positive integer"), ({"segments": 1.5}, "'segments'"),
           ({"num_warps_fwd": 2}, "unknown launch setting 'num_warps_fwd'")]
    for settings, match in bad:
        with launch_overrides("selective_scan", **settings), pytest.raises(ValueError, match=match):
            launch_config(196, 8, 160, 256)


def test_config_follows_forward(triton_interpreter):
    """The backward uses the launch config of its forward (the saved states' interval, the segments), not the one
    current when autograd runs it."""
    inputs, softplus = make_inputs(dim=3, length=37, has_z=False)
    expected = run_with_grads(selective_scan_ref, inputs, softplus, dtype=torch.float64)
    leaves = {k: (v.detach().float().requires_grad_(True) if v is not None else None) for k, v in inputs.items()}
    with launch_overrides("selective_scan", chunk=8):
        out = selective_scan(*(leaves[k] for k in NAMES), delta_softplus=softplus)
    with launch_overrides("selective_scan", chunk=4, segments=2):
        g = torch.Generator().manual_seed(1)
        (out.double() * torch.randn(out.shape, generator=g, dtype=torch.float64)).sum().backward()
    for name, grad in expected[2].items():
        assert_close(leaves[name].grad, grad, tol=1e-3, name=f"d{name}")


def test_interpreter_bf16(triton_interpreter, poison_outputs):
    inputs, softplus = make_inputs(length=30, groups=2)
    compare(inputs, softplus, dtype=torch.bfloat16, fwd_tol=2e-2, grad_tol=3e-2)


def test_benchmark_suite_skips_without_cuda(monkeypatch, capsys):
    """The kernel suite reports one skip line and no rows where CUDA is unavailable, touching no CUDA API."""
    from visionssm.benchmark.suites import selective_scan as benchmark

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert benchmark.run(quick=True, copy_gbps=None) == []
    assert capsys.readouterr().out.strip() == "# selective_scan suite needs CUDA; skipped"


# ---------------------------------------------------------------------------------------------------------------
# GPU: the Triton kernels at real sizes


def _rounded(inputs, dtype):
    """Inputs rounded to ``dtype`` and back to float64, so the reference sees exactly what the kernel sees."""
    return {k: (v.to(dtype).double() if v is not None else None) for k, v in inputs.items()}


CUDA_CASES = [  # (batch, dim, N, L, groups, causal, has_z)
    (8, 160, 8, 196, 0, True, False),  # mamba_vision_T stage 2
    (8, 320, 8, 49, 0, True, False),  # mamba_vision_T stage 3
    (4, 64, 16, 257, 4, False, True),
    (2, 48, 8, 3136, 0, True, True),  # long sequence, few programs: 12 segments (tiled path)
    (2, 48, 8, 1000, 2, False, False),
    (2, 48, 8, 2000, 2, False, True),  # bidirectional in 7 segments
    (3, 24, 5, 1, 0, False, True),
]


@pytest.mark.cuda
@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda(poison_outputs, case, dtype):
    batch, dim, nstate, length, groups, causal, has_z = case
    inputs, softplus = make_inputs(batch=batch, dim=dim, nstate=nstate, length=length, groups=groups, has_z=has_z,
                                   device="cuda")
    inputs = _rounded(inputs, dtype)
    if dtype == torch.float32:
        compare(inputs, softplus, dtype=dtype, causal=causal)
    else:  # bf16 inputs and outputs, fp32 state
        compare(inputs, softplus, dtype=dtype, causal=causal, fwd_tol=1e-2, grad_tol=2e-2)


@pytest.mark.cuda
def test_cuda_last_state_and_mixed_dtypes(poison_outputs):
    """MambaVision's call: bf16 activations with fp32 A, D, delta_bias; plus the last state."""
    inputs, softplus = make_inputs(batch=4, dim=160, nstate=8, length=196, has_z=False, device="cuda")
    inputs = _rounded(inputs, torch.bfloat16)
    args = {k: (v.to(torch.bfloat16) if k in ("u", "delta", "B", "C") else v.float()) for k, v in inputs.items()
            if v is not None}
    out, last = selective_scan(args["u"], args["delta"], args["A"], args["B"], args["C"], args["D"],
                               delta_bias=args["delta_bias"], delta_softplus=True, return_last_state=True)
    ref, ref_last = selective_scan_ref(*(inputs[k] for k in NAMES), delta_softplus=softplus, return_last_state=True)
    assert out.dtype == torch.bfloat16 and last.dtype == torch.float32
    assert_close(out, ref, tol=1e-2, name="out")
    assert_close(last, ref_last, tol=1e-4, name="last_state")


@pytest.mark.cuda
def test_cuda_segments_last_state(poison_outputs):
    """The segmented long-sequence path with the last state and its gradient (fp32)."""
    assert launch_config(1500, 16, 32, 1).segments == 5
    inputs, softplus = make_inputs(batch=1, dim=32, nstate=16, length=1500, has_z=False, device="cuda")
    compare(inputs, softplus, dtype=torch.float32, return_last_state=True)


def test_interpreter_under_torch_compile(triton_interpreter):
    """torch.compile (Inductor) takes the registered op, also once automatic dynamic shapes make the sizes symbolic
    (a second sequence length and width): the Triton launch options must stay plain ints (the fake specializes)."""
    compiled = torch.compile(lambda *a: selective_scan(*a, delta_softplus=True))
    for dim, length in ((4, 9), (6, 13), (5, 11)):
        inputs, softplus = make_inputs(dim=dim, length=length, has_z=False)
        args = [inputs[k].float() if inputs[k] is not None else None for k in NAMES]
        expected = selective_scan_ref(*(inputs[k] for k in NAMES), delta_softplus=softplus)
        assert_close(compiled(*args), expected, tol=1e-4, name=f"out (dim {dim}, L {length})")


# ---------------------------------------------------------------------------------------------------------------
# The registered op (torch.compile / torch.export)


def _op():
    import importlib

    return importlib.import_module("visionssm.kernels.selective_scan.custom_op").selective_scan_op


OP_VARIANTS = {  # (causal, return_last_state, make_inputs options)
    "causal": (True, False, {"groups": 2}),
    "causal-last": (True, True, {"groups": 0, "has_z": False}),
    "bidir": (False, False, {"groups": 2}),
    "bidir-bare": (False, False, BARE),
}


def _opcheck(variant, requires_grad, **sizes):
    causal, last, options = OP_VARIANTS[variant]
    inputs, softplus = make_inputs(**{"batch": 1, "dim": 2, "nstate": 2, "length": 11, **sizes, **options})
    args = [v.float().requires_grad_(requires_grad) if v is not None else None for v in (inputs[k] for k in NAMES)]
    torch.library.opcheck(_op(), (*args, softplus, causal, last, requires_grad))


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("variant", list(OP_VARIANTS))
def test_opcheck_reference(reference_path, variant, requires_grad):
    _opcheck(variant, requires_grad, length=13)


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("variant", ["causal", "causal-last", "bidir"])
def test_opcheck_interpreter(triton_interpreter, poison_outputs, variant, requires_grad):
    """Two chunks of 8 tokens: the chunk-start states are among the tensors the forward keeps for the backward."""
    _opcheck(variant, requires_grad)


def test_opcheck_interpreter_segments(triton_interpreter, poison_outputs):
    """The segmented path also keeps the segments' sums of delta for the backward (the fake must know)."""
    with launch_overrides("selective_scan", chunk=4, segments=2):
        _opcheck("causal-last", True, length=9)


def test_op_without_saved_states_refuses_the_backward(triton_interpreter):
    inputs, softplus = make_inputs(batch=1, dim=2, nstate=2, length=11)
    args = [v.float().requires_grad_(True) if v is not None else None for v in (inputs[k] for k in NAMES)]
    out = _op()(*args, softplus, True, False, False)[0]
    with pytest.raises(RuntimeError, match="save_states=False"):
        out.sum().backward()


def _compiled_against_eager(compile_kwargs, *, causal, return_last_state, dtype=torch.float32, device="cpu",
                            autocast=None, tol=0.0, **sizes):
    inputs, softplus = make_inputs(**{"batch": 1, "dim": 2, "nstate": 2, "length": 11, "groups": 2, "device": device,
                                      **sizes})

    def fn(*args):
        return selective_scan(*args, delta_softplus=softplus, causal=causal, return_last_state=return_last_state)

    def run(f):
        with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
            return run_with_grads(f, inputs, softplus, dtype=dtype, causal=causal,
                                   return_last_state=return_last_state)

    args = [v.to(dtype) if v is not None else None for v in (inputs[k] for k in NAMES)]
    assert torch._dynamo.explain(fn)(*args).graph_break_count == 0
    compiled = run(lambda *a, **_: torch.compile(fn, fullgraph=True, **compile_kwargs)(*a))
    eager = run(lambda *a, **_: fn(*a))
    for got, want, name in ((compiled[0], eager[0], "out"), (compiled[1], eager[1], "last_state"),
                            *((compiled[2][k], eager[2][k], f"d{k}") for k in eager[2])):
        if want is None:
            assert got is None
            continue
        assert got.dtype == want.dtype and got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("variant", [(True, False), (True, True), (False, False)], ids=["causal", "last", "bidir"])
def test_compile_fullgraph_reference(reference_path, variant):
    causal, last = variant
    _compiled_against_eager({"backend": "aot_eager"}, causal=causal, return_last_state=last)


@pytest.mark.parametrize("variant", [(True, True), (False, False)], ids=["last", "bidir"])
def test_compile_fullgraph_interpreter(triton_interpreter, poison_outputs, variant):
    causal, last = variant
    _compiled_against_eager({"backend": "aot_eager"}, causal=causal, return_last_state=last)


def test_compile_fullgraph_autocast(reference_path):
    """Under autocast the registered op sees the inputs as the caller passes them, as the autograd.Function does."""
    _compiled_against_eager({"backend": "aot_eager"}, causal=True, return_last_state=True, autocast=torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("variant", [(True, True), (False, False)], ids=["last", "bidir"])
def test_cuda_compile_inductor_bf16(poison_outputs, variant):
    causal, last = variant
    _compiled_against_eager({}, causal=causal, return_last_state=last, dtype=torch.bfloat16, device="cuda", batch=4,
                            dim=64, nstate=8, length=197, has_z=not causal)


@pytest.mark.cuda
def test_cuda_compile_inductor_autocast(poison_outputs):
    """MambaVision's call under bf16 autocast: fp32 parameters and activations as passed, fullgraph."""
    _compiled_against_eager({}, causal=True, return_last_state=False, device="cuda", autocast=torch.bfloat16, batch=4,
                            dim=64, nstate=8, length=196, groups=0, has_z=False)


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_cuda_compile_cuda_graphs(causal):
    """mode="reduce-overhead": the op runs inside the captured CUDA graph (replays after the warm-up calls)."""
    inputs, softplus = make_inputs(batch=4, dim=64, nstate=8, length=196, groups=0, device="cuda")
    args = [v.to(torch.bfloat16) if v is not None else None for v in (inputs[k] for k in NAMES)]

    def fn(*args):
        return selective_scan(*args, delta_softplus=softplus, causal=causal)

    compiled = torch.compile(fn, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        expected = fn(*args)
        for _ in range(3):
            got = compiled(*args).clone()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
