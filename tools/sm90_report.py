"""Compile a Triton kernel for Hopper (sm_90a) on a machine without a GPU and report registers, spills and shared
memory, as ``ptxas -v`` prints them. Catches what Triton's interpreter accepts but the GPU compiler does not, and
register spills, before any device time is spent.

    from tools.sm90_report import sm90_report
    print(sm90_report(my_kernel, {"x": "*bf16", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 64}, num_warps=4))

``signature`` maps every kernel argument to a Triton type string (``*fp32``, ``*bf16``, ``i32``, ``fp32``, ...)
or ``constexpr``; ``constexprs`` gives the constexpr values.
"""

from __future__ import annotations

import re
import subprocess
import tempfile


def pointers_aligned(fn, signature: dict) -> dict:
    """Triton's ``attrs`` that mark every pointer argument of ``signature`` 16-byte aligned, as a launch on tensors
    from PyTorch's allocator is specialised."""
    names = list(fn.arg_names)
    return {(names.index(name),): [["tt.divisibility", 16]] for name, kind in signature.items() if kind.startswith("*")}


def sm90_report(fn, signature: dict, constexprs: dict, *, num_warps: int = 4, num_stages: int = 3,
                max_registers: int | None = None, aligned: bool = True) -> dict:
    """``{"registers", "spill_stores", "spill_loads", "stack", "shared"}`` of ``fn`` compiled for sm_90a
    (``max_registers``: Triton's ``maxnreg`` cap per thread, as a launch would pass it; ``aligned``: every pointer
    16-byte aligned, as Triton specializes a launch on tensors from PyTorch's allocator — without it the compiler
    must assume scalar loads, and reports far more registers than the kernel launched on the GPU uses)."""
    import triton
    import triton.backends.nvidia.compiler as nvidia
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                       attrs=pointers_aligned(fn, signature) if aligned else None)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if max_registers is not None:
        options["maxnreg"] = max_registers
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        log = subprocess.run([nvidia.get_ptxas(90).path, "-v", "--gpu-name=sm_90a", ptx.name, "-o", "/dev/null"],
                             capture_output=True, text=True, check=True).stderr

    def number(pattern: str) -> int:
        found = re.search(pattern, log)
        return int(found.group(1)) if found else 0

    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "stack": number(r"(\d+) bytes stack frame"),
            "shared": compiled.metadata.shared}
