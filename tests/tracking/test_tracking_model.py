"""Pair backbones on the real visionssm models (tiny configurations), the ImageNet-weight hand-over and the tracker."""

import numpy as np
import pytest
import timm
import torch

from visionssm.tracking.model import OneStreamTracker, build_model, build_pair_backbone
from visionssm.tracking.model.backbones import (
    HierarchicalPairBackbone,
    IsotropicPairBackbone,
    create_classifier,
)
from visionssm.tracking.tracker import Tracker

TINY_HIER = {"depths": (1, 1, 2, 1), "dims": 16, "stem_dim": 8, "num_heads": (1, 1, 2, 2)}
CASES = [
    ("test_comba_vision", {}, IsotropicPairBackbone),
    ("mamba_vision_T", TINY_HIER, HierarchicalPairBackbone),
    ("gka_vision_T", TINY_HIER, HierarchicalPairBackbone),
]


@pytest.mark.parametrize("name,kwargs,cls", CASES, ids=[c[0] for c in CASES])
def test_pair_backbone_shapes_and_template_dependence(name, kwargs, cls):
    torch.manual_seed(0)
    backbone = build_pair_backbone(name, **kwargs).eval()
    assert isinstance(backbone, cls)
    assert all(not getattr(m, "causal", False) for m in backbone.modules())  # every mixer built non-causal
    z, x = torch.randn(2, 3, 128, 128), torch.randn(2, 3, 256, 256)
    with torch.no_grad():
        out = backbone(z, x)
        assert out.shape == (2, backbone.out_channels, 16, 16)
        # Template first in one joint sequence: the search map must depend on the template.
        other = backbone(torch.randn(2, 3, 128, 128), x)
    assert (out - other).abs().max() > 1e-4
    with pytest.raises(ValueError, match="template"):
        backbone(torch.randn(1, 3, 96, 96), x[:1])


def test_isotropic_mixers_are_non_causal():
    """All-Comba blocks: the first search token must see the last search patch (a causal scan would not)."""
    torch.manual_seed(0)
    backbone = build_pair_backbone("test_comba_vision").eval()
    z, x = torch.randn(1, 3, 128, 128), torch.randn(1, 3, 256, 256)
    x2 = x.clone()
    x2[..., -16:, -16:] += 1.0  # the bottom-right patch = the last token of the sequence
    with torch.no_grad():
        a, b = backbone(z, x), backbone(z, x2)
    assert (a[..., 0, 0] - b[..., 0, 0]).abs().max() > 1e-5


def test_isotropic_adapter_chains_comba_blocks():
    """The adapter runs Comba blocks chained (residual adds inside the norms): the same search map, and the same
    gradients, as the blocks called one after another (forced by a forward hook on one of them)."""
    from visionssm.models.comba_vision import can_chain

    torch.manual_seed(0)
    backbone = build_pair_backbone("test_comba_vision")
    z, x = torch.randn(1, 3, 128, 128), torch.randn(1, 3, 256, 256)
    results = []
    for hooked in (False, True):
        handle = backbone.blocks[0].register_forward_hook(lambda m, i, o: None) if hooked else None
        assert can_chain(backbone.blocks) is not hooked
        backbone.zero_grad(set_to_none=True)
        out = backbone(z, x)
        out.square().mean().backward()
        results.append([out.detach(), backbone.blocks[0].norm1.weight.grad, backbone.pos_embed_x.grad])
        if handle is not None:
            handle.remove()
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_imagenet_checkpoint_is_loaded_into_the_adapter(tmp_path):
    torch.manual_seed(1)
    source = create_classifier("test_comba_vision")
    path = tmp_path / "imagenet.pth"
    torch.save({"model": source.state_dict()}, path)
    backbone = build_pair_backbone("test_comba_vision", pretrained=str(path))
    torch.testing.assert_close(backbone.blocks[0].norm1.weight, source.blocks[0].norm1.weight)
    torch.testing.assert_close(backbone.patch_embed.proj.weight, source.patch_embed.proj.weight)
    resampled = timm.layers.resample_abs_pos_embed(source.pos_embed.detach(), (8, 8), old_size=(6, 6),
                                                   num_prefix_tokens=0)
    torch.testing.assert_close(backbone.pos_embed_z.detach(), resampled)
    torch.save({"model": {"blocks.0.norm1.weight": torch.ones(64)}}, tmp_path / "partial.pth")
    with pytest.raises(RuntimeError, match="lacks backbone weights"):
        build_pair_backbone("test_comba_vision", pretrained=str(tmp_path / "partial.pth"))


def test_hierarchical_checkpoint_handover(tmp_path):
    source = create_classifier("mamba_vision_T", **TINY_HIER)
    torch.save(source.state_dict(), tmp_path / "mv.pth")
    backbone = build_pair_backbone("mamba_vision_T", pretrained=str(tmp_path / "mv.pth"), **TINY_HIER)
    torch.testing.assert_close(backbone.blocks[0].norm1.weight, source.stages[2].blocks[0].norm1.weight)
    torch.testing.assert_close(backbone.stem.conv1.weight, source.stem.conv1.weight)


def test_unknown_backbone():
    with pytest.raises(ValueError, match="unknown backbone"):
        build_pair_backbone("resnet50")


class _StayModel(torch.nn.Module):
    """Predicts the crop centre with a fixed size: a tracker using it must keep the box where it is."""

    def __init__(self, size_fraction):
        super().__init__()
        self.backbone = type("B", (), {"stride": 16, "template_size": 128, "search_size": 256})()
        self.template_size, self.search_size = 128, 256
        self.size_fraction = size_fraction

    def forward(self, template, search):
        score = torch.full((1, 1, 16, 16), 1e-3)
        score[0, 0, 8, 8] = 0.9  # centre 8.0 cells = the crop centre, offset 0
        return {"score": score, "size": torch.full((1, 2, 16, 16), self.size_fraction),
                "offset": torch.zeros(1, 2, 16, 16)}


def test_tracker_maps_back_to_image_coordinates():
    box = np.array([50.0, 40.0, 24.0, 24.0])  # square: the search crop is 4·24 = 96 px → 256 px
    tracker = Tracker(_StayModel(0.25), "cpu")
    image = np.zeros((120, 160, 3), np.uint8)
    tracker.initialize(image, box)
    np.testing.assert_allclose(tracker.track(image), box, atol=1e-4)
    np.testing.assert_allclose(tracker.track(image), box, atol=1e-4)
    # Near the border the box is clipped into the image.
    tracker.initialize(image, np.array([150.0, 40.0, 24.0, 24.0]))
    out = tracker.track(image)
    assert out[0] + out[2] <= 160 + 1e-9 and out[2] >= 10


def test_tracker_validates_input():
    model = build_model({"backbone": "tiny", "head_channels": 32})
    tracker = Tracker(model)
    with pytest.raises(RuntimeError, match="initialize"):
        tracker.track(np.zeros((64, 64, 3), np.uint8))
    with pytest.raises(ValueError, match="box"):
        tracker.initialize(np.zeros((64, 64, 3), np.uint8), [0, 0, 0, 5])
    with pytest.raises(ValueError, match="RGB uint8"):
        tracker.initialize(np.zeros((64, 64), np.uint8), [1, 1, 5, 5])
    assert isinstance(model, OneStreamTracker)


@pytest.mark.parametrize("name,kwargs,cls", CASES, ids=[c[0] for c in CASES])
def test_training_step_reaches_every_parameter(name, kwargs, cls):
    from visionssm.tracking.losses import tracking_loss

    torch.manual_seed(0)
    # Small crops (2×2 template and 4×4 search tokens) keep the CPU reference kernels quick.
    model = build_model({"backbone": name, "backbone_kwargs": kwargs, "head_channels": 32, "drop_path_rate": 0.0,
                         "template_size": 32, "search_size": 64})
    out = model(torch.randn(2, 3, 32, 32), torch.randn(2, 3, 64, 64))
    assert out["score"].shape == (2, 1, 4, 4)
    loss, _ = tracking_loss(out, torch.tensor([[0.3, 0.3, 0.6, 0.7], [0.1, 0.2, 0.4, 0.5]]))
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, missing
