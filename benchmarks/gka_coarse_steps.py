"""How many leading Chebyshev steps of ``solver="auto"`` (causal heads wider than 16) can use one-pass bf16
products and still leave x̂ within 1e-3 of the exact ridge solution (CPU, float64 model of the rounding).

    python benchmarks/gka_coarse_steps.py [--n 2000]

For each width and ridge: the steps ``naive.auto_chebyshev_steps`` runs, the coarse steps it chooses, and the worst
relative error with 0, the chosen number and every other count of coarse steps
(``visionssm.kernels.gka.benchmark.coarse_step_errors``)."""

import argparse

from visionssm.kernels.gka.benchmark import coarse_step_errors
from visionssm.kernels.gka.naive import AUTO_TOLERANCE, auto_chebyshev_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="random matrices per width and ridge")
    args = parser.parse_args()
    for D in (64, 128):
        for ridge in (0.005, 0.02, 0.1, 0.5):
            steps, chosen = auto_chebyshev_steps(ridge)
            counts = sorted({0, chosen, *range(0, steps + 1, max(1, steps // 10))})
            errors = coarse_step_errors(D, ridge, counts, n=args.n)
            worst = errors[chosen]
            print(f"D{D} ridge {ridge}: {steps} steps, {chosen} coarse -> worst {worst:.2e} "
                  f"({'within' if worst <= AUTO_TOLERANCE else 'OVER'} {AUTO_TOLERANCE:g}); by coarse steps: "
                  + " ".join(f"{c}:{e:.1e}" for c, e in errors.items()), flush=True)


if __name__ == "__main__":
    main()
