"""GKA kernel suite: visionssm.kernels.gka next to SDPA (same (B, H, T, D) data, same causality) and, at the LM
shape, flash-linear-attention's ``chunk_gated_delta_rule`` forward (the linear-attention anchor), bf16, forward and
forward+backward.

Shapes and targets (forward+backward against SDPA unless said): B256 T196 H10 D16 causal ≤ 0.6× (non-causal
≤ 0.25×); B256 T49 H20 D16 causal ≤ 0.6× in GPU time (CUDA graph) and ≤ 1.0× eager (non-causal ≤ 0.3×); B256 T197
H6 D64 causal ≤ 2.5× (non-causal ≤ 0.3×); B4 T2048 H8 D128 causal forward ≤ 1.5× ``chunk_gated_delta_rule`` forward
and forward+backward ≤ 4 ms. FLA's gated backward refuses Triton < 3.7.1 on Hopper, so FLA is timed forward only.

Every implementation is also timed by replaying a captured CUDA graph (the ``(CUDA graph)`` rows: forward, or
forward + autograd backward): GPU time without the host's per-call work, which the plain rows include wherever the
host is the slower side. FLA's forward at the LM shape is host-bound in plain calls (several launches for little
GPU time), so the ratios printed against it set graph against graph and plain against plain.

``solver`` is ``"auto"`` (the per-token direct solve for causal 16-wide heads, for wider causal heads the Chebyshev
iteration with the steps its 1e-3 bound needs, 29 at ridge 0.02; non-causal rows run whatever the non-causal kernels
are). ``GB/s`` counts the minimal traffic (inputs read once, outputs written once), so ``%copy`` is a lower bound of
the bandwidth the kernels use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from visionssm.benchmark.harness import kernel_times_us, measure_impls, print_ratios, sdpa_graph_ms, time_fn

ANCHOR = "sdpa"
OURS_GRAPH = "visionssm (CUDA graph)"
SDPA_GRAPH = "sdpa (CUDA graph)"
OURS = ("visionssm", OURS_GRAPH)
FLA = "fla_gated_delta_rule"
FLA_GRAPH = f"{FLA} (CUDA graph)"
GRAPHED = (OURS_GRAPH, SDPA_GRAPH, FLA_GRAPH)
#: (B, T, H, D, causal modes)
SHAPES = [(256, 196, 10, 16, (True, False)), (256, 49, 20, 16, (True, False)), (256, 197, 6, 64, (True, False)),
          (4, 2048, 8, 128, (True,))]


def _fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as exc:  # noqa: BLE001 - any import failure only drops the column
        print(f"# flash-linear-attention not usable ({type(exc).__name__}: {exc}); its column is skipped", flush=True)
        return None
    return chunk_gated_delta_rule


def make_inputs(B, T, H, D, dtype=torch.bfloat16):
    dev = "cuda"
    q = F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).to(dtype)
    v = torch.randn(B, T, H, D, device=dev, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, device=dev) + 4.0).to(dtype)
    beta = torch.sigmoid(torch.randn(B, T, H, device=dev)).to(dtype)
    alpha = torch.sigmoid(torch.randn(B, T, H, device=dev)).to(dtype)
    return q, k, v, g, beta, alpha


def _bytes(B, T, H, D, backward: bool, elem: int = 2) -> int:
    """Minimal traffic: q, k, v and three gates read, o written; backward: those and do read again, dq, dk, dv and
    three gate gradients written."""
    tokens = B * T * H
    fwd = tokens * elem * (4 * D + 3)
    return fwd + (tokens * elem * (4 * D + 3 + 3 * D + 3) if backward else 0)


def _impls(B, T, H, D, causal: bool, fla):
    from visionssm.kernels.gka import gka

    q, k, v, g, beta, alpha = make_inputs(B, T, H, D)
    sq, sk, sv = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    do = torch.randn_like(v)
    sdo = do.transpose(1, 2).contiguous()
    ours = ((q, k, v, g if causal else None, beta, alpha), lambda a, c=causal: gka(*a, causal=c), do)
    sdpa = ((sq, sk, sv), lambda a, c=causal: F.scaled_dot_product_attention(*a, is_causal=c), sdo)
    impls = {"visionssm": ours, "sdpa": sdpa, OURS_GRAPH: ours, SDPA_GRAPH: sdpa}
    if causal and fla is not None and D >= 64:
        gdn_g = g.float()
        impls[FLA] = impls[FLA_GRAPH] = ((q, k, v, gdn_g, beta), lambda a, d=D: fla(
            q=a[0], k=a[1], v=a[2], g=a[3], beta=a[4], scale=d ** -0.5)[0], do)
    return impls


def run(quick: bool = False, copy_gbps: float | None = None) -> list[dict]:
    if not torch.cuda.is_available():
        print("# gka suite needs CUDA; skipped")
        return []
    fla = _fla()
    rows = []
    for B, T, H, D, modes in SHAPES[:1] if quick else SHAPES:
        shape = f"B{B} T{T} H{H} D{D}"
        for causal in modes:
            tag = "causal" if causal else "noncausal"
            rows += measure_impls("gka", shape, tag, _impls(B, T, H, D, causal, fla), ours=OURS, graphed=GRAPHED,
                                  bytes_moved=lambda bwd, s=(B, T, H, D): _bytes(*s, bwd), copy_gbps=copy_gbps,
                                  forward_only=(FLA, FLA_GRAPH))
            torch.cuda.empty_cache()
    # GPU time against GPU time, and the LM shape's forward against FLA's, graph against graph and plain against plain
    print_ratios(rows, ((OURS_GRAPH, SDPA_GRAPH, "sdpa, both CUDA graph"),
                        (OURS_GRAPH, FLA_GRAPH, f"{FLA}, both CUDA graph"), ("visionssm", FLA, f"{FLA}, both plain")))
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Diagnostics (not part of the suite): GPU time per kernel of the causal path
#
#     python -m visionssm.benchmark.suites.gka            # per-kernel times at the suite's causal shapes


def profile_stages(B: int, T: int, H: int, D: int, reps: int = 10) -> dict:
    """GPU µs per kernel of one causal forward+backward (torch.profiler), and the CUDA-graph fwd and fwd+bwd ms."""
    from visionssm.kernels.gka import gka

    q, k, v, g, beta, alpha = (t.requires_grad_(True) for t in make_inputs(B, T, H, D))
    leaves = [q, k, v, g, beta, alpha]
    do = torch.randn_like(v)
    step = lambda: torch.autograd.grad(gka(q, k, v, g, beta, alpha), leaves, do)
    kernels = kernel_times_us(step, reps)
    fwd = time_fn(lambda: gka(q, k, v, g, beta, alpha), warmup=3, repeats=20, cuda_graph=True).median_ms
    both = time_fn(step, warmup=3, repeats=20, cuda_graph=True).median_ms
    return {"kernels": kernels, "fwd_ms": fwd, "fwdbwd_ms": both}


def _report(shape, result) -> None:
    B, T, H, D = shape
    q, k, v = make_inputs(*shape)[:3]
    sdpa_fwd, sdpa_both = sdpa_graph_ms(q, k, v, torch.randn_like(v), causal=True)
    print(f"## B{B} T{T} H{H} D{D} CUDA graph fwd {result['fwd_ms']:.4f} ms, "
          f"fwd+bwd {result['fwdbwd_ms']:.4f} ms; sdpa (CUDA graph, same run) fwd {sdpa_fwd:.4f} ms, fwd+bwd "
          f"{sdpa_both:.4f} ms: {result['fwd_ms'] / sdpa_fwd:.2f}x / {result['fwdbwd_ms'] / sdpa_both:.2f}x",
          flush=True)
    for name, us in sorted(result["kernels"].items(), key=lambda kv: -kv[1]):
        print(f"#   {us:9.1f} us  {name[:90]}", flush=True)


def main(argv: list[str] | None = None) -> int:
    import argparse

    argparse.ArgumentParser(description="GKA causal path: GPU time per kernel at the suite's causal shapes "
                            "(not part of the suite)").parse_args(argv)
    if not torch.cuda.is_available():
        print("# gka diagnostics need CUDA; skipped")
        return 0
    for B, T, H, D, _ in SHAPES:
        try:
            _report((B, T, H, D), profile_stages(B, T, H, D))
        except Exception as exc:  # noqa: BLE001 - report and keep going
            print(f"# B{B} T{T} H{H} D{D} failed: {type(exc).__name__}: {exc}", flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
