"""visionssm: state-space and linear-attention vision backbones on Triton kernels, registered in timm.

``import visionssm`` registers every model with timm, so ``timm.create_model('gka_vision_T')`` works after it.
Importing needs no GPU and compiles no Triton kernel (the kernels load on first use).
"""

from . import kernels, layers, models  # noqa: F401  (importing models registers them with timm)
from .version import __version__

__all__ = ["__version__", "kernels", "layers", "models"]
