"""timm's RandAugment (``rand-m9-mstd0.5-inc1`` and the other ``rand-*`` strings) on batches of uint8 tensors.

Each image draws its own ops and magnitudes on the CPU (:func:`draw_rand_augment`, from a ``random.Random`` seeded
per image), then each op runs once per batch on the subset of images that drew it, with per-image arguments
(:func:`apply_rand_augment`). The op set, the magnitude noise and clamp, the level-to-argument rules and the random
signs are timm's (``timm.data.auto_augment``); each op follows the Pillow function timm calls:

- exact up to rounding (one grey level): Invert, Posterize, Solarize, SolarizeAdd, AutoContrast, Equalize, Color,
  Contrast, Brightness, Sharpness (Pillow's integer greyscale, its truncating blend, its smoothing kernel);
- Rotate, ShearX/Y, TranslateX/YRel: the same affine map and fill colour as Pillow, sampled by ``grid_sample``;
  bilinear agrees with Pillow inside the image, pixels whose source straddles the image border blend towards the
  fill instead of switching to it, and bicubic uses torch's kernel (a = -0.75) where Pillow's uses a = -0.5.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from visionssm.utils.cli import UserValueError

__all__ = ["GEOMETRIC_OPS", "RandAugmentPolicy", "apply_op", "apply_rand_augment", "draw_rand_augment",
           "level_args", "parse_rand_augment"]

_LEVEL_DENOM = 10.0
# timm's _RAND_TRANSFORMS and _RAND_INCREASING_TRANSFORMS (Cutout is random erasing there too)
_RAND_TRANSFORMS = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd", "Color",
                    "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")
_RAND_INCREASING_TRANSFORMS = ("AutoContrast", "Equalize", "Invert", "Rotate", "PosterizeIncreasing",
                               "SolarizeIncreasing", "SolarizeAdd", "ColorIncreasing", "ContrastIncreasing",
                               "BrightnessIncreasing", "SharpnessIncreasing", "ShearX", "ShearY", "TranslateXRel",
                               "TranslateYRel")
GEOMETRIC_OPS = frozenset({"Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel"})
INTERPOLATIONS = ("bilinear", "bicubic")  # timm's random choice for the geometric ops


@dataclass(frozen=True)
class RandAugmentPolicy:
    """A parsed ``rand-...`` string (timm's ``rand_augment_transform`` sections m, n, p, mstd, mmax, inc)."""

    ops: tuple[str, ...]
    magnitude: float = 10.0
    num_layers: int = 2
    prob: float = 0.5
    magnitude_std: float = 0.0
    magnitude_max: float = _LEVEL_DENOM
    fill: tuple[int, int, int] = (128, 128, 128)
    interpolation: str | None = None  # None: bilinear or bicubic per op, as timm's 'random'


def parse_rand_augment(config: str, fill: tuple[int, int, int], interpolation: str | None) -> RandAugmentPolicy:
    """timm's ``rand-m9-mstd0.5-inc1`` syntax; anything else (AutoAugment, AugMix, weighted op sets) is refused
    with the setting named, since only RandAugment has a batched implementation here."""
    sections = config.split("-")
    if sections[0] != "rand":
        raise UserValueError(f"--aa {config!r}: the gpu data backend implements RandAugment (rand-...) only; use "
                             "--data-backend pil for other policies")
    values = {"m": 10.0, "n": 2, "p": 0.5, "mstd": 0.0, "mmax": _LEVEL_DENOM, "inc": 0}
    for section in sections[1:]:
        key = section.rstrip("0123456789.")
        key = next((k for k in ("mstd", "mmax", "inc", "m", "n", "p") if section.startswith(k)), key)
        text = section[len(key):]
        if key not in values or not text:
            raise UserValueError(f"--aa {config!r}: section {section!r} is not one the gpu data backend knows "
                                 "(m, n, p, mstd, mmax, inc)")
        try:
            values[key] = float(text)
        except ValueError:
            raise UserValueError(f"--aa {config!r}: section {section!r} has no number") from None
    std = values["mstd"]
    return RandAugmentPolicy(ops=_RAND_INCREASING_TRANSFORMS if values["inc"] else _RAND_TRANSFORMS,
                             magnitude=int(values["m"]), num_layers=int(values["n"]), prob=values["p"],
                             magnitude_std=math.inf if std > 100 else std, magnitude_max=values["mmax"],
                             fill=tuple(fill), interpolation=interpolation)


def _negate(value: float, negate: bool) -> float:
    return -value if negate else value


def level_args(name: str, magnitude: float, negate: bool) -> tuple:
    """timm's ``LEVEL_TO_ARG[name](magnitude)`` with its random sign given (``negate``: timm's ``random() > 0.5``)."""
    level = magnitude / _LEVEL_DENOM
    if name == "Rotate":
        return (_negate(level * 30.0, negate),)
    if name in ("ShearX", "ShearY"):
        return (_negate(level * 0.3, negate),)
    if name in ("TranslateXRel", "TranslateYRel"):
        return (_negate(level * 0.45, negate),)
    if name in ("Color", "Contrast", "Brightness", "Sharpness"):
        return (level * 1.8 + 0.1,)
    if name in ("ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing", "SharpnessIncreasing"):
        return (max(0.1, 1.0 + _negate(level * 0.9, negate)),)
    if name == "Posterize":
        return (int(level * 4),)
    if name == "PosterizeIncreasing":
        return (4 - int(level * 4),)
    if name == "Solarize":
        return (min(256, int(level * 256)),)
    if name == "SolarizeIncreasing":
        return (256 - min(256, int(level * 256)),)
    if name == "SolarizeAdd":
        return (min(128, int(level * 110)),)
    return ()


def draw_rand_augment(policy: RandAugmentPolicy, rng: random.Random) -> list[tuple[str, tuple, str] | None]:
    """One image's draw: per layer ``(op, args, interpolation)`` or ``None`` when the layer's coin says skip."""
    drawn = []
    for _ in range(policy.num_layers):
        name = policy.ops[rng.randrange(len(policy.ops))]  # with replacement, as timm without choice weights
        if policy.prob < 1.0 and rng.random() > policy.prob:
            drawn.append(None)
            continue
        magnitude = policy.magnitude
        if policy.magnitude_std == math.inf:
            magnitude = rng.uniform(0, magnitude)
        elif policy.magnitude_std > 0:
            magnitude = rng.gauss(magnitude, policy.magnitude_std)
        magnitude = max(0.0, min(magnitude, policy.magnitude_max or _LEVEL_DENOM))
        args = level_args(name, magnitude, rng.random() > 0.5)
        interpolation = policy.interpolation or INTERPOLATIONS[rng.randrange(2)] if name in GEOMETRIC_OPS else ""
        drawn.append((name, args, interpolation))
    return drawn


def apply_rand_augment(images: torch.Tensor, draws: list[list], fill: tuple[int, int, int]) -> torch.Tensor:
    """Apply each image's drawn ops (:func:`draw_rand_augment`) to a (N, 3, H, W) uint8 batch, layer by layer, each
    distinct (op, interpolation) once on its subset."""
    out = images.clone()
    layers = max((len(d) for d in draws), default=0)
    for layer in range(layers):
        groups: dict[tuple[str, str], list[int]] = {}
        for i, drawn in enumerate(draws):
            if layer < len(drawn) and drawn[layer] is not None:
                name, _, interpolation = drawn[layer]
                groups.setdefault((name, interpolation), []).append(i)
        for (name, interpolation), members in groups.items():
            args = [draws[i][layer][1] for i in members]
            index = torch.tensor(members, device=images.device)
            out[index] = apply_op(name, out[index], args, interpolation, fill)
    return out


def apply_op(name: str, images: torch.Tensor, args: list[tuple], interpolation: str,
             fill: tuple[int, int, int]) -> torch.Tensor:
    """One RandAugment op on a (N, 3, H, W) uint8 batch, image ``i`` with its arguments ``args[i]``."""
    device = images.device
    values = torch.tensor([a[0] for a in args], dtype=torch.float32, device=device) if args and args[0] else None
    if name == "Invert":
        return 255 - images
    if name == "AutoContrast":
        return _auto_contrast(images)
    if name == "Equalize":
        return _equalize(images)
    if name.startswith("Posterize"):
        bits = values.to(torch.int64).clamp(0, 8)
        mask = (~((1 << (8 - bits)) - 1) & 0xFF).to(torch.uint8)
        return images & mask[:, None, None, None]
    if name.startswith("Solarize") and name != "SolarizeAdd":
        threshold = values[:, None, None, None]
        return torch.where(images.float() >= threshold, 255 - images, images)
    if name == "SolarizeAdd":
        added = (images.float() + values[:, None, None, None]).clamp(max=255).to(torch.uint8)
        return torch.where(images < 128, added, images)
    if name.startswith(("Color", "Contrast", "Brightness", "Sharpness")):
        return _blend(_degenerate(name, images), images, values)
    if name in GEOMETRIC_OPS:
        return _affine(images, _affine_coefficients(name, values, images.shape[-2:]), interpolation, fill)
    raise ValueError(f"unknown RandAugment op {name!r}")


def _grey(images: torch.Tensor) -> torch.Tensor:
    """Pillow's RGB -> L: (19595 R + 38470 G + 7471 B + 2^15) >> 16, as (N, 1, H, W) int32."""
    r, g, b = images.to(torch.int32).unbind(1)
    return ((r * 19595 + g * 38470 + b * 7471 + 32768) >> 16)[:, None]


def _degenerate(name: str, images: torch.Tensor) -> torch.Tensor:
    """The image ``ImageEnhance`` blends with: greyscale (Color), its mean grey (Contrast), black (Brightness),
    Pillow's SMOOTH filter with the border kept (Sharpness)."""
    if name.startswith("Color"):
        return _grey(images).expand_as(images).float()
    if name.startswith("Contrast"):
        mean = _grey(images).double().mean(dim=(1, 2, 3))
        return torch.floor(mean + 0.5).float()[:, None, None, None].expand(images.shape)
    if name.startswith("Brightness"):
        return torch.zeros_like(images, dtype=torch.float32)
    kernel = torch.ones(3, 1, 3, 3, device=images.device)
    kernel[:, :, 1, 1] = 5.0
    smooth = F.conv2d(images.float(), kernel / 13.0, groups=3)
    out = images.float().clone()
    out[..., 1:-1, 1:-1] = torch.floor(smooth + 0.5).clamp(0, 255)
    return out


def _blend(degenerate: torch.Tensor, images: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Pillow's ``Image.blend(degenerate, image, factor)``: float, clipped, truncated to uint8."""
    out = degenerate + factor[:, None, None, None] * (images.float() - degenerate)
    return out.clamp(0, 255).floor().to(torch.uint8)


def _auto_contrast(images: torch.Tensor) -> torch.Tensor:
    """``ImageOps.autocontrast``: each channel stretched from its [min, max] to [0, 255] (lookup ``int(x * scale -
    lo * scale)``); a flat channel is kept."""
    x = images.double()
    lo = x.amin(dim=(2, 3), keepdim=True)
    hi = x.amax(dim=(2, 3), keepdim=True)
    flat = hi <= lo
    scale = 255.0 / torch.where(flat, torch.ones_like(hi), hi - lo)
    out = torch.trunc(x * scale - lo * scale).clamp(0, 255)
    return torch.where(flat, x, out).to(torch.uint8)


def _equalize(images: torch.Tensor) -> torch.Tensor:
    """``ImageOps.equalize`` per channel: lookup ``(step // 2 + pixels below) // step`` with ``step = (pixels -
    count of the top level present) // 255``; a channel whose step is 0 is kept."""
    n, c, h, w = images.shape
    flat = images.reshape(n * c, h * w).to(torch.int64)
    hist = torch.zeros(n * c, 256, dtype=torch.int64, device=images.device)
    hist.scatter_add_(1, flat, torch.ones_like(flat))
    levels = torch.arange(256, device=images.device)
    top = torch.where(hist > 0, levels, -1).amax(dim=1, keepdim=True)
    step = (h * w - hist.gather(1, top)) // 255
    below = hist.cumsum(dim=1) - hist
    lut = ((step // 2 + below) // step.clamp(min=1)).clamp(max=255)
    lut = torch.where(step > 0, lut, levels)
    return lut.gather(1, flat).to(torch.uint8).reshape(n, c, h, w)


def _affine_coefficients(name: str, values: torch.Tensor, size) -> torch.Tensor:
    """Pillow's AFFINE data (a, b, c, d, e, f) per image: output pixel centre (x, y) reads (ax + by + c, dx + ey +
    f)."""
    h, w = size
    one, zero = torch.ones_like(values), torch.zeros_like(values)
    if name == "ShearX":
        return torch.stack([one, values, zero, zero, one, zero], dim=1)
    if name == "ShearY":
        return torch.stack([one, zero, zero, values, one, zero], dim=1)
    if name == "TranslateXRel":
        return torch.stack([one, zero, values * w, zero, one, zero], dim=1)
    if name == "TranslateYRel":
        return torch.stack([one, zero, zero, zero, one, values * h], dim=1)
    # Image.rotate(degrees) about the centre, no expansion: the inverse rotation, moved to the centre
    angle = -torch.deg2rad(values.double())
    cos, sin = torch.cos(angle), torch.sin(angle)
    cx, cy = w / 2.0, h / 2.0
    c = cos * -cx + sin * -cy + cx
    f = -sin * -cx + cos * -cy + cy
    return torch.stack([cos, sin, c, -sin, cos, f], dim=1).float()


def _affine(images: torch.Tensor, coefficients: torch.Tensor, interpolation: str,
            fill: tuple[int, int, int]) -> torch.Tensor:
    n, _, h, w = images.shape
    ys, xs = torch.meshgrid(torch.arange(h, device=images.device, dtype=torch.float32) + 0.5,
                            torch.arange(w, device=images.device, dtype=torch.float32) + 0.5, indexing="ij")
    a, b, c, d, e, f = (coefficients[:, k, None, None] for k in range(6))
    x_in = a * xs + b * ys + c
    y_in = d * xs + e * ys + f
    grid = torch.stack([2 * x_in / w - 1, 2 * y_in / h - 1], dim=-1)  # align_corners=False: pixel edges at +-1
    fill_value = torch.tensor(fill, dtype=torch.float32, device=images.device)[None, :, None, None]
    # sampled relative to the fill colour so that zero padding outside the image is the fill
    out = F.grid_sample(images.float() - fill_value, grid, mode=interpolation, padding_mode="zeros",
                        align_corners=False) + fill_value
    return torch.floor(out + 0.5).clamp(0, 255).to(torch.uint8)
