"""``visionssm-benchmark``: the backbone benchmark (any timm models side by side, :mod:`.cli`) and the kernel suites
(``visionssm-benchmark kernels``, :mod:`.kernel_suites`).

Split by stage: :mod:`.config` (settings, checks and the FLOP/timing rules), :mod:`.measure` (one model on one
device), :mod:`.parallel` (the whole run, data-parallel included), :mod:`.report` (table, chart, files).
"""

from .cli import build_parser, main
from .config import FLOP_RULE, TIMING_RULE, BenchmarkConfig, resolve_models, validate_config, visionssm_models
from .kernel_suites import DEFAULT_OUT, run_suites
from .measure import count_flops, measure_model
from .parallel import run_benchmark
from .report import format_table, plot_results, write_outputs

__all__ = ["DEFAULT_OUT", "FLOP_RULE", "TIMING_RULE", "BenchmarkConfig", "build_parser", "count_flops",
           "format_table", "main", "measure_model", "plot_results", "resolve_models", "run_benchmark", "run_suites",
           "validate_config", "visionssm_models", "write_outputs"]
