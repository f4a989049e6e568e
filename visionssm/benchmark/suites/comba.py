"""Comba kernel suite: visionssm.kernels.comba next to SDPA (same causality) and flash-linear-attention's
``chunk_comba`` (causal only; its non-causal form would be two calls), bf16, forward and forward+backward.

Shapes: the vision shapes first — two with 16-wide heads, then the mixer of ``comba_vision_S`` (batch 256, 197
tokens, 6 heads of 64) — then that mixer at 1024² (4,096 tokens) and 2048² (16,384 tokens), and then two LM shapes
with 64- and 128-wide heads (the suite takes minutes; a run cut short loses the LM rows rather than the vision
targets). FLA's backward is wrong with Triton < 3.7.1 on Hopper,
so below that version only its forward is timed (its forward+backward rows are left out).

Every implementation is also timed by replaying a captured CUDA graph (the ``(CUDA graph)`` columns: forward, or
forward + autograd backward): GPU time without the host's per-call work (Python, autograd, launches), which the
plain columns include wherever the host is the slower side — at the vision shapes in eager mode it is, for FLA's
staged kernels too. Ratios to FLA set graph against graph and plain against plain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from visionssm.benchmark.harness import measure_impls, print_ratios

ANCHOR = "sdpa"
OURS_GRAPH = "visionssm (CUDA graph)"
SDPA_GRAPH = "sdpa (CUDA graph)"
FLA = "fla_chunk_comba"
FLA_GRAPH = f"{FLA} (CUDA graph)"
#: Timed by replaying a captured CUDA graph.
GRAPHED = (OURS_GRAPH, SDPA_GRAPH, FLA_GRAPH)
OURS = ("visionssm", OURS_GRAPH)
SHAPES = [(256, 196, 10, 16), (256, 49, 20, 16), (256, 197, 6, 64), (16, 4096, 6, 64), (4, 16384, 6, 64),
          (64, 1024, 4, 64), (4, 2048, 8, 128)]


def _fla_chunk_comba():
    try:
        from fla.ops.comba import chunk_comba
    except Exception as exc:  # noqa: BLE001 - any import failure just drops the column
        print(f"# flash-linear-attention not usable here ({type(exc).__name__}: {exc}); chunk_comba column skipped")
        return None, False
    import triton

    version = tuple(int(x) for x in triton.__version__.split(".")[:3] if x.isdigit())
    backward_ok = version >= (3, 7, 1) or torch.cuda.get_device_capability()[0] != 9
    if not backward_ok:
        print(f"# triton {triton.__version__} on Hopper: FLA chunk_comba backward is known wrong; forward only")
    return chunk_comba, backward_ok


def make_inputs(B, T, H, D, dtype=torch.bfloat16):
    dev = "cuda"
    q = F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1)
    p = (k * torch.sigmoid(torch.randn(B, T, H, 1, device=dev))).to(dtype)
    k = k.to(dtype)
    v = torch.randn(B, T, H, D, device=dev, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, device=dev)) / 16
    beta = torch.sigmoid(torch.randn(B, T, H, device=dev)).to(dtype)
    return q, k, v, p, g, beta


def _bytes(B, T, H, D, causal: bool, backward: bool, dtype: torch.dtype = torch.bfloat16) -> int:
    """Traffic of our kernels' design at this shape: q,k,p,v,o in ``dtype`` (+ do and 4 gradients) and the gates,
    plus what the launch layout stores and reads back: the state entering every chunk (in the dtype the op stores
    it in), the chunk inverses (64-wide heads) and, for the split backward, the state gradient leaving every chunk
    (the states' dtype). (The op's own floor, inputs read once and outputs written once, is the first and last terms
    alone.)"""
    from visionssm.kernels.comba.launch import CHUNK, _state_dtype, launch_config

    elem = dtype.itemsize
    tokens = B * T * H
    fwd = tokens * (5 * D * elem + 4 + elem)
    if not backward:
        return fwd
    directions = 1 if causal else 2
    cfg = launch_config(D, D, T, B * H, directions)
    chunks = directions * B * H * (-(-T // CHUNK))
    state_bytes = _state_dtype(cfg, dtype).itemsize
    states = 2 * chunks * D * D * state_bytes
    inverses = 2 * chunks * CHUNK * CHUNK * 4 if cfg["store_inv"] or cfg["inv_pass"] else 0
    state_grads = 2 * chunks * D * D * state_bytes if cfg["split_bwd"] else 0
    return fwd + states + inverses + state_grads + tokens * (10 * D * elem + 2 * (4 + elem))


def run(quick: bool = False, copy_gbps: float | None = None) -> list[dict]:
    from visionssm.kernels import comba

    if not torch.cuda.is_available():
        print("# comba suite needs CUDA; skipped")
        return []
    fla_chunk_comba, fla_backward_ok = _fla_chunk_comba()
    rows = []
    for B, T, H, D in SHAPES[:1] if quick else SHAPES:
        shape = f"B{B} T{T} H{H} D{D}"
        q, k, v, p, g, beta = make_inputs(B, T, H, D)
        sq, sk, sv = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        do = torch.randn_like(v)
        sdo = do.transpose(1, 2).contiguous()
        for causal in (True, False):
            tag = "causal" if causal else "noncausal"
            ours = ((q, k, v, p, g, beta), lambda a, c=causal: comba(*a, causal=c), do)
            sdpa = ((sq, sk, sv), lambda a, c=causal: F.scaled_dot_product_attention(*a, is_causal=c), sdo)
            impls = {"visionssm": ours, "sdpa": sdpa, OURS_GRAPH: ours, SDPA_GRAPH: sdpa}
            if causal and fla_chunk_comba is not None:
                impls[FLA] = impls[FLA_GRAPH] = ((q, k, v, p, g, beta), lambda a: fla_chunk_comba(
                    q=a[0], k=a[1], v=a[2], p=a[3], g=a[4], beta=a[5])[0], do)
            rows += measure_impls("comba", shape, tag, impls, ours=OURS, graphed=GRAPHED,
                                  bytes_moved=lambda bwd, s=(B, T, H, D, causal): _bytes(*s, bwd),
                                  copy_gbps=copy_gbps, forward_only=() if fla_backward_ok else (FLA, FLA_GRAPH))
        del q, k, v, p, g, beta, sq, sk, sv, do, sdo
        torch.cuda.empty_cache()
    print_ratios(rows, ((OURS_GRAPH, FLA_GRAPH, f"{FLA}, both CUDA graph"), ("visionssm", FLA, f"{FLA}, both plain")))
    print_ratios(rows, ((OURS_GRAPH, SDPA_GRAPH, "sdpa, both CUDA graph"),))
    return rows
