"""The mixer layers: the mixer contract (every registered mixer), causality, gradients, dtype/device kwargs, and
each layer's own details (Comba's feedback factor b and transitions, GKA's kernel arguments, parameter budgets),
and the fused GKA/Comba layers against their reference composition.

CPU only; the kernels run on their PyTorch reference path here (tests/conftest.py sets VISIONSSM_KERNELS=torch),
except the fused-layer tests, which run the Triton kernels in Triton's interpreter.
"""

import contextlib
import inspect

import pytest
import torch

from visionssm import kernels
from visionssm.kernels.tuning import launch_overrides
from visionssm.kernels.utils import assert_close, relative_error
from visionssm.layers import MIXERS, SequenceMixer
from visionssm.layers.comba import CombaMixer
from visionssm.layers.gka import GKAMixer

DIM = 64
SEQ = 23  # not a multiple of any chunk size

# Cheaper settings for CPU where a mixer's defaults are slow (dim 64 -> GKA: 2 heads of 16; Comba: 2 heads of 32).
# Every registered mixer is tested, with its defaults where it has no entry here.
SMALL = {"gka": {"num_iters": 8}, "comba": {"num_heads": 2}}
LAYERS = {name: (lambda causal, name=name, **kw: MIXERS[name].cls(DIM, causal=causal, **{**SMALL.get(name, {}), **kw}))
          for name in MIXERS}


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_mixer_contract(name):
    spec = MIXERS[name]
    assert issubclass(spec.cls, SequenceMixer)
    parameters = inspect.signature(spec.cls).parameters
    assert list(parameters)[0] == "dim"
    for argument in ("causal", "device", "dtype"):
        assert parameters[argument].kind is inspect.Parameter.KEYWORD_ONLY, argument
    layer = LAYERS[name](True)
    assert layer.dim == DIM and "causal" in vars(layer) and layer.causal is True  # a plain attribute
    own = {n for n, _ in layer.named_parameters(recurse=False)}
    assert layer.no_weight_decay() <= own and set(type(layer).no_weight_decay_names) >= layer.no_weight_decay()
    if spec.kernel is not None:
        assert spec.kernel in kernels.MIXER_OPS
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    torch.manual_seed(1)
    layer.reset_parameters()
    assert set(before) == {n for n, _ in layer.named_parameters()}


@pytest.mark.parametrize("name", sorted(name for name in MIXERS if MIXERS[name].cls.linear_input))
def test_linear_input_means_autocast_casts_the_input_first(name):
    """``linear_input = True`` (the contract): under autocast the mixer's result does not depend on whether its input
    arrives in float32 or already in autocast's dtype, so a backbone's pre-norm may write it in that dtype."""
    layer = _far_from_init(LAYERS[name](False))
    x = _input()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(layer(x), layer(x.bfloat16()))


@torch.no_grad()
def _far_from_init(layer):
    """Random weights of a visible size: some mixers start with their token mixing almost off (MambaVision's)."""
    for param in layer.parameters():
        param.normal_(0.0, 0.3)
    return layer


def _input(batch=2, seq=SEQ, dtype=torch.float32):
    return torch.randn(batch, seq, DIM, dtype=dtype)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_shape_contract(name, causal):
    layer = LAYERS[name](causal)
    assert layer.causal is causal
    for batch, seq in ((2, SEQ), (1, 1), (3, 5)):
        x = _input(batch, seq)
        y = layer(x)
        assert y.shape == x.shape and y.dtype == x.dtype
        assert torch.isfinite(y).all()


@pytest.mark.parametrize("layer", [
    GKAMixer(DIM, use_output_gate=False, num_iters=8),
    GKAMixer(DIM, expand=1.0, head_dim=32, conv_size=4, num_iters=8),
    CombaMixer(DIM, gate_rank=None, causal=True),
    CombaMixer(DIM, num_heads=4, expand_v=0.5, conv_size=4),
], ids=["gka-no-gate", "gka-expand1", "comba-full-gate", "comba-expand-v"])
def test_variants(layer):
    x = _input()
    y = layer(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.square().mean().backward()
    for param_name, param in layer.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, param_name


def test_default_causality():
    # GKA is causal as published; Comba defaults to the bidirectional vision variant.
    assert GKAMixer(DIM).causal is True
    assert CombaMixer(DIM, num_heads=2).causal is False


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_bad_input_fails_loudly(name):
    layer = LAYERS[name](True)
    with pytest.raises(ValueError, match="x must have shape"):
        layer(torch.randn(2, SEQ, DIM + 1))
    with pytest.raises(ValueError, match="x must have shape"):
        layer(torch.randn(SEQ, DIM))
    with pytest.raises(TypeError, match="causal"):
        LAYERS[name](1)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="head_dim"):
        GKAMixer(40)  # 40 * 0.5 = 20 channels is not a whole number of 16-channel heads
    with pytest.raises(ValueError, match="ridge"):
        GKAMixer(DIM, ridge=0.0)
    with pytest.raises(ValueError, match="num_iters"):
        GKAMixer(DIM, num_iters=0)
    with pytest.raises(ValueError, match="num_heads"):
        CombaMixer(DIM, num_heads=3)
    with pytest.raises(ValueError, match="gate_rank"):
        CombaMixer(DIM, gate_rank=0)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_causal_and_non_causal_differ(name):
    causal = LAYERS[name](True)
    bidirectional = LAYERS[name](False)
    _far_from_init(causal)
    # Same weights wherever both have them (the non-causal GKA layer has no forgetting gate: its input projection
    # lacks the last H rows, the forget-gate logits).
    state = causal.state_dict()
    shapes = {name: t.shape for name, t in bidirectional.state_dict().items()}
    state = {name: t[:shapes[name][0]] for name, t in state.items() if name in shapes}
    bidirectional.load_state_dict(state)
    x = _input()
    y_causal, y_bidirectional = causal(x), bidirectional(x)
    # The last token sees the whole sequence in both variants, earlier tokens do not.
    assert (y_causal[:, :-1] - y_bidirectional[:, :-1]).abs().amax() > 1e-3


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_causal_output_ignores_later_tokens(name, causal):
    layer = _far_from_init(LAYERS[name](causal))
    x = _input()
    t0 = SEQ // 2
    x_perturbed = x.clone()
    x_perturbed[:, t0] += 3.0 * torch.randn(x.shape[0], DIM)
    y, y_perturbed = layer(x), layer(x_perturbed)
    change = (y - y_perturbed).abs().amax(dim=(0, 2))
    assert change[t0:].amax() > 1e-3  # the perturbation is seen at and after t0
    if causal:
        assert change[:t0 - layer.lookahead()].amax() == 0.0
    else:
        assert change[:t0].amin() > 1e-6  # the bidirectional layer does see the future: the check can fail


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_gradients_reach_every_parameter(name, causal):
    # away from init: a zero-initialised output projection (SKA's, as its paper has it) blocks every other gradient
    # at the first step by design
    layer = _far_from_init(LAYERS[name](causal))
    x = _input().requires_grad_()
    layer(x).square().mean().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for param_name, param in layer.named_parameters():
        assert param.grad is not None, param_name
        assert torch.isfinite(param.grad).all(), param_name
        assert param.grad.abs().sum() > 0, f"{param_name} gets a zero gradient"


@pytest.mark.parametrize("causal", [True, False])
def test_comba_feedback_b_is_not_cancelled(causal, monkeypatch):
    layer = CombaMixer(DIM, causal=causal, num_heads=2)
    with torch.no_grad():
        layer.b_logit.copy_(torch.tensor([-1.0, 2.0]))
        layer.correction.copy_(torch.tensor([0.3, -0.2]))
    captured = {}
    original = kernels.comba

    def spy(q, k, v, p, g, beta, **kwargs):
        captured.update(q=q, k=k, p=p, g=g, beta=beta, kwargs=kwargs)
        return original(q, k, v, p, g, beta, **kwargs)

    monkeypatch.setattr(kernels, "comba", spy)
    x = _input()
    layer(x).square().mean().backward()
    b = torch.sigmoid(layer.b_logit.detach())
    k, p, q = captured["k"].detach(), captured["p"].detach(), captured["q"].detach()
    # k is unit-norm, p = b·k keeps its norm b (the kernel receives it un-normalised), q = q̂ − d·p.
    # (Norms are 1 up to the eps of the L2 normalisation.)
    torch.testing.assert_close(k.norm(dim=-1), torch.ones_like(k[..., 0]), rtol=0, atol=1e-3)
    torch.testing.assert_close(p, k * b[:, None])
    q_hat = q + layer.correction.detach()[:, None] * p
    torch.testing.assert_close(q_hat.norm(dim=-1), torch.ones_like(q[..., 0]), rtol=0, atol=1e-3)
    assert (captured["g"] <= 0).all() and ((captured["beta"] > 0) & (captured["beta"] < 1)).all()
    assert captured["kwargs"] == {"causal": causal}
    # And b matters: it gets a gradient, and changing it changes the output.
    assert layer.b_logit.grad is not None and (layer.b_logit.grad.abs() > 0).all()
    assert (layer.correction.grad.abs() > 0).all()
    monkeypatch.setattr(kernels, "comba", original)
    y = layer(x)
    with torch.no_grad():
        layer.b_logit.add_(1.0)
    assert (layer(x) - y).abs().amax() > 1e-4


def test_gka_kernel_arguments(monkeypatch):
    layer = GKAMixer(DIM, causal=True, ridge=0.05, num_iters=7)
    captured = {}
    original = kernels.gka

    def spy(q, k, v, g, beta, alpha, **kwargs):
        captured.update(q=q, k=k, v=v, g=g, beta=beta, alpha=alpha, kwargs=kwargs)
        return original(q, k, v, g, beta, alpha, **kwargs)

    monkeypatch.setattr(kernels, "gka", spy)
    layer(_input())
    q, k, v = captured["q"], captured["k"], captured["v"]
    assert q.shape == k.shape == v.shape == (2, SEQ, 2, 16)  # head dim 16, expand 0.5
    torch.testing.assert_close(q.norm(dim=-1), torch.ones_like(q[..., 0]), rtol=0, atol=1e-3)
    torch.testing.assert_close(k.norm(dim=-1), torch.ones_like(k[..., 0]), rtol=0, atol=1e-3)
    assert captured["g"].dtype == torch.float32 and (captured["g"] <= 0).all()
    for gate in ("beta", "alpha"):
        assert captured[gate].shape == (2, SEQ, 2)
        assert ((captured[gate] > 0) & (captured[gate] < 1)).all()
    assert captured["kwargs"] == {"causal": True, "ridge": 0.05, "num_iters": 7, "solver": "auto"}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_dtype_and_device_kwargs(name):
    layer = LAYERS[name](True, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in layer.parameters())
    x = _input(dtype=torch.float64)
    y = layer(x)
    assert y.dtype == torch.float64 and torch.isfinite(y).all()
    # float64 gives the float32 result up to float32 rounding.
    layer32 = LAYERS[name](True)
    layer32.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    torch.testing.assert_close(layer32(x.float()), y.float(), rtol=1e-3, atol=1e-4)

    meta = LAYERS[name](True, device="meta")
    assert all(p.device.type == "meta" for p in meta.parameters())

    bf16 = LAYERS[name](True, dtype=torch.bfloat16)
    # (a mixer may keep its recurrence's own parameters in float32, as MambaVision's A_log and D)
    assert all(p.dtype in (torch.bfloat16, torch.float32) for p in bf16.parameters())
    assert any(p.dtype == torch.bfloat16 for p in bf16.parameters())
    y16 = bf16(_input(dtype=torch.bfloat16))
    assert y16.dtype == torch.bfloat16 and torch.isfinite(y16.float()).all()


@pytest.mark.parametrize("bias", [False, True])
def test_aligned_projection_is_the_projection_padded(bias):
    """The first N columns are the layer's own projection, forward and backward; the padding is zero and adds no
    gradient; the weight keeps its N rows."""
    from visionssm.layers.common import aligned_projection

    linear = torch.nn.Linear(6, 13, bias=bias).double()
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    out = aligned_projection(x, linear)
    assert out.shape == (2, 5, 16) and linear.weight.shape == (13, 6)
    assert torch.equal(out[..., 13:], torch.zeros_like(out[..., 13:]))
    cotangent = torch.randn(2, 5, 13, dtype=torch.float64)
    grads = torch.autograd.grad(out[..., :13], [x, *linear.parameters()], cotangent)
    want = torch.autograd.grad(linear(x), [x, *linear.parameters()], cotangent)
    torch.testing.assert_close(out[..., :13], linear(x), rtol=1e-12, atol=1e-12)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    assert aligned_projection(x, torch.nn.Linear(6, 16).double()).shape == (2, 5, 16)


def test_aligned_projection_follows_every_weight_change():
    """Without autograd too the padded weight is built from the parameter of the call: an update through ``.data``
    (EMA helpers, sharded-parameter wrappers) moves no version counter, so a padded copy kept across calls would go
    stale silently."""
    from visionssm.layers.common import aligned_projection

    linear = torch.nn.Linear(6, 13)
    x = torch.randn(2, 5, 6)
    with torch.no_grad():
        aligned_projection(x, linear)
        linear.weight.data.mul_(-2.0)
        linear.bias.data.add_(1.0)
        torch.testing.assert_close(aligned_projection(x, linear), torch.nn.functional.pad(linear(x), (0, 3)),
                                   rtol=0, atol=0)


def test_aligned_projection_leaves_hooked_and_wrapped_linears_alone():
    """A forward hook on the projection (feature extraction, FLOP counting) still sees the call, and a Linear
    subclass (a LoRA-style wrapper) still runs its own forward: both unpadded."""
    from visionssm.layers.common import aligned_projection

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    x = torch.randn(2, 5, 6)
    linear = torch.nn.Linear(6, 13)
    seen = []
    handle = linear.register_forward_hook(lambda module, inputs, output: seen.append(output.shape))
    try:
        out = aligned_projection(x, linear)
    finally:
        handle.remove()
    assert seen == [(2, 5, 13)] and out.shape == (2, 5, 13)
    wrapped = Scaled(6, 13)
    torch.testing.assert_close(aligned_projection(x, wrapped), 2 * torch.nn.functional.linear(x, wrapped.weight,
                                                                                              wrapped.bias))


def test_gka_parameter_budget():
    # gka_vision_T hosts this layer in 4 blocks of width 320 and 2 of width 640 (see the module docstring):
    # the six mixers must hold 0.99 M – 4.17 M parameters for the model to stay within 5 % of 31.8 M.
    def count(dim, **kw):
        return sum(p.numel() for p in GKAMixer(dim, **kw).parameters())

    assert count(320) == 267_096 and count(640) == 1_065_376
    total = 4 * count(320) + 2 * count(640)
    assert 0.99e6 <= total <= 4.17e6
    assert 29_218_888 + total == 32_418_024  # the rest of mamba_vision_T is 29,218,888 parameters
    assert 29_218_888 + 4 * count(320, use_output_gate=False) + 2 * count(640, use_output_gate=False) == 31_803_624


# ---------------------------------------------------------------------------------------------------------------
# The fused layer (mixer_prologue + mixer kernel + gated_rmsnorm) against the reference composition

FUSED_CASES = {
    "comba-splr-bidirectional": lambda: CombaMixer(DIM, num_heads=2, causal=False),
    "comba-iplr-causal": lambda: CombaMixer(DIM, num_heads=2, causal=True, transition="iplr", conv_size=4),
    "comba-full-gate-expand-v": lambda: CombaMixer(DIM, num_heads=4, causal=False, gate_rank=None, expand_v=0.5),
    "gka-causal": lambda: GKAMixer(DIM, causal=True),
    "gka-bidirectional-no-gate": lambda: GKAMixer(DIM, causal=False, use_output_gate=False),
}


def _old_forward(layer, x):
    """The layers' forward as it was written before the fused ops, from their own modules (ShortConv1d,
    l2_normalize, GatedRMSNorm): the reference path must give these numbers bit for bit."""
    from visionssm.layers.common import l2_normalize

    B, L, _ = x.shape
    proj = layer.in_proj(x)
    if isinstance(layer, CombaMixer):
        H, K, V = layer.num_heads, layer.head_dim, layer.head_v_dim
        split = [2 * layer.dim + layer.value_dim, H, H, layer._prologue_spec.gate_cols[1]]
        qkv, forget, beta, gate = proj.split(split, dim=-1)
        q, k, v = layer.qkv_conv(qkv, layer.causal).split([layer.dim, layer.dim, layer.value_dim], dim=-1)
        q, k, v = l2_normalize(q.reshape(B, L, H, K)), l2_normalize(k.reshape(B, L, H, K)), v.reshape(B, L, H, V)
        p = k * torch.sigmoid(layer.b_logit).to(k.dtype)[:, None]
        q = q - layer.correction.to(q.dtype)[:, None] * p
        g = -layer.A_log.float().exp() * torch.nn.functional.softplus(forget.float() + layer.dt_bias.float())
        o = kernels.comba(q, k, v, p, g, torch.sigmoid(beta), causal=layer.causal)
        gate = layer.gate_up(gate) if layer.gate_up is not None else gate
        return layer.out_proj(layer.out_norm(o, gate.reshape(B, L, H, V)).reshape(B, L, layer.value_dim))
    H, D = layer.num_heads, layer.head_dim
    split = [3 * layer.inner_dim, layer.inner_dim if layer.use_output_gate else 0, (3 if layer.causal else 2) * H]
    qkv, gate, gates = proj.split(split, dim=-1)
    q, k, v = layer.qkv_conv(qkv, layer.causal).view(B, L, 3, H, D).unbind(2)
    q, k = l2_normalize(q), l2_normalize(k)
    beta = torch.sigmoid(gates[..., :H] + layer.beta_bias)
    alpha = torch.sigmoid(gates[..., H:2 * H] + layer.alpha_bias)
    g = None
    if layer.A_log is not None:
        decay_logits = gates[..., 2 * H:].float() + layer.dt_bias.float()
        g = -layer.A_log.float().exp() * torch.nn.functional.softplus(decay_logits)
    o = kernels.gka(q, k, v, g, beta, alpha, causal=layer.causal, ridge=layer.ridge, num_iters=layer.num_iters,
                    solver=layer.solver)
    o = layer.out_norm(o, gate.reshape(B, L, H, D) if layer.use_output_gate else None)
    return layer.out_proj(o.reshape(B, L, layer.inner_dim))


@pytest.mark.parametrize("case", [c for c in FUSED_CASES if "iplr" not in c])
def test_reference_path_is_the_old_composition(case):
    """Checkpoints stay loadable and give the same outputs: on the reference path the layer computes exactly what
    it computed before its ops were fused (same parameters, same state-dict keys, same numbers)."""
    layer = _far_from_init(FUSED_CASES[case]())
    x = _input()
    torch.testing.assert_close(layer(x), _old_forward(layer, x), rtol=0, atol=0)


def _outputs_and_grads(layer, x, cotangent, *, reference_ops: bool, dtype):
    x = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    with contextlib.ExitStack() as stack:
        if reference_ops:
            stack.enter_context(launch_overrides("mixer_prologue", reference=True))
            stack.enter_context(launch_overrides("gated_rmsnorm", reference=True))
        if dtype == torch.bfloat16:
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        y = layer(x)
    (y.float() * cotangent).sum().backward()
    return y.detach(), {"x": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}


@pytest.mark.parametrize("case", sorted(FUSED_CASES))
def test_fused_layer_matches_reference_composition(case, triton_interpreter, poison_outputs):
    """The fused ops (Triton, in the interpreter) against the reference composition around the same mixer kernel:
    output and the gradient of the input and of every parameter, in fp32 and in bf16 (one fp32 truth for both).
    fp32: the two agree to 1e-5 / 1e-4. bf16 (under autocast): both are compared with the fp32 reference, and the
    fused layer must be about as close to it as the reference composition is (sums that cancel, as b_logit's gradient,
    lose tens of percent in bf16 either way): within three times its error plus 1e-2. (Twice was the bound until the
    Comba kernel's bf16 states: comba-iplr-causal's b_logit gradient then moved from 4.18e-2 to 4.27e-2 against a
    bound of 4.21e-2, the reference composition itself being at 1.6e-2 there and at 3e-2 to 5e-1 in the other Comba
    cases.)"""
    layer = _far_from_init(FUSED_CASES[case]())
    with torch.no_grad():  # keep the recurrences' gates in their trained range
        for name in ("A_log", "dt_bias"):
            if getattr(layer, name, None) is not None:
                getattr(layer, name).clamp_(-2.0, 1.0)
    x = _input(seq=13)
    cotangent = torch.randn(x.shape)
    truth = _outputs_and_grads(layer, x, cotangent, reference_ops=True, dtype=torch.float32)
    names = ["y", *truth[1]]
    for dtype in (torch.float32, torch.bfloat16):
        reference = truth if dtype == torch.float32 else _outputs_and_grads(layer, x, cotangent, reference_ops=True,
                                                                            dtype=dtype)
        fused = _outputs_and_grads(layer, x, cotangent, reference_ops=False, dtype=dtype)
        assert fused[0].dtype == reference[0].dtype
        for name, got, ref, want in zip(names, (fused[0], *fused[1].values()),
                                        (reference[0], *reference[1].values()), (truth[0], *truth[1].values())):
            assert got is not None and want is not None, name
            if dtype == torch.float32:
                assert_close(got, want, tol=1e-5 if name == "y" else 1e-4, name=name)
            else:
                assert_close(got, want, tol=3 * relative_error(ref, want) + 1e-2, name=f"{name} (bf16)")


def test_comba_gate_up_inside_the_op_equals_calling_it(triton_interpreter, poison_outputs, monkeypatch):
    """Comba's low-rank gate up-projected inside gated_rmsnorm (the kernels, in the interpreter) against the old
    composition, gate_up called and its output passed as the gate: output, input and every parameter gradient in
    float32. A forward hook on gate_up forces the old composition, and sees its call; so does a subclass in its
    place."""
    layer = _far_from_init(CombaMixer(DIM, num_heads=2, gate_rank=8))
    x, cotangent = _input(seq=13), torch.randn(2, 13, DIM)
    calls = []
    op = kernels.gated_rmsnorm
    monkeypatch.setattr(kernels, "gated_rmsnorm", lambda *a, **kw: calls.append(kw["gate_weight"]) or op(*a, **kw))

    def run():
        xg = x.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        y = layer(xg)
        (y * cotangent).sum().backward()
        return [y.detach(), xg.grad, *(p.grad for _, p in layer.named_parameters())]

    fused = run()
    assert calls == [layer.gate_up.weight]
    seen = []
    handle = layer.gate_up.register_forward_hook(lambda module, args, out: seen.append(tuple(out.shape)))
    try:
        old = run()
    finally:
        handle.remove()
    assert seen == [(2, 13, layer.value_dim)] and calls[1:] == [None]
    for name, got, want in zip(["y", "x", *(n for n, _ in layer.named_parameters())], fused, old):
        assert got is not None and want is not None, name
        assert_close(got, want, tol=1e-5 if name == "y" else 1e-4, name=name)

    class CountingLinear(torch.nn.Linear):
        def forward(self, inputs):
            seen.append("subclass")
            return super().forward(inputs)

    layer.gate_up.__class__ = CountingLinear
    assert_close(run()[0], old[0], tol=1e-5, name="y (subclass)")
    assert seen[1:] == ["subclass"] and calls[2:] == [None]


@pytest.mark.cuda
@pytest.mark.parametrize("case,L", [("comba_vision_S", 196), ("comba_vision_T-iplr", 197), ("gka_vision_T-stage3", 196),
                                    ("gka_vision_T-stage4", 49), ("gka-bidirectional", 196)])
def test_cuda_fused_layer_at_model_shapes(case, L, poison_outputs):
    """The layers as the models build them, bf16 autocast on the GPU: the fused ops are as close to the fp32
    reference composition as the bf16 reference composition is (output, input and every parameter gradient)."""
    torch.manual_seed(0)
    layer = {"comba_vision_S": lambda: CombaMixer(384, num_heads=6, gate_rank=32),
             "comba_vision_T-iplr": lambda: CombaMixer(192, num_heads=3, gate_rank=16, transition="iplr"),
             "gka_vision_T-stage3": lambda: GKAMixer(320), "gka_vision_T-stage4": lambda: GKAMixer(640),
             "gka-bidirectional": lambda: GKAMixer(320, causal=False)}[case]().cuda()
    x = torch.randn(16, L, layer.dim, device="cuda")
    cotangent = torch.randn(x.shape, device="cuda")

    def run(reference_ops: bool, autocast: bool):
        xg = x.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        with contextlib.ExitStack() as stack:
            if reference_ops:
                stack.enter_context(launch_overrides("mixer_prologue", reference=True))
                stack.enter_context(launch_overrides("gated_rmsnorm", reference=True))
            stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast))
            y = layer(xg)
        (y.float() * cotangent).sum().backward()
        return [y.detach(), xg.grad, *(p.grad for _, p in layer.named_parameters())]

    truth, reference, fused = run(True, False), run(True, True), run(False, True)
    names = ["y", "x", *(n for n, _ in layer.named_parameters())]
    for name, got, ref, want in zip(names, fused, reference, truth):
        assert_close(got, want, tol=2 * relative_error(ref, want) + 1e-2, name=f"{name} (bf16)")
    fused32 = run(False, False)  # fp32: the fused ops against the reference composition
    for name, got, want in zip(names, fused32, truth):
        assert_close(got, want, tol=1e-3, name=f"{name} (fp32)")


# ---------------------------------------------------------------------------------------------------------------
# Comba-iplr as a layer option


def test_comba_transition_option():
    splr, iplr = CombaMixer(DIM, num_heads=2), CombaMixer(DIM, num_heads=2, transition="iplr")
    assert splr.transition == "splr" and iplr.transition == "iplr" and "transition=iplr" in repr(iplr)
    # no parameters of its own: a checkpoint of either loads into the other
    assert {k: v.shape for k, v in splr.state_dict().items()} == {k: v.shape for k, v in iplr.state_dict().items()}
    iplr.load_state_dict(_far_from_init(splr).state_dict())
    x = _input()
    assert (iplr(x) - splr(x)).abs().amax() > 1e-4
    with pytest.raises(ValueError, match="transition"):
        CombaMixer(DIM, num_heads=2, transition="dplr")


def test_comba_iplr_feedback_key(monkeypatch):
    """iplr hands the kernel p = 2·b·e^g·k̂ (the transition e^g (I − 2bβ k̂k̂ᵀ)) and keeps q' = q̂ − d·b·k̂."""
    layer = CombaMixer(DIM, causal=False, num_heads=2, transition="iplr")
    captured = {}
    original = kernels.comba

    def spy(q, k, v, p, g, beta, **kwargs):
        captured.update(q=q, k=k, p=p, g=g)
        return original(q, k, v, p, g, beta, **kwargs)

    monkeypatch.setattr(kernels, "comba", spy)
    layer(_input())
    b = torch.sigmoid(layer.b_logit.detach())
    k, p, g, q = (captured[n].detach() for n in ("k", "p", "g", "q"))
    torch.testing.assert_close(p, k * (2 * b[:, None] * g.exp()[..., None]))
    q_hat = q + layer.correction.detach()[:, None] * b[:, None] * k
    torch.testing.assert_close(q_hat.norm(dim=-1), torch.ones_like(q[..., 0]), rtol=0, atol=1e-3)


class _KeepEverything:
    """``recompute_saved`` switched off: every save kept."""

    def __init__(self, tensors, recompute):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _saved_and_grads(layer, x, cotangent, dtype):
    """(output, gradients of x and every parameter, activation bytes kept for the backward)."""
    from visionssm.benchmark import memory

    autocast_dtype = torch.bfloat16 if dtype == torch.bfloat16 else None
    kept = memory.summarize(memory.saved_tensors(layer, x.detach().clone().requires_grad_(),
                                                 autocast_dtype=autocast_dtype))["activation_bytes"]
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_dtype is not None):
        y = layer(x)
    (y.float() * cotangent).sum().backward()
    return y.detach(), {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}, kept


@pytest.mark.parametrize("kernels_path", ["interpreter", "reference"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["comba", "gka"])
def test_kernel_inputs_recomputed_for_the_backward(name, causal, kernels_path, request, poison_outputs, monkeypatch):
    """The recurrence's inputs (the prologue's outputs) are rebuilt from the projection for the backward instead of
    kept: the same output and gradients bit for bit (fp32 and bf16 autocast), and, where the kernels keep them (the
    Triton path; the reference ops keep tensors derived from them), at least q, k and v fewer bytes kept."""
    request.getfixturevalue("triton_interpreter" if kernels_path == "interpreter" else "reference_path")
    import visionssm.layers.comba as comba_module
    import visionssm.layers.gka as gka_module

    layer = LAYERS[name](causal)
    x, cotangent = _input(seq=13), torch.randn(2, 13, DIM)
    for dtype in (torch.float32, torch.bfloat16):
        y, grads, kept = _saved_and_grads(layer, x, cotangent, dtype)
        with monkeypatch.context() as patch:
            patch.setattr(comba_module if name == "comba" else gka_module, "recompute_saved", _KeepEverything)
            y_all, grads_all, kept_all = _saved_and_grads(layer, x, cotangent, dtype)
        torch.testing.assert_close(y, y_all, rtol=0, atol=0)
        for key, grad in grads_all.items():
            torch.testing.assert_close(grads[key], grad, rtol=0, atol=0, msg=key)
        qkv_bytes = 3 * x.numel() * (0.5 if name == "gka" else 1) * (2 if dtype == torch.bfloat16 else 4)
        assert kept <= kept_all - (qkv_bytes if kernels_path == "interpreter" else 0), (kept, kept_all, qkv_bytes)


@pytest.mark.parametrize("kernels_path", ["interpreter", "reference"])
@pytest.mark.parametrize("causal", [False, True])
def test_comba_recompute_state_same_numbers_less_kept(causal, kernels_path, request, poison_outputs):
    """``recompute_state=True``: the prologue and the recurrence run again in the backward, nothing but the
    projection kept: the same output and gradients bit for bit, fewer bytes kept, and nothing the recurrence's op
    keeps (its chunk states on the Triton path) among them."""
    from visionssm.benchmark import memory

    request.getfixturevalue("triton_interpreter" if kernels_path == "interpreter" else "reference_path")
    layer = LAYERS["comba"](causal)
    again = LAYERS["comba"](causal, recompute_state=True)
    again.load_state_dict(layer.state_dict())
    assert "recompute_state=True" in repr(again)
    x, cotangent = _input(seq=37), torch.randn(2, 37, DIM)
    y, grads, kept = _saved_and_grads(layer, x, cotangent, torch.float32)
    y_again, grads_again, kept_again = _saved_and_grads(again, x, cotangent, torch.float32)
    torch.testing.assert_close(y_again, y, rtol=0, atol=0)
    for key, grad in grads.items():
        torch.testing.assert_close(grads_again[key], grad, rtol=0, atol=0, msg=key)
    assert kept_again < kept
    sites = lambda mixer: {r.site.split(":")[0] for r in memory.saved_tensors(mixer, x.clone().requires_grad_())}
    assert any(site.startswith("kernels/comba/") for site in sites(layer))
    assert not any(site.startswith("kernels/comba/") for site in sites(again))
    with pytest.raises(TypeError, match="recompute_state"):
        LAYERS["comba"](causal, recompute_state="yes")


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["comba", "gka"])
def test_cuda_saved_inputs_recomputed_and_recompute_state(name, causal, monkeypatch):
    """On the GPU kernels, bf16 autocast, at a model's width and a 1024-px stage length: the recomputed kernel inputs
    (and Comba's recompute_state) give the output and gradients of keeping everything (to the run-to-run noise of
    atomic adds), for fewer bytes held from the forward to the backward."""
    import visionssm.layers.comba as comba_module
    import visionssm.layers.gka as gka_module
    from visionssm.layers.comba import CombaMixer
    from visionssm.layers.gka import GKAMixer

    torch.manual_seed(0)
    make = (lambda **kw: CombaMixer(384, causal=causal, num_heads=6, gate_rank=32, **kw)) if name == "comba" else \
        (lambda **kw: GKAMixer(320, causal=causal, **kw))
    layer = make().cuda()
    x = torch.randn(2, 4096, layer.dim, device="cuda")
    cotangent = torch.randn_like(x)

    def run(mixer):
        mixer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = mixer(xi)
        kept = torch.cuda.memory_allocated() - start
        (y.float() * cotangent).sum().backward()
        return y.detach(), [xi.grad] + [p.grad for p in mixer.parameters()], kept

    run(layer)  # a first call makes lazily created buffers (cuBLAS's workspace) that would count as kept
    y, grads, kept = run(layer)
    with monkeypatch.context() as patch:
        patch.setattr(comba_module if name == "comba" else gka_module, "recompute_saved", _KeepEverything)
        y_all, grads_all, kept_all = run(layer)
    variants = [(y_all, grads_all)]
    assert kept < kept_all, (kept, kept_all)
    if name == "comba":
        lean = make(recompute_state=True).cuda()
        lean.load_state_dict(layer.state_dict())
        y_lean, grads_lean, kept_lean = run(lean)
        assert kept_lean < kept, (kept_lean, kept)
        variants.append((y_lean, grads_lean))
    # the same kernels on the same inputs; only the order of a kernel's atomic adds may differ between two runs
    for y_other, grads_other in variants:
        assert relative_error(y_other, y) < 1e-3
        for i, (got, want) in enumerate(zip(grads_other, grads)):
            assert relative_error(got, want) < 1e-3, f"gradient {i}: {relative_error(got, want):.3g}"
