"""Spectral Koopman Attention (SKA) mixer: retrieval through a ridge-regression fit of the tokens' key dynamics.

Sridhar & Johansen, "Echo: KV-Cache-Free Associative Recall with Spectral Koopman Operators", arXiv 2605.06997
(§3.2). SKA is built to stand where attention stands beside SSM blocks (Echo's hybrids; here the attention half of
MambaVision's stages 3–4, ``echo_vision_*``). The layer, with the paper's choices:

    q, k, v = W_q x, W_k x, W_v x            own projections, no bias; W_q, W_k orthogonally initialised
                                             (H heads: q, k of width R, the Koopman rank; v of width V)
    o  = ska(q, k, v)                        sequence-max normalisation, G, M, C, G⁻¹, σ̂, power filter K̄^p
                                             (kernel: visionssm.kernels.ska)
    o  = α γ^p · o                           learnable α (init 1.5) and SSN scale γ (init 1), per head
    y  = W_o o                               zero-initialised, no gate: SKA starts as an exact identity of the
                                             residual stream ("ungated additive injection")

α and γ enter the output only as the product α·γ^p (the filter is homogeneous of degree p in K̄), so the kernel
takes neither. The paper has one scalar each; per head is the same map with more freedom.

Parameters: ``dim·H·(2R + V) + H·V·dim + 2H``. In MambaVision's attention slot (``num_heads`` offered by the stage:
8 heads at width 320, 16 at 640, i.e. dim/H = 40) with R = 16 and V = 64 this is exactly 4·dim², the parameter
count of the attention block it replaces (qkv 3·dim², proj dim², biases aside).
"""

from __future__ import annotations

import torch
from timm.layers import trunc_normal_
from torch import nn
from torch.nn import functional as F

from visionssm import kernels
from visionssm.kernels.ska import MAX_POWER, SUPPORTED_HEAD_DIMS, SUPPORTED_RANKS

from .base import SequenceMixer, register_mixer
from .common import require_int, require_positive

__all__ = ["SKAMixer"]


@register_mixer("ska", kernel="ska")
class SKAMixer(SequenceMixer):
    """Spectral Koopman Attention, (B, L, C) -> (B, L, C).

    Args:
        dim: model width C.
        causal: ``False`` (default, vision): one operator from all tokens of the sequence (window), queried by every
            token. ``True``: token t uses the statistics of tokens ≤ t (running sequence max): strictly causal.
        num_heads: heads H (a backbone's attention slot offers its stage's count); default ``max(1, dim //
            head_dim)``.
        head_dim: value width V per head, one of (16, 32, 64, 128).
        rank: key/query width R per head (the Koopman rank), one of (16, 32, 64).
        ridge: λ on the max-normalised keys (the public code's 1e-3; the paper's value was lost).
        power: order p of the power filter (the paper: 2; 0 is plain ridge retrieval).
        num_iters: power-iteration steps of the spectral normalisation (the paper: 6).
        normalize: divide the Koopman operator by its estimated top singular value (the paper's eq. 12).
        alpha_init, gamma_init: initial α and γ.
        zero_init_output: zero-initialise the output projection (the paper; ``False``: trunc-normal 0.02).
    """

    no_weight_decay_names = ("alpha", "gamma")
    linear_input = True

    def __init__(self, dim: int, *, causal: bool = False, num_heads: int | None = None, head_dim: int = 64,
                 rank: int = 16, ridge: float = 1e-3, power: int = 2, num_iters: int = 6, normalize: bool = True,
                 alpha_init: float = 1.5, gamma_init: float = 1.0, zero_init_output: bool = True, device=None,
                 dtype=None) -> None:
        super().__init__(dim, causal=causal)
        dd = {"device": device, "dtype": dtype}
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim!r}")
        if rank not in SUPPORTED_RANKS:
            raise ValueError(f"rank must be one of {SUPPORTED_RANKS}, got {rank!r}")
        self.num_heads = max(1, dim // head_dim) if num_heads is None else require_int("num_heads", num_heads, 1)
        self.head_dim, self.rank = head_dim, rank
        self.ridge = require_positive("ridge", ridge)
        self.power = require_int("power", power, 0)
        if self.power > MAX_POWER:
            raise ValueError(f"power must be <= {MAX_POWER}, got {power}")
        self.num_iters = require_int("num_iters", num_iters, 1)
        if not isinstance(normalize, bool):
            raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
        self.normalize = normalize
        self.alpha_init = float(alpha_init)
        self.gamma_init = float(gamma_init)
        self.zero_init_output = bool(zero_init_output)
        H = self.num_heads
        self._splits = [H * rank, H * rank, H * head_dim]
        self.in_proj = nn.Linear(dim, sum(self._splits), bias=False, **dd)
        self.alpha = nn.Parameter(torch.empty(H, **dd))
        self.gamma = nn.Parameter(torch.empty(H, **dd))
        self.out_proj = nn.Linear(H * head_dim, dim, bias=False, **dd)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.alpha.is_meta:
            return
        q_rows, k_rows, _ = self._splits
        weight = self.in_proj.weight
        # orthogonal q and k blocks "to promote well-conditioned covariance matrices" (the paper); nn.init works
        # in float32 at least (its QR has no 16-bit kernels)
        for block in (weight[:q_rows], weight[q_rows:q_rows + k_rows]):
            block.copy_(nn.init.orthogonal_(torch.empty(block.shape, device=block.device,
                                                        dtype=torch.promote_types(block.dtype, torch.float32))))
        trunc_normal_(weight[q_rows + k_rows:], std=0.02)
        if self.zero_init_output:
            nn.init.zeros_(self.out_proj.weight)
        else:
            trunc_normal_(self.out_proj.weight, std=0.02)
        self.alpha.fill_(self.alpha_init)
        self.gamma.fill_(self.gamma_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        B, L, _ = x.shape
        H = self.num_heads
        q, k, v = self.in_proj(x).split(self._splits, dim=-1)
        o = kernels.ska(q.reshape(B, L, H, self.rank), k.reshape(B, L, H, self.rank),
                        v.reshape(B, L, H, self.head_dim), causal=self.causal, ridge=self.ridge, power=self.power,
                        num_iters=self.num_iters, normalize=self.normalize)
        # the per-head output scale α·γ^p goes into the output projection's columns (a (C, H·V) product) rather
        # than over the (B, L, H, V) output: one pass over the largest activation less
        scale = self.alpha * self.gamma ** self.power                   # (H,)
        weight = (self.out_proj.weight.unflatten(1, (H, self.head_dim)) * scale[:, None]).flatten(1)
        return F.linear(o.reshape(B, L, H * self.head_dim), weight)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, heads={self.num_heads}, rank={self.rank}, head_dim={self.head_dim}, "
                f"causal={self.causal}, ridge={self.ridge}, power={self.power}, normalize={self.normalize}")
