"""Tracking datasets (GOT-10k, LaSOT, generated), crops and training pairs.

:class:`PairDataset` (torch, albumentations) loads on first use, so ``python -m visionssm.tracking.data.synthetic``
answers ``--help`` without them.
"""

from .base import Sequence
from .got10k import Got10k
from .lasot import LaSOT

__all__ = ["Got10k", "LaSOT", "PairDataset", "Sequence"]


def __getattr__(name: str):
    if name == "PairDataset":
        from .sampler import PairDataset

        return PairDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
