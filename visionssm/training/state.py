"""Pieces of the ImageNet trainer (:mod:`visionssm.train`) that are worth testing on their own.

- ``parse_config``: timm's config flow. The packaged ``configs/imagenet/default.yaml`` lists every key with its
  default, a recipe YAML overrides some, and the command line overrides any (``batch_size`` is ``--batch-size``).
- ``TrainState``: epoch / position / update count / best metric, saved with the accelerate checkpoint.
- ``CheckpointManager``: ``accelerator.save_state`` into a temporary directory, renamed when complete, so a kill at
  any moment leaves the previous checkpoints intact; keeps the last K and the best.
- ``MetricsLog`` and ``plot_curves``: ``metrics.jsonl`` (one record per epoch) and ``curves.png``.
- ``deterministic_algorithms``: the switch behind both trainers' ``deterministic`` setting.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import json
import math
import os
import re
import shutil
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from visionssm.configs import find_config
from visionssm.utils.cli import ArgumentParser, UserFileError, UserValueError, compile_mode, load_yaml_mapping

__all__ = ["CheckpointManager", "MetricsLog", "TrainState", "DEFAULT_CONFIG", "deterministic_algorithms",
           "parse_config", "plot_curves", "plot_runs", "scaled_lr"]

DEFAULT_CONFIG = find_config("default", "imagenet")
_AMP_CHOICES = ("auto", "no", "bf16", "fp16")


#: cuBLAS's workspace setting under which its GEMMs repeat bit for bit (read when the process's first cuBLAS handle
#: is made; PyTorch's deterministic mode refuses cuBLAS calls without it or ``:16:8``).
CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool = True) -> Iterator[None]:
    """Run the block on PyTorch's deterministic algorithms (``torch.use_deterministic_algorithms``, cuDNN's
    deterministic convolutions, no cuDNN benchmarking), restoring the previous settings after it.

    Why: on a GPU, several kernels sum in an order that changes from run to run (PyTorch flags, for example, its
    memory-efficient attention backward), so two identical GPU runs, or a resumed run and the uninterrupted one,
    drift apart in the last bits (most of a tiny tracker's tensors within a few steps). With this
    on, they are equal to the last bit; an operation that has no deterministic implementation raises and names
    itself instead of running. (The tests' CPU runs repeat without it.)
    ``CUBLAS_WORKSPACE_CONFIG`` is set (unless already set) before anything runs, so it must be entered before the
    process's first CUDA matrix product to take effect: the trainers enter it first thing."""
    if not enabled:
        yield
        return
    import torch  # here, not at the top: parsing a config needs no torch

    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = previous[2], previous[3]


# ----------------------------------------------------------------------------------------------------------------
# Configuration


_GROUP_LINE = re.compile(r"#\s*---\s*(.+?)\s*---\s*$")
_KEY_LINE = re.compile(r"([a-z_][a-z0-9_]*):[^#]*(?:#\s*(.*))?$")


def key_docs(path: str | os.PathLike = DEFAULT_CONFIG) -> tuple[dict[str, str], dict[str, str]]:
    """Each key's ``--help`` text and group, read from the defaults file's comments: the comment after the key (and
    comment lines indented under it), and the last ``# --- name ---`` line above it."""
    helps: dict[str, str] = {}
    groups: dict[str, str] = {}
    group, key = "settings", None
    for line in Path(path).read_text().splitlines():
        header = _GROUP_LINE.match(line.strip())
        entry = _KEY_LINE.match(line)
        if header:
            group, key = header.group(1), None
        elif entry:
            key = entry.group(1)
            helps[key], groups[key] = (entry.group(2) or "").strip(), group
        elif key is not None and line[:1].isspace() and line.strip().startswith("#"):
            helps[key] = f"{helps[key]} {line.strip()[1:].strip()}".strip()
        else:
            key = None
    return helps, groups


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _yaml_number(value):
    """PyYAML reads ``5e-4`` (no dot) as a string; numbers written that way are meant as floats."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _value_parser(key: str, default: Any):
    """The argparse type for a key, from its default's type; YAML syntax for lists, dicts and null."""
    def parse(text: str):
        if isinstance(default, str) and not isinstance(default, bool):
            return None if text.lower() in ("null", "none") else text
        value = _yaml_number(yaml.safe_load(text))
        if isinstance(default, bool) and not isinstance(value, bool):
            raise argparse.ArgumentTypeError(f"{_flag(key)} expects true/false, got {text!r}")
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if isinstance(default, int) and not isinstance(default, bool) and value is not None and not is_int:
            raise argparse.ArgumentTypeError(f"{_flag(key)} expects an integer, got {text!r}")
        if isinstance(default, float) and value is not None:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise argparse.ArgumentTypeError(f"{_flag(key)} expects a number, got {text!r}")
            value = float(value)
        return value
    parse.__name__ = type(default).__name__ if default is not None else "value"
    return parse


def _yaml_text(value) -> str:
    """A value as it would be typed on the command line (YAML: null, true, [0.08, 1.0])."""
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).removesuffix("\n...\n").strip()


def _check_known(config: Mapping, known: Iterable[str], source: str) -> None:
    known = list(known)
    unknown = sorted(set(config) - set(known))
    if unknown:
        hints = [f"{k} -> {close[0]}" for k in unknown if (close := difflib.get_close_matches(k, known, n=1))]
        hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
        raise UserValueError(f"{source}: unknown config keys {unknown}{hint}; every key is listed in "
                             f"{DEFAULT_CONFIG}")


def _apply_layer(merged: dict, layer: Mapping) -> None:
    """Override ``merged`` with ``layer``; ``model_kwargs`` belongs to the model it was written for, so a layer
    that names a model without giving ``model_kwargs`` resets them to ``{}``."""
    merged.update(layer)
    if "model" in layer and "model_kwargs" not in layer:
        merged["model_kwargs"] = {}


def parse_config(argv: Sequence[str] | None = None, defaults_file: str | os.PathLike = DEFAULT_CONFIG,
                 prog: str | None = None) -> dict:
    """Resolve the run's configuration: defaults file, then ``--config``, then command-line flags.

    ``--config`` is a YAML file or the name of a recipe shipped in ``visionssm.configs`` (``mamba_vision_T``,
    ``configs/imagenet/mamba_vision_T.yaml``; see :func:`visionssm.configs.find_config`).
    """
    defaults = load_yaml_mapping(defaults_file)
    pre = ArgumentParser(prog=prog, add_help=False)
    pre.add_argument("-c", "--config", default=None,
                     help="recipe YAML overriding the defaults, or the name of a shipped recipe (mamba_vision_T)")
    known, _ = pre.parse_known_args(argv)
    merged = dict(defaults)
    if known.config:
        try:
            recipe_file = find_config(known.config, "imagenet")
        except FileNotFoundError as error:
            raise UserFileError(f"--config: {error}") from None
        recipe = load_yaml_mapping(recipe_file)
        _check_known(recipe, defaults, str(recipe_file))
        _apply_layer(merged, {k: _yaml_number(v) if isinstance(defaults[k], float) else v for k, v in recipe.items()})

    parser = ArgumentParser(
        prog=prog, argument_default=argparse.SUPPRESS, parents=[pre], usage="%(prog)s [-c RECIPE] [--KEY VALUE ...]",
        description="Train or evaluate a timm/visionssm image classifier with accelerate. Every key of "
                    f"{Path(defaults_file).name} is a flag (batch_size: --batch-size); values use YAML syntax "
                    "(--scale '[0.08, 1.0]', --model-kwargs '{dims: 64}'). Giving --model without --model-kwargs "
                    "resets model_kwargs to {}. --epochs is the whole run, warmup and cooldown included. "
                    "Written into the working directory: the run's folder (--output, default output/train) and, "
                    "without --data-dir, the generated set (data/generated/<set>, about 14 MB, drawn once).")
    helps, group_of = key_docs(defaults_file)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for key, default in defaults.items():
        group_name = group_of.get(key, "settings")
        if group_name not in groups:
            groups[group_name] = parser.add_argument_group(group_name)
        # argparse %-formats help texts
        text = f"{helps.get(key) or ''} (default: {_yaml_text(merged[key])})".replace("%", "%%")
        if key == "resume":
            # bare --resume: continue from the latest checkpoint and fail if there is none
            groups[group_name].add_argument("--resume", nargs="?", const="latest",
                                            help=f"bare --resume: latest. {text}")
        elif key == "compile":
            # bare --compile: torch.compile's default mode
            groups[group_name].add_argument("--compile", nargs="?", const=True, type=_value_parser(key, default),
                                            metavar="MODE", help=text.strip())
        elif isinstance(default, bool):
            groups[group_name].add_argument(_flag(key), action=argparse.BooleanOptionalAction, help=text.strip())
        else:
            groups[group_name].add_argument(_flag(key), type=_value_parser(key, default), metavar=key.upper(),
                                            help=text.strip())
    given = vars(parser.parse_args(argv))
    given.pop("config", None)
    _apply_layer(merged, given)
    config = {key: merged[key] for key in defaults}
    config["config"] = known.config
    if config["amp"] is False:  # YAML reads a bare `no` as false
        config["amp"] = "no"
    if config["amp"] not in _AMP_CHOICES:
        raise UserValueError(f"--amp must be one of {_AMP_CHOICES}, got {config['amp']!r}")
    compile_mode(config["compile"], "--compile")
    return config


def scaled_lr(lr_base: float, lr_base_size: int, global_batch: int, rule: str) -> float:
    """``lr_base`` (tuned at global batch ``lr_base_size``) scaled to ``global_batch`` by ``rule``."""
    ratio = global_batch / lr_base_size
    if rule == "linear":
        return lr_base * ratio
    if rule == "sqrt":
        return lr_base * math.sqrt(ratio)
    if rule == "none":
        return lr_base
    raise UserValueError(f"--lr-scale must be linear, sqrt or none, got {rule!r}")


# ----------------------------------------------------------------------------------------------------------------
# Training state and checkpoints


@dataclass
class TrainState:
    """Where training stands; registered with ``accelerator.register_for_checkpointing``.

    ``epoch`` is the epoch in progress (0-based) and ``batch_in_epoch`` how many of its batches were consumed, so
    an end-of-epoch checkpoint reads ``(epoch + 1, 0)``. ``loss_sum``/``loss_count`` carry the partial epoch's
    training loss across a mid-epoch resume.
    """

    epoch: int = 0
    batch_in_epoch: int = 0
    global_update: int = 0
    best_metric: float = -math.inf
    best_epoch: int = -1
    best_checkpoint: str | None = None
    loss_sum: float = 0.0
    loss_count: int = 0
    images_seen: int = 0
    skipped_train: int = 0
    extra: dict = field(default_factory=dict)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: Mapping) -> None:
        for key, value in state.items():
            setattr(self, key, value)

    @property
    def position(self) -> tuple[int, int]:
        return self.epoch, self.batch_in_epoch


def _cpu_copy(obj):
    """``obj`` with every tensor copied to CPU memory (containers rebuilt, other values deep-copied)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return type(obj)((key, _cpu_copy(value)) for key, value in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_cpu_copy(value) for value in obj)
    return copy.deepcopy(obj)


@contextlib.contextmanager
def captured_writes() -> Iterator[list]:
    """Inside the block, this thread's calls of accelerate's checkpoint writers (``accelerate.checkpointing.save``
    and ``torch.save``) record ``(writer, CPU copy of the object, args, kwargs)`` instead of writing; replaying the
    list writes the same files. Other threads write as usual."""
    import accelerate.checkpointing as checkpointing
    import torch

    writes: list = []
    owner = threading.get_ident()
    real = {"save": checkpointing.save, "torch": torch.save}

    def recording(writer):
        def record(obj, *args, **kwargs):
            if threading.get_ident() != owner:
                return writer(obj, *args, **kwargs)
            writes.append((writer, _cpu_copy(obj), args, kwargs))
            return None
        return record

    checkpointing.save, torch.save = recording(real["save"]), recording(real["torch"])
    try:
        yield writes
    finally:
        checkpointing.save, torch.save = real["save"], real["torch"]


STATE_FILE = "trainer_state.json"  # written last into a checkpoint; its presence marks the checkpoint complete


class CheckpointManager:
    """Checkpoints under ``OUT/checkpoints``: ``epoch_NNNN`` at epoch ends, ``step_NNNNNNNN`` within epochs.

    Every process calls ``save``; accelerate writes into ``.tmp-<name>``, the main process then adds
    ``trainer_state.json`` and renames the directory into place. Deletion goes through a rename to ``.trash-<name>``
    first, so no half-deleted checkpoint ever looks complete. Leftover ``.tmp-*``/``.trash-*`` directories from a
    killed run are removed at start-up.

    With ``background`` (a single process) ``save`` returns once the state is copied to CPU memory: what
    ``accelerator.save_state`` would write is captured, and a thread writes it, adds the state file and renames, while
    training goes on. One write at a time: the next ``save`` (or :meth:`wait`) waits for the previous one and raises
    its error, if any.
    """

    def __init__(self, accelerator, output_dir: str | os.PathLike, keep_last: int, background: bool = False):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.accelerator = accelerator
        self.root = Path(output_dir) / "checkpoints"
        self.keep_last = keep_last
        self.background = background
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

    # -- discovery (works without an accelerator) --
    @staticmethod
    def complete(root: str | os.PathLike) -> list[tuple[Path, dict]]:
        """Complete checkpoints under ``root``, oldest first, each with its saved ``TrainState`` fields."""
        root = Path(root)
        found = []
        if root.is_dir():
            for path in root.iterdir():
                state_file = path / STATE_FILE
                if path.name.startswith(".") or not state_file.is_file():
                    continue
                try:
                    state = json.loads(state_file.read_text())
                except (OSError, ValueError):
                    continue
                found.append((path, state))
        found.sort(key=lambda item: (item[1]["epoch"], item[1]["batch_in_epoch"], item[1]["global_update"]))
        return found

    def latest(self) -> Path | None:
        found = self.complete(self.root)
        return found[-1][0] if found else None

    def clean_leftovers(self) -> None:
        if self.accelerator.is_main_process and self.root.is_dir():
            for path in self.root.iterdir():
                if path.name.startswith((".tmp-", ".trash-")):
                    shutil.rmtree(path, ignore_errors=True)
        self.accelerator.wait_for_everyone()

    def wait(self) -> None:
        """Wait for the checkpoint being written in the background, if any; raise what writing it raised."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint under {self.root} failed: {error}") from error

    def save(self, name: str, state: TrainState, is_best: bool = False) -> Path:
        self.wait()
        accelerator = self.accelerator
        final = self.root / name
        tmp = self.root / f".tmp-{name}"
        if accelerator.is_main_process:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        accelerator.wait_for_everyone()
        if is_best:
            state.best_checkpoint = name
        if self.background:
            with captured_writes() as writes:
                accelerator.save_state(str(tmp))
            record = state.state_dict()  # the state as it is now, not when the thread gets to it

            def write() -> None:
                try:
                    for writer, obj, args, kwargs in writes:
                        writer(obj, *args, **kwargs)
                    self._finish(tmp, final, record)
                except BaseException as error:  # raised in the training thread by the next save or wait
                    self._error = error

            self._writer = threading.Thread(target=write, name=f"checkpoint-{name}", daemon=False)
            self._writer.start()
            return final
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            self._finish(tmp, final, state.state_dict())
        accelerator.wait_for_everyone()
        return final

    def _finish(self, tmp: Path, final: Path, record: dict) -> None:
        """Mark ``tmp`` complete, rename it to ``final`` and prune (main process)."""
        (tmp / STATE_FILE).write_text(json.dumps(record, indent=1))
        if final.exists():  # re-saving a name (a run restarted from an older checkpoint): move the old aside
            self._discard(final)
        os.replace(tmp, final)
        self._prune(record["best_checkpoint"])

    def _discard(self, path: Path) -> None:
        trash = path.parent / f".trash-{path.name}"
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def _prune(self, best: str | None) -> None:
        found = [path for path, _ in self.complete(self.root)]
        keep = set(found[-self.keep_last:])
        for path in found:
            if path not in keep and path.name != best:
                self._discard(path)


# ----------------------------------------------------------------------------------------------------------------
# Metrics and curves


class MetricsLog:
    """``metrics.jsonl``: one JSON record per finished epoch (main process only)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate(self, completed_epochs: int) -> None:
        """Keep records of epochs ``<= completed_epochs`` (a resumed run rewrites what came after its checkpoint)."""
        records = [r for r in self.read() if r["epoch"] <= completed_epochs]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        os.replace(tmp, self.path)

    def append(self, record: Mapping) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


def _import_pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(records: Sequence[Mapping], path: str | os.PathLike, title: str = "") -> None:
    """Training loss and validation top-1 (model and EMA) against epoch."""
    plot_runs({title or "run": records}, path, title=title)


def plot_runs(runs: Mapping[str, Sequence[Mapping]], path: str | os.PathLike, title: str = "") -> None:
    """Several runs side by side: training loss, validation top-1 (solid: model, dashed: EMA), learning rate."""
    plt = _import_pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, (name, records) in enumerate(runs.items()):
        if not records:
            continue
        colour = f"C{i % 10}"
        epochs = [r["epoch"] for r in records]
        axes[0].plot(epochs, [r["train_loss"] for r in records], color=colour, marker=".", label=name)
        axes[1].plot(epochs, [r["val_top1"] for r in records], color=colour, marker=".", label=f"{name}")
        if records[0].get("ema_val_top1") is not None:
            axes[1].plot(epochs, [r["ema_val_top1"] for r in records], color=colour, linestyle="--",
                         label=f"{name} (EMA)")
        axes[2].plot(epochs, [r["lr"] for r in records], color=colour, label=name)
    axes[0].set(xlabel="epoch", ylabel="train loss", title="training loss")
    axes[1].set(xlabel="epoch", ylabel="top-1 (%)", title="validation top-1")
    axes[2].set(xlabel="epoch", ylabel="lr", title="learning rate (end of epoch)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    tmp = Path(path).with_name(Path(path).name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
