"""What a backbone benchmark run measures: its settings (:class:`BenchmarkConfig`), their checks, and the rules
for FLOPs and timing that every results JSON carries."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence

import torch

from visionssm.kernels.utils import check_int
from visionssm.layers import mixer_kernel_ops
from visionssm.utils.cli import COMPILE_MODES

from .cli import CHART_AXES, MODES

__all__ = ["CHART_AXES", "COMPILE_MODES", "DTYPES", "FLOP_RULE", "MODES", "PRECISIONS", "TIMING_RULE",
           "BenchmarkConfig", "at_resolution", "resolve_models", "scaled_batch", "validate_config",
           "visionssm_models"]

FLOP_RULE = ("GFLOPs = 2 x multiply-accumulates of one forward pass of a 1x3xHxW image, as counted by "
             "torch.utils.flop_counter.FlopCounterMode: convolutions, linear layers and matmuls including attention "
             "(scaled_dot_product_attention); element-wise ops, norms and activations are not counted, nor are "
             f"visionssm's sequence-mixer ops ({', '.join(mixer_kernel_ops())}), as with the ptflops/fvcore GMACs "
             "that MambaVision and timm quote. GMACs = GFLOPs / 2.")
TIMING_RULE = ("CUDA events around each call after warm-up (time.perf_counter on CPU); median, p20 and p80 of the "
               "repeats; img/s = batch / median time. Training step = forward + cross-entropy + backward + AdamW "
               "step (no gradient scaler). Data-parallel: one process per GPU, --batch-size images per GPU, total "
               "img/s summed over GPUs; training through DistributedDataParallel.")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
PRECISIONS = ("amp", "pure")


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
    #: every resolution measured (empty: ``img_size`` alone); ``img_size`` is then the first
    img_sizes: tuple[int, ...] = ()
    #: the batch at each of ``img_sizes`` (empty: ``batch_size`` at the first, scaled to the same pixels per batch)
    batch_sizes: tuple[int, ...] = ()
    #: extra ``timm.create_model`` kwargs of every model (e.g. ``{"global_mixer": True}``)
    model_kwargs: dict = dataclasses.field(default_factory=dict)

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


def validate_config(cfg: BenchmarkConfig) -> BenchmarkConfig:
    """Check and normalise every field; raise ``ValueError`` naming the bad argument (``TypeError`` for a count that
    is not an int)."""
    if not cfg.models:
        raise ValueError("models: give at least one timm model name")
    cfg.skipped = []
    cfg.models = resolve_models(cfg.models, cfg.skipped if cfg.skip_unknown else None)
    if not cfg.models:
        raise ValueError("models: none of the given names is a timm model: " + "; ".join(cfg.skipped))
    _validate_sizes(cfg)
    check_int("warmup", cfg.warmup, 0)
    check_int("repeats", cfg.repeats, 1)
    check_int("num_classes", cfg.num_classes, 1)
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
    _validate_device(cfg)
    if cfg.baseline is None:
        cfg.baseline = cfg.models[0]
    elif cfg.baseline not in cfg.models:
        raise ValueError(f"baseline {cfg.baseline!r} is not one of the benchmarked models {cfg.models}")
    return cfg


def scaled_batch(batch: int, size: int, new_size: int) -> int:
    """The batch at ``new_size`` pixels a side holding as many pixels as ``batch`` images at ``size`` (at least 1)."""
    return max(1, round(batch * size * size / (new_size * new_size)))


def _validate_sizes(cfg: BenchmarkConfig) -> None:
    """Resolutions and their batches: ``img_sizes`` (default ``(img_size,)``) and one batch per size, given or
    scaled from the first (``batch_sizes`` of one entry, or ``batch_size``) to keep the pixels per batch."""
    sizes = tuple(cfg.img_sizes) or (cfg.img_size,)
    for size in sizes:
        check_int("img_size", size, 1)
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"img_size: each resolution once, got {list(sizes)}")
    batches = tuple(cfg.batch_sizes) or (cfg.batch_size,)
    for batch in batches:
        check_int("batch_size", batch, 1)
    if len(batches) == 1:
        batches = tuple(scaled_batch(batches[0], sizes[0], size) for size in sizes)
    elif len(batches) != len(sizes):
        raise ValueError(f"batch_size: one value (scaled to every resolution) or one per resolution "
                         f"({len(sizes)}), got {list(batches)}")
    if not isinstance(cfg.model_kwargs, dict):
        raise TypeError(f"model_kwargs must be a dict, got {type(cfg.model_kwargs).__name__}")
    cfg.img_sizes, cfg.batch_sizes = sizes, batches
    cfg.img_size, cfg.batch_size = sizes[0], batches[0]


def at_resolution(cfg: BenchmarkConfig, index: int) -> BenchmarkConfig:
    """A validated ``cfg`` measuring its ``index``-th resolution alone (``img_size`` and ``batch_size`` set)."""
    return dataclasses.replace(cfg, img_size=cfg.img_sizes[index], batch_size=cfg.batch_sizes[index],
                               img_sizes=(cfg.img_sizes[index],), batch_sizes=(cfg.batch_sizes[index],))


def _validate_device(cfg: BenchmarkConfig) -> None:
    """The device, and the settings that depend on it (CUDA graphs, data-parallel process count)."""
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
    check_int("data_parallel", cfg.data_parallel, 1)
    if device.type == "cuda" and cfg.data_parallel > torch.cuda.device_count():
        raise ValueError(f"data_parallel={cfg.data_parallel} but only {torch.cuda.device_count()} GPU(s) are visible")


def visionssm_models(sizes: Sequence[str]) -> list[str]:
    """visionssm's registered models of the given size tags (``"T"`` -> ``mamba_vision_T``, ``gka_vision_T``, ...),
    family by family: the scripts' presets follow the model registry, so a new family joins them by itself."""
    from visionssm.models import FAMILIES

    return [name for models in FAMILIES.values() for size in sizes for name in models
            if name.rsplit("_", 1)[-1] == size]
