"""Measuring one model on one device: throughput (inference, training step), latency at batch 1, peak memory,
parameters and FLOPs, as the rules in :mod:`.config` state."""

from __future__ import annotations

import contextlib
import gc
import time

import torch

from .config import BenchmarkConfig
from .harness import HOST_REPEATS, Timing, time_fn

__all__ = ["HOST_REPEATS", "count_flops", "create_model", "inference_step", "maybe_compile", "measure_model",
           "release_memory", "timm_model", "training_step"]


def timm_model(name: str, img_size: int, **kwargs) -> torch.nn.Module:
    """``timm.create_model(name, img_size=img_size, **kwargs)``; convolutional models take any resolution and do not
    accept ``img_size``, so they are built without it."""
    import timm

    try:
        return timm.create_model(name, img_size=img_size, **kwargs)
    except TypeError as error:
        if "img_size" not in str(error):
            raise
        return timm.create_model(name, **kwargs)


def create_model(name: str, cfg: BenchmarkConfig, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm_model(name, cfg.img_size, **{**cfg.model_kwargs, "pretrained": False, "num_classes": cfg.num_classes})
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
    import visionssm.kernels as kernel_ops
    from visionssm.layers import mixer_kernel_ops

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
            f"{prefix}_spread": timing.spread, f"{prefix}_host_ms": timing.host_ms,
            f"{prefix}_host_bound": timing.host_bound}


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


def maybe_compile(model: torch.nn.Module, cfg: BenchmarkConfig):
    return torch.compile(model, mode=None if cfg.compile_mode == "default" else cfg.compile_mode) if cfg.compile \
        else model


def _first_call_s(step, cfg: BenchmarkConfig, device: torch.device) -> float | None:
    """Seconds of a compiled step's first call (tracing, compiling, the first run), what a user waits before the
    first batch; ``None`` for an eager run (the warm-up runs the first call then)."""
    if not cfg.compile:
        return None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def inference_step(model, runner, cfg: BenchmarkConfig, batch: int, device: torch.device):
    model.eval()
    x = _input(cfg, batch, device)

    def step():
        with torch.no_grad(), _autocast(cfg, device):
            return runner(x)

    return step


def training_step(model, runner, cfg: BenchmarkConfig, batch: int, device: torch.device, *, captured: bool = False):
    """One training step as a closure; ``captured``: it will be replayed from a CUDA graph."""
    model.train()
    x = _input(cfg, batch, device)
    target = torch.randint(0, cfg.num_classes, (batch,), device=device)
    params = [p for p in model.parameters() if p.requires_grad]
    # a captured step needs the optimizer's step counts on the device (capturable); its state tensors are made by the
    # eager warm-up steps before the capture, so the replayed graph updates them in place
    optimizer = torch.optim.AdamW(params, lr=1e-6, fused=device.type == "cuda", capturable=captured)

    def step():
        with _autocast(cfg, device):
            loss = torch.nn.functional.cross_entropy(runner(x).float(), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if hasattr(torch, "_dynamo"):
        torch._dynamo.reset()


def measure_model(name: str, cfg: BenchmarkConfig, device: torch.device) -> dict:
    """All single-device numbers for one model (a failure, e.g. out of memory, is recorded in ``error``)."""
    row: dict = {"model": name, "family": None, "params_M": None, "gflops": None, "batch_size": cfg.batch_size,
                 "img_size": cfg.img_size, "dtype": cfg.dtype, "precision": cfg.precision,
                 "channels_last": cfg.channels_last, "compile": cfg.compile,
                 **({"model_kwargs": cfg.model_kwargs} if cfg.model_kwargs else {})}
    model = None
    try:
        model = create_model(name, cfg, device)
        row["family"] = _family(model)
        row["params_M"] = sum(p.numel() for p in model.parameters()) / 1e6
        if cfg.count_flops:
            flop_dtype = cfg.torch_dtype if cfg.precision == "pure" else torch.float32
            row["gflops"] = count_flops(model, cfg.img_size, device, flop_dtype)
        runner = maybe_compile(model, cfg)
        # eager runs also time the host's side of a call alone, which says whether the CPU set the rate
        host_repeats = 0 if cfg.cuda_graph else min(HOST_REPEATS, cfg.repeats)
        timing_kwargs = {"warmup": cfg.warmup, "repeats": cfg.repeats, "device": device,
                         "host_repeats": host_repeats}
        if "infer" in cfg.modes:
            _reset_memory(device)
            step = inference_step(model, runner, cfg, cfg.batch_size, device)
            row["infer_compile_s"] = _first_call_s(step, cfg, device)
            row.update(_timing_fields("infer", time_fn(step, cuda_graph=cfg.cuda_graph, **timing_kwargs),
                                      cfg.batch_size))
            row["infer_peak_MiB"] = _peak_mib(device)
        if "train" in cfg.modes:
            _reset_memory(device)
            step = training_step(model, runner, cfg, cfg.batch_size, device, captured=cfg.cuda_graph)
            row["train_compile_s"] = _first_call_s(step, cfg, device)
            row.update(_timing_fields("train", time_fn(step, cuda_graph=cfg.cuda_graph, **timing_kwargs),
                                      cfg.batch_size))
            row["train_peak_MiB"] = _peak_mib(device)
            model.zero_grad(set_to_none=True)
        if "latency" in cfg.modes:
            step = inference_step(model, runner, cfg, 1, device)
            latency = time_fn(step, cuda_graph=cfg.cuda_graph, **timing_kwargs)
            row.update({"latency_ms": latency.median_ms, "latency_p20_ms": latency.p20_ms,
                        "latency_p80_ms": latency.p80_ms, "latency_host_ms": latency.host_ms})
        row["error"] = None
    except Exception as error:  # noqa: BLE001 - one failing model must not lose the others' numbers
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
    finally:
        del model
        release_memory(device)
    return row
