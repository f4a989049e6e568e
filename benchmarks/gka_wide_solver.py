"""Causal GKA on wide heads (B256 T197 H6 D64, B4 T2048 H8 D128; bf16): the solvers side by side in one run, GPU
time from CUDA graphs, with SDPA (fwd+bwd) and flash-linear-attention's ``chunk_gated_delta_rule`` forward (when
installed) as anchors, and each solver's distance from the exact solve.

    python benchmarks/gka_wide_solver.py [--shapes d64 d128] [--solvers auto chebyshev direct]
    python benchmarks/gka_wide_solver.py --shapes d128 --solvers auto --rounds 3 --kernels \
        --layouts default='{}' one-launch='{"coarse_launch": false}'

``auto`` is what ``gka`` runs by default there (:func:`visionssm.kernels.gka.resolve_solver`); ``chebyshev`` the
paper's 30 steps in full precision; ``direct`` the iteration run to fp32 convergence. Error: relative Frobenius
distance of the output from the float64 exact solve on the first sequence's first two heads (bf16 output rounding
included, about 3e-3).

``--layouts NAME=JSON ...`` times every solver under each set of causal launch settings
(:func:`visionssm.kernels.gka.causal_launch.launch_config`, applied through ``launch_overrides("gka", ...)``), in
``--rounds`` interleaved rounds (medians printed, every round listed), and ``--kernels`` adds each kernel's GPU time
(torch.profiler): same-process A/B of launch settings. The 16-wide vision shapes (``d16-t196``, ``d16-t49``) are
there for such comparisons of the causal 16-wide kernels."""

import argparse
import json
import statistics

import torch

from visionssm.kernels.gka import gka
from visionssm.kernels.gka.benchmark import _fla, make_inputs
from visionssm.kernels.gka.naive import gka_chunked
from visionssm.kernels.tuning import launch_overrides
from visionssm.kernels.utils import relative_error
from visionssm.utils.benchmark import kernel_times_us, sdpa_graph_ms, time_fn

SHAPES = {"d64": (256, 197, 6, 64), "d128": (4, 2048, 8, 128), "d16-t196": (256, 196, 10, 16),
          "d16-t49": (256, 49, 20, 16)}


def graph_ms(fn) -> float:
    return time_fn(fn, warmup=3, repeats=20, cuda_graph=True).median_ms


def run_shape(B: int, T: int, H: int, D: int, solvers: list[str], fla, layouts: dict[str, dict] | None = None,
              rounds: int = 1, kernels: bool = False) -> None:
    layouts = layouts or {"": {}}
    q, k, v, g, beta, alpha = make_inputs(B, T, H, D)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta, alpha)]
    do = torch.randn_like(v)
    ref = gka_chunked(*[t.detach()[:1, :, :2].double() for t in leaves], causal=True, exact=True)
    sdpa_fwd, sdpa_both = sdpa_graph_ms(q, k, v, do, causal=True)
    line = f"B{B} T{T} H{H} D{D} causal: sdpa fwd {sdpa_fwd:.4f} / fwd+bwd {sdpa_both:.4f} ms"
    fla_fwd = None
    if fla is not None:
        inputs = {"q": q.detach(), "k": k.detach(), "v": v.detach(), "g": g.detach().float(), "beta": beta.detach()}
        fla_fwd = graph_ms(lambda: fla(**inputs, scale=D ** -0.5))
        line += f"; fla chunk_gated_delta_rule fwd {fla_fwd:.4f} ms"
    print(line, flush=True)
    times = {(solver, name): ([], []) for solver in solvers for name in layouts}
    errors = {}
    for r in range(rounds):
        for (solver, name), (fwd_times, both_times) in times.items():
            with launch_overrides("gka", **layouts[name]):
                fwd = lambda s=solver: gka(*leaves, solver=s)
                both = lambda s=solver: torch.autograd.grad(gka(*leaves, solver=s), leaves, do)
                with torch.no_grad():
                    out = fwd()
                    fwd_times.append(graph_ms(fwd))
                both_times.append(graph_ms(both))
                if r == 0:
                    errors[solver, name] = relative_error(out[:1, :, :2], ref)
                    if kernels:
                        per_kernel = sorted(kernel_times_us(both, reps=5).items(), key=lambda item: -item[1])
                        print(f"  # {solver} {name} {layouts[name]}: "
                              + ", ".join(f"{key} {us:.1f} us" for key, us in per_kernel if us >= 5), flush=True)
    for (solver, name), (fwd_times, both_times) in times.items():
        fwd_ms, both_ms = statistics.median(fwd_times), statistics.median(both_times)
        extra = f", fwd {fwd_ms / fla_fwd:.2f}x fla" if fla_fwd else ""
        listed = (f"; rounds fwd {' '.join(f'{t:.4f}' for t in fwd_times)}, fwd+bwd "
                  f"{' '.join(f'{t:.4f}' for t in both_times)}") if rounds > 1 else ""
        label = f"{solver} {name}".strip()
        print(f"  {label:20s} fwd {fwd_ms:.4f} ms  fwd+bwd {both_ms:.4f} ms ({both_ms / sdpa_both:.2f}x sdpa"
              f"{extra})  o vs exact {errors[solver, name]:.2e}{listed}", flush=True)


def _layout(text: str) -> tuple[str, dict]:
    name, sep, settings = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--layouts takes NAME=JSON, got {text!r}")
    try:
        return name, json.loads(settings)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--layouts {name}: not JSON ({exc})") from exc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["d64", "d128"], choices=list(SHAPES))
    parser.add_argument("--solvers", nargs="+", default=["auto", "chebyshev"])
    parser.add_argument("--layouts", nargs="+", type=_layout, default=None,
                        help="NAME=JSON: causal launch settings to time each solver under")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds per layout (medians printed)")
    parser.add_argument("--kernels", action="store_true", help="also each kernel's GPU time (torch.profiler)")
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    fla = _fla()
    layouts = dict(args.layouts) if args.layouts else None
    for name in args.shapes:
        run_shape(*SHAPES[name], args.solvers, fla, layouts, args.rounds, args.kernels)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
