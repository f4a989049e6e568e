"""MambaVision: a hybrid Mamba-Transformer vision backbone, weight-compatible with NVIDIA's release.

Paper: "MambaVision: A Hybrid Mamba-Transformer Vision Backbone", Ali Hatamizadeh and Jan Kautz, CVPR 2025,
https://arxiv.org/abs/2407.08083

    @inproceedings{hatamizadeh2025mambavision,
      title={MambaVision: A Hybrid Mamba-Transformer Vision Backbone},
      author={Hatamizadeh, Ali and Kautz, Jan},
      booktitle={CVPR}, year={2025}
    }

A clean re-implementation of the architecture of https://github.com/NVlabs/MambaVision (no code taken from it:
that code is under the NVIDIA Source Code License-NC). NVIDIA's released weights are CC-BY-NC-SA-4.0
(non-commercial); ``checkpoint_filter_fn`` / ``MambaVision.load_pretrained`` read them unchanged, and
``pretrained=True`` downloads them from the URLs in ``default_cfgs``.

Architecture (four stages of widths dim * 2**i): a two-conv stem (stride 4), two stages of residual conv blocks,
then two stages whose first ceil(depth / 2) blocks use a sequence mixer (MambaVision's selective-scan mixer by
default) and whose remaining blocks use self-attention; those stages run on non-overlapping windows (zero padded
to a multiple of the window, unmasked, as the official code does), so any input resolution works; with
``global_mixer=True`` their linear-cost mixer blocks see the whole feature map instead (the attention blocks keep
the windows). A BatchNorm, global average pooling and a linear classifier follow.

Differences from the official code, none of which changes the function computed:
- timm's module names (``stem``, ``stages.{i}.downsample`` at the *start* of stage i, ``ls1.gamma``, ``head.fc``);
  ``checkpoint_filter_fn`` maps the official names (``patch_embed.conv_down``, ``levels.{i}.downsample`` at the end
  of level i, ``gamma_1``, ``head``).
- ``forward_features`` returns the normalised, unpooled map (timm convention); pooling lives in the head.
- Both halves of a windowed stage can host any mixer of ``visionssm.layers.MIXERS``: ``mixer=`` (scanned causally or
  not, ``mixer_causal=``) and ``attn_mixer=``. ``gka_vision_*`` and ``echo_vision_*`` are presets of this class.

The building blocks (stem, conv and token blocks, windowing, the stage) are in ``_mamba_vision_blocks.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import ClassifierHead, trunc_normal_
from timm.models import adapt_input_conv, build_model_with_cfg, generate_default_cfgs, register_model
from timm.models._features import feature_take_indices

from visionssm.layers import SequenceMixer, mixer_no_weight_decay
from visionssm.utils.checkpoint import read_state_dict

from ._mamba_vision_blocks import MambaVisionStage, Stem, _timm_dd

__all__ = ["MambaVision"]


class MambaVision(nn.Module):
    """MambaVision (and any-mixer variants of its macro-architecture).

    Args:
        in_chans: Input image channels.
        num_classes: Classifier outputs (0 for no classifier).
        global_pool: Head pooling type (``'avg'``, ``''`` for none, ...).
        depths: Blocks per stage.
        dims: Stage widths (an int d means (d, 2d, 4d, 8d)).
        stem_dim: Width of the stem's first conv.
        num_heads: Attention heads per stage (used in token stages).
        window_size: Window side per stage (used in token stages; inputs are padded to a multiple of it).
        mlp_ratio: MLP hidden width over block width.
        qkv_bias: Bias in the attention's qkv projection.
        layer_scale: LayerScale init in token blocks (``None``: no layer scale).
        layer_scale_conv: LayerScale init in conv blocks (``None``: no layer scale).
        num_conv_stages: How many leading stages are conv stages (2 in MambaVision).
        mixer: Sequence mixer of the token blocks' first half: a name from ``visionssm.layers.MIXERS`` or a class
            following the mixer contract (``visionssm.layers.base``).
        mixer_causal: ``causal=`` given to every first-half mixer.
        mixer_kwargs: Extra constructor kwargs for every first-half mixer.
        attn_mixer: Mixer of the token blocks' second half (``'attention'`` in MambaVision; e.g. ``'ska'`` for the
            Echo-style hybrids). It is offered the stage's ``num_heads`` and the attention options (``qkv_bias``,
            dropouts) where its constructor takes them.
        attn_mixer_causal: ``causal=`` given to every second-half mixer (``False`` in MambaVision).
        attn_mixer_kwargs: Extra constructor kwargs for every second-half mixer.
        drop_rate: Dropout before the classifier.
        proj_drop_rate: Dropout after attention/MLP projections.
        attn_drop_rate: Attention dropout.
        drop_path_rate: Stochastic depth, rising linearly over all blocks from 0.
        global_mixer: Token-stage blocks whose mixer is linear in the sequence length (the scan, GKA, Comba, SKA:
            ``linear_in_length``) run over the whole feature map, row-major, instead of ``window_size`` windows, at
            any resolution; attention blocks keep their windows. Same parameters, so checkpoints load either way;
            where one window covers a stage's map exactly (224² for the presets) the function is the same.
        device, dtype: Factory kwargs.
    """

    def __init__(
            self,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = "avg",
            depths: Sequence[int] = (1, 3, 8, 4),
            dims: int | Sequence[int] = 80,
            stem_dim: int = 32,
            num_heads: Sequence[int] = (2, 4, 8, 16),
            window_size: Sequence[int] = (8, 8, 14, 7),
            mlp_ratio: float = 4.0,
            qkv_bias: bool = True,
            layer_scale: float | None = None,
            layer_scale_conv: float | None = None,
            num_conv_stages: int = 2,
            mixer: str | Callable[..., nn.Module] = "mamba",
            mixer_causal: bool = True,
            mixer_kwargs: dict | None = None,
            attn_mixer: str | Callable[..., nn.Module] = "attention",
            attn_mixer_causal: bool = False,
            attn_mixer_kwargs: dict | None = None,
            drop_rate: float = 0.0,
            proj_drop_rate: float = 0.0,
            attn_drop_rate: float = 0.0,
            drop_path_rate: float = 0.2,
            global_mixer: bool = False,
            device=None,
            dtype=None,
            **kwargs,
    ):
        super().__init__()
        # Official entrypoints swallow `resolution`/`img_size`; accept and ignore them so their configs load.
        kwargs.pop("resolution", None)
        kwargs.pop("img_size", None)
        if kwargs:
            raise TypeError(f"MambaVision got unexpected keyword arguments: {sorted(kwargs)}")
        dd = {"device": device, "dtype": dtype}
        num_stages = len(depths)
        if isinstance(dims, int):
            dims = tuple(dims * 2 ** i for i in range(num_stages))
        dims = tuple(dims)
        for name, value in (("dims", dims), ("num_heads", num_heads), ("window_size", window_size)):
            if len(value) != num_stages:
                raise ValueError(f"{name} must have one entry per stage ({num_stages}), got {tuple(value)}")
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.drop_rate = drop_rate
        self.mixer_name = mixer if isinstance(mixer, str) else getattr(mixer, "__name__", str(mixer))
        self.mixer_causal = mixer_causal
        self.global_mixer = global_mixer
        self.attn_mixer_name = attn_mixer if isinstance(attn_mixer, str) else getattr(attn_mixer, "__name__",
                                                                                      str(attn_mixer))

        self.stem = Stem(in_chans, stem_dim, dims[0], **dd)
        total = sum(depths)
        dpr = [drop_path_rate * i / (total - 1) if total > 1 else 0.0 for i in range(total)]
        stages = []
        self.feature_info = []
        prev_dim = dims[0]
        shared = {"mixer": mixer, "mixer_causal": mixer_causal, "mixer_kwargs": mixer_kwargs, "attn_mixer": attn_mixer,
                  "attn_mixer_causal": attn_mixer_causal, "attn_mixer_kwargs": attn_mixer_kwargs,
                  "mlp_ratio": mlp_ratio, "qkv_bias": qkv_bias, "proj_drop": proj_drop_rate,
                  "attn_drop": attn_drop_rate, "layer_scale": layer_scale, "layer_scale_conv": layer_scale_conv,
                  "global_mixer": global_mixer, **dd}
        for i in range(num_stages):
            stages.append(MambaVisionStage(
                prev_dim, dims[i], depths[i], conv=i < num_conv_stages, downsample=i > 0, num_heads=num_heads[i],
                window_size=window_size[i], drop_path=dpr[sum(depths[:i]):sum(depths[:i + 1])], **shared))
            prev_dim = dims[i]
            self.feature_info.append({"num_chs": dims[i], "reduction": 4 * 2 ** i, "module": f"stages.{i}"})
        self.stages = nn.Sequential(*stages)
        self.num_features = self.head_hidden_size = dims[-1]
        self.norm = nn.BatchNorm2d(self.num_features, **dd)
        self.head = ClassifierHead(self.num_features, num_classes, pool_type=global_pool, drop_rate=drop_rate,
                                   **_timm_dd(device, dtype))
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        # The official model-wide init: trunc-normal(0.02) Linear weights, zero biases, unit norms. Sequence mixers
        # own their init (MambaVisionMixer and SelfAttention reproduce what the official init leaves in them), so they
        # are skipped.
        skip = set()
        for module in self.modules():
            if isinstance(module, SequenceMixer):
                skip.update(id(m) for m in module.modules())
        for module in self.modules():
            if id(module) in skip:
                continue
            if isinstance(module, nn.Linear):
                trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.LayerNorm, nn.BatchNorm2d)):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        # Names or fnmatch patterns over full parameter names (timm's optimizer factory): every mixer's own list (the
        # SSM's A_log is 2-D, so 1-D-only rules would miss it) and the layer-scale gammas.
        return {"*.gamma"} | mixer_no_weight_decay(self)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict:
        return {
            "stem": r"^stem",
            "blocks": r"^stages\.(\d+)" if coarse else [
                (r"^stages\.(\d+)\.downsample", (0,)),
                (r"^stages\.(\d+)\.blocks\.(\d+)", None),
                (r"^norm", (99999,)),
            ],
        }

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        for stage in self.stages:
            stage.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head.fc

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        self.num_classes = num_classes
        self.head.reset(num_classes, global_pool)

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: int | list[int] | None = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = "NCHW",
            intermediates_only: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """Forward returning the stage outputs (stride 4, 8, 16, 32; before the next downsample).

        Args:
            x: Input images (B, C, H, W).
            indices: Take the last n stages if an int, all if None, the listed stages if a sequence.
            norm: Apply the final BatchNorm to the last stage's output when it is taken.
            stop_early: Stop after the last stage needed.
            output_fmt: Only 'NCHW'.
            intermediates_only: Return only the intermediates.
        Returns:
            The intermediates, or (final features, intermediates).
        """
        if output_fmt != "NCHW":
            raise ValueError(f"output_fmt must be 'NCHW', got {output_fmt!r}")
        intermediates = []
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        last_idx = len(self.stages) - 1
        x = self.stem(x)
        if torch.jit.is_scripting() or not stop_early:
            stages = self.stages
        else:
            stages = self.stages[:max_index + 1]
        feat_idx = 0
        for feat_idx, stage in enumerate(stages):
            x = stage(x)
            if feat_idx in take_indices:
                intermediates.append(self.norm(x) if norm and feat_idx == last_idx else x)
        if intermediates_only:
            return intermediates
        if feat_idx == last_idx:
            x = self.norm(x)
        return x, intermediates

    def prune_intermediate_layers(
            self,
            indices: int | list[int] = 1,
            prune_norm: bool = False,
            prune_head: bool = True,
    ) -> list[int]:
        """Drop the stages (and norm/head) not needed for ``indices``; returns the kept indices."""
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        prune_end = max_index < len(self.stages) - 1
        if prune_norm or prune_end:
            self.norm = nn.Identity()  # the final norm is sized for, and only applied to, the last stage
        self.stages = self.stages[:max_index + 1]
        if prune_end:
            self.num_features = self.head_hidden_size = self.feature_info[max_index]["num_chs"]
        if prune_head or prune_end:
            self.reset_classifier(0, "")
        return take_indices

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.stages(x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return self.head(x, pre_logits=True) if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    @torch.jit.ignore
    def load_pretrained(self, checkpoint_path: str, strict: bool = True) -> None:
        """Load an official MambaVision checkpoint (``.pth.tar`` with ``{'state_dict': ...}``, official key names)
        or a visionssm/timm one (``.pth``/``.safetensors``). Takes the checkpoint's ``state_dict`` (the weights the
        official loader uses) rather than an EMA copy. Adapts the stem to ``in_chans`` and drops the classifier when
        ``num_classes`` differs. timm calls this for ``pretrained=True`` (``custom_load`` cfgs) and for
        ``pretrained_cfg_overlay=dict(file=PATH)``."""
        state_dict = checkpoint_filter_fn(read_state_dict(checkpoint_path), self)
        own = self.state_dict()
        first_conv = "stem.conv1.weight"
        if first_conv in state_dict and state_dict[first_conv].shape != own[first_conv].shape:
            in_chans = own[first_conv].shape[1]
            state_dict[first_conv] = adapt_input_conv(in_chans, state_dict[first_conv])
        for key in ("head.fc.weight", "head.fc.bias"):
            if key in state_dict and (key not in own or own[key].shape != state_dict[key].shape):
                del state_dict[key]
        missing, unexpected = self.load_state_dict(state_dict, strict=False)
        missing = [k for k in missing if not k.startswith("head.fc.")]
        if strict and (missing or unexpected):
            raise RuntimeError(f"checkpoint {checkpoint_path} does not match the model: missing {missing}, "
                               f"unexpected {unexpected}")


_OFFICIAL_RENAMES = (
    (r"^patch_embed\.conv_down\.0\.", "stem.conv1."),
    (r"^patch_embed\.conv_down\.1\.", "stem.norm1."),
    (r"^patch_embed\.conv_down\.3\.", "stem.conv2."),
    (r"^patch_embed\.conv_down\.4\.", "stem.norm2."),
    (r"^levels\.(\d+)\.blocks\.(\d+)\.gamma_1$", r"stages.\1.blocks.\2.ls1.gamma"),
    (r"^levels\.(\d+)\.blocks\.(\d+)\.gamma_2$", r"stages.\1.blocks.\2.ls2.gamma"),
    (r"^levels\.(\d+)\.blocks\.(\d+)\.gamma$", r"stages.\1.blocks.\2.ls.gamma"),
    (r"^levels\.(\d+)\.blocks\.", r"stages.\1.blocks."),
    (r"^head\.", "head.fc."),
)


def checkpoint_filter_fn(state_dict: dict, model: nn.Module) -> dict:
    """Convert an official NVlabs/MambaVision checkpoint to this model's key names.

    Accepts the whole checkpoint (``{'state_dict': ...}`` or ``{'model': ...}``) or a bare state dict, with the
    ``module.`` (DDP) / ``encoder.`` / ``model.`` (Hugging Face wrapper) prefixes the official loader strips. The
    official downsample at the end of level i becomes the downsample at the start of stage i + 1. A state dict
    already in this model's format is returned unchanged.
    """
    for key in ("state_dict", "model"):
        if isinstance(state_dict.get(key), dict):
            state_dict = state_dict[key]
            break
    if "stem.conv1.weight" in state_dict:
        return state_dict
    for prefix in ("module.", "encoder.", "model."):
        if state_dict and all(k.startswith(prefix) for k in state_dict):
            state_dict = {k[len(prefix):]: v for k, v in state_dict.items()}
    out = {}
    for key, value in state_dict.items():
        if key.startswith("patch_embed.proj"):
            continue  # an Identity in the official model; nothing to load
        match = re.match(r"^levels\.(\d+)\.downsample\.reduction\.0\.weight$", key)
        if match:
            out[f"stages.{int(match.group(1)) + 1}.downsample.conv.weight"] = value
            continue
        for pattern, repl in _OFFICIAL_RENAMES:
            new_key, n = re.subn(pattern, repl, key)
            if n:
                key = new_key
                break
        out[key] = value
    return out


def _cfg(url: str = "", **kwargs) -> dict:
    return {
        "url": url,
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": (7, 7),
        "crop_pct": 1.0,
        "crop_mode": "center",
        "interpolation": "bicubic",
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "stem.conv1",
        "classifier": "head.fc",
        "paper_ids": "arXiv:2407.08083",
        "paper_name": "MambaVision: A Hybrid Mamba-Transformer Vision Backbone",
        **kwargs,
    }


def _nv_cfg(repo: str, filename: str, **kwargs) -> dict:
    # NVIDIA's own files (official key names, {'state_dict': ...}); loaded by MambaVision.load_pretrained.
    return _cfg(
        url=f"https://huggingface.co/nvidia/{repo}/resolve/main/{filename}",
        custom_load=True,
        license="cc-by-nc-sa-4.0",
        origin_url=f"https://huggingface.co/nvidia/{repo}",
        **kwargs,
    )


default_cfgs = generate_default_cfgs({
    "mamba_vision_T.nv_in1k": _nv_cfg("MambaVision-T-1K", "mambavision_tiny_1k.pth.tar", crop_pct=1.0),
    "mamba_vision_T2.nv_in1k": _nv_cfg("MambaVision-T2-1K", "mambavision_tiny2_1k.pth.tar", crop_pct=0.98),
    "mamba_vision_S.nv_in1k": _nv_cfg("MambaVision-S-1K", "mambavision_small_1k.pth.tar", crop_pct=0.93),
    "mamba_vision_B.nv_in1k": _nv_cfg("MambaVision-B-1K", "mambavision_base_1k.pth.tar", crop_pct=1.0),
    "mamba_vision_B.nv_in21k_ft_in1k": _nv_cfg("MambaVision-B-21K", "mambavision_base_21k.pth.tar", crop_pct=1.0),
    "mamba_vision_L.nv_in1k": _nv_cfg("MambaVision-L-1K", "mambavision_large_1k.pth.tar", crop_pct=1.0),
    "mamba_vision_L.nv_in21k_ft_in1k": _nv_cfg("MambaVision-L-21K", "mambavision_large_21k.pth.tar", crop_pct=1.0),
    "mamba_vision_L2.nv_in1k": _nv_cfg("MambaVision-L2-1K", "mambavision_large2_1k.pth.tar", crop_pct=1.0),
    "mamba_vision_L2_512.nv_in21k_ft_in1k": _nv_cfg(
        "MambaVision-L2-512-21K", "mambavision_L2_21k_240m_512.pth.tar",
        input_size=(3, 512, 512), pool_size=(16, 16), crop_pct=0.93, crop_mode="squash"),
    "mamba_vision_L3_256.nv_in21k_ft_in1k": _nv_cfg(
        "MambaVision-L3-256-21K", "mambavision_L3_21k_740m_256.pth.tar",
        input_size=(3, 256, 256), pool_size=(8, 8), crop_pct=1.0),
    "mamba_vision_L3_512.nv_in21k_ft_in1k": _nv_cfg(
        "MambaVision-L3-512-21K", "mambavision_L3_21k_740m_512.pth.tar",
        input_size=(3, 512, 512), pool_size=(16, 16), crop_pct=0.93, crop_mode="squash"),
})


# Size presets of the macro-architecture, shared by gka_vision (the same backbone with another mixer).
MAMBA_VISION_ARCHS = {
    "T": {"depths": (1, 3, 8, 4), "dims": 80, "stem_dim": 32, "num_heads": (2, 4, 8, 16),
          "window_size": (8, 8, 14, 7), "drop_path_rate": 0.2},
    "T2": {"depths": (1, 3, 11, 4), "dims": 80, "stem_dim": 32, "num_heads": (2, 4, 8, 16),
           "window_size": (8, 8, 14, 7), "drop_path_rate": 0.2},
    "S": {"depths": (3, 3, 7, 5), "dims": 96, "stem_dim": 64, "num_heads": (2, 4, 8, 16),
          "window_size": (8, 8, 14, 7), "drop_path_rate": 0.2},
    "B": {"depths": (3, 3, 10, 5), "dims": 128, "stem_dim": 64, "num_heads": (2, 4, 8, 16),
          "window_size": (8, 8, 14, 7), "drop_path_rate": 0.3, "layer_scale": 1e-5},
    "L": {"depths": (3, 3, 10, 5), "dims": 196, "stem_dim": 64, "num_heads": (4, 8, 16, 32),
          "window_size": (8, 8, 14, 7), "drop_path_rate": 0.3, "layer_scale": 1e-5},
    "L2": {"depths": (3, 3, 12, 5), "dims": 196, "stem_dim": 64, "num_heads": (4, 8, 16, 32),
           "window_size": (8, 8, 14, 7), "drop_path_rate": 0.3, "layer_scale": 1e-5},
    "L2_512": {"depths": (3, 3, 12, 5), "dims": 196, "stem_dim": 64, "num_heads": (4, 8, 16, 32),
               "window_size": (8, 8, 32, 16), "drop_path_rate": 0.3, "layer_scale": 1e-5},
    "L3_256": {"depths": (3, 3, 20, 10), "dims": 256, "stem_dim": 64, "num_heads": (4, 8, 16, 32),
               "window_size": (8, 8, 16, 8), "drop_path_rate": 0.5, "layer_scale": 1e-5},
    "L3_512": {"depths": (3, 3, 20, 10), "dims": 256, "stem_dim": 64, "num_heads": (4, 8, 16, 32),
               "window_size": (8, 8, 32, 16), "drop_path_rate": 0.5, "layer_scale": 1e-5},
}


def _create_mamba_vision(variant: str, pretrained: bool = False, **kwargs) -> MambaVision:
    return build_model_with_cfg(
        MambaVision,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg={"out_indices": (0, 1, 2, 3), "flatten_sequential": True},
        **kwargs,
    )


@register_model
def mamba_vision_T(pretrained: bool = False, **kwargs) -> MambaVision:
    return _create_mamba_vision("mamba_vision_T", pretrained, **dict(MAMBA_VISION_ARCHS["T"], **kwargs))


@register_model
def mamba_vision_T2(pretrained: bool = False, **kwargs) -> MambaVision:
    return _create_mamba_vision("mamba_vision_T2", pretrained, **dict(MAMBA_VISION_ARCHS["T2"], **kwargs))


@register_model
def mamba_vision_S(pretrained: bool = False, **kwargs) -> MambaVision:
    return _create_mamba_vision("mamba_vision_S", pretrained, **dict(MAMBA_VISION_ARCHS["S"], **kwargs))


@register_model
def mamba_vision_B(pretrained: bool = False, **kwargs) -> MambaVision:
    return _create_mamba_vision("mamba_vision_B", pretrained, **dict(MAMBA_VISION_ARCHS["B"], **kwargs))


@register_model
def mamba_vision_L(pretrained: bool = False, **kwargs) -> MambaVision:
    return _create_mamba_vision("mamba_vision_L", pretrained, **dict(MAMBA_VISION_ARCHS["L"], **kwargs))


@register_model
def mamba_vision_L2(pretrained: bool = False, **kwargs) -> MambaVision:
    return _create_mamba_vision("mamba_vision_L2", pretrained, **dict(MAMBA_VISION_ARCHS["L2"], **kwargs))


# ImageNet-21K-pretrained releases at higher resolution: windows sized so stages 3/4 stay global at that resolution.
@register_model
def mamba_vision_L2_512(pretrained: bool = False, **kwargs) -> MambaVision:
    return _create_mamba_vision("mamba_vision_L2_512", pretrained, **dict(MAMBA_VISION_ARCHS["L2_512"], **kwargs))


@register_model
def mamba_vision_L3_256(pretrained: bool = False, **kwargs) -> MambaVision:
    return _create_mamba_vision("mamba_vision_L3_256", pretrained, **dict(MAMBA_VISION_ARCHS["L3_256"], **kwargs))


@register_model
def mamba_vision_L3_512(pretrained: bool = False, **kwargs) -> MambaVision:
    return _create_mamba_vision("mamba_vision_L3_512", pretrained, **dict(MAMBA_VISION_ARCHS["L3_512"], **kwargs))
