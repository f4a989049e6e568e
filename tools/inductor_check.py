"""Would Inductor take our Triton kernels into its own graph? A check that needs no GPU.

``torch.compile`` can trace through an op whose body launches Triton kernels (``torch.library.triton_op`` /
``wrap_triton``) and then launch them from its generated code, with none of a custom op's per-call host work. For
that it needs two things of every kernel: its mutation analysis must find the tensors the kernel writes (where it
fails or over-approximates, every input it names is cloned before the launch, and a weight that requires grad makes
compilation fail), and the kernel must compile with Inductor's argument types (a Python float becomes an fp64
scalar). This script runs a tiny model's eager forward and backward on CPU with every Triton launch captured instead
of run, and reports both for each distinct launch:

    python -m tools.inductor_check comba_vision_T gka_vision_T

Run it with the torch and Triton of the GPU machine (``PYTHONPATH`` to a side install works: the analysis differs
between torch versions). The plans are built for a CPU device, so launch layouts can differ from the GPU's.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JIT functions, which the analysis reads

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def declared_writes(kernel) -> set[str] | None:
    """The arguments ``kernel`` stores to, from the ``WRITES`` of the module that defines it (``None``: no entry)."""
    entry = getattr(sys.modules.get(kernel.fn.__module__), "WRITES", {}).get(kernel.fn.__name__)
    return None if entry is None else set(entry)


_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
           torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8", torch.bool: "i1"}


class _Driver:
    """Enough of a Triton driver for code generation without a GPU."""

    def get_current_target(self):
        return TARGET


def default_models() -> list[str]:
    """The T model of every family in :data:`visionssm.models.FAMILIES`."""
    from visionssm.models import FAMILIES

    return [f"{family}_T" for family in FAMILIES]


def default_preset(name: str) -> tuple[dict, int]:
    """(timm.create_model keyword arguments, input side) of model ``name`` when no preset is given: Comba's isotropic
    models at 64 px (their token count is what costs), the others at 224."""
    return ({"img_size": 64}, 64) if name.startswith("comba") else ({}, 224)


def capture(names: list[str], presets: dict | None = None, steps: tuple = ()) -> dict:
    """{(kernel name, constexprs): (kernel, {argument: value}, options)} of every launch the models' steps make.
    ``presets``: {name: (timm.create_model keyword arguments, input side)} for smaller networks than the defaults;
    ``steps``: callables run after the models, their launches captured too (an op called directly, for a variant
    no model preset reaches)."""
    import timm

    import visionssm  # noqa: F401
    from visionssm.kernels import dispatch

    dispatch._choose = lambda tensors, export: "triton"  # CPU tensors take the Triton path, as CUDA ones do
    launches = {}

    def run(kernel, *args, grid, warmup, **kwargs):
        bound = dict(zip(kernel.arg_names, args)) | {k: v for k, v in kwargs.items() if k in kernel.arg_names}
        options = {k: v for k, v in kwargs.items() if k not in kernel.arg_names}
        key = (kernel.fn.__name__, tuple(sorted((k, str(v)) for k, v in bound.items() if not torch.is_tensor(v)
                                                and kernel.params[kernel.arg_names.index(k)].is_constexpr)))
        launches.setdefault(key, (kernel, bound, options))

    triton.runtime.jit.JITFunction.run = run
    for name in names:
        kwargs, size = presets[name] if presets and name in presets else default_preset(name)
        model = timm.create_model(name, num_classes=10, **kwargs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            try:
                model(torch.randn(2, 3, size, size)).float().sum().backward()
            except Exception as error:  # noqa: BLE001 - nothing ran, so code past a launch may see bad shapes
                print(f"{name}: the step stopped early ({type(error).__name__}); launches so far are checked")
    for step in steps:
        step()
    return launches


def _signature(kernel, bound: dict) -> tuple[dict, dict]:
    signature, constants = {}, {}
    for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        value = bound[name]
        if param.is_constexpr or value is None:
            signature[name], constants[(i,)] = "constexpr", value
        elif torch.is_tensor(value):
            signature[name] = "*" + _DTYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i64" if abs(value) >= 2 ** 31 else "i32"
        else:
            signature[name] = "fp64"  # what Inductor's wrapper passes for a Python float
    return signature, constants


def analysed_writes(kernel, bound: dict) -> list[str] | None:
    """The tensor arguments torch's mutation analysis of a ``wrap_triton`` launch of ``kernel`` on ``bound`` takes as
    written (whichever of its functions this torch has); ``None`` when the analysis failed (torch then takes every
    tensor argument as written). Needs JIT functions (no ``TRITON_INTERPRET``) and a Triton driver that names a
    target (:class:`_Driver` off a GPU)."""
    from torch._higher_order_ops import triton_kernel_wrap

    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    log = logging.getLogger(triton_kernel_wrap.__name__)
    handler = Keep()
    log.addHandler(handler)
    propagate, log.propagate = log.propagate, False
    try:
        analyse = getattr(triton_kernel_wrap, "identify_mutated_tensors", None)
        if analyse is None:  # newer torch
            accessed = triton_kernel_wrap.identify_accessed_tensors(kernel, dict(bound), {})
            written = sorted(dep.name for dep in accessed.read_writes.writes)
        else:
            written = sorted(analyse(kernel, dict(bound), {}))
    finally:
        log.removeHandler(handler)
        log.propagate = propagate
    inputs = sorted(n for n, v in bound.items() if torch.is_tensor(v))
    # a failed analysis logs a warning and takes every tensor argument as written
    return None if messages or (len(inputs) > 1 and written == inputs) else written


def check(kernel, bound: dict, options: dict) -> tuple[str, str]:
    """(the analysis' written tensors, or why it failed; the TTIR build with Inductor's types)."""
    inputs = [n for n, v in bound.items() if torch.is_tensor(v)]
    written = analysed_writes(kernel, bound)
    declared = declared_writes(kernel)
    if written is None:
        analysis = f"FAILED (all {len(inputs)} tensors taken as written)"
    elif declared is None:
        analysis = f"writes {written}; FAILED: no entry in its module's WRITES"
    elif set(written) - declared:
        analysis = f"writes {written}; FAILED: not outputs {sorted(set(written) - declared)}"
    else:
        analysis = f"writes {written}"
    try:
        signature, constants = _signature(kernel, bound)
        backend = triton.compiler.compiler.make_backend(TARGET)
        opts = backend.parse_options({k: v for k, v in options.items() if k in ("num_warps", "num_stages")})
        context = triton._C.libtriton.ir.context()
        triton._C.libtriton.ir.load_dialects(context)
        backend.load_dialects(context)
        triton.compiler.ASTSource(kernel, signature, constants).make_ir(
            TARGET, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context)
        build = "ok"
    except Exception as error:  # noqa: BLE001 - reported per kernel
        while error.__cause__ is not None:  # Triton wraps the reason once per helper call level
            error = error.__cause__
        build = f"FAILED: {type(error).__name__}: {str(error).strip().splitlines()[-1][:120]}"
    return analysis, build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="timm model names (default: the T model of every family)")
    args = parser.parse_args(argv)
    triton.runtime.driver.set_active(_Driver())
    launches = capture(args.models or default_models())
    print(f"torch {torch.__version__}, Triton {triton.__version__}: {len(launches)} distinct launches")
    bad = 0
    for (name, _), (kernel, bound, options) in sorted(launches.items(), key=lambda item: item[0]):
        analysis, build = check(kernel, bound, options)
        bad += "FAILED" in analysis + build
        print(f"{name:36s} analysis: {analysis}\n{'':36s} build with Inductor's types: {build}")
    return int(bad > 0)


if __name__ == "__main__":
    raise SystemExit(main())
