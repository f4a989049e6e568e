"""Mixer prologue op: the PyTorch composition against a per-token float64 spec, the Triton kernels against the
composition in float64 (forward and every gradient, odd lengths, NaN-poisoned outputs), the iplr transition through
the Comba kernel against a direct per-token iplr recurrence, the layers' specs, bad input (the spec's when it is
built, the call's tensors when it runs)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from visionssm.kernels import comba as comba_op
from visionssm.kernels import dispatch, mixer_prologue
from visionssm.kernels.layers.mixer_prologue import PrologueSpec, _well_formed, mixer_prologue_reference
from visionssm.kernels.tuning import launch_overrides
from visionssm.kernels.utils import assert_close

OUTPUTS = ("q", "k", "v", "p", "g", "beta", "alpha", "gate")
PARAMS = ("beta_bias", "alpha_bias", "A_log", "dt_bias", "feedback", "correction")
SPEC_FIELDS = ("num_heads", "key_dim", "value_dim", "causal", "beta_col", "decay_col", "gate_cols", "eps",
               "alpha_col", "transition")


def spec_and_params(kwargs):
    """A problem's flat description (the reference's keyword arguments) as the op takes it: the layer's spec and the
    per-head parameters it passes."""
    spec = PrologueSpec(**{name: kwargs[name] for name in SPEC_FIELDS if name in kwargs})
    return spec, {name: kwargs[name] for name in PARAMS if kwargs.get(name) is not None}


def call(proj, conv_weight, kwargs, fn=None):
    spec, params = spec_and_params(kwargs)
    return (fn or mixer_prologue)(proj, conv_weight, spec, **params)


def make_problem(mode: str, B=2, L=7, H=2, K=8, V=8, KS=3, gate_width=5, seed=0, dtype=torch.float32,
                 device="cpu", transition="splr", causal=True, aligned=False, unused=0):
    """(proj, conv_weight, kwargs) laid out as the layers lay out their input projection: comba [q k v | decay
    beta | gate], gka [q k v | gate | beta alpha (decay)], then ``unused`` columns no output reads."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    C = 2 * H * K + H * V
    kwargs = {"num_heads": H, "key_dim": K, "value_dim": V, "causal": causal}
    if mode == "comba":
        N = C + 2 * H + gate_width
        kwargs.update(decay_col=C, beta_col=C + H, A_log=rand(H), dt_bias=rand(H), feedback=rand(H),
                      correction=0.3 * rand(H), transition=transition, gate_cols=(C + 2 * H, gate_width))
    elif mode in ("gka", "gka-noncausal"):
        N = C + H * V + (3 if mode == "gka" else 2) * H
        kwargs.update(beta_col=C + H * V, beta_bias=rand(H), alpha_col=C + H * V + H, alpha_bias=rand(H),
                      gate_cols=(C, H * V))
        if mode == "gka":
            kwargs.update(decay_col=C + H * V + 2 * H, A_log=rand(H), dt_bias=rand(H))
    else:  # the minimum: q, k, v and one gate without bias
        N = C + H
        kwargs.update(beta_col=C)
    proj = rand(B, L, N + unused)
    weight = 0.6 * rand(C, 1, KS)
    if aligned:  # nearly parallel keys, feedback gain near 2, slow decay: the hard case of the iplr transition
        proj[..., H * K:2 * H * K] = rand(B, 1, H * K) + 0.05 * rand(B, L, H * K)
        weight[H * K:2 * H * K] = 0.5
        proj[..., kwargs["beta_col"]:kwargs["beta_col"] + H] = 6.0
        kwargs.update(feedback=torch.full((H,), 6.0, dtype=torch.float64), A_log=torch.full((H,), -6.0,
                                                                                              dtype=torch.float64))
    for name in PARAMS:
        if kwargs.get(name) is not None:
            kwargs[name] = kwargs[name].to(device=device, dtype=torch.float32 if dtype != torch.float64 else dtype)
    return proj.to(device=device, dtype=dtype), weight.to(device=device, dtype=torch.float32
                                                          if dtype != torch.float64 else dtype), kwargs


def run_with_grads(proj, weight, kwargs, *, seed=1, double=False, view_of=None, fn=None):
    """Outputs and the gradients of proj, the conv weight and every per-head parameter, for a fixed random
    cotangent on every output. ``view_of=(pad_left, pad_right)`` passes proj as a column slice of a wider tensor;
    ``fn`` calls the op (default :func:`mixer_prologue`; a compiled caller, say)."""
    cast = (lambda t: t.detach().double()) if double else (lambda t: t.detach().clone())
    base = cast(proj)
    if view_of is not None:
        base = F.pad(base, view_of)
    base.requires_grad_()
    proj_in = base if view_of is None else base[..., view_of[0]:view_of[0] + proj.shape[-1]]
    leaves = {"conv_weight": cast(weight).requires_grad_()}
    kw = dict(kwargs)
    for name in PARAMS:
        if kw.get(name) is not None:
            kw[name] = leaves[name] = cast(kw[name]).requires_grad_()
    outputs = call(proj_in, leaves["conv_weight"], kw, fn)
    gen = torch.Generator().manual_seed(seed)
    loss = 0.0
    for out in outputs:
        if out is not None:
            cotangent = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.device)
            loss = loss + (out.double() * cotangent).sum()
    loss.backward()
    grad = base.grad if view_of is None else base.grad[..., view_of[0]:view_of[0] + proj.shape[-1]]
    return outputs, {"proj": grad, **{name: t.grad for name, t in leaves.items()}}


def check_against_reference(proj, weight, kwargs, fwd_tol=1e-5, grad_tol=1e-4, **run_kwargs):
    with dispatch.backend("torch"):
        ref_out, ref_grads = run_with_grads(proj.cpu(), weight.cpu(), {k: v.cpu() if torch.is_tensor(v) else v
                                                                          for k, v in kwargs.items()}, double=True)
    out, grads = run_with_grads(proj, weight, kwargs, **run_kwargs)
    for name, got, want in zip(OUTPUTS, out, ref_out):
        assert (got is None) == (want is None), name
        if got is not None:
            assert got.dtype == (torch.float32 if name in ("g", "beta", "alpha") else proj.dtype), name
            assert_close(got, want, tol=fwd_tol, name=name)
    for name, want in ref_grads.items():
        assert grads[name] is not None, f"no gradient reached {name}"
        assert_close(grads[name], want, tol=grad_tol, name=f"d{name}")


# ---------------------------------------------------------------------------------------------------------------
# The composition against a per-token spec


def per_token_spec(proj, weight, kwargs):
    """The prologue written token by token in float64 (convolution as an explicit sum over taps)."""
    proj, weight = proj.double(), weight.double().reshape(weight.shape[0], -1)
    B, L, _ = proj.shape
    H, K, KS = kwargs["num_heads"], kwargs["key_dim"], weight.shape[1]
    left = KS - 1 if kwargs["causal"] else (KS - 1) // 2
    C = weight.shape[0]
    conv = torch.zeros(B, L, C, dtype=torch.float64)
    for t in range(L):
        for j in range(KS):
            s = t + j - left
            if 0 <= s < L:
                conv[:, t] += weight[:, j] * proj[:, s, :C]
    act = conv * torch.sigmoid(conv)
    q = act[..., :H * K].reshape(B, L, H, K)
    k = act[..., H * K:2 * H * K].reshape(B, L, H, K)
    q = q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    k = k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    cols = lambda start: proj[..., start:start + H]  # noqa: E731
    A_log, dt_bias = kwargs["A_log"].double(), kwargs["dt_bias"].double()
    g = -A_log.exp() * torch.log1p(torch.exp(cols(kwargs["decay_col"]) + dt_bias))
    b, d = torch.sigmoid(kwargs["feedback"].double()), kwargs["correction"].double()
    gain = (2 * g.exp() if kwargs["transition"] == "iplr" else torch.ones_like(g)) * b
    return q - (d * b)[:, None] * k, k, gain[..., None] * k, g, torch.sigmoid(cols(kwargs["beta_col"]))


@pytest.mark.parametrize("causal,KS,transition", [(True, 3, "splr"), (False, 3, "iplr"), (False, 4, "splr")])
def test_reference_equals_per_token_spec(causal, KS, transition):
    proj, weight, kwargs = make_problem("comba", L=9, KS=KS, causal=causal, transition=transition,
                                        dtype=torch.float64)
    out = mixer_prologue_reference(proj, weight, **kwargs)
    for name, got, want in zip(("q", "k", "p", "g", "beta"), (out[0], out[1], out[3], out[4], out[5]),
                               per_token_spec(proj, weight, kwargs)):
        assert_close(got, want, tol=1e-12, name=name)


def test_centred_and_causal_windows():
    """Token t of the causal prologue depends on tokens ≤ t only; the centred one sees t + 1 as well."""
    for causal in (True, False):
        proj, weight, kwargs = make_problem("gka", L=9, causal=causal, dtype=torch.float64)
        base = mixer_prologue_reference(proj, weight, **kwargs)
        poked = proj.clone()
        poked[:, 5] += 1.0
        moved = mixer_prologue_reference(poked, weight, **kwargs)
        change = (moved[2] - base[2]).abs().amax(dim=(0, 2, 3))
        assert change[:4].amax() == 0 and change[5] > 0
        assert (change[4] > 0) == (not causal)


# ---------------------------------------------------------------------------------------------------------------
# Triton (interpreter) against the composition


@pytest.mark.parametrize("L", [1, 5, 23])
@pytest.mark.parametrize("mode,causal,transition", [("comba", False, "splr"), ("comba", True, "iplr"),
                                                    ("gka", True, "splr"), ("gka-noncausal", False, "splr"),
                                                    ("plain", True, "splr")])
def test_triton_interpreter_forward_and_gradients(mode, causal, transition, L, triton_interpreter, poison_outputs):
    proj, weight, kwargs = make_problem(mode, L=L, causal=causal, transition=transition)
    check_against_reference(proj, weight, kwargs)


@pytest.mark.parametrize("H,K,V,KS", [(3, 12, 4, 4), (4, 16, 16, 2), (1, 32, 8, 1)])
def test_triton_interpreter_head_shapes(H, K, V, KS, triton_interpreter, poison_outputs):
    """Heads not a power of two, K ≠ V, widths that are not powers of two, even and unit conv sizes."""
    proj, weight, kwargs = make_problem("comba", L=6, H=H, K=K, V=V, KS=KS, causal=False, seed=2)
    check_against_reference(proj, weight, kwargs)


def test_triton_interpreter_strided_proj(triton_interpreter, poison_outputs):
    """proj a column slice of a wider tensor (its gradient lands in that slice)."""
    proj, weight, kwargs = make_problem("gka", L=6, seed=3)
    check_against_reference(proj, weight, kwargs, view_of=(3, 5))


def test_triton_interpreter_unused_columns(triton_interpreter, poison_outputs):
    """Columns no output reads (a layer's alignment padding) get an exactly zero gradient, though the gradient
    buffer starts out NaN-poisoned."""
    proj, weight, kwargs = make_problem("comba", L=6, seed=4, unused=3)
    check_against_reference(proj, weight, kwargs)
    _, grads = run_with_grads(proj, weight, kwargs)
    assert torch.equal(grads["proj"][..., -3:], torch.zeros_like(grads["proj"][..., -3:]))


def test_row_alignment_is_the_common_power_of_two_triton_cannot_see():
    from visionssm.kernels.layers.mixer_prologue.launch import row_alignment

    assert row_alignment(117600, 600, 600) == 8  # comba_vision_T's projection at 196 tokens
    assert row_alignment(598) == 2 and row_alignment(601) == 1 and row_alignment(608, 604) == 4
    # 16 and its multiples Triton proves itself: the strides go as they are
    assert row_alignment(1200) == 1 and row_alignment(1216, 1200) == 1 and row_alignment(235200, 1200, 1200) == 1


def test_triton_interpreter_low_precision(triton_interpreter, poison_outputs):
    proj, weight, kwargs = make_problem("comba", L=9, causal=False, transition="iplr", dtype=torch.bfloat16)
    check_against_reference(proj, weight, kwargs, fwd_tol=1e-2, grad_tol=2e-2)


@pytest.mark.parametrize("overrides", [{"block_tokens": 2, "heads_per_program": 1},
                                       {"conv_block_tokens": 2, "conv_block_channels": 16}])
def test_triton_interpreter_launch_variants(overrides, triton_interpreter, poison_outputs):
    proj, weight, kwargs = make_problem("gka", L=7, seed=4)
    with launch_overrides("mixer_prologue", **overrides):
        check_against_reference(proj, weight, kwargs)


def test_triton_interpreter_no_grad_and_reference_override(triton_interpreter):
    proj, weight, kwargs = make_problem("comba", L=5, transition="iplr")
    with torch.no_grad():
        fused = call(proj, weight, kwargs)
        with launch_overrides("mixer_prologue", reference=True):
            composed = call(proj, weight, kwargs)
    for name, a, b in zip(OUTPUTS, fused, composed):
        if a is not None:
            assert_close(a, b, tol=1e-5, name=name)
    with pytest.raises(ValueError, match="unknown launch setting"), launch_overrides("mixer_prologue", chunk=4):
        call(proj, weight, kwargs)


def test_float64_takes_the_reference_path_under_triton(triton_interpreter):
    proj, weight, kwargs = make_problem("gka", L=5, dtype=torch.float64)
    out = call(proj, weight, kwargs)
    assert_close(out.q, mixer_prologue_reference(proj, weight, **kwargs)[0], tol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# Comba-iplr: the prologue's p through the Comba kernel is the iplr recurrence


def iplr_recurrence(q, k, v, g, beta, b, *, causal: bool) -> torch.Tensor:
    """The paper's Comba-iplr in float64, token by token: S_t = α_t S_{t−1} (I − 2 b β_t k_t k_tᵀ) + β_t v_t k_tᵀ,
    o_t = S_t q_t / √K; non-causal adds the same recurrence over reversed time."""
    q, k, v, g, beta, b = (t.double() for t in (q, k, v, g, beta, b))
    B, L, H, K = q.shape
    S = torch.zeros(B, H, v.shape[-1], K, dtype=torch.float64)
    outputs = []
    for t in range(L):
        kt = k[:, t]
        erase = torch.einsum("bhvk,bhk->bhv", S, kt)[..., None] * kt[:, :, None, :]
        bt = (b * beta[:, t])[..., None, None]
        S = g[:, t].exp()[..., None, None] * (S - 2 * bt * erase) + beta[:, t, :, None, None] * \
            v[:, t, :, :, None] * kt[:, :, None, :]
        outputs.append(torch.einsum("bhvk,bhk->bhv", S, q[:, t]) / math.sqrt(K))
    o = torch.stack(outputs, 1)
    if not causal:
        o = o + iplr_recurrence(*(t.flip(1) for t in (q, k, v, g, beta)), b, causal=True).flip(1)
    return o


def _iplr_check(device, dtype, causal, aligned, tol, L=40, H=2, K=16):
    proj, weight, kwargs = make_problem("comba", L=L, H=H, K=K, V=K, B=1, transition="iplr", causal=causal,
                                        aligned=aligned, seed=5, dtype=dtype, device=device)
    with dispatch.backend("torch"):
        ref = mixer_prologue_reference(proj.cpu().double(), weight.cpu().double(),
                                       **{k: v.cpu().double() if torch.is_tensor(v) else v for k, v in kwargs.items()})
    if aligned:  # the hard case really is hard: neighbouring keys nearly parallel, feedback gain 2·b·β·α ≈ 2
        cosine = (ref[1][:, 1:] * ref[1][:, :-1]).sum(-1)
        gain = 2 * torch.sigmoid(kwargs["feedback"].cpu().double()) * ref[5] * ref[4].exp()
        assert cosine.amin() > 0.95 and gain.amin() > 1.95
    b = torch.sigmoid(kwargs["feedback"].cpu().double())
    expected = iplr_recurrence(ref[0], ref[1], ref[2], ref[4], ref[5], b, causal=causal)
    out = call(proj, weight, kwargs)
    o = comba_op(out.q, out.k, out.v, out.p, out.g, out.beta, causal=causal)
    assert_close(o, expected, tol=tol, name="o")
    # and through the reference composition end to end (float64)
    assert_close(comba_op(ref[0], ref[1], ref[2], ref[3], ref[4], ref[5], causal=causal), expected, tol=1e-10)


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_iplr_reference_is_the_iplr_recurrence(causal, aligned, reference_path):
    _iplr_check("cpu", torch.float64, causal, aligned, tol=1e-10)


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_triton_interpreter_iplr_is_the_iplr_recurrence(causal, aligned, triton_interpreter, poison_outputs):
    _iplr_check("cpu", torch.float32, causal, aligned, tol=1e-3, L=21)


# ---------------------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.cuda
@pytest.mark.parametrize("mode,L,H,K,V,causal,transition", [
    ("comba", 196, 6, 64, 64, False, "splr"), ("comba", 197, 3, 64, 64, False, "iplr"),
    ("comba", 49, 20, 16, 16, True, "iplr"), ("gka", 196, 10, 16, 16, True, "splr"),
    ("gka", 49, 20, 16, 16, True, "splr"), ("gka-noncausal", 196, 10, 16, 16, False, "splr")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_vision_shapes(mode, L, H, K, V, causal, transition, dtype, poison_outputs):
    proj, weight, kwargs = make_problem(mode, B=8, L=L, H=H, K=K, V=V, gate_width=32, causal=causal,
                                        transition=transition, dtype=dtype, device="cuda")
    tols = (1e-5, 1e-4) if dtype == torch.float32 else (1e-2, 2e-2)
    check_against_reference(proj, weight, kwargs, fwd_tol=tols[0], grad_tol=tols[1])


@pytest.mark.cuda
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_iplr_is_the_iplr_recurrence(causal, aligned, poison_outputs):
    _iplr_check("cuda", torch.bfloat16, causal, aligned, tol=3e-2, L=70, K=64)


@pytest.mark.cuda
@pytest.mark.parametrize("unused, view_of", [(0, None), (2, None), (3, None), (10, None), (0, (0, 6))])
def test_cuda_every_row_alignment(unused, view_of, poison_outputs):
    """comba_vision_T's projection (598 columns) with row strides 598, 600, 601, 608 and 604 (a column slice): the
    kernels' promised stride factor (ROW_ALIGN 2, 8, 1, 1, 2) changes how they load and store rows, not what."""
    proj, weight, kwargs = make_problem("comba", B=4, L=196, H=3, K=64, V=64, gate_width=16, causal=False,
                                        dtype=torch.bfloat16, device="cuda", unused=unused)
    check_against_reference(proj, weight, kwargs, fwd_tol=1e-2, grad_tol=2e-2, view_of=view_of)


@pytest.mark.cuda
def test_cuda_unit_strides(poison_outputs):
    """One token of an 8-column projection: every stride is one unit of ROW_ALIGN = 8, an argument Triton turns
    into the compile-time constant 1 inside the kernels (an integer, not a tensor)."""
    proj, weight, kwargs = make_problem("min", B=2, L=1, H=1, K=2, V=3, device="cuda")
    assert proj.shape[-1] == 8
    check_against_reference(proj, weight, kwargs)


@pytest.mark.cuda
def test_cuda_repeated_calls_reuse_the_plan(poison_outputs):
    proj, weight, kwargs = make_problem("comba", B=4, L=196, H=6, K=64, V=64, causal=False, dtype=torch.bfloat16,
                                        device="cuda")
    first = run_with_grads(proj, weight, kwargs)
    second = run_with_grads(proj, weight, kwargs)
    for a, b in zip(first[0], second[0]):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# The registered op (torch.compile / torch.export take it): opcheck on both paths, compiled against eager

#: (mode, causal, transition, unused columns, proj a column slice)
_VARIANTS = {"comba": ("comba", False, "splr", 0, False), "comba_iplr_causal": ("comba", True, "iplr", 0, False),
             "gka": ("gka", True, "splr", 0, False), "gka_noncausal": ("gka-noncausal", False, "splr", 0, False),
             "plain": ("plain", True, "splr", 0, False), "comba_padded_strided": ("comba", False, "splr", 3, True)}


def _op_args(variant, requires_grad):
    """The registered op's arguments: proj, conv_weight, the six per-head parameters, then the scalars."""
    mode, causal, transition, unused, strided = _VARIANTS[variant]
    proj, weight, kwargs = make_problem(mode, L=5, causal=causal, transition=transition, unused=unused, seed=7)
    if strided:
        proj = F.pad(proj, (2, 3))[..., 2:2 + proj.shape[-1]]
    tensors = [proj, weight, *(kwargs.get(name) for name in PARAMS)]
    if requires_grad:
        tensors = [None if t is None else t.detach().requires_grad_() for t in tensors]
    return (*tensors, kwargs["num_heads"], kwargs["key_dim"], kwargs["value_dim"], causal, kwargs["beta_col"],
            kwargs.get("alpha_col"), kwargs.get("decay_col"), transition, 1e-6)


@pytest.mark.parametrize("path", ["reference_path", "triton_interpreter"])
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_registered_op_opcheck(variant, requires_grad, path, request, poison_outputs):
    from visionssm.kernels.layers.mixer_prologue.custom_op import mixer_prologue_op

    request.getfixturevalue(path)
    torch.library.opcheck(mixer_prologue_op, _op_args(variant, requires_grad))


def _compiled_against_eager(proj, weight, kwargs, *, backend="aot_eager", tol=0.0, view_of=None):
    """Outputs (the gate a view of proj, as in eager) and every gradient of the compiled op against eager, and no
    graph break."""
    spec, params = spec_and_params(kwargs)
    torch._dynamo.reset()
    assert torch._dynamo.explain(mixer_prologue)(proj, weight, spec, **params).graph_break_count == 0
    compiled = torch.compile(mixer_prologue, fullgraph=True, backend=backend)
    want_out, want_grads = run_with_grads(proj, weight, kwargs, view_of=view_of)
    got_out, got_grads = run_with_grads(proj, weight, kwargs, view_of=view_of, fn=compiled)
    for name, got, want in zip(OUTPUTS, got_out, want_out):
        assert (got is None) == (want is None), name
        if want is not None:
            assert got.dtype == want.dtype, name
            torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=name)
    if got_out.gate is not None:
        assert got_out.gate._base is not None, "the gate is a view of proj"
    for name, want in want_grads.items():
        torch.testing.assert_close(got_grads[name], want, rtol=tol, atol=tol, msg=f"d{name}")


@pytest.mark.parametrize("path,tol", [("reference_path", 1e-5), ("triton_interpreter", 0.0)])
@pytest.mark.parametrize("mode,causal,transition,view_of", [("comba", True, "iplr", (2, 3)),
                                                            ("gka", True, "splr", None)])
def test_compiled_equals_eager(mode, causal, transition, view_of, path, tol, request, poison_outputs):
    """The reference path's gradients come from differentiating the composition again: equal up to rounding."""
    request.getfixturevalue(path)
    proj, weight, kwargs = make_problem(mode, L=5, causal=causal, transition=transition, unused=2, seed=8)
    _compiled_against_eager(proj, weight, kwargs, tol=tol, view_of=view_of)


@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled:UserWarning")  # caches are off on purpose
def test_inductor_compiled_equals_eager_with_aligned_inputs(triton_interpreter, poison_outputs, monkeypatch):
    """Inductor asserts that a custom op's outputs are 16-byte aligned where it took its inputs as aligned (on CUDA;
    here CPU inputs are taken so too): with 3 heads, a per-head gradient read as a row of the kernels' partial sums
    started 24 bytes into them (comba-iplr on the H200)."""
    import torch._inductor.graph as inductor_graph
    from torch._inductor.utils import tensor_is_aligned

    monkeypatch.setattr(inductor_graph, "should_assume_input_aligned", tensor_is_aligned)
    proj, weight, kwargs = make_problem("comba", B=1, L=5, H=3, K=4, V=4, gate_width=4, causal=False,
                                        transition="iplr", unused=2, seed=9)
    # a cached graph would skip the asserts; config.patch, not monkeypatch: pytest's monkeypatch does not see the
    # setting on the config module, so its undo deleted it and every later Inductor compile in the worker failed
    with torch._inductor.config.patch(force_disable_caches=True):
        _compiled_against_eager(proj, weight, kwargs, backend="inductor", tol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("mode,transition", [("comba", "iplr"), ("gka", "splr")])
def test_cuda_compiled_equals_eager(mode, transition, poison_outputs):
    """Inductor around the registered op, bf16: the same kernels run, so the same result up to bf16 rounding."""
    proj, weight, kwargs = make_problem(mode, B=4, L=197, H=3, K=64, V=64, gate_width=32, causal=False,
                                        transition=transition, dtype=torch.bfloat16, device="cuda", unused=2)
    _compiled_against_eager(proj, weight, kwargs, backend="inductor", tol=2e-2)


# ---------------------------------------------------------------------------------------------------------------
# Bad input


def _bad_cases():
    """(the name the message holds, the error, the changes to a Comba problem, whether the spec refuses them when it is
    built rather than the call)."""
    return [
        ("num_heads", TypeError, {"num_heads": 2.0}, True),
        ("key_dim", ValueError, {"key_dim": 0}, True),
        ("causal", TypeError, {"causal": 1}, True),
        ("beta_col", ValueError, {"beta_col": 3}, True),
        ("alpha_col", ValueError, {"alpha_col": -1}, True),
        ("gate_cols", TypeError, {"gate_cols": [52, 5]}, True),
        ("gate_cols start", ValueError, {"gate_cols": (0, 5)}, True),
        ("transition", ValueError, {"transition": "dplr"}, True),
        ("iplr", ValueError, {"decay_col": None, "A_log": None, "dt_bias": None, "transition": "iplr"}, True),
        ("eps", ValueError, {"eps": 0.0}, True),
        ("proj", ValueError, {"proj": torch.randn(4, 60)}, False),
        ("proj", ValueError, {"proj": torch.randn(2, 0, 60)}, False),
        ("proj", TypeError, {"proj": torch.zeros(2, 4, 60, dtype=torch.int32)}, False),
        ("columns", ValueError, {"proj": torch.randn(2, 4, 20)}, False),
        ("decay_col", ValueError, {"decay_col": 1000}, False),
        ("conv_weight", ValueError, {"conv_weight": torch.randn(47, 1, 3)}, False),
        ("A_log", ValueError, {"A_log": None}, False),
        ("dt_bias", ValueError, {"dt_bias": torch.randn(3)}, False),
        ("correction", ValueError, {"correction": None}, False),
        ("feedback", ValueError, {"transition": None}, False),
        ("alpha_bias", ValueError, {"alpha_bias": torch.randn(2)}, False),
        ("A_log", ValueError, {"decay_col": None}, False),
    ]


@pytest.mark.parametrize("name,error,changes,at_spec", _bad_cases(),
                         ids=lambda c: c if isinstance(c, str) else "")
def test_bad_input_raises_naming_the_argument(name, error, changes, at_spec):
    proj, weight, kwargs = make_problem("comba", L=4)
    kwargs.update(changes)
    proj, weight = kwargs.pop("proj", proj), kwargs.pop("conv_weight", weight)
    if at_spec:
        with pytest.raises(error, match=name):
            spec_and_params(kwargs)
        return
    spec, params = spec_and_params(kwargs)
    assert not _well_formed(proj, weight, spec, tuple(params.get(n) for n in PARAMS)), "the fast check let it pass"
    with pytest.raises(error, match=name):
        mixer_prologue(proj, weight, spec, **params)


@pytest.mark.parametrize("mode", ["comba", "gka", "gka-noncausal", "plain"])
def test_good_calls_take_the_fast_check(mode):
    """A layer's calls are checked by the one-pass check alone (the naming checks run only for bad input)."""
    proj, weight, kwargs = make_problem(mode, L=4)
    spec, params = spec_and_params(kwargs)
    assert _well_formed(proj, weight, spec, tuple(params.get(n) for n in PARAMS))
    assert _well_formed(proj, weight.reshape(weight.shape[0], -1), spec, tuple(params.get(n) for n in PARAMS))


def test_spec_must_be_a_prologue_spec():
    proj, weight, kwargs = make_problem("comba", L=4)
    _, params = spec_and_params(kwargs)
    with pytest.raises(TypeError, match="spec"):
        mixer_prologue(proj, weight, {name: kwargs[name] for name in SPEC_FIELDS if name in kwargs}, **params)


@pytest.mark.parametrize("name,kwargs", [("gka", {"causal": True, "head_dim": 16}),
                                         ("gka", {"causal": False, "head_dim": 16}),
                                         ("comba", {"causal": False, "num_heads": 2}),
                                         ("comba", {"causal": True, "num_heads": 2, "transition": "iplr"})])
def test_layers_declare_their_parts(name, kwargs):
    """Each layer builds its spec once: the core columns inside its projection, and only its own part (GKA the
    second gate α, Comba the key feedback with its transition)."""
    from visionssm.layers import MIXERS

    layer = MIXERS[name].cls(32, **kwargs)
    spec = layer._prologue_spec
    assert isinstance(spec, PrologueSpec) and spec.causal == kwargs["causal"]
    assert spec.columns[0] <= layer.in_proj.out_features and spec.width == layer.qkv_conv.weight.shape[0]
    assert (spec.alpha_col is not None) == (name == "gka")
    assert spec.transition == (kwargs.get("transition", "splr") if name == "comba" else None)
    assert (spec.decay_col is not None) == (name == "comba" or kwargs["causal"])
