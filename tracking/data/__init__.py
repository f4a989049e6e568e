"""Tracking datasets (GOT-10k, LaSOT, generated), crops and training pairs."""

from .base import Sequence
from .got10k import Got10k
from .lasot import LaSOT
from .sampler import PairDataset

__all__ = ["Got10k", "LaSOT", "PairDataset", "Sequence"]
