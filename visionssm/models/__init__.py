"""timm-registered backbones; importing this package registers them."""

from .comba_vision import *  # noqa: F403
from .gka_vision import *  # noqa: F403
from .mamba_vision import *  # noqa: F403
