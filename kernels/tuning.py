"""Launch-setting overrides for the Triton kernels: the one way to force a chunk size, a warp count or a code path,
for tuning sweeps and tests. Normal use needs none of this; every op picks its launch settings itself.

Two sources, merged (code wins over the environment):

* ``VISIONSSM_LAUNCH``, read once when this module is imported, e.g.
  ``VISIONSSM_LAUNCH="comba:split_bwd=false,num_warps=4;selective_scan:num_warps_bwd=2"``
  (``op:name=value,...`` groups separated by ``;``; values are ints, floats, ``true``/``false`` or strings);
* :func:`launch_overrides`, a context manager: ``with launch_overrides("comba", split_bwd=False): ...``.

Each op documents the names it understands next to its launch heuristics and rejects unknown names with a
``ValueError`` that names the setting (:func:`check_names`). Ops that cache launch plans key them on
:func:`generation`, which changes whenever an override is entered or left, so a cached plan never outlives the
override it was built under.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType

__all__ = ["ENV", "PlanCache", "apply_overrides", "check_names", "generation", "launch_overrides", "overrides"]

ENV = "VISIONSSM_LAUNCH"


def _parse_value(text: str):
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse(text: str) -> dict[str, dict[str, object]]:
    """``"op:a=1,b=x;op2:c=true"`` → ``{"op": {"a": 1, "b": "x"}, "op2": {"c": True}}``; ValueError on bad text."""
    result: dict[str, dict[str, object]] = {}
    for group in filter(None, (part.strip() for part in text.split(";"))):
        op, sep, body = group.partition(":")
        if not sep or not op.strip():
            raise ValueError(f"{ENV}: expected 'op:name=value,...', got {group!r}")
        settings = result.setdefault(op.strip(), {})
        for item in filter(None, (part.strip() for part in body.split(","))):
            name, eq, value = item.partition("=")
            if not eq or not name.strip():
                raise ValueError(f"{ENV}: expected name=value in {group!r}, got {item!r}")
            settings[name.strip()] = _parse_value(value)
    return result


_FROM_ENV = parse(os.environ.get(ENV, ""))
_from_code: dict[str, dict[str, object]] = {}
_generation = 0
_EMPTY: Mapping[str, object] = MappingProxyType({})


def overrides(op: str) -> Mapping[str, object]:
    """The settings forced for ``op`` (empty in normal use)."""
    env, code = _FROM_ENV.get(op), _from_code.get(op)
    if not env and not code:
        return _EMPTY
    return MappingProxyType({**(env or {}), **(code or {})})


def generation() -> int:
    """A number that changes whenever an override starts or ends: part of every cached launch plan's key."""
    return _generation


@contextlib.contextmanager
def launch_overrides(op: str, **settings) -> Iterator[None]:
    """Force ``settings`` for ``op`` inside the block (nested blocks add to and then restore the outer ones)."""
    global _generation
    previous = _from_code.get(op)
    _from_code[op] = {**(previous or {}), **settings}
    _generation += 1
    try:
        yield
    finally:
        if previous is None:
            _from_code.pop(op, None)
        else:
            _from_code[op] = previous
        _generation += 1


class PlanCache(dict):
    """An op's launch plans by key, emptied whenever a launch override starts or ends (a plan built under an override
    must not outlive it, nor one built without it serve inside it)."""

    def __init__(self) -> None:
        super().__init__()
        self._generation = _generation

    def get_or_build(self, key, build: Callable[[], object]):
        """The plan of ``key``, built by ``build()`` on first use."""
        if self._generation != _generation:
            self.clear()
            self._generation = _generation
        plan = self.get(key)
        if plan is None:
            plan = self[key] = build()
        return plan


def apply_overrides(op: str, cfg: dict, known: Iterable[str]) -> dict:
    """``cfg`` with the settings forced for ``op`` laid over it (names checked against ``known``); ``reference``
    chooses the backend, not a launch setting, so it stays out of ``cfg``."""
    forced = overrides(op)
    if forced:
        check_names(op, forced, known)
        cfg.update((k, v) for k, v in forced.items() if k != "reference")
    return cfg


def check_names(op: str, settings: Mapping[str, object], known: Iterable[str]) -> None:
    """ValueError naming the first setting of ``settings`` that ``op`` does not understand."""
    known = set(known)
    for name in settings:
        if name not in known:
            raise ValueError(f"unknown launch setting {name!r} for {op} (known: {', '.join(sorted(known))}); "
                             f"check {ENV} or launch_overrides()")
