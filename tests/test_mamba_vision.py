"""MambaVision: exact official parameter counts, weight compatibility with NVIDIA's checkpoints, any resolution.

Weight compatibility is checked against ``_Official*``, a small re-statement of the official model written from the
official architecture: the official module tree and key names (so its state dict
*is* the released checkpoint format), the official window padding and the official mixer with its per-token
selective scan (mamba_ssm's ``selective_scan_ref`` semantics, dt bias applied twice). A random state dict of that
tree goes through ``checkpoint_filter_fn`` into our model; every tensor must land and the logits must agree.
"""

from __future__ import annotations

import argparse
import fnmatch
import math

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

# `import visionssm` does not register the models yet (the package __init__ is wired at integration): import the
# model modules explicitly.
import visionssm.models.comba_vision  # noqa: F401
import visionssm.models.gka_vision  # noqa: F401
from visionssm.kernels.utils import relative_error
from visionssm.layers import MIXERS
from visionssm.layers.mamba import MambaVisionMixer
from visionssm.models.mamba_vision import MambaVision, checkpoint_filter_fn

PARAM_COUNTS = {
    "mamba_vision_T": 31_794_248,
    "mamba_vision_T2": 35_104_008,
    "mamba_vision_S": 50_140_584,
    "mamba_vision_B": 97_685_288,
    "mamba_vision_L": 227_961_048,
    "mamba_vision_L2": 241_554_824,
    "mamba_vision_L2_512": 241_554_824,  # L2 with 512-px windows
    "mamba_vision_L3_256": 739_570_472,
    "mamba_vision_L3_512": 739_570_472,
}

# (depths, dim, in_dim, heads, windows, layer_scale) of the official entrypoints (spec §1.1)
OFFICIAL_T = {"depths": (1, 3, 8, 4), "dim": 80, "in_dim": 32, "num_heads": (2, 4, 8, 16), "window_size": (8, 8, 14, 7)}


# ---------------------------------------------------------------------------------------------------------------
# The official model, restated from the spec with the official module names.


def _official_scan(u, delta, A, B, C, D, delta_bias):
    """mamba_ssm selective_scan_ref semantics, z=None, softplus: one forward pass over L, token by token."""
    delta = F.softplus(delta + delta_bias[:, None])
    state = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[-1]):
        drive = (delta[:, :, t] * u[:, :, t])[..., None] * B[:, None, :, t]
        state = torch.exp(delta[:, :, t, None] * A) * state + drive
        ys.append((state * C[:, None, :, t]).sum(-1))
    return torch.stack(ys, dim=-1) + u * D[:, None]


class _OfficialMixer(nn.Module):
    def __init__(self, d_model, d_state=8, d_conv=3):
        super().__init__()
        self.dt_rank = math.ceil(d_model / 16)
        self.d_state = d_state
        h = d_model // 2
        self.in_proj = nn.Linear(d_model, d_model, bias=False)
        self.x_proj = nn.Linear(h, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, h, bias=True)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1).float()).repeat(h, 1))
        self.D = nn.Parameter(torch.ones(h))
        self.out_proj = nn.Linear(d_model, d_model, bias=False)
        self.conv1d_x = nn.Conv1d(h, h, d_conv, groups=h, bias=False)
        self.conv1d_z = nn.Conv1d(h, h, d_conv, groups=h, bias=False)

    def forward(self, hidden):
        L = hidden.shape[1]
        x, z = self.in_proj(hidden).transpose(1, 2).chunk(2, dim=1)
        h = x.shape[1]
        x = F.silu(F.conv1d(x, self.conv1d_x.weight, None, padding="same", groups=h))
        z = F.silu(F.conv1d(z, self.conv1d_z.weight, None, padding="same", groups=h))
        dt, B, C = torch.split(self.x_proj(x.transpose(1, 2).reshape(-1, h)), [self.dt_rank, self.d_state,
                                                                                 self.d_state], dim=-1)
        dt = self.dt_proj(dt).reshape(-1, L, h).transpose(1, 2)  # bias added here ...
        B = B.reshape(-1, L, self.d_state).transpose(1, 2)
        C = C.reshape(-1, L, self.d_state).transpose(1, 2)
        y = _official_scan(x, dt, -torch.exp(self.A_log), B, C, self.D, self.dt_proj.bias)  # ... and again here
        return self.out_proj(torch.cat([y, z], dim=1).transpose(1, 2))


class _OfficialAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1) * (C // self.num_heads) ** -0.5).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class _OfficialMlp(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class _OfficialBlock(nn.Module):
    def __init__(self, dim, num_heads, attention, layer_scale):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.mixer = _OfficialAttention(dim, num_heads) if attention else _OfficialMixer(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = _OfficialMlp(dim)
        self.gamma_1 = nn.Parameter(layer_scale * torch.ones(dim)) if layer_scale else 1
        self.gamma_2 = nn.Parameter(layer_scale * torch.ones(dim)) if layer_scale else 1

    def forward(self, x):
        x = x + self.gamma_1 * self.mixer(self.norm1(x))
        return x + self.gamma_2 * self.mlp(self.norm2(x))


class _OfficialConvBlock(nn.Module):
    def __init__(self, dim, layer_scale_conv):
        super().__init__()
        self.conv1 = nn.Conv2d(dim, dim, 3, 1, 1)
        self.norm1 = nn.BatchNorm2d(dim, eps=1e-5)
        self.act1 = nn.GELU(approximate="tanh")
        self.conv2 = nn.Conv2d(dim, dim, 3, 1, 1)
        self.norm2 = nn.BatchNorm2d(dim, eps=1e-5)
        if layer_scale_conv:
            self.gamma = nn.Parameter(layer_scale_conv * torch.ones(dim))
        self.layer_scale = bool(layer_scale_conv)

    def forward(self, x):
        y = self.norm2(self.conv2(self.act1(self.norm1(self.conv1(x)))))
        if self.layer_scale:
            y = y * self.gamma.view(1, -1, 1, 1)
        return x + y


class _OfficialDownsample(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.reduction = nn.Sequential(nn.Conv2d(dim, 2 * dim, 3, 2, 1, bias=False))

    def forward(self, x):
        return self.reduction(x)


class _OfficialPatchEmbed(nn.Module):
    def __init__(self, in_chans, in_dim, dim):
        super().__init__()
        self.proj = nn.Identity()
        self.conv_down = nn.Sequential(
            nn.Conv2d(in_chans, in_dim, 3, 2, 1, bias=False), nn.BatchNorm2d(in_dim, eps=1e-4), nn.ReLU(),
            nn.Conv2d(in_dim, dim, 3, 2, 1, bias=False), nn.BatchNorm2d(dim, eps=1e-4), nn.ReLU())

    def forward(self, x):
        return self.conv_down(self.proj(x))


class _OfficialLevel(nn.Module):
    def __init__(self, dim, depth, num_heads, window_size, conv, downsample, layer_scale, layer_scale_conv):
        super().__init__()
        self.conv = conv
        self.window_size = window_size
        attention = range(depth // 2 + 1, depth) if depth % 2 else range(depth // 2, depth)
        if conv:
            self.blocks = nn.ModuleList([_OfficialConvBlock(dim, layer_scale_conv) for _ in range(depth)])
        else:
            self.blocks = nn.ModuleList([_OfficialBlock(dim, num_heads, i in attention, layer_scale)
                                         for i in range(depth)])
        self.downsample = _OfficialDownsample(dim) if downsample else None

    def forward(self, x):
        _, _, H, W = x.shape
        ws = self.window_size
        if not self.conv:
            pad_r, pad_b = (ws - W % ws) % ws, (ws - H % ws) % ws
            x = F.pad(x, (0, pad_r, 0, pad_b))
            B, C, Hp, Wp = x.shape
            x = x.view(B, C, Hp // ws, ws, Wp // ws, ws).permute(0, 2, 4, 3, 5, 1).reshape(-1, ws * ws, C)
        for blk in self.blocks:
            x = blk(x)
        if not self.conv:
            x = x.reshape(B, Hp // ws, Wp // ws, ws, ws, C).permute(0, 5, 1, 3, 2, 4).reshape(B, C, Hp, Wp)
            x = x[:, :, :H, :W].contiguous()
        return x if self.downsample is None else self.downsample(x)


class _OfficialMambaVision(nn.Module):
    def __init__(self, depths, dim, in_dim, num_heads, window_size, layer_scale=None, layer_scale_conv=None,
                 in_chans=3, num_classes=1000):
        super().__init__()
        self.patch_embed = _OfficialPatchEmbed(in_chans, in_dim, dim)
        self.levels = nn.ModuleList([
            _OfficialLevel(dim * 2 ** i, depths[i], num_heads[i], window_size[i], conv=i < 2, downsample=i < 3,
                           layer_scale=layer_scale, layer_scale_conv=layer_scale_conv)
            for i in range(4)])
        self.norm = nn.BatchNorm2d(dim * 8)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(dim * 8, num_classes)

    def forward(self, x):
        x = self.patch_embed(x)
        for level in self.levels:
            x = level(x)
        return self.head(torch.flatten(self.avgpool(self.norm(x)), 1))


@torch.no_grad()
def _randomize_(model: nn.Module) -> nn.Module:
    """Distinct random values everywhere (params and BN statistics), so a misrouted tensor changes the logits."""
    gen = torch.Generator().manual_seed(1234)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 7 + 1))
        elif leaf in ("D",) or leaf.startswith("gamma") or ("norm" in name and leaf == "weight"):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    for name, b in model.named_buffers():
        if name.endswith("running_mean"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))
        elif name.endswith("running_var"):
            b.copy_(0.5 + torch.rand(b.shape, generator=gen))
    return model


def _official_t(**overrides):
    return _randomize_(_OfficialMambaVision(**{**OFFICIAL_T, **overrides})).eval()


# ---------------------------------------------------------------------------------------------------------------
# Parameter counts


@pytest.mark.parametrize("name", list(PARAM_COUNTS))
def test_param_count_exact(name):
    model = timm.create_model(name, device="meta")
    assert sum(p.numel() for p in model.parameters()) == PARAM_COUNTS[name]


def test_gka_vision_t_within_5_percent_of_mamba_vision_t():
    model = timm.create_model("gka_vision_T", device="meta")
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / 31.8e6 - 1) < 0.05, count
    assert all(type(b.mixer).__name__ in ("GKAMixer", "SelfAttention") for b in model.stages[2].blocks)


def test_official_restatement_matches_spec():
    """The reference tree above has the official parameter count and the key names listed in the spec (§1.9)."""
    ref = _OfficialMambaVision(**OFFICIAL_T)
    assert sum(p.numel() for p in ref.parameters()) == PARAM_COUNTS["mamba_vision_T"]
    keys = set(ref.state_dict())
    for key in ("patch_embed.conv_down.0.weight", "patch_embed.conv_down.4.running_var",
                "levels.0.blocks.0.conv1.bias", "levels.1.blocks.2.norm2.num_batches_tracked",
                "levels.2.downsample.reduction.0.weight", "levels.2.blocks.0.mixer.A_log",
                "levels.2.blocks.3.mixer.conv1d_z.weight", "levels.2.blocks.4.mixer.qkv.bias",
                "levels.3.blocks.1.mixer.dt_proj.bias", "levels.3.blocks.3.mlp.fc2.weight", "norm.running_mean",
                "head.weight"):
        assert key in keys, key
    assert "levels.3.downsample.reduction.0.weight" not in keys


# ---------------------------------------------------------------------------------------------------------------
# Weight compatibility


@pytest.mark.parametrize("layer_scales", [(None, None), (1e-5, 1e-5)], ids=["T", "T-layer-scale"])
def test_official_state_dict_lands_everywhere(layer_scales):
    layer_scale, layer_scale_conv = layer_scales
    ref = _official_t(layer_scale=layer_scale, layer_scale_conv=layer_scale_conv)
    official = ref.state_dict()
    model = timm.create_model("mamba_vision_T", layer_scale=layer_scale, layer_scale_conv=layer_scale_conv).eval()
    converted = checkpoint_filter_fn({"state_dict": official}, model)
    ours = model.state_dict()
    assert set(converted) == set(ours), (sorted(set(converted) - set(ours)), sorted(set(ours) - set(converted)))
    assert len(converted) == len(official)
    for key, value in converted.items():
        assert value.shape == ours[key].shape, key
    # every official tensor lands in exactly one place, unchanged
    assert sorted(id(v) for v in converted.values()) == sorted(id(v) for v in official.values())
    model.load_state_dict(converted, strict=True)
    for size in ((64, 64), (96, 128), (70, 45)):  # the last two pad the stage-3/4 windows
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            assert relative_error(model(x), ref(x)) < 1e-4, size


def test_pretrained_overlay_file_in_official_format(tmp_path):
    ref = _official_t()
    path = tmp_path / "mambavision_tiny_1k.pth.tar"
    # what NVIDIA's train.py saves: the weights under 'state_dict' next to the argparse args and more
    torch.save({"epoch": 309, "arch": "mamba_vision_T", "state_dict": ref.state_dict(),
                "args": argparse.Namespace(model="mamba_vision_T", lr=0.005), "metric": 82.3}, path)
    model = timm.create_model("mamba_vision_T", pretrained=True, pretrained_cfg_overlay={"file": str(path)}).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert relative_error(model(x), ref(x)) < 1e-4
        # a new classifier and single-channel input still load the rest
        model = timm.create_model("mamba_vision_T", pretrained=True, num_classes=7, in_chans=1,
                                  pretrained_cfg_overlay={"file": str(path)}).eval()
        assert model(torch.randn(1, 1, 64, 64)).shape == (1, 7)
        assert torch.equal(model.stages[2].blocks[0].mixer.A_log, ref.levels[2].blocks[0].mixer.A_log)
    # a state dict already in our format goes through unchanged
    assert checkpoint_filter_fn(model.state_dict(), model).keys() == model.state_dict().keys()


def test_default_cfgs_name_official_weights():
    for tag in ("mamba_vision_T.nv_in1k", "mamba_vision_T2.nv_in1k", "mamba_vision_S.nv_in1k",
                "mamba_vision_B.nv_in1k", "mamba_vision_B.nv_in21k_ft_in1k", "mamba_vision_L.nv_in1k",
                "mamba_vision_L.nv_in21k_ft_in1k", "mamba_vision_L2.nv_in1k", "mamba_vision_L2_512.nv_in21k_ft_in1k",
                "mamba_vision_L3_256.nv_in21k_ft_in1k", "mamba_vision_L3_512.nv_in21k_ft_in1k"):
        cfg = timm.models.get_pretrained_cfg(tag)
        assert cfg.url.startswith("https://huggingface.co/nvidia/MambaVision-") and cfg.url.endswith(".pth.tar")
        assert cfg.custom_load and cfg.license == "cc-by-nc-sa-4.0"
    assert timm.models.get_pretrained_cfg("mamba_vision_S").crop_pct == 0.93


# ---------------------------------------------------------------------------------------------------------------
# Mixer


@pytest.mark.parametrize("causal", [True, False])
def test_mixer_matches_official_formula(causal):
    ref = _randomize_(_OfficialMixer(64))
    mixer = MambaVisionMixer(64, causal=causal)
    mixer.load_state_dict(ref.state_dict())
    x = torch.randn(2, 37, 64)
    with torch.no_grad():
        out = mixer(x)
        if causal:
            expected = ref(x)
        else:
            # forward + reverse scans summed, D * u once (visionssm.kernels.selective_scan's non-causal semantics)
            expected = _bidirectional_reference(ref, x)
    assert relative_error(out, expected) < 1e-5


def _bidirectional_reference(ref: _OfficialMixer, hidden: torch.Tensor) -> torch.Tensor:
    L = hidden.shape[1]
    x, z = ref.in_proj(hidden).transpose(1, 2).chunk(2, dim=1)
    h = x.shape[1]
    x = F.silu(F.conv1d(x, ref.conv1d_x.weight, None, padding="same", groups=h))
    z = F.silu(F.conv1d(z, ref.conv1d_z.weight, None, padding="same", groups=h))
    dt, B, C = torch.split(ref.x_proj(x.transpose(1, 2)), [ref.dt_rank, ref.d_state, ref.d_state], dim=-1)
    dt = ref.dt_proj(dt).transpose(1, 2)
    B, C = B.transpose(1, 2), C.transpose(1, 2)
    A = -torch.exp(ref.A_log)
    zero_d = torch.zeros_like(ref.D)
    fwd = _official_scan(x, dt, A, B, C, zero_d, ref.dt_proj.bias)
    rev = _official_scan(x.flip(-1), dt.flip(-1), A, B.flip(-1), C.flip(-1), zero_d, ref.dt_proj.bias).flip(-1)
    y = fwd + rev + x * ref.D[:, None]
    assert y.shape[-1] == L
    return ref.out_proj(torch.cat([y, z], dim=1).transpose(1, 2))


def test_mixer_rejects_bad_input():
    with pytest.raises(ValueError, match="x must have shape"):
        MambaVisionMixer(32)(torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match="expand"):
        MambaVisionMixer(3)


@pytest.mark.parametrize("name", sorted(MIXERS))
@pytest.mark.parametrize("causal", [True, False])
def test_model_hosts_any_mixer(name, causal):
    model = timm.create_model("mamba_vision_T", mixer=name, mixer_causal=causal, depths=(1, 1, 2, 2),
                              num_classes=5).eval()
    first_half = [b.mixer for s in model.stages[2:] for b in s.blocks[:(len(s.blocks) + 1) // 2]]
    assert first_half and all(isinstance(m, MIXERS[name].cls) and m.causal == causal for m in first_half)
    with torch.no_grad():
        assert model(torch.randn(1, 3, 64, 64)).shape == (1, 5)
    with pytest.raises(ValueError, match="mixer"):
        timm.create_model("mamba_vision_T", mixer="nope", device="meta")


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_model_hosts_any_second_mixer(name):
    model = timm.create_model("mamba_vision_T", attn_mixer=name, depths=(1, 1, 2, 2), num_classes=5).eval()
    second_half = [b.mixer for s in model.stages[2:] for b in s.blocks[(len(s.blocks) + 1) // 2:]]
    assert second_half and all(isinstance(m, MIXERS[name].cls) and m.causal is False for m in second_half)
    with torch.no_grad():
        assert model(torch.randn(1, 3, 64, 64)).shape == (1, 5)
    with pytest.raises(ValueError, match="attn_mixer"):
        timm.create_model("mamba_vision_T", attn_mixer="nope", device="meta")


def test_no_weight_decay_patterns_reach_ssm_parameters():
    model = timm.create_model("mamba_vision_T", device="meta")
    patterns = model.no_weight_decay()
    names = [n for n, _ in model.named_parameters()]
    a_logs = [n for n in names if n.endswith(".A_log")]
    assert len(a_logs) == 6
    for n in a_logs + [n for n in names if n.endswith(".D")]:
        assert any(fnmatch.fnmatch(n, p) for p in patterns), n
    assert not any(fnmatch.fnmatch("stages.2.blocks.0.mixer.in_proj.weight", p) for p in patterns)


# ---------------------------------------------------------------------------------------------------------------
# Resolution


@pytest.fixture(scope="module")
def shallow_t():
    return timm.create_model("mamba_vision_T", depths=(1, 1, 2, 2)).eval()


@pytest.mark.parametrize("size", [(32, 32), (64, 96), (100, 60), (33, 47)])
def test_any_resolution(size, shallow_t):
    model = shallow_t
    with torch.no_grad():
        feats = model.forward_intermediates(torch.randn(1, 3, *size), intermediates_only=True)
        out = model(torch.randn(1, 3, *size))
    h, w = (size[0] + 1) // 2, (size[1] + 1) // 2  # each stride-2 conv: ceil(n / 2)
    for f in feats:
        h, w = (h + 1) // 2, (w + 1) // 2
        assert f.shape[-2:] == (h, w)
    assert out.shape == (1, 1000) and torch.isfinite(out).all()


def test_cpu_forward_224():
    model = timm.create_model("mamba_vision_T").eval()
    assert isinstance(model, MambaVision)
    with torch.no_grad():
        out = model(torch.randn(1, 3, 224, 224))
    assert out.shape == (1, 1000) and torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------------------------
# GPU: the Triton path against the reference path, torch.compile (each family's kernel entry stays an opaque call),
# a bf16 channels_last training step


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["mamba_vision_T", "gka_vision_T", "comba_vision_T"])
def test_cuda_triton_path_and_compile(name):
    from visionssm.kernels import dispatch

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    model = timm.create_model(name).cuda().eval()
    x = torch.randn(2, 3, 224, 224, device="cuda")
    with torch.no_grad():
        with dispatch.backend("torch"):
            reference = model(x)
        out = model(x)  # CUDA tensors: the Triton kernels
        error = relative_error(out, reference)
        assert error < 1e-3, f"Triton path vs PyTorch path: relative error {error:.3g}"
        error = relative_error(torch.compile(model)(x), out)
        assert error < 1e-3, f"torch.compile vs eager: relative error {error:.3g}"

    model.train().to(memory_format=torch.channels_last)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x.contiguous(memory_format=torch.channels_last)).float().logsumexp(-1).mean()
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n


# ---------------------------------------------------------------------------------------------------------------
# Window-free stages (global_mixer=True)

# stride 16 / 32 maps of a 64² input are 4x4 / 2x2: one window each covers them exactly
_ONE_WINDOW = {"depths": (1, 1, 2, 2), "dims": 8, "stem_dim": 8, "window_size": (8, 8, 4, 2), "num_classes": 5,
               "drop_path_rate": 0.0}


@pytest.mark.parametrize("name", ["mamba_vision_T", "gka_vision_T", "echo_vision_T"])
def test_global_mixer_equals_windowed_when_one_window_covers_the_map(name, reference_path):
    import visionssm.models.echo_vision  # noqa: F401

    windowed = timm.create_model(name, **_ONE_WINDOW)
    whole = timm.create_model(name, global_mixer=True, **_ONE_WINDOW)
    whole.load_state_dict(windowed.state_dict())
    x = torch.randn(2, 3, 64, 64)
    for model in (windowed, whole):
        model(x).square().sum().backward()
    torch.testing.assert_close(whole(x), windowed(x), rtol=0, atol=0)
    grads = dict(whole.named_parameters())
    for n, p in windowed.named_parameters():
        torch.testing.assert_close(grads[n].grad, p.grad, rtol=0, atol=0, msg=n)
    # where the map is larger than a window the two differ: the option changes what the mixers see
    with torch.no_grad():
        big = torch.randn(1, 3, 128, 128)
        assert relative_error(whole(big), windowed(big)) > 1e-3


@pytest.mark.parametrize("name,global_blocks", [("gka_vision_T", 1), ("echo_vision_T", 2)])
def test_global_mixer_blocks_see_the_whole_map_and_attention_keeps_windows(name, global_blocks, reference_path):
    import visionssm.models.echo_vision  # noqa: F401

    model = timm.create_model(name, global_mixer=True, **_ONE_WINDOW).eval()
    stage = model.stages[2]
    lengths = []
    hooks = [b.mixer.register_forward_pre_hook(lambda m, args: lengths.append(tuple(args[0].shape[:2])))
             for b in stage.blocks]
    with torch.no_grad():
        model(torch.randn(1, 3, 160, 96))  # stride-16 map 10x6: windows of 4 pad it to 12x8, six windows
    for h in hooks:
        h.remove()
    assert lengths[:global_blocks] == [(1, 60)] * global_blocks  # the whole map, unpadded
    assert lengths[global_blocks:] == [(6, 16)] * (2 - global_blocks)  # attention: its windows
    assert "global_mixer=True" in repr(stage)
    with pytest.raises(TypeError, match="global_mixer"):
        timm.create_model("gka_vision_T", global_mixer="yes", device="meta")
