"""GOT-10k and LaSOT metric edge cases, hand-computed LaSOT cases, and parity with the got10k toolkit."""

import json
import os

import numpy as np
import pytest

from visionssm.tracking import metrics
from visionssm.tracking.data.synthetic import make_got10k
from visionssm.tracking.evaluate import evaluate
from visionssm.tracking.run import result_paths


def _boxes(n, box=(10.0, 20.0, 30.0, 40.0)):
    return np.tile(np.array(box, dtype=float), (n, 1))


# ---- GOT-10k ---------------------------------------------------------------------------------------------------

def test_got10k_iou_continuous_and_clipped():
    a = np.array([[0.0, 0.0, 10.0, 10.0]])
    b = np.array([[5.0, 0.0, 10.0, 10.0]])
    np.testing.assert_allclose(metrics.got10k_iou(a, b), [50 / 150])
    # Clipping to the image: the part of the prediction outside a 12-px-wide image does not count.
    np.testing.assert_allclose(metrics.got10k_iou(np.array([[5.0, 0.0, 20.0, 10.0]]), b, bound=(12, 100)),
                               [1.0])


def test_got10k_frame_one_excluded_cover_filter_and_strict_threshold():
    gt = _boxes(4)
    pred = gt.copy()
    pred[0] = [500, 500, 1, 1]          # frame 1 is never scored
    pred[1] = [10, 20, 15, 40]          # IoU exactly 0.5: not a success for SR0.5 (strict)
    pred[3] = [900, 900, 5, 5]          # a miss on a frame with cover 0: dropped
    cover = np.array([8, 8, 8, 0])
    ious = metrics.got10k_sequence_ious([pred], gt, cover, bound=(1000, 1000))
    np.testing.assert_allclose(ious, [0.5, 1.0])
    s = metrics.got10k_summary(ious, np.array([0.1, 0.05, 0.0]))
    assert s["ao"] == pytest.approx(0.75) and s["sr50"] == 0.5 and s["sr75"] == 0.5
    assert s["speed_fps"] == pytest.approx((10 + 20) / 2)  # times ≤ 0 ignored


def test_got10k_pools_frames_not_sequences():
    seq_a = metrics.got10k_sequence_ious([_boxes(11)], _boxes(11), np.full(11, 8), None)   # 10 frames of IoU 1
    miss = _boxes(3, (500, 500, 5, 5))
    seq_b = metrics.got10k_sequence_ious([miss], _boxes(3), np.full(3, 8), None)           # 2 frames of IoU 0
    s = metrics.got10k_summary(np.concatenate([seq_a, seq_b]))
    assert s["ao"] == pytest.approx(10 / 12)  # per-sequence mean would be 0.5


def test_got10k_rejects_bad_results():
    with pytest.raises(ValueError, match="boxes for"):
        metrics.got10k_sequence_ious([_boxes(3)], _boxes(4), np.full(4, 8), None)
    with pytest.raises(ValueError, match="no frames"):
        metrics.got10k_summary(np.zeros(0))


def _write_results(results_dir, name, root, rng, noise):
    from visionssm.tracking.data.got10k import Got10k

    for seq in Got10k(root, "val"):
        pred = seq.boxes + rng.normal(0, noise, seq.boxes.shape) * seq.boxes[:, 2:].repeat(2, 1)
        pred[:, 2:] = np.abs(pred[:, 2:])
        box_file, time_file = result_paths(results_dir, "got10k", name, seq.name)
        os.makedirs(os.path.dirname(box_file), exist_ok=True)
        np.savetxt(box_file, pred, fmt="%.3f", delimiter=",")
        np.savetxt(time_file, rng.uniform(0.001, 0.02, (len(seq), 1)), fmt="%.8f", delimiter=",")


def test_got10k_matches_the_toolkit(tmp_path):
    pytest.importorskip("six")
    experiments = pytest.importorskip("got10k.experiments")
    root = make_got10k(str(tmp_path / "got10k"), {"val": 4}, num_frames=(12, 20), seed=3)
    rng = np.random.default_rng(0)
    _write_results(str(tmp_path / "results"), "noisy", root, rng, 0.15)
    _write_results(str(tmp_path / "results"), "rough", root, rng, 0.6)
    ours = evaluate("got10k", root, "val", str(tmp_path / "results"), ["noisy", "rough"], str(tmp_path / "ours"),
                    plots=False)["trackers"]
    exp = experiments.ExperimentGOT10k(root, subset="val", result_dir=str(tmp_path / "results"),
                                       report_dir=str(tmp_path / "toolkit"))
    theirs = exp.report(["noisy", "rough"])
    for name in ("noisy", "rough"):
        t = theirs[name]["overall"]
        assert ours[name]["ao"] == pytest.approx(t["ao"], abs=1e-12)
        assert ours[name]["sr50"] == pytest.approx(t["sr"], abs=1e-12)
        assert ours[name]["sr75"] == pytest.approx(t["succ_curve"][75], abs=1e-12)
        np.testing.assert_allclose(ours[name]["succ_curve"], t["succ_curve"], atol=1e-12)
        assert ours[name]["speed_fps"] == pytest.approx(t["speed_fps"], rel=1e-12)
    assert 0 < ours["rough"]["ao"] < ours["noisy"]["ao"] < 1


def test_toolkit_run_output_scores_the_same(tmp_path):
    """Results written by the toolkit's own ``run`` (through our adapter) score the same with our evaluator."""
    pytest.importorskip("six")
    experiments = pytest.importorskip("got10k.experiments")
    from visionssm.tracking.tracker import FirstBoxTracker, got10k_toolkit_tracker

    root = make_got10k(str(tmp_path / "got10k"), {"val": 2}, num_frames=(10, 14), seed=5)
    exp = experiments.ExperimentGOT10k(root, subset="val", result_dir=str(tmp_path / "results"),
                                       report_dir=str(tmp_path / "toolkit"))
    exp.run(got10k_toolkit_tracker(FirstBoxTracker(), "first_box"))
    theirs = exp.report(["first_box"])["first_box"]["overall"]
    ours = evaluate("got10k", root, "val", str(tmp_path / "results"), ["first_box"], str(tmp_path / "ours"),
                    plots=False)["trackers"]["first_box"]
    assert ours["ao"] == pytest.approx(theirs["ao"], abs=1e-12)
    assert ours["sr50"] == pytest.approx(theirs["sr"], abs=1e-12)


# ---- LaSOT -----------------------------------------------------------------------------------------------------

def test_lasot_perfect_tracker_auc_is_20_of_21():
    gt = _boxes(30)
    s = metrics.lasot_summary([metrics.lasot_sequence_curves(gt, gt)])
    assert s["auc"] == pytest.approx(100 * 20 / 21)  # 95.238: IoU 1 never passes τ = 1 with '>'
    assert s["auc"] == pytest.approx(95.238, abs=1e-3)
    assert s["precision_20px"] == 100 and s["norm_precision_0.20"] == 100
    assert s["op50"] == 100 and s["op75"] == 100
    assert len(metrics.SUCCESS_THRESHOLDS) == 21


def test_lasot_absent_frames_are_failures():
    gt = _boxes(10)
    visible = np.ones(10, bool)
    visible[[3, 4]] = False
    gt[4] = 0  # LaSOT writes 0,0,0,0 where the target is gone
    c = metrics.lasot_sequence_curves(gt.copy(), gt, visible)  # predicting the GT everywhere
    np.testing.assert_allclose(c["success"][:-1], 0.8)
    np.testing.assert_allclose(c["precision"], 0.8)
    np.testing.assert_allclose(c["norm_precision"], 0.8)


def test_lasot_constant_shift_precision_curve():
    gt = _boxes(11, (100.0, 100.0, 50.0, 50.0))
    pred = gt.copy()
    pred[:, 0] += 7  # 7 px to the right on frames 2..11 (frame 1 is replaced by the GT)
    c = metrics.lasot_sequence_curves(pred, gt)
    expected = np.where(np.arange(51) >= 7, 1.0, 1 / 11)
    np.testing.assert_allclose(c["precision"], expected)
    expected_np = np.where(metrics.NORM_PRECISION_THRESHOLDS >= 7 / 50, 1.0, 1 / 11)
    np.testing.assert_allclose(c["norm_precision"], expected_np)
    # Pixel-inclusive IoU of a 7-px shift of a 50-px box: 43·50 / (2·2500 − 43·50).
    iou = 43 * 50 / (5000 - 43 * 50)
    expected_s = (1 + 10 * (iou > metrics.SUCCESS_THRESHOLDS)) / 11
    expected_s[-1] = 0
    np.testing.assert_allclose(c["success"], expected_s)


def test_lasot_pixel_inclusive_iou_and_strict_threshold():
    gt = np.array([[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 10.0]])
    pred = np.array([[0.0, 0.0, 10.0, 10.0], [5.0, 0.0, 10.0, 10.0]])  # inter 5·10 = 50, union 150
    c = metrics.lasot_sequence_curves(pred, gt)
    # frame 2 has IoU 1/3: success for τ < 1/3; frame 1 (GT) for τ < 1.
    expected = (np.array(metrics.SUCCESS_THRESHOLDS < 1, float) + (metrics.SUCCESS_THRESHOLDS < 1 / 3)) / 2
    np.testing.assert_allclose(c["success"], expected)
    half = np.array([[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 10.0]])
    pred_half = np.array([[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 5.0]])  # IoU exactly 0.5
    c = metrics.lasot_sequence_curves(pred_half, half)
    idx = int(np.argmin(np.abs(metrics.SUCCESS_THRESHOLDS - 0.5)))
    assert c["success"][idx] == 0.5 and c["success"][idx - 1] == 1.0


def test_lasot_result_cleanup_rules():
    gt = _boxes(5)
    pred = gt.copy()
    pred[0] = [0, 0, 1, 1]        # frame 1 is replaced by the GT
    pred[2] = [10, 20, 0, 0]      # zero size repeats the previous box
    longer = np.vstack([pred, _boxes(3)])
    cleaned = metrics.prepare_lasot_prediction(longer, gt)
    np.testing.assert_allclose(cleaned, gt)
    with pytest.raises(ValueError, match="boxes for"):
        metrics.prepare_lasot_prediction(gt[:3], gt)
    bad = gt.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="invalid"):
        metrics.prepare_lasot_prediction(bad, gt)


def test_lasot_sequence_average():
    gt = _boxes(10)
    perfect = metrics.lasot_sequence_curves(gt, gt)
    lost = gt.copy()
    lost[1:] = [900, 900, 30, 40]
    s = metrics.lasot_summary([perfect, metrics.lasot_sequence_curves(lost, gt)])
    assert s["auc"] == pytest.approx(100 * (20 / 21 + 20 / 21 / 10) / 2)
    json.dumps(s)
