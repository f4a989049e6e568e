"""The YAML recipes shipped with visionssm (installed as ``visionssm.configs``): ``imagenet/`` for ``visionssm-train``,
``tracking/`` for ``python -m visionssm.tracking.train``.

They are package data, so a wheel installed anywhere finds them. :func:`find_config` turns what a user typed after
``--config`` into a file: a path that exists is used as it is (a recipe of your own), and otherwise the name is
looked up among the shipped recipes, so the commands the README gives (``--config configs/imagenet/gka_vision_T.yaml``)
work from any directory.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

__all__ = ["KINDS", "find_config", "shipped_configs"]

KINDS = ("imagenet", "tracking")


def _root() -> Path:
    # The package is installed as plain files (setuptools never zips it), so its resources are real paths.
    return Path(str(resources.files(__name__)))


def shipped_configs(kind: str) -> list[str]:
    """Names (file stems) of the recipes of ``kind`` that ship with the package."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return sorted(p.stem for p in (_root() / kind).glob("*.yaml"))


def find_config(name: str | os.PathLike, kind: str) -> Path:
    """The config file ``name`` means, for a run of ``kind`` (``imagenet`` or ``tracking``).

    ``name`` is an existing file, or a shipped recipe given as ``configs/<kind>/<stem>.yaml``, ``<kind>/<stem>.yaml``,
    ``<stem>.yaml`` or ``<stem>``. A missing one is a ``FileNotFoundError`` listing the shipped recipes.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    path = Path(name)
    if path.is_file():
        return path
    parts = path.parts[1:] if path.parts[:1] == ("configs",) else path.parts
    if parts and parts[0] == kind:
        parts = parts[1:]
    if len(parts) == 1:  # only a file directly in the kind's folder is a shipped recipe
        stem = parts[0][:-len(".yaml")] if parts[0].endswith(".yaml") else parts[0]
        shipped = _root() / kind / f"{stem}.yaml"
        if shipped.is_file():
            return shipped
    raise FileNotFoundError(f"config file {name} not found, and it names none of the {kind} recipes shipped with "
                            f"visionssm: {', '.join(shipped_configs(kind))}")
