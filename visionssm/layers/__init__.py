"""Sequence-mixer modules on visionssm.kernels: (B, L, C) -> (B, L, C), one contract (:mod:`.base`).

Every module of this package that defines a mixer registers it with :func:`~.base.register_mixer`; importing the
package imports them all, so :data:`MIXERS` (name -> spec) is complete without a hand-kept list: a new mixer is a
new file here.
"""

import importlib
import pkgutil

from .base import (
    MIXERS,
    MixerSpec,
    SequenceMixer,
    build_mixer,
    get_mixer,
    mixer_kernel_ops,
    mixer_no_weight_decay,
    register_mixer,
    resolve_mixer,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["MIXERS", "MixerSpec", "SequenceMixer", "build_mixer", "get_mixer", "mixer_kernel_ops",
           "mixer_no_weight_decay", "register_mixer", "resolve_mixer",
           *(spec.cls.__name__ for spec in MIXERS.values())]
globals().update({spec.cls.__name__: spec.cls for spec in MIXERS.values()})
