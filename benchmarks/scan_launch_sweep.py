"""Launch variants of the selective-scan kernels, timed side by side (GPU time, CUDA graphs).

    python benchmarks/scan_launch_sweep.py [variant ...] [--warm]

Each variant forces a few launch settings through ``visionssm.kernels.tuning.launch_overrides`` (the settings are
listed with their defaults in ``visionssm.kernels.selective_scan.launch.SETTINGS``); every fwd+bwd is first checked
against the default's gradients, then the forward and the fwd+bwd are timed in two interleaved rounds (best of the
two) at MambaVision's four scan shapes, bf16. ``--warm`` only compiles (run several in parallel to fill Triton's
cache first). Re-run on a new GPU before changing the defaults in ``SETTINGS``.
"""

import sys

import torch

from visionssm.kernels.selective_scan.autograd import SelectiveScanFunction
from visionssm.kernels.tuning import launch_overrides
from visionssm.utils.benchmark import time_fn

VARIANTS = {
    "default": {},
    "bw4": {"num_warps_bwd": 4},
    "bd16w2": {"block_d_bwd": 16, "num_warps_bwd": 2},
    "bd16w4": {"block_d_bwd": 16, "num_warps_bwd": 4},
    "bd64w4": {"block_d_bwd": 64, "num_warps_bwd": 4},
    "bd64w8": {"block_d_bwd": 64, "num_warps_bwd": 8},
    "fd16w1": {"block_d_fwd": 16, "num_warps_fwd": 1},
    "fd64w2": {"block_d_fwd": 64, "num_warps_fwd": 2},
    "c4": {"chunk": 4},
    "c16": {"chunk": 16},
    "full": {"lean": False},
    "loop": {"unroll": False},
}
SHAPES = [(256, 160, 196), (256, 320, 49), (256, 256, 196), (256, 512, 49)]


def inputs(b, d, L, dt=torch.bfloat16):
    ins = [torch.randn(b, d, L, device="cuda", dtype=dt), torch.randn(b, d, L, device="cuda", dtype=dt) - 2,
           -torch.rand(d, 8, device="cuda") - 0.5, torch.randn(b, 8, L, device="cuda", dtype=dt),
           torch.randn(b, 8, L, device="cuda", dtype=dt), torch.randn(d, device="cuda"),
           torch.randn(b, d, L, device="cuda", dtype=dt), torch.randn(d, device="cuda")]
    return [t.requires_grad_() for t in ins], torch.randn(b, d, L, device="cuda", dtype=dt)


def forward(leaves):
    def run():
        with torch.no_grad():
            return SelectiveScanFunction.apply(*leaves, True, True, False)
    return run


def fwd_bwd(leaves, dout):
    def run():
        out = SelectiveScanFunction.apply(*leaves, True, True, False)
        return torch.autograd.grad(out, leaves, dout)
    return run


def time_variant(name, leaves, dout, reference, check, warm):
    """(forward ms, fwd+bwd ms) of one variant, or None where it failed (reported)."""
    try:
        # the override is held over the whole timing: each call finds the same cached launch config
        with launch_overrides("selective_scan", **VARIANTS[name]):
            grads = fwd_bwd(leaves, dout)()
            if check:
                err = max(((a.float() - r).norm() / r.norm()).item() for a, r in zip(grads, reference))
                if err > 1e-2:
                    print(f"  {name}: gradients differ from the default's by {err:.2e}", flush=True)
            if warm:
                return None
            return (time_fn(forward(leaves), warmup=5, repeats=40, cuda_graph=True).median_ms,
                    time_fn(fwd_bwd(leaves, dout), warmup=5, repeats=40, cuda_graph=True).median_ms)
    except Exception as exc:  # noqa: BLE001 - a variant that fails to compile/launch is reported, not fatal
        print(f"  {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return None


def main():
    warm = "--warm" in sys.argv
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or list(VARIANTS)
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    for shape in SHAPES[:1] if warm else SHAPES:
        leaves, dout = inputs(*shape)
        reference = [g.float() for g in fwd_bwd(leaves, dout)()]
        timings = {}
        for round_ in range(1 if warm else 2):
            for name in names:
                timed = time_variant(name, leaves, dout, reference, round_ == 0, warm)
                if timed is not None:
                    timings.setdefault(name, []).append(timed)
        if timings:
            best = {name: (min(t[0] for t in runs), min(t[1] for t in runs)) for name, runs in timings.items()}
            ref_fwd, ref_both = best.get("default", (float("nan"), float("nan")))
            print(f"SWEEP {shape} fwd: " + "  ".join(f"{k} {v[0]:.4f} ({v[0] / ref_fwd:.3f})" for k, v in best.items()),
                  flush=True)
            print(f"SWEEP {shape} fwd+bwd: " + "  ".join(f"{k} {v[1]:.4f} ({v[1] / ref_both:.3f})"
                                                         for k, v in best.items()), flush=True)


if __name__ == "__main__":
    main()
