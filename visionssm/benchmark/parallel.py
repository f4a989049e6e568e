"""The whole backbone run: every model on one device, then data-parallel throughput with one process per GPU
(spawned here, or the processes of ``accelerate launch`` / ``torchrun``)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import tempfile
from pathlib import Path

import torch

from .config import BenchmarkConfig, at_resolution, validate_config
from .harness import time_fn
from .measure import create_model, inference_step, maybe_compile, measure_model, release_memory, training_step

__all__ = ["launched_rank", "run_benchmark"]


def _measure_data_parallel(cfg: BenchmarkConfig, device: torch.device, rank: int, world: int) -> dict[str, dict]:
    """Run inside every rank of an initialised process group; returns (on every rank) the total img/s per model."""
    import torch.distributed as dist

    totals: dict[str, dict] = {}
    timing_kwargs = {"warmup": cfg.warmup, "repeats": cfg.repeats, "device": device}
    for name in cfg.models:
        local: dict = {}
        model = None
        try:
            model = create_model(name, cfg, device)
            runner = maybe_compile(model, cfg)
            if "infer" in cfg.modes:
                step = inference_step(model, runner, cfg, cfg.batch_size, device)
                dist.barrier()
                local["infer"] = time_fn(step, cuda_graph=cfg.cuda_graph, **timing_kwargs).median_ms
            if "train" in cfg.modes:
                ddp = torch.nn.parallel.DistributedDataParallel(
                    model, device_ids=[device.index] if device.type == "cuda" else None)
                step = training_step(model, maybe_compile(ddp, cfg), cfg, cfg.batch_size, device)
                dist.barrier()
                local["train"] = time_fn(step, **timing_kwargs).median_ms
                del ddp
        except Exception as error:  # noqa: BLE001
            local["error"] = f"{type(error).__name__}: {error}"[:300]
        finally:
            del model
            release_memory(device)
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


def launched_rank() -> tuple[int, int, int] | None:
    """(rank, local rank, world size) when started by ``accelerate launch`` / ``torchrun`` with several processes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and "RANK" in os.environ and "LOCAL_RANK" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), world
    return None


def run_benchmark(cfg: BenchmarkConfig, *, log=print, on_row=None) -> list[dict]:
    """Validate ``cfg``, measure every model at every resolution (``cfg.img_sizes``, each at its batch) and return
    one row per model and resolution, resolution by resolution. ``on_row(rows)`` is called after each row with the
    rows so far (the command line saves them, so a run cut short keeps what it measured)."""
    cfg = validate_config(cfg)
    device = torch.device(cfg.device)
    launched = launched_rank()
    if launched is not None:
        return _run_launched(cfg, launched, log, on_row)
    rows: list[dict] = []
    for index in range(len(cfg.img_sizes)):
        at = at_resolution(cfg, index)
        these = []
        for name in cfg.models:
            log(f"measuring {name} at {at.img_size}px, batch {at.batch_size} ...", flush=True)
            row = measure_model(name, at, device)
            log(_summary(row), flush=True)
            these.append(row)
            if on_row is not None:
                on_row(rows + these)
        if at.data_parallel > 1 and ("infer" in at.modes or "train" in at.modes):
            log(f"data-parallel throughput over {at.data_parallel} processes ...", flush=True)
            _merge_data_parallel(these, _spawn_data_parallel(at))
        else:
            _merge_data_parallel(these, {})
        rows += these
    return rows


def _run_launched(cfg: BenchmarkConfig, launched: tuple[int, int, int], log, on_row=None) -> list[dict]:
    """Under accelerate launch / torchrun: rank 0 measures the single-device numbers while the others wait, then
    every rank joins the data-parallel measurement, resolution by resolution. Only rank 0 returns rows; the others
    return ``[]``."""
    import torch.distributed as dist

    rank, local_rank, world = launched
    device = torch.device(f"cuda:{local_rank}") if cfg.device.startswith("cuda") else torch.device("cpu")
    cfg.data_parallel = world
    _init_process_group(rank, world, device)
    rows: list[dict] = []
    try:
        for index in range(len(cfg.img_sizes)):
            at = at_resolution(cfg, index)
            these = []
            if rank == 0:
                for name in at.models:
                    log(f"measuring {name} at {at.img_size}px, batch {at.batch_size} ...", flush=True)
                    these.append(measure_model(name, at, device))
                    log(_summary(these[-1]), flush=True)
                    if on_row is not None:
                        on_row(rows + these)
            dist.barrier()
            totals = _measure_data_parallel(at, device, rank, world)
            _merge_data_parallel(these, totals)
            rows += these
    finally:
        dist.destroy_process_group()
    return rows if rank == 0 else []


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
