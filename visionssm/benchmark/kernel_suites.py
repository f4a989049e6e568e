"""Kernel suites: every op the registered mixers run, next to its anchors (SDPA, flash-linear-attention, mamba_ssm,
``torch.compile``), in one run.

    visionssm-benchmark kernels                          # every op, every shape (GPU)
    visionssm-benchmark kernels --ops gka --quick        # one op, its first shape only
    visionssm-benchmark kernels --out results/           # JSON/CSV into results/ (default ./benchmark-results)

The ops come from the mixer registry (:func:`visionssm.layers.mixer_kernel_ops`). Each op's cases live beside this
runner, in ``visionssm.benchmark.suites.<op>``: a module with ``ANCHOR`` (the implementation the ratios are taken
against) and ``run(quick: bool, copy_gbps: float | None) -> list[dict]`` returning rows with ``op, shape, mode,
impl, ms`` (optionally ``GB/s``, ``%copy``, and for plain calls ``host_ms`` / ``host_bound``: their host side
alone, and whether it set the rate, cleared where the implementation's CUDA-graph row shows the GPU did; a
host-bound value is marked ‡ in the table). The suites time Triton kernels on a GPU: without CUDA each one prints a
single skip line, nothing is written and the exit status is 0. A suite that measures nothing writes nothing; a suite
that fails is reported and the others still run (exit status 1).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from visionssm.layers import mixer_kernel_ops

from .cli import DEFAULT_OUT
from .cli import build_kernels_parser as build_parser
from .cli import kernels_main as main
from .harness import copy_bandwidth_gbps, environment, save_results, settle_host_bound, side_by_side

__all__ = ["DEFAULT_OUT", "build_parser", "load_suite", "main", "run_suites"]


#: The module of an op's suite.
SUITE_MODULE = "visionssm.benchmark.suites.{op}"


def load_suite(op: str) -> ModuleType:
    """The benchmark module of kernel op ``op``; ``ValueError`` when the op has none or it lacks the contract."""
    ops = mixer_kernel_ops()
    if op not in ops:
        raise ValueError(f"ops: {op!r} is not a kernel op of a registered mixer ({', '.join(ops)})")
    name = SUITE_MODULE.format(op=op)
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:
            raise
        raise ValueError(f"ops: kernel op {op!r} has no benchmark suite ({name})") from None
    missing = [attr for attr in ("ANCHOR", "run") if not hasattr(module, attr)]
    if missing:
        raise ValueError(f"ops: {name} lacks {' and '.join(missing)}")
    return module


def run_suites(ops: Sequence[str], *, quick: bool = False, out: str | Path | None = DEFAULT_OUT, log=print) -> int:
    """Run the suites of ``ops`` and write their rows to ``out`` (``None``: print only). Returns the exit status."""
    suites = {op: load_suite(op) for op in dict.fromkeys(ops)}
    if not torch.cuda.is_available():
        for op in suites:
            log(f"{op}: skipped, its kernel suite times the Triton kernels on a CUDA GPU and none is available "
                "(nothing written)", flush=True)
        return 0
    env = environment()
    copy_gbps = copy_bandwidth_gbps()
    env["copy_GBps"] = copy_gbps
    log(f"# {env['device']}  torch {env['torch']}  triton {env['triton']}  {env['date']}"
        + (f"  copy ceiling {copy_gbps:.0f} GB/s" if copy_gbps else ""), flush=True)
    measured: dict[str, list[dict]] = {}
    tables, failed = [], []
    for op, suite in suites.items():
        try:
            rows = suite.run(quick=quick, copy_gbps=copy_gbps)
        except Exception as error:  # noqa: BLE001 - one broken suite must not lose the others' numbers
            failed.append(op)
            log(f"{op}: suite failed: {type(error).__name__}: {error}", flush=True)
            continue
        if not rows:
            log(f"{op}: skipped, its suite measured nothing (nothing written)", flush=True)
            continue
        measured[op] = settle_host_bound(rows)
        # read after run(): a suite may pick its anchor by what it could measure on this machine
        tables.append(f"## {op}\n" + side_by_side(rows, keys=["shape", "mode"], baseline=suite.ANCHOR))
    if measured and out is not None:
        # A run of some of the ops is named after them, so it does not overwrite a full run of the same day.
        name = "kernels" if set(measured) == set(mixer_kernel_ops()) else "kernels-" + "-".join(measured)
        paths = save_results(name, [row for rows in measured.values() for row in rows], out_dir=out, env=env)
        log("wrote", *(str(path.resolve()) for path in paths), flush=True)
    if tables:
        log("\n\n".join(tables))
    return 1 if failed else 0
