"""timm-registered backbones; importing this package registers them.

Every module of this package is a model family (timm's one-file-per-family layout) and is imported here, so a new
family is a new file: :data:`FAMILIES` (family name -> its registered model names) is derived from timm's registry.
Each family's public names (its model classes and entrypoints) are also available from this package.
"""

import importlib
import pkgutil

import timm

__all__ = ["FAMILIES"]

for _info in pkgutil.iter_modules(__path__):
    _module = importlib.import_module(f"{__name__}.{_info.name}")
    globals().update({name: getattr(_module, name) for name in _module.__all__})
    __all__ += list(_module.__all__)

#: family (module) name -> the model names it registers with timm, e.g. ``{"gka_vision": ["gka_vision_B", ...]}``.
FAMILIES = {info.name: timm.list_models(module=info.name) for info in pkgutil.iter_modules(__path__)}
