"""The training behind ``python -m visionssm.tracking.train`` (:mod:`visionssm.tracking.train`, which parses its
arguments before importing this): :func:`train` runs or resumes one experiment config. The recipe, the outputs and
resuming are described in :mod:`visionssm.tracking.train`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm import tqdm

from visionssm.training.state import CheckpointManager, MetricsLog, TrainState, deterministic_algorithms
from visionssm.utils.cli import UserValueError, cap_workers, compile_mode

from .data.got10k import Got10k
from .data.lasot import LaSOT
from .data.sampler import PairDataset
from .losses import tracking_loss
from .model.tracker_model import build_model

NO_DECAY_NAMES = ("pos_embed", "token_type", "A_log", "dt_bias")


def build_datasets(cfg: dict) -> PairDataset:
    d = cfg["data"]
    if not d["train"]:
        raise UserValueError("data.train lists no dataset (e.g. --set 'data.train.0={type: got10k, root: DIR}')")
    datasets, ratios = [], []
    for entry in d["train"]:
        cls = Got10k if entry["type"] == "got10k" else LaSOT
        datasets.append(cls(entry["root"], entry["split"]))
        ratios.append(float(entry["ratio"]))
    return PairDataset(
        datasets, ratios, d["pairs_per_epoch"], d["max_gap"], cfg["model"]["template_size"],
        cfg["model"]["search_size"], d["template_factor"], d["search_factor"], d["center_jitter"],
        d["scale_jitter"], d["grayscale_prob"], d["flip_prob"], tuple(d["brightness"]), cfg["seed"],
    )


def _worker_init(_):
    # Each loader worker decodes and warps whole images; one OpenCV/torch thread per worker avoids oversubscription.
    import cv2

    cv2.setNumThreads(1)
    torch.set_num_threads(1)


def param_groups(model: torch.nn.Module, lr: float, backbone_mult: float, weight_decay: float) -> list[dict]:
    """Backbone parameters at ``lr·backbone_mult``, the head at ``lr``; no decay for 1-D parameters and embeddings."""
    groups: dict[tuple[bool, bool], list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = p.ndim >= 2 and not any(k in name for k in NO_DECAY_NAMES)
        groups.setdefault((name.startswith("backbone."), decay), []).append(p)
    return [{"params": params, "lr": lr * (backbone_mult if bb else 1.0),
             "weight_decay": weight_decay if decay else 0.0} for (bb, decay), params in sorted(groups.items())]


def save_atomic(obj: dict, path: str):
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


@dataclass
class _Loop:
    """What the training loop touches; one instance per call of :func:`train`."""

    cfg: dict
    accelerator: Accelerator
    dataset: PairDataset
    loader: DataLoader
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    state: TrainState
    checkpoints: CheckpointManager
    metrics: MetricsLog
    progress: bool
    started: float
    last_stats: dict = field(default_factory=dict)  # the mean statistics of the last epoch this call finished

    def log(self, record: dict) -> None:
        if self.accelerator.is_main_process:
            self.metrics.append(record)

    def fold(self, window: dict, window_n: int, sums: dict) -> dict:
        """Average a window of step statistics over processes and add it into the epoch's sums."""
        means = {k: float(self.accelerator.reduce(v / window_n, "mean")) for k, v in window.items()}
        for k, v in means.items():
            sums[k] = sums.get(k, 0.0) + v * window_n
        sums["n"] = sums.get("n", 0) + window_n
        return means

    def stop_reason(self) -> str | None:
        t = self.cfg["train"]
        if t["max_steps"] and self.state.global_update >= t["max_steps"]:
            return "max_steps"
        if t["time_limit_s"] and time.time() - self.started > t["time_limit_s"]:
            return "time_limit_s"
        return None

    def step(self, batch: dict) -> dict:
        t = self.cfg["train"]
        weights = (t["loss_weights"]["focal"], t["loss_weights"]["giou"], t["loss_weights"]["l1"])
        outputs = self.model(batch["template"], batch["search"])
        loss, stats = tracking_loss(outputs, batch["search_box"], weights)
        self.accelerator.backward(loss)
        if t["grad_clip"]:
            self.accelerator.clip_grad_norm_(self.model.parameters(), t["grad_clip"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.global_update += 1
        self.state.batch_in_epoch += 1
        return stats

    def run_epoch(self) -> str | None:
        """Train the current epoch from where the state stands in it; returns why it stopped early, if it did."""
        t, state, accelerator = self.cfg["train"], self.state, self.accelerator
        epoch, steps = state.epoch, len(self.loader)
        self.dataset.set_epoch(epoch)
        self.model.train()
        batches = self.loader if state.batch_in_epoch == 0 else accelerator.skip_first_batches(self.loader,
                                                                                              state.batch_in_epoch)
        window: dict[str, torch.Tensor] = {}
        window_n, tic, epoch_tic = 0, time.time(), time.time()
        sums = state.extra.get("epoch_sums", {})
        # the bar is advanced by hand: the loop leaves on its last batch, before tqdm would count it
        bar = tqdm(total=steps, initial=state.batch_in_epoch, desc=f"epoch {epoch + 1}/{t['epochs']}",
                   disable=not (self.progress and accelerator.is_main_process), dynamic_ncols=True)
        stop = None
        for batch in batches:
            for k, v in self.step(batch).items():
                window[k] = window.get(k, 0) + v
            window_n += 1
            bar.update(1)
            last = state.batch_in_epoch == steps
            if state.global_update % t["log_every"] == 0 or last:
                means = self.fold(window, window_n, sums)
                if not math.isfinite(means["loss"]):
                    raise FloatingPointError(f"non-finite loss at step {state.global_update}: {means}")
                self.log({"epoch": epoch + 1, "step": state.global_update, "lr": self.optimizer.param_groups[-1]["lr"],
                          **means, "pairs_per_s": window_n * t["batch_size"] * accelerator.num_processes /
                          max(time.time() - tic, 1e-9)})
                bar.set_postfix(loss=f"{means['loss']:.3f}", iou=f"{means['iou']:.3f}")
                window, window_n, tic = {}, 0, time.time()
            state.extra["epoch_sums"] = sums
            stop = self.stop_reason()
            if last:
                break
            if stop or (t["checkpoint_every_steps"] and state.global_update % t["checkpoint_every_steps"] == 0):
                if window_n:  # fold the unlogged window in so that the epoch summary survives a resume
                    self.fold(window, window_n, sums)
                    window, window_n = {}, 0
                self.checkpoints.save(f"step_{state.global_update:08d}", state)
                if stop:
                    bar.close()
                    return stop
        bar.close()
        self.end_epoch(sums, time.time() - epoch_tic)
        return stop

    def end_epoch(self, sums: dict, seconds: float) -> None:
        state = self.state
        n = max(sums.get("n", 0), 1)
        self.last_stats = {k: v / n for k, v in sums.items() if k != "n"}
        self.log({"epoch": state.epoch + 1, "step": state.global_update, "epoch_summary": True, "seconds": seconds,
                  **self.last_stats})
        self.scheduler.step()
        state.epoch, state.batch_in_epoch, state.extra = state.epoch + 1, 0, {}
        self.checkpoints.save(f"epoch_{state.epoch:04d}", state)


def _prepare(cfg: dict, accelerator: Accelerator, progress: bool) -> _Loop:
    """Data, model, optimizer and schedule: everything that can fail on the user's settings, built before any file
    is written."""
    t = cfg["train"]
    dataset = build_datasets(cfg)
    workers = cap_workers(cfg["data"]["num_workers"], "data.num_workers",
                          accelerator.print if accelerator.is_main_process else None)
    loader = DataLoader(dataset, batch_size=t["batch_size"], shuffle=False, drop_last=True,
                        num_workers=workers, pin_memory=torch.cuda.is_available(),
                        persistent_workers=False, worker_init_fn=_worker_init)
    model = build_model(cfg["model"], load_pretrained=True)
    if t["grad_checkpointing"]:
        model.backbone.set_grad_checkpointing(True)
    mode = compile_mode(t["compile"], "train.compile")
    if mode is not None:
        # in place: the state dict keeps its keys, so checkpoints and final.pth are the same as an eager run's
        model.compile(mode=mode)
    optimizer = torch.optim.AdamW(param_groups(model, t["lr"], t["backbone_lr_mult"], t["weight_decay"]),
                                  lr=t["lr"], weight_decay=t["weight_decay"])
    drop_epoch = max(1, int(round(t["lr_drop_fraction"] * t["epochs"])))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[drop_epoch], gamma=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if len(loader) == 0:
        raise ValueError(f"data.pairs_per_epoch ({cfg['data']['pairs_per_epoch']}) is smaller than one batch "
                         f"({t['batch_size']} x {accelerator.num_processes} processes)")
    state = TrainState()
    accelerator.register_for_checkpointing(scheduler, state)
    out_dir = cfg["output_dir"]
    return _Loop(cfg, accelerator, dataset, loader, model, optimizer, scheduler, state,
                 CheckpointManager(accelerator, out_dir, keep_last=t["keep_last"]),
                 MetricsLog(os.path.join(out_dir, "metrics.jsonl")), progress, time.time())


def _start(loop: _Loop, resume: bool) -> None:
    """Write ``config.yaml``, then continue from the newest complete checkpoint (or start afresh)."""
    accelerator, state, metrics = loop.accelerator, loop.state, loop.metrics
    if accelerator.is_main_process:
        os.makedirs(loop.cfg["output_dir"], exist_ok=True)
        with open(os.path.join(loop.cfg["output_dir"], "config.yaml"), "w") as f:
            yaml.safe_dump(loop.cfg, f, sort_keys=False)
    loop.checkpoints.clean_leftovers()
    latest = loop.checkpoints.latest() if resume else None
    if latest is not None:
        accelerator.load_state(str(latest))
        accelerator.print(f"resumed from {latest} (epoch {state.epoch + 1}, batch {state.batch_in_epoch}, "
                          f"step {state.global_update})")
        if accelerator.is_main_process:
            records = [r for r in metrics.read() if r["step"] <= state.global_update]
            tmp = str(metrics.path) + ".tmp"
            with open(tmp, "w") as f:
                f.write("".join(json.dumps(r) + "\n" for r in records))
            os.replace(tmp, metrics.path)
    elif accelerator.is_main_process and metrics.path.exists():
        metrics.path.unlink()


def train(cfg: dict, resume: bool = True, progress: bool = True) -> dict:
    """Run (or resume) training; returns the mean statistics of the last epoch worked on.

    A run that fails before its first optimizer step leaves no output folder behind (if it created it). With
    ``train.deterministic`` it runs on deterministic algorithms (:func:`deterministic_algorithms`), without which a
    GPU run, resumed or repeated, matches the uninterrupted one only to rounding.
    """
    with deterministic_algorithms(cfg["train"]["deterministic"]):
        return _train(cfg, resume, progress)


def _train(cfg: dict, resume: bool, progress: bool) -> dict:
    accelerator = Accelerator(mixed_precision=cfg["train"]["mixed_precision"])
    set_seed(cfg["seed"])
    loop = _prepare(cfg, accelerator, progress)
    out_dir = cfg["output_dir"]
    created = not os.path.exists(out_dir)
    try:
        _start(loop, resume)
        if loop.state.epoch >= cfg["train"]["epochs"] and os.path.isfile(os.path.join(out_dir, "final.pth")):
            accelerator.print(f"nothing to do: {out_dir} holds a finished run ({loop.state.epoch} epochs, step "
                              f"{loop.state.global_update}; its tracker is {os.path.join(out_dir, 'final.pth')}). "
                              "--no-resume trains it again from scratch (or give another name / output_dir).")
            return {}
        stop = None
        while loop.state.epoch < cfg["train"]["epochs"] and stop is None:
            stop = loop.run_epoch()
    except BaseException:
        if created and loop.state.global_update == 0 and accelerator.is_main_process:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    finished = loop.state.epoch >= cfg["train"]["epochs"]
    if accelerator.is_main_process:
        save_atomic({"model": accelerator.unwrap_model(loop.model).state_dict(), "config": cfg, "finished": finished,
                     "epoch": loop.state.epoch, "step": loop.state.global_update}, os.path.join(out_dir, "final.pth"))
        if stop:
            accelerator.print(f"stopped early ({stop}) at step {loop.state.global_update}; rerun to resume")
    accelerator.wait_for_everyone()
    return loop.last_stats
