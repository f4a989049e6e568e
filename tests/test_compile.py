"""Whole models under ``torch.compile`` and ``torch.export`` (issue #43): one graph, no breaks, no recompilation.

Every model visionssm registers with timm is built on a tiny preset of its family (``TINY``: the family's layout,
every block type, a few blocks; a new family fails ``test_every_family_has_a_tiny_preset`` until it gets one).
Registered models that are the same network on that preset (``mamba_vision_T``/``S``/``T2`` differ only in sizes
the preset overrides) are checked once, under the first of their names (``MODELS``); those that still differ (the
B/L presets' layer scale) are checked on their own. Checks whose subject is the traced code take the first of each
family (``FAMILY_MODELS``).

CPU (the PyTorch path of the kernels, ``VISIONSSM_KERNELS=torch`` from tests/conftest.py):
- ``torch._dynamo.explain``: 1 graph, 0 breaks, eval and train (every model);
- ``torch.compile(fullgraph=True, backend="aot_eager")``, train mode: output, every parameter gradient and the
  BatchNorm statistics equal eager's, and a second call on new data compiles nothing;
- per-block DropPath rates with a forward hook on a block, and with gradient checkpointing: one graph, and no
  recompilation on the next call;
- eval mode without gradients: the compiled model and ``torch.export.export``'s module give eager's output;
- the same train step on the Triton kernels in Triton's interpreter (the layers' Triton-path code, the registered
  ops' fakes against their kernels).

GPU (``cuda``-marked, the Triton path): explain, and Inductor against eager with bf16 autocast and channels_last in
train and eval mode (every model); smoke runs of ``mode="reduce-overhead"`` and ``mode="max-autotune-no-cudagraphs"``.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import timm
import torch

from visionssm.models import FAMILIES  # importing the package registers every family

# the hierarchical families: two conv stages and one windowed token stage (a mixer block and an attention-slot block),
# whose 3x3 windows pad its 4x4 map (64 px input) to 6x6: four windows of 9 tokens, an odd sequence length
_HIERARCHICAL = {"depths": (1, 1, 2), "dims": (8, 16, 32), "stem_dim": 8, "num_heads": (1, 1, 2),
                 "window_size": (8, 8, 3)}
#: family -> (kwargs of timm.create_model giving a tiny network of that family, input side in pixels)
TINY = {
    "mamba_vision": (_HIERARCHICAL, 64),
    "gka_vision": (_HIERARCHICAL, 64),
    # SKA's output projection starts at zero (the paper): trunc-normal here, so that its other parameters get gradients
    "echo_vision": ({**_HIERARCHICAL, "attn_mixer_kwargs": {"zero_init_output": False}}, 64),
    "comba_vision": ({"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2,
                      "mlp_ratio": 2.0, "mixer_kwargs": {"gate_rank": 4}}, 32),
}
BATCH = 2
RTOL, ATOL = 1e-4, 1e-5  # float32: the compiled graph runs the same ops, decomposed


def _family(name: str) -> str:
    return next(family for family, names in FAMILIES.items() if name in names)


def _build(name: str, **kwargs) -> torch.nn.Module:
    preset, _ = TINY[_family(name)]
    return timm.create_model(name, num_classes=10, **{**preset, "drop_path_rate": 0.0, **kwargs})


def _distinct_models() -> list[str]:
    """One registered name per distinct tiny network (the first, sorted), every family represented."""
    seen: dict[str, str] = {}
    for name in sorted(n for names in FAMILIES.values() for n in names):
        if _family(name) in TINY:
            seen.setdefault(repr(_build(name)), name)
    return sorted(seen.values())


MODELS = _distinct_models()
# one per family (its first in MODELS: for mamba/gka_vision the B/L presets' network, layer scale included) for the
# equality, export and variant checks, whose subject is the traced code rather than which modules a preset holds
FAMILY_MODELS = sorted({_family(name): name for name in reversed(MODELS)}.values())


def _input(name: str, batch: int = BATCH, max_side: int | None = None) -> torch.Tensor:
    _, side = TINY[_family(name)]
    side = side if max_side is None else min(side, max_side)
    return torch.randn(batch, 3, side, side)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from nothing: code compiled for an earlier test's model would count as a recompile."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _no_recompile(check: bool = True):
    """A context in which a recompilation raises (``check``), or a plain one (a first call compiles)."""
    return torch._dynamo.config.patch(error_on_recompile=True) if check else contextlib.nullcontext()


def _explain(model: torch.nn.Module, x: torch.Tensor) -> str | None:
    """None for one graph and no break, else what dynamo reports."""
    explanation = torch._dynamo.explain(model)(x)
    if explanation.graph_count == 1 and explanation.graph_break_count == 0:
        return None
    reasons = "\n".join(f"- {b.reason.splitlines()[0]} at {b.user_stack[-1] if b.user_stack else '?'}"
                        for b in explanation.break_reasons)
    return f"{explanation.graph_count} graphs, {explanation.graph_break_count} breaks:\n{reasons}"


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters()}


def _assert_grads_close(model: torch.nn.Module, eager: torch.nn.Module) -> None:
    """Every parameter's gradient equals eager's, each to float32 tolerance of its own size (a branch behind a 1e-5
    layer scale has gradients far below an absolute tolerance), floored at a hundredth of the largest (a gradient
    that is zero in exact arithmetic, a conv bias before a training-mode BatchNorm, is rounding noise)."""
    got, want = _grads(model), _grads(eager)
    largest = max(g.abs().max().item() for g in want.values() if g is not None)
    for param, g in want.items():
        assert g is not None and got[param] is not None, f"no gradient for {param}"
        atol = ATOL * max(g.abs().max().item(), 1e-2 * largest)
        torch.testing.assert_close(got[param], g, rtol=RTOL, atol=atol, msg=lambda m, p=param: f"{p}: {m}")


def _assert_near(got: torch.Tensor, want: torch.Tensor, tol: float, floor: float, what: str) -> None:
    """``‖got − want‖ ≤ tol · max(‖want‖, floor)``: bf16 rounding differs between fused and unfused code, and the
    floor keeps a tensor whose values are all near zero (a gradient behind a small layer scale) from failing on it."""
    error = (got.float() - want.float()).norm().item()
    scale = max(want.float().norm().item(), floor)
    assert error <= tol * scale, f"{what}: error {error:.3g} against norm {scale:.3g}"


def test_every_family_has_a_tiny_preset():
    assert set(FAMILIES) <= set(TINY), f"add a tiny preset to TINY for {sorted(set(FAMILIES) - set(TINY))}"
    assert {_family(name) for name in MODELS} == set(FAMILIES)


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("name", MODELS)
def test_explain_one_graph(name, mode):
    model = getattr(_build(name), mode)()
    problem = _explain(model, _input(name))
    assert problem is None, f"{name} ({mode}): {problem}"


def _assert_step_matches(out, expected, model, eager) -> None:
    """The compiled model's output equals eager's, and so does every parameter gradient after one backward of the
    same random cotangent through each."""
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
    grad = torch.randn_like(expected)
    out.backward(grad)
    expected.backward(grad)
    _assert_grads_close(model, eager)


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_compiled_train_step_matches_eager(name):
    """fullgraph aot_eager forward+backward in train mode: outputs, every gradient and the BatchNorm running
    statistics equal eager's; the next call, on new data, compiles nothing."""
    eager = _build(name).train()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for step in range(2):
        x = _input(name)
        with _no_recompile(step > 0):
            out = compiled(x)
        _assert_step_matches(out, eager(x), model, eager)
        for (buffer, b), (_, b_eager) in zip(model.named_buffers(), eager.named_buffers()):
            torch.testing.assert_close(b, b_eager, rtol=RTOL, atol=ATOL, msg=lambda m, p=buffer: f"{p}: {m}")
        model.zero_grad()
        eager.zero_grad()


@pytest.mark.parametrize("variant", ["hook", "checkpointing"])
@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_drop_path_hooks_checkpointing_one_graph(name, variant):
    """Per-block DropPath rates, with a forward hook on a block or with gradient checkpointing: one graph in train
    mode (fullgraph), the hook runs on every call, and the next call compiles nothing."""
    model = _build(name, drop_path_rate=0.3).train()
    calls = torch.zeros(())  # counted in place: a Python counter would be a guarded constant

    def hook(module, args, out):
        calls.add_(1)

    if variant == "hook":
        blocks = [m for m in model.modules() if type(m).__name__.endswith("Block")]
        blocks[-1].register_forward_hook(hook)
    else:
        model.set_grad_checkpointing(True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for step in range(2):
        with _no_recompile(step > 0):
            out = compiled(_input(name))
        out.square().mean().backward()
        assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
        model.zero_grad()
    assert calls.item() == (2 if variant == "hook" else 0)


def test_eager_norm_shortcuts_leave_the_compiled_graph_alone(monkeypatch):
    """The eager-mode shortcuts around Comba's norms (LayerNorm kernels, residual adds inside them, blocks chained
    through ``forward_split``) trace to the same graph as plain ``nn.LayerNorm`` and unchained blocks: under
    ``torch.compile`` they cost nothing and the compiler fuses the norms and adds itself."""
    from visionssm.models import comba_vision

    def graph_ops(**kwargs) -> list[str]:
        torch._dynamo.reset()
        ops = []

        def backend(gm, example_inputs):
            ops.extend(str(n.target) for n in gm.graph.nodes if n.op.startswith("call_"))
            return gm.forward

        model = _build("comba_vision_T", **kwargs).train()
        torch.compile(model, backend=backend, fullgraph=True)(_input("comba_vision_T")).sum().backward()
        return ops

    shipped = graph_ops()
    assert any("layer_norm" in op for op in shipped)
    assert graph_ops(fused_norm=False) == shipped
    monkeypatch.setattr(comba_vision, "can_chain", lambda blocks: False)
    assert graph_ops() == shipped


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_eval_compile_and_export_match_eager(name):
    """Eval mode without gradients: the fullgraph aot_eager compile and ``torch.export.export``'s module give eager's
    output, on the data traced and on new data (without recompiling)."""
    model = _build(name).eval()
    x = _input(name)
    exported = torch.export.export(model, (x,)).module()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for step in range(2):
            x = _input(name)
            expected = model(x)
            torch.testing.assert_close(exported(x), expected, rtol=RTOL, atol=ATOL)
            with _no_recompile(step > 0):
                torch.testing.assert_close(compiled(x), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_bf16_autocast_train_step_matches_eager(name):
    """Under CPU bf16 autocast (the ops see what autocast gives their callers: bf16 activations, float32 weights),
    the compiled train step's output and gradients equal eager's within bf16 rounding."""
    eager = _build(name).train()
    model = copy.deepcopy(eager)
    x = _input(name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
        expected = eager(x)
    assert out.dtype == expected.dtype
    _assert_near(out, expected, 2e-2, 1e-6, f"{name}: output")
    grad = torch.randn_like(expected)
    out.backward(grad)
    expected.backward(grad)
    got, want = _grads(model), _grads(eager)
    floor = 1e-2 * max(g.float().norm().item() for g in want.values())
    for param, g in want.items():
        _assert_near(got[param], g, 5e-2, floor, f"{name}: gradient of {param}")


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_triton_path_train_and_eval(name, triton_interpreter):
    """The Triton kernels (in Triton's interpreter) under a fullgraph aot_eager compile: one graph (the layers take
    other code there, e.g. fused prologues), and in train mode the output and every gradient, in eval mode without
    gradients the output, equal eager's on the same path (the registered ops' fakes match their kernels)."""
    eager = _build(name).train()
    model = copy.deepcopy(eager)
    x = _input(name, batch=1, max_side=32)  # the interpreter's time grows with the grid (here: one 3x3 window)
    _assert_step_matches(torch.compile(model, fullgraph=True, backend="aot_eager")(x), eager(x), model, eager)
    # inference: the ops keep nothing for a backward (their no-grad layouts)
    torch._dynamo.reset()
    model.eval()
    eager.eval()
    with torch.no_grad():
        out = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
        torch.testing.assert_close(out, eager(x), rtol=RTOL, atol=ATOL)


# ---- GPU: Inductor on the Triton path ----------------------------------------------------------------------------


def _cuda_model(name: str, **kwargs) -> torch.nn.Module:
    return _build(name, **kwargs).cuda().to(memory_format=torch.channels_last)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("name", MODELS)
def test_cuda_explain_one_graph(name, mode):
    model = getattr(_cuda_model(name), mode)()
    x = _input(name).cuda().to(memory_format=torch.channels_last)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        problem = _explain(model, x)
    assert problem is None, f"{name} ({mode}, cuda, bf16): {problem}"


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("name", MODELS)
def test_cuda_inductor_matches_eager(name, mode):
    """Inductor (default mode), bf16 autocast, channels_last: the output and, in train mode, every gradient are
    about as close to the float32 model's as eager bf16's are (bf16 rounding differs between fused and unfused code, and
    train-mode BatchNorm over a tiny batch amplifies it, so the measure is eager's own bf16 error); the next call
    compiles nothing."""
    eager = getattr(_cuda_model(name), mode)()
    model, exact = copy.deepcopy(eager), copy.deepcopy(eager)
    compiled = torch.compile(model, fullgraph=True)
    train = mode == "train"
    for step in range(2):
        x = _input(name).cuda().to(memory_format=torch.channels_last)
        with torch.set_grad_enabled(train):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                with _no_recompile(step > 0):
                    out = compiled(x)
                expected = eager(x)
            reference = exact(x)
        assert out.dtype == expected.dtype
        _assert_as_close(out, expected, reference, f"{name} {mode} (call {step}): output")
        if not train:
            continue
        grad = torch.randn_like(reference)
        for y in (out, expected, reference):
            y.backward(grad.to(y.dtype))
        got, want, ref = _grads(model), _grads(eager), _grads(exact)
        floor = 1e-2 * max(g.float().norm().item() for g in ref.values())
        failed = []  # every gradient that differs, in one report: a GPU run is too dear to learn them one at a time
        for param, g in ref.items():
            assert got[param] is not None, f"{name}: no gradient for {param}"
            try:
                _assert_as_close(got[param], want[param], g, f"{name} (call {step}): gradient of {param}", floor)
            except AssertionError as error:
                failed.append(str(error))
        assert not failed, "\n".join(failed)
        for m in (model, eager, exact):
            m.zero_grad()


def _assert_as_close(got: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor, what: str,
                     floor: float = 1e-6) -> None:
    """``got``'s distance to the float32 result ``exact`` is at most three times eager bf16's, plus 1% of ``exact``'s
    norm floored at ``floor`` (a gradient that is zero in exact arithmetic, a conv bias before a training-mode
    BatchNorm, is rounding noise on both sides)."""
    error = (got.float() - exact.float()).norm().item()
    eager_error = (eager.float() - exact.float()).norm().item()
    allowed = 3 * eager_error + 1e-2 * max(exact.float().norm().item(), floor)
    assert error <= allowed, (f"{what}: error {error:.3g} against fp32, eager bf16's {eager_error:.3g}, "
                              f"allowed {allowed:.3g}")


@pytest.mark.cuda
@pytest.mark.parametrize("compile_mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_cuda_compile_modes_run(name, compile_mode):
    """Smoke: CUDA graphs and max-autotune compile the whole model (fullgraph) and run it, eval and train (with
    per-block DropPath), bf16 autocast, channels_last, without recompiling on later calls."""
    for mode in ("eval", "train"):
        torch._dynamo.reset()
        model = getattr(_cuda_model(name, drop_path_rate=0.3), mode)()
        compiled = torch.compile(model, fullgraph=True, mode=compile_mode)
        train = mode == "train"
        for step in range(3):
            x = _input(name).cuda().to(memory_format=torch.channels_last)
            torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", dtype=torch.bfloat16), torch.set_grad_enabled(train), _no_recompile(step > 0):
                out = compiled(x)
            assert out.isfinite().all(), f"{name} {compile_mode} {mode}: non-finite output"
            if train:
                out.float().square().mean().backward()
                assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
                model.zero_grad(set_to_none=True)
