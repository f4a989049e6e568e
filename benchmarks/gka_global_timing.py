"""Non-causal GKA (closed form, kernels/gka/global_kernels.py) next to SDPA on the same data, bf16, same run.

For each vision shape: forward (inputs requiring grad, as in training), inference forward (no grad) and
forward+backward (gradients of q, k, v, β, α for GKA; q, k, v for SDPA), each eager and replayed from a CUDA graph
(GPU time without launch gaps); ratios GKA / SDPA against the targets. ``--sweep`` then times fwd+bwd for a few
launch layouts per head width (``visionssm.kernels.tuning``, op ``gka``, ``global_*`` names), and ``--kernels`` the
GPU time of each kernel of those layouts (torch.profiler, after all the CUDA-graph timings). ``--precision`` sets
the product precisions of ``PRECISION_LAYOUTS`` side by side (one bf16 pass per token product against two, bf16x3
against tf32x3 per-(batch, head) products): the relative error of o and of every gradient against the float64
closed form, SDPA's bf16 error against its own float64 result on the same q, k, v beside them, and the fwd+bwd GPU
time of each (CUDA graph, best of five interleaved rounds).

    python benchmarks/gka_global_timing.py [--quick] [--sweep] [--kernels] [--precision] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from visionssm.kernels.gka import gka
from visionssm.kernels.gka.naive import gka_closed_form
from visionssm.kernels.tuning import launch_overrides
from visionssm.utils.benchmark import environment, save_results, slug, time_fn

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEVICE = "cuda"
# (name, B, T, H, D, target fwd+bwd ratio to SDPA)
SHAPES = [("S1", 256, 196, 10, 16, 0.25), ("S2", 256, 49, 20, 16, 0.3), ("S3", 256, 197, 6, 64, 0.3)]
SWEEP = {
    16: [{}, {"global_packed": True}, {"global_prefetch": False, "global_prefetch_bwd": False},
         {"global_max_registers": 96}, {"global_split": True, "global_solve_warps": 1}, {"global_hold_p": False}],
    # 64-wide heads default to the split forward with the block inverse on 32-wide leaves (global_solve_leaf)
    64: [{}, {"global_solve_leaf": 64}, {"global_solve_leaf": 16}, {"global_solve_warps": 4},
         {"global_solve_warps": 1}, {"global_split": False}, {"global_split": False, "global_solve_leaf": 64},
         {"global_num_warps_bwd": 8}, {"global_block_t_bwd": 32}, {"global_split_bwd": True},
         {"global_split_bwd": True, "global_block_t_bwd": 32}],
}


def make_inputs(B, T, H, D, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, device=DEVICE, generator=gen)
    q = F.normalize(rand(B, T, H, D), dim=-1).bfloat16()
    k = F.normalize(rand(B, T, H, D), dim=-1).bfloat16()
    v = rand(B, T, H, D).bfloat16()
    beta = torch.sigmoid(rand(B, T, H)).bfloat16()
    alpha = torch.sigmoid(rand(B, T, H)).bfloat16()
    return [t.requires_grad_(True) for t in (q, k, v, beta, alpha)]


def steps(B, T, H, D):
    """{impl: {mode: callable}} on shared data."""
    q, k, v, beta, alpha = make_inputs(B, T, H, D)
    do = torch.randn(B, T, H, D, device=DEVICE, dtype=torch.bfloat16)
    sq, sk, sv = (t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v))
    sdo = do.transpose(1, 2).contiguous()
    ours = lambda: gka(q, k, v, None, beta, alpha, causal=False)
    sdpa = lambda: F.scaled_dot_product_attention(sq, sk, sv)

    def no_grad(fn):
        def run():
            with torch.no_grad():
                return fn()
        return run

    # the Triton entry without gka()'s argument checks and dispatch: how much of an eager call they take
    from visionssm.kernels.gka.autograd import gka_triton

    entry = lambda: gka_triton(q, k, v, None, beta, alpha, causal=False, ridge=0.02, num_iters=30, solver="direct")
    out = ours()
    assert torch.isfinite(out).all(), "GKA output has NaN/inf"
    return {
        "gka": {"fwd": ours, "inference": no_grad(ours),
                "fwd+bwd": lambda: torch.autograd.grad(ours(), (q, k, v, beta, alpha), do),
                "fwd+bwd entry": lambda: torch.autograd.grad(entry(), (q, k, v, beta, alpha), do)},
        "sdpa": {"fwd": sdpa, "inference": no_grad(sdpa),
                 "fwd+bwd": lambda: torch.autograd.grad(sdpa(), (sq, sk, sv), sdo)},
    }


def timed(fn, graph: bool) -> float:
    return time_fn(fn, warmup=10, repeats=50, cuda_graph=graph).median_ms


def main_table(rows: list[dict], quick: bool = False) -> None:
    """Every mode eager and from a CUDA graph; ``quick``: the forward and fwd+bwd from CUDA graphs only."""
    for name, B, T, H, D, target in SHAPES:
        shape = f"B{B} T{T} H{H} D{D}"
        impls = steps(B, T, H, D)
        for mode in ("fwd", "inference", "fwd+bwd", "fwd+bwd entry"):
            for graph in (False, True):
                if (mode == "fwd+bwd entry" and graph) or (quick and (not graph or mode == "inference")):
                    continue
                ms = {impl: timed(fns[mode if mode in fns else "fwd+bwd"], graph) for impl, fns in impls.items()}
                ratio = ms["gka"] / ms["sdpa"]
                row = {"shape": shape, "id": name, "mode": mode, "timing": "cuda-graph" if graph else "eager",
                       "gka_ms": round(ms["gka"], 5), "sdpa_ms": round(ms["sdpa"], 5), "ratio": round(ratio, 4)}
                if mode.startswith("fwd+bwd"):
                    row["target"] = target
                    row["meets"] = ratio <= target
                rows.append(row)
                print(f"{name} {shape:>20} {mode:>13} {row['timing']:>10}  gka {ms['gka']:8.4f} ms  "
                      f"sdpa {ms['sdpa']:8.4f} ms  ratio {ratio:6.3f}" + (f"  target {target}" if "target" in row
                                                                           else ""), flush=True)
        del impls
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def sweep(rows: list[dict], deadline: float) -> None:
    for name, B, T, H, D, _ in SHAPES:
        shape = f"B{B} T{T} H{H} D{D}"
        for cfg in SWEEP[D]:
            if time.time() > deadline:
                print("# sweep stopped: time budget", flush=True)
                return
            with launch_overrides("gka", **cfg):
                fns = steps(B, T, H, D)["gka"]
                graph_ms = timed(fns["fwd+bwd"], True)
                fwd_ms = timed(fns["fwd"], True)
            label = ",".join(f"{k[len('global_'):]}={v}" for k, v in cfg.items()) or "default"
            rows.append({"shape": shape, "id": name, "mode": "sweep", "config": label,
                         "fwd_graph_ms": round(fwd_ms, 5), "fwdbwd_graph_ms": round(graph_ms, 5)})
            print(f"sweep {name} {shape:>20} {label:>44}  fwd {fwd_ms:8.4f} ms  fwd+bwd {graph_ms:8.4f} ms",
                  flush=True)


def kernels(rows: list[dict]) -> None:
    """GPU µs per call of every kernel of GKA's fwd+bwd (torch.profiler) for each sweep layout. Run after every
    CUDA-graph timing of the process: in this script's runs on torch 2.11 a graph captured after a profiler session
    failed (cudaErrorStreamCaptureImplicit; other scripts captured after one without error, cause not established)."""
    from visionssm.utils.benchmark import kernel_times_us

    for name, B, T, H, D, _ in SHAPES:
        shape = f"B{B} T{T} H{H} D{D}"
        for cfg in SWEEP[D]:
            with launch_overrides("gka", **cfg):
                times = kernel_times_us(steps(B, T, H, D)["gka"]["fwd+bwd"])
            label = ",".join(f"{k[len('global_'):]}={v}" for k, v in cfg.items()) or "default"
            ours = {key: round(us, 1) for key, us in times.items() if "gka" in key}
            rows.append({"shape": shape, "id": name, "mode": "kernels", "config": label, **ours})
            print(f"kernels {name} {shape:>20} {label:>44}  " + "  ".join(f"{key} {us:.1f} us"
                                                                       for key, us in ours.items()), flush=True)


def _errors(outs, refs) -> str:
    """Relative Frobenius error / max-abs error over the reference's max-abs, per tensor (o, then the gradients)."""
    cells = []
    for name, a, b in zip(("o", "dq", "dk", "dv", "dbeta", "dalpha"), outs, refs):
        a, b = a.double(), b.double()
        cells.append(f"{name} {((a - b).norm() / b.norm()).item():.2e}/"
                     f"{((a - b).abs().max() / b.abs().max()).item():.2e}")
    return "  ".join(cells)


# --precision: GKA's product precisions (launch overrides) against the float64 closed form: the default (two bf16
# passes per token product, bf16x3 per-(batch, head) products in the read-out and the backward, tf32x3 in the
# solve), one pass, tf32x3 products outside the solve too, bf16x3 inside it too
PRECISION_LAYOUTS = {"default": {}, "passes=1": {"global_passes": 1}, "sprec=tf32x3": {"global_sprec": "tf32x3"},
                     "solve_sprec=bf16x3": {"global_solve_sprec": "bf16x3"}}


def _precision_steps(leaves, do) -> dict:
    """fwd+bwd steps returning (o, gradients): GKA in each of PRECISION_LAYOUTS, SDPA on the same data."""
    sq, sk, sv = (t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in leaves[:3])
    sdo = do.transpose(1, 2).contiguous()

    def gka_step(overrides):
        def run():
            with launch_overrides("gka", **overrides):
                out = gka(*leaves[:3], None, *leaves[3:], causal=False)
                return (out.detach(), *torch.autograd.grad(out, leaves, do))
        return run

    def sdpa_step():
        out = F.scaled_dot_product_attention(sq, sk, sv)
        return (out.detach(), *torch.autograd.grad(out, (sq, sk, sv), sdo))

    steps_ = {label: gka_step(overrides) for label, overrides in PRECISION_LAYOUTS.items()}
    return {**steps_, "sdpa": sdpa_step, "sdpa_inputs": (sq, sk, sv, sdo)}


def _float64_grads(fn, leaves, do) -> tuple:
    exact = [t.detach().double().requires_grad_(True) for t in leaves]
    out = fn(*exact)
    return (out.detach(), *torch.autograd.grad(out, exact, do.double()))


def precision(rows: list[dict]) -> None:
    for name, B, T, H, D, _ in SHAPES:
        shape = f"B{B} T{T} H{H} D{D}"
        leaves = make_inputs(B, T, H, D)
        do = torch.randn(B, T, H, D, device=DEVICE, dtype=torch.bfloat16)
        steps_ = _precision_steps(leaves, do)
        refs = _float64_grads(gka_closed_form, leaves, do)
        for label in PRECISION_LAYOUTS:
            print(f"precision {name} {shape} {label}  {_errors(steps_[label](), refs)}", flush=True)
        *sdpa_leaves, sdo = steps_.pop("sdpa_inputs")
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            refs = _float64_grads(F.scaled_dot_product_attention, sdpa_leaves, sdo)
        print(f"precision {name} {shape} sdpa-bf16  {_errors(steps_['sdpa'](), refs)}", flush=True)
        del refs
        best: dict[str, float] = {}
        for _ in range(5):
            for label, fn in steps_.items():
                best[label] = min(best.get(label, float("inf")), timed(fn, True))
        for label, ms in best.items():
            rows.append({"shape": shape, "id": name, "mode": "precision", "config": label,
                         "fwdbwd_graph_ms": round(ms, 5), "ratio": round(ms / best["sdpa"], 4)})
        print(f"precision {name} {shape} fwd+bwd CUDA graph  " + "  ".join(
            f"{label} {ms:.4f} ms ({ms / best['sdpa']:.3f}x sdpa)" for label, ms in best.items()), flush=True)
        del leaves, steps_, sdpa_leaves
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--precision", action="store_true", help="product precisions side by side: error and time")
    parser.add_argument("--out", default=str(RESULTS_DIR), help="folder for the JSON/CSV results (default "
                        "benchmarks/results)")
    parser.add_argument("--quick", action="store_true", help="main table: forward and fwd+bwd, CUDA graphs only")
    parser.add_argument("--kernels", action="store_true", help="last: per-kernel GPU time of each sweep layout "
                        "(torch.profiler)")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds after which the sweep stops")
    args = parser.parse_args()
    start = time.time()
    env = environment()
    print(json.dumps(env), flush=True)
    rows: list[dict] = []
    if args.precision:
        precision(rows)
    else:
        main_table(rows, quick=args.quick)
    save_results("kernels-gka-global", rows, out_dir=args.out, env=env)
    if args.sweep:
        sweep(rows, start + args.budget)
        save_results("kernels-gka-global", rows, out_dir=args.out, env=env)
    if args.kernels:
        kernels(rows)
        save_results("kernels-gka-global", rows, out_dir=args.out, env=env)
    print(f"# results: {Path(args.out)}/kernels-gka-global-{slug(env['device'])}-"
          f"{env['date']}.json", flush=True)


if __name__ == "__main__":
    main()
