"""MambaVision's token mixer, weight-compatible with NVlabs/MambaVision.

The layer follows the official ``MambaVisionMixer`` (Hatamizadeh & Kautz, "MambaVision: A Hybrid Mamba-Transformer
Vision Backbone", CVPR 2025, https://arxiv.org/abs/2407.08083) to the letter, so that NVIDIA's released weights
give NVIDIA's outputs:

- ``in_proj`` maps C -> d_inner (= expand * C, *not* 2 * d_inner as in Mamba) and the result is split into halves
  x and z of h = d_inner / 2 channels each.
- Both halves go through a depthwise, bias-free, *non-causal* ('same' padded) conv of width ``d_conv`` and SiLU.
- Only x is scanned (``selective_scan`` with B/C shared across channels); z is not a multiplicative gate: it is
  concatenated to the scan output (the paper's "symmetric path without SSM"), then ``out_proj`` maps back to C.
- ``dt_proj`` adds its bias and the same bias is passed again to the scan as ``delta_bias``, so the effective step
  is ``softplus(W_dt dt + 2 b_dt)``. This double bias is a quirk of the official code that the released weights
  were trained with; it is kept on purpose.

``causal`` only changes the scan: ``True`` is the official single row-major scan over the window's tokens,
``False`` sums a forward and a reverse scan (``selective_scan(..., causal=False)``). The convs stay non-causal in
both modes, as in the official layer.

The scan is :func:`visionssm.kernels.selective_scan`, which runs the Triton kernel on CUDA and the PyTorch
reference elsewhere (CPU, TorchScript/ONNX/FX tracing), so the layer works on every device.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import trunc_normal_

from visionssm.kernels import selective_scan

from .base import SequenceMixer, register_mixer

__all__ = ["MambaVisionMixer"]


@register_mixer("mamba", kernel="selective_scan")
class MambaVisionMixer(SequenceMixer):
    """MambaVision's SSM token mixer: (B, L, C) -> (B, L, C).

    Args:
        dim: Channels C of the input and output.
        causal: ``True`` (official): one forward scan over the tokens; ``False``: forward + reverse scans summed.
        d_state: SSM state size N per channel (MambaVision uses 8).
        d_conv: Width of the depthwise convs on both halves (MambaVision uses 3).
        expand: d_inner = expand * dim; each half has d_inner / 2 channels (MambaVision uses 1).
        dt_rank: Rank of the step projection; ``'auto'`` is ceil(dim / 16).
        dt_init: ``'official'`` (default) reproduces the initialisation the released models were trained from:
            the official model-wide init overwrites Mamba's step init, giving ``dt_proj`` a trunc-normal(0.02)
            weight and a zero bias. ``'mamba'`` uses Mamba's init instead (uniform weight of scale
            dt_rank^-0.5 * dt_scale, bias = softplus^-1 of a log-uniform step in [dt_min, dt_max]).
        dt_min, dt_max, dt_scale, dt_init_floor: Parameters of the ``'mamba'`` step init.
        conv_bias: Give the depthwise convs a bias (the official layer has none).
        bias: Give ``in_proj``/``out_proj`` a bias (the official layer has none).
        device, dtype: Factory kwargs for the parameters.
    """

    no_weight_decay_names = ("A_log", "D")
    linear_input = True

    def __init__(
            self,
            dim: int,
            *,
            causal: bool = True,
            d_state: int = 8,
            d_conv: int = 3,
            expand: float = 1,
            dt_rank: int | str = "auto",
            dt_init: str = "official",
            dt_min: float = 0.001,
            dt_max: float = 0.1,
            dt_scale: float = 1.0,
            dt_init_floor: float = 1e-4,
            conv_bias: bool = False,
            bias: bool = False,
            device=None,
            dtype=None,
    ):
        super().__init__(dim, causal=causal)
        dd = {"device": device, "dtype": dtype}
        d_inner = int(expand * dim)
        if d_inner < 2 or d_inner % 2:
            raise ValueError(f"expand * dim must be an even number >= 2 (x and z are halves), got {d_inner}")
        if dt_init not in ("official", "mamba"):
            raise ValueError(f"dt_init must be 'official' or 'mamba', got {dt_init!r}")
        self.d_state = d_state
        self.d_conv = d_conv
        self.d_inner = d_inner
        self.dt_rank = math.ceil(dim / 16) if dt_rank == "auto" else int(dt_rank)
        half = d_inner // 2
        self.half = half

        self.in_proj = nn.Linear(dim, d_inner, bias=bias, **dd)
        # 'same' padding: symmetric for the odd widths MambaVision uses; written as an int where possible because
        # exporters handle explicit padding best.
        padding = (d_conv - 1) // 2 if d_conv % 2 else "same"
        self.conv1d_x = nn.Conv1d(half, half, kernel_size=d_conv, padding=padding, groups=half, bias=conv_bias, **dd)
        self.conv1d_z = nn.Conv1d(half, half, kernel_size=d_conv, padding=padding, groups=half, bias=conv_bias, **dd)
        self.x_proj = nn.Linear(half, self.dt_rank + 2 * d_state, bias=False, **dd)
        self.dt_proj = nn.Linear(self.dt_rank, half, bias=True, **dd)
        # A and D stay (at least) float32 whatever 16-bit dtype the module is built in; the scan wants them so.
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.A_log = nn.Parameter(torch.empty(half, d_state, device=device, dtype=state_dtype))
        self.D = nn.Parameter(torch.empty(half, device=device, dtype=state_dtype))
        self.out_proj = nn.Linear(d_inner, dim, bias=bias, **dd)
        self._dt_init = (dt_init, dt_min, dt_max, dt_scale, dt_init_floor)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.A_log.is_meta:
            return
        for linear in (self.in_proj, self.x_proj, self.out_proj):
            trunc_normal_(linear.weight, std=0.02)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        self.conv1d_x.reset_parameters()
        self.conv1d_z.reset_parameters()
        dt_init, dt_min, dt_max, dt_scale, dt_init_floor = self._dt_init
        if dt_init == "official":
            trunc_normal_(self.dt_proj.weight, std=0.02)
            nn.init.zeros_(self.dt_proj.bias)
        else:
            std = self.dt_rank ** -0.5 * dt_scale
            nn.init.uniform_(self.dt_proj.weight, -std, std)
            dt = torch.exp(torch.rand(self.half, device=self.D.device) * (math.log(dt_max) - math.log(dt_min))
                           + math.log(dt_min)).clamp(min=dt_init_floor)
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        a = torch.arange(1, self.d_state + 1, dtype=torch.float32, device=self.A_log.device)
        self.A_log.copy_(torch.log(a).expand(self.half, -1))
        self.D.fill_(1.0)

    def lookahead(self) -> int:
        # The 'same'-padded convolutions of the official layer see d_conv // 2 later tokens in both modes.
        return self.d_conv // 2

    def extra_repr(self) -> str:
        return f"dim={self.dim}, d_state={self.d_state}, d_conv={self.d_conv}, dt_rank={self.dt_rank}, " \
               f"causal={self.causal}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        xz = self.in_proj(x).transpose(1, 2)  # (B, d_inner, L)
        x, z = xz.chunk(2, dim=1)
        x = F.silu(self.conv1d_x(x))
        z = F.silu(self.conv1d_z(z))
        x_dbl = self.x_proj(x.transpose(1, 2))  # (B, L, dt_rank + 2N)
        dt, b, c = torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = self.dt_proj(dt).transpose(1, 2)  # (B, h, L); dt_proj's bias is added here *and* below (official)
        b = b.transpose(1, 2).contiguous()  # (B, N, L)
        c = c.transpose(1, 2).contiguous()
        A = -torch.exp(self.A_log.float())
        y = selective_scan(
            x.contiguous(), dt.contiguous(), A, b, c, self.D.float(),
            z=None,
            delta_bias=self.dt_proj.bias.float(),
            delta_softplus=True,
            causal=self.causal,
        )
        y = torch.cat([y.to(z.dtype), z], dim=1).transpose(1, 2)  # (B, L, d_inner)
        return self.out_proj(y)
