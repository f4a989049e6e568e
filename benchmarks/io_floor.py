"""The memory-traffic floor of a mixer's forward+backward, timed on the GPU beside SDPA on the same data.

A mixer op reads its full-width inputs (q, k, v; Comba also p) and per-token gates and writes o in the forward, then
reads them again with dO and writes their gradients in the backward. No implementation can take less time than
moving those bytes once. This script times exactly that traffic: two Triton kernels that do nothing else, replayed
from CUDA graphs, next to SDPA's forward+backward on (B, H, T, D) copies of the same q, k, v and the copy ceiling,
all in one run. Every byte they load is used (the forward writes o = Σ inputs + Σ gates of the row; the backward
each input's gradient input + dO, and each gate's gradient gate + the row's first dO), so none of it can be dropped.
A target ratio to SDPA below ``floor / SDPA`` cannot be met on the GPU at hand by any kernel.

    python benchmarks/io_floor.py [--out DIR]       # the cases of CASES; a CPU machine prints one skip line
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton
import triton.language as tl

from visionssm.benchmark.harness import copy_bandwidth_gbps, environment, save_results, sdpa_graph_ms, time_fn

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BLOCK = 1024
#: (case, B, T, H, D, full-width inputs, gates, the acceptance target of its fwd+bwd as a ratio to SDPA's)
CASES = [
    ("gka non-causal", 256, 197, 6, 64, 3, 2, 0.3),
    ("gka non-causal", 256, 196, 10, 16, 3, 2, 0.25),
    ("gka non-causal", 256, 49, 20, 16, 3, 2, 0.3),
    ("comba non-causal", 256, 197, 6, 64, 4, 2, 2.5),
]


@triton.jit
def floor_fwd_kernel(x_ptr, gate_ptr, out_ptr, n, D: tl.constexpr, N_IN: tl.constexpr, N_GATES: tl.constexpr,
                     BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(N_IN):
        acc += tl.load(x_ptr + i * n + offs, mask=mask, other=0.0).to(tl.float32)
    # a gate is read once from memory: the D elements of its row load the same word, from cache after the first
    rows = offs // D
    for j in tl.static_range(N_GATES):
        acc += tl.load(gate_ptr + j * (n // D) + rows, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def floor_bwd_kernel(x_ptr, gate_ptr, do_ptr, dx_ptr, dgate_ptr, n, D: tl.constexpr, N_IN: tl.constexpr,
                     N_GATES: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    do = tl.load(do_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for i in tl.static_range(N_IN):
        x = tl.load(x_ptr + i * n + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + i * n + offs, (x + do).to(dx_ptr.dtype.element_ty), mask=mask)
    rows = offs // D
    row_start = mask & (offs % D == 0)
    for j in tl.static_range(N_GATES):
        gate = tl.load(gate_ptr + j * (n // D) + rows, mask=row_start, other=0.0).to(tl.float32)
        tl.store(dgate_ptr + j * (n // D) + rows, (gate + do).to(dgate_ptr.dtype.element_ty), mask=row_start)


def _check(inputs: torch.Tensor, gates: torch.Tensor) -> int:
    """n, the elements of one full-width input; ``inputs`` (N_IN, B, T, H, D), ``gates`` (N_GATES, B, T, H)."""
    if inputs.dim() != 5 or gates.dim() != 4 or gates.shape[1:] != inputs.shape[1:4]:
        raise ValueError(f"inputs must be (N_IN, B, T, H, D) and gates (N_GATES, B, T, H), got {tuple(inputs.shape)} "
                         f"and {tuple(gates.shape)}")
    if not (inputs.is_contiguous() and gates.is_contiguous()):
        raise ValueError("inputs and gates must be contiguous")
    n = inputs[0].numel()
    if max(inputs.numel(), gates.numel()) >= 2**31:
        raise ValueError(f"inputs: {inputs.numel()} elements, the kernels index with 32-bit offsets")
    return n


def floor_fwd(inputs: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """o = Σ inputs + Σ gates (each gate broadcast over its row of D), moving each byte once."""
    n = _check(inputs, gates)
    out = torch.empty_like(inputs[0])
    floor_fwd_kernel[(triton.cdiv(n, BLOCK),)](inputs, gates, out, n, D=inputs.shape[-1], N_IN=inputs.shape[0],
                                               N_GATES=gates.shape[0], BLOCK=BLOCK)
    return out


def floor_bwd(inputs: torch.Tensor, gates: torch.Tensor, do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs + dO, gates + dO[..., 0]), moving each byte once."""
    n = _check(inputs, gates)
    if do.shape != inputs.shape[1:] or not do.is_contiguous():
        raise ValueError(f"do must be a contiguous {tuple(inputs.shape[1:])} tensor, got {tuple(do.shape)}")
    dx, dgate = torch.empty_like(inputs), torch.empty_like(gates)
    floor_bwd_kernel[(triton.cdiv(n, BLOCK),)](inputs, gates, do, dx, dgate, n, D=inputs.shape[-1],
                                               N_IN=inputs.shape[0], N_GATES=gates.shape[0], BLOCK=BLOCK)
    return dx, dgate


def traffic_bytes(inputs: torch.Tensor, gates: torch.Tensor) -> tuple[int, int]:
    """Bytes the forward and the backward must move: read inputs + gates, write o; read inputs + gates + dO, write
    their gradients."""
    full, gate, one = inputs.nbytes, gates.nbytes, inputs[0].nbytes
    return full + gate + one, 2 * full + 2 * gate + one


def measure(case: str, B: int, T: int, H: int, D: int, n_in: int, n_gates: int, target: float) -> dict:
    """One case: the floor kernels' fwd / bwd GPU time from CUDA graphs and SDPA's fwd+bwd on the same q, k, v."""
    inputs = torch.randn(n_in, B, T, H, D, device="cuda", dtype=torch.bfloat16)
    gates = torch.rand(n_gates, B, T, H, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    moved = sum(traffic_bytes(inputs, gates))
    fwd = time_fn(lambda: floor_fwd(inputs, gates), warmup=3, repeats=30, cuda_graph=True).median_ms
    bwd = time_fn(lambda: floor_bwd(inputs, gates, do), warmup=3, repeats=30, cuda_graph=True).median_ms
    _, sdpa = sdpa_graph_ms(inputs[0], inputs[1], inputs[2], do, causal=False)
    floor = fwd + bwd
    return {"case": case, "shape": f"B{B} T{T} H{H} D{D}", "inputs": n_in, "gates": n_gates,
            "MB": round(moved / 1e6, 1), "floor_fwd_ms": round(fwd, 4), "floor_bwd_ms": round(bwd, 4),
            "floor_ms": round(floor, 4), "floor_GB/s": round(moved / (floor * 1e-3) / 1e9),
            "sdpa_ms": round(sdpa, 4), "floor/sdpa": round(floor / sdpa, 3), "target": target,
            "target_below_floor": target < floor / sdpa}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS_DIR), help="folder of the JSON/CSV (default: benchmarks/results)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("io_floor: skipped, no CUDA device (the floor is a GPU measurement)")
        return 0
    env = environment()
    copy = copy_bandwidth_gbps()
    print(f"# {env['device']}  torch {env['torch']}  triton {env['triton']}  {env['date']}  "
          f"copy ceiling {copy:.0f} GB/s")
    rows = [measure(*case) for case in CASES]
    columns = list(rows[0])
    print("  ".join(columns))
    for row in rows:
        print("  ".join(str(row[c]) for c in columns))
    for path in save_results("io-floor", [{**row, "copy_GB/s": round(copy)} for row in rows], out_dir=args.out,
                             env=env):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
