"""comba_vision_{T,S}: parameter counts, GFLOPs, CPU forward at 224² and other resolutions, the timm contract and
the pieces trackers use.

``import visionssm`` does not register the models yet, so this file imports ``visionssm.models.comba_vision``
directly (that registers the comba_vision family with timm).
"""

import fnmatch

import pytest
import timm
import torch
from timm.layers import resample_abs_pos_embed
from timm.models import group_parameters
from torch import nn

import visionssm.models.comba_vision  # noqa: F401  (registers the models)
from visionssm.kernels.utils import assert_close
from visionssm.layers.comba import CombaMixer
from visionssm.models.comba_vision import CombaVision, blocks_then_norm, can_chain

TINY = "test_comba_vision"


def count_gmacs(model: nn.Module, x: torch.Tensor) -> tuple[dict[str, float], torch.Tensor]:
    """GFLOPs of ``model(x)`` counted as multiply-accumulates (fvcore's convention, which the Comba paper's Table 9
    uses: DeiT-T 1.2, DeiT-S 4.6), per image; returns them with the output.

    * ``layers``: every Linear, Conv2d and depthwise short conv (output elements × inputs per output);
    * ``sequence``: the Comba recurrence in its recurrent form, 3·K·V per token, head and scan direction (read
      ``pᵀS``, write ``k uᵀ``, read-out ``qᵀS``; the scalar decay is elementwise and not counted), two directions
      when non-causal.

    Elementwise work (norms, activations, gates) is not counted, as in fvcore."""
    macs = {"layers": 0, "sequence": 0}

    def linear(module, inputs, output):
        macs["layers"] += output.numel() * module.in_features

    def conv2d(module, inputs, output):
        kh, kw = module.kernel_size
        macs["layers"] += output.numel() * (module.in_channels // module.groups) * kh * kw

    def mixer(module, inputs, output):
        batch, length, _ = inputs[0].shape
        # the depthwise short conv runs inside the mixer's fused prologue op, not through its module's forward
        macs["layers"] += batch * length * module.qkv_conv.channels * module.qkv_conv.kernel_size
        directions = 1 if module.causal else 2
        macs["sequence"] += 3 * batch * length * module.num_heads * module.head_dim * module.head_v_dim * directions

    hooks = []
    for module in model.modules():
        for cls, hook in ((nn.Linear, linear), (nn.Conv2d, conv2d), (CombaMixer, mixer)):
            if isinstance(module, cls):
                hooks.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = model(x)
    finally:
        for hook in hooks:
            hook.remove()
    return {key: value / 1e9 / x.shape[0] for key, value in macs.items()}, out


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return timm.create_model(TINY).eval()


# ---- the paper's sizes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, exact, paper_params, paper_gflops", [
    ("comba_vision_T", 5_819_320, 5.8e6, 1.1),
    ("comba_vision_S", 22_428_808, 22.6e6, 4.4),
])
def test_params_flops_and_forward_at_224(name, exact, paper_params, paper_gflops):
    model = timm.create_model(name).eval()
    assert n_params(model) == exact
    assert abs(n_params(model) / paper_params - 1) < 0.05
    assert model.mixer_causal is False and all(not m.causal for m in model.modules() if isinstance(m, CombaMixer))
    gmacs, logits = count_gmacs(model, torch.randn(1, 3, 224, 224))  # the CPU forward at 224²
    assert logits.shape == (1, 1000) and torch.isfinite(logits).all()
    assert abs(gmacs["layers"] / paper_gflops - 1) < 0.05, gmacs
    dim, heads = model.embed_dim, model.blocks[0].mixer.num_heads
    assert gmacs["sequence"] == pytest.approx(12 * 2 * 3 * 196 * heads * (dim // heads) ** 2 / 1e9)


def test_causal_recurrence_costs_half(tiny):
    causal = timm.create_model(TINY, mixer_causal=True).eval()
    x = torch.randn(1, 3, 96, 96)
    bidirectional_macs, _ = count_gmacs(tiny, x)
    causal_macs, _ = count_gmacs(causal, x)
    assert causal_macs["layers"] == bidirectional_macs["layers"]
    assert causal_macs["sequence"] == pytest.approx(bidirectional_macs["sequence"] / 2)


# ---- resolutions and position embeddings ------------------------------------------------------------------------


@pytest.mark.parametrize("img_size", [(96, 96), (64, 64), (128, 160), (112, 80), (100, 90)])
def test_other_resolutions(tiny, img_size):
    x = torch.randn(2, 3, *img_size)
    grid = (-(-img_size[0] // 16), -(-img_size[1] // 16))  # sides that are not multiples of 16 are padded
    with torch.no_grad():
        tokens = tiny.forward_features(x)
        logits = tiny(x)
        maps = tiny.forward_intermediates(x, indices=1, intermediates_only=True)
    assert tokens.shape == (2, grid[0] * grid[1], tiny.embed_dim)
    assert logits.shape == (2, tiny.num_classes) and torch.isfinite(logits).all()
    assert maps[0].shape == (2, tiny.embed_dim, *grid)


def test_position_embedding_resampled_per_grid(tiny):
    x = torch.randn(1, 3, 96, 96)
    patches = tiny.patch_embed(x)
    assert patches.shape == (1, 6, 6, tiny.embed_dim)  # NHWC
    torch.testing.assert_close(tiny._pos_embed(patches), patches.reshape(1, 36, -1) + tiny.pos_embed)
    bigger = tiny.patch_embed(torch.randn(1, 3, 160, 128))
    expected = resample_abs_pos_embed(tiny.pos_embed, new_size=(10, 8), old_size=(6, 6), num_prefix_tokens=0)
    torch.testing.assert_close(tiny._pos_embed(bigger), bigger.reshape(1, 80, -1) + expected)


def test_tracker_pieces_run_on_concatenated_tokens(tiny):
    template, search = torch.randn(2, 3, 64, 64), torch.randn(2, 3, 128, 128)
    with torch.no_grad():
        z, z_grid = tiny.embed(template)
        s, s_grid = tiny.embed(search)
        assert (z_grid, s_grid) == ((4, 4), (8, 8))
        joint = tiny.norm(tiny.blocks(torch.cat([z, s], dim=1)))
        assert joint.shape == (2, 16 + 64, tiny.embed_dim) and torch.isfinite(joint).all()
        # The same pieces reproduce forward_features for a single image.
        x = torch.randn(2, 3, 96, 96)
        torch.testing.assert_close(tiny.norm(tiny.blocks(tiny._pos_embed(tiny.patch_embed(x)))),
                                   tiny.forward_features(x))


def test_checkpoint_filter_resamples_and_unwraps(tmp_path):
    source = timm.create_model(TINY).eval()
    path = tmp_path / "checkpoint.pth"
    torch.save({"model": {f"module.{k}": v for k, v in source.state_dict().items()}}, path)
    model = timm.create_model(TINY, pretrained=True, img_size=128, pretrained_cfg_overlay={"file": str(path)})
    model.eval()
    assert model.pos_embed.shape == (1, 64, source.embed_dim)
    for name, value in model.state_dict().items():
        if name != "pos_embed":
            torch.testing.assert_close(value, source.state_dict()[name], msg=name)
    x = torch.randn(1, 3, 96, 96)
    with torch.no_grad():  # at the source resolution the resampled grid comes back to the original one
        torch.testing.assert_close(model(x), source(x), rtol=5e-3, atol=5e-3)


# ---- timm contract ----------------------------------------------------------------------------------------------


def test_default_cfgs_complete():
    for name in ("comba_vision_T", "comba_vision_S", TINY):
        cfg = timm.models.get_pretrained_cfg(name).to_dict()
        for key in ("num_classes", "input_size", "crop_pct", "interpolation", "mean", "std", "first_conv",
                    "classifier", "license"):
            assert cfg.get(key) is not None, (name, key)
        model = timm.create_model(name)
        state = model.state_dict()
        assert cfg["first_conv"] + ".weight" in state and cfg["classifier"] + ".weight" in state
        assert model.pretrained_cfg["input_size"] == cfg["input_size"]


def test_heads_and_reset_classifier(tiny):
    model = timm.create_model(TINY).eval()
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        features = model.forward_features(x)
        assert features.shape == (2, 36, model.num_features)
        pre_logits = model.forward_head(features, pre_logits=True)
        assert pre_logits.shape == (2, model.head_hidden_size)
        torch.testing.assert_close(pre_logits, features.mean(1))
        model.reset_classifier(0)
        assert model.num_classes == 0 and model(x).shape == (2, model.head_hidden_size)
        model.reset_classifier(0, "")
        assert model(x).shape == (2, 36, model.num_features)
        model.reset_classifier(7, "avg")
        assert model(x).shape == (2, 7)
        assert timm.create_model(TINY, num_classes=0, global_pool="")(x).shape == (2, 36, model.num_features)
    with pytest.raises(ValueError, match="global_pool"):
        model.reset_classifier(0, "max")


def test_forward_intermediates_and_prune(tiny):
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        final, intermediates = tiny.forward_intermediates(x)
        torch.testing.assert_close(final, tiny.forward_features(x))
        assert len(intermediates) == len(tiny.blocks) == len(tiny.feature_info)
        for feat, info in zip(intermediates, tiny.feature_info):
            assert feat.shape == (2, info["num_chs"], 96 // info["reduction"], 96 // info["reduction"])
        nlc = tiny.forward_intermediates(x, indices=[0, 2], output_fmt="NLC", norm=True, intermediates_only=True)
        assert [t.shape for t in nlc] == [(2, 36, tiny.embed_dim)] * 2
        torch.testing.assert_close(nlc[1], final)
        early = tiny.forward_intermediates(x, indices=[1], stop_early=True, intermediates_only=True)
        torch.testing.assert_close(early[0], intermediates[1])

        pruned = timm.create_model(TINY)
        pruned.load_state_dict(tiny.state_dict())
        pruned.eval()
        assert pruned.prune_intermediate_layers(indices=[1]) == [1]
        assert len(pruned.blocks) == 2 and pruned.num_classes == 0
        torch.testing.assert_close(pruned.forward_intermediates(x, indices=[1], intermediates_only=True)[0],
                                   intermediates[1])


def test_features_only(tiny):
    model = timm.create_model(TINY, features_only=True).eval()
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        features = model(x)
    assert len(features) == 3 == len(model.feature_info.channels())
    for feat, channels, reduction in zip(features, model.feature_info.channels(), model.feature_info.reduction()):
        assert feat.shape == (2, channels, 96 // reduction, 96 // reduction)


def test_backward_every_parameter_and_grad_checkpointing():
    model = timm.create_model(TINY, num_classes=42)
    model.train()
    x = torch.randn(2, 3, 96, 96)
    out = model(x)
    assert out.shape == (2, 42)
    out.mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, f"{name} gets a zero gradient"

    model.eval()
    with torch.no_grad():
        reference = model(x)
        model.set_grad_checkpointing(True)
        torch.testing.assert_close(model(x), reference, rtol=1e-4, atol=1e-5)
        final, _ = model.forward_intermediates(x, indices=1)
        torch.testing.assert_close(final, model.forward_features(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernels", [False, True], ids=["reference-ops", "interpreter"])
def test_chained_blocks_equal_the_block_sequence(kernels, request):
    """forward_features chains the blocks (each residual add inside the next norm, the last inside the final norm):
    features and every gradient equal the plain sequence of block calls, with the reference ops on CPU and with the
    kernels (Triton's interpreter); a forward hook on a block turns the chain off, and sees its call."""
    if kernels:
        request.getfixturevalue("triton_interpreter")
        request.getfixturevalue("poison_outputs")
    torch.manual_seed(0)
    model = timm.create_model(TINY, depth=2)
    x = torch.randn(2, 3, 48, 64)
    cotangent = torch.randn(2, 12, 64)

    def run(chained):
        model.zero_grad(set_to_none=True)
        if chained:
            assert can_chain(model.blocks)
            out = model.forward_features(x)
        else:
            out = model.norm(model.blocks(model.embed(x)[0]))
        (out * cotangent).sum().backward()
        return [out.detach(), *(p.grad for _, p in model.named_parameters())]

    names = ["features", *(name for name, _ in model.named_parameters())]
    for name, got, want in zip(names, run(True), run(False)):
        assert (got is None) == (want is None) == name.startswith("head."), name
        if got is not None:
            assert_close(got, want, tol=1e-5, name=name)
    seen = []
    hook = model.blocks[1].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    try:
        assert not can_chain(model.blocks)
        model.forward_features(x)
    finally:
        hook.remove()
    assert seen == [(2, 12, 64)]
    tokens = torch.randn(2, 12, 64)
    assert torch.equal(blocks_then_norm(nn.Sequential(), model.norm, tokens), model.norm(tokens))  # no blocks


def test_no_weight_decay_and_group_matcher(tiny):
    patterns = tiny.no_weight_decay()
    names = [name for name, _ in tiny.named_parameters()]
    for pattern in patterns:
        assert any(fnmatch.fnmatch(name, pattern) for name in names), f"{pattern} matches no parameter"
    for suffix in ("A_log", "dt_bias", "b_logit", "correction"):
        assert any(fnmatch.fnmatch(f"blocks.0.mixer.{suffix}", p) for p in patterns)
    groups = group_parameters(tiny, tiny.group_matcher())
    assert sorted(n for group in groups.values() for n in group) == sorted(names)
    assert len(groups) == len(tiny.blocks) + 2  # stem, one group per block, final norm + head


def test_mixer_causal_switch_changes_outputs(tiny):
    causal = timm.create_model(TINY, mixer_causal=True).eval()
    causal.load_state_dict(tiny.state_dict())
    x = torch.randn(1, 3, 96, 96)
    with torch.no_grad():
        assert (causal(x) - tiny(x)).abs().amax() > 1e-4
    with pytest.raises(TypeError, match="mixer_causal"):
        CombaVision(mixer_causal="yes")


@pytest.mark.parametrize("mixer_causal", [False, True])
def test_fx_feature_extraction(mixer_causal):
    # The mixers are FX leaves (register_notrace_module) and the shape-dependent position embedding a leaf
    # function, so timm's FX feature extraction traces the rest; the traced graph works at other resolutions too.
    from timm.models import create_feature_extractor

    model = timm.create_model(TINY, mixer_causal=mixer_causal).eval()
    extractor = create_feature_extractor(model, return_nodes=["blocks.1", "head"])
    for size in (96, 128):
        x = torch.randn(1, 3, size, size)
        with torch.no_grad():
            assert torch.equal(extractor(x)["head"], model(x))


def test_device_and_dtype_kwargs():
    model = timm.create_model(TINY, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    model = timm.create_model(TINY, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    with torch.no_grad():
        assert model(torch.randn(1, 3, 96, 96, dtype=torch.float64)).dtype == torch.float64


# ---- the iplr transition ----------------------------------------------------------------------------------------


def test_transition_passes_through_create_model(tiny):
    model = timm.create_model("comba_vision_S", transition="iplr", num_classes=0)
    assert {block.mixer.transition for block in model.blocks} == {"iplr"}
    assert {block.mixer.gate_rank for block in model.blocks} == {32}  # the preset's other mixer settings stay
    assert {b.mixer.transition for b in timm.create_model("comba_vision_T").blocks} == {"splr"}
    iplr = timm.create_model(TINY, transition="iplr").eval()
    iplr.load_state_dict(tiny.state_dict())  # no parameters of its own: the same checkpoint loads
    x = torch.randn(1, 3, 96, 96)
    with torch.no_grad():
        assert (iplr(x) - tiny(x)).abs().amax() > 1e-5
    with pytest.raises(ValueError, match="transition"):
        timm.create_model(TINY, transition="dplr")


def test_transition_passes_through_the_tracking_config():
    import os

    from visionssm.tracking.config import load_config
    from visionssm.tracking.model.tracker_model import build_model

    path = os.path.join(os.path.dirname(__file__), "..", "configs", "tracking", "comba_vision_S_got10k_ep100.yaml")
    assert load_config(path)["model"]["backbone_kwargs"] == {"transition": "splr"}
    cfg = load_config(path, ["model.backbone=test_comba_vision", "model.backbone_kwargs={transition: iplr}"])
    tracker = build_model(cfg["model"], load_pretrained=False)
    mixers = [m for m in tracker.modules() if isinstance(m, CombaMixer)]
    assert mixers and {m.transition for m in mixers} == {"iplr"} and not any(m.causal for m in mixers)


# ---- the norms ----------------------------------------------------------------------------------------------------


def test_fused_norm_choice_and_checkpoints_interchange(tiny):
    from visionssm.layers.common import LayerNorm

    def norms(model):
        return {type(m) for m in model.modules() if isinstance(m, nn.LayerNorm)}

    assert norms(tiny) == {LayerNorm}  # the default: visionssm's kernels
    assert norms(timm.create_model("comba_vision_S", num_classes=0)) == {LayerNorm}
    other = timm.create_model(TINY, fused_norm=False).eval()
    assert norms(other) == {nn.LayerNorm}
    other.load_state_dict(tiny.state_dict())  # same parameters and keys
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        torch.testing.assert_close(other(x), tiny(x))
    for bad in (1, "inference"):
        with pytest.raises(TypeError, match="fused_norm"):
            timm.create_model(TINY, fused_norm=bad)
    with pytest.raises(TypeError, match="autocast_output"):
        LayerNorm(8, autocast_output="yes")


def test_block_norms_write_autocast_dtype_for_linear_inputs():
    """A block's norms hand their result to a linear projection first (the MLP's; the mixer's where the mixer says
    so), so under autocast they write it in autocast's dtype; the final norm (pooled by the head) does not."""
    from visionssm.layers.base import SequenceMixer
    from visionssm.layers.common import LayerNorm

    model = timm.create_model(TINY)
    assert all(b.norm1.autocast_output and b.norm2.autocast_output for b in model.blocks)
    assert isinstance(model.norm, LayerNorm) and not model.norm.autocast_output

    class Scaled(SequenceMixer):  # uses its input before any projection: keeps float32 input under autocast
        def __init__(self, dim, *, causal=False, device=None, dtype=None):
            super().__init__(dim, causal=causal)
            self.proj = nn.Linear(dim, dim, device=device, dtype=dtype)

        def reset_parameters(self):
            self.proj.reset_parameters()

        def forward(self, x):
            return self.proj(x * x.square().mean(-1, keepdim=True).rsqrt())

    other = timm.create_model(TINY, mixer=Scaled, mixer_kwargs={})
    assert all(not b.norm1.autocast_output and b.norm2.autocast_output for b in other.blocks)
    plain = timm.create_model(TINY, fused_norm=False)
    assert not any(hasattr(m, "autocast_output") for m in plain.modules())


@pytest.mark.cuda
def test_cuda_block_norms_in_autocast_dtype():
    """The norms writing autocast's dtype give the logits of float32 norms cast by the projections (up to the norms'
    rare last-place differences), in inference and in a training step, and the same gradients: the projections'
    backward hands the norms the 16-bit gradient that the cast's backward widened before."""
    from visionssm.kernels.utils import assert_close
    from visionssm.layers.common import LayerNorm

    torch.manual_seed(0)
    model = timm.create_model(TINY).cuda()
    norms = [m for m in model.modules() if isinstance(m, LayerNorm) and m is not model.norm]
    x = torch.randn(4, 3, 96, 96, device="cuda")
    logits, dtypes, grads = [], [], []
    hooks = [n.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype)) for n in norms]
    for direct in (True, False):
        for m in norms:
            m.autocast_output = direct
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            logits.append(model.eval()(x).float())
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model.train()(x).float().square().mean().backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    dtype_direct, dtype_cast = [torch.bfloat16] * len(norms), [torch.float32] * len(norms)
    assert dtypes == dtype_direct * 2 + dtype_cast * 2
    assert_close(logits[0], logits[1], tol=1e-2, name="logits")
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert_close(grads[0][name], grads[1][name], tol=2e-2, name=f"{name}.grad")
    for h in hooks:
        h.remove()
