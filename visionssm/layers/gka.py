"""Gated KalmaNet (GKA) mixer: a fading-memory layer that solves a ridge regression at every token.

Peng, Chattopadhyay, Zancato, Nunez, Xia, Soatto, "Gated KalmaNet: A Fading Memory Layer Through Test-Time Ridge
Regression", arXiv 2511.21016 (CVPR 2026). Layer as in the paper's Fig. 4 / appendix C, with the GKAVision settings of
appendix N (short conv k=3, expansion 0.5, head dim 16, the per-head input gate β of eq. 55):

    q, k, v = SiLU(conv3(W_{q,k,v} x))          expand 0.5: each is (B, L, C/2), heads of 16 channels
    q̂, k̂ = q/‖q‖, k/‖k‖                        per head
    g  = −exp(A_log) · softplus(W_a x + dt_bias)  log forgetting gate γ_t = e^{g_t} ≤ 1 (Mamba2 parametrisation)
    β  = sigmoid(W_β x),  α = sigmoid(W_α x)      per head
    H_t = γ_t H_{t−1} + β_t k̂_t k̂_tᵀ,   U_t = γ_t U_{t−1} + β_t v_t k̂_tᵀ
    x_t ≈ (H_t + λ_t I)^{−1} q̂_t  (Chebyshev, λ_t = ridge · ‖H_t‖_F),   q̃_t = q̂_t + α_t (x_t − q̂_t)
    o_t = U_t q̃_t                                 (kernel: visionssm.kernels.gka)
    y  = W_o (RMSNorm_head(o) · SiLU(W_gate x))

Parameter budget (gka_vision_T, the MambaVision-T macro-architecture with this layer in the 4 + 2 mixer blocks of
stages 3–4, dims 320 and 640, as in NVIDIA's MambaVision-T). MambaVisionMixer at width C has
2C² + O(C) parameters (in_proj C×C, out_proj C×C, x_proj, dt_proj, A_log, D, two k=3 convs): 216,320 at C=320 and
855,040 at C=640, 2,575,360 over the six mixers; the rest of mamba_vision_T is 29,218,888. To stay within 5 % of
31.8 M (30.21 M – 33.39 M) the six mixers must hold between 0.99 M and 4.17 M, i.e. between 0.38× and 1.62× the
Mamba mixers. This layer holds 1.5C² (q/k/v) + 0.5C² (gate) + 0.5C² (out) + 3·C·C/32 (three per-head gate
projections) + 4.5C (k=3 convs on 1.5C channels) + O(C/32) ≈ 2.6C²: 267,096 at C=320 and 1,065,376 at C=640,
3,199,136 over the six mixers, so gka_vision_T has 32,418,024 parameters (+1.9 % of 31.8 M). Without the output
gate (``use_output_gate=False``) the layer holds ≈ 2.1C² and gka_vision_T 31,803,624 (+0.01 %), the closer match
to the paper's "≈ 31.8 M"; the gate stays on by default because Fig. 4 has it. The non-causal layer has no
forgetting gate (the kernel's non-causal mode is a single ridge regression over the whole sequence), 3,220 / 12,840
parameters fewer per mixer at C=320 / 640.

Everything between the input projection and the kernel (short conv, SiLU, L2 norms, the gates) is one op,
:func:`visionssm.kernels.mixer_prologue` (its core and its second-gate part for α, as the layer's ``PrologueSpec``
says), and the output norm and gate another, :func:`visionssm.kernels.gated_rmsnorm`: fused Triton kernels on the
GPU that read the projection's output in place, the plain PyTorch composition on CPU.
"""

from __future__ import annotations

import math

import torch
from timm.layers import trunc_normal_
from torch import nn

from visionssm import kernels
from visionssm.kernels.gka import SOLVERS as GKA_SOLVERS
from visionssm.kernels.layers.mixer_prologue import PrologueSpec

from .base import SequenceMixer, register_mixer
from .common import (
    GatedRMSNorm,
    ShortConv1d,
    aligned_projection,
    init_log_decay_,
    recompute_saved,
    require_int,
    require_positive,
)

__all__ = ["GKAMixer"]

#: Epsilon of the per-head L2 normalisation of q and k.
L2_EPS = 1e-6


@register_mixer("gka", kernel="gka")
class GKAMixer(SequenceMixer):
    """Gated KalmaNet sequence mixer, (B, L, C) -> (B, L, C).

    Args:
        dim: model width C.
        causal: ``True`` (as published) makes token t depend on tokens ≤ t only (causal short conv and the causal
            ridge-regression recurrence with the forgetting gate γ); ``False`` solves one ridge regression over the
            whole sequence (no forgetting, so the layer then has no γ parameters) and centres the short conv.
            Fixed at construction.
        expand: width of q, k and v relative to ``dim`` (0.5 in GKAVision); ``dim * expand`` must be a multiple of
            ``head_dim``.
        head_dim: channels per head (16 in GKAVision); the number of heads is ``dim * expand / head_dim``.
        conv_size: kernel size of the depthwise short convolution on q, k and v.
        ridge: ``a`` in the adaptive regulariser ``λ_t = a·‖H_t‖_F`` (0.02 in the paper).
        num_iters: Chebyshev iterations of the ridge solve (30 in the paper; ``solver="chebyshev"`` only).
        solver: how the ridge system is solved, see :func:`visionssm.kernels.gka`: ``"auto"`` (default: the exact
            solution where that is the fastest, elsewhere the Chebyshev iteration with the steps that keep it within
            1e-3 of the exact one), ``"direct"`` or ``"chebyshev"`` (the paper's numerics). Checkpoints load whatever
            the solver: it has no parameters.
        use_output_gate: multiply the normalised output by ``SiLU(W_gate x)`` (Fig. 4); ``False`` drops ``W_gate``.
        norm_eps: epsilon of the per-head output RMSNorm.
    """

    no_weight_decay_names = ("beta_bias", "alpha_bias", "A_log", "dt_bias")
    linear_input = True

    def __init__(self, dim: int, *, causal: bool = True, expand: float = 0.5, head_dim: int = 16,
                 conv_size: int = 3, ridge: float = 0.02, num_iters: int = 30, solver: str = "auto",
                 use_output_gate: bool = True, norm_eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__(dim, causal=causal)
        dd = {"device": device, "dtype": dtype}
        self.head_dim = require_int("head_dim", head_dim, 1)
        expand = require_positive("expand", expand)
        inner = dim * expand
        if not math.isclose(inner, round(inner)) or round(inner) % head_dim != 0:
            raise ValueError(f"dim * expand must be a whole multiple of head_dim={head_dim}, got {dim} * {expand}")
        self.inner_dim = round(inner)
        self.num_heads = self.inner_dim // head_dim
        self.ridge = require_positive("ridge", ridge)
        self.num_iters = require_int("num_iters", num_iters, 1)
        if solver not in GKA_SOLVERS:
            raise ValueError(f"solver must be one of {GKA_SOLVERS}, got {solver!r}")
        self.solver = solver
        self.use_output_gate = bool(use_output_gate)
        heads = self.num_heads

        # One GEMM for every input projection: q, k, v (3·inner), the output gate (inner), and the per-head β, α
        # and forgetting (causal only) logits, in that order of columns.
        gate_width = self.inner_dim if self.use_output_gate else 0
        num_gates = 3 if causal else 2
        beta_col = 3 * self.inner_dim + gate_width
        # the prologue's core (q, k, v, β, the forgetting gate when causal, the output gate's columns) and GKA's
        # part of it, the second sigmoid gate α
        self._prologue_spec = PrologueSpec(
            num_heads=heads, key_dim=head_dim, value_dim=head_dim, causal=causal, beta_col=beta_col,
            decay_col=beta_col + 2 * heads if causal else None,
            gate_cols=(3 * self.inner_dim, gate_width) if self.use_output_gate else None, eps=L2_EPS,
            alpha_col=beta_col + heads)
        self.in_proj = nn.Linear(dim, beta_col + num_gates * heads, bias=False, **dd)
        self.qkv_conv = ShortConv1d(3 * self.inner_dim, conv_size, **dd)
        # Standalone parameters (not Linear biases), so a backbone's Linear re-initialisation leaves them alone.
        self.beta_bias = nn.Parameter(torch.empty(heads, **dd))
        self.alpha_bias = nn.Parameter(torch.empty(heads, **dd))
        if causal:
            # The forgetting gate γ = exp(g), g = −exp(A_log)·softplus(W_a x + dt_bias).
            self.A_log = nn.Parameter(torch.empty(heads, **dd))
            self.dt_bias = nn.Parameter(torch.empty(heads, **dd))
        else:
            self.A_log = self.dt_bias = None
        self.out_norm = GatedRMSNorm(head_dim, activation="silu", eps=norm_eps, **dd)
        self.out_proj = nn.Linear(self.inner_dim, dim, bias=False, **dd)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for linear in (self.in_proj, self.out_proj):
            trunc_normal_(linear.weight, std=0.02)
        nn.init.zeros_(self.beta_bias)
        nn.init.zeros_(self.alpha_bias)
        if self.A_log is not None:
            init_log_decay_(self.A_log, self.dt_bias)

    def _prologue(self, proj: torch.Tensor) -> tuple:
        return kernels.mixer_prologue(proj, self.qkv_conv.weight, self._prologue_spec, beta_bias=self.beta_bias,
                                      alpha_bias=self.alpha_bias, A_log=self.A_log, dt_bias=self.dt_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        proj = aligned_projection(x, self.in_proj)
        q, k, v, _, g, beta, alpha, gate = self._prologue(proj)
        # the solver's inputs are rebuilt from proj (which the prologue keeps) for the backward, not kept twice
        with recompute_saved((q, k, v, g, beta, alpha), lambda: _kernel_inputs(self._prologue(proj.detach()))):
            o = kernels.gka(q, k, v, g, beta, alpha, causal=self.causal, ridge=self.ridge, num_iters=self.num_iters,
                            solver=self.solver)
        return self.out_proj(kernels.gated_rmsnorm(o, gate, self.out_norm.weight, activation="silu",
                                                   eps=self.out_norm.eps))

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, heads={self.num_heads}, head_dim={self.head_dim}, causal={self.causal}, "
                f"ridge={self.ridge}, solver={self.solver}, num_iters={self.num_iters}")


def _kernel_inputs(prologue: tuple) -> tuple:
    """(q, k, v, g, beta, alpha) of the prologue's outputs (it also returns Comba's p and the gate)."""
    q, k, v, _, g, beta, alpha, _ = prologue
    return q, k, v, g, beta, alpha
