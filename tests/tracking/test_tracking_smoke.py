"""End to end on generated videos: train (and resume), track, write both result formats, evaluate with plots."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from visionssm.tracking.config import load_config
from visionssm.tracking.data.synthetic import make_got10k, make_lasot
from visionssm.tracking.evaluate import evaluate, format_report
from visionssm.tracking.run import main as run_main
from visionssm.tracking.run import run
from visionssm.tracking.train import train

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tracking", "smoke_synthetic.yaml")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    base = tmp_path_factory.mktemp("smoke")
    got = make_got10k(str(base / "got10k"), {"train": 3, "val": 2, "test": 1}, num_frames=(12, 16), seed=4)
    lasot = make_lasot(str(base / "lasot"), ("cube",), per_category=2, test_per_category=1, num_frames=(12, 16),
                       seed=4)
    return base, got, lasot


def test_configs_load():
    cfg_dir = os.path.dirname(CONFIG)
    for name in sorted(os.listdir(cfg_dir)):
        cfg = load_config(os.path.join(cfg_dir, name))
        assert cfg["data"]["train"], name
    got = load_config(os.path.join(cfg_dir, "gka_vision_T_got10k_ep100.yaml"))
    assert [d["type"] for d in got["data"]["train"]] == ["got10k"]  # GOT-10k protocol: GOT-10k train only
    assert got["train"]["lr"] == 4e-4 and got["train"]["backbone_lr_mult"] == 0.1
    assert got["train"]["grad_clip"] == 0.1 and got["train"]["weight_decay"] == 1e-4
    with pytest.raises(KeyError, match="unknown config key"):
        load_config(CONFIG, ["train.learning_rate=1"])


def test_train_resume_track_evaluate(data, capsys):
    base, got, lasot = data
    out = str(base / "train")
    # deterministic: the resumed run below must equal the uninterrupted one to the last bit on a GPU too
    overrides = [f"data.train=[{{type: got10k, root: {got}}}, {{type: lasot, root: {lasot}, ratio: 0.5}}]",
                 f"output_dir={out}", "train.epochs=2", "data.pairs_per_epoch=8", "train.deterministic=true"]
    stats = train(load_config(CONFIG, overrides), progress=False)
    assert np.isfinite(stats["loss"])
    records = [json.loads(line) for line in Path(os.path.join(out, "metrics.jsonl")).read_text().splitlines()]
    assert [r["epoch"] for r in records if r.get("epoch_summary")] == [1, 2]
    assert {"final.pth", "config.yaml", "metrics.jsonl", "checkpoints"} <= set(os.listdir(out))
    # checkpoint_every_steps 3, keep_last 2: the two newest complete checkpoints stay.
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["epoch_0002", "step_00000003"]
    final = torch.load(os.path.join(out, "final.pth"), weights_only=False)
    assert final["finished"] and final["step"] == 4

    # Stopped mid-epoch 2 (after step 3), then resumed at the exact batch: same weights as the uninterrupted run.
    other = str(base / "train_resumed")
    again = overrides[:1] + [f"output_dir={other}", "train.epochs=2", "data.pairs_per_epoch=8",
                             "train.deterministic=true"]
    train(load_config(CONFIG, again + ["train.max_steps=3"]), progress=False)
    assert not torch.load(os.path.join(other, "final.pth"), weights_only=False)["finished"]
    assert "step_00000003" in os.listdir(os.path.join(other, "checkpoints"))
    capsys.readouterr()
    train(load_config(CONFIG, again), progress=True)
    # 8 pairs in batches of 4: the resumed epoch's bar starts at 1/2 and ends at its last step, 2/2
    assert "2/2" in capsys.readouterr().err
    resumed = torch.load(os.path.join(other, "final.pth"), weights_only=False)
    assert resumed["finished"] and resumed["step"] == 4
    for key, value in final["model"].items():
        torch.testing.assert_close(resumed["model"][key], value, rtol=0, atol=0, msg=key)
    assert train(load_config(CONFIG, again), progress=False) == {}, "a finished run is not trained again"
    assert "nothing to do" in capsys.readouterr().out

    results, reports = str(base / "results"), str(base / "reports")
    summary = run("got10k", got, "val", "tiny", results, checkpoint=os.path.join(out, "final.pth"), progress=False)
    assert summary["sequences"] == 2 and summary["fps"] > 0
    run("got10k", got, "val", "first_box", results, baseline="first-box", progress=False)
    seq_dir = os.path.join(results, "GOT-10k", "tiny", "GOT-10k_Val_000001")
    boxes = np.loadtxt(os.path.join(seq_dir, "GOT-10k_Val_000001_001.txt"), delimiter=",")
    times = np.loadtxt(os.path.join(seq_dir, "GOT-10k_Val_000001_time.txt"), delimiter=",")
    assert boxes.shape[1] == 4 and len(times) == len(boxes) and (times > 0).all()
    report = evaluate("got10k", got, "val", results, ["tiny", "first_box"], reports)
    for perf in report["trackers"].values():
        assert 0 <= perf["sr75"] <= perf["sr50"] <= 1 and 0 <= perf["ao"] <= 1
    assert os.path.getsize(os.path.join(reports, "GOT-10k", "success_plot.png")) > 0
    assert "frame 1 excluded" in format_report(report)
    # the got10k toolkit's ExperimentGOT10k writes one time column per repetition of a run
    for seq in sorted(os.listdir(os.path.join(results, "GOT-10k", "first_box"))):
        time_file = os.path.join(results, "GOT-10k", "first_box", seq, f"{seq}_time.txt")
        one = np.loadtxt(time_file, delimiter=",")
        np.savetxt(time_file, np.stack([one, 2 * one, 4 * one], axis=1), fmt="%.8f", delimiter=",")
    repeated = evaluate("got10k", got, "val", results, ["first_box"], reports, plots=False)["trackers"]["first_box"]
    before = report["trackers"]["first_box"]
    assert repeated["fps"] == pytest.approx(before["fps"] * 3 / 7)  # 3x the frames in 7x the time
    assert repeated["speed_fps"] == pytest.approx(before["speed_fps"] * (1 + 1 / 2 + 1 / 4) / 3)

    run_main(["--dataset", "got10k", "--root", got, "--split", "test", "--checkpoint", os.path.join(out, "final.pth"),
              "--name", "tiny", "--results-dir", results, "--pack"])
    import zipfile

    with zipfile.ZipFile(os.path.join(results, "GOT-10k", "tiny.zip")) as archive:
        assert sorted(archive.namelist()) == ["GOT-10k_Test_000001/", "GOT-10k_Test_000001/GOT-10k_Test_000001_001.txt",
                                              "GOT-10k_Test_000001/GOT-10k_Test_000001_time.txt"]

    # val and test runs share the tracker's folder, each keeps its own summary
    assert {"tiny_val_run_summary.json", "tiny_test_run_summary.json"} <= set(os.listdir(os.path.join(results,
                                                                                                   "GOT-10k")))
    run("lasot", lasot, "test", "tiny", results, checkpoint=os.path.join(out, "final.pth"), progress=False)
    assert os.path.exists(os.path.join(results, "LaSOT", "tiny", "cube-1.txt"))
    report = evaluate("lasot", lasot, "test", results, ["tiny"], reports)
    perf = report["trackers"]["tiny"]
    assert 0 <= perf["auc"] <= 100 * 20 / 21 + 1e-9 and perf["sequences"] == 1
    for plot in ("success_plot.png", "precision_plot.png", "norm_precision_plot.png"):
        assert os.path.getsize(os.path.join(reports, "LaSOT", plot)) > 0
    assert "95.24" in format_report(report)
