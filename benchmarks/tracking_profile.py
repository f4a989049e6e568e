"""Tracker speed per backbone: parameters, network latency at batch 1 and end-to-end tracking FPS.

::

    python benchmarks/tracking_profile.py --backbones gka_vision_T mamba_vision_T comba_vision_S --json speed.json

Network latency: one template (128²) + one search (256²) forward at batch 1 on random weights, after warm-up,
timed with CUDA events over ``--iters`` runs (fp32, and bf16 autocast). End-to-end FPS: the full
:class:`~visionssm.tracking.tracker.Tracker` step (crop, normalise, copy to the GPU, forward, Hann window, decode, map
back) over generated frames held in memory, so image decoding is excluded (as in OSTrack's and the toolkit's
timing of ``track``).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from visionssm.benchmark.harness import environment
from visionssm.tracking.model.tracker_model import build_model
from visionssm.tracking.tracker import Tracker


def _latency_ms(model, device, iters: int, warmup: int, amp: bool) -> float:
    z = torch.randn(1, 3, model.template_size, model.template_size, device=device)
    x = torch.randn(1, 3, model.search_size, model.search_size, device=device)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
        for _ in range(warmup):
            model(z, x)
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                model(z, x)
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / iters
        tic = time.perf_counter()
        for _ in range(iters):
            model(z, x)
        return (time.perf_counter() - tic) * 1000 / iters


def _video(frames: int, seed: int = 0):
    from visionssm.tracking.data.synthetic import render_video

    images, boxes, _, _ = render_video(seed, frames, 640, 480, occlusion_prob=0.0)
    return images, boxes


def profile_backbone(name: str, device: str = "cuda", iters: int = 200, warmup: int = 30, frames: int = 200,
                     backbone_kwargs: dict | None = None) -> dict:
    dev = torch.device(device)
    model = build_model({"backbone": name, "backbone_kwargs": backbone_kwargs or {}}, load_pretrained=False)
    model = model.eval().to(dev)
    out = {"backbone": name, "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
           "backbone_params_M": sum(p.numel() for p in model.backbone.parameters()) / 1e6}
    out["latency_ms_fp32"] = _latency_ms(model, dev, iters, warmup, amp=False)
    out["latency_ms_bf16"] = _latency_ms(model, dev, iters, warmup, amp=True) if dev.type == "cuda" else None
    images, boxes = _video(frames + 1)
    for amp in (False, True) if dev.type == "cuda" else (False,):
        tracker = Tracker(model, dev, amp=amp)
        tracker.initialize(images[0], boxes[0])
        for image in images[1:11]:  # warm-up (first-call compilation of every shape)
            tracker.track(image)
        tracker.initialize(images[0], boxes[0])
        if dev.type == "cuda":
            torch.cuda.synchronize()
        tic = time.perf_counter()
        for image in images[1:]:
            tracker.track(image)  # returns a numpy box: synchronises every frame, as a real tracker must
        out[f"tracker_fps_{'bf16' if amp else 'fp32'}"] = frames / (time.perf_counter() - tic)
    out["network_fps_fp32"] = 1000 / out["latency_ms_fp32"]
    if out["latency_ms_bf16"]:
        out["network_fps_bf16"] = 1000 / out["latency_ms_bf16"]
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description="Tracker speed per backbone (random weights).")
    parser.add_argument("--backbones", nargs="+", default=["gka_vision_T", "mamba_vision_T", "comba_vision_S"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--frames", type=int, default=200)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    results = {"environment": environment(), "method": __doc__.split("\n\n")[3], "backbones": []}
    for name in args.backbones:
        try:
            r = profile_backbone(name, args.device, args.iters, args.warmup, args.frames)
        except Exception as e:  # report and go on with the next backbone
            r = {"backbone": name, "error": f"{type(e).__name__}: {e}"}
        results["backbones"].append(r)
        print(json.dumps(r), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
