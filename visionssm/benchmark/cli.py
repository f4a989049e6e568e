"""Backbone benchmark: throughput, latency and memory of any timm models (visionssm's and timm's), side by side.

    visionssm-benchmark mamba_vision_T gka_vision_T convnext_tiny resnet50 \\
        --batch-size 256 --img-size 224 --dtype bf16 --channels-last --baseline convnext_tiny
    visionssm-benchmark comba_vision_S deit_small_patch16_224 --img-size 224 384 512 768 1024 --batch-size 256
    visionssm-benchmark gka_vision_T --model-kwargs global_mixer=True --img-size 1024 --batch-size 8
    visionssm-benchmark resnet18 test_vit --device cpu --batch-size 4 --img-size 64   # try it on a CPU
    visionssm-benchmark kernels --ops gka --quick                                     # the kernel suites
    (python -m visionssm.benchmark ... is the same command)

For every model it measures, on one device:

* inference img/s at ``--batch-size`` (eval mode, no grad),
* training img/s at ``--batch-size`` (one step = forward, cross-entropy, backward, AdamW step),
* latency at batch 1 (eval mode, milliseconds),
* peak memory of the inference and training runs (CUDA only),
* parameters and GFLOPs (see ``FLOP_RULE``),

timed with CUDA events (warm-up, then median and p20/p80 of ``--repeats`` runs; ``time.perf_counter`` on CPU) by
:func:`visionssm.benchmark.harness.time_fn`. With more than one visible GPU it also measures data-parallel throughput,
one process per GPU (``torch.multiprocessing``, or the processes of ``accelerate launch`` / ``torchrun``), each at
``--batch-size`` images, training through DistributedDataParallel; the total img/s over all GPUs is reported
(as in the GKA paper's Table 3). On one GPU or a CPU the data-parallel columns repeat the single-device numbers.
With ``--cuda-graph`` the single-device inference, latency and whole training step (forward, loss, backward and a
capturable fused AdamW) are captured once and replayed: the GPU's time without the host's per-op work, which small
models at batch 256 can be bound by in eager mode (data-parallel training stays eager). Eager runs also time a few
calls' host side alone, each started with the GPU idle (``*_host_ms`` in the files); a throughput whose host side is
at least 90% of its time per call is marked ``‡`` in the table: the CPU that enqueues the work sets that rate or
comes close to it, and it moves with that CPU's speed and load.

With several ``--img-size`` values every model is measured at each, the batch scaled from ``--batch-size`` at the
first size to the same pixels per batch (or one ``--batch-size`` per size), and the chart is img/s and peak memory
against resolution, one line per model and mode.

It prints one line per model (and resolution) with ratios to ``--baseline`` and writes
``throughput-<device>-<date>.json``/``.csv`` (with the GPU, software versions and date) and a ``.png`` chart of
inference throughput against parameters or GFLOPs into ``--out`` (default ``./benchmark-results`` in the working
directory). Names that ``--skip-unknown`` leaves out are not in the files, and a run stopped by a bad argument writes
nothing; a model that fails (e.g. out of memory) keeps a row with its ``error``, which the regression check flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

# Only what parsing needs: torch, timm and the models load once the arguments parse (see _run_models).
from visionssm.utils.cli import COMPILE_MODES, ArgumentParser, run_main

if TYPE_CHECKING:
    from .config import BenchmarkConfig

__all__ = ["CHART_AXES", "DEFAULT_OUT", "MODES", "build_kernels_parser", "build_parser", "kernels_main", "main"]

#: What a model run can measure, in the order the table shows it.
MODES = ("infer", "train", "latency")
#: The x axes the chart can plot inference throughput against.
CHART_AXES = ("params", "gflops")
#: Where results go unless told otherwise: a folder in the working directory, never inside the installed package.
DEFAULT_OUT = Path("benchmark-results")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="visionssm-benchmark", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Subcommand: `visionssm-benchmark kernels [--ops ...] [--quick] [--out DIR]` runs the kernel suites "
               "(`visionssm-benchmark kernels --help`).")
    p.add_argument("models", nargs="*", help="timm model names or patterns (e.g. 'gka_vision_*')")
    p.add_argument("--batch-size", "-b", type=int, nargs="+", default=None, metavar="N",
                   help="per device (default 256 on GPU, 4 on CPU): one value, at the first --img-size and scaled to "
                   "the same pixels per batch at the others, or one value per --img-size")
    p.add_argument("--img-size", type=int, nargs="+", default=[224], metavar="PX",
                   help="square input resolution(s) (default 224); several: every model at each, and a chart of "
                   "img/s and peak memory against resolution")
    p.add_argument("--model-kwargs", nargs="*", default={}, action=_ParseKwargs, metavar="KEY=VALUE",
                   help="extra timm.create_model kwargs of every model, as timm's scripts take them (values read as "
                   "Python literals), e.g. --model-kwargs global_mixer=True")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (aliases fp32, bf16, fp16); default "
                   "bfloat16 on a GPU, float32 on CPU (where bf16 autocast is several times slower)")
    p.add_argument("--precision", default="amp", help="amp: fp32 weights under autocast(dtype) (default; no autocast "
                   "for float32); pure: weights and inputs cast to dtype")
    p.add_argument("--channels-last", action="store_true", help="model and input in channels_last memory format")
    p.add_argument("--compile", nargs="?", const="default", default=None, type=_compile_mode, metavar="MODE",
                   help=f"torch.compile the model, in MODE: {', '.join(COMPILE_MODES)} (bare --compile: default); "
                   "its first call's seconds are reported apart")
    p.add_argument("--cuda-graph", action="store_true", help="replay a captured CUDA graph (inference, latency and, on "
                   "one device, the whole training step: GPU time without the host's per-op work)")
    p.add_argument("--modes", nargs="+", default=list(MODES), help=f"subset of {MODES}")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls (default 10)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls (default 50; 5 on CPU)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default cuda when available)")
    p.add_argument("--baseline", default=None, help="model the ratios are taken against (default: the first)")
    p.add_argument("--gpus", default="auto", help="data-parallel processes: 'auto' (all visible GPUs), 1 (off) or N")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--no-flops", action="store_true", help="skip the FLOP count")
    p.add_argument("--skip-unknown", action="store_true", help="leave out (with a warning) model names this timm "
                   "version does not know, instead of stopping")
    p.add_argument("--chart", default="params", help="x axis of the PNG chart: params or gflops")
    p.add_argument("--out", "--out-dir", dest="out", default=str(DEFAULT_OUT),
                   help=f"folder for JSON/CSV/PNG (default ./{DEFAULT_OUT} in the working directory)")
    p.add_argument("--name", default="throughput", help="file name prefix (default 'throughput')")
    p.add_argument("--no-save", action="store_true", help="print the table only")
    p.add_argument("--kernels", action="store_true", help="also run the kernel suites (into the same --out)")
    return p


class _ParseKwargs(argparse.Action):
    """``KEY=VALUE`` pairs into a dict, each value a Python literal where it reads as one (else the string), as timm's
    ``--model-kwargs``."""

    def __call__(self, parser, namespace, values, option_string=None):
        import ast

        kwargs = {}
        for item in values:
            key, sep, text = item.partition("=")
            if not sep or not key.isidentifier():
                parser.error(f"{option_string} takes KEY=VALUE pairs, got {item!r}")
            try:
                kwargs[key] = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                kwargs[key] = text
        setattr(namespace, self.dest, kwargs)


def _compile_mode(text: str) -> str:
    if text not in COMPILE_MODES:
        # a bare --compile in front of the model names takes the first name as its mode
        raise argparse.ArgumentTypeError(f"unknown mode {text!r}: one of {', '.join(COMPILE_MODES)} (model names go "
                                         "before a bare --compile)")
    return text


def _config_from_args(args: argparse.Namespace) -> BenchmarkConfig:
    import torch

    from .config import BenchmarkConfig

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_cpu = device.startswith("cpu")
    if args.chart not in CHART_AXES:
        raise ValueError(f"chart must be one of {CHART_AXES}, got {args.chart!r}")
    gpus = str(args.gpus).strip().lower()
    if gpus == "auto":
        data_parallel = max(1, torch.cuda.device_count()) if (not on_cpu and torch.cuda.is_available()) else 1
    else:
        try:
            data_parallel = int(gpus)
        except ValueError:
            raise ValueError(f"gpus must be 'auto' or a positive integer, got {args.gpus!r}") from None
    batches = args.batch_size or [4 if on_cpu else 256]
    return BenchmarkConfig(
        models=list(args.models), batch_size=batches[0], batch_sizes=tuple(batches), img_size=args.img_size[0],
        img_sizes=tuple(args.img_size), model_kwargs=dict(args.model_kwargs),
        dtype=args.dtype or ("float32" if on_cpu else "bfloat16"), precision=args.precision,
        channels_last=args.channels_last,
        compile=args.compile is not None, compile_mode=args.compile or "default", modes=tuple(args.modes),
        warmup=args.warmup if args.warmup is not None else 10,
        repeats=args.repeats if args.repeats is not None else (5 if on_cpu else 50), device=device,
        baseline=args.baseline, cuda_graph=args.cuda_graph, data_parallel=data_parallel,
        num_classes=args.num_classes, count_flops=not args.no_flops, skip_unknown=args.skip_unknown)


def _stamp(cfg: BenchmarkConfig, argv: list[str]) -> dict:
    """The environment stamp of a results file, with the settings and rules the numbers were taken under."""
    import timm

    from .config import FLOP_RULE, TIMING_RULE
    from .harness import environment

    env = environment(cfg.device)
    env.update({"timm": timm.__version__, "benchmark": dataclasses.asdict(cfg), "flop_rule": FLOP_RULE,
                "timing_rule": TIMING_RULE, "command": "visionssm-benchmark " + " ".join(argv)})
    env["benchmark"]["modes"] = list(cfg.modes)
    return env


def _run_models(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> int:
    import visionssm.models  # noqa: F401  (registers the visionssm backbones with timm)

    from .harness import save_results
    from .parallel import launched_rank, run_benchmark
    from .report import format_table, write_outputs

    out = None if args.no_save else Path(args.out)
    stamp: dict = {}

    def save_so_far(rows: list[dict]) -> None:
        # after every model, so a run cut short keeps what it measured; the settings are validated by then
        if out is not None:
            stamp.setdefault("env", _stamp(cfg, argv))
            save_results(args.name, rows, out_dir=out, env=stamp["env"])

    rank0 = launched_rank() is None or launched_rank()[0] == 0
    try:
        cfg = _config_from_args(args)
        rows = run_benchmark(cfg, log=print if rank0 else (lambda *a, **k: None), on_row=save_so_far)
    except ValueError as error:
        parser.error(str(error))
    if not rank0:
        return 0
    for problem in cfg.skipped:
        print(f"warning: skipped {problem}", file=sys.stderr)
    env = stamp.get("env") or _stamp(cfg, argv)
    print(format_table(rows, cfg.baseline, env))
    if out is not None:
        paths = write_outputs(rows, env, name=args.name, out_dir=out, chart=args.chart)
        print("wrote", *[str(p.resolve()) for p in paths if p is not None])
    return 1 if any(r.get("error") or r.get("dp_error") for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    """The command line: exit status 0, 1 when a model failed, 2 with one error line for a bad argument."""
    return run_main(_main, argv, prog="visionssm-benchmark")


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["kernels"]:
        return kernels_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    status = 0
    if args.models or not args.kernels:
        status = _run_models(parser, args, argv)
    if args.kernels:
        kernel_argv = ["--no-save"] if args.no_save else ["--out", args.out]
        status = max(status, kernels_main(kernel_argv))
    return status


def build_kernels_parser(default_out: str | Path = DEFAULT_OUT) -> argparse.ArgumentParser:
    """The parser of ``visionssm-benchmark kernels`` (its text is :mod:`.kernel_suites`' docstring, read as a file so
    that parsing imports nothing the suites need)."""
    doc = _module_docstring(Path(__file__).with_name("kernel_suites.py"))
    parser = ArgumentParser(prog="visionssm-benchmark kernels", description=doc,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", nargs="+", default=None, metavar="OP",
                        help="kernel ops of the registered mixers (default: all of them)")
    parser.add_argument("--quick", action="store_true", help="first shape only (a smoke run)")
    parser.add_argument("--out", "--out-dir", dest="out", default=str(default_out),
                        help=f"folder for the JSON/CSV results (default {default_out})")
    parser.add_argument("--no-save", action="store_true", help="print the tables only")
    return parser


def kernels_main(argv: Sequence[str] | None = None, *, default_out: str | Path = DEFAULT_OUT) -> int:
    """``visionssm-benchmark kernels``: parse, check the ops (an unknown one is a one-line error), run the suites."""
    parser = build_kernels_parser(default_out)
    args = parser.parse_args(argv)
    from visionssm.layers import mixer_kernel_ops

    from .kernel_suites import load_suite, run_suites

    ops = list(dict.fromkeys(args.ops or mixer_kernel_ops()))
    try:
        for op in ops:
            load_suite(op)
    except ValueError as error:
        parser.error(str(error))
    return run_suites(ops, quick=args.quick, out=None if args.no_save else args.out)


def _module_docstring(path: Path) -> str | None:
    import ast

    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
