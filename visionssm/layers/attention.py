"""Multi-head self-attention as a sequence mixer (MambaVision's attention blocks; the anchor the other mixers are
measured against). Non-causal by default, as in MambaVision; ``causal=True`` masks future tokens."""

from __future__ import annotations

from typing import Final

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_, use_fused_attn
from torch import nn

from .base import SequenceMixer, register_mixer
from .common import require_int

__all__ = ["SelfAttention"]


@register_mixer("attention")
class SelfAttention(SequenceMixer):
    """Multi-head self-attention over a window's tokens (no position bias), (B, L, C) -> (B, L, C).

    Args:
        dim: model width C, divisible by ``num_heads``.
        causal: mask future tokens (``False`` in MambaVision).
        num_heads: attention heads.
        qkv_bias: bias of the q/k/v projection (MambaVision: ``True``).
        attn_drop, proj_drop: dropout on the attention weights and on the output.
    """

    fused_attn: Final[bool]
    linear_input = True
    linear_in_length = False  # quadratic in the window's tokens: backbones keep it windowed

    def __init__(self, dim: int, *, causal: bool = False, num_heads: int = 8, qkv_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, device=None, dtype=None) -> None:
        super().__init__(dim, causal=causal)
        dd = {"device": device, "dtype": dtype}
        require_int("num_heads", num_heads, 1)
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.fused_attn = use_fused_attn()
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias, **dd)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # MambaVision's model-wide init, which leaves attention with trunc-normal(0.02) weights and zero biases.
        for linear in (self.qkv, self.proj):
            trunc_normal_(linear.weight, std=0.02)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0,
                                               is_causal=self.causal)
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)
            if self.causal:
                future = torch.ones(N, N, dtype=torch.bool, device=x.device).triu(1)
                attn = attn.masked_fill(future, float("-inf"))
            attn = self.attn_drop(attn.softmax(dim=-1))
            x = attn @ v
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, causal={self.causal}"
