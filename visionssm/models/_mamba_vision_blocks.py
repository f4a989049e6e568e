"""MambaVision's building blocks: stem, downsample, conv and token blocks, and the stage that holds them.

They live apart from ``mamba_vision.py`` (the model, its checkpoint conversion and its presets) only to keep each
file readable; the leading underscore keeps this module out of :data:`visionssm.models.FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import DropPath, LayerScale, LayerScale2d, Mlp
from timm.models import checkpoint_seq, register_notrace_function

from visionssm.layers import build_mixer

__all__ = ["Block", "ConvBlock", "Downsample", "MambaVisionStage", "Stem", "tokens_of_map", "tokens_to_map",
           "window_partition", "window_reverse"]


def _timm_dd(device, dtype) -> dict:
    # Factory kwargs for timm layers, passed only when set: older timm layers do not accept device/dtype.
    return {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}


@register_notrace_function
def window_partition(x: torch.Tensor, window_size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B * num_windows, window_size**2, C), zero padding H and W on the bottom/right up to a
    multiple of ``window_size``; windows in row-major order, tokens row-major inside a window (as official)."""
    B, C, H, W = x.shape
    pad_b = (window_size - H % window_size) % window_size
    pad_r = (window_size - W % window_size) % window_size
    if pad_b > 0 or pad_r > 0:
        x = F.pad(x, (0, pad_r, 0, pad_b))
    Hp, Wp = H + pad_b, W + pad_r
    # Through an NHWC view: free for channels_last inputs, one copy either way.
    x = x.permute(0, 2, 3, 1).reshape(B, Hp // window_size, window_size, Wp // window_size, window_size, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window_size * window_size, C)


@register_notrace_function
def window_reverse(windows: torch.Tensor, window_size: int, H: int, W: int) -> torch.Tensor:
    """Inverse of :func:`window_partition`: back to (B, C, H, W) (channels_last strides), dropping the padding."""
    Hp = H + (window_size - H % window_size) % window_size
    Wp = W + (window_size - W % window_size) % window_size
    C = windows.shape[-1]
    B = windows.shape[0] // ((Hp // window_size) * (Wp // window_size))
    x = windows.reshape(B, Hp // window_size, Wp // window_size, window_size, window_size, C)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(B, Hp, Wp, C)
    if Hp != H or Wp != W:
        x = x[:, :H, :W]
    return x.permute(0, 3, 1, 2)


class Stem(nn.Module):
    """Two stride-2 3x3 convs with BatchNorm (eps 1e-4) and ReLU: output stride 4."""

    def __init__(self, in_chans: int, stem_dim: int, dim: int, device=None, dtype=None):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.conv1 = nn.Conv2d(in_chans, stem_dim, 3, stride=2, padding=1, bias=False, **dd)
        self.norm1 = nn.BatchNorm2d(stem_dim, eps=1e-4, **dd)
        self.act1 = nn.ReLU()
        self.conv2 = nn.Conv2d(stem_dim, dim, 3, stride=2, padding=1, bias=False, **dd)
        self.norm2 = nn.BatchNorm2d(dim, eps=1e-4, **dd)
        self.act2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.norm1(self.conv1(x)))
        return self.act2(self.norm2(self.conv2(x)))


class Downsample(nn.Module):
    """A single stride-2 3x3 conv, no norm (as the official model)."""

    def __init__(self, dim: int, dim_out: int, device=None, dtype=None):
        super().__init__()
        self.conv = nn.Conv2d(dim, dim_out, 3, stride=2, padding=1, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class ConvBlock(nn.Module):
    """x + DropPath(ls(BN(conv(GELU_tanh(BN(conv(x)))))))."""

    def __init__(
            self,
            dim: int,
            drop_path: float = 0.0,
            layer_scale: float | None = None,
            device=None,
            dtype=None,
    ):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.conv1 = nn.Conv2d(dim, dim, 3, padding=1, **dd)
        self.norm1 = nn.BatchNorm2d(dim, **dd)
        self.act1 = nn.GELU(approximate="tanh")
        self.conv2 = nn.Conv2d(dim, dim, 3, padding=1, **dd)
        self.norm2 = nn.BatchNorm2d(dim, **dd)
        scale_dd = _timm_dd(device, dtype)
        self.ls = LayerScale2d(dim, layer_scale, **scale_dd) if layer_scale is not None else nn.Identity()
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.act1(self.norm1(self.conv1(x)))
        x = self.norm2(self.conv2(x))
        return shortcut + self.drop_path(self.ls(x))


class Block(nn.Module):
    """Pre-norm residual block on tokens: x + DropPath(ls1(mixer(LN(x)))), x + DropPath(ls2(MLP(LN(x))))."""

    def __init__(
            self,
            dim: int,
            mixer: nn.Module,
            mlp_ratio: float = 4.0,
            proj_drop: float = 0.0,
            drop_path: float = 0.0,
            layer_scale: float | None = None,
            device=None,
            dtype=None,
    ):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        tdd = _timm_dd(device, dtype)
        self.norm1 = nn.LayerNorm(dim, **dd)
        self.mixer = mixer
        self.ls1 = LayerScale(dim, layer_scale, **tdd) if layer_scale is not None else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, **dd)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU, drop=proj_drop, **tdd)
        self.ls2 = LayerScale(dim, layer_scale, **tdd) if layer_scale is not None else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.mixer(self.norm1(x))))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


class MambaVisionStage(nn.Module):
    """Optional downsample, then either conv blocks (``conv=True``) or windowed token blocks: the first
    ceil(depth / 2) with ``mixer`` (MambaVision: the selective scan), the rest with ``attn_mixer`` (MambaVision:
    self-attention). ``global_mixer=True``: the token blocks whose mixer is linear in the sequence length
    (``linear_in_length``) run over the whole feature map, row-major, instead of windows; the others (attention)
    keep the windows."""

    def __init__(
            self,
            dim: int,
            dim_out: int,
            depth: int,
            *,
            conv: bool,
            downsample: bool,
            num_heads: int,
            window_size: int,
            mixer: str | Callable[..., nn.Module] = "mamba",
            mixer_causal: bool = True,
            mixer_kwargs: dict | None = None,
            attn_mixer: str | Callable[..., nn.Module] = "attention",
            attn_mixer_causal: bool = False,
            attn_mixer_kwargs: dict | None = None,
            mlp_ratio: float = 4.0,
            qkv_bias: bool = True,
            proj_drop: float = 0.0,
            attn_drop: float = 0.0,
            drop_path: Sequence[float] = (),
            layer_scale: float | None = None,
            layer_scale_conv: float | None = None,
            global_mixer: bool = False,
            device=None,
            dtype=None,
    ):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        if not isinstance(global_mixer, bool):
            raise TypeError(f"global_mixer must be a bool, got {type(global_mixer).__name__}")
        self.grad_checkpointing = False
        self.conv = conv
        self.window_size = 0 if conv else int(window_size)
        if not conv and self.window_size < 1:
            raise ValueError(f"window_size must be >= 1 for a token stage, got {window_size}")
        self.downsample = Downsample(dim, dim_out, **dd) if downsample else nn.Identity()
        drop_path = list(drop_path) or [0.0] * depth
        if conv:
            blocks = [ConvBlock(dim_out, drop_path[i], layer_scale_conv, **dd) for i in range(depth)]
        else:
            num_mixer = (depth + 1) // 2  # official: attention in the last floor(depth / 2) blocks
            # What the stage offers the second slot's mixer, if its constructor takes it (attention: all of it).
            attn_offered = {"num_heads": num_heads, "qkv_bias": qkv_bias, "attn_drop": attn_drop,
                            "proj_drop": proj_drop}
            blocks = []
            for i in range(depth):
                if i < num_mixer:
                    token_mixer = build_mixer(mixer, dim_out, causal=mixer_causal, kwargs=mixer_kwargs, **dd)
                else:
                    token_mixer = build_mixer(attn_mixer, dim_out, causal=attn_mixer_causal, kwargs=attn_mixer_kwargs,
                                              offered=attn_offered, argument="attn_mixer", **dd)
                blocks.append(Block(dim_out, token_mixer, mlp_ratio, proj_drop, drop_path[i], layer_scale, **dd))
        self.blocks = nn.Sequential(*blocks)
        self.global_mixer = global_mixer
        # consecutive blocks sharing a layout, (global, first, end): the tokens are re-laid only between runs
        self._runs: list[tuple[bool, int, int]] = []
        for i, block in enumerate(blocks):
            whole = global_mixer and not conv and bool(getattr(block.mixer, "linear_in_length", False))
            if self._runs and self._runs[-1][0] == whole:
                self._runs[-1] = (whole, self._runs[-1][1], i + 1)
            else:
                self._runs.append((whole, i, i + 1))

    def _run_blocks(self, blocks: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.grad_checkpointing and not torch.jit.is_scripting():
            return checkpoint_seq(blocks, x)
        return blocks(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.downsample(x)
        if self.conv:
            return self._run_blocks(self.blocks, x)
        if len(self._runs) == 1 and not self._runs[0][0]:  # every block windowed (MambaVision)
            H, W = x.shape[-2], x.shape[-1]
            x = window_partition(x, self.window_size)
            return window_reverse(self._run_blocks(self.blocks, x), self.window_size, H, W)
        for whole, first, end in self._runs:
            blocks = self.blocks[first:end]
            if whole:
                x = tokens_to_map(self._run_blocks(blocks, tokens_of_map(x)), x.shape[-2], x.shape[-1])
            else:
                H, W = x.shape[-2], x.shape[-1]
                windows = self._run_blocks(blocks, window_partition(x, self.window_size))
                x = window_reverse(windows, self.window_size, H, W)
        return x

    def extra_repr(self) -> str:
        return "global_mixer=True" if self.global_mixer else ""


@register_notrace_function
def tokens_of_map(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H·W, C), row-major: the whole map as one sequence (the order of a single window)."""
    return x.permute(0, 2, 3, 1).flatten(1, 2)


@register_notrace_function
def tokens_to_map(tokens: torch.Tensor, H: int, W: int) -> torch.Tensor:
    """Inverse of :func:`tokens_of_map`: (B, H·W, C) -> (B, C, H, W) (channels_last strides)."""
    return tokens.unflatten(1, (H, W)).permute(0, 3, 1, 2)
