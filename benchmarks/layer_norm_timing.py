"""LayerNorm at the isotropic backbones' shapes (256 images × 197 or 196 tokens, 192 or 384 channels, fp32 as
autocast runs it): ``torch.nn.functional.layer_norm`` next to ``visionssm.kernels.layer_norm`` on the same data,
forward and forward + backward (gradients of x, weight and bias), GPU time from CUDA graphs, best of two rounds.

    python benchmarks/layer_norm_timing.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from visionssm.kernels import layer_norm
from visionssm.utils.benchmark import time_fn

SHAPES = [(256 * 197, 192), (256 * 197, 384), (256 * 196, 192)]


def measure(N: int, C: int) -> str:
    x = (torch.randn(N, C, device="cuda") * 2 + 1).requires_grad_()
    w = (1 + 0.1 * torch.randn(C, device="cuda")).requires_grad_()
    b = (0.1 * torch.randn(C, device="cuda")).requires_grad_()
    dy = torch.randn(N, C, device="cuda")
    impls = {"torch": lambda: F.layer_norm(x, (C,), w, b, 1e-6), "visionssm": lambda: layer_norm(x, w, b, eps=1e-6)}
    grads = {name: torch.autograd.grad(fn(), (x, w, b), dy) for name, fn in impls.items()}
    diff = max(((a - c).norm() / c.norm()).item() for a, c in zip(grads["visionssm"], grads["torch"]))
    best: dict[str, tuple[float, float]] = {}
    for _ in range(2):
        for name, fn in impls.items():
            both = time_fn(lambda f=fn: torch.autograd.grad(f(), (x, w, b), dy), warmup=5, repeats=30,
                           cuda_graph=True).median_ms
            fwd = time_fn(fn, warmup=5, repeats=30, cuda_graph=True).median_ms
            old = best.get(name, (float("inf"), float("inf")))
            best[name] = (min(old[0], both), min(old[1], fwd))
    (tb, tf), (vb, vf) = best["torch"], best["visionssm"]
    return (f"N{N} C{C} fp32  fwd+bwd: torch {tb:.4f} ms  visionssm {vb:.4f} ms ({vb / tb:.2f}x)   fwd: torch "
            f"{tf:.4f} ms  visionssm {vf:.4f} ms ({vf / tf:.2f}x)   gradients' largest relative difference "
            f"{diff:.1e}")


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    for N, C in SHAPES:
        print(measure(N, C), flush=True)


if __name__ == "__main__":
    main()
