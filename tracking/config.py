"""Tracking experiment configs: OSTrack's defaults, overridden by a YAML file with strict key checking.

A YAML may only set keys that exist in :data:`DEFAULTS` (a typo fails loudly, as OSTrack's
``update_config_from_file`` does); ``data.train`` is a list of datasets, each ``{type, root, split, ratio}``
(``type`` ``got10k`` or ``lasot``; ``ratio`` is the sampling weight). ``--set a.b=value`` on the command line
overrides single keys (values parsed as YAML); a number indexes a list (``data.train.0.root=DIR`` changes the first
dataset's root, ``data.train.1={type: lasot, root: DIR}`` appends a second one). The file is a path or the name of a
recipe shipped in ``visionssm.configs`` (``configs/tracking/smoke_synthetic.yaml`` or ``smoke_synthetic`` works from
any directory). A bare ``--set model.pretrained=null`` trains the backbone from scratch (no ImageNet checkpoint).
"""

from __future__ import annotations

import copy
import difflib

import yaml

from visionssm.configs import find_config
from visionssm.utils.cli import (
    UserFileError,
    UserKeyError,
    UserTypeError,
    UserValueError,
    compile_mode,
    load_yaml_mapping,
)

DEFAULTS: dict = {
    "name": "tracking",
    "output_dir": None,  # default: output/tracking/<name>
    "seed": 0,
    "model": {
        "backbone": "gka_vision_T",
        "pretrained": None,  # ImageNet checkpoint file of the backbone (.pth / .pth.tar / .safetensors)
        "backbone_kwargs": {},
        "drop_path_rate": 0.1,
        "template_size": 128,
        "search_size": 256,
        "head_channels": 256,
    },
    "data": {
        "train": [],
        "pairs_per_epoch": 60000,
        "max_gap": 200,
        "template_factor": 2.0,
        "search_factor": 4.0,
        "center_jitter": 3.0,
        "scale_jitter": 0.25,
        "grayscale_prob": 0.05,
        "flip_prob": 0.5,
        "brightness": [0.8, 1.2],
        "num_workers": 8,
    },
    "train": {
        "epochs": 100,
        "batch_size": 32,  # per process
        "lr": 4.0e-4,
        "backbone_lr_mult": 0.1,
        "weight_decay": 1.0e-4,
        "grad_clip": 0.1,
        "lr_drop_fraction": 0.8,  # lr ÷ 10 after this fraction of the epochs
        "loss_weights": {"focal": 1.0, "giou": 2.0, "l1": 5.0},
        "mixed_precision": "no",  # accelerate: no | bf16 | fp16
        "grad_checkpointing": False,
        "checkpoint_every_steps": 1000,  # also checkpoint within an epoch (0: only at epoch ends)
        "keep_last": 2,  # complete checkpoints kept under output_dir/checkpoints
        "log_every": 50,  # steps
        "max_steps": None,  # stop after this many optimizer steps in all (smoke runs); resumable
        "time_limit_s": None,  # checkpoint and stop after this many seconds of this run; resumable
        "deterministic": False,  # deterministic GPU algorithms: a resumed or repeated GPU run equal to the last bit
        "compile": None,  # torch.compile the tracker: null/false, true, or a mode (reduce-overhead, max-autotune, ...)
    },
    "test": {
        "search_factor": 4.0,
        "hann_window": True,
    },
}

DATASET_KEYS = {"type": None, "root": None, "split": "train", "ratio": 1.0}
DATASET_TYPES = ("got10k", "lasot")


def _merge(base: dict, update: dict, path: str = "") -> dict:
    for key, value in update.items():
        where = f"{path}{key}"
        if key not in base:
            close = difflib.get_close_matches(str(key), [str(k) for k in base], n=1)
            hint = f"did you mean {path}{close[0]}? " if close else ""
            raise UserKeyError(f"unknown config key {where!r} ({hint}known: {sorted(base)})")
        if isinstance(base[key], dict) and key != "backbone_kwargs":
            if not isinstance(value, dict):
                raise UserTypeError(f"config key {where!r} must be a mapping, got {type(value).__name__}")
            _merge(base[key], value, where + ".")
        elif isinstance(base[key], list) and isinstance(value, dict) and value and all(
                str(k).isdigit() for k in value):
            base[key] = _merge_indexed(base[key], value, where)
        else:
            base[key] = _coerce(base[key], value, where)
    return base


def _merge_indexed(items: list, update: dict, where: str) -> list:
    """``--set data.train.0.root=DIR``: the numbered entries of ``update`` change (mappings: their keys) or append
    to the list ``items``."""
    items = copy.deepcopy(items)
    for index in sorted(update, key=int):
        i, value = int(index), update[index]
        if i > len(items):
            raise UserKeyError(f"config key '{where}.{i}': {where} has {len(items)} entries (indices 0 to "
                               f"{len(items) - 1}; {len(items)} appends one)")
        if i == len(items):
            items.append(value)
        elif isinstance(items[i], dict) and isinstance(value, dict):
            items[i] = {**items[i], **value}
        else:
            items[i] = value
    return items


def _coerce(default, value, where: str):
    """Numbers stay numbers: YAML reads ``4e-4`` (no dot) as a string, so parse such strings; reject the rest.
    A switch takes only true or false (a string such as ``"off"`` would otherwise read as on)."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise UserTypeError(f"config key {where!r} must be true or false, got {value!r}")
        return value
    if default is None or value is None:
        return value
    if isinstance(default, (int, float)) and not isinstance(value, bool):
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise UserTypeError(f"config key {where!r} must be a number, got {value!r}") from None
        if not isinstance(value, (int, float)):
            raise UserTypeError(f"config key {where!r} must be a number, got {type(value).__name__}")
        if isinstance(default, int) and float(value).is_integer():
            return int(value)
        return float(value)
    return value


def _check_datasets(entries) -> list[dict]:
    if not isinstance(entries, list):
        raise UserTypeError("data.train must be a list of {type, root, split, ratio}")
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise UserTypeError(f"data.train[{i}] must be a mapping")
        unknown = set(entry) - set(DATASET_KEYS)
        if unknown:
            raise UserKeyError(f"data.train[{i}]: unknown keys {sorted(unknown)} (known: {sorted(DATASET_KEYS)})")
        full = {**DATASET_KEYS, **entry}
        if full["type"] not in DATASET_TYPES:
            raise UserValueError(f"data.train[{i}].type must be one of {DATASET_TYPES}, got {full['type']!r}")
        if not full["root"]:
            raise UserValueError(f"data.train[{i}].root is required")
        out.append(full)
    return out


def parse_overrides(items: list[str] | None) -> dict:
    """``['train.epochs=3', 'model.backbone=tiny']`` → nested dict (values parsed as YAML)."""
    out: dict = {}
    for item in items or []:
        if "=" not in item:
            raise UserValueError(f"--set {item!r}: an override looks like key.sub=value")
        key, value = item.split("=", 1)
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        try:
            node[parts[-1]] = yaml.safe_load(value)
        except yaml.YAMLError as error:
            raise UserValueError(f"--set {item!r}: the value is not valid YAML ({' '.join(str(error).split())})") \
                from None
    return out


def load_config(path: str | None = None, overrides: list[str] | dict | None = None) -> dict:
    cfg = copy.deepcopy(DEFAULTS)
    if path:
        try:
            config_file = find_config(path, "tracking")
        except FileNotFoundError as error:
            raise UserFileError(f"--config: {error}") from None
        _merge(cfg, load_yaml_mapping(config_file))
    if overrides:
        _merge(cfg, overrides if isinstance(overrides, dict) else parse_overrides(overrides))
    cfg["data"]["train"] = _check_datasets(cfg["data"]["train"])
    if cfg["output_dir"] is None:
        cfg["output_dir"] = f"output/tracking/{cfg['name']}"
    t = cfg["train"]
    if t["mixed_precision"] is False:  # YAML reads a bare `no` (--set train.mixed_precision=no) as false
        t["mixed_precision"] = "no"
    if t["mixed_precision"] not in ("no", "bf16", "fp16"):
        raise UserValueError(f"train.mixed_precision must be no, bf16 or fp16, got {t['mixed_precision']!r}")
    if t["epochs"] < 1 or t["batch_size"] < 1:
        raise UserValueError("train.epochs and train.batch_size must be ≥ 1")
    if not 0 < t["lr_drop_fraction"] <= 1:
        raise UserValueError("train.lr_drop_fraction must be in (0, 1]")
    compile_mode(t["compile"], "train.compile")
    return cfg
