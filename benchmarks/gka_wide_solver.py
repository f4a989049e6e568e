"""Causal GKA on wide heads (B256 T197 H6 D64, B4 T2048 H8 D128; bf16): the solvers side by side in one run, GPU
time from CUDA graphs, with SDPA (fwd+bwd) and flash-linear-attention's ``chunk_gated_delta_rule`` forward (when
installed) as anchors, and each solver's distance from the exact solve.

    python benchmarks/gka_wide_solver.py [--shapes d64 d128] [--solvers auto chebyshev direct]

``auto`` is what ``gka`` runs by default there (:func:`visionssm.kernels.gka.resolve_solver`); ``chebyshev`` the
paper's 30 steps in full precision; ``direct`` the iteration run to fp32 convergence. Error: relative Frobenius
distance of the output from the float64 exact solve on the first sequence's first two heads (bf16 output rounding
included, about 3e-3)."""

import argparse

import torch

from visionssm.kernels.gka import gka
from visionssm.kernels.gka.benchmark import _fla, make_inputs
from visionssm.kernels.gka.naive import gka_chunked
from visionssm.kernels.utils import relative_error
from visionssm.utils.benchmark import sdpa_graph_ms, time_fn

SHAPES = {"d64": (256, 197, 6, 64), "d128": (4, 2048, 8, 128)}


def graph_ms(fn) -> float:
    return time_fn(fn, warmup=3, repeats=20, cuda_graph=True).median_ms


def run_shape(B: int, T: int, H: int, D: int, solvers: list[str], fla) -> None:
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
    for solver in solvers:
        fwd = lambda s=solver: gka(*leaves, solver=s)
        with torch.no_grad():
            out = fwd()
            fwd_ms = graph_ms(fwd)
        both_ms = graph_ms(lambda s=solver: torch.autograd.grad(gka(*leaves, solver=s), leaves, do))
        err = relative_error(out[:1, :, :2], ref)
        extra = f", fwd {fwd_ms / fla_fwd:.2f}x fla" if fla_fwd else ""
        print(f"  {solver:10s} fwd {fwd_ms:.4f} ms  fwd+bwd {both_ms:.4f} ms ({both_ms / sdpa_both:.2f}x sdpa"
              f"{extra})  o vs exact {err:.2e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--solvers", nargs="+", default=["auto", "chebyshev"])
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    fla = _fla()
    for name in args.shapes:
        run_shape(*SHAPES[name], args.solvers, fla)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
