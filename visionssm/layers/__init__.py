"""Sequence-mixer modules: (B, L, C) -> (B, L, C), each with a ``causal`` switch, on visionssm.kernels.

``MIXERS`` maps a mixer name to its class, so a backbone can host any mixer by name (``mixer='gka'``).
"""

from .comba import CombaMixer
from .gka import GKAMixer
from .mamba import MambaVisionMixer

MIXERS = {"mamba": MambaVisionMixer, "gka": GKAMixer, "comba": CombaMixer}

__all__ = ["MIXERS", "CombaMixer", "GKAMixer", "MambaVisionMixer"]
