"""Launch variants of the tiled selective-scan backward, timed side by side (GPU time, CUDA graphs).

    python benchmarks/scan_launch_sweep.py [variant ...] [--warm]

Each variant overrides a few keys of the default launch config (``visionssm.kernels.selective_scan.scan``'s
``CONFIG_OVERRIDE``); every fwd+bwd is first checked against the default's gradients, then timed in two interleaved
rounds (best of the two) at MambaVision's four scan shapes, bf16. ``--warm`` only compiles (run several in parallel
to fill Triton's cache first). Re-run on a new GPU before changing the defaults in ``scan._launch_config``.
"""

import sys

import torch

from visionssm.kernels.selective_scan import scan
from visionssm.utils.benchmark import time_fn

VARIANTS = {
    "default": {},
    "bw4": {"warps_bwd": 4},
    "bd16w2": {"block_d_bwd": 16, "warps_bwd": 2},
    "bd16w4": {"block_d_bwd": 16, "warps_bwd": 4},
    "bd64w4": {"block_d_bwd": 64, "warps_bwd": 4},
    "bd64w8": {"block_d_bwd": 64, "warps_bwd": 8},
    "c4": {"block_l": 4},
    "full": {"lean": False},
}
SHAPES = [(256, 160, 196), (256, 320, 49), (256, 256, 196), (256, 512, 49)]


def inputs(b, d, L, dt=torch.bfloat16):
    ins = [torch.randn(b, d, L, device="cuda", dtype=dt), torch.randn(b, d, L, device="cuda", dtype=dt) - 2,
           -torch.rand(d, 8, device="cuda") - 0.5, torch.randn(b, 8, L, device="cuda", dtype=dt),
           torch.randn(b, 8, L, device="cuda", dtype=dt), torch.randn(d, device="cuda"),
           torch.randn(b, d, L, device="cuda", dtype=dt), torch.randn(d, device="cuda")]
    return [t.requires_grad_() for t in ins], torch.randn(b, d, L, device="cuda", dtype=dt)


def fwd_bwd(leaves, dout, config):
    def run():
        scan.CONFIG_OVERRIDE = config
        try:
            out = scan.SelectiveScanFunction.apply(*leaves, True, True, False)
            return torch.autograd.grad(out, leaves, dout)
        finally:
            scan.CONFIG_OVERRIDE = None
    return run


def main():
    warm = "--warm" in sys.argv
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or list(VARIANTS)
    for shape in SHAPES[:1] if warm else SHAPES:
        leaves, dout = inputs(*shape)
        base = scan._launch_config(shape[2], 8, shape[1])
        reference = [g.float() for g in fwd_bwd(leaves, dout, base)()]
        timings = {}
        for round_ in range(1 if warm else 2):
            for name in names:
                run = fwd_bwd(leaves, dout, {**base, **VARIANTS[name]})
                try:
                    grads = run()
                    if round_ == 0:
                        err = max(((a.float() - r).norm() / r.norm()).item() for a, r in zip(grads, reference))
                        if err > 1e-2:
                            print(f"  {name} {shape}: gradients differ from the default's by {err:.2e}", flush=True)
                    if not warm:
                        timings.setdefault(name, []).append(
                            time_fn(run, warmup=5, repeats=40, cuda_graph=True).median_ms)
                except Exception as exc:  # noqa: BLE001 - a variant that fails to compile/launch is reported, not fatal
                    print(f"  {name} {shape}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        if timings:
            ref = min(timings.get("default", [float("nan")]))
            print(f"SWEEP {shape}: " + "  ".join(f"{k} {min(v):.4f} ({min(v) / ref:.3f})" for k, v in timings.items()),
                  flush=True)


if __name__ == "__main__":
    main()
