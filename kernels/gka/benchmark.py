"""GKA kernel suite: visionssm.kernels.gka next to SDPA (same causality) and flash-linear-attention's
``chunk_gated_delta_rule`` (causal; the linear-attention anchor), bf16, forward and forward+backward.

Shapes and targets (issue 3): at the three vision shapes GKA forward+backward ≤ 1.0× SDPA; at (B4, T2048, H8, D128)
≤ 1.5× chunk_gated_delta_rule. FLA's gated backward computes wrong gradients with Triton < 3.7.1 on Hopper; its
forward+backward time is still a valid time, so it is kept, and the row's ``note`` says so.

``GB/s`` counts the compulsory traffic of our kernels (inputs read, outputs written, the fp32 per-chunk states and
the saved solution x̂ written by the forward and read by the backward); ``%copy`` relates it to the measured
device-to-device copy ceiling.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from visionssm.utils.benchmark import time_fn

ANCHOR = "sdpa"
SHAPES = [(256, 196, 10, 16), (256, 49, 20, 16), (64, 1024, 4, 64), (4, 2048, 8, 128)]


def _fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as exc:  # noqa: BLE001 - any import failure only drops the column
        print(f"# flash-linear-attention not usable ({type(exc).__name__}: {exc}); its column is skipped", flush=True)
        return None, ""
    import triton

    version = tuple(int(x) for x in triton.__version__.split(".")[:3] if x.isdigit())
    note = ""
    if version < (3, 7, 1) and torch.cuda.get_device_capability()[0] == 9:
        note = f"FLA gated backward is numerically wrong on Triton {triton.__version__} < 3.7.1 on Hopper (time valid)"
        print("# " + note, flush=True)
    return chunk_gated_delta_rule, note


def _inputs(B, T, H, D, dtype=torch.bfloat16):
    dev = "cuda"
    q = F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).to(dtype)
    v = torch.randn(B, T, H, D, device=dev, dtype=dtype)
    g = (F.logsigmoid(torch.randn(B, T, H, device=dev) + 4.0)).to(dtype)
    beta = torch.sigmoid(torch.randn(B, T, H, device=dev)).to(dtype)
    alpha = torch.sigmoid(torch.randn(B, T, H, device=dev)).to(dtype)
    return q, k, v, g, beta, alpha


def _bytes(B, T, H, D, causal: bool, backward: bool, elem: int = 2) -> int:
    tokens = B * T * H
    bt = 16 if D >= 128 else 32
    nstates = B * H * ((-(-T // bt)) if causal else 1)
    states = nstates * 2 * D * D * 4                                # H0 and U0, fp32
    fwd = tokens * (4 * D * elem + 3 * elem) + tokens * (D * 4 + 4) + states
    if not backward:
        return fwd
    bwd = tokens * (5 * D * elem + 3 * elem) + tokens * (D * 4 + 4) + 2 * states   # inputs, do, x̂, ‖H‖, states
    bwd += tokens * (3 * D * elem + 3 * 4) + tokens * (D * 4 + 4) * 2 + 2 * nstates * 2 * D * D * 4  # grads, y, dG
    return fwd + bwd


def _timed(fn, args, do, backward):
    if not backward:
        return time_fn(lambda: fn(args), warmup=5, repeats=30).median_ms
    leaves = [a for a in args if a is not None and a.requires_grad]

    def step():
        out = fn(args)
        torch.autograd.grad(out, leaves, do)

    return time_fn(step, warmup=5, repeats=30).median_ms


def run(quick: bool = False, copy_gbps: float | None = None) -> list[dict]:
    from visionssm.kernels.gka import gka

    if not torch.cuda.is_available():
        print("# gka suite needs CUDA; skipped")
        return []
    fla_gdn, fla_note = _fla()
    modes = os.environ.get("GKA_BENCH_MODES", "fwd,fwdbwd").split(",")
    rows = []
    for B, T, H, D in SHAPES[:1] if quick else SHAPES:
        shape = f"B{B} T{T} H{H} D{D}"
        q, k, v, g, beta, alpha = (t.requires_grad_(True) for t in _inputs(B, T, H, D))
        sq, sk, sv = (t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v))
        do = torch.randn_like(v)
        sdo = do.transpose(1, 2).contiguous()
        for causal in (True, False):
            tag = "causal" if causal else "noncausal"
            impls = {
                "gka": ((q, k, v, g if causal else None, beta, alpha), lambda a, c=causal: gka(*a, causal=c), do, ""),
                "sdpa": ((sq, sk, sv), lambda a, c=causal: F.scaled_dot_product_attention(*a, is_causal=c), sdo, ""),
            }
            if causal and fla_gdn is not None:
                gdn_g = g.detach().float().requires_grad_(True)
                impls["fla_gdn"] = ((q, k, v, gdn_g, beta), lambda a, d=D: fla_gdn(
                    q=a[0], k=a[1], v=a[2], g=a[3], beta=a[4], scale=d ** -0.5)[0], do, fla_note)
            for mode in modes:
                backward = mode == "fwdbwd"
                for impl, (args, fn, grad_out, note) in impls.items():
                    try:
                        ms = _timed(fn, args, grad_out, backward)
                    except Exception as exc:  # noqa: BLE001 - report and continue with the other rows
                        print(f"# {impl} {shape} {tag} {mode} failed: {type(exc).__name__}: {exc}", flush=True)
                        continue
                    row = {"op": "gka", "shape": shape, "mode": f"{mode} {tag}", "impl": impl, "ms": ms}
                    if impl == "gka":
                        gbps = _bytes(B, T, H, D, causal, backward) / (ms * 1e-3) / 1e9
                        row["GB/s"] = gbps
                        if copy_gbps:
                            row["%copy"] = 100.0 * gbps / copy_gbps
                    if note and backward:
                        row["note"] = note
                    rows.append(row)
                    print(f"{shape:>22} {mode + ' ' + tag:>18} {impl:>8} {ms:8.3f} ms", flush=True)
        del q, k, v, g, beta, alpha, sq, sk, sv
        torch.cuda.empty_cache()
    return rows
