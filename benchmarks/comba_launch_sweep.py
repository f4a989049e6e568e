"""Launch variants of the Comba kernels, timed side by side (GPU time, CUDA graphs).

    python benchmarks/comba_launch_sweep.py [variant ...] [--shapes d16|d16nc|d64|d64nc|tiny|lm|all] \
        [--rounds N] [--warm]

Each variant forces a few launch settings (``visionssm.kernels.tuning.launch_overrides("comba", ...)``; the
settings are listed in ``visionssm.kernels.comba.launch``). At every shape each variant's output and gradients
are first checked against the default's, then forward+backward and the forward alone (no autograd) are timed in
interleaved rounds (best of them; two unless ``--rounds``), bf16, and each shape ends with SDPA on the same data
(the ``ANCHOR`` line). ``--warm`` only compiles. Re-run on a new GPU before changing the defaults in
``launch_config``.
"""

import sys

import torch

from visionssm.kernels import comba
from visionssm.kernels.comba.benchmark import make_inputs
from visionssm.kernels.tuning import launch_overrides
from visionssm.utils.benchmark import sdpa_graph_ms, time_fn

VARIANTS = {
    "default": {},
    "one_pass_bwd": {"split_bwd": False},
    "one_pass_bwd_recompute": {"split_bwd": False, "inv_pass": False, "store_inv": False},
    "one_pass_bwd_stored": {"split_bwd": False, "inv_pass": True, "store_inv": True},
    "one_pass_bwd_inv_pass": {"split_bwd": False, "inv_pass": True, "store_inv": False},
    "split_bwd": {"split_bwd": True},
    "split_bwd_stored": {"split_bwd": True, "inv_pass": True, "store_inv": True},
    "inv_pass": {"inv_pass": True},
    "no_inv_pass": {"inv_pass": False},
    "store_inverse": {"store_inv": True},
    "recompute_inverse": {"store_inv": False},
    "dirs_in_grid": {"dir_loop": False},
    "dirs_in_program": {"dir_loop": True},
    "prefetch": {"prefetch": True},
    "no_prefetch": {"prefetch": False},
    "bwd_prefetch": {"bwd_prefetch": True},
    "no_bwd_prefetch": {"bwd_prefetch": False},
    "dh_warps2": {"dh_num_warps": 2},
    "pre_wy": {"pre_wy": True},
    "no_pre_wy": {"pre_wy": False},
    "state_fp32": {"state_lp": False},
    "walk_regs_free": {"walk_max_registers": None},
    "grad_warps8": {"grad_num_warps": 8},
    "grad_warps8_walk_regs_free": {"grad_num_warps": 8, "walk_max_registers": None},
    "grad_regs200": {"grad_max_registers": 200},
    "grad_regs184": {"grad_max_registers": 184},
    "fwd_lp": {"fwd_lp": True},
    "unbalanced": {"wave_slots": 0},
}
# (B, T, H, D, causal): vision shapes with 16-wide heads, the comba_vision_S and comba_vision_T mixers, two LM shapes
SHAPES = {"d16": [(256, 196, 10, 16, True), (256, 196, 10, 16, False), (256, 49, 20, 16, True)],
          "d16nc": [(256, 196, 10, 16, False), (256, 49, 20, 16, False)],
          "d64": [(256, 197, 6, 64, False), (256, 197, 6, 64, True)], "d64nc": [(256, 197, 6, 64, False)],
          "tiny": [(256, 197, 3, 64, False)],
          "lm": [(64, 1024, 4, 64, True), (4, 2048, 8, 128, True)]}


def inputs(B, T, H, D):
    leaves = [t.requires_grad_() for t in make_inputs(B, T, H, D)]  # the kernel suite's inputs (bf16)
    return leaves, torch.randn_like(leaves[2])


def fwd_bwd(leaves, do, causal, overrides):
    def run():
        with launch_overrides("comba", **overrides):
            out = comba(*leaves, causal=causal)
            # detached: a result holding the autograd graph would keep the leaves' gradient nodes (made on this
            # stream) alive into the CUDA graph capture on another stream, which invalidates the capture
            return (out.detach(), *torch.autograd.grad(out, leaves, do))
    return run


def fwd_only(leaves, causal, overrides):
    def run():
        with launch_overrides("comba", **overrides), torch.no_grad():
            return comba(*leaves, causal=causal)
    return run


def _check(name, shape, results, reference):
    err = max(((a.float() - r).norm() / r.norm().clamp_min(1e-30)).item() for a, r in zip(results, reference))
    if not err <= 2e-2:
        print(f"  {name} {shape}: output/gradients differ from the default's by {err:.2e}", flush=True)


def sweep_shape(B, T, H, D, causal, names, warm, rounds):
    shape = f"B{B} T{T} H{H} D{D} {'causal' if causal else 'noncausal'}"
    leaves, do = inputs(B, T, H, D)
    reference = [t.float() for t in fwd_bwd(leaves, do, causal, {})()]
    timings = {}
    for round_ in range(1 if warm else rounds):
        for name in names:
            try:
                if round_ == 0:
                    _check(name, shape, fwd_bwd(leaves, do, causal, VARIANTS[name])(), reference)
                    fwd_only(leaves, causal, VARIANTS[name])()  # compiles the forward without saved state
                if not warm:
                    both = time_fn(fwd_bwd(leaves, do, causal, VARIANTS[name]), warmup=3, repeats=20, cuda_graph=True)
                    fwd = time_fn(fwd_only(leaves, causal, VARIANTS[name]), warmup=3, repeats=20, cuda_graph=True)
                    timings.setdefault(name, []).append((both.median_ms, fwd.median_ms))
                    print(f"  {shape} {name} round {round_}: fwd+bwd {both.median_ms:.4f} fwd {fwd.median_ms:.4f} ms",
                          flush=True)
            except Exception as exc:  # noqa: BLE001 - a variant that fails to compile/launch is reported, not fatal
                print(f"  {name} {shape}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    if timings:
        best = {name: (min(t[0] for t in ts), min(t[1] for t in ts)) for name, ts in timings.items()}
        ref = best.get("default", (float("nan"), float("nan")))
        print(f"SWEEP {shape} ms fwd+bwd / fwd (ratio to default): "
              + "  ".join(f"{k} {b:.4f}/{f:.4f} ({b / ref[0]:.2f}/{f / ref[1]:.2f})" for k, (b, f) in best.items()),
              flush=True)
        sdpa_fwd, sdpa_both = sdpa_graph_ms(*leaves[:3], do, causal)
        print(f"ANCHOR {shape} sdpa on the same (B, H, T, D) data, CUDA graph: fwd+bwd {sdpa_both:.4f} fwd "
              f"{sdpa_fwd:.4f} ms; default / sdpa {ref[0] / sdpa_both:.2f}x / {ref[1] / sdpa_fwd:.2f}x", flush=True)


def main():
    warm = "--warm" in sys.argv
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    which = next((sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--shapes"), "all")
    rounds = int(next((sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--rounds"), 2))
    names = [a for a in args if a in VARIANTS] or list(VARIANTS)
    shapes = SHAPES["d16"] + SHAPES["d64"] + SHAPES["lm"] if which == "all" else SHAPES[which]
    for B, T, H, D, causal in shapes:
        sweep_shape(B, T, H, D, causal, names, warm, rounds)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
