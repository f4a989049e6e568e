"""Comba against flash-linear-attention's ``chunk_comba`` stage by stage, same run (GPU only, FLA installed).

    python benchmarks/comba_fla_stages.py [--shapes d64|d16|all]

FLA's ``chunk_comba`` is the public Triton Comba: 64-token chunks in nine staged kernels (gate sums, p·kᵀ, a
16→64 triangular inverse, W/U, the state walk, the output; in the backward dv, the dh walk, dq/dk/dw/dg, the WY
gradients). Ours is the 16-token single-walk design of :mod:`visionssm.kernels.comba`. At every shape this prints
the CUDA-graph times of ours (causal and not), of FLA (causal: it has no non-causal form) and of SDPA, then the GPU
time per kernel of one forward+backward of each (torch.profiler), so that a restructure toward FLA's stages can be
judged by measurement.

FLA refuses its gated backward with Triton >= 3.4 and < 3.7.1 on Hopper, because one of its kernels
(``chunk_bwd_dqkwg``) gives wrong gradients there (FLA issue #640). Here that guard is lifted to TIME the backward
only: the kernels do the same work, their gradients are not used or checked. At 16-wide heads (B256 T196 H10 D16)
the unguarded backward hit an illegal memory access on an H100 with Triton 3.6, which leaves the CUDA context
unusable; so FLA's forward+backward is timed last at each shape, and ``--shapes`` defaults to the 64-wide one.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from visionssm.kernels import comba  # noqa: E402
from visionssm.kernels.comba.benchmark import make_inputs  # noqa: E402
from visionssm.utils.benchmark import kernel_times_us, time_op  # noqa: E402

SHAPES = {"d64": [(256, 197, 6, 64)], "d16": [(256, 196, 10, 16)]}
SHAPES["all"] = SHAPES["d64"] + SHAPES["d16"]
#: Rows of the per-kernel table printed for each implementation.
TOP_KERNELS = 14


def _fla():
    import fla.ops.common.chunk_o as fla_chunk_o
    from fla.ops.comba import chunk_comba

    fla_chunk_o.TRITON_ABOVE_3_7_1 = True  # timing only: see the module docstring
    return chunk_comba


def _time(name: str, fn, args, grad_out, backward: bool) -> None:
    timing = time_op(fn, args, grad_out, backward=backward, cuda_graph=True)
    print(f"  {name:24s} {'fwd+bwd' if backward else 'fwd':8s} {timing.median_ms:8.4f} ms (graph)", flush=True)


def _kernel_table(name: str, fn, args, grad_out) -> None:
    leaves = [a.detach().requires_grad_() for a in args]
    times = kernel_times_us(lambda: torch.autograd.grad(fn(leaves), leaves, grad_out))
    print(f"  per-kernel GPU us, {name} fwd+bwd (sum {sum(times.values()):.1f}):", flush=True)
    for key, us in sorted(times.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]:
        print(f"    {us:9.1f}  {key[:90]}", flush=True)


def run_shape(B: int, T: int, H: int, D: int, chunk_comba) -> None:
    q, k, v, p, g, beta = make_inputs(B, T, H, D)
    do = torch.randn_like(v)
    sq, sk, sv, sdo = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))
    with torch.no_grad():
        ours = comba(q, k, v, p, g, beta, causal=True).float()
        theirs = chunk_comba(q, k, v, p, g, beta)[0].float()
    rel = ((ours - theirs).norm() / theirs.norm()).item()
    print(f"B{B} T{T} H{H} D{D}: forward relative difference ours vs chunk_comba {rel:.2e}", flush=True)
    inputs = (q, k, v, p, g, beta)
    ours_causal = (inputs, lambda a: comba(*a, causal=True), do)
    ours_global = (inputs, lambda a: comba(*a, causal=False), do)
    fla = (inputs, lambda a: chunk_comba(*a)[0], do)
    for name, impl in (("ours causal", ours_causal), ("ours noncausal", ours_global)):
        _time(name, *impl, backward=False)
        _time(name, *impl, backward=True)
    for name, causal in (("sdpa causal", True), ("sdpa noncausal", False)):
        sdpa = ((sq, sk, sv), lambda a, c=causal: F.scaled_dot_product_attention(*a, is_causal=c), sdo)
        _time(name, *sdpa, backward=False)
        _time(name, *sdpa, backward=True)
    _time("fla chunk_comba causal", *fla, backward=False)
    _kernel_table("ours causal", *ours_causal)
    _kernel_table("ours noncausal", *ours_global)
    # FLA's unguarded backward last: where it faults, the context is lost for everything after it
    _time("fla chunk_comba causal", *fla, backward=True)
    _kernel_table("fla chunk_comba causal", *fla)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="d64")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("# needs CUDA; skipped")
        return 0
    import triton

    chunk_comba = _fla()
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"# {torch.cuda.get_device_name()} {now:%Y-%m-%d %H:%M} UTC torch {torch.__version__} "
          f"triton {triton.__version__}", flush=True)
    for shape in SHAPES[args.shapes]:
        run_shape(*shape, chunk_comba)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
