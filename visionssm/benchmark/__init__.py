"""``visionssm-benchmark``: the backbone benchmark (any timm models side by side, :mod:`.cli`) and the kernel suites
(``visionssm-benchmark kernels``, :mod:`.kernel_suites`).

Split by stage: :mod:`.config` (settings, checks and the FLOP/timing rules), :mod:`.measure` (one model on one
device), :mod:`.parallel` (the whole run, data-parallel included), :mod:`.report` (table, chart, files);
:mod:`.harness` is the timing, result files and side-by-side tables every benchmark shares (the kernel suites in
:mod:`.suites` and the scripts in the checkout's ``benchmarks/`` too).
The names below load on first use: the command (``visionssm-benchmark`` runs :func:`main`) parses its arguments
before torch is imported.
"""

import importlib

from .cli import build_parser, main

# public name -> the submodule that defines it
_LAZY = {
    "FLOP_RULE": "config", "TIMING_RULE": "config", "BenchmarkConfig": "config", "resolve_models": "config",
    "validate_config": "config", "visionssm_models": "config", "DEFAULT_OUT": "kernel_suites",
    "run_suites": "kernel_suites", "count_flops": "measure", "measure_model": "measure",
    "run_benchmark": "parallel", "format_table": "report", "plot_results": "report", "write_outputs": "report",
}

__all__ = ["DEFAULT_OUT", "FLOP_RULE", "TIMING_RULE", "BenchmarkConfig", "build_parser", "count_flops",
           "format_table", "main", "measure_model", "plot_results", "resolve_models", "run_benchmark", "run_suites",
           "validate_config", "visionssm_models", "write_outputs"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
