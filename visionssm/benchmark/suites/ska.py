"""SKA kernel suite: visionssm.kernels.ska next to SDPA (softmax attention at head dim 64 = SKA's value width, same
batch, heads, tokens and causality), bf16, forward and forward+backward, plain and replayed from a CUDA graph.

Shapes (R = 16, V = 64): B256 T49 H16 and B256 T196 H8 (MambaVision-T's stage-4 and stage-3 windows at 224²,
with its head counts), B256 T1024 H4 (a 512² image at stride 16 in one window). Targets (non-causal forward +
backward, CUDA graph): ≤ 0.5× SDPA at T196, ≤ 1.0× at T49.

``GB/s`` counts the minimal traffic (q, k, v read and o written; backward: q, k, v and do read again and dq, dk, dv
written), so ``%copy`` is a lower bound of the bandwidth used.

    python -m visionssm.benchmark.suites.ska    # diagnostics: GPU time per kernel at the suite's shapes
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from visionssm.benchmark.harness import kernel_times_us, measure_impls, print_ratios

ANCHOR = "sdpa"
OURS_GRAPH = "visionssm (CUDA graph)"
SDPA_GRAPH = "sdpa (CUDA graph)"
GRAPHED = (OURS_GRAPH, SDPA_GRAPH)
OURS = ("visionssm", OURS_GRAPH)
RANK, VALUE = 16, 64
#: (B, T, H)
SHAPES = [(256, 196, 8), (256, 49, 16), (256, 1024, 4)]


def make_inputs(B, T, H, R=RANK, V=VALUE, dtype=torch.bfloat16):
    dev = "cuda"
    q = torch.randn(B, T, H, R, device=dev, dtype=dtype)
    k = torch.randn(B, T, H, R, device=dev, dtype=dtype)
    v = torch.randn(B, T, H, V, device=dev, dtype=dtype)
    return q, k, v


def _bytes(B, T, H, backward: bool, R=RANK, V=VALUE, elem: int = 2) -> int:
    tokens = B * T * H
    fwd = tokens * elem * (2 * R + 2 * V)
    return fwd + (tokens * elem * (2 * R + 2 * V) + tokens * elem * (2 * R + V) if backward else 0)


def _impls(B, T, H, causal: bool):
    from visionssm.kernels.ska import ska

    q, k, v = make_inputs(B, T, H)
    do = torch.randn_like(v)
    sq, sk, sv = (torch.randn(B, H, T, VALUE, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    sdo = torch.randn_like(sv)
    ours = ((q, k, v), lambda a, c=causal: ska(*a, causal=c), do)
    sdpa = ((sq, sk, sv), lambda a, c=causal: F.scaled_dot_product_attention(*a, is_causal=c), sdo)
    return {"visionssm": ours, "sdpa": sdpa, OURS_GRAPH: ours, SDPA_GRAPH: sdpa}


def run(quick: bool = False, copy_gbps: float | None = None) -> list[dict]:
    if not torch.cuda.is_available():
        print("# ska suite needs CUDA; skipped")
        return []
    rows = []
    for B, T, H in SHAPES[:1] if quick else SHAPES:
        shape = f"B{B} T{T} H{H} R{RANK} V{VALUE}"
        for causal in (False, True):
            tag = "causal" if causal else "noncausal"
            rows += measure_impls("ska", shape, tag, _impls(B, T, H, causal), ours=OURS, graphed=GRAPHED,
                                  bytes_moved=lambda bwd, s=(B, T, H): _bytes(*s, bwd), copy_gbps=copy_gbps)
            torch.cuda.empty_cache()
    print_ratios(rows, ((OURS_GRAPH, SDPA_GRAPH, "sdpa, both CUDA graph"), ("visionssm", "sdpa", "sdpa, eager")))
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Diagnostics (not part of the suite): GPU time per kernel at the suite's shapes


def profile_stages(B: int, T: int, H: int, causal: bool = False, reps: int = 10) -> dict:
    """GPU µs per kernel of one forward+backward (torch.profiler)."""
    from visionssm.kernels.ska import ska

    q, k, v = (t.requires_grad_(True) for t in make_inputs(B, T, H))
    do = torch.randn_like(v)
    step = lambda: torch.autograd.grad(ska(q, k, v, causal=causal), (q, k, v), do)
    return kernel_times_us(step, reps)


def main(argv: list[str] | None = None) -> int:
    import argparse

    argparse.ArgumentParser(description="SKA: GPU time per kernel at the suite's shapes (not part of the "
                            "suite)").parse_args(argv)
    if not torch.cuda.is_available():
        print("# ska diagnostics need CUDA; skipped")
        return 0
    for B, T, H in SHAPES:
        for causal in (False, True):
            kernels = profile_stages(B, T, H, causal)
            print(f"## B{B} T{T} H{H} {'causal' if causal else 'noncausal'}", flush=True)
            for name, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
                print(f"#   {us:9.1f} us  {name[:90]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
