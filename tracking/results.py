"""Tracking result files (one ``x,y,w,h`` line per frame, and one time per frame): read strictly, written atomically.

A result file that cannot be what a tracker produced is an error naming the file and the line, never a metric
computed from it: a line that is not four numbers, a NaN or infinite value, a negative width or height, or a line
count other than the sequence's frame count. Neither benchmark toolkit accepts such files on purpose: pytracking
(LaSOT) raises on NaN and negative sizes, and the got10k toolkit asserts equal shapes (its NaN boxes only surface
as an AO of nan), so there is no switch to let them through. Zero-size boxes stay legal: GOT-10k scores them IoU 0
and pytracking repeats the previous box for them. The one leniency kept is pytracking's: a LaSOT result longer than
the ground truth is cut to it.
"""

from __future__ import annotations

import os

import numpy as np

from visionssm.utils.cli import UserFileError, UserValueError

__all__ = ["check_boxes", "read_result_boxes", "read_result_times", "write_rows"]


def _numbers(path: str, line_no: int, line: str, count: int, what: str) -> list[float]:
    parts = [p for p in line.replace("\t", ",").replace(" ", ",").split(",") if p != ""]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != count:
        raise UserValueError(f"{path}:{line_no}: expected {what}, got {line.strip()!r}")
    if not np.isfinite(values).all():
        raise UserValueError(f"{path}:{line_no}: NaN or infinite value in {line.strip()!r}")
    return values


def _lines(path: str, frames: int, allow_longer: bool) -> list[tuple[int, str]]:
    """The file's lines, numbered from 1, checked against the sequence's frame count."""
    if not os.path.isfile(path):
        raise UserFileError(f"result file {path} not found")
    with open(path) as f:
        lines = list(enumerate(f.read().splitlines(), 1))
    for line_no, line in lines:
        if not line.strip():
            raise UserValueError(f"{path}:{line_no}: empty line (one line per frame)")
    if len(lines) < frames:
        raise UserValueError(f"{path}: {len(lines)} lines for a sequence of {frames} frames (the file ends early)")
    if len(lines) > frames and not allow_longer:
        raise UserValueError(f"{path}:{frames + 1}: more lines than the sequence's {frames} frames")
    return lines[:frames]


def read_result_boxes(path: str, frames: int, allow_longer: bool = False) -> np.ndarray:
    """The (frames, 4) boxes of a result file, every line checked (see the module docstring).

    ``allow_longer`` cuts a file with more lines than frames to the frame count (pytracking's LaSOT rule); the
    lines cut are not read.
    """
    boxes = np.zeros((frames, 4))
    for i, (line_no, line) in enumerate(_lines(path, frames, allow_longer)):
        boxes[i] = _numbers(path, line_no, line, 4, "4 numbers x,y,w,h")
        if boxes[i, 2] < 0 or boxes[i, 3] < 0:
            raise UserValueError(f"{path}:{line_no}: negative width or height in {line.strip()!r}")
    return boxes


def read_result_times(path: str, frames: int) -> np.ndarray:
    """The per-frame seconds of a ``*_time.txt`` file: finite, non-negative numbers, one line per frame.

    One column gives shape ``(frames,)``. The got10k toolkit's ``ExperimentGOT10k`` writes one column per repetition
    of a run (comma separated), read as ``(frames, repetitions)``; every line must have the same number of columns.
    """
    rows = []
    for line_no, line in _lines(path, frames, allow_longer=False):
        columns = len([p for p in line.replace("\t", ",").replace(" ", ",").split(",") if p != ""]) or 1
        if rows and columns != len(rows[0]):
            raise UserValueError(f"{path}:{line_no}: {columns} columns where line 1 has {len(rows[0])} (one time per "
                                 "repetition of the run)")
        values = _numbers(path, line_no, line, columns, "one number (seconds) per repetition")
        if min(values) < 0:
            raise UserValueError(f"{path}:{line_no}: negative time {line.strip()!r}")
        rows.append(values)
    times = np.asarray(rows, dtype=np.float64).reshape(frames, -1)
    return times[:, 0] if times.shape[1] == 1 else times


def check_boxes(boxes: np.ndarray, where: str) -> np.ndarray:
    """Boxes a tracker produced, before they are written: finite, with non-negative sizes (frames from 1)."""
    boxes = np.asarray(boxes, dtype=np.float64)
    bad = ~np.isfinite(boxes).all(axis=1) | (np.nan_to_num(boxes[:, 2:], nan=0.0) < 0).any(axis=1)
    if bad.any():
        frame = int(np.flatnonzero(bad)[0])
        raise UserValueError(f"{where}: frame {frame + 1} has the invalid box {boxes[frame].tolist()} (NaN, infinite "
                         "or negative size)")
    return boxes


def write_rows(path: str, array: np.ndarray, fmt: str) -> None:
    """``array`` as comma-separated rows, written to a temporary file and renamed, so no reader sees half a file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    np.savetxt(tmp, array, fmt=fmt, delimiter=",")
    os.replace(tmp, path)
