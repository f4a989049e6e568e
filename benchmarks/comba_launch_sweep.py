"""Launch variants of the Comba kernels, timed side by side (GPU time, CUDA graphs).

    python benchmarks/comba_launch_sweep.py [variant ...] [--warm]

Each variant overrides a few keys of the launch config (``visionssm.kernels.comba.fused``'s ``CONFIG_OVERRIDES``;
see ``_launch_config`` there); every forward+backward is first checked against the default's output and gradients,
then timed in two interleaved rounds (best of the two), bf16, at a vision shape with 16-wide heads, the mixer of
``comba_vision_S`` and the two LM shapes of the kernel suite. ``--warm`` only compiles. The default of a large
small-head problem includes its timed launch choice (``_choose``); forced variants are not timed that way. Re-run on
a new GPU before changing the defaults in ``_launch_config``.
"""

import sys

import torch

from visionssm.kernels import comba
from visionssm.kernels.comba import fused
from visionssm.kernels.comba.benchmark import make_inputs
from visionssm.utils.benchmark import time_fn

VARIANTS = {
    "default": {},
    "one_pass_bwd": {"split_bwd": False},
    "split_bwd": {"split_bwd": True},
    "bt32": {"BT": 32},
    "one_pass_bt32": {"split_bwd": False, "BT": 32},
    "bwd_warps8": {"bwd_num_warps": 8},
    "dh_warps2": {"dh_num_warps": 2},
    "dh_warps8": {"dh_num_warps": 8},
    "bv32": {"BV": 32},
    "pre_wy": {"pre_wy": True},
    "directions_in_grid": {"dir_loop": False},
    "prefetch": {"prefetch": True},
}
# (B, T, H, D, causal)
SHAPES = [(256, 196, 10, 16, True), (256, 196, 10, 16, False), (256, 49, 20, 16, False), (256, 197, 6, 64, False),
          (64, 1024, 4, 64, True), (4, 2048, 8, 128, True)]


def inputs(B, T, H, D):
    leaves = [t.requires_grad_() for t in make_inputs(B, T, H, D)]  # the kernel suite's inputs (bf16)
    return leaves, torch.randn_like(leaves[2])


def fwd_bwd(leaves, do, causal, overrides):
    def run():
        fused.CONFIG_OVERRIDES = overrides
        try:
            out = comba(*leaves, causal=causal)
            # detached: a result holding the autograd graph would keep the leaves' gradient nodes (made on this
            # stream) alive into the CUDA graph capture on another stream, which invalidates the capture
            return (out.detach(), *torch.autograd.grad(out, leaves, do))
        finally:
            fused.CONFIG_OVERRIDES = {}
    return run


def main():
    warm = "--warm" in sys.argv
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or list(VARIANTS)
    for B, T, H, D, causal in SHAPES:
        shape = f"B{B} T{T} H{H} D{D} {'causal' if causal else 'noncausal'}"
        leaves, do = inputs(B, T, H, D)
        reference = [t.float() for t in fwd_bwd(leaves, do, causal, {})()]
        timings = {}
        for round_ in range(1 if warm else 2):
            for name in names:
                run = fwd_bwd(leaves, do, causal, VARIANTS[name])
                try:
                    if round_ == 0:
                        results = run()
                        err = max(((a.float() - r).norm() / r.norm().clamp_min(1e-30)).item()
                                  for a, r in zip(results, reference))
                        if not err <= 2e-2:
                            print(f"  {name} {shape}: output/gradients differ from the default's by {err:.2e}",
                                  flush=True)
                    if not warm:
                        ms = time_fn(run, warmup=3, repeats=20, cuda_graph=True).median_ms
                        timings.setdefault(name, []).append(ms)
                except Exception as exc:  # noqa: BLE001 - a variant that fails to compile/launch is reported, not fatal
                    print(f"  {name} {shape}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        if timings:
            ref = min(timings.get("default", [float("nan")]))
            print(f"SWEEP {shape} fwd+bwd ms (ratio to default): "
                  + "  ".join(f"{k} {min(v):.4f} ({min(v) / ref:.2f})" for k, v in timings.items()), flush=True)
        del leaves, do, reference
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
