"""Selective scan at MambaVision's shapes (bf16 activations, fp32 A/D/delta_bias, B/C shared, softplus, z=None).

Implementations: ours (Triton), the PyTorch reference path compiled with ``torch.compile``, and mamba_ssm's CUDA
kernel when it is importable on the machine: ``mamba_ssm.ops.selective_scan_interface.selective_scan_fn``, or, if
only its extension ``selective_scan_cuda`` is (e.g. built alone from mamba's ``csrc/selective_scan`` sources with
``torch.utils.cpp_extension``, where no wheel fits the machine), a thin autograd wrapper over
``selective_scan_cuda.fwd/bwd`` doing what ``selective_scan_fn`` does. The ratios are taken against mamba_ssm when
it was measured in this run, else against the compiled reference. The H100 ``mamba_ssm`` numbers of the op's speed
target are added as rows marked ``quoted`` (not measured in this run; a different GPU).

    python benchmarks/kernels.py --ops selective_scan

Launch settings forced around the run (``visionssm.kernels.tuning.launch_overrides``) apply to our rows and are
printed. Without CUDA the suite prints one line and returns no rows.
"""

from __future__ import annotations

import contextlib

import torch

from visionssm.benchmark.harness import HOST_REPEATS, kernel_row, time_fn
from visionssm.kernels import selective_scan, tuning
from visionssm.kernels.selective_scan.naive import selective_scan_torch
from visionssm.kernels.tuning import launch_overrides

OP = "selective_scan"
COMPILED = "torch.compile(ref)"
MAMBA = "mamba_ssm"
MAMBA_GRAPH = "mamba_ssm (CUDA graph)"
#: The implementation the ratios are taken against: set by :func:`run` to mamba_ssm when it was measured.
ANCHOR = COMPILED
OURS = "visionssm-triton"
OURS_GRAPH = "visionssm-triton (CUDA graph)"
#: Timed by replaying a captured CUDA graph (forward, or forward + autograd backward): GPU time without the host's
#: per-call work (Python, launches), which the plain rows include when the host is the slower side.
GRAPHED = (OURS_GRAPH, MAMBA_GRAPH)
QUOTED = "mamba_ssm H100 (quoted)"

#: (batch, dim, L, N): mamba_vision_T stages 2 and 3, and mamba_vision_B's widths.
SHAPES = [(256, 160, 196, 8), (256, 320, 49, 8), (256, 256, 196, 8), (256, 512, 49, 8)]
#: Long sequences with few (batch, channel block) programs, where the time axis is split into segments scanned in
#: parallel (e.g. 56 x 56 = 3136 tokens of a stage-1 scan in VMamba-like designs): ours against ours run as one
#: segment. mamba_ssm is not timed here (the anchor builds used so far instantiate only its L <= 256 kernels).
LONG_SHAPES = [(2, 192, 3136, 16), (16, 192, 3136, 16)]
OURS_ONE_SEGMENT = "visionssm-triton (one segment)"
#: The speed target's reference: mamba_ssm's CUDA selective_scan_fn on an H100 with bf16 inputs, as quoted
#: (forward ms, forward+backward ms).
QUOTED_H100 = {(256, 160, 196, 8): (0.24, 0.94), (256, 320, 49, 8): (0.26, 0.84),
               (256, 256, 196, 8): (0.32, 1.29), (256, 512, 49, 8): (0.35, 1.31)}


def make_inputs(batch, dim, length, nstate, device="cuda", dtype=torch.bfloat16):
    g = torch.Generator(device=device).manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g, device=device)  # noqa: E731
    return {
        "u": rand(batch, dim, length).to(dtype),
        "delta": (rand(batch, dim, length) * 0.5 - 2.0).to(dtype),
        "A": -torch.arange(1, nstate + 1, device=device, dtype=torch.float32).repeat(dim, 1),
        "B": rand(batch, nstate, length).to(dtype),
        "C": rand(batch, nstate, length).to(dtype),
        "D": torch.ones(dim, device=device),
        "delta_bias": rand(dim) * 0.1,
    }


def _callable(fn, x, mode):
    keys = ("u", "delta", "A", "B", "C", "D", "delta_bias")
    if mode == "fwd":
        def call():
            with torch.no_grad():
                return fn(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], None, x["delta_bias"], True)
        return call
    leaves = {k: x[k].detach().requires_grad_(True) for k in keys}
    dout = torch.randn_like(x["u"])

    def call():
        out = fn(leaves["u"], leaves["delta"], leaves["A"], leaves["B"], leaves["C"], leaves["D"], None,
                 leaves["delta_bias"], True)
        return torch.autograd.grad(out, [leaves[k] for k in keys], dout)
    return call


def _bytes(batch, dim, length, nstate, mode):
    """Bytes a fused kernel must move (bf16 activations): the memory floor."""
    act, bc = batch * dim * length * 2, batch * nstate * length * 2
    fwd = 3 * act + 2 * bc  # u, delta in; out
    return fwd if mode == "fwd" else fwd + 5 * act + 4 * bc  # + u, delta, dout in; du, ddelta out; B, C, dB, dC


def _implementations():
    forced = dict(tuning.overrides(OP))
    if forced:
        print(f"# {OURS} launch settings forced: {forced}", flush=True)
    impls = {OURS: selective_scan, OURS_GRAPH: selective_scan,
             COMPILED: torch.compile(selective_scan_torch, dynamic=False)}
    mamba = mamba_selective_scan()
    if mamba is not None:
        impls[MAMBA] = mamba
        impls[MAMBA_GRAPH] = mamba
    return impls


def mamba_selective_scan():
    """mamba_ssm's CUDA selective scan (``selective_scan_fn``'s signature), or ``None`` when not importable."""
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except Exception as exc:  # ImportError, or mamba_ssm's own imports failing
        reason = f"{type(exc).__name__}: {exc}"
    else:
        print("# mamba_ssm: mamba_ssm.ops.selective_scan_interface.selective_scan_fn", flush=True)
        return selective_scan_fn
    try:
        import selective_scan_cuda
    except ImportError:
        print(f"# mamba_ssm not importable here ({reason}): its CUDA scan is not measured", flush=True)
        return None
    print(f"# mamba_ssm: selective_scan_cuda.fwd/bwd from {selective_scan_cuda.__file__} (selective_scan_fn not "
          f"importable: {reason})", flush=True)
    return _MambaCudaScan(selective_scan_cuda).apply


def _MambaCudaScan(ext):  # noqa: N802 (a class factory)
    class MambaCudaScan(torch.autograd.Function):
        """What ``mamba_ssm``'s ``SelectiveScanFn`` does around the extension (ungrouped B/C get a group axis)."""

        @staticmethod
        def forward(ctx, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
            squeeze = B.dim() == 3
            B, C = (B.unsqueeze(1), C.unsqueeze(1)) if squeeze else (B, C)
            u, delta, B, C = (t.contiguous() for t in (u, delta, B, C))
            out, x, *rest = ext.fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus)
            ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, x, out if z is not None else None)
            ctx.flags = (delta_softplus, squeeze)
            return rest[0] if z is not None else out

        @staticmethod
        def backward(ctx, dout):
            u, delta, A, B, C, D, z, delta_bias, x, out = ctx.saved_tensors
            delta_softplus, squeeze = ctx.flags
            du, ddelta, dA, dB, dC, dD, dbias, *rest = ext.bwd(u, delta, A, B, C, D, z, delta_bias,
                                                                dout.contiguous(), x, out, None, delta_softplus,
                                                                False)
            if squeeze:
                dB, dC = dB.squeeze(1), dC.squeeze(1)
            return (du, ddelta, dA, dB, dC, dD if D is not None else None, rest[0] if z is not None else None,
                    dbias if delta_bias is not None else None, None)

    return MambaCudaScan


def _timed_row(name, fn, x, label, mode, *, warmup, repeats) -> dict | None:
    """One implementation timed on inputs ``x`` (printed): its result row, or None when it fails -- reported, not
    fatal (e.g. an anchor out of memory)."""
    try:
        timing = time_fn(_callable(fn, x, mode), warmup=warmup, repeats=repeats, cuda_graph=name in GRAPHED,
                         host_repeats=HOST_REPEATS)
    except Exception as exc:
        print(f"# {name} {label} {mode} failed: {type(exc).__name__}: {exc}", flush=True)
        return None
    return kernel_row("selective_scan", label, mode, name, timing)


def run(quick: bool, copy_gbps: float | None) -> list[dict]:
    global ANCHOR
    if not torch.cuda.is_available():
        print("# selective_scan suite needs CUDA; skipped", flush=True)
        return []
    rows = []
    impls = _implementations()
    for shape in SHAPES[:1] if quick else SHAPES:
        x = make_inputs(*shape)
        label = "x".join(map(str, shape))
        for mode in ("fwd", "fwd+bwd"):
            for name, fn in impls.items():
                row = _timed_row(name, fn, x, label, mode, warmup=5, repeats=30)
                if row is None:
                    continue
                gbps = _bytes(*shape, mode) / (row["ms"] * 1e-3) / 1e9
                row["GB/s"] = gbps
                if copy_gbps:
                    row["%copy"] = 100 * gbps / copy_gbps
                rows.append(row)
            quoted = QUOTED_H100.get(shape)
            if quoted:
                rows.append({"op": "selective_scan", "shape": label, "mode": mode, "impl": QUOTED,
                             "ms": quoted[0 if mode == "fwd" else 1], "note": "quoted H100 figure, not measured here"})
        del x
        torch.cuda.empty_cache()
    # ours again with the time axis in one segment (whatever else is forced), the override held over the whole
    # timing so the cached launch config stays valid between calls
    long_impls = {OURS: contextlib.nullcontext, OURS_GRAPH: contextlib.nullcontext,
                  OURS_ONE_SEGMENT: lambda: launch_overrides(OP, segments=1)}
    for shape in [] if quick else LONG_SHAPES:
        x = make_inputs(*shape)
        label = "x".join(map(str, shape))
        for mode in ("fwd", "fwd+bwd"):
            timed = {}
            for name, forced in long_impls.items():
                with forced():
                    row = _timed_row(name, selective_scan, x, label, mode, warmup=3, repeats=20)
                if row is not None:
                    timed[name] = row["ms"]
                    rows.append(row)
            if OURS in timed and OURS_ONE_SEGMENT in timed:
                print(f"# {label} {mode}: segmented / one segment = {timed[OURS] / timed[OURS_ONE_SEGMENT]:.2f}x",
                      flush=True)
        del x
        torch.cuda.empty_cache()
    ANCHOR = MAMBA if any(row["impl"] == MAMBA for row in rows) else COMPILED
    return rows

