"""The ImageNet trainer's run (:func:`train`), to which :mod:`visionssm.train` (the ``visionssm-train`` command)
hands the parsed configuration; the loop is timm's ``train.py`` shape: :func:`train_one_epoch`, :func:`validate`,
:func:`end_epoch`. It lives apart from the command so that ``--help`` and a mistyped flag answer without loading
torch, timm and the models.

timm provides the data pipeline (transforms, RandAugment, random erasing, Mixup/CutMix), the optimizer factory
(honouring the model's ``no_weight_decay``), the warmup-cosine schedule and the EMA; accelerate provides devices,
DDP, mixed precision, gradient accumulation and checkpoint state. The timm scheduler is not passed through
``accelerator.prepare`` (its wrapper assumes torch schedulers and steps once per process): it is stepped here with
the global update count and saved with ``register_for_checkpointing``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
import yaml
from accelerate import Accelerator
from accelerate.utils import set_seed
from timm.data import Mixup
from timm.data.random_erasing import RandomErasing
from timm.utils import ModelEmaV3
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

import visionssm.models  # noqa: F401  (registers the visionssm backbones with timm)
from visionssm.data.gpu import EncodedImageFolder, EvalStage, TrainStage, resolve_data_backend
from visionssm.data.loader import EpochShuffleSampler, build_split
from visionssm.training.setup import (
    build_criterion,
    build_optimizer,
    build_scheduler,
    build_train_loader,
    check_config,
    create_model,
    data_config,
    eval_transform,
    find_resume_checkpoint,
    gpu_stages,
    load_weights_for_eval,
    make_accelerator,
    peak_memory_mib,
    resolve_amp,
    resolve_best_key,
    resolve_data_dir,
    save_weights,
    val_loader,
)
from visionssm.training.state import (
    CheckpointManager,
    MetricsLog,
    TrainState,
    deterministic_algorithms,
    plot_curves,
)
from visionssm.utils.cli import UserValueError, compile_mode

__all__ = ["Run", "describe_model", "end_epoch", "train", "train_one_epoch", "validate", "validate_many"]


# ----------------------------------------------------------------------------------------------------------------
# The run: everything the epoch loop touches


@dataclass
class Run:
    """A training run as :func:`train_one_epoch` and :func:`end_epoch` see it."""

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
    train_stage: TrainStage | None = None  # gpu data backend: decodes and augments the loader's byte batches
    val_stage: EvalStage | None = None
    erase: RandomErasing | None = None  # gpu data backend: random erasing on the batch (pil: in the transform)


def build_model_and_data(cfg: dict, accelerator: Accelerator, data_dir: Path, backend: str = "pil"):
    """The splits (file bytes for the gpu data ``backend``), the model on its device and its EMA (same initial
    weights on every process)."""
    encoded = backend == "gpu"
    train_set = build_split(data_dir, cfg["train_split"], transform=None, on_error="replace",
                            augment_seed=cfg["seed"], encoded=encoded)
    num_classes = len(train_set.classes)
    if cfg["num_classes"] is not None and cfg["num_classes"] != num_classes:
        raise UserValueError(f"--num-classes {cfg['num_classes']} but {data_dir / cfg['train_split']} has "
                             f"{num_classes} class folders")
    model = create_model(cfg, num_classes)
    data_cfg = data_config(cfg, model)
    val_set = build_split(data_dir, cfg["val_split"], transform=None if encoded else eval_transform(data_cfg),
                          on_error="drop", class_to_idx=train_set.class_to_idx, encoded=encoded)
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
    mode = compile_mode(cfg["compile"], "--compile")
    if mode is not None:
        # in place: the state dict keeps its keys, so a checkpoint loads into a compiled or an eager run alike
        model.compile(mode=mode)
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
              # one process: checkpoints are written by a thread while training goes on
              checkpoints=CheckpointManager(accelerator, out, keep_last=cfg["keep_last"], background=world == 1),
              metrics=MetricsLog(out / "metrics.jsonl"), best_key=resolve_best_key(cfg, ema))
    if isinstance(train_set, EncodedImageFolder):
        run.train_stage, run.val_stage, run.erase = gpu_stages(cfg, train_set, val_set, data_cfg,
                                                               accelerator.device, accelerator.print)
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
            raise UserValueError(f"--log-with {cfg['log_with']!r}: no such tracker is installed (e.g. pip "
                                 "install tensorboard)")


# ----------------------------------------------------------------------------------------------------------------
# One epoch


def _train_step(run: Run, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Forward, backward and (when the accumulation window closes) the clipped optimizer step; returns the loss."""
    cfg, accelerator = run.cfg, run.accelerator
    if run.erase is not None:
        images = run.erase(images)
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
    stage_seconds = dict(run.train_stage.seconds) if run.train_stage is not None else {}
    batches = iter(run.train_stage(loader) if run.train_stage is not None else loader)
    data_wait = 0.0  # the loop's time blocked on its next batch (timm's data_time)
    while True:
        waited = time.perf_counter()
        batch = next(batches, None)
        data_wait += time.perf_counter() - waited
        if batch is None:
            break
        images, targets, unreadable = batch
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
    times = {"train_data_wait_s": data_wait}
    if run.train_stage is not None:  # the gpu data backend's own time in this epoch (its thread, this process)
        times.update({f"data_stage_{k}_s": v - stage_seconds[k] for k, v in run.train_stage.seconds.items()})
    return {"train_img_per_s": session_images / max(seconds, 1e-9), "started": start, "times": times}


def validate(net: torch.nn.Module, loader: DataLoader, accelerator: Accelerator, channels_last: bool,
             stage: EvalStage | None = None) -> dict:
    """Top-1/top-5/loss over the whole split, summed over processes; also img/s and unreadable files. ``stage``
    decodes and transforms the loader's byte batches (gpu data backend)."""
    return validate_many([net], loader, accelerator, channels_last, stage)[0]


@torch.no_grad()
def validate_many(nets: list[torch.nn.Module], loader: DataLoader, accelerator: Accelerator, channels_last: bool,
                  stage: EvalStage | None = None) -> list[dict]:
    """:func:`validate` for several networks (the model and its EMA) on one pass over the split: each batch is read
    and decoded once."""
    was_training = [net.training for net in nets]
    for net in nets:
        net.eval()
    device = accelerator.device
    sums = torch.zeros(len(nets), 5, dtype=torch.float64, device=device)  # top1, top5, loss, count, unreadable
    start = time.perf_counter()
    for images, targets, unreadable in (stage(loader) if stage is not None else loader):
        sums[:, 4] += unreadable.item()
        if targets.numel() == 0:
            continue
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        for row, net in zip(sums, nets):
            with accelerator.autocast():
                logits = net(images)
            logits = logits.float()
            k = min(5, logits.shape[1])
            hits = logits.topk(k, dim=1).indices == targets[:, None]
            row[0] += hits[:, 0].sum()
            row[1] += hits.any(dim=1).sum()
            row[2] += F.cross_entropy(logits, targets, reduction="sum")
            row[3] += targets.numel()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    sums = accelerator.reduce(sums, reduction="sum")
    results = []
    for net, training, row in zip(nets, was_training, sums.tolist()):
        net.train(training)
        count = max(row[3], 1.0)
        results.append({"top1": 100.0 * row[0] / count, "top5": 100.0 * row[1] / count, "loss": row[2] / count,
                         "images": int(row[3]), "unreadable": int(row[4]), "img_per_s": row[3] / max(seconds, 1e-9),
                         "seconds": seconds})
    return results


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
        # where the training loop's time went, this process: waiting for batches, and the gpu data stage's decode and
        # transform seconds (on its own thread, so they overlap the step)
        **trained["times"],
        "epoch_seconds": time.perf_counter() - trained["started"],
        "wall_time": time.time(),  # whole-run throughput spans records (benchmarks/train_throughput.py)
        "peak_memory_mib": peak, "peak_memory_kind": peak_kind,
        "skipped_images": state.skipped_train + val["unreadable"],
        "skipped_train_images": state.skipped_train, "skipped_val_images": val["unreadable"],
        "val_images": val["images"],
        "val_seconds": val["seconds"],  # evaluation's share of an epoch's fixed cost (train_throughput.py)
    }


def end_epoch(run: Run, epoch: int, trained: dict) -> None:
    """Validate (model and EMA), record the epoch, keep the best weights and write the epoch's checkpoint."""
    cfg, accelerator, state = run.cfg, run.accelerator, run.state
    nets = [run.eval_model] + ([run.ema.module] if run.ema is not None else [])
    val, *ema_val = validate_many(nets, run.val_dl, accelerator, cfg["channels_last"], run.val_stage)
    ema_val = ema_val[0] if ema_val else None
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
# The run


def describe_model(cfg: dict) -> str:
    """The model as the run builds it: a non-empty ``model_kwargs`` makes it another width or depth than the name's."""
    if not cfg["model_kwargs"]:
        return cfg["model"]
    kwargs = json.dumps(cfg["model_kwargs"])
    return f"{cfg['model']} resized by model_kwargs {kwargs} (--model-kwargs '{{}}': the named size)"


def train(cfg: dict) -> int:
    """Check the parsed ``cfg`` (:func:`~visionssm.training.setup.check_config`), then train, or with
    ``eval_only`` evaluate, as it says; returns the exit status."""
    # launched processes share one terminal: the main one says what was capped
    check_config(cfg, say=print if int(os.environ.get("LOCAL_RANK", "0")) == 0 else None)
    with deterministic_algorithms(cfg["deterministic"]):
        return _main(cfg)


def _main(cfg: dict) -> int:
    out = Path(cfg["output"])
    amp = resolve_amp(cfg["amp"])
    weights = load_eval_weights(cfg, out) if cfg["eval_only"] else None  # a bad file stops the run before any work
    accelerator = make_accelerator(cfg, out, amp)
    set_seed(cfg["seed"])  # the same initial weights on every process
    data_dir = resolve_data_dir(cfg, accelerator)
    backend = resolve_data_backend(cfg["data_backend"], accelerator.device, accelerator.print)
    train_set, val_set, model, data_cfg, ema = build_model_and_data(cfg, accelerator, data_dir, backend)
    n_params = sum(p.numel() for p in model.parameters())
    accelerator.print(f"model {describe_model(cfg)}: {n_params / 1e6:.2f} M parameters, {len(train_set.classes)} "
                      f"classes, input {data_cfg['input_size']}, {accelerator.num_processes} process(es) on "
                      f"{accelerator.device}, amp={amp}")
    backend_note = ", gpu backend" if backend == "gpu" else ""
    accelerator.print(f"data: {data_dir} ({len(train_set)} train / {len(val_set)} val images{backend_note})")
    if cfg["eval_only"]:
        return run_eval_only(cfg, accelerator, model, weights, val_set, out, data_cfg)

    run, recorded = prepare_run(cfg, accelerator, out, model, ema, train_set, val_set, data_cfg)
    resolved = dict(cfg, **recorded, num_classes=len(train_set.classes), amp=amp, data_dir=str(data_dir),
                    data_backend=backend,
                    input_size=list(data_cfg["input_size"]), crop_pct=data_cfg["crop_pct"],
                    mean=list(data_cfg["mean"]), std=list(data_cfg["std"]), interpolation=data_cfg["interpolation"],
                    parameters=n_params, versions={"torch": str(torch.__version__), "timm": str(timm.__version__),
                                                   "python": platform.python_version()})
    resume(run, resolved)
    for epoch in range(run.state.epoch, cfg["epochs"]):
        end_epoch(run, epoch, train_one_epoch(run, epoch))
    run.checkpoints.wait()
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
                 "keep_last", "checkpoint_every_steps", "output", "config", "val_batch_size", "versions", "compile"}


def _warn_changed_settings(previous: dict, current: dict, say) -> None:
    """A resumed run restores the schedule, optimizer and EMA from the checkpoint; say which settings changed."""
    changed = sorted(k for k in set(previous) | set(current)
                     if k not in _RUNTIME_KEYS and previous.get(k) != current.get(k))
    if changed:
        say("WARNING: resuming with settings that differ from the checkpointed run's config.yaml: " + ", ".join(
            f"{k}: {previous.get(k)!r} -> {current.get(k)!r}" for k in changed) +
            " (the restored lr schedule keeps the original epochs and warmup)")


def load_eval_weights(cfg: dict, out: Path) -> tuple[Path, dict]:
    """The checkpoint ``--eval-only`` evaluates (``--checkpoint``, else OUT's latest) and its weights (model and, if
    saved, EMA)."""
    checkpoint = cfg["checkpoint"]
    if checkpoint is None:
        checkpoint = CheckpointManager.complete(out / "checkpoints")
        if not checkpoint:
            raise UserValueError(f"--eval-only needs --checkpoint (or an --output holding checkpoints; {out} has none)")
        checkpoint = checkpoint[-1][0]
    checkpoint = Path(checkpoint)
    return checkpoint, load_weights_for_eval(checkpoint, EMA_CHECKPOINT_INDEX if cfg["model_ema"] else None)


def run_eval_only(cfg: dict, accelerator: Accelerator, model, loaded: tuple[Path, dict], val_set, out: Path,
                  data_cfg: dict) -> int:
    checkpoint, found = loaded
    val_dl = val_loader(val_set, cfg, accelerator)
    stage = None
    if isinstance(val_set, EncodedImageFolder):
        stage = gpu_stages(cfg, None, val_set, data_cfg, accelerator.device, accelerator.print)[1]
    results = {"checkpoint": str(checkpoint), "model": cfg["model"]}
    for name, weights in found.items():
        try:
            model.load_state_dict(weights)
        except RuntimeError as error:  # torch lists every missing and unexpected key; the start names the problem
            raise UserValueError(f"--checkpoint {checkpoint}: its {name} weights do not fit "
                                 f"{describe_model(cfg)}: {' '.join(str(error).split())[:300]}") from None
        res = validate(model, val_dl, accelerator, cfg["channels_last"], stage)
        prefix = "" if name == "model" else "ema_"
        results.update({f"{prefix}val_top1": res["top1"], f"{prefix}val_top5": res["top5"],
                        f"{prefix}val_loss": res["loss"], f"{prefix}img_per_s": res["img_per_s"]})
        results["val_images"], results["skipped_val_images"] = res["images"], res["unreadable"]
    accelerator.print(json.dumps(results))
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0
