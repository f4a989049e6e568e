"""The pieces an ImageNet training run (:mod:`visionssm.train`) is built from, each from the resolved config.

Model and data (the generated set when no ``data_dir`` is given), the transforms and loaders, the loss and Mixup,
timm's optimizer and schedule (``--epochs`` is the whole run: :func:`fit_schedule`), the weights written for the best
epoch and read back for ``--eval-only``.
"""

from __future__ import annotations

import difflib
import math
import os
import resource
from pathlib import Path

import timm
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, ProjectConfiguration
from safetensors.torch import save_file
from timm.data import Mixup, create_transform, resolve_data_config
from timm.data.random_erasing import RandomErasing
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.models import clean_state_dict
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from torch.utils.data import DataLoader

from visionssm.data.gpu import (
    BACKENDS,
    JPEG_DECODERS,
    EncodedImageFolder,
    EvalStage,
    TrainStage,
    collate_encoded,
    jpeg_decoder,
)
from visionssm.data.loader import (
    EpochShuffleSampler,
    ShardSampler,
    collate_skipping,
    patch_timm_posterize,
    split_root,
)
from visionssm.data.synthetic import SyntheticSpec, ensure_synthetic_dataset
from visionssm.training.state import CheckpointManager, scaled_lr
from visionssm.utils.checkpoint import read_state_dict
from visionssm.utils.cli import UserFileError, UserTypeError, UserValueError, cap_workers, check_choice

__all__ = ["build_criterion", "build_optimizer", "build_scheduler", "build_train_loader", "check_config",
           "create_model", "data_config", "eval_transform", "find_resume_checkpoint", "fit_schedule", "gpu_stages",
           "load_weights_for_eval", "make_accelerator", "peak_memory_mib", "resolve_amp", "resolve_best_key",
           "resolve_data_dir", "save_weights", "synthetic_spec", "val_loader"]


def resolve_amp(amp: str) -> str:
    if amp == "fp16" and not torch.cuda.is_available():
        raise UserValueError("--amp fp16 needs a GPU; use bf16 or no on CPU")
    if amp != "auto":
        return amp
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def _xpu_or_mps_available() -> bool:
    xpu = getattr(torch, "xpu", None)
    return bool((xpu is not None and xpu.is_available()) or torch.backends.mps.is_available())


def make_accelerator(cfg: dict, out: Path, amp: str) -> Accelerator:
    return Accelerator(
        # accelerate only forms a CPU process group (gloo) when told it runs on CPU: without this a
        # `accelerate launch --multi_gpu --num_processes 2` on a host with no GPU would train 2 separate copies.
        cpu=cfg["cpu"] or not (torch.cuda.is_available() or _xpu_or_mps_available()),
        mixed_precision=amp,
        gradient_accumulation_steps=cfg["grad_accum_steps"],
        log_with=cfg["log_with"],
        project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "logs")),
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=cfg["ddp_find_unused_parameters"])],
    )


def _check_at_least(cfg: dict, minimum: int, *keys: str) -> None:
    for key in keys:
        value = cfg[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise UserValueError(f"--{key.replace('_', '-')} must be an integer >= {minimum}, got {value!r}")


def _check_model(cfg: dict) -> None:
    """The model name is timm's and its ``model_kwargs`` are arguments it takes (built on the meta device: free)."""
    name, kwargs = cfg["model"], cfg["model_kwargs"]
    if not isinstance(name, str) or not timm.is_model(name):
        close = difflib.get_close_matches(str(name), timm.list_models(), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else " (timm.list_models() lists them)"
        raise UserValueError(f"--model {name!r} is not a timm or visionssm model{hint}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise UserTypeError(f"--model-kwargs must be a mapping such as '{{dims: 64}}', got {kwargs!r}")
    try:
        with torch.device("meta"):
            create_model(cfg, num_classes=2)
    except TypeError as error:
        raise UserValueError(f"--model-kwargs {kwargs!r} do not fit {name}: {error}") from None
    except Exception:  # a model that cannot be built on the meta device is checked by its real build
        pass


def _check_resume(cfg: dict) -> None:
    resume = cfg["resume"]
    if isinstance(resume, bool) or resume in ("auto", "latest", "never"):
        find_resume_checkpoint(resume, CheckpointManager(None, cfg["output"], keep_last=cfg["keep_last"]))
    elif not (Path(str(resume)) / "trainer_state.json").is_file():
        raise UserFileError(f"--resume {resume}: not a complete checkpoint directory (no trainer_state.json)")


def find_resume_checkpoint(resume, checkpoints: CheckpointManager) -> Path | None:
    """The checkpoint ``resume`` (auto | latest | never | a directory) means for ``checkpoints``, or ``None``."""
    resume = "never" if resume is False else ("latest" if resume is True else str(resume))
    latest = checkpoints.latest()
    if resume == "auto":
        return latest
    if resume == "latest":
        if latest is None:
            raise UserFileError(f"--resume: no complete checkpoint under {checkpoints.root}")
        return latest
    if resume == "never":
        if latest is not None:
            raise UserValueError(f"{checkpoints.root} already holds checkpoints (latest {latest.name}) and "
                                 "--resume never: choose another --output or resume")
        return None
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise UserFileError(f"--resume {path}: not a complete checkpoint directory (no trainer_state.json)")
    return path


def check_config(cfg: dict, say=print) -> None:
    """Everything the user may have got wrong, checked before any work is done or any file written: the model and
    its kwargs, the data folders (or the generated set's parameters), the checkpoint to evaluate or resume, the
    optimizer, schedule and value ranges. Raises a :class:`~visionssm.utils.cli.UserError` naming the setting.

    Caps ``cfg['workers']`` at the CPUs this process may use (``say`` gets the note)."""
    _check_at_least(cfg, 1, "epochs", "batch_size", "grad_accum_steps", "keep_last", "log_interval")
    _check_at_least(cfg, 0, "workers", "checkpoint_every_steps", "warmup_epochs", "cooldown_epochs")
    cfg["workers"] = cap_workers(cfg["workers"], "workers", say)
    resolve_amp(cfg["amp"])
    check_choice(cfg["data_backend"], BACKENDS, "--data-backend")
    check_choice(cfg["jpeg_decoder"], JPEG_DECODERS, "--jpeg-decoder")
    _check_model(cfg)
    if cfg["data_dir"] is not None:
        for split in (cfg["train_split"], cfg["val_split"]):
            try:
                split_root(cfg["data_dir"], split)
            except UserFileError as error:
                raise UserFileError(f"--data-dir: {error}") from None
    else:
        try:
            synthetic_spec(cfg)
        except UserValueError as error:
            raise UserValueError(f"generated set (--synthetic-*): {error}") from None
    if cfg["eval_only"]:
        if cfg["checkpoint"] is not None and not Path(cfg["checkpoint"]).exists():
            raise UserFileError(f"--checkpoint {cfg['checkpoint']} not found")
    else:
        _check_resume(cfg)
    if cfg["clip_grad"] and cfg["clip_mode"] not in ("norm", "value"):
        raise UserValueError(f"--clip-mode must be norm or value, got {cfg['clip_mode']!r}")
    resolve_best_key(cfg, ema=cfg["model_ema"] or None)
    probe = torch.nn.Linear(1, 1)  # the optimizer and schedule names and arguments, on one parameter
    try:
        optimizer, _, _ = build_optimizer(dict(cfg, layer_decay=None), probe, world=1)
    except ValueError as error:  # timm: an optimizer name it does not know
        raise UserValueError(f"--opt: {error}") from None
    build_scheduler(cfg, optimizer, updates_per_epoch=1, say=lambda _note: None)


def synthetic_spec(cfg: dict) -> SyntheticSpec:
    return SyntheticSpec(classes=cfg["synthetic_classes"], train_per_class=cfg["synthetic_train_per_class"],
                         val_per_class=cfg["synthetic_val_per_class"], image_size=cfg["synthetic_image_size"],
                         seed=cfg["synthetic_seed"])


def resolve_data_dir(cfg: dict, accelerator: Accelerator) -> Path:
    """``data_dir``, or the generated set (drawn once, by the main process, the others waiting)."""
    if cfg["data_dir"] is not None:
        return Path(cfg["data_dir"])
    spec = synthetic_spec(cfg)
    # Relative to the working directory, like the default output folder: an installed package has no checkout.
    root = Path(cfg["synthetic_dir"]) if cfg["synthetic_dir"] else (
        Path("data") / "generated" /
        f"shapes{spec.classes}_{spec.image_size}px_{spec.train_per_class}x{spec.val_per_class}_s{spec.seed}")
    with accelerator.main_process_first():
        ensure_synthetic_dataset(root, spec, verbose=accelerator.is_main_process)
    return root


def create_model(cfg: dict, num_classes: int) -> torch.nn.Module:
    kwargs = dict(cfg["model_kwargs"] or {})
    if cfg["drop_path"] is not None:
        kwargs["drop_path_rate"] = cfg["drop_path"]
    return timm.create_model(cfg["model"], pretrained=False, num_classes=num_classes, drop_rate=cfg["drop_rate"],
                             **kwargs)


def data_config(cfg: dict, model: torch.nn.Module) -> dict:
    overrides = {k: cfg[k] for k in ("crop_pct", "mean", "std", "interpolation") if cfg[k] is not None}
    if cfg["img_size"] is not None:
        overrides["input_size"] = (3, cfg["img_size"], cfg["img_size"])
    return resolve_data_config(overrides, model=model)


def eval_transform(data_cfg: dict):
    return create_transform(data_cfg["input_size"], is_training=False, interpolation=data_cfg["interpolation"],
                            mean=data_cfg["mean"], std=data_cfg["std"], crop_pct=data_cfg["crop_pct"])


def val_loader(dataset, cfg: dict, accelerator: Accelerator) -> DataLoader:
    """Each process evaluates its own slice (no padding, no duplicates); counts are summed afterwards."""
    # Its own generator: creating an iterator draws a seed, from the global RNG when the loader has no generator.
    # Persistent workers create theirs once per process, so a resumed run would draw at another point than the
    # uninterrupted run and shift the global RNG that drop path and Mixup use in every later epoch.
    return DataLoader(dataset, batch_size=cfg["val_batch_size"] or 2 * cfg["batch_size"],
                      sampler=ShardSampler(len(dataset), accelerator.process_index, accelerator.num_processes),
                      num_workers=cfg["workers"], persistent_workers=cfg["workers"] > 0,
                      collate_fn=collate_encoded if isinstance(dataset, EncodedImageFolder) else collate_skipping,
                      pin_memory=cfg["pin_memory"] and torch.cuda.is_available(),
                      generator=torch.Generator().manual_seed(cfg["seed"]))


def peak_memory_mib(accelerator: Accelerator) -> tuple[float, str]:
    if accelerator.device.type == "cuda":
        return torch.cuda.max_memory_allocated(accelerator.device) / 2**20, "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cpu_max_rss"


def fit_schedule(epochs: int, warmup: int, cooldown: int) -> tuple[int, int, str | None]:
    """Warmup and cooldown epochs that fit a run of ``epochs`` epochs in all, and a note when they were shrunk.

    At least one epoch must remain between warmup and cooldown for the learning rate to decay, so
    ``warmup + cooldown <= epochs - 1``; when the recipe's are longer (a 320-epoch recipe run for 5 epochs), both
    shrink in proportion, rounded down.
    """
    if epochs < 1:
        raise UserValueError(f"--epochs must be >= 1, got {epochs}")
    if warmup < 0 or cooldown < 0:
        raise UserValueError(f"--warmup-epochs and --cooldown-epochs must be >= 0, got {warmup} and {cooldown}")
    room = epochs - 1
    if warmup + cooldown <= room:
        return warmup, cooldown, None
    fitted_warmup = math.floor(warmup * room / (warmup + cooldown))
    fitted_cooldown = math.floor(cooldown * room / (warmup + cooldown))
    note = (f"note: {epochs} epoch(s) in all: warmup {warmup} -> {fitted_warmup} and cooldown {cooldown} -> "
            f"{fitted_cooldown} epochs, so that the learning rate decays for at least one epoch")
    return fitted_warmup, fitted_cooldown, note


# A warmup inside the cosine ends where the cosine has already fallen to (1 + cos(pi * warmup / cycle)) / 2 of the
# peak; below this fraction the warmup is prepended instead, so that the run reaches the lr it prints.
MIN_PEAK_FRACTION = 0.95


def build_scheduler(cfg: dict, optimizer, updates_per_epoch: int, say):
    """timm's scheduler stepped per update, over exactly ``cfg['epochs']`` epochs.

    With ``warmup_prefix: false`` the warmup runs inside the cosine (MambaVision's recipe), so the lr drops at the
    warmup's end to the cosine's value there; when the warmup is a large part of the cycle (a shortened recipe:
    ``--epochs 5`` of a 320-epoch one) that drop would keep the run far below its lr, so the warmup is prepended.
    """
    warmup, cooldown, note = fit_schedule(cfg["epochs"], cfg["warmup_epochs"], cfg["cooldown_epochs"])
    if note:
        say(note)
    prefix = cfg["warmup_prefix"]
    if not prefix and warmup and cfg["sched"] == "cosine":
        reached = (1 + math.cos(math.pi * warmup / (cfg["epochs"] - cooldown))) / 2
        if reached < MIN_PEAK_FRACTION:
            prefix = True
            say(f"note: warmup_prefix false -> true: a {warmup}-epoch warmup inside a {cfg['epochs'] - cooldown}-"
                f"epoch cosine would end at {reached:.0%} of the lr, so the cosine starts after the warmup")
    # timm adds the cooldown (and a prefixed warmup) to the cycle it is given, so it gets what is left of the run.
    cycle = cfg["epochs"] - cooldown - (warmup if prefix else 0)
    try:
        scheduler, num_epochs = create_scheduler_v2(
            optimizer, sched=cfg["sched"], num_epochs=cycle, warmup_epochs=warmup, cooldown_epochs=cooldown,
            warmup_lr=cfg["warmup_lr"], min_lr=cfg["min_lr"], warmup_prefix=prefix, noise_seed=cfg["seed"],
            step_on_epochs=False, updates_per_epoch=updates_per_epoch)
    except ValueError as error:  # timm: an unknown schedule name
        raise UserValueError(f"--sched: {error}") from None
    if scheduler is None:
        raise UserValueError(f"--sched {cfg['sched']!r} gives no scheduler; use e.g. cosine or constant")
    if num_epochs != cfg["epochs"]:
        raise UserValueError(f"--sched {cfg['sched']!r} runs {num_epochs} epochs for epochs={cfg['epochs']}: use a "
                             "schedule without restarts (cycle_limit 1)")
    return scheduler


def build_train_loader(cfg: dict, train_set, data_cfg: dict, world: int):
    """The training DataLoader with its sampler and generator (both re-seeded per epoch by the loop). With an
    ``EncodedImageFolder`` (gpu data backend) the workers only read bytes: :func:`gpu_stages` transforms."""
    if cfg["batch_size"] < 1:
        raise UserValueError(f"--batch-size must be >= 1, got {cfg['batch_size']}")
    encoded = isinstance(train_set, EncodedImageFolder)
    if not encoded:
        patch_timm_posterize()
        train_set.transform = create_transform(
            data_cfg["input_size"], is_training=True, scale=tuple(cfg["scale"]), ratio=tuple(cfg["ratio"]),
            hflip=cfg["hflip"], color_jitter=cfg["color_jitter"], auto_augment=cfg["aa"],
            interpolation=cfg["train_interpolation"], mean=data_cfg["mean"], std=data_cfg["std"],
            re_prob=cfg["reprob"], re_mode=cfg["remode"], re_count=cfg["recount"])
    if len(train_set) < cfg["batch_size"] * world:
        raise UserValueError(f"the training split has {len(train_set)} images, fewer than one global batch "
                         f"({cfg['batch_size']} x {world} processes)")
    sampler = EpochShuffleSampler(len(train_set), seed=cfg["seed"], tag_epoch=True)
    # Augmentation draws are per image (SafeImageFolder augment_seed). The DataLoader gets its own generator so
    # that creating an iterator (at an epoch start, or mid-epoch after a resume) does not consume the global RNG,
    # which drop path and Mixup draw from: a resumed run stays on the uninterrupted run's track.
    generator = torch.Generator()
    loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=sampler, drop_last=True,
                        num_workers=cfg["workers"], collate_fn=collate_encoded if encoded else collate_skipping,
                        generator=generator, pin_memory=cfg["pin_memory"] and torch.cuda.is_available(),
                        persistent_workers=cfg["workers"] > 0)  # the sampler tags each index with its epoch
    return loader, sampler, generator


def gpu_stages(cfg: dict, train_set, val_set, data_cfg: dict, device: torch.device, say):
    """The gpu data backend's training and evaluation stages and the batch random erasing (timm's, on ``device``)."""
    size = data_cfg["input_size"][-1]
    mean, std = data_cfg["mean"], data_cfg["std"]
    if not cfg["aa"] and cfg["color_jitter"]:
        say(f"note: --data-backend gpu does not apply colour jitter (--color-jitter {cfg['color_jitter']}); the "
            "recipes' RandAugment replaces it, as in timm")
    decoder = jpeg_decoder(cfg["jpeg_decoder"], device, say)
    say(f"gpu data backend: JPEG decoding by {'nvImageCodec' if decoder else 'torchvision (nvJPEG)'} on {device}")
    train = None
    if train_set is not None:
        train = TrainStage(train_set, device, size, mean, std, seed=cfg["seed"], scale=cfg["scale"],
                           ratio=cfg["ratio"], hflip=cfg["hflip"], interpolation=cfg["train_interpolation"],
                           auto_augment=cfg["aa"], decoder=decoder)
    evaluate = EvalStage(val_set, device, size, mean, std, crop_pct=data_cfg["crop_pct"],
                         interpolation=data_cfg["interpolation"], decoder=decoder)
    erase = None
    if cfg["reprob"] > 0:
        erase = RandomErasing(cfg["reprob"], mode=cfg["remode"], max_count=cfg["recount"], device=device)
    return train, evaluate, erase


def build_criterion(cfg: dict, num_classes: int):
    """The loss and, when Mixup/CutMix is on, the batch mixer."""
    mixup_active = cfg["mixup"] > 0 or cfg["cutmix"] > 0 or cfg["cutmix_minmax"] is not None
    if not mixup_active:
        if cfg["smoothing"]:
            return LabelSmoothingCrossEntropy(smoothing=cfg["smoothing"]), None
        return torch.nn.CrossEntropyLoss(), None
    if cfg["batch_size"] % 2:
        raise UserValueError(f"--batch-size (per process) must be even with Mixup/CutMix, got {cfg['batch_size']}")
    mixup_fn = Mixup(mixup_alpha=cfg["mixup"], cutmix_alpha=cfg["cutmix"], cutmix_minmax=cfg["cutmix_minmax"],
                     prob=cfg["mixup_prob"], switch_prob=cfg["mixup_switch_prob"], mode=cfg["mixup_mode"],
                     label_smoothing=cfg["smoothing"], num_classes=num_classes)
    return SoftTargetCrossEntropy(), mixup_fn


def build_optimizer(cfg: dict, model: torch.nn.Module, world: int):
    """timm's optimizer at the configured or batch-scaled learning rate; returns (optimizer, lr, global batch)."""
    global_batch = cfg["batch_size"] * world * cfg["grad_accum_steps"]
    lr = cfg["lr"] if cfg["lr"] is not None else scaled_lr(cfg["lr_base"], cfg["lr_base_size"], global_batch,
                                                             cfg["lr_scale"])
    opt_args = {}
    if cfg["opt"].lower().split("_")[-1] not in ("sgd", "momentum", "nesterov"):
        if cfg["opt_eps"] is not None:
            opt_args["eps"] = cfg["opt_eps"]
        if cfg["opt_betas"] is not None:
            opt_args["betas"] = tuple(cfg["opt_betas"])
    optimizer = create_optimizer_v2(model, opt=cfg["opt"], lr=lr, weight_decay=cfg["weight_decay"],
                                    momentum=cfg["momentum"], layer_decay=cfg["layer_decay"], **opt_args)
    return optimizer, lr, global_batch


def resolve_best_key(cfg: dict, ema) -> str:
    best_key = cfg["best_metric"]
    if best_key == "auto":
        return "ema_val_top1" if ema is not None else "val_top1"
    if best_key not in ("top1", "ema_top1"):
        raise UserValueError(f"--best-metric must be auto, top1 or ema_top1, got {cfg['best_metric']!r}")
    if best_key == "ema_top1" and ema is None:
        raise UserValueError("--best-metric ema_top1 needs model_ema: true")
    return {"top1": "val_top1", "ema_top1": "ema_val_top1"}[best_key]


def save_weights(module: torch.nn.Module, path: Path) -> None:
    """A plain timm state dict (no DDP / compile prefixes), written atomically."""
    state = {k: v.detach().contiguous().cpu() for k, v in clean_state_dict(module.state_dict()).items()}
    tmp = path.with_name(path.name + ".tmp")
    save_file(state, str(tmp))
    os.replace(tmp, path)


def load_weights_for_eval(checkpoint: Path, ema_index: int | None) -> dict:
    """Weights to evaluate from a checkpoint directory (model and, if saved, EMA) or a weights file."""
    if not checkpoint.is_dir():
        if not checkpoint.is_file():
            raise UserFileError(f"--checkpoint {checkpoint} is neither a checkpoint directory nor a weights file")
        return {"model": read_state_dict(checkpoint)}
    found = {"model": read_state_dict(checkpoint / "model.safetensors")}
    ema_file = checkpoint / f"custom_checkpoint_{ema_index}.pkl" if ema_index is not None else None
    if ema_file is not None and ema_file.is_file():
        found["ema"] = read_state_dict(ema_file)
    return found
