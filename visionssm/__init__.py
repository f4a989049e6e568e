"""visionssm: state-space and linear-attention vision backbones on Triton kernels, registered in timm.

``import visionssm`` registers every model with timm, so ``timm.create_model('gka_vision_T')`` works after it.
"""

from .version import __version__

__all__ = ["__version__"]
