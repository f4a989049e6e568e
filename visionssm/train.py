"""Train (or evaluate) a timm/visionssm image classifier on ImageNet or any ImageFolder, with accelerate.

    visionssm-train                               # embedded default: small model, generated shapes set, CPU-friendly
    accelerate launch -m visionssm.train --config configs/imagenet/mamba_vision_T.yaml --data-dir DATA --output OUT
    visionssm-train --eval-only --checkpoint OUT/checkpoints/epoch_0012 --output OUT

``python -m visionssm.train`` and a checkout's ``train_imagenet.py`` are the same program. The loop is timm's
``train.py`` shape: :func:`train_one_epoch`, :func:`validate`, :func:`main`.

timm provides the data pipeline (transforms, RandAugment, random erasing, Mixup/CutMix), the optimizer factory
(honouring the model's ``no_weight_decay``), the warmup-cosine schedule and the EMA; accelerate provides devices,
DDP, mixed precision, gradient accumulation and checkpoint state. The timm scheduler is not passed through
``accelerator.prepare`` (its wrapper assumes torch schedulers and steps once per process): it is stepped here with
the global update count and saved with ``register_for_checkpointing``.

Every key of the packaged ``configs/imagenet/default.yaml`` can be set by a recipe (``--config``: a file, or the
name of a recipe shipped in ``visionssm.configs``) and overridden on the command line. ``--epochs N`` is the whole
run: warmup and cooldown are shrunk to fit when they do not (:func:`fit_schedule`). OUT receives ``config.yaml``
(the resolved configuration), ``metrics.jsonl`` (one record per epoch), ``curves.png``, ``checkpoints/`` (the last
``keep_last`` plus the best, each complete or absent) and ``model_best.safetensors`` (plain timm state dict of the
best weights, model or EMA per ``best_metric``). A run pointed at an OUT holding a complete checkpoint continues
from it (``--resume auto``, the default) and ends exactly where the uninterrupted run would have.
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
import yaml
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, ProjectConfiguration, set_seed
from safetensors.torch import save_file
from timm.data import Mixup, create_transform, resolve_data_config
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.models import clean_state_dict
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

import visionssm.models  # noqa: F401  (registers the visionssm backbones with timm)
from visionssm.data.loader import EpochShuffleSampler, ShardSampler, build_split, collate_skipping, patch_timm_posterize
from visionssm.data.synthetic import SyntheticSpec, ensure_synthetic_dataset
from visionssm.utils.checkpoint import read_state_dict
from visionssm.utils.training import CheckpointManager, MetricsLog, TrainState, parse_config, plot_curves, scaled_lr

__all__ = ["fit_schedule", "main", "train_one_epoch", "validate"]

PROG = "visionssm-train"


# ----------------------------------------------------------------------------------------------------------------
# Set-up


def resolve_amp(amp: str) -> str:
    if amp == "fp16" and not torch.cuda.is_available():
        raise ValueError("amp=fp16 needs a GPU; use bf16 or no on CPU")
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


def resolve_data_dir(cfg: dict, accelerator: Accelerator) -> Path:
    """``data_dir``, or the generated set (drawn once, by the main process, the others waiting)."""
    if cfg["data_dir"] is not None:
        return Path(cfg["data_dir"])
    spec = SyntheticSpec(classes=cfg["synthetic_classes"], train_per_class=cfg["synthetic_train_per_class"],
                         val_per_class=cfg["synthetic_val_per_class"], image_size=cfg["synthetic_image_size"],
                         seed=cfg["synthetic_seed"])
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
                      num_workers=cfg["workers"], collate_fn=collate_skipping, persistent_workers=cfg["workers"] > 0,
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
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    if warmup < 0 or cooldown < 0:
        raise ValueError(f"warmup_epochs and cooldown_epochs must be >= 0, got {warmup} and {cooldown}")
    room = epochs - 1
    if warmup + cooldown <= room:
        return warmup, cooldown, None
    fitted_warmup = math.floor(warmup * room / (warmup + cooldown))
    fitted_cooldown = math.floor(cooldown * room / (warmup + cooldown))
    note = (f"note: {epochs} epoch(s) in all: warmup {warmup} -> {fitted_warmup} and cooldown {cooldown} -> "
            f"{fitted_cooldown} epochs, so that the learning rate decays for at least one epoch")
    return fitted_warmup, fitted_cooldown, note


def build_scheduler(cfg: dict, optimizer, updates_per_epoch: int, say):
    """timm's scheduler stepped per update, over exactly ``cfg['epochs']`` epochs."""
    warmup, cooldown, note = fit_schedule(cfg["epochs"], cfg["warmup_epochs"], cfg["cooldown_epochs"])
    if note:
        say(note)
    # timm adds the cooldown (and a prefixed warmup) to the cycle it is given, so it gets what is left of the run.
    cycle = cfg["epochs"] - cooldown - (warmup if cfg["warmup_prefix"] else 0)
    scheduler, num_epochs = create_scheduler_v2(
        optimizer, sched=cfg["sched"], num_epochs=cycle, warmup_epochs=warmup, cooldown_epochs=cooldown,
        warmup_lr=cfg["warmup_lr"], min_lr=cfg["min_lr"], warmup_prefix=cfg["warmup_prefix"], noise_seed=cfg["seed"],
        step_on_epochs=False, updates_per_epoch=updates_per_epoch)
    if scheduler is None:
        raise ValueError(f"sched={cfg['sched']!r} gives no scheduler; use e.g. cosine or constant")
    if num_epochs != cfg["epochs"]:
        raise ValueError(f"sched={cfg['sched']!r} runs {num_epochs} epochs for epochs={cfg['epochs']}: use a "
                         "schedule without restarts (cycle_limit 1)")
    return scheduler


def build_train_loader(cfg: dict, train_set, data_cfg: dict, world: int):
    """The training DataLoader with its sampler and generator (both re-seeded per epoch by the loop)."""
    if cfg["batch_size"] < 1:
        raise ValueError(f"batch_size must be >= 1, got {cfg['batch_size']}")
    patch_timm_posterize()
    train_set.transform = create_transform(
        data_cfg["input_size"], is_training=True, scale=tuple(cfg["scale"]), ratio=tuple(cfg["ratio"]),
        hflip=cfg["hflip"], color_jitter=cfg["color_jitter"], auto_augment=cfg["aa"],
        interpolation=cfg["train_interpolation"], mean=data_cfg["mean"], std=data_cfg["std"],
        re_prob=cfg["reprob"], re_mode=cfg["remode"], re_count=cfg["recount"])
    if len(train_set) < cfg["batch_size"] * world:
        raise ValueError(f"the training split has {len(train_set)} images, fewer than one global batch "
                         f"({cfg['batch_size']} x {world} processes)")
    sampler = EpochShuffleSampler(len(train_set), seed=cfg["seed"], tag_epoch=True)
    # Augmentation draws are per image (SafeImageFolder augment_seed). The DataLoader gets its own generator so
    # that creating an iterator (at an epoch start, or mid-epoch after a resume) does not consume the global RNG,
    # which drop path and Mixup draw from: a resumed run stays on the uninterrupted run's track.
    generator = torch.Generator()
    loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=sampler, drop_last=True,
                        num_workers=cfg["workers"], collate_fn=collate_skipping, generator=generator,
                        pin_memory=cfg["pin_memory"] and torch.cuda.is_available(),
                        persistent_workers=cfg["workers"] > 0)  # the sampler tags each index with its epoch
    return loader, sampler, generator


def build_criterion(cfg: dict, num_classes: int):
    """The loss and, when Mixup/CutMix is on, the batch mixer."""
    mixup_active = cfg["mixup"] > 0 or cfg["cutmix"] > 0 or cfg["cutmix_minmax"] is not None
    if not mixup_active:
        if cfg["smoothing"]:
            return LabelSmoothingCrossEntropy(smoothing=cfg["smoothing"]), None
        return torch.nn.CrossEntropyLoss(), None
    if cfg["batch_size"] % 2:
        raise ValueError(f"batch_size (per process) must be even with Mixup/CutMix, got {cfg['batch_size']}")
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
        raise ValueError(f"best_metric must be auto, top1 or ema_top1, got {cfg['best_metric']!r}")
    if best_key == "ema_top1" and ema is None:
        raise ValueError("best_metric=ema_top1 needs model_ema: true")
    return {"top1": "val_top1", "ema_top1": "ema_val_top1"}[best_key]


# ----------------------------------------------------------------------------------------------------------------
# The run: everything the epoch loop touches


@dataclass
class Run:
    cfg: dict
    accelerator: Accelerator
    out: Path
    model: torch.nn.Module  # what the step calls: prepared (DDP) and possibly compiled
    base_model: torch.nn.Module  # the plain module the EMA follows
    eval_model: torch.nn.Module  # unwrapped: evaluation bypasses DDP, whose shards may differ in length
    ema: ModelEmaV3 | None
    optimizer: torch.optim.Optimizer
    scheduler: object
    criterion: torch.nn.Module
    mixup_fn: Mixup | None
    train_dl: DataLoader
    train_sampler: EpochShuffleSampler
    loader_generator: torch.Generator
    val_dl: DataLoader
    state: TrainState
    checkpoints: CheckpointManager
    metrics: MetricsLog
    best_key: str


def build_model_and_data(cfg: dict, accelerator: Accelerator, data_dir: Path):
    """The splits, the model on its device and its EMA (same initial weights on every process)."""
    train_set = build_split(data_dir, cfg["train_split"], transform=None, on_error="replace",
                            augment_seed=cfg["seed"])
    num_classes = len(train_set.classes)
    if cfg["num_classes"] is not None and cfg["num_classes"] != num_classes:
        raise ValueError(f"num_classes={cfg['num_classes']} but {data_dir / cfg['train_split']} has "
                         f"{num_classes} class folders")
    model = create_model(cfg, num_classes)
    data_cfg = data_config(cfg, model)
    val_set = build_split(data_dir, cfg["val_split"], transform=eval_transform(data_cfg), on_error="drop",
                          class_to_idx=train_set.class_to_idx)
    model.to(accelerator.device)
    if cfg["channels_last"]:
        model.to(memory_format=torch.channels_last)
    if cfg["grad_checkpointing"]:
        model.set_grad_checkpointing(True)
    ema = None
    if cfg["model_ema"]:  # taken before DDP broadcasts the weights
        ema = ModelEmaV3(model, decay=cfg["model_ema_decay"], use_warmup=cfg["model_ema_warmup"])
    return train_set, val_set, model, data_cfg, ema


def prepare_run(cfg: dict, accelerator: Accelerator, out: Path, model, ema, train_set, val_set, data_cfg):
    """Loaders, loss, optimizer and schedule, prepared by accelerate; returns the :class:`Run` and what
    ``config.yaml`` records about it."""
    world = accelerator.num_processes
    train_dl, train_sampler, loader_generator = build_train_loader(cfg, train_set, data_cfg, world)
    criterion, mixup_fn = build_criterion(cfg, len(train_set.classes))
    optimizer, lr, global_batch = build_optimizer(cfg, model, world)
    base_model = model
    if cfg["compile"]:
        model = torch.compile(model, **({"mode": cfg["compile"]} if isinstance(cfg["compile"], str) else {}))
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
    updates_per_epoch = math.ceil(len(train_dl) / cfg["grad_accum_steps"])
    scheduler = build_scheduler(cfg, optimizer, updates_per_epoch, accelerator.print)
    state = TrainState()  # epoch, position, update count, best metric: saved with every checkpoint
    accelerator.register_for_checkpointing(*_checkpointed(scheduler, state, ema))
    accelerator.print(f"global batch {global_batch} ({cfg['batch_size']} x {world} processes x "
                      f"{cfg['grad_accum_steps']} accumulation) -> lr {lr:.3g}; {cfg['epochs']} epochs of "
                      f"{updates_per_epoch} updates")
    run = Run(cfg=cfg, accelerator=accelerator, out=out, model=model, base_model=base_model,
              eval_model=accelerator.unwrap_model(model), ema=ema, optimizer=optimizer, scheduler=scheduler,
              criterion=criterion, mixup_fn=mixup_fn, train_dl=train_dl, train_sampler=train_sampler,
              loader_generator=loader_generator, val_dl=val_loader(val_set, cfg, accelerator), state=state,
              checkpoints=CheckpointManager(accelerator, out, keep_last=cfg["keep_last"]),
              metrics=MetricsLog(out / "metrics.jsonl"), best_key=resolve_best_key(cfg, ema))
    recorded = {"lr": lr, "global_batch": global_batch, "world_size": world, "total_epochs": cfg["epochs"],
                "updates_per_epoch": updates_per_epoch}
    return run, recorded


def resume(run: Run, resolved: dict) -> None:
    """Continue from a checkpoint (or start afresh), then write ``config.yaml`` and start the trackers."""
    cfg, accelerator, state = run.cfg, run.accelerator, run.state
    run.checkpoints.clean_leftovers()
    resume_from = find_resume_checkpoint(cfg["resume"], run.checkpoints)
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        accelerator.print(f"resumed from {resume_from} (epoch {state.epoch}, batch {state.batch_in_epoch}, "
                          f"update {state.global_update})")
        if not accelerator.is_main_process:  # partial-epoch sums were saved already reduced; count them once
            state.loss_sum, state.loss_count, state.images_seen, state.skipped_train = 0.0, 0, 0, 0
    else:
        set_seed(cfg["seed"], device_specific=True)  # drop path and Mixup draw differently on each process
    if accelerator.is_main_process:
        run.out.mkdir(parents=True, exist_ok=True)
        if resume_from is not None:
            run.metrics.truncate(state.epoch)
        elif run.metrics.path.exists():
            run.metrics.path.unlink()
        config_file = run.out / "config.yaml"
        if resume_from is not None and config_file.is_file():
            _warn_changed_settings(yaml.safe_load(config_file.read_text()) or {}, resolved, accelerator.print)
        config_file.write_text(yaml.safe_dump(resolved, sort_keys=False))
    if cfg["log_with"]:
        accelerator.init_trackers("train_imagenet", config={k: v for k, v in cfg.items()
                                                            if isinstance(v, (int, float, str, bool))})
        if accelerator.is_main_process and not accelerator.trackers:  # accelerate drops unavailable ones silently
            raise ValueError(f"log_with={cfg['log_with']!r}: no such tracker is installed (e.g. pip install "
                             "tensorboard)")


# ----------------------------------------------------------------------------------------------------------------
# One epoch


def _train_step(run: Run, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Forward, backward and (when the accumulation window closes) the clipped optimizer step; returns the loss."""
    cfg, accelerator = run.cfg, run.accelerator
    if run.mixup_fn is not None:
        images, targets = run.mixup_fn(images, targets)
    if cfg["channels_last"]:
        images = images.contiguous(memory_format=torch.channels_last)
    with accelerator.accumulate(run.model):
        with accelerator.autocast():
            loss = run.criterion(run.model(images), targets)
        accelerator.backward(loss)
        if accelerator.sync_gradients and cfg["clip_grad"]:
            if cfg["clip_mode"] == "norm":
                accelerator.clip_grad_norm_(run.model.parameters(), cfg["clip_grad"])
            elif cfg["clip_mode"] == "value":
                accelerator.clip_grad_value_(run.model.parameters(), cfg["clip_grad"])
            else:
                raise ValueError(f"clip_mode must be norm or value, got {cfg['clip_mode']!r}")
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
    return loss


def _after_update(run: Run, local: torch.Tensor) -> int:
    """Schedule, EMA and the within-epoch checkpoint after an optimizer update; returns the images it folded."""
    state, every = run.state, run.cfg["checkpoint_every_steps"]
    state.global_update += 1
    run.scheduler.step_update(num_updates=state.global_update)
    if run.ema is not None:
        run.ema.update(run.base_model, step=state.global_update)
    if every and state.global_update % every == 0 and state.batch_in_epoch < len(run.train_dl):
        folded = _fold_partial_sums(state, local, run.accelerator)
        run.checkpoints.save(f"step_{state.global_update:08d}", state)
        return folded
    return 0


def train_one_epoch(run: Run, epoch: int) -> dict:
    """Train epoch ``epoch`` (0-based) from where ``run.state`` stands in it; returns its throughput figures."""
    cfg, accelerator, state = run.cfg, run.accelerator, run.state
    state.epoch = epoch
    if run.mixup_fn is not None and cfg["mixup_off_epoch"] and epoch >= cfg["mixup_off_epoch"]:
        run.mixup_fn.mixup_enabled = False
    run.train_sampler.set_epoch(epoch)  # its (epoch, index) tags select the augmentation draws
    run.train_dl.set_epoch(epoch)
    run.loader_generator.manual_seed(cfg["seed"] * 1_000_003 + epoch)
    device = accelerator.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    loader = run.train_dl if state.batch_in_epoch == 0 else accelerator.skip_first_batches(run.train_dl,
                                                                                           state.batch_in_epoch)
    local = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, samples, images, unreadable
    session_images = 0  # images trained on in this epoch by this run (a resumed epoch started earlier)
    start = time.perf_counter()
    run.model.train()
    bar = tqdm(total=len(run.train_dl), initial=state.batch_in_epoch, desc=f"epoch {epoch + 1}/{cfg['epochs']}",
               disable=not accelerator.is_local_main_process, dynamic_ncols=True, mininterval=1.0)
    for images, targets, unreadable in loader:
        local[3] += unreadable.to(device=local.device, dtype=local.dtype)
        loss = _train_step(run, images, targets)
        n = images.shape[0]
        local[0] += loss.detach().double() * n
        local[1] += n
        local[2] += n
        state.batch_in_epoch += 1
        bar.update(1)
        if state.batch_in_epoch % cfg["log_interval"] == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{run.optimizer.param_groups[0]['lr']:.2e}")
        if accelerator.sync_gradients:
            session_images += _after_update(run, local)
    bar.close()
    seconds = time.perf_counter() - start
    session_images += _fold_partial_sums(state, local, accelerator)
    if state.images_seen and state.batch_in_epoch != len(run.train_dl):
        raise RuntimeError(f"epoch {epoch + 1} consumed {state.batch_in_epoch} of {len(run.train_dl)} batches")
    return {"train_img_per_s": session_images / max(seconds, 1e-9), "started": start}


@torch.no_grad()
def validate(net: torch.nn.Module, loader: DataLoader, accelerator: Accelerator, channels_last: bool) -> dict:
    """Top-1/top-5/loss over the whole split, summed over processes; also img/s and unreadable files."""
    was_training = net.training
    net.eval()
    device = accelerator.device
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # top1, top5, loss, count, unreadable
    start = time.perf_counter()
    for images, targets, unreadable in loader:
        sums[4] += unreadable.item()
        if targets.numel() == 0:
            continue
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with accelerator.autocast():
            logits = net(images)
        logits = logits.float()
        k = min(5, logits.shape[1])
        hits = logits.topk(k, dim=1).indices == targets[:, None]
        sums[0] += hits[:, 0].sum()
        sums[1] += hits.any(dim=1).sum()
        sums[2] += F.cross_entropy(logits, targets, reduction="sum")
        sums[3] += targets.numel()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    sums = accelerator.reduce(sums, reduction="sum")
    net.train(was_training)
    count = max(sums[3].item(), 1.0)
    return {"top1": 100.0 * sums[0].item() / count, "top5": 100.0 * sums[1].item() / count,
            "loss": sums[2].item() / count, "images": int(sums[3].item()), "unreadable": int(sums[4].item()),
            "img_per_s": sums[3].item() / max(seconds, 1e-9)}


def _epoch_record(run: Run, epoch: int, trained: dict, val: dict, ema_val: dict | None) -> dict:
    state, accelerator = run.state, run.accelerator
    peak, peak_kind = peak_memory_mib(accelerator)
    peak = accelerator.gather(torch.tensor([peak], device=accelerator.device)).max().item()
    return {
        "epoch": epoch + 1,
        "global_update": state.global_update,
        "train_loss": state.loss_sum / max(state.loss_count, 1),
        "val_top1": val["top1"], "val_top5": val["top5"], "val_loss": val["loss"],
        "ema_val_top1": ema_val["top1"] if ema_val else None,
        "ema_val_top5": ema_val["top5"] if ema_val else None,
        "ema_val_loss": ema_val["loss"] if ema_val else None,
        "lr": run.optimizer.param_groups[0]["lr"],
        "train_img_per_s": trained["train_img_per_s"],
        "epoch_seconds": time.perf_counter() - trained["started"],
        "peak_memory_mib": peak, "peak_memory_kind": peak_kind,
        "skipped_images": state.skipped_train + val["unreadable"],
        "skipped_train_images": state.skipped_train, "skipped_val_images": val["unreadable"],
        "val_images": val["images"],
    }


def end_epoch(run: Run, epoch: int, trained: dict) -> None:
    """Validate (model and EMA), record the epoch, keep the best weights and write the epoch's checkpoint."""
    cfg, accelerator, state = run.cfg, run.accelerator, run.state
    val = validate(run.eval_model, run.val_dl, accelerator, cfg["channels_last"])
    ema_val = None
    if run.ema is not None:
        ema_val = validate(run.ema.module, run.val_dl, accelerator, cfg["channels_last"])
    record = _epoch_record(run, epoch, trained, val, ema_val)
    is_best = record[run.best_key] > state.best_metric
    if is_best:
        state.best_metric, state.best_epoch = record[run.best_key], epoch + 1
    record["best_" + run.best_key] = state.best_metric
    accelerator.print(
        f"epoch {epoch + 1}/{cfg['epochs']}: train loss {record['train_loss']:.4f}  val top-1 {val['top1']:.2f} "
        f"top-5 {val['top5']:.2f}" + (f"  EMA top-1 {ema_val['top1']:.2f}" if ema_val else "") +
        f"  lr {record['lr']:.3g}  {record['train_img_per_s']:.1f} img/s  {record['epoch_seconds']:.1f} s")
    if accelerator.is_main_process:
        run.metrics.append(record)
        plot_curves(run.metrics.read(), run.out / "curves.png", title=f"{cfg['model']} ({run.out.name})")
        if is_best:
            best = run.ema.module if run.best_key.startswith("ema") else run.eval_model
            save_weights(best, run.out / "model_best.safetensors")
    if cfg["log_with"]:
        accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=state.global_update)
    state.epoch, state.batch_in_epoch = epoch + 1, 0
    state.loss_sum, state.loss_count, state.images_seen, state.skipped_train = 0.0, 0, 0, 0
    run.checkpoints.save(f"epoch_{epoch + 1:04d}", state, is_best=is_best)


# ----------------------------------------------------------------------------------------------------------------
# Main


def main(argv=None) -> int:
    cfg = parse_config(argv, prog=PROG)
    out = Path(cfg["output"])
    amp = resolve_amp(cfg["amp"])
    accelerator = make_accelerator(cfg, out, amp)
    set_seed(cfg["seed"])  # the same initial weights on every process
    data_dir = resolve_data_dir(cfg, accelerator)
    train_set, val_set, model, data_cfg, ema = build_model_and_data(cfg, accelerator, data_dir)
    n_params = sum(p.numel() for p in model.parameters())
    accelerator.print(f"model {cfg['model']}: {n_params / 1e6:.2f} M parameters, {len(train_set.classes)} classes, "
                      f"input {data_cfg['input_size']}, {accelerator.num_processes} process(es) on "
                      f"{accelerator.device}, amp={amp}")
    accelerator.print(f"data: {data_dir} ({len(train_set)} train / {len(val_set)} val images)")
    if cfg["eval_only"]:
        return run_eval_only(cfg, accelerator, model, ema, val_set, out)

    run, recorded = prepare_run(cfg, accelerator, out, model, ema, train_set, val_set, data_cfg)
    resolved = dict(cfg, **recorded, num_classes=len(train_set.classes), amp=amp, data_dir=str(data_dir),
                    input_size=list(data_cfg["input_size"]), crop_pct=data_cfg["crop_pct"],
                    mean=list(data_cfg["mean"]), std=list(data_cfg["std"]), interpolation=data_cfg["interpolation"],
                    parameters=n_params, versions={"torch": str(torch.__version__), "timm": str(timm.__version__),
                                                   "python": platform.python_version()})
    resume(run, resolved)
    for epoch in range(run.state.epoch, cfg["epochs"]):
        end_epoch(run, epoch, train_one_epoch(run, epoch))
    if cfg["log_with"]:
        accelerator.end_training()
    accelerator.print(f"done: best {run.best_key} {run.state.best_metric:.2f} at epoch {run.state.best_epoch}; "
                      f"outputs in {out}")
    return 0


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints, weights and evaluation


def _checkpointed(scheduler, state: TrainState, ema):
    """The objects saved with every checkpoint besides model/optimizer; the EMA, if any, is last."""
    return (scheduler, state) if ema is None else (scheduler, state, ema)


EMA_CHECKPOINT_INDEX = 2  # position of the EMA in _checkpointed (custom_checkpoint_2.pkl)


def _fold_partial_sums(state: TrainState, local: torch.Tensor, accelerator: Accelerator) -> int:
    """Add this epoch's per-process sums, reduced over processes, into ``state`` (and zero them).

    Returns the number of images added."""
    total = accelerator.reduce(local.clone(), reduction="sum")
    state.loss_sum += total[0].item()
    state.loss_count += int(total[1].item())
    state.images_seen += int(total[2].item())
    state.skipped_train += int(total[3].item())
    local.zero_()
    return int(total[2].item())


# Settings that may differ between a run and its continuation without changing what is being trained.
_RUNTIME_KEYS = {"resume", "eval_only", "checkpoint", "workers", "pin_memory", "log_with", "log_interval",
                 "keep_last", "checkpoint_every_steps", "output", "config", "val_batch_size", "versions"}


def _warn_changed_settings(previous: dict, current: dict, say) -> None:
    """A resumed run restores the schedule, optimizer and EMA from the checkpoint; say which settings changed."""
    changed = sorted(k for k in set(previous) | set(current)
                     if k not in _RUNTIME_KEYS and previous.get(k) != current.get(k))
    if changed:
        say("WARNING: resuming with settings that differ from the checkpointed run's config.yaml: " + ", ".join(
            f"{k}: {previous.get(k)!r} -> {current.get(k)!r}" for k in changed) +
            " (the restored lr schedule keeps the original epochs and warmup)")


def find_resume_checkpoint(resume, checkpoints: CheckpointManager) -> Path | None:
    resume = "never" if resume is False else ("latest" if resume is True else str(resume))
    latest = checkpoints.latest()
    if resume == "auto":
        return latest
    if resume == "latest":
        if latest is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint under {checkpoints.root}")
        return latest
    if resume == "never":
        if latest is not None:
            raise FileExistsError(f"{checkpoints.root} already holds checkpoints (latest {latest.name}) and "
                                  "resume=never: choose another --output or resume")
        return None
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"--resume {path}: not a complete checkpoint directory (no trainer_state.json)")
    return path


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
            raise FileNotFoundError(f"checkpoint {checkpoint} is neither a checkpoint directory nor a weights file")
        return {"model": read_state_dict(checkpoint)}
    found = {"model": read_state_dict(checkpoint / "model.safetensors")}
    ema_file = checkpoint / f"custom_checkpoint_{ema_index}.pkl" if ema_index is not None else None
    if ema_file is not None and ema_file.is_file():
        found["ema"] = read_state_dict(ema_file)
    return found


def run_eval_only(cfg: dict, accelerator: Accelerator, model, ema, val_set, out: Path) -> int:
    checkpoint = cfg["checkpoint"]
    if checkpoint is None:
        checkpoint = CheckpointManager.complete(out / "checkpoints")
        if not checkpoint:
            raise ValueError("--eval-only needs --checkpoint (or an --output holding checkpoints)")
        checkpoint = checkpoint[-1][0]
    checkpoint = Path(checkpoint)
    found = load_weights_for_eval(checkpoint, EMA_CHECKPOINT_INDEX if ema is not None else None)
    val_dl = val_loader(val_set, cfg, accelerator)
    results = {"checkpoint": str(checkpoint), "model": cfg["model"]}
    for name, weights in found.items():
        model.load_state_dict(weights)
        res = validate(model, val_dl, accelerator, cfg["channels_last"])
        prefix = "" if name == "model" else "ema_"
        results.update({f"{prefix}val_top1": res["top1"], f"{prefix}val_top5": res["top5"],
                        f"{prefix}val_loss": res["loss"], f"{prefix}img_per_s": res["img_per_s"]})
        results["val_images"], results["skipped_val_images"] = res["images"], res["unreadable"]
    accelerator.print(json.dumps(results))
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
