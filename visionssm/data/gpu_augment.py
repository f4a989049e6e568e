"""timm's RandAugment (``rand-m9-mstd0.5-inc1`` and the other ``rand-*`` strings) on batches of uint8 tensors.

Each image draws its own ops and magnitudes on the CPU (:func:`draw_rand_augment`, from a ``random.Random`` seeded
per image); :func:`plan_rand_augment` turns a batch's draws into numbers, and :func:`apply_rand_augment` runs each
layer as a fixed set of op families, each once on the subset of images that drew one of its ops, with per-image op
codes and arguments as tensors: the lookup-table ops (one table per image and channel, one gather), the blends (one
degenerate image per image), and the affine ops (one ``grid_sample`` per interpolation). The kernel launches per
batch are therefore the same for any batch size.

The op set, the magnitude noise and clamp, the level-to-argument rules and the random signs are timm's
(``timm.data.auto_augment``); each op follows the Pillow function timm calls:

- exact up to rounding (one grey level): Invert, Posterize, Solarize, SolarizeAdd, AutoContrast, Equalize, Color,
  Contrast, Brightness, Sharpness (Pillow's integer greyscale, its truncating blend, its smoothing kernel);
- Rotate, ShearX/Y, TranslateX/YRel: the same affine map and fill colour as Pillow, sampled by ``grid_sample``;
  bilinear agrees with Pillow inside the image, pixels whose source straddles the image border blend towards the
  fill instead of switching to it, and bicubic uses torch's kernel (a = -0.75) where Pillow's uses a = -0.5.
"""

from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from visionssm.utils.cli import UserValueError

__all__ = ["GEOMETRIC_OPS", "PLAN_COLUMNS", "RandAugmentPolicy", "affine_coefficients", "apply_op",
           "apply_rand_augment", "draw_rand_augment", "families", "level_args", "parse_rand_augment",
           "plan_rand_augment"]

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


# The op families a batch runs per layer: each image drew at most one op per layer, so the families' subsets of the
# batch are disjoint and each runs once on its subset, whatever the batch size and however many ops were drawn.
_LUT_OPS = {"Invert": 0, "Posterize": 1, "PosterizeIncreasing": 1, "Solarize": 2, "SolarizeIncreasing": 2,
            "SolarizeAdd": 3, "AutoContrast": 4, "Equalize": 5}
_BLEND_OPS = {"Color": 0, "ColorIncreasing": 0, "Contrast": 1, "ContrastIncreasing": 1, "Brightness": 2,
              "BrightnessIncreasing": 2, "Sharpness": 3, "SharpnessIncreasing": 3}
_AFFINE_OPS = {"Rotate": 0, "ShearX": 1, "ShearY": 2, "TranslateXRel": 3, "TranslateYRel": 4}


def families(policy: RandAugmentPolicy) -> tuple[str, ...]:
    """The op families a batch runs per layer under ``policy``: ``lut``, ``blend`` and one ``affine-<mode>`` per
    interpolation the geometric ops can draw."""
    modes = (policy.interpolation,) if policy.interpolation else INTERPOLATIONS
    return ("lut", "blend", *(f"affine-{mode}" for mode in modes))


def _family_and_code(name: str, interpolation: str) -> tuple[str, int]:
    if name in _LUT_OPS:
        return "lut", _LUT_OPS[name]
    if name in _BLEND_OPS:
        return "blend", _BLEND_OPS[name]
    if name in _AFFINE_OPS:
        return f"affine-{interpolation}", _AFFINE_OPS[name]
    raise ValueError(f"unknown RandAugment op {name!r}")


PLAN_COLUMNS = 9  # position in the batch, op code, argument, affine coefficients a..f


def _plan_row(position: int, name: str, args: tuple, interpolation: str, size: tuple[int, int]) -> list[float]:
    family, code = _family_and_code(name, interpolation)
    value = args[0] if args else 0.0
    coefficients = affine_coefficients(name, value, size) if family.startswith("affine") else (0.0,) * 6
    return [position, code, value, *coefficients]


def plan_rand_augment(policy: RandAugmentPolicy, draws: list[list], size: tuple[int, int]) -> dict[str, list[float]]:
    """The batch's draws (:func:`draw_rand_augment`, one list per image, for images of ``size``) as host numbers:
    for each layer and family (``"<layer>.<family>"``, every one present, empty or not) the rows of the images
    that drew an op of that family in that layer, flattened, :data:`PLAN_COLUMNS` numbers each."""
    plan: dict[str, list[float]] = {f"{layer}.{family}": [] for layer in range(policy.num_layers)
                                    for family in families(policy)}
    for position, drawn in enumerate(draws):
        for layer, op in enumerate(drawn):
            if op is not None:
                name, args, interpolation = op
                plan[f"{layer}.{_family_and_code(name, interpolation)[0]}"] += _plan_row(position, name, args,
                                                                                         interpolation, size)
    return plan


def apply_rand_augment(images: torch.Tensor, plan: dict[str, torch.Tensor], fill: tuple[int, int, int]) -> torch.Tensor:
    """Apply a planned batch (:func:`plan_rand_augment`'s rows, as ``(m, PLAN_COLUMNS)`` float64 tensors on the
    images' device) to a (N, 3, H, W) uint8 batch in place: per layer, each family once on its subset, so the number
    of kernel launches does not depend on the batch size or on the draws."""
    for key, rows in plan.items():
        index = rows[:, 0].long()
        images.index_copy_(0, index, _run_family(key.split(".", 1)[1], images.index_select(0, index), rows, fill))
    return images


def apply_op(name: str, images: torch.Tensor, args: list[tuple], interpolation: str,
             fill: tuple[int, int, int]) -> torch.Tensor:
    """One RandAugment op on a (N, 3, H, W) uint8 batch, image ``i`` with its arguments ``args[i]`` (through the
    batched family code that :func:`apply_rand_augment` runs)."""
    size = tuple(images.shape[-2:])
    rows = torch.tensor([_plan_row(i, name, a, interpolation, size) for i, a in enumerate(args)],
                        dtype=torch.float64, device=images.device).view(-1, PLAN_COLUMNS)
    return _run_family(_family_and_code(name, interpolation)[0], images, rows, fill)


def _run_family(family: str, images: torch.Tensor, rows: torch.Tensor, fill: tuple[int, int, int]) -> torch.Tensor:
    """One family on ``images`` (its subset of the batch), image ``i`` with ``rows[i]``."""
    if family == "lut":
        return _lookup_family(images, rows[:, 1].long(), rows[:, 2])
    if family == "blend":
        return _blend_family(images, rows[:, 1].long(), rows[:, 2])
    return _affine(images, rows[:, 3:].float(), family.split("-", 1)[1], fill)


def _lookup_family(images: torch.Tensor, codes: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Invert, Posterize, Solarize, SolarizeAdd, AutoContrast, Equalize: each a per-channel table of the 256 levels
    (the Pillow function's own lookup), chosen per image by ``codes``, applied in one gather."""
    m = images.shape[0]
    flat = images.reshape(m, 3, images.shape[-2] * images.shape[-1]).long()
    levels = torch.arange(256, device=images.device)
    value = values[:, None, None]
    bits = values.long().clamp(0, 8)
    mask = (~((1 << (8 - bits)) - 1) & 0xFF)[:, None, None]
    tables = [(255 - levels).expand(m, 3, 256),
              (levels & mask).expand(m, 3, 256),
              torch.where(levels >= value, 255 - levels, levels).expand(m, 3, 256),
              torch.where(levels < 128, (levels + value).clamp(max=255).long(), levels).expand(m, 3, 256),
              _auto_contrast_table(flat, levels),
              _equalize_table(flat, levels)]
    chosen = torch.stack(tables, dim=1).gather(1, codes.view(m, 1, 1, 1).expand(m, 1, 3, 256))[:, 0]
    return chosen.gather(2, flat).to(torch.uint8).view_as(images)


def _auto_contrast_table(flat: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """``ImageOps.autocontrast``'s table per channel: [min, max] stretched to [0, 255] (``int(x * scale - lo *
    scale)``); a flat channel is kept."""
    lo = flat.amin(dim=2, keepdim=True).double()
    hi = flat.amax(dim=2, keepdim=True).double()
    constant = hi <= lo
    scale = 255.0 / torch.where(constant, torch.ones_like(hi), hi - lo)
    table = torch.trunc(levels * scale - lo * scale).clamp(0, 255).long()
    return torch.where(constant, levels, table)


def _equalize_table(flat: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """``ImageOps.equalize``'s table per channel: ``(step // 2 + pixels below) // step`` with ``step = (pixels -
    count of the top level present) // 255``; a channel whose step is 0 is kept."""
    m, c, pixels = flat.shape
    hist = torch.zeros(m * c, 256, dtype=torch.int64, device=flat.device)
    hist.scatter_add_(1, flat.reshape(m * c, pixels), torch.ones_like(flat).reshape(m * c, pixels))
    top = torch.where(hist > 0, levels, -1).amax(dim=1, keepdim=True)
    step = (pixels - hist.gather(1, top)) // 255
    below = hist.cumsum(dim=1) - hist
    table = ((step // 2 + below) // step.clamp(min=1)).clamp(max=255)
    return torch.where(step > 0, table, levels).view(m, c, 256)


def _blend_family(images: torch.Tensor, codes: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Color, Contrast, Brightness, Sharpness: ``Image.blend(degenerate, image, factor)`` with each image's
    degenerate picked by ``codes`` (:func:`_degenerate`)."""
    code = codes.view(-1, 1, 1, 1)
    grey = _grey(images).float()
    mean = torch.floor(grey.double().mean(dim=(1, 2, 3), keepdim=True) + 0.5).float()
    degenerate = torch.where(code == 0, grey, torch.where(code == 1, mean, torch.where(
        code == 2, torch.zeros_like(mean), _smooth(images))))
    return _blend(degenerate, images, values.float())


def _grey(images: torch.Tensor) -> torch.Tensor:
    """Pillow's RGB -> L: (19595 R + 38470 G + 7471 B + 2^15) >> 16, as (N, 1, H, W) int32."""
    r, g, b = images.to(torch.int32).unbind(1)
    return ((r * 19595 + g * 38470 + b * 7471 + 32768) >> 16)[:, None]


def _smooth(images: torch.Tensor) -> torch.Tensor:
    """Sharpness's degenerate: Pillow's SMOOTH filter with the border kept, as float."""
    kernel = torch.ones(3, 1, 3, 3, device=images.device)
    kernel[:, :, 1, 1] = 5.0
    smooth = F.conv2d(images.float(), kernel / 13.0, groups=3)
    out = images.float()
    out[..., 1:-1, 1:-1] = torch.floor(smooth + 0.5).clamp(0, 255)
    return out


def _blend(degenerate: torch.Tensor, images: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Pillow's ``Image.blend(degenerate, image, factor)``: float, clipped, truncated to uint8."""
    out = degenerate + factor[:, None, None, None] * (images.float() - degenerate)
    return out.clamp(0, 255).floor().to(torch.uint8)


def affine_coefficients(name: str, value: float, size: tuple[int, int]) -> tuple[float, ...]:
    """Pillow's AFFINE data (a, b, c, d, e, f) for a geometric op with argument ``value`` on an image of ``size``:
    output pixel centre (x, y) reads (ax + by + c, dx + ey + f); computed from the argument's float32 value."""
    h, w = size
    v = struct.unpack("f", struct.pack("f", value))[0]
    if name == "ShearX":
        return (1.0, v, 0.0, 0.0, 1.0, 0.0)
    if name == "ShearY":
        return (1.0, 0.0, 0.0, v, 1.0, 0.0)
    if name == "TranslateXRel":
        return (1.0, 0.0, v * w, 0.0, 1.0, 0.0)
    if name == "TranslateYRel":
        return (1.0, 0.0, 0.0, 0.0, 1.0, v * h)
    if name != "Rotate":
        raise ValueError(f"{name!r} is not a geometric RandAugment op")
    # Image.rotate(degrees) about the centre, no expansion: the inverse rotation, moved to the centre
    angle = -math.radians(v)
    cos, sin = math.cos(angle), math.sin(angle)
    cx, cy = w / 2.0, h / 2.0
    return (cos, sin, cos * -cx + sin * -cy + cx, -sin, cos, -sin * -cx + cos * -cy + cy)


def _affine(images: torch.Tensor, coefficients: torch.Tensor, interpolation: str,
            fill: tuple[int, int, int]) -> torch.Tensor:
    n, _, h, w = images.shape
    ys, xs = torch.meshgrid(torch.arange(h, device=images.device, dtype=torch.float32) + 0.5,
                            torch.arange(w, device=images.device, dtype=torch.float32) + 0.5, indexing="ij")
    a, b, c, d, e, f = (coefficients[:, k, None, None] for k in range(6))
    x_in = a * xs + b * ys + c
    y_in = d * xs + e * ys + f
    grid = torch.stack([2 * x_in / w - 1, 2 * y_in / h - 1], dim=-1)  # align_corners=False: pixel edges at +-1
    # filled on the device: a tensor built from the host's tuple would be a synchronising copy
    fill_value = torch.stack([torch.full((), float(v), device=images.device) for v in fill])[None, :, None, None]
    # sampled relative to the fill colour so that zero padding outside the image is the fill
    out = F.grid_sample(images.float() - fill_value, grid, mode=interpolation, padding_mode="zeros",
                        align_corners=False) + fill_value
    return torch.floor(out + 0.5).clamp(0, 255).to(torch.uint8)
