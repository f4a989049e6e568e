"""Backbone benchmark: throughput, latency and memory of any timm models (visionssm's and timm's), side by side.

    python -m visionssm.benchmark mamba_vision_T gka_vision_T convnext_tiny resnet50 \\
        --batch-size 256 --img-size 224 --dtype bf16 --channels-last --baseline convnext_tiny
    python -m visionssm.benchmark resnet18 test_vit --device cpu --batch-size 4 --img-size 64   # try it on a CPU
    python -m visionssm.benchmark kernels --ops gka --quick                                       # kernel suite

For every model it measures, on one device:

* inference img/s at ``--batch-size`` (eval mode, no grad),
* training img/s at ``--batch-size`` (one step = forward, cross-entropy, backward, AdamW step),
* latency at batch 1 (eval mode, milliseconds),
* peak memory of the inference and training runs (CUDA only),
* parameters and GFLOPs (see ``FLOP_RULE``),

timed with CUDA events (warm-up, then median and p20/p80 of ``--repeats`` runs; ``time.perf_counter`` on CPU) by
:func:`visionssm.utils.benchmark.time_fn`. With more than one visible GPU it also measures data-parallel throughput,
one process per GPU (``torch.multiprocessing``, or the processes of ``accelerate launch`` / ``torchrun``), each at
``--batch-size`` images, training through DistributedDataParallel; the total img/s over all GPUs is reported
(as in the GKA paper's Table 3). On one GPU or a CPU the data-parallel columns repeat the single-device numbers.

It prints one line per model with ratios to ``--baseline`` and writes ``throughput-<device>-<date>.json``/``.csv`` (with
the GPU, software versions and date) and a ``.png`` chart of inference throughput against parameters or GFLOPs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import difflib
import gc
import json
import os
import socket
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from visionssm.utils.benchmark import RESULTS_DIR, Timing, environment, save_results, time_fn

__all__ = ["FLOP_RULE", "BenchmarkConfig", "count_flops", "format_table", "main", "plot_results", "resolve_models",
           "run_benchmark", "validate_config", "write_outputs"]

FLOP_RULE = ("GFLOPs = 2 x multiply-accumulates of one forward pass of a 1x3xHxW image, as counted by "
             "torch.utils.flop_counter.FlopCounterMode: convolutions, linear layers and matmuls including attention "
             "(scaled_dot_product_attention); element-wise ops, norms and activations are not counted, nor are "
             "visionssm's sequence-mixer ops (selective_scan, gka, comba), as with the ptflops/fvcore GMACs that "
             "MambaVision and timm quote. GMACs = GFLOPs / 2.")
TIMING_RULE = ("CUDA events around each call after warm-up (time.perf_counter on CPU); median, p20 and p80 of the "
               "repeats; img/s = batch / median time. Training step = forward + cross-entropy + backward + AdamW "
               "step (no gradient scaler). Data-parallel: one process per GPU, --batch-size images per GPU, total "
               "img/s summed over GPUs; training through DistributedDataParallel.")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
PRECISIONS = ("amp", "pure")
MODES = ("infer", "train", "latency")
CHART_AXES = ("params", "gflops")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclasses.dataclass
class BenchmarkConfig:
    """Everything one benchmark run depends on (also written into the JSON)."""

    models: list[str]
    batch_size: int = 256
    img_size: int = 224
    dtype: str = "bfloat16"
    precision: str = "amp"
    channels_last: bool = False
    compile: bool = False
    compile_mode: str = "default"
    modes: tuple[str, ...] = MODES
    warmup: int = 10
    repeats: int = 50
    device: str = "cuda"
    baseline: str | None = None
    cuda_graph: bool = False
    data_parallel: int = 1
    num_classes: int = 1000
    count_flops: bool = True
    skip_unknown: bool = False
    skipped: list[str] = dataclasses.field(default_factory=list)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def resolve_models(names: Sequence[str], skipped: list[str] | None = None) -> list[str]:
    """Expand wildcards (``'gka_vision_*'``) and check every name is a timm model; ``ValueError`` otherwise.
    With a ``skipped`` list, unknown names are appended to it (with the reason) instead of raising."""
    import timm
    from timm.models import split_model_name_tag

    resolved: list[str] = []
    for name in names:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"model names must be non-empty strings, got {name!r}")
        if any(ch in name for ch in "*?["):
            matches = timm.list_models(name)
            if not matches:
                problem = f"model pattern {name!r} matches no timm model"
                if skipped is None:
                    raise ValueError(problem)
                skipped.append(problem)
            resolved += [m for m in matches if m not in resolved]
            continue
        base, _ = split_model_name_tag(name)
        if not timm.is_model(base):
            close = difflib.get_close_matches(base, timm.list_models(), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            problem = f"unknown model {name!r}{hint}"
            if skipped is None:
                raise ValueError(problem)
            skipped.append(problem)
            continue
        if name not in resolved:
            resolved.append(name)
    return resolved


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def validate_config(cfg: BenchmarkConfig) -> BenchmarkConfig:
    """Check and normalise every field; raise ``ValueError`` naming the bad argument."""
    if not cfg.models:
        raise ValueError("models: give at least one timm model name")
    cfg.skipped = []
    cfg.models = resolve_models(cfg.models, cfg.skipped if cfg.skip_unknown else None)
    if not cfg.models:
        raise ValueError("models: none of the given names is a timm model: " + "; ".join(cfg.skipped))
    _check_int("batch_size", cfg.batch_size, 1)
    _check_int("img_size", cfg.img_size, 1)
    _check_int("warmup", cfg.warmup, 0)
    _check_int("repeats", cfg.repeats, 1)
    _check_int("num_classes", cfg.num_classes, 1)
    dtype = str(cfg.dtype).lower().replace("torch.", "")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(set(DTYPES))}, got {cfg.dtype!r}")
    cfg.dtype = str(DTYPES[dtype]).replace("torch.", "")
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {cfg.precision!r}")
    if cfg.compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got {cfg.compile_mode!r}")
    modes = tuple(cfg.modes)
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"modes must be a non-empty subset of {MODES}, got {list(modes)!r}")
    cfg.modes = tuple(m for m in MODES if m in modes)
    try:
        device = torch.device(cfg.device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device: {error}") from None
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', got {cfg.device!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but CUDA is not available (use --device cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {cfg.device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif cfg.cuda_graph:
        raise ValueError("cuda_graph needs a CUDA device")
    cfg.device = str(device)
    _check_int("data_parallel", cfg.data_parallel, 1)
    if device.type == "cuda" and cfg.data_parallel > torch.cuda.device_count():
        raise ValueError(f"data_parallel={cfg.data_parallel} but only {torch.cuda.device_count()} GPU(s) are visible")
    if cfg.baseline is None:
        cfg.baseline = cfg.models[0]
    elif cfg.baseline not in cfg.models:
        raise ValueError(f"baseline {cfg.baseline!r} is not one of the benchmarked models {cfg.models}")
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# Measuring one model


def _create_model(name: str, cfg: BenchmarkConfig, device: torch.device) -> torch.nn.Module:
    import timm

    torch.manual_seed(0)
    kwargs = {"pretrained": False, "num_classes": cfg.num_classes}
    try:
        model = timm.create_model(name, img_size=cfg.img_size, **kwargs)
    except TypeError as error:
        # Convolutional models take any resolution and do not accept img_size.
        if "img_size" not in str(error):
            raise
        model = timm.create_model(name, **kwargs)
    if cfg.precision == "pure":
        model = model.to(cfg.torch_dtype)
    model = model.to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def _family(model: torch.nn.Module) -> str:
    return "visionssm" if type(model).__module__.startswith("visionssm") else "timm"


def _input(cfg: BenchmarkConfig, batch: int, device: torch.device) -> torch.Tensor:
    dtype = cfg.torch_dtype if cfg.precision == "pure" else torch.float32
    x = torch.randn(batch, 3, cfg.img_size, cfg.img_size, device=device, dtype=dtype)
    return x.contiguous(memory_format=torch.channels_last) if cfg.channels_last else x


def _autocast(cfg: BenchmarkConfig, device: torch.device):
    enabled = cfg.precision == "amp" and cfg.torch_dtype != torch.float32
    # CUDA-graph capture must not reuse autocast's weight-cast cache from outside the graph.
    return torch.autocast(device.type, dtype=cfg.torch_dtype, enabled=enabled, cache_enabled=not cfg.cuda_graph)


@contextlib.contextmanager
def _mixer_ops_excluded(counter):
    """Wrap visionssm's sequence-mixer ops so the FLOPs counted inside them can be taken out of the total.
    The layers call them as attributes of :mod:`visionssm.kernels`, which is where the wrappers go."""
    try:
        import visionssm.kernels as kernel_ops
    except ImportError:  # pragma: no cover - visionssm.kernels is part of the package
        yield [0]
        return
    excluded = [0]
    originals = {}

    def wrap(op):
        def counted_apart(*args, **kwargs):
            before = counter.get_total_flops()
            try:
                return op(*args, **kwargs)
            finally:
                excluded[0] += counter.get_total_flops() - before
        return counted_apart

    from visionssm.layers import mixer_kernel_ops

    for name in mixer_kernel_ops():
        try:
            originals[name] = getattr(kernel_ops, name)
        except (AttributeError, ImportError):
            continue
        setattr(kernel_ops, name, wrap(originals[name]))
    try:
        # The PyTorch reference path: no Triton compilation just to count, and the same count on CPU and GPU.
        with kernel_ops.backend("torch"):
            yield excluded
    finally:
        for name, op in originals.items():
            setattr(kernel_ops, name, op)


def count_flops(model: torch.nn.Module, img_size: int, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> float:
    """GFLOPs of one forward pass of a single image, counted as stated in :data:`FLOP_RULE`."""
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(1, 3, img_size, img_size, device=device, dtype=dtype)
    was_training = model.training
    model.eval()
    counter = FlopCounterMode(display=False)
    try:
        with torch.no_grad(), counter, _mixer_ops_excluded(counter) as excluded:
            model(x)
    finally:
        model.train(was_training)
    return (counter.get_total_flops() - excluded[0]) / 1e9


def _timing_fields(prefix: str, timing: Timing, batch: int) -> dict:
    return {f"{prefix}_img_s": batch / (timing.median_ms / 1e3) if timing.median_ms > 0 else None,
            f"{prefix}_ms": timing.median_ms, f"{prefix}_p20_ms": timing.p20_ms, f"{prefix}_p80_ms": timing.p80_ms,
            f"{prefix}_spread": timing.spread}


def _reset_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_mib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2**20


def _maybe_compile(model: torch.nn.Module, cfg: BenchmarkConfig):
    return torch.compile(model, mode=None if cfg.compile_mode == "default" else cfg.compile_mode) if cfg.compile \
        else model


def _inference_fn(model, runner, cfg: BenchmarkConfig, batch: int, device: torch.device):
    model.eval()
    x = _input(cfg, batch, device)

    def step():
        with torch.no_grad(), _autocast(cfg, device):
            return runner(x)

    return step


def _training_fn(model, runner, cfg: BenchmarkConfig, batch: int, device: torch.device):
    model.train()
    x = _input(cfg, batch, device)
    target = torch.randint(0, cfg.num_classes, (batch,), device=device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6, fused=device.type == "cuda")

    def step():
        with _autocast(cfg, device):
            loss = torch.nn.functional.cross_entropy(runner(x).float(), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if hasattr(torch, "_dynamo"):
        torch._dynamo.reset()


def measure_model(name: str, cfg: BenchmarkConfig, device: torch.device) -> dict:
    """All single-device numbers for one model (a failure, e.g. out of memory, is recorded in ``error``)."""
    row: dict = {"model": name, "family": None, "params_M": None, "gflops": None, "batch_size": cfg.batch_size,
                 "img_size": cfg.img_size, "dtype": cfg.dtype, "precision": cfg.precision,
                 "channels_last": cfg.channels_last, "compile": cfg.compile}
    model = None
    try:
        model = _create_model(name, cfg, device)
        row["family"] = _family(model)
        row["params_M"] = sum(p.numel() for p in model.parameters()) / 1e6
        if cfg.count_flops:
            flop_dtype = cfg.torch_dtype if cfg.precision == "pure" else torch.float32
            row["gflops"] = count_flops(model, cfg.img_size, device, flop_dtype)
        runner = _maybe_compile(model, cfg)
        timing_kwargs = {"warmup": cfg.warmup, "repeats": cfg.repeats, "device": device}
        if "infer" in cfg.modes:
            _reset_memory(device)
            step = _inference_fn(model, runner, cfg, cfg.batch_size, device)
            row.update(_timing_fields("infer", time_fn(step, cuda_graph=cfg.cuda_graph, **timing_kwargs),
                                      cfg.batch_size))
            row["infer_peak_MiB"] = _peak_mib(device)
        if "train" in cfg.modes:
            _reset_memory(device)
            step = _training_fn(model, runner, cfg, cfg.batch_size, device)
            row.update(_timing_fields("train", time_fn(step, **timing_kwargs), cfg.batch_size))
            row["train_peak_MiB"] = _peak_mib(device)
            model.zero_grad(set_to_none=True)
        if "latency" in cfg.modes:
            step = _inference_fn(model, runner, cfg, 1, device)
            latency = time_fn(step, cuda_graph=cfg.cuda_graph, **timing_kwargs)
            row.update({"latency_ms": latency.median_ms, "latency_p20_ms": latency.p20_ms,
                        "latency_p80_ms": latency.p80_ms})
        row["error"] = None
    except Exception as error:  # noqa: BLE001 - one failing model must not lose the others' numbers
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
    finally:
        del model
        _release(device)
    return row


# ---------------------------------------------------------------------------------------------------------------
# Data-parallel throughput (one process per device)


def _measure_data_parallel(cfg: BenchmarkConfig, device: torch.device, rank: int, world: int) -> dict[str, dict]:
    """Run inside every rank of an initialised process group; returns (on every rank) the total img/s per model."""
    import torch.distributed as dist

    totals: dict[str, dict] = {}
    timing_kwargs = {"warmup": cfg.warmup, "repeats": cfg.repeats, "device": device}
    for name in cfg.models:
        local: dict = {}
        model = None
        try:
            model = _create_model(name, cfg, device)
            runner = _maybe_compile(model, cfg)
            if "infer" in cfg.modes:
                step = _inference_fn(model, runner, cfg, cfg.batch_size, device)
                dist.barrier()
                local["infer"] = time_fn(step, cuda_graph=cfg.cuda_graph, **timing_kwargs).median_ms
            if "train" in cfg.modes:
                ddp = torch.nn.parallel.DistributedDataParallel(
                    model, device_ids=[device.index] if device.type == "cuda" else None)
                step = _training_fn(model, _maybe_compile(ddp, cfg), cfg, cfg.batch_size, device)
                dist.barrier()
                local["train"] = time_fn(step, **timing_kwargs).median_ms
                del ddp
        except Exception as error:  # noqa: BLE001
            local["error"] = f"{type(error).__name__}: {error}"[:300]
        finally:
            del model
            _release(device)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, local)
        entry: dict = {"gpus": world}
        errors = [g["error"] for g in gathered if "error" in g]
        if errors:
            entry["dp_error"] = errors[0]
        for mode in ("infer", "train"):
            times = [g.get(mode) for g in gathered]
            if times and all(t for t in times):
                entry[f"dp_{mode}_img_s"] = sum(cfg.batch_size / (t / 1e3) for t in times)
        totals[name] = entry
    return totals


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_process_group(rank: int, world: int, device: torch.device) -> None:
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=_dt.timedelta(minutes=60))


def _spawned_worker(rank: int, world: int, cfg: BenchmarkConfig, port: int, result_path: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(f"cuda:{rank}") if cfg.device.startswith("cuda") else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    _init_process_group(rank, world, device)
    try:
        totals = _measure_data_parallel(cfg, device, rank, world)
        if rank == 0:
            Path(result_path).write_text(json.dumps(totals))
    finally:
        dist.destroy_process_group()


def _spawn_data_parallel(cfg: BenchmarkConfig) -> dict[str, dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result_path = str(Path(tmp) / "dp.json")
        mp.spawn(_spawned_worker, args=(cfg.data_parallel, cfg, _free_port(), result_path),
                 nprocs=cfg.data_parallel, join=True)
        return json.loads(Path(result_path).read_text())


def _launched_rank() -> tuple[int, int, int] | None:
    """(rank, local rank, world size) when started by ``accelerate launch`` / ``torchrun`` with several processes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and "RANK" in os.environ and "LOCAL_RANK" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), world
    return None


# ---------------------------------------------------------------------------------------------------------------
# The whole run


def run_benchmark(cfg: BenchmarkConfig, *, log=print, on_row=None) -> list[dict]:
    """Validate ``cfg``, measure every model and return one row per model. ``on_row(rows)`` is called after each
    model with the rows so far (the command line saves them, so a run cut short keeps what it measured)."""
    cfg = validate_config(cfg)
    device = torch.device(cfg.device)
    launched = _launched_rank()
    if launched is not None:
        return _run_launched(cfg, launched, log, on_row)
    rows = []
    for name in cfg.models:
        log(f"measuring {name} ...", flush=True)
        row = measure_model(name, cfg, device)
        log(_summary(row), flush=True)
        rows.append(row)
        if on_row is not None:
            on_row(rows)
    if cfg.data_parallel > 1 and ("infer" in cfg.modes or "train" in cfg.modes):
        log(f"data-parallel throughput over {cfg.data_parallel} processes ...", flush=True)
        _merge_data_parallel(rows, _spawn_data_parallel(cfg))
    else:
        _merge_data_parallel(rows, {})
    return rows


def _run_launched(cfg: BenchmarkConfig, launched: tuple[int, int, int], log, on_row=None) -> list[dict]:
    """Under accelerate launch / torchrun: rank 0 measures the single-device numbers while the others wait, then
    every rank joins the data-parallel measurement. Only rank 0 returns rows; the others return ``[]``."""
    import torch.distributed as dist

    rank, local_rank, world = launched
    device = torch.device(f"cuda:{local_rank}") if cfg.device.startswith("cuda") else torch.device("cpu")
    cfg.data_parallel = world
    _init_process_group(rank, world, device)
    try:
        rows = []
        if rank == 0:
            for name in cfg.models:
                log(f"measuring {name} ...", flush=True)
                rows.append(measure_model(name, cfg, device))
                log(_summary(rows[-1]), flush=True)
                if on_row is not None:
                    on_row(rows)
        dist.barrier()
        totals = _measure_data_parallel(cfg, device, rank, world)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return []
    _merge_data_parallel(rows, totals)
    return rows


def _summary(row: dict) -> str:
    """One log line per model as soon as it is measured (a run cut short still leaves its numbers in the log)."""
    if row.get("error"):
        return f"  {row['model']} failed: {row['error']}"
    parts = [f"{key}={row[key]:.4g}" for key in ("params_M", "gflops", "infer_img_s", "train_img_s", "latency_ms",
                                                  "infer_peak_MiB", "train_peak_MiB", "infer_spread")
             if isinstance(row.get(key), (int, float))]
    return f"  {row['model']}: " + " ".join(parts)


def _merge_data_parallel(rows: list[dict], totals: dict[str, dict]) -> None:
    for row in rows:
        entry = totals.get(row["model"])
        if entry is None:  # one device: the data-parallel total is the single-device number
            entry = {"gpus": 1, "dp_infer_img_s": row.get("infer_img_s"), "dp_train_img_s": row.get("train_img_s")}
        row.update({"gpus": entry["gpus"], "dp_infer_img_s": entry.get("dp_infer_img_s"),
                    "dp_train_img_s": entry.get("dp_train_img_s")})
        if entry.get("dp_error"):
            row["dp_error"] = entry["dp_error"]


# ---------------------------------------------------------------------------------------------------------------
# Reporting


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if digits == 0 and abs(value) < 100:  # small throughputs (CPU runs) keep three significant digits
            return f"{value:.3g}"
        return f"{value:,.{digits}f}"
    return str(value)


def _ratio(value, base, higher_is_better: bool) -> str:
    if not isinstance(value, (int, float)) or not isinstance(base, (int, float)) or not base or not value:
        return "-"
    return f"{value / base:.2f}x"


def format_table(rows: list[dict], baseline: str, env: dict | None = None) -> str:
    """One line per model: params, GFLOPs, img/s, latency, memory, and ratios to ``baseline``."""
    base = next((r for r in rows if r["model"] == baseline), {})
    multi = any((r.get("gpus") or 1) > 1 for r in rows)
    columns = [("model", "model", None), ("family", "family", None), ("params (M)", "params_M", 1),
               ("GFLOPs", "gflops", 2), ("infer img/s", "infer_img_s", 0), ("±spread", "infer_spread", None),
               ("train img/s", "train_img_s", 0), ("lat b1 (ms)", "latency_ms", 2),
               ("infer MiB", "infer_peak_MiB", 0), ("train MiB", "train_peak_MiB", 0)]
    if multi:
        columns += [("GPUs", "gpus", None), ("DP infer img/s", "dp_infer_img_s", 0),
                    ("DP train img/s", "dp_train_img_s", 0)]
    header = [c[0] for c in columns] + ["infer/base", "train/base", "latency/base"]
    lines = []
    for row in rows:
        cells = []
        for _, key, digits in columns:
            value = row.get(key)
            if key == "infer_spread":
                cells.append("-" if value is None else f"{100 * value:.0f}%")
            else:
                cells.append(_fmt(value, digits) if digits is not None else _fmt(value))
        cells += [_ratio(row.get("infer_img_s"), base.get("infer_img_s"), True),
                  _ratio(row.get("train_img_s"), base.get("train_img_s"), True),
                  _ratio(row.get("latency_ms"), base.get("latency_ms"), False)]
        lines.append(cells)
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    render = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                                     enumerate(zip(cells, widths)))
    out = []
    if env is not None:
        bench = env.get("benchmark", {})
        out.append(f"# {env['device']} x{max(1, env.get('device_count') or 1)}  torch {env['torch']}  "
                   f"timm {env.get('timm')}  {env['time_utc']}  batch {bench.get('batch_size')}  "
                   f"{bench.get('img_size')}px  {bench.get('dtype')} ({bench.get('precision')})"
                   f"{'  channels_last' if bench.get('channels_last') else ''}"
                   f"{'  torch.compile' if bench.get('compile') else ''}")
    out += [render(header), render(["-" * w for w in widths]), *map(render, lines)]
    out.append(f"(base = {baseline}. img/s: higher is better, ratio > 1 is faster than the base; latency: lower is "
               f"better, ratio < 1 is faster; spread = (p80 - p20) / median of the inference timing)")
    for row in rows:
        if row.get("error"):
            out.append(f"! {row['model']}: {row['error']}")
        if row.get("dp_error"):
            out.append(f"! {row['model']} (data-parallel): {row['dp_error']}")
    return "\n".join(out)


def plot_results(rows: list[dict], path: str | Path, *, x: str = "params", env: dict | None = None) -> Path | None:
    """Scatter of inference img/s against parameters (``x='params'``) or GFLOPs; visionssm models highlighted.
    Returns the PNG path, or ``None`` when no model has numbers to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, label = ("params_M", "parameters (M)") if x == "params" else ("gflops", "GFLOPs (2 x MACs, batch 1)")
    points = [r for r in rows if r.get(key) is not None and r.get("infer_img_s") is not None]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=150)
    for family, colour, marker in (("visionssm", "tab:red", "o"), ("timm", "tab:blue", "s")):
        group = [r for r in points if (r.get("family") or "timm") == family]
        if group:
            ax.scatter([r[key] for r in group], [r["infer_img_s"] for r in group], c=colour, marker=marker,
                       label=family, zorder=3)
    for r in points:
        ax.annotate(r["model"], (r[key], r["infer_img_s"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel(label)
    ax.set_ylabel("inference throughput (img/s)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    if env is not None:
        bench = env.get("benchmark", {})
        ax.set_title(f"{env['device']}, batch {bench.get('batch_size')}, {bench.get('img_size')}px, "
                     f"{bench.get('dtype')}{', channels_last' if bench.get('channels_last') else ''}"
                     f"{', compiled' if bench.get('compile') else ''} ({env['date']})", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_outputs(rows: list[dict], env: dict, *, name: str, out_dir: str | Path, chart: str = "params"
                  ) -> tuple[Path, Path, Path | None]:
    """JSON + CSV through :func:`save_results`, and the PNG chart beside them."""
    json_path, csv_path = save_results(name, rows, out_dir=out_dir, env=env)
    png_path = plot_results(rows, json_path.with_suffix(".png"), x=chart, env=env)
    return json_path, csv_path, png_path


def _default_out_dir() -> Path:
    # In a source checkout the results go next to the committed ones; an installed package writes to the cwd.
    return RESULTS_DIR if RESULTS_DIR.parent.joinpath("kernels.py").exists() else Path.cwd() / "benchmark-results"


# ---------------------------------------------------------------------------------------------------------------
# Command line


def _kernel_suite_main():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels.py"
    if not path.exists():
        raise ValueError(f"the kernel suite ships with the source repository ({path} not found): run it from a "
                         "checkout of visionssm")
    import importlib.util

    spec = importlib.util.spec_from_file_location("visionssm_kernel_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="visionssm-benchmark", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Subcommand: `visionssm-benchmark kernels [--ops ...] [--quick]` runs benchmarks/kernels.py.")
    p.add_argument("models", nargs="*", help="timm model names or patterns (e.g. 'gka_vision_*')")
    p.add_argument("--batch-size", "-b", type=int, default=None, help="per device (default 256 on GPU, 4 on CPU)")
    p.add_argument("--img-size", type=int, default=224, help="square input resolution (default 224)")
    p.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 | float16 (aliases fp32, bf16, fp16)")
    p.add_argument("--precision", default="amp", help="amp: fp32 weights under autocast(dtype) (default); "
                   "pure: weights and inputs cast to dtype")
    p.add_argument("--channels-last", action="store_true", help="model and input in channels_last memory format")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (compile time is in warm-up)")
    p.add_argument("--compile-mode", default="default", help=f"one of {COMPILE_MODES}")
    p.add_argument("--cuda-graph", action="store_true", help="replay a captured CUDA graph (inference, latency)")
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
    p.add_argument("--out-dir", default=None, help="where JSON/CSV/PNG go (default benchmarks/results in a "
                   "checkout, else ./benchmark-results)")
    p.add_argument("--name", default="throughput", help="file name prefix (default 'throughput')")
    p.add_argument("--no-save", action="store_true", help="print the table only")
    p.add_argument("--kernels", action="store_true", help="also run the kernel suite (benchmarks/kernels.py)")
    return p


def _config_from_args(args: argparse.Namespace) -> BenchmarkConfig:
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
    return BenchmarkConfig(
        models=list(args.models), batch_size=args.batch_size if args.batch_size is not None else (4 if on_cpu else 256),
        img_size=args.img_size, dtype=args.dtype, precision=args.precision, channels_last=args.channels_last,
        compile=args.compile, compile_mode=args.compile_mode, modes=tuple(args.modes),
        warmup=args.warmup if args.warmup is not None else 10,
        repeats=args.repeats if args.repeats is not None else (5 if on_cpu else 50), device=device,
        baseline=args.baseline, cuda_graph=args.cuda_graph, data_parallel=data_parallel,
        num_classes=args.num_classes, count_flops=not args.no_flops, skip_unknown=args.skip_unknown)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["kernels"]:
        try:
            kernel_main = _kernel_suite_main()
        except ValueError as error:
            print(f"visionssm-benchmark: error: {error}", file=sys.stderr)
            return 2
        return kernel_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.models and args.kernels:
        return main(["kernels"] + (["--out-dir", args.out_dir] if args.out_dir else []) +
                    (["--no-save"] if args.no_save else []))
    out_dir = None if args.no_save else (args.out_dir or _default_out_dir())
    env: dict = {}

    def describe(cfg: BenchmarkConfig) -> dict:
        if not env:
            import timm

            env.update(environment())
            env.update({"timm": timm.__version__, "benchmark": dataclasses.asdict(cfg), "flop_rule": FLOP_RULE,
                        "timing_rule": TIMING_RULE, "command": "visionssm-benchmark " + " ".join(argv)})
            env["benchmark"]["modes"] = list(cfg.modes)
        return env

    def save_so_far(rows: list[dict]) -> None:
        if out_dir is not None:
            save_results(args.name, rows, out_dir=out_dir, env=describe(cfg))

    try:
        cfg = _config_from_args(args)
        rank0 = _launched_rank() is None or _launched_rank()[0] == 0
        rows = run_benchmark(cfg, log=print if rank0 else (lambda *a, **k: None), on_row=save_so_far)
    except ValueError as error:
        parser.error(str(error))
    if not rank0:
        return 0
    for problem in cfg.skipped:
        print(f"warning: skipped {problem}", file=sys.stderr)
    print(format_table(rows, cfg.baseline, describe(cfg)))
    if out_dir is not None:
        paths = write_outputs(rows, describe(cfg), name=args.name, out_dir=out_dir, chart=args.chart)
        print("wrote", *[str(p) for p in paths if p is not None])
    status = 1 if any(r.get("error") or r.get("dp_error") for r in rows) else 0
    if args.kernels:
        status = max(status, main(["kernels"] + (["--out-dir", args.out_dir] if args.out_dir else []) +
                                  (["--no-save"] if args.no_save else [])))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
