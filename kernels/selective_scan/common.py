"""The ``@triton.jit`` helper the forward and backward kernels share."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softplus(x):
    # torch.nn.functional.softplus with its default threshold of 20
    return tl.where(x <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))), x)
