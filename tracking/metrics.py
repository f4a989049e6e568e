"""Tracking metrics with the benchmarks' own conventions.

GOT-10k (``got10k`` toolkit, ``ExperimentGOT10k.report`` on val):
    frame 1 excluded; predicted and ground-truth boxes clipped to the image (``resolution`` of ``meta_info.ini``);
    IoU in continuous coordinates, ``∩ / (∪ + eps)`` clipped to [0, 1]; only frames with ``cover > 0``; IoUs pooled
    over all frames of all sequences (and repetitions); AO = mean IoU, SR_τ = fraction of IoU > τ (strict);
    speed = mean of 1/t over per-frame times t > 0.
LaSOT (pytracking / OSTrack ``extract_results``):
    frame 1 replaced by the ground truth; predictions longer than the ground truth truncated; zero-size predictions
    repeat the previous box; IoU pixel-inclusive (``+1``), centres ``xy + (wh − 1)/2``; a frame whose ground truth
    has w ≤ 0 or h ≤ 0 (OSTrack's validity rule) or whose target is fully occluded / out of view counts as a failure
    in every curve (except pytracking's quirk: a visible frame with an invalid box is a success for the normalised
    precision); every frame of a sequence counts (denominator N_s); curves averaged over sequences;
    success S(τ) = frac IoU > τ for τ = 0, 0.05, …, 1 (21 thresholds, strict), AUC = mean S (a perfect tracker
    gets 20/21 = 95.24 %); precision P(d) = frac centre error ≤ d px, d = 0..50, reported at 20 px; normalised
    precision N(e) = frac ‖Δc / wh_gt‖ ≤ e, e = 0..0.50, reported at 0.20.
"""

from __future__ import annotations

import numpy as np
import torch

GOT10K_CONVENTIONS = (
    "GOT-10k (got10k toolkit rules): frame 1 excluded; boxes clipped to the image; frames with cover > 0 only; "
    "IoU pooled over all frames of all sequences; AO = mean IoU; SR0.5 / SR0.75 = fraction of IoU > 0.5 / > 0.75 "
    "(strict); toolkit speed = mean of 1/t over per-frame times."
)
LASOT_CONVENTIONS = (
    "LaSOT (pytracking/OSTrack convention): frame 1 set to ground truth; absent / out-of-view / invalid-box frames "
    "are failures; curves per sequence over all frames, then averaged over sequences; success AUC = mean over 21 "
    "IoU thresholds 0:0.05:1 with strict '>' (perfect tracker = 95.24); precision at 20 px (centre error <= 20); "
    "normalised precision at 0.20 (centre error / GT size <= 0.20). Pixel-inclusive IoU and centres."
)

# pytracking builds its thresholds with torch.arange; reuse those exact float64 values.
SUCCESS_THRESHOLDS = torch.arange(0.0, 1.0 + 0.05, 0.05, dtype=torch.float64).numpy()
PRECISION_THRESHOLDS = torch.arange(0, 51, dtype=torch.float64).numpy()
NORM_PRECISION_THRESHOLDS = (torch.arange(0, 51, dtype=torch.float64) / 100.0).numpy()
GOT10K_THRESHOLDS = np.linspace(0, 1, 101)


def _boxes(a, name: str) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    if a.ndim != 2 or a.shape[1] != 4:
        raise ValueError(f"{name} must be (N, 4) boxes, got shape {a.shape}")
    return a


# ---- GOT-10k -----------------------------------------------------------------------------------------------------

def got10k_iou(pred: np.ndarray, gt: np.ndarray, bound: tuple[int, int] | None = None) -> np.ndarray:
    """The toolkit's ``rect_iou``: continuous coordinates, boxes clipped to ``bound`` = (W, H) first."""
    pred, gt = _boxes(pred, "pred").copy(), _boxes(gt, "gt").copy()
    if pred.shape != gt.shape:
        raise ValueError(f"pred and gt must have the same shape, got {pred.shape} and {gt.shape}")
    if bound is not None:
        for r in (pred, gt):
            r[:, 0] = np.clip(r[:, 0], 0, bound[0])
            r[:, 1] = np.clip(r[:, 1], 0, bound[1])
            r[:, 2] = np.clip(r[:, 2], 0, bound[0] - r[:, 0])
            r[:, 3] = np.clip(r[:, 3], 0, bound[1] - r[:, 1])
    x1 = np.maximum(pred[:, 0], gt[:, 0])
    y1 = np.maximum(pred[:, 1], gt[:, 1])
    x2 = np.minimum(pred[:, 0] + pred[:, 2], gt[:, 0] + gt[:, 2])
    y2 = np.minimum(pred[:, 1] + pred[:, 3], gt[:, 1] + gt[:, 3])
    inter = np.maximum(x2 - x1, 0) * np.maximum(y2 - y1, 0)
    union = pred[:, 2] * pred[:, 3] + gt[:, 2] * gt[:, 3] - inter
    return np.clip(inter / (union + np.finfo(float).eps), 0.0, 1.0)


def got10k_sequence_ious(runs: list[np.ndarray], gt: np.ndarray, cover: np.ndarray, bound) -> np.ndarray:
    """Pooled IoUs of one sequence over its repetitions: frames 2.. with cover > 0."""
    gt = _boxes(gt, "gt")
    cover = np.asarray(cover).reshape(-1)
    if len(cover) != len(gt):
        raise ValueError(f"cover has {len(cover)} entries for {len(gt)} frames")
    out = []
    for run in runs:
        run = _boxes(run, "pred")
        if run.shape != gt.shape:
            raise ValueError(f"a result has {len(run)} boxes for {len(gt)} frames")
        out.append(got10k_iou(run[1:], gt[1:], bound)[cover[1:] > 0])
    return np.concatenate(out) if out else np.zeros(0)


def got10k_summary(ious: np.ndarray, times: np.ndarray | None = None) -> dict:
    """AO, SR0.5, SR0.75, the 101-point success curve and the toolkit's speed from pooled IoUs and frame times."""
    ious = np.asarray(ious, dtype=np.float64).reshape(-1)
    if len(ious) == 0:
        raise ValueError("no frames to evaluate (every frame after the first has cover 0?)")
    curve = np.mean(ious[:, None] > GOT10K_THRESHOLDS[None, :], axis=0)
    out = {"ao": float(ious.mean()), "sr50": float(np.mean(ious > 0.5)), "sr75": float(np.mean(ious > 0.75)),
           "succ_curve": curve.tolist(), "frames": int(len(ious))}
    if times is not None:
        t = np.asarray(times, dtype=np.float64).reshape(-1)
        t = t[np.isfinite(t) & (t > 0)]
        out["speed_fps"] = float(np.mean(1.0 / t)) if len(t) else -1.0
    return out


# ---- LaSOT (pytracking) ------------------------------------------------------------------------------------------

def prepare_lasot_prediction(pred: np.ndarray, gt: np.ndarray) -> np.ndarray:
    """pytracking's clean-up: truncate to the ground truth, frame 1 := GT, zero-size boxes repeat the previous one."""
    pred, gt = _boxes(pred, "pred").copy(), _boxes(gt, "gt")
    if len(pred) < len(gt):
        raise ValueError(f"result has {len(pred)} boxes for {len(gt)} frames")
    pred = pred[: len(gt)]
    if not np.isfinite(pred).all() or (pred[:, 2:] < 0).any():
        raise ValueError("invalid results: NaN/inf boxes or negative width/height")
    pred[0] = gt[0]
    for i in range(1, len(pred)):
        if (pred[i, 2:] == 0).any():
            pred[i] = pred[i - 1]
    return pred


def lasot_sequence_curves(pred: np.ndarray, gt: np.ndarray, visible: np.ndarray | None = None) -> dict:
    """Success (21), precision (51) and normalised precision (51) curves of one sequence, each in [0, 1]."""
    gt = _boxes(gt, "gt")
    pred = prepare_lasot_prediction(pred, gt)
    visible = np.ones(len(gt), dtype=bool) if visible is None else np.asarray(visible, dtype=bool).reshape(-1)
    if len(visible) != len(gt):
        raise ValueError(f"visible has {len(visible)} entries for {len(gt)} frames")
    with np.errstate(invalid="ignore"):
        gt_valid = np.isfinite(gt).all(1) & (gt[:, 2] > 0) & (gt[:, 3] > 0)
    gt_safe = np.where(np.isfinite(gt), gt, 0.0)
    tl = np.maximum(pred[:, :2], gt_safe[:, :2])
    br = np.minimum(pred[:, :2] + pred[:, 2:] - 1.0, gt_safe[:, :2] + gt_safe[:, 2:] - 1.0)
    inter = np.prod(np.clip(br - tl + 1.0, 0, None), axis=1)
    union = np.prod(pred[:, 2:], axis=1) + np.prod(gt_safe[:, 2:], axis=1) - inter
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = np.where(union > 0, inter / union, 0.0)
        delta = (pred[:, :2] + (pred[:, 2:] - 1.0) / 2) - (gt_safe[:, :2] + (gt_safe[:, 2:] - 1.0) / 2)
        ce = np.sqrt((delta**2).sum(1))
        nce = np.sqrt(((delta / gt_safe[:, 2:]) ** 2).sum(1))
    valid = gt_valid & visible
    iou[~valid] = -1.0
    ce[~valid] = np.inf
    nce[~valid] = -1.0
    nce[~visible] = np.inf
    n = len(gt)
    return {
        "success": (iou[:, None] > SUCCESS_THRESHOLDS[None]).sum(0) / n,
        "precision": (ce[:, None] <= PRECISION_THRESHOLDS[None]).sum(0) / n,
        "norm_precision": (nce[:, None] <= NORM_PRECISION_THRESHOLDS[None]).sum(0) / n,
    }


def lasot_summary(curves: list[dict]) -> dict:
    """Sequence-averaged curves and the headline numbers (in %): AUC, OP50, OP75, P@20, NP@0.20."""
    if not curves:
        raise ValueError("no sequences to evaluate")
    mean = {k: np.mean([c[k] for c in curves], axis=0) for k in ("success", "precision", "norm_precision")}
    idx50 = int(np.argmin(np.abs(SUCCESS_THRESHOLDS - 0.5)))
    idx75 = int(np.argmin(np.abs(SUCCESS_THRESHOLDS - 0.75)))
    return {
        "auc": float(100 * mean["success"].mean()),
        "op50": float(100 * mean["success"][idx50]),
        "op75": float(100 * mean["success"][idx75]),
        "precision_20px": float(100 * mean["precision"][20]),
        "norm_precision_0.20": float(100 * mean["norm_precision"][20]),
        "sequences": len(curves),
        "curves": {k: v.tolist() for k, v in mean.items()},
    }
