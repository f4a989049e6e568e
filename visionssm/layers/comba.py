"""Comba mixer: a closed-loop (SPLR) delta-rule recurrence with input feedback and output correction.

Hu et al., "Comba: Improving Bilinear RNNs with Closed-loop Control", arXiv 2506.02475 (NeurIPS 2025), §3.3 and
Fig. 2. Per head (paper eq. 5, with p = b·k̂):

    q, k, v = SiLU(conv3(W_{q,k,v} x))         short conv, then the SiLU feature map
    q̂, k̂ = q/‖q‖, k/‖k‖
    p  = b · k̂,        b = sigmoid(b_logit)      feedback strength, a learned per-head scalar in (0, 1)
    q' = q̂ − d · p                                output correction, d a learned per-head scalar (init 0.02)
    g  = −a · softplus(W_α x + c)                 α = e^g close to 1; a = exp(A_log), c = dt_bias per head
    β  = sigmoid(W_β x)
    S_t = S_{t−1}(α_t − β_t b k̂_t k̂_tᵀ) + β_t v_t k̂_tᵀ,   o_t = S_t q'_t     (kernel: visionssm.kernels.comba)
    y  = W_o (RMSNorm_head(o) · sigmoid(W_up W_down x))

``transition="iplr"`` replaces the state transition by the paper's Comba-iplr (Table 4), ``α_t (I − 2 β̃_t k̂ k̂ᵀ)``
with β̃ = b·β, eigenvalues α(1 − 2bβ) ∈ (−1, 1). Comba's kernel updates ``S_t = S_{t−1}(α_t − β_t p_t k̂_tᵀ) + …``,
so the same kernel runs it with ``p_t = 2·b·α_t·k̂_t`` per token; the output correction stays q̂ − d·b·k̂, and the
parameters are the same as splr's (a checkpoint loads into either).

Everything between the input projection and the kernel (short conv, SiLU, L2 norms, p, q', the gates) is one op,
:func:`visionssm.kernels.mixer_prologue` (its core and its key-feedback part, as the layer's ``PrologueSpec`` says),
and the output norm and gate another, :func:`visionssm.kernels.gated_rmsnorm`, which also up-projects the low-rank
gate (``gate_up``'s weight and bias are read by the op, in float32 even under autocast; a hooked or replaced
``gate_up`` is called instead): fused Triton kernels on the GPU that read the projection's output in place, the
plain PyTorch composition on CPU.

p and q' are built after the L2 normalisation, and the kernel does not normalise again: a re-normalisation
of p would cancel b (flash-linear-attention's Comba layer normalises p again), and then b_logit
would get no gradient.

The sigmoid output gate is low-rank (``gate_rank``): a full C×C gate would add 12·C² parameters to a 12-block
backbone and put comba_vision_T/S 6 % / 5 % over the paper's 5.8 M / 22.6 M (Table 9); rank 16 / 32 keeps them
within 1.5 %. ``gate_rank=None`` gives the full-rank gate of the language-model layer.
"""

from __future__ import annotations

import torch
from timm.layers import trunc_normal_
from torch import nn
from torch.utils.checkpoint import checkpoint

from visionssm import kernels
from visionssm.kernels.dispatch import fx_tracing
from visionssm.kernels.layers.mixer_prologue import TRANSITIONS, PrologueSpec

from .base import SequenceMixer, register_mixer
from .common import (
    GatedRMSNorm,
    ShortConv1d,
    aligned_projection,
    init_log_decay_,
    is_plain_linear,
    recompute_saved,
    require_int,
    require_positive,
)

__all__ = ["TRANSITIONS", "CombaMixer"]

#: Epsilon of the per-head L2 normalisation of q and k.
L2_EPS = 1e-6


@register_mixer("comba", kernel="comba")
class CombaMixer(SequenceMixer):
    """Comba sequence mixer, (B, L, C) -> (B, L, C).

    Args:
        dim: model width C (the width of q, k; v has ``dim * expand_v``).
        causal: ``False`` (the vision default) runs the recurrence in both directions and centres the short conv;
            ``True`` makes token t depend on tokens ≤ t only.
        num_heads: number of heads; ``dim`` must be divisible by it. Default: ``dim // 64`` (head dim 64).
        expand_v: value width relative to ``dim``.
        conv_size: kernel size of the depthwise short convolution on q, k and v.
        correction_init: initial output-correction factor d (0.02, the paper's choice for small models).
        feedback_init: initial b_logit, b = sigmoid(feedback_init) (FLA initialises it to 1, b ≈ 0.73).
        gate_rank: rank of the sigmoid output gate ``W_up W_down``; ``None`` for a full-rank ``dim × value`` gate.
        norm_eps: epsilon of the per-head output RMSNorm.
        transition: ``"splr"`` (default, the paper's Comba: α_t − β̃_t k̂ k̂ᵀ) or ``"iplr"`` (Comba-iplr:
            α_t (I − 2 β̃_t k̂ k̂ᵀ)), with β̃ = b·β. Same parameters either way.
        recompute_state: in training keep only the input projection for the backward, which runs the prologue and
            the recurrence's forward again (``torch.utils.checkpoint``): the recurrence's chunk states, the largest
            thing a Comba block keeps at long sequences, are not held from the forward to the backward, for one more
            forward of the kernel per step. Same numbers; eager only (a compiled graph plans its own saves).
    """

    no_weight_decay_names = ("A_log", "dt_bias", "b_logit", "correction")
    linear_input = True

    def __init__(self, dim: int, *, causal: bool = False, num_heads: int | None = None, expand_v: float = 1.0,
                 conv_size: int = 3, correction_init: float = 0.02, feedback_init: float = 1.0,
                 gate_rank: int | None = 16, norm_eps: float = 1e-5, transition: str = "splr",
                 recompute_state: bool = False, device=None, dtype=None) -> None:
        super().__init__(dim, causal=causal)
        dd = {"device": device, "dtype": dtype}
        if num_heads is None:
            num_heads = max(1, dim // 64)
        self.num_heads = require_int("num_heads", num_heads, 1)
        if dim % num_heads:
            raise ValueError(f"dim={dim} must be divisible by num_heads={num_heads}")
        value_dim = dim * require_positive("expand_v", expand_v)
        if value_dim != round(value_dim) or round(value_dim) % num_heads:
            raise ValueError(f"dim * expand_v must be a whole multiple of num_heads={num_heads}, "
                             f"got {dim} * {expand_v}")
        if gate_rank is not None:
            require_int("gate_rank", gate_rank, 1)
        if transition not in TRANSITIONS:
            raise ValueError(f"transition must be one of {TRANSITIONS}, got {transition!r}")
        self.transition = transition
        if not isinstance(recompute_state, bool):
            raise TypeError(f"recompute_state must be a bool, got {type(recompute_state).__name__}")
        self.recompute_state = recompute_state
        for name, value in (("correction_init", correction_init), ("feedback_init", feedback_init)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
        self.head_dim = dim // num_heads
        self.value_dim = round(value_dim)
        self.head_v_dim = self.value_dim // num_heads
        self.gate_rank = gate_rank
        self.correction_init = float(correction_init)
        self.feedback_init = float(feedback_init)
        heads = num_heads

        # One GEMM for every input projection: q, k, v, the per-head forget and input gate logits, and the output
        # gate (its down-projection when low-rank), in that order of columns.
        gate_width = self.value_dim if gate_rank is None else gate_rank
        qkv_width = 2 * dim + self.value_dim
        # the prologue's core (q, k, v, β, the forget gate, the output gate's columns) and Comba's part of it, the
        # key feedback p and the corrected q under the chosen transition
        self._prologue_spec = PrologueSpec(
            num_heads=heads, key_dim=self.head_dim, value_dim=self.head_v_dim, causal=causal,
            beta_col=qkv_width + heads, decay_col=qkv_width, gate_cols=(qkv_width + 2 * heads, gate_width),
            eps=L2_EPS, transition=transition)
        self.in_proj = nn.Linear(dim, qkv_width + 2 * heads + gate_width, bias=False, **dd)
        self.qkv_conv = ShortConv1d(2 * dim + self.value_dim, conv_size, **dd)
        # The paper's trainable scalars {a, b, c, d}, one per head, kept out of weight decay.
        self.A_log = nn.Parameter(torch.empty(heads, **dd))
        self.dt_bias = nn.Parameter(torch.empty(heads, **dd))
        self.b_logit = nn.Parameter(torch.empty(heads, **dd))
        self.correction = nn.Parameter(torch.empty(heads, **dd))
        self.gate_up = nn.Linear(gate_rank, self.value_dim, **dd) if gate_rank is not None else None
        self.out_norm = GatedRMSNorm(self.head_v_dim, activation="sigmoid", eps=norm_eps, **dd)
        self.out_proj = nn.Linear(self.value_dim, dim, bias=False, **dd)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in (self.in_proj, self.gate_up, self.out_proj):
            if module is not None:
                trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        init_log_decay_(self.A_log, self.dt_bias)
        with torch.no_grad():
            self.b_logit.fill_(self.feedback_init)
            self.correction.fill_(self.correction_init)

    def _prologue(self, proj: torch.Tensor) -> tuple:
        return kernels.mixer_prologue(proj, self.qkv_conv.weight, self._prologue_spec, A_log=self.A_log,
                                      dt_bias=self.dt_bias, feedback=self.b_logit, correction=self.correction)

    def _recurrence(self, proj: torch.Tensor) -> torch.Tensor:
        return kernels.comba(*self._prologue(proj)[:6], causal=self.causal)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        proj = aligned_projection(x, self.in_proj)
        if self.recompute_state and torch.is_grad_enabled() and not torch.compiler.is_compiling() \
                and not fx_tracing():
            o = checkpoint(self._recurrence, proj, use_reentrant=False, preserve_rng_state=False)
            start, width = self._prologue_spec.gate_cols
            gate = proj[..., start:start + width]  # the prologue's gate view
        else:
            q, k, v, p, g, beta, _, gate = self._prologue(proj)
            # the recurrence's inputs are rebuilt from proj (which the prologue keeps) for the backward, not kept twice
            with recompute_saved((q, k, v, p, g, beta), lambda: self._prologue(proj.detach())[:6]):
                o = kernels.comba(q, k, v, p, g, beta, causal=self.causal)
        gate_weight = gate_bias = None
        if self.gate_up is not None:
            if is_plain_linear(self.gate_up):  # the up-projection inside the op: no Linear call, no full gate in memory
                gate_weight, gate_bias = self.gate_up.weight, self.gate_up.bias
            else:
                gate = self.gate_up(gate)
        return self.out_proj(kernels.gated_rmsnorm(o, gate, self.out_norm.weight, activation="sigmoid",
                                                   eps=self.out_norm.eps, gate_weight=gate_weight, gate_bias=gate_bias))

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, heads={self.num_heads}, head_dim={self.head_dim}, causal={self.causal}, "
                f"gate_rank={self.gate_rank}, transition={self.transition}"
                + (", recompute_state=True" if self.recompute_state else ""))
