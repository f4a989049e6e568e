"""How long each of a model's Triton kernels takes to compile for Hopper (sm_90a), measured without a GPU.

A first call from empty caches waits for every kernel to compile: eagerly, ours one after another as each launch
first runs; under ``torch.compile``, Inductor's and ours in its parallel workers, where the slowest single kernel
bounds the wait. This runs each model's forward and backward on CPU with every Triton launch captured
(:func:`tools.inductor_check.capture`), compiles each distinct launch to a cubin in a fresh cache, one after another,
and prints the seconds, longest first:

    python -m tools.compile_times gka_vision_T mamba_vision_T

Run it with the Triton of the GPU machine for its numbers (``PYTHONPATH`` to a side install works). The plans are
built for a CPU device, so a GPU's launch layouts (and so its set of kernels) can differ.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from unittest import mock

from tools import inductor_check
from tools.sm90_report import pointers_aligned


def compile_seconds(kernel, bound: dict, options: dict) -> float:
    """Seconds to compile one captured launch for sm_90a, its tensors 16-byte aligned as PyTorch's allocator gives
    them (what a launch on the GPU specialises on)."""
    import triton

    signature, constants = inductor_check._signature(kernel, bound)
    source = triton.compiler.ASTSource(kernel, signature, constants, pointers_aligned(kernel, signature))
    start = time.perf_counter()
    triton.compile(source, target=inductor_check.TARGET,
                   options={k: v for k, v in options.items() if k in ("num_warps", "num_stages", "maxnreg")})
    return time.perf_counter() - start


def compile_all(launches: dict) -> list[tuple[float, str]]:
    """(seconds, kernel name) of every launch of ``launches`` (as :func:`tools.inductor_check.capture` returns them),
    compiled in a fresh Triton cache, longest first."""
    with tempfile.TemporaryDirectory() as cache, mock.patch.dict(os.environ, {"TRITON_CACHE_DIR": cache}):
        rows = [(compile_seconds(kernel, bound, options), name)
                for (name, _), (kernel, bound, options) in launches.items()]
    return sorted(rows, reverse=True)


def main(argv: list[str] | None = None) -> int:
    import triton

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="timm model names (default: the T model of every family)")
    args = parser.parse_args(argv)
    triton.runtime.driver.set_active(inductor_check._Driver())
    for name in args.models or inductor_check.default_models():
        rows = compile_all(inductor_check.capture([name]))
        total = sum(seconds for seconds, _ in rows)
        print(f"{name}: {len(rows)} distinct launches, {total:.1f} s in all (Triton {triton.__version__})")
        for seconds, kernel in rows:
            print(f"  {seconds:7.2f} s  {kernel}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
