"""The one error path of every visionssm command line (``visionssm-train``, ``visionssm-benchmark``,
``python -m visionssm.tracking.*``, ``python -m visionssm.data.synthetic``).

A mistake in what the user asked for (a path that is not there, an unknown model, recipe or config key, a value out
of range, a file that is not a checkpoint) is a :class:`UserError`: :func:`run_main` prints it as the one line
``prog: error: <message>`` on stderr and returns 2, as argparse does for a bad flag. Any other exception is a bug
and keeps its traceback. The subclasses also derive from the built-in exception a library caller would expect
(``ValueError``, ``FileNotFoundError``, ``KeyError``, ``TypeError``).

:class:`ArgumentParser` is argparse's with a one-line error (the full usage of a 90-flag parser buries the message)
that names close matches of a mistyped flag. :func:`cap_workers` keeps loader workers within the CPUs this process
may use. :func:`compile_mode` reads every command's ``compile`` setting (null/false, true, or a mode).

Every command parses its arguments before it imports torch (``visionssm.COMMANDS`` lists them): its module holds the
parser and ``main``, the work lives in a module it imports once the arguments parse, and
:func:`forward_attributes` keeps that module's names reachable from the command's.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

__all__ = ["COMPILE_MODES", "ArgumentParser", "UserError", "UserFileError", "UserKeyError", "UserTypeError",
           "UserValueError", "cap_workers", "compile_mode", "forward_attributes", "load_yaml_mapping", "run_main",
           "usable_cpus"]

#: torch.compile's modes; "default" is what ``torch.compile(model)`` does without one.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class UserError(Exception):
    """A mistake in the user's arguments, config or files; its message names the argument, key or file."""

    def __str__(self) -> str:
        # KeyError's own str() quotes the message; a user error reads the same whatever its base
        return " ".join(str(self.args[0]).split()) if len(self.args) == 1 else super().__str__()


class UserValueError(UserError, ValueError):
    """A value out of range, an unknown name, a file that cannot be what it should be."""


class UserFileError(UserError, FileNotFoundError):
    """A path given (or implied) by the user that does not exist."""


class UserKeyError(UserError, KeyError):
    """A config key that does not exist."""


class UserTypeError(UserError, TypeError):
    """A config value of the wrong kind (a list where a mapping belongs, a string where a switch belongs)."""


def run_main(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None, *,
             prog: str) -> int:
    """``main(argv)``'s exit status; a :class:`UserError` becomes ``prog: error: <message>`` on stderr and 2."""
    try:
        status = main(argv)
    except UserError as error:
        print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0 if status is None else int(status)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line (``prog: error: ...; see prog --help``), exit status 2."""

    def error(self, message: str) -> None:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            flags = sorted(s for s in self._option_string_actions if s.startswith("--"))
            hints = []
            for arg in message[len(prefix):].split():
                close = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1) if arg.startswith("-") else []
                if close:
                    hints.append(f"{arg} (did you mean {close[0]}?)")
            if hints:
                message = f"{message}; " + ", ".join(hints)
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def forward_attributes(implementation: str, command: str) -> Callable[[str], object]:
    """A command module's ``__getattr__``: names it does not define come from the module ``implementation``, imported
    on first use, so ``from <command> import train`` keeps working while ``--help`` imports nothing heavy."""

    def __getattr__(name: str):
        if not name.startswith("__"):
            module = importlib.import_module(implementation)
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {command!r} has no attribute {name!r}")

    return __getattr__


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one), as PyTorch's DataLoader counts."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


_capped_notes: set[tuple[str, int, int]] = set()


def cap_workers(requested: int, setting: str, say: Callable[[str], None] | None = print) -> int:
    """``requested`` loader worker processes, at most one per usable CPU; ``say`` gets one note (once per process
    and setting) when that lowers the number. More workers than CPUs only adds processes that wait for a core."""
    if requested < 0:
        raise UserValueError(f"{setting} must be >= 0, got {requested}")
    cpus = usable_cpus()
    if requested <= cpus:
        return requested
    key = (setting, requested, cpus)
    if say is not None and key not in _capped_notes:
        _capped_notes.add(key)
        say(f"note: {setting} {requested} -> {cpus} (this machine has {cpus} usable CPU(s))")
    return cpus


def check_choice(value, choices: Sequence[str], setting: str) -> str:
    """``value`` if it is one of ``choices``, else a :class:`UserValueError` naming ``setting`` and the choices."""
    if value not in choices:
        raise UserValueError(f"{setting} must be one of {', '.join(choices)}, got {value!r}")
    return value


def compile_mode(value, setting: str) -> str | None:
    """The ``torch.compile`` mode a ``compile`` setting asks for: ``None`` (null or false: no compiling), ``"default"``
    (true) or the mode it names, one of :data:`COMPILE_MODES`; anything else is a :class:`UserValueError` naming
    ``setting``."""
    if value is None or value is False:
        return None
    if value is True:
        return "default"
    if isinstance(value, str) and value in COMPILE_MODES:
        return value
    raise UserValueError(f"{setting} must be true, false, null or a torch.compile mode ({', '.join(COMPILE_MODES)}), "
                         f"got {value!r}")


def load_yaml_mapping(path: str | os.PathLike) -> dict:
    """The mapping a YAML config file holds; a missing file, bad YAML or another top-level value is a user error
    naming the file."""
    path = Path(path)
    if not path.is_file():
        raise UserFileError(f"config file {path} not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise UserValueError(f"config file {path} is not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise UserValueError(f"config file {path} must hold a mapping of keys to values, got {type(data).__name__}")
    return data
