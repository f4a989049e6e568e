"""timm-registered backbones; importing this package registers them.

Every module of this package whose name does not start with an underscore is a model family (timm's
one-file-per-family layout) and is imported here, so a new family is a new file: :data:`FAMILIES` (family name -> its
registered model names) is derived from timm's registry. Underscored modules hold pieces the families share.
Each family's public names (its model classes and entrypoints) are also available from this package.
"""

import importlib
import pkgutil

import timm

__all__ = ["FAMILIES"]

_FAMILY_MODULES = [info.name for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_")]

for _name in _FAMILY_MODULES:
    _module = importlib.import_module(f"{__name__}.{_name}")
    globals().update({name: getattr(_module, name) for name in _module.__all__})
    __all__ += list(_module.__all__)

#: family (module) name -> the model names it registers with timm, e.g. ``{"gka_vision": ["gka_vision_B", ...]}``.
FAMILIES = {name: timm.list_models(module=name) for name in _FAMILY_MODULES}
