"""timm's generic model checks (timm tests/test_models.py), ported and run on every registered visionssm model.

On CPU, at small resolution (64-96 px; 224 px for the cfg check that forward_features matches ``pool_size``), on
the PyTorch reference path of the kernels (tests/conftest.py sets ``VISIONSSM_KERNELS=torch`` without a GPU).
The B/L/L2-sized models (98-242 M parameters) get the cheap checks only (creation on the meta device, cfg and
parameter names), to keep this file within its CPU budget; every code path they use is exercised by the T/S
sizes.

Exclusions, with the reason:
- TorchScript (timm's ``test_model_forward_torchscript``): not run for any visionssm model. ``torch.jit.script``
  is deprecated in the torch versions we support, and the mixers call the kernels through Python-level dispatch
  (thread-local backend choice, lazy Triton imports) that TorchScript cannot compile. Graph export is covered by
  ``torch.onnx.export``/``torch.export`` (tests/test_export.py) and ``torch.compile`` (GPU).
- FX (``test_model_forward_fx``/``_backward_fx``) for the patterns in ``FX_EXCLUDE`` (empty at present).
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import math

import pytest
import timm
import torch
from timm.layers._fx import create_feature_extractor, get_graph_node_names

from visionssm.models import FAMILIES  # importing the package registers every family

ALL_MODELS = sorted(model for models in FAMILIES.values() for model in models)
# Too big for CPU CI beyond creation on the meta device (their code paths are the T/S ones at other widths).
LARGE = [m for m in ALL_MODELS if fnmatch.fnmatch(m, "*_vision_[BL]*")]
MODELS = [m for m in ALL_MODELS if m not in LARGE]
# Isotropic models return (B, L, C) tokens from forward_features (timm's "non-std" checks).
NON_STD = [m for m in ALL_MODELS if "comba_vision" in m]
STD = [m for m in MODELS if m not in NON_STD]
# fnmatch pattern -> reason, for models FX symbolic tracing cannot handle (none at present).
FX_EXCLUDE: dict[str, str] = {}

FWD_SIZE = 64  # stages 3/4 pad to their windows, so the mixers still see 196- and 49-token windows
BWD_SIZE = 64
FEAT_SIZE = 96


def _input_size(name: str, target: int) -> tuple[int, int, int]:
    cfg = timm.models.get_pretrained_cfg(name)
    input_size = cfg.input_size
    if cfg.fixed_input_size:
        return input_size
    return (input_size[0], *(min(s, target) for s in input_size[1:]))


@functools.cache
def _template(name: str, **kwargs) -> torch.nn.Module:
    return timm.create_model(name, pretrained=False, **kwargs)


def _create(name: str, **kwargs) -> torch.nn.Module:
    """A fresh model (a copy of one cached per name and kwargs: building and initialising 30-50 M parameters costs
    more than the checks)."""
    return copy.deepcopy(_template(name, **kwargs))


def _fx_excluded(name: str) -> str | None:
    return next((why for pattern, why in FX_EXCLUDE.items() if fnmatch.fnmatch(name, pattern)), None)


def test_every_family_is_registered():
    for prefix in ("mamba_vision_", "gka_vision_"):
        assert any(m.startswith(prefix) for m in ALL_MODELS), prefix
    assert {"mamba_vision_T", "mamba_vision_T2", "mamba_vision_S", "mamba_vision_B", "mamba_vision_L",
            "mamba_vision_L2", "gka_vision_T", "gka_vision_T2", "gka_vision_S", "gka_vision_B"} <= set(ALL_MODELS)


@pytest.mark.parametrize("model_name", MODELS)
def test_model_forward(model_name):
    """Forward, no NaN; the same output with gradient checkpointing on."""
    model = _create(model_name).eval()
    x = torch.randn(1, *_input_size(model_name, FWD_SIZE))
    with torch.no_grad():
        out = model(x)
        assert out.shape == (1, model.num_classes)
        assert not torch.isnan(out).any()
        model.set_grad_checkpointing()
        torch.testing.assert_close(model(x), out, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_name", MODELS)
def test_model_backward(model_name):
    """Train-mode forward/backward with a new classifier: every parameter receives a gradient."""
    model = _create(model_name)
    model.reset_classifier(42)
    num_params = sum(p.numel() for p in model.parameters())
    model.train()
    out = model(torch.randn(2, *_input_size(model_name, BWD_SIZE)))
    out.mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
    assert num_params == sum(p.grad.numel() for p in model.parameters())
    assert out.shape == (2, 42)
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("model_name", ALL_MODELS)
def test_model_default_cfgs(model_name):
    """cfg consistency: pool_size and num_features at the cfg resolution, pre-logits width, reset_classifier,
    classifier / first_conv names (large models: names only, on the meta device)."""
    large = model_name in LARGE
    model = timm.create_model(model_name, device="meta") if large else _create(model_name).eval()
    cfg = model.pretrained_cfg
    state_dict = model.state_dict()
    for key in ("mean", "std", "input_size", "crop_pct", "interpolation", "first_conv", "classifier"):
        assert cfg.get(key) is not None, key
    classifiers = cfg["classifier"] if isinstance(cfg["classifier"], (tuple, list)) else (cfg["classifier"],)
    for c in classifiers:
        assert c + ".weight" in state_dict, f"{c} not in model params"
    first_convs = cfg["first_conv"] if isinstance(cfg["first_conv"], (tuple, list)) else (cfg["first_conv"],)
    for fc in first_convs:
        assert fc + ".weight" in state_dict, f"{fc} not in model params"
    assert model.num_classes == cfg["num_classes"] and model.num_features > 0 and model.head_hidden_size > 0
    if large:
        return

    x = torch.randn(1, *cfg["input_size"])  # the full cfg resolution (224): every T/S model runs at 224 on CPU
    with torch.no_grad():
        feats = model.forward_features(x)
        if model_name in NON_STD:
            assert feats.ndim == 3 and feats.shape[-1] == model.num_features
        else:
            assert feats.shape[1] == model.num_features
            assert tuple(feats.shape[-2:]) == tuple(cfg["pool_size"])
        assert model.forward_head(feats).shape == (1, model.num_classes)
        pre_logits = model.forward_head(feats, pre_logits=True)
        assert pre_logits.shape == (1, model.head_hidden_size)

        model.reset_classifier(0)
        assert model.num_classes == 0
        out = model.forward_head(feats)
        assert out.shape == pre_logits.shape
        if model_name not in NON_STD:
            model.reset_classifier(0, "")
            out = model.forward_head(feats)
            assert out.ndim == 4 and tuple(out.shape[-2:]) == tuple(cfg["pool_size"])
            small = torch.randn(1, *_input_size(model_name, FWD_SIZE))
            unpooled = timm.create_model(model_name, num_classes=0, global_pool="").eval()
            assert unpooled(small).ndim == 4


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("feature_cls", [None, "getter"])
def test_model_forward_features(model_name, feature_cls):
    """features_only: one map per feature_info entry, channels and strides as declared (4/8/16/32 for the
    hierarchical models), no NaN."""
    kwargs = {} if feature_cls is None else {"feature_cls": feature_cls}
    model = timm.create_model(model_name, pretrained=False, features_only=True, **kwargs).eval()
    channels = model.feature_info.channels()
    reductions = model.feature_info.reduction()
    if model_name in STD:
        assert reductions == [4, 8, 16, 32]
    else:
        assert len(channels) >= 1
    input_size = _input_size(model_name, FEAT_SIZE)
    with torch.no_grad():
        outputs = model(torch.randn(1, *input_size))
    assert len(outputs) == len(channels)
    for c, r, o in zip(channels, reductions, outputs):
        assert o.shape[1] == c
        assert o.shape[-2] <= math.ceil(input_size[1] / r) + 1 and o.shape[-1] <= math.ceil(input_size[2] / r) + 1
        assert not torch.isnan(o).any()


@pytest.mark.parametrize("model_name", MODELS)
def test_model_forward_intermediates(model_name):
    """forward_intermediates gives the feature_info maps and a final output equal to forward_features, with and
    without gradient checkpointing; prune_intermediate_layers keeps the requested stages working."""
    model = _create(model_name).eval()
    feature_info = timm.models.FeatureInfo(model.feature_info, range(len(model.feature_info)))
    input_size = _input_size(model_name, FEAT_SIZE)
    x = torch.randn(1, *input_size)
    with torch.no_grad():
        expected = model.forward_features(x)
        final, intermediates = model.forward_intermediates(x, output_fmt="NCHW")
        assert len(intermediates) == len(feature_info.channels())
        for c, r, o in zip(feature_info.channels(), feature_info.reduction(), intermediates):
            assert o.shape[1] == c
            assert o.shape[-2] <= math.ceil(input_size[1] / r) + 1
        torch.testing.assert_close(final, expected)
        model.set_grad_checkpointing()
        final, _ = model.forward_intermediates(x, output_fmt="NCHW")
        torch.testing.assert_close(final, expected, rtol=1e-4, atol=1e-5)
        # the last intermediate of the full model survives pruning unchanged
        only = model.forward_intermediates(x, indices=[1], intermediates_only=True)
        kept = model.prune_intermediate_layers([1], prune_head=True)
        assert kept == [1]
        torch.testing.assert_close(model.forward_intermediates(x, indices=[1], intermediates_only=True)[0],
                                   only[0])


@pytest.mark.parametrize("model_name", STD)
def test_model_group_matcher_and_no_weight_decay(model_name):
    """Every parameter falls in a layer-decay group; the no-weight-decay patterns name real parameters."""
    from timm.models import group_parameters

    model = timm.create_model(model_name, device="meta")
    groups = group_parameters(model, model.group_matcher(coarse=False))
    grouped = {n for names in groups.values() for n in names}
    assert grouped == {n for n, _ in model.named_parameters()}
    patterns = model.no_weight_decay()
    names = [n for n, _ in model.named_parameters()]
    assert any(fnmatch.fnmatch(n, p) for n in names for p in patterns)


@pytest.mark.parametrize("model_name", MODELS)
def test_model_forward_fx(model_name):
    """torchvision FX feature extraction with timm's leaf modules gives exactly the eager output."""
    why = _fx_excluded(model_name)
    if why:
        pytest.skip(f"FX excluded: {why}")
    model = _create(model_name).eval()
    _, eval_nodes = get_graph_node_names(model)
    fx_model = create_feature_extractor(model, return_nodes=[eval_nodes[-1]])
    x = torch.randn(1, *_input_size(model_name, FWD_SIZE))
    with torch.no_grad():
        fx_out = tuple(fx_model(x).values())[0]
        out = model(x)
    assert torch.equal(fx_out, out)


@pytest.mark.parametrize("model_name", [m for m in ("mamba_vision_T", "gka_vision_T", "comba_vision_T")
                                        if m in MODELS])
def test_model_backward_fx(model_name):
    """Backward through the FX-extracted model reaches every parameter."""
    model = timm.create_model(model_name, pretrained=False, num_classes=42)
    num_params = sum(p.numel() for p in model.parameters())
    model.train()
    train_nodes, _ = get_graph_node_names(model)
    fx_model = create_feature_extractor(model, return_nodes=[train_nodes[-1]])
    out = tuple(fx_model(torch.randn(2, *_input_size(model_name, BWD_SIZE))).values())[0]
    out.mean().backward()
    for name, p in fx_model.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
    assert num_params == sum(p.grad.numel() for p in fx_model.parameters())
    assert out.shape[-1] == 42


@pytest.mark.parametrize("model_name", LARGE)
def test_large_model_creates_on_meta(model_name):
    model = timm.create_model(model_name, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert len(model.feature_info) >= 1
