"""CombaVision: isotropic (DeiT-shaped) backbones with the Comba mixer in place of self-attention.

Paper: Hu et al., "Comba: Improving Bilinear RNNs with Closed-loop Control", arXiv 2506.02475 (NeurIPS 2025),
§4.3 and Table 9 (Comba-T 5.8 M parameters / 1.1 GFLOPs, Comba-S 22.6 M / 4.4 GFLOPs at 224², ImageNet-1k).

    @inproceedings{hu2025comba,
      title={Comba: Improving Bilinear RNNs with Closed-loop Control},
      author={Hu, Jiaxi and Pan, Yongqi and Du, Jusen and Lan, Disen and Tang, Xiaqiang and Wen, Qingsong and
              Liang, Yuxuan and Sun, Weigao},
      booktitle={Advances in Neural Information Processing Systems},
      year={2025}}

No vision code or weights of the authors are public, so the macro
architecture follows the paper's statement "DeiT-T/S proportions" and the vision linear-mixer practice it compares
with (ViG, Vim): 16×16 patches, 12 blocks of width 192 / 384 with 3 / 6 heads (head dim 64), MLP ratio 4,
pre-norm residual blocks, a learned absolute position embedding, no class token and global average pooling over the
tokens. Tokens are scanned in row-major order (h, then w); the mixer is non-causal by default (forward plus
reversed-time recurrence, see :class:`visionssm.layers.comba.CombaMixer`), ``mixer_causal=True`` gives the
one-directional variant.

Parameter counts (this file): comba_vision_T 5,819,320 (Table 9: 5.8 M, +0.3 %), comba_vision_S 22,428,808
(22.6 M, −0.8 %). GFLOPs at 224², batch 1, counted as multiply-accumulates (the fvcore convention of the paper's
table): 1.09 / 4.30 for every Linear and Conv layer (what fvcore-style counters see; Table 9: 1.1 / 4.4), plus
0.17 / 0.35 for the Comba recurrence itself counted in its recurrent form (3·K·V multiply-adds per token, head and
scan direction; two directions when non-causal, half that when causal), i.e. 1.26 / 4.64 in all. The counter is in
tests/test_comba_vision.py.

Hooks for trackers (one-stream, OSTrack-style): ``embed(img) -> (tokens (B, L, C), grid (H, W))``, which is
``patch_embed`` (NHWC output; sides that are not multiples of the patch size are zero-padded) followed by
``_pos_embed(x_nhwc)`` (adds the position embedding resampled to that image's grid, flattens to (B, L, C));
``blocks`` (each (B, L, C) -> (B, L, C), any L); ``norm``. Embed template and search images separately,
concatenate the token sequences, run the blocks, apply ``norm``.
"""

from __future__ import annotations

import re
from functools import partial

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import (
    DropPath,
    LayerScale,
    Mlp,
    PatchEmbed,
    register_notrace_function,
    resample_abs_pos_embed,
    trunc_normal_,
)
from timm.models import build_model_with_cfg, checkpoint_seq, generate_default_cfgs, register_model
from timm.models._features import feature_take_indices
from timm.models._manipulate import checkpoint
from torch import nn

from visionssm.kernels.dispatch import fx_tracing
from visionssm.layers import SequenceMixer, build_mixer, mixer_no_weight_decay
from visionssm.layers.common import LayerNorm, add_and_norm, is_hooked

__all__ = ["CombaBlock", "CombaVision", "blocks_then_norm", "can_chain"]


@register_notrace_function  # shape-dependent branch: FX keeps it as one call
def add_pos_embed(x: torch.Tensor, pos_embed: torch.Tensor, grid_size: tuple[int, int]) -> torch.Tensor:
    """Flatten (B, H, W, C) patch embeddings to (B, H·W, C) and add ``pos_embed`` (1, grid_size[0]·grid_size[1], C),
    bicubically resampled to the (H, W) grid when that differs from ``grid_size``."""
    B, H, W, C = x.shape
    if (grid_size[0], grid_size[1]) != (H, W):
        pos_embed = resample_abs_pos_embed(pos_embed, new_size=(H, W), old_size=grid_size, num_prefix_tokens=0)
    return x.reshape(B, H * W, C) + pos_embed


class CombaBlock(nn.Module):
    """Pre-norm residual block: ``x + DropPath(LS(mixer(LN(x))))``, then ``x + DropPath(LS(MLP(LN(x))))``."""

    def __init__(self, dim: int, *, num_heads: int, mlp_ratio: float = 4.0, mixer="comba", mixer_causal: bool = False,
                 mixer_kwargs: dict | None = None, proj_drop: float = 0.0, drop_path: float = 0.0,
                 init_values: float | None = None, norm_layer=None, act_layer=None, device=None,
                 dtype=None) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        norm_layer = norm_layer or partial(LayerNorm, eps=1e-6)
        act_layer = act_layer or nn.GELU
        self.norm1 = norm_layer(dim, **dd)
        self.mixer = build_mixer(mixer, dim, causal=mixer_causal, kwargs=mixer_kwargs, offered={"num_heads": num_heads},
                                 **dd)
        self.ls1 = LayerScale(dim, init_values, **dd) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = norm_layer(dim, **dd)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop, **dd)
        self.ls2 = LayerScale(dim, init_values, **dd) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        # Each norm feeds a linear projection first (the MLP's, and the mixer's where it says so): under autocast it
        # writes its result in autocast's dtype, which that projection would cast it to (comba_vision_T: 24 casts of
        # (B·197, 192) float32 activations per forward fewer, and in training their backward casts)
        for norm, feeds_linear in ((self.norm1, getattr(self.mixer, "linear_input", False)), (self.norm2, True)):
            if isinstance(norm, LayerNorm) and feeds_linear:
                norm.autocast_output = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, branch = self.forward_split(x)
        return x + branch

    def forward_split(self, x: torch.Tensor, branch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block applied to ``x + branch`` (``x`` when ``branch`` is None), returned as ``(x', branch')`` whose sum
        is the block's output. Each residual add is done inside the norm after it (:func:`add_and_norm`: one pass over
        the residual stream fewer each way), so a backbone chaining its blocks this way leaves no add of its own."""
        if branch is None:
            h = self.norm1(x)
        else:
            h, x = add_and_norm(self.norm1, branch, x)
        h, x = add_and_norm(self.norm2, self.drop_path1(self.ls1(self.mixer(h))), x)
        return x, self.drop_path2(self.ls2(self.mlp(h)))


def can_chain(blocks: nn.Module) -> bool:
    """Whether ``blocks`` may run chained (each residual add inside the next norm, the last inside the final norm):
    every one an unhooked :class:`CombaBlock` (a hook must see the block's call) and no FX tracing (which keeps each
    block as one call)."""
    return not fx_tracing() and all(type(b) is CombaBlock and not is_hooked(b) for b in blocks)


def blocks_then_norm(blocks: nn.Module, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(blocks(x))``; chained (:meth:`CombaBlock.forward_split`) where :func:`can_chain` allows, so that no
    residual add runs on its own."""
    if not can_chain(blocks):
        return norm(blocks(x))
    branch = None
    for block in blocks:
        x, branch = block.forward_split(x, branch)
    return norm(x) if branch is None else add_and_norm(norm, branch, x)[0]


class CombaVision(nn.Module):
    """Isotropic Comba backbone: patch embedding + position embedding, ``depth`` Comba blocks, LayerNorm,
    global average pooling, linear classifier.

    Args:
        img_size: training resolution; sets the position-embedding grid (other resolutions resample it).
        patch_size: patch size of the stride-``patch_size`` convolutional embedding.
        in_chans: input channels.
        num_classes: classifier outputs (0: no classifier).
        global_pool: ``'avg'`` (mean over tokens) or ``''`` (no pooling: the head sees every token).
        embed_dim: width of every block.
        depth: number of blocks.
        num_heads: mixer heads per block (offered to mixers whose constructor takes ``num_heads``).
        mlp_ratio: MLP hidden width relative to ``embed_dim``.
        mixer: the token mixer of every block, a name from ``visionssm.layers.MIXERS`` or a mixer class
            (default ``'comba'``).
        mixer_causal: ``False`` (default) for the bidirectional mixer, ``True`` for the causal one.
        mixer_kwargs: further keyword arguments of the mixer (e.g. :class:`~visionssm.layers.comba.CombaMixer`'s).
        transition: Comba's state transition, ``'splr'`` (the paper's Comba) or ``'iplr'`` (Comba-iplr, the paper's
            best tracker), given to the mixer (``None``: the mixer's default, splr). It has no parameters of its own,
            so checkpoints load into either.
        recompute_state: given to the mixer (:class:`~visionssm.layers.comba.CombaMixer`; ``None``: its default,
            off): in training each mixer keeps only its input projection and runs its recurrence's forward again in
            the backward, instead of keeping the recurrence's chunk states (high resolution: less memory, one more
            kernel forward per block and step). No parameters of its own.
        fused_norm: ``True``: the blocks' and the final LayerNorm on visionssm's Triton kernels
            (:class:`visionssm.layers.common.LayerNorm`: a third of PyTorch's GPU time forward+backward at these
            widths, the residual adds inside them); ``False``: ``nn.LayerNorm`` and plain adds. Same parameters
            either way; under ``torch.compile`` both are the same graph. Ignored when ``norm_layer`` is given.
        init_values: LayerScale initial value (``None``: no LayerScale).
        drop_rate: dropout before the classifier.
        pos_drop_rate: dropout after the position embedding.
        proj_drop_rate: dropout inside the MLPs.
        drop_path_rate: stochastic-depth rate of the last block (linear from 0).
    """

    def __init__(self, img_size: int | tuple[int, int] = 224, patch_size: int = 16, in_chans: int = 3,
                 num_classes: int = 1000, global_pool: str = "avg", embed_dim: int = 192, depth: int = 12,
                 num_heads: int = 3, mlp_ratio: float = 4.0, mixer="comba", mixer_causal: bool = False,
                 mixer_kwargs: dict | None = None, transition: str | None = None,
                 recompute_state: bool | None = None, fused_norm: bool = True,
                 init_values: float | None = None, drop_rate: float = 0.0,
                 pos_drop_rate: float = 0.0, proj_drop_rate: float = 0.0, drop_path_rate: float = 0.0,
                 norm_layer=None, act_layer=None, device=None, dtype=None) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        if global_pool not in ("", "avg"):
            raise ValueError(f"global_pool must be 'avg' or '', got {global_pool!r}")
        if not isinstance(mixer_causal, bool):
            raise TypeError(f"mixer_causal must be a bool, got {type(mixer_causal).__name__}")
        if not isinstance(fused_norm, bool):
            raise TypeError(f"fused_norm must be a bool, got {type(fused_norm).__name__}")
        if norm_layer is None:
            norm_layer = partial(LayerNorm if fused_norm else nn.LayerNorm, eps=1e-6)
        if transition is not None:
            mixer_kwargs = {**(mixer_kwargs or {}), "transition": transition}
        if recompute_state is not None:
            mixer_kwargs = {**(mixer_kwargs or {}), "recompute_state": recompute_state}
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_prefix_tokens = 0
        self.mixer_causal = mixer_causal
        self.grad_checkpointing = False

        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=in_chans,
                                      embed_dim=embed_dim, output_fmt="NHWC", strict_img_size=False,
                                      dynamic_img_pad=True, **dd)
        self.pos_embed = nn.Parameter(torch.empty(1, self.patch_embed.num_patches, embed_dim, **dd))
        self.pos_drop = nn.Dropout(pos_drop_rate)
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]
        self.blocks = nn.Sequential(*[
            CombaBlock(embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, mixer=mixer, mixer_causal=mixer_causal,
                       mixer_kwargs=mixer_kwargs, proj_drop=proj_drop_rate, drop_path=dpr[i],
                       init_values=init_values, norm_layer=norm_layer, act_layer=act_layer, **dd)
            for i in range(depth)])
        reduction = self.patch_embed.patch_size[0]
        self.feature_info = [{"module": f"blocks.{i}", "num_chs": embed_dim, "reduction": reduction}
                             for i in range(depth)]
        self.norm = norm_layer(embed_dim, **dd)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes, **dd) if num_classes > 0 else nn.Identity()
        self.init_weights()

    def init_weights(self) -> None:
        trunc_normal_(self.pos_embed, std=0.02)
        self.apply(_init_weights)
        # Mixers own their initialisation (Comba's gates and scalars, and trunc-normal(0.02) Linear layers as
        # everything else): restore it after the model-wide pass.
        for module in self.modules():
            if isinstance(module, SequenceMixer):
                module.reset_parameters()

    # ---- timm contract --------------------------------------------------------------------------------------

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"pos_embed"} | mixer_no_weight_decay(self)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict:
        return {"stem": r"^pos_embed|patch_embed", "blocks": [(r"^blocks\.(\d+)", None), (r"^norm", (99999,))]}

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        self.num_classes = num_classes
        if global_pool is not None:
            if global_pool not in ("", "avg"):
                raise ValueError(f"global_pool must be 'avg' or '', got {global_pool!r}")
            self.global_pool = global_pool
        like = self.pos_embed
        self.head = (nn.Linear(self.embed_dim, num_classes, device=like.device, dtype=like.dtype)
                     if num_classes > 0 else nn.Identity())

    # ---- pieces (also used by trackers) ---------------------------------------------------------------------

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, W, C) patch embeddings -> (B, H·W, C) tokens with the position embedding of that grid."""
        return self.pos_drop(add_pos_embed(x, self.pos_embed, tuple(self.patch_embed.grid_size)))

    def embed(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """Image (B, C_in, H_img, W_img) -> tokens (B, H·W, C) and the token grid (H, W)."""
        x = self.patch_embed(x)
        grid = (x.shape[1], x.shape[2])
        return self._pos_embed(x), grid

    # ---- forward --------------------------------------------------------------------------------------------

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None, norm: bool = False,
                              stop_early: bool = False, output_fmt: str = "NCHW",
                              intermediates_only: bool = False) -> list[torch.Tensor] | tuple[torch.Tensor, list]:
        """Features after selected blocks.

        Args:
            x: images (B, C_in, H_img, W_img).
            indices: the last n blocks if an int, all blocks if None, else the given block indices.
            norm: apply the final norm to every intermediate.
            stop_early: stop after the last requested block.
            output_fmt: ``'NCHW'`` (B, C, H, W) maps at stride ``patch_size`` or ``'NLC'`` token sequences.
            intermediates_only: return only the intermediates.

        Returns:
            ``(final_features, intermediates)``, or the intermediates alone.
        """
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        B = x.shape[0]
        x, (H, W) = self.embed(x)
        blocks = self.blocks if torch.jit.is_scripting() or not stop_early else self.blocks[:max_index + 1]
        intermediates = []
        for i, block in enumerate(blocks):
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(block, x)
            else:
                x = block(x)
            if i in take_indices:
                intermediates.append(self.norm(x) if norm else x)
        if output_fmt == "NCHW":
            intermediates = [y.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates

    def prune_intermediate_layers(self, indices: int | list[int] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> list[int]:
        """Drop the blocks after the last of ``indices`` (and optionally the norm and head); returns the kept
        indices."""
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[:max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take_indices

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images -> normalised tokens (B, L, C) in row-major order, L = ⌈H_img / patch⌉ · ⌈W_img / patch⌉ (images
        whose sides are not multiples of the patch size are zero-padded at the bottom/right)."""
        x, _ = self.embed(x)
        if self.grad_checkpointing and not torch.jit.is_scripting():
            return self.norm(checkpoint_seq(self.blocks, x))
        return blocks_then_norm(self.blocks, self.norm, x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == "avg":
            x = x.mean(dim=1)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


def checkpoint_filter_fn(state_dict: dict, model: CombaVision) -> dict:
    """Accept a CombaVision state dict, bare or wrapped (``{'model': ...}``, ``{'state_dict': ...}``, DDP's
    ``module.`` prefix), and fit its position embedding and patch-embedding kernel to ``model``. No foreign
    checkpoints exist to convert: the Comba authors released no vision weights."""
    from timm.layers import resample_patch_embed

    for key in ("model", "state_dict", "model_ema"):
        if key in state_dict and isinstance(state_dict[key], dict):
            state_dict = state_dict[key]
            break
    out = {}
    for name, value in state_dict.items():
        name = re.sub(r"^module\.", "", name)
        if name == "pos_embed" and value.shape != model.pos_embed.shape:
            value = resample_abs_pos_embed(value, new_size=model.patch_embed.grid_size, num_prefix_tokens=0)
        elif name == "patch_embed.proj.weight" and value.shape[-2:] != model.patch_embed.proj.weight.shape[-2:]:
            value = resample_patch_embed(value, list(model.patch_embed.patch_size))
        out[name] = value
    return out


def _cfg(url: str = "", **kwargs) -> dict:
    return {
        "url": url,
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": None,
        "crop_pct": 0.875,
        "interpolation": "bicubic",
        "fixed_input_size": False,
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "license": "apache-2.0",
        **kwargs,
    }


default_cfgs = generate_default_cfgs({
    "comba_vision_T": _cfg(),
    "comba_vision_S": _cfg(),
    "test_comba_vision": _cfg(input_size=(3, 96, 96), crop_pct=0.95),
})


def _create_comba_vision(variant: str, pretrained: bool = False, **kwargs) -> CombaVision:
    out_indices = kwargs.pop("out_indices", 3)
    return build_model_with_cfg(CombaVision, variant, pretrained, pretrained_filter_fn=checkpoint_filter_fn,
                                feature_cfg={"out_indices": out_indices, "feature_cls": "getter"}, **kwargs)


@register_model
def comba_vision_T(pretrained: bool = False, **kwargs) -> CombaVision:
    """Comba-T: DeiT-T proportions (width 192, 3 heads, 12 blocks), 5.8 M parameters.

    Its norms run the fused kernels in training too: with the residual adds inside the norms and the kernels
    launched directly, the GPU time they save outweighs their Python autograd nodes' host time."""
    model_args = {"patch_size": 16, "embed_dim": 192, "depth": 12, "num_heads": 3, "mlp_ratio": 4.0,
                  "mixer_kwargs": {"gate_rank": 16}}
    return _create_comba_vision("comba_vision_T", pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def comba_vision_S(pretrained: bool = False, **kwargs) -> CombaVision:
    """Comba-S: DeiT-S proportions (width 384, 6 heads, 12 blocks), 22.4 M parameters."""
    model_args = {"patch_size": 16, "embed_dim": 384, "depth": 12, "num_heads": 6, "mlp_ratio": 4.0,
                  "mixer_kwargs": {"gate_rank": 32}}
    return _create_comba_vision("comba_vision_S", pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def test_comba_vision(pretrained: bool = False, **kwargs) -> CombaVision:
    """Tiny CombaVision for CI (width 64, 2 heads of 32, 3 blocks, 96² input)."""
    model_args = {"img_size": 96, "patch_size": 16, "embed_dim": 64, "depth": 3, "num_heads": 2, "mlp_ratio": 2.0,
                  "mixer_kwargs": {"gate_rank": 8}}
    return _create_comba_vision("test_comba_vision", pretrained=pretrained, **dict(model_args, **kwargs))
