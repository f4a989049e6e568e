"""Tracker network: pair backbones, centre head."""

from .backbones import build_pair_backbone
from .head import CenterHead, decode_boxes, hann_window
from .tracker_model import OneStreamTracker, build_model

__all__ = ["CenterHead", "OneStreamTracker", "build_model", "build_pair_backbone", "decode_boxes", "hann_window"]
