"""Launch-setting overrides for the Triton kernels: the one way for a test to force a chunk size or a code path that
the heuristics take only at other shapes. Normal use needs none of this; every op picks its launch settings itself.

``with launch_overrides("gka", chunk=32): ...`` forces settings inside the block. Each op lists the names it
understands next to its launch rules and rejects any other with a ``ValueError`` that names the setting
(:func:`check_names`). Ops that cache launch plans key them on :func:`generation`, which changes whenever an
override is entered or left, so a cached plan never outlives the override it was built under.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType

__all__ = ["PlanCache", "apply_overrides", "check_names", "generation", "launch_overrides", "overrides"]

_from_code: dict[str, dict[str, object]] = {}
_generation = 0
_EMPTY: Mapping[str, object] = MappingProxyType({})


def overrides(op: str) -> Mapping[str, object]:
    """The settings forced for ``op`` (empty in normal use)."""
    code = _from_code.get(op)
    return MappingProxyType(code) if code else _EMPTY


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
                             "check launch_overrides()")
