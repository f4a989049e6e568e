"""Where the time of a GKA / Comba backbone goes, before and after the fused layer ops, in one run.

    python benchmarks/profile_layers.py                                   # comba_vision_S and gka_vision_T, B256
    python benchmarks/profile_layers.py --out benchmarks/results/profile-layers-<gpu>-<date>.md
    python benchmarks/profile_layers.py --models comba_vision_T --batch-size 64 --steps 2

For each model (bf16 autocast, channels_last, fp32 weights, as ``visionssm-benchmark``) and each of an inference
forward and a training step (forward, cross-entropy, backward, AdamW), two variants of the same model in the same
process: ``before`` runs the layers' PyTorch composition around the mixer kernel (the ``reference`` launch setting
of the ``mixer_prologue`` and ``gated_rmsnorm`` ops: exactly the ops the layers ran before they were fused), and
``after`` the fused Triton ops. Printed per variant:

1. the torch profiler's GPU kernel time per step, grouped: the mixer kernel (the Triton kernels of the mixer op
   packages), the fused layer ops, GEMMs, convolutions, attention, and everything else (elementwise, norms,
   reductions, copies), then the top kernels;
2. the layer share: one mixer layer at the model's own shapes, timed alone (CUDA events, median), forward and
   forward + backward, next to its mixer kernel alone on the same inputs; layer − kernel is what the layer costs
   around its kernel.

With ``--compile [MODE]`` the model is ``torch.compile``d (the ops traced through, so Inductor launches our kernels
beside its own) and profiled once, as ``compiled``: Inductor's generated kernels get a category of their own, and the
layer share, which times single layers eagerly, is left out.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import pkgutil
import re
import statistics
import sys
import time

import torch

CATEGORIES = ("mixer kernel", "fused layer ops", "GEMM", "conv", "attention", "Inductor-generated",
              "elementwise / norm / other")
GEMM_MARKS = ("gemm", "cutlass", "cublas", "xmma", "nvjet", "matmul", "_sgemm", "_hgemm", "wgmma")
LAYER_OPS = ("mixer_prologue", "gated_rmsnorm")


def triton_kernel_names(op: str) -> set[str]:
    """Names of the Triton kernels defined anywhere in the package of the op ``visionssm.kernels.<op>`` (a mixer's
    folder or one under ``layers/``)."""
    import visionssm.kernels as kernels

    names = set()
    pkg = importlib.import_module(getattr(kernels, op).__module__)
    modules = [pkg]
    for info in pkgutil.iter_modules(pkg.__path__):
        try:
            modules.append(importlib.import_module(f"{pkg.__name__}.{info.name}"))
        except Exception:  # a module that needs a GPU library this machine lacks: its kernels just go uncounted
            continue
    for module in modules:
        for value in vars(module).values():
            fn = getattr(value, "fn", None)
            if fn is not None and hasattr(value, "arg_names"):
                names.add(fn.__name__)
    return names


def categorise(name: str, mixer_names: set[str], layer_names: set[str]) -> str:
    lowered = name.lower()
    # whole identifiers only: a Triton helper named ``mm`` is a substring of every "gemm" and of "GammaBeta"
    identifiers = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", name))
    # Inductor renames a user-defined Triton kernel it launches to <name>_<index>
    identifiers |= {re.sub(r"_\d+$", "", identifier) for identifier in identifiers}
    if identifiers & mixer_names:
        return "mixer kernel"
    if identifiers & layer_names:
        return "fused layer ops"
    if any(mark in lowered for mark in GEMM_MARKS):
        return "GEMM"
    if "conv" in lowered or "cudnn" in lowered:
        return "conv"
    if "flash" in lowered or "fmha" in lowered or "attention" in lowered:
        return "attention"
    if re.match(r"triton_(poi|red|per|tem)_", name):
        return "Inductor-generated"
    return "elementwise / norm / other"


def variant(name: str):
    """Context for the ``before`` (reference composition) or ``after`` (fused) layer ops; ``compiled`` as ``after``."""
    from visionssm.kernels.tuning import launch_overrides

    stack = contextlib.ExitStack()
    if name == "before":
        for op in LAYER_OPS:
            stack.enter_context(launch_overrides(op, reference=True))
    return stack


def build(model_name: str, device, batch: int, img_size: int):
    import timm

    import visionssm  # noqa: F401  (registers the models)

    model = timm.create_model(model_name).to(device).to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, img_size, img_size, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, x, y, optimizer


def step_fn(mode: str, model, x, y, optimizer, device):
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def infer():
        with torch.no_grad(), autocast:
            model(x)

    def train():
        with autocast:
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if mode == "infer":
        model.eval()
        return infer
    model.train()
    return train


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_times(events, device_type: str) -> dict[str, list]:
    """{name: [ms, calls]} of the profiled kernels: on CUDA the device-side events, without the profiler's user
    annotations (``record_function`` ranges such as the optimizer's ``Optimizer.step#AdamW.step`` appear on the
    GPU timeline too and would count their kernels twice); on CPU (tests) the leaf ops' CPU time."""
    per_kernel: dict[str, list] = {}
    for event in events:
        if device_type == "cuda":
            kernel = (str(getattr(event, "device_type", "")).endswith("CUDA") and event.device_time_total > 0
                      and not getattr(event, "is_user_annotation", False))
            ms = event.device_time_total / 1e3
        else:
            kernel = event.cpu_children == [] and event.cpu_time_total > 0
            ms = event.cpu_time_total / 1e3
        if kernel:
            entry = per_kernel.setdefault(event.name, [0.0, 0])
            entry[0] += ms
            entry[1] += 1
    return per_kernel


def profile_steps(step, steps: int, device, mixer_names, layer_names) -> tuple[dict, list, float]:
    """(GPU ms per step by category, top kernels [(ms per step, calls per step, name)], total ms per step)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    per_kernel = kernel_times(prof.events(), device.type)
    groups = dict.fromkeys(CATEGORIES, 0.0)
    for name, (ms, _) in per_kernel.items():
        groups[categorise(name, mixer_names, layer_names)] += ms / steps
    top = sorted(((ms / steps, calls / steps, name) for name, (ms, calls) in per_kernel.items()), reverse=True)
    return groups, top, sum(groups.values())


def time_ms(fn, device, repeats: int) -> float:
    """Median wall time of ``fn`` (CUDA events on a GPU) after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def mixer_layers(model) -> tuple[list, dict]:
    """(forward pre-hooks, {module name: input shape}): the hooks record the input shape of every GKA / Comba mixer."""
    from visionssm.layers.comba import CombaMixer
    from visionssm.layers.gka import GKAMixer

    shapes: dict[str, tuple] = {}

    def record(name):
        def hook(module, args) -> None:  # returns None: a pre-hook's return value would replace the layer's input
            shapes.setdefault(name, tuple(args[0].shape))
        return hook

    hooks = [module.register_forward_pre_hook(record(name))
             for name, module in model.named_modules() if isinstance(module, (CombaMixer, GKAMixer))]
    return hooks, shapes


def _kernel_inputs(layer, x):
    """The positional and keyword arguments the layer hands its mixer kernel on input x."""
    from visionssm import kernels
    from visionssm.layers.comba import CombaMixer

    op_name = "comba" if isinstance(layer, CombaMixer) else "gka"
    original = getattr(kernels, op_name)
    captured = {}

    def spy(*args, **kwargs):
        captured["args"] = [a.detach() if torch.is_tensor(a) else a for a in args]
        captured["kwargs"] = kwargs
        return original(*args, **kwargs)

    setattr(kernels, op_name, spy)
    try:
        with torch.no_grad():
            layer(x)
    finally:
        setattr(kernels, op_name, original)
    return original, captured["args"], captured["kwargs"]


def measure_layer(layer, shape: tuple, device, repeats: int) -> dict:
    """One mixer layer alone (before / after) and its kernel alone, forward and forward + backward, in ms."""
    x = torch.randn(shape, device=device)
    xg = x.detach().requires_grad_()
    row = {}
    with torch.autocast(device.type, dtype=torch.bfloat16):
        for which in ("before", "after"):
            with variant(which):
                with torch.no_grad():
                    row[f"{which} fwd"] = time_ms(lambda: layer(x), device, repeats)
                row[f"{which} fwd+bwd"] = time_ms(lambda: layer(xg).float().sum().backward(), device, repeats)
        kernel, args, kwargs = _kernel_inputs(layer, x)
    with torch.no_grad():
        row["kernel fwd"] = time_ms(lambda: kernel(*args, **kwargs), device, repeats)
    leaves = [a.clone().requires_grad_() if torch.is_tensor(a) else a for a in args]
    row["kernel fwd+bwd"] = time_ms(lambda: kernel(*leaves, **kwargs).float().sum().backward(), device, repeats)
    for which in ("before", "after"):
        row[f"{which} share fwd"] = row[f"{which} fwd"] - row["kernel fwd"]
        row[f"{which} share fwd+bwd"] = row[f"{which} fwd+bwd"] - row["kernel fwd+bwd"]
    return row


def layer_share(model, shapes: dict, device, repeats: int) -> list[dict]:
    """measure_layer for each distinct (type, width, input shape) of the model's mixers, with how often it occurs."""
    modules = dict(model.named_modules())
    keys = {name: (type(modules[name]).__name__, modules[name].dim, shape) for name, shape in shapes.items()}
    rows = []
    for key in dict.fromkeys(keys.values()):
        name = next(n for n, k in keys.items() if k == key)
        count = sum(1 for k in keys.values() if k == key)
        row = measure_layer(modules[name], key[2], device, repeats)
        row.update(layer=f"{key[0]}(dim={key[1]}) x{count}", shape=key[2], count=count)
        rows.append(row)
    return rows


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def layer_share_report(model_name: str, model, x, args, device) -> list[str]:
    """The markdown lines of the layer share of every distinct mixer layer of ``model``."""
    out = []
    hooks, shapes = mixer_layers(model)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        model.eval()
        model(x[:1])
    for hook in hooks:
        hook.remove()
    shares = layer_share(model, {n: (args.batch_size, *s[1:]) for n, s in shapes.items()}, device, args.repeats)
    out += [f"## {model_name}: layer share (one layer alone, ms, median of {args.repeats}; share = layer − kernel)",
            "", markdown_table(
                ["layer", "input", "kernel fwd", "before fwd", "after fwd", "share before", "share after",
                 "kernel f+b", "before f+b", "after f+b", "share before", "share after"],
                [[r["layer"], "×".join(map(str, r["shape"])), f"{r['kernel fwd']:.3f}", f"{r['before fwd']:.3f}",
                  f"{r['after fwd']:.3f}", f"{r['before share fwd']:.3f}", f"{r['after share fwd']:.3f}",
                  f"{r['kernel fwd+bwd']:.3f}", f"{r['before fwd+bwd']:.3f}", f"{r['after fwd+bwd']:.3f}",
                  f"{r['before share fwd+bwd']:.3f}", f"{r['after share fwd+bwd']:.3f}"] for r in shares]), ""]
    totals = {k: sum(r[k] * r["count"] for r in shares) for k in ("before share fwd", "after share fwd",
                                                                   "before share fwd+bwd", "after share fwd+bwd")}
    out += [f"Whole model, all mixer layers: share around the kernel {totals['before share fwd']:.2f} → "
            f"{totals['after share fwd']:.2f} ms (forward), {totals['before share fwd+bwd']:.2f} → "
            f"{totals['after share fwd+bwd']:.2f} ms (forward + backward).", ""]
    print("\n".join(out), flush=True)
    return out


def run(args) -> str:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    mixer_names = set()
    from visionssm.layers import mixer_kernel_ops

    for op in mixer_kernel_ops():
        mixer_names |= triton_kernel_names(op)
    layer_names = set().union(*(triton_kernel_names(op) for op in LAYER_OPS))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    variants = ("compiled",) if args.compile else ("before", "after")
    compiled = f", torch.compile(mode={args.compile!r})" if args.compile else ""
    out = [f"# Layer profile: {', '.join(args.models)} — {gpu}, {time.strftime('%Y-%m-%d')}",
           "", f"torch {torch.__version__}; batch {args.batch_size}, {args.img_size}², bf16 autocast, channels_last"
           f"{compiled}; GPU kernel time per step from torch.profiler over {args.steps} steps after {args.warmup} "
           "warm-up steps. " + ("" if args.compile else "before = the layers' PyTorch composition around the mixer "
                                "kernel, after = the fused Triton layer ops."), ""]
    for model_name in args.models:
        model, x, y, optimizer = build(model_name, device, args.batch_size, args.img_size)
        if args.compile:
            model = torch.compile(model, mode=args.compile)
        for mode in ("infer", "train"):
            step = step_fn(mode, model, x, y, optimizer, device)
            results = {}
            for which in variants:
                with variant(which):
                    for _ in range(args.warmup):
                        step()
                    results[which] = profile_steps(step, args.steps, device, mixer_names, layer_names)
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                        step()
                        synchronize(device)
                        results[which] += (torch.cuda.max_memory_allocated(device) / 2 ** 30,)
                    else:
                        results[which] += (float("nan"),)
            out += [f"## {model_name}, {'inference forward' if mode == 'infer' else 'training step'}", ""]
            rows = []
            for category in CATEGORIES:
                cells = [category]
                for which in variants:
                    groups, _, total, _ = results[which]
                    cells += [f"{groups[category]:.2f}", f"{100 * groups[category] / max(total, 1e-9):.0f}%"]
                rows.append(cells)
            rows.append(["**total**"] + sum(([f"**{results[w][2]:.2f}**", "100%"] for w in variants), []))
            rows.append(["peak memory (GiB)"] + sum(([f"{results[w][3]:.2f}", ""] for w in variants), []))
            out += [markdown_table(["GPU ms / step"] + sum(([w, "%"] for w in variants), []), rows), ""]
            for which in variants:
                top = results[which][1][:args.top]
                out += [f"Top kernels, {which}:", "",
                        markdown_table(["ms / step", "calls / step", "category", "kernel"],
                                       [[f"{ms:.3f}", f"{calls:g}", categorise(name, mixer_names, layer_names),
                                         name[:90].replace("|", "/")] for ms, calls, name in top]), ""]
            print("\n".join(out[-30:]), flush=True)
        if not args.compile:
            out += layer_share_report(model_name, model, x, args, device)
        del model, optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["comba_vision_S", "gka_vision_T"])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="steps before profiling (Triton compiles here)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per layer-share measurement")
    parser.add_argument("--top", type=int, default=15, help="kernels listed per variant")
    parser.add_argument("--device", default=None)
    parser.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE",
                        help="torch.compile the model in MODE (bare: default) and profile it once, without the layer "
                        "share")
    parser.add_argument("--out", default=None, help="also write the markdown report here")
    args = parser.parse_args(argv)
    report = run(args)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
