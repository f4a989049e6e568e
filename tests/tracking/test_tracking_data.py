"""Loaders on generated data in the exact GOT-10k / LaSOT layouts, and the pair sampler."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from visionssm.tracking.data import Got10k, LaSOT, PairDataset, Sequence
from visionssm.tracking.data.synthetic import make_got10k, make_lasot


@pytest.fixture(scope="module")
def got10k_root(tmp_path_factory):
    return make_got10k(str(tmp_path_factory.mktemp("got10k")), {"train": 3, "val": 2, "test": 1},
                       num_frames=(24, 30), seed=1)


@pytest.fixture(scope="module")
def lasot_root(tmp_path_factory):
    return make_lasot(str(tmp_path_factory.mktemp("lasot")), ("cube", "ball"), per_category=2, test_per_category=1,
                      num_frames=(24, 30), seed=1)


def test_got10k_layout_on_disk(got10k_root):
    for split, n in (("train", 3), ("val", 2), ("test", 1)):
        names = Path(os.path.join(got10k_root, split, "list.txt")).read_text().split()
        assert names == [f"GOT-10k_{split.capitalize()}_{i:06d}" for i in range(1, n + 1)]
    seq_dir = os.path.join(got10k_root, "val", "GOT-10k_Val_000001")
    files = set(os.listdir(seq_dir))
    assert {"groundtruth.txt", "absence.label", "cover.label", "cut_by_image.label", "meta_info.ini"} <= files
    frames = sorted(f for f in files if f.endswith(".jpg"))
    gt_lines = Path(os.path.join(seq_dir, "groundtruth.txt")).read_text().split()
    assert frames[0] == "00000001.jpg" and len(frames) == len(gt_lines)
    meta = Path(os.path.join(seq_dir, "meta_info.ini")).read_text().splitlines()
    assert meta[0] == "[METAINFO]" and meta[-1].startswith("resolution: (")
    test_dir = os.path.join(got10k_root, "test", "GOT-10k_Test_000001")
    assert len(Path(os.path.join(test_dir, "groundtruth.txt")).read_text().split()) == 1
    assert not any(f.endswith(".label") for f in os.listdir(test_dir))


def test_got10k_loader(got10k_root):
    val = Got10k(got10k_root, "val")
    assert len(val) == 2
    seq = val["GOT-10k_Val_000002"]
    assert isinstance(seq, Sequence) and len(seq) == len(seq.boxes) == len(seq.visible)
    expected = (seq.meta["absence"] == 0) & (seq.meta["cover"] > 0)
    np.testing.assert_array_equal(seq.visible, expected)
    assert seq.meta["resolution"] == (160, 120)
    test = Got10k(got10k_root, "test")[0]
    assert test.visible[0] and not test.visible[1:].any() and np.isnan(test.boxes[1:]).all()


def test_got10k_absent_frames(tmp_path):
    root = make_got10k(str(tmp_path), {"val": 1}, num_frames=12, seed=0)
    seq_dir = os.path.join(root, "val", "GOT-10k_Val_000001")
    absence = np.zeros(12, int)
    absence[[2, 5]] = 1
    np.savetxt(os.path.join(seq_dir, "absence.label"), absence, fmt="%d")
    cover = np.full(12, 8)
    cover[7] = 0
    np.savetxt(os.path.join(seq_dir, "cover.label"), cover, fmt="%d")
    gt = np.loadtxt(os.path.join(seq_dir, "groundtruth.txt"), delimiter=",")
    gt[9] = np.nan
    np.savetxt(os.path.join(seq_dir, "groundtruth.txt"), gt, fmt="%.4f", delimiter=",")
    seq = Got10k(root, "val")[0]
    np.testing.assert_array_equal(np.flatnonzero(~seq.visible), [2, 5, 7, 9])


def test_got10k_bad_input(tmp_path, got10k_root):
    with pytest.raises(ValueError, match="split"):
        Got10k(got10k_root, "validation")
    with pytest.raises(FileNotFoundError, match="list.txt"):
        Got10k(str(tmp_path), "val")
    with pytest.raises(ValueError, match="not in list.txt"):
        Got10k(got10k_root, "val", seq_names=["nope"])


def test_lasot_layout_and_loader(lasot_root):
    assert Path(os.path.join(lasot_root, "testing_set.txt")).read_text().split() == ["cube-1", "ball-1"]
    assert Path(os.path.join(lasot_root, "training_set.txt")).read_text().split() == ["cube-2", "ball-2"]
    seq_dir = os.path.join(lasot_root, "cube", "cube-1")
    assert {"img", "groundtruth.txt", "full_occlusion.txt", "out_of_view.txt", "nlp.txt"} <= set(os.listdir(seq_dir))
    assert sorted(os.listdir(os.path.join(seq_dir, "img")))[0] == "00000001.jpg"
    assert len(Path(os.path.join(seq_dir, "full_occlusion.txt")).read_text().strip().splitlines()) == 1
    test = LaSOT(lasot_root, "test")
    train = LaSOT(lasot_root, "train")
    assert test.seq_names == ["cube-1", "ball-1"] and train.seq_names == ["cube-2", "ball-2"]
    assert len(LaSOT(lasot_root, "all")) == 4
    seq = test["cube-1"]
    assert seq.meta["category"] == "cube"
    np.testing.assert_array_equal(seq.visible, ~seq.meta["full_occlusion"] & ~seq.meta["out_of_view"]
                                  & (seq.boxes[:, 2] > 0))
    assert (seq.boxes[seq.meta["full_occlusion"]] == 0).all()


def test_lasot_occlusion_flags(tmp_path):
    root = make_lasot(str(tmp_path), ("cube",), per_category=1, test_per_category=1, num_frames=10, seed=2)
    seq_dir = os.path.join(root, "cube", "cube-1")
    flags = ["0"] * 10
    flags[4] = "1"
    with open(os.path.join(seq_dir, "out_of_view.txt"), "w") as f:
        f.write(",".join(flags) + "\n")
    seq = LaSOT(root, "test")[0]
    assert not seq.visible[4] and seq.meta["out_of_view"][4]


def test_pair_frames_respect_gap_and_visibility():
    vis = np.zeros(1000, bool)
    vis[[0, 5, 300, 480, 700, 999]] = True
    seq = Sequence("s", ["f"] * 1000, np.ones((1000, 4)), vis)
    ds = PairDataset([[seq]], max_gap=200)
    rng = np.random.default_rng(0)
    pairs = {ds.sample_frames(seq, rng) for _ in range(500)}
    assert pairs == {(0, 5), (300, 480)}  # 5→300, 480→700 and 700→999 are more than 200 apart
    lonely = Sequence("l", ["f"] * 3, np.ones((3, 4)), [True, False, False])
    assert ds.sample_frames(lonely, rng) is None


def test_pair_dataset_items(got10k_root, lasot_root):
    ds = PairDataset([Got10k(got10k_root, "train"), LaSOT(lasot_root, "train")], [1, 1], pairs_per_epoch=6, seed=5)
    item = ds[0]
    assert item["template"].shape == (3, 128, 128) and item["search"].shape == (3, 256, 256)
    box = item["search_box"]
    centre = (box[:2] + box[2:]) / 2
    assert ((centre >= 0) & (centre < 1)).all() and (box[2:] > box[:2]).all()
    assert torch.equal(ds[3]["search"], ds[3]["search"])  # deterministic per (seed, epoch, index)
    ds.set_epoch(1)
    assert not torch.equal(ds[0]["search"], item["search"])
    with pytest.raises(ValueError, match="ratios"):
        PairDataset([Got10k(got10k_root, "train")], [1, 2])
