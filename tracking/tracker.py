"""Inference: a tracker object with ``initialize(image, box)`` and ``track(image) -> box`` (OSTrack's procedure).

The template is cropped once from the first frame (2× the box → 128²) and kept for the whole video. Each new frame
is cropped around the previous box (4× → 256², zero padding), the score map is multiplied by a Hann window, the box
is read at the windowed peak, mapped back to image pixels and clipped to the image (at least 10 px wide and high).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from visionssm.utils.cli import UserFileError, UserValueError

from .data.processing import clip_box, crop_image, crop_transform
from .data.transforms import to_tensor
from .model.head import decode_boxes, hann_window


def _as_rgb_array(image) -> np.ndarray:
    if hasattr(image, "convert"):  # PIL image
        image = np.asarray(image.convert("RGB"))
    image = np.asarray(image)
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"image must be RGB uint8 (H, W, 3), got shape {image.shape} dtype {image.dtype}")
    return image


class Tracker:
    """Single-object tracker around a :class:`~visionssm.tracking.model.OneStreamTracker`."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: str | torch.device = "cpu",
        template_factor: float = 2.0,
        search_factor: float = 4.0,
        use_window: bool = True,
        amp: bool = False,
    ):
        self.model = model.eval().to(device)
        self.device = torch.device(device)
        self.template_factor, self.search_factor = float(template_factor), float(search_factor)
        self.template_size, self.search_size = model.template_size, model.search_size
        self.feat_size = self.search_size // model.backbone.stride
        self.window = hann_window(self.feat_size, self.device) if use_window else None
        self.amp = bool(amp) and self.device.type == "cuda"
        self.template = None
        self.state = None

    @staticmethod
    def _check_box(box) -> np.ndarray:
        box = np.asarray(box, dtype=np.float64).reshape(-1)
        if box.shape != (4,) or not np.isfinite(box).all() or box[2] <= 0 or box[3] <= 0:
            raise ValueError(f"box must be a finite (x, y, w, h) with w, h > 0, got {box}")
        return box

    @torch.no_grad()
    def initialize(self, image, box) -> None:
        image = _as_rgb_array(image)
        box = self._check_box(box)
        crop, _ = crop_image(image, crop_transform(box, self.template_factor, self.template_size))
        self.template = to_tensor(crop)[None].to(self.device)
        self.state = box

    @torch.no_grad()
    def track(self, image) -> np.ndarray:
        if self.template is None:
            raise RuntimeError("call initialize(image, box) before track(image)")
        image = _as_rgb_array(image)
        transform = crop_transform(self.state, self.search_factor, self.search_size)
        crop, _ = crop_image(image, transform)
        search = to_tensor(crop)[None].to(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            out = self.model(self.template, search)
        boxes, _ = decode_boxes(out["score"], out["size"], out["offset"], self.window)
        cx, cy, w, h = (boxes[0].float().cpu().numpy() * self.search_size).tolist()
        box_crop = np.array([cx - w / 2, cy - h / 2, w, h])
        box = transform.box_to_image(box_crop)
        self.state = clip_box(box, image.shape[1], image.shape[0], margin=10)
        return self.state.copy()


class FirstBoxTracker:
    """The baseline that repeats the first box on every frame."""

    def initialize(self, image, box) -> None:
        self.state = np.asarray(box, dtype=np.float64).reshape(4)

    def track(self, image) -> np.ndarray:
        return self.state.copy()


def got10k_toolkit_tracker(tracker, name: str):
    """Wrap a tracker for the ``got10k`` toolkit (``ExperimentGOT10k(...).run(wrapped)``): ``init``/``update`` on PIL
    images, deterministic (one repetition)."""
    from got10k.trackers import Tracker as ToolkitTracker

    class _Toolkit(ToolkitTracker):
        def __init__(self):
            super().__init__(name, is_deterministic=True)

        def init(self, image, box):
            tracker.initialize(image, box)

        def update(self, image):
            return tracker.track(image)

    return _Toolkit()


def load_tracker(checkpoint: str, device: str = "cpu", **kwargs) -> Tracker:
    """A :class:`Tracker` from a training checkpoint (``final.pth`` or ``last.pth`` of ``visionssm.tracking.train``)."""
    from .model.tracker_model import build_model

    if not os.path.isfile(checkpoint):
        raise UserFileError(f"--checkpoint {checkpoint} not found")
    try:
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    except Exception as error:  # unpickling arbitrary bytes can fail with almost any exception type
        raise UserValueError(f"--checkpoint {checkpoint} cannot be read as a checkpoint "
                             f"({(str(error).strip().splitlines() or [''])[0][:200]})") from None
    if not isinstance(state, dict) or "config" not in state or "model" not in state:
        raise UserValueError(f"{checkpoint} is not a visionssm.tracking checkpoint (needs 'config' and 'model')")
    model = build_model(state["config"]["model"], load_pretrained=False)
    model.load_state_dict(state["model"])
    test = state["config"].get("test", {})
    return Tracker(model, device, template_factor=state["config"]["data"]["template_factor"],
                   search_factor=test.get("search_factor", state["config"]["data"]["search_factor"]),
                   use_window=test.get("hann_window", True), **kwargs)
