"""Comba's output gate with the up-projection inside gated_rmsnorm ("fused") against gate_up called first and its
output passed to the op ("old", forced here by treating gate_up as hooked), in the same run:

* host time per call of one CombaMixer forward at batch 2 (comba_vision_T's first mixer, inference_mode, bf16
  autocast; best of 5 rounds of 300 calls, one sync per round: the launches outrun the GPU, so this is host time);
* GPU time (CUDA graph replays, triton.testing.do_bench median) of the mixer forward and forward+backward at batch
  256, L = 196, for comba_vision_T (C=192, H=3, R=16) and comba_vision_S (C=384, H=6, R=32), bf16 autocast.

Outputs and gradients of the two paths are compared first (relative error, NaN check).

    python benchmarks/comba_gate_fusion.py [--log FILE] [--sweep]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import sys
import time

import timm
import torch
import triton
from triton.testing import do_bench

import visionssm  # noqa: F401  (registers the models)
from visionssm.kernels.tuning import launch_overrides
from visionssm.kernels.utils import relative_error
from visionssm.layers import comba as comba_module
from visionssm.utils.benchmark import capture_graph

L = 196
#: Backward launch settings timed by --sweep (the first of each: the defaults on an H100, 132 SMs).
SWEEP = {
    "comba_vision_T": [{"programs_bwd": 264}, {"programs_bwd": 132}, {"programs_bwd": 528},
                       {"heads_per_program_bwd": 2, "programs_bwd": 132}, {"num_warps_bwd": 4, "programs_bwd": 528}],
    "comba_vision_S": [{"programs_bwd": 88}, {"programs_bwd": 44}, {"programs_bwd": 176},
                       {"num_warps_bwd": 4, "programs_bwd": 176}, {"heads_per_program_bwd": 1, "programs_bwd": 132}],
}


@contextlib.contextmanager
def old_path(enabled: bool):
    """gate_up called as a module (what a hook on it forces), the full gate passed to the op."""
    original = comba_module.is_plain_linear
    if enabled:
        comba_module.is_plain_linear = lambda module: False
    try:
        yield
    finally:
        comba_module.is_plain_linear = original


def mixer_of(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    mixer = timm.create_model(name).blocks[0].mixer.cuda()
    with torch.no_grad():  # a trained-looking gate: not the near-zero initialisation
        mixer.gate_up.weight.normal_(0.0, 0.3)
        mixer.gate_up.bias.normal_(0.0, 0.3)
    return mixer


def host_time_us(mixer, x, old: bool, calls: int = 300, rounds: int = 5) -> float:
    best = float("inf")
    with old_path(old), torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(20):
            mixer(x)
        for _ in range(rounds):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                mixer(x)
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def gpu_times_us(mixer, batch: int, old: bool) -> tuple[float, float]:
    x = torch.randn(batch, L, mixer.dim, device="cuda")
    xg = x.clone().requires_grad_()
    cot = torch.randn_like(x)
    params = list(mixer.parameters())

    def forward():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            mixer(x)

    def train_step():
        for p in params:
            p.grad = None
        xg.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = mixer(xg)
        y.backward(cot)

    with old_path(old):
        fwd_graph, train_graph = capture_graph(forward), capture_graph(train_step)
    return tuple(do_bench(graph.replay, warmup=25, rep=200) * 1e3 for graph in (fwd_graph, train_graph))


def outputs_and_grads(mixer, x, cot, old: bool):
    xg = x.clone().requires_grad_()
    mixer.zero_grad(set_to_none=True)
    with old_path(old), torch.autocast("cuda", dtype=torch.bfloat16):
        y = mixer(xg)
    y.float().backward(cot)
    return {"y": y.detach(), "x": xg.grad, **{n: p.grad.clone() for n, p in mixer.named_parameters()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", default=None, help="also write the report to this file")
    parser.add_argument("--sweep", action="store_true", help="also time the fused path's backward launch settings")
    args = parser.parse_args()
    lines = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    say(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | {now}")
    say("# Comba output gate: up-projection inside gated_rmsnorm (fused) vs gate_up then gated_rmsnorm (old), "
        "same run. Host: CombaMixer forward, B=2, L=196, inference_mode + bf16 autocast, best of 5x300 calls. "
        "GPU: CUDA-graph replays (do_bench median), B=256, L=196, bf16 autocast, forward and forward+backward.")
    ok = True
    for name in ("comba_vision_T", "comba_vision_S"):
        mixer = mixer_of(name)
        x = torch.randn(16, L, mixer.dim, device="cuda")
        cot = torch.randn_like(x)
        new, old = outputs_and_grads(mixer, x, cot, False), outputs_and_grads(mixer, x, cot, True)
        errors = {k: relative_error(new[k], old[k]) for k in new}
        worst = max(errors, key=errors.get)
        finite = all(torch.isfinite(t).all() for t in new.values())
        # the old path rounds the gate to bf16, the fused one does not: bf16-sized differences, larger in the
        # gradients that cancel (b_logit); the float64 comparisons are the tests'
        ok &= finite and errors["y"] < 1e-2
        say(f"{name}: fused vs old (B=16, bf16 autocast) relative difference y {errors['y']:.2e}, "
            f"x.grad {errors['x']:.2e}, gate_up.weight.grad {errors['gate_up.weight']:.2e}, "
            f"gate_up.bias.grad {errors['gate_up.bias']:.2e}, largest {errors[worst]:.2e} ({worst}), finite={finite}")
    say()
    mixer = mixer_of("comba_vision_T")
    x = torch.randn(2, L, mixer.dim, device="cuda")
    host = {}
    for _ in range(2):  # interleaved, twice, keeping each path's best
        for old in (True, False):
            host[old] = min(host.get(old, float("inf")), host_time_us(mixer, x, old))
    say("host time per CombaMixer forward, comba_vision_T, B=2 (us):")
    say(f"  old {host[True]:.1f}  fused {host[False]:.1f}  saved {host[True] - host[False]:.1f}  "
        f"ratio fused/old {host[False] / host[True]:.3f}")
    say()
    say(f"{'model':16} {'path':6} {'fwd us':>9} {'fwd+bwd us':>11}")
    table = {}
    for name in ("comba_vision_T", "comba_vision_S"):
        mixer = mixer_of(name)
        for old in (True, False):
            table[name, old] = gpu_times_us(mixer, 256, old)
            fwd, train = table[name, old]
            say(f"{name:16} {'old' if old else 'fused':6} {fwd:9.1f} {train:11.1f}")
        (of, ot), (nf, nt) = table[name, True], table[name, False]
        say(f"{name:16} {'f/old':6} {nf / of:9.3f} {nt / ot:11.3f}")
        del mixer
        torch.cuda.empty_cache()
    if args.sweep:
        say()
        say("fused path under backward launch settings (B=256, CUDA graph, us):")
        for name, sweep in SWEEP.items():
            mixer = mixer_of(name)
            for settings in sweep:
                with launch_overrides("gated_rmsnorm", **settings):
                    fwd, train = gpu_times_us(mixer, 256, False)
                say(f"  {name:16} {str(settings):60} fwd {fwd:8.1f} fwd+bwd {train:8.1f}")
            del mixer
    if args.log:
        with open(args.log, "w") as handle:
            handle.write("\n".join(lines) + "\n")
    if not ok:
        sys.exit("fused and old paths disagree (or NaN)")


if __name__ == "__main__":
    main()
