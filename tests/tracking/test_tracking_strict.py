"""Strict inputs: result files that no tracker could have produced stop run/evaluate with their file and line, and a
tracking run that fails before its first step leaves no output folder."""

import os
import re

import numpy as np
import pytest

from visionssm.tracking import trainer as train_module
from visionssm.tracking.config import load_config
from visionssm.tracking.data.synthetic import make_got10k, make_lasot
from visionssm.tracking.evaluate import evaluate
from visionssm.tracking.results import check_boxes, read_result_boxes, read_result_times
from visionssm.tracking.run import result_paths, run, track_sequence
from visionssm.tracking.tracker import FirstBoxTracker


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)
    return str(path)


GOOD = "1,2,3,4\n5.5,6,0,8\n9\t10\t11\t12\n"


@pytest.mark.parametrize(("text", "message"), [
    ("1,2,3,4\n5,6,nan,8\n9,10,11,12\n", r"result\.txt:2: NaN or infinite"),
    ("1,2,3,4\n5,6,7,8\ninf,10,11,12\n", r"result\.txt:3: NaN or infinite"),
    ("1,2,3,4\n5,6,-7,8\n9,10,11,12\n", r"result\.txt:2: negative width or height"),
    ("1,2,3,4\n5,6,7\n9,10,11,12\n", r"result\.txt:2: expected 4 numbers"),
    ("1,2,3,4\n5,6,seven,8\n9,10,11,12\n", r"result\.txt:2: expected 4 numbers"),
    ("1,2,3,4\n\n9,10,11,12\n", r"result\.txt:2: empty line"),
    ("1,2,3,4\n5,6,7,8\n", r"result\.txt: 2 lines for a sequence of 3 frames"),
    ("1,2,3,4\n5,6,7,8\n9,10,11,12\n13,14,15,16\n", r"result\.txt:4: more lines than the sequence's 3 frames"),
])
def test_bad_result_lines_are_named(tmp_path, text, message):
    path = _write(tmp_path / "result.txt", text)
    with pytest.raises(ValueError, match=message):
        read_result_boxes(path, 3)


def test_good_results_and_pytrackings_cut_of_longer_lasot_results(tmp_path):
    path = _write(tmp_path / "result.txt", GOOD)
    np.testing.assert_array_equal(read_result_boxes(path, 3), [[1, 2, 3, 4], [5.5, 6, 0, 8], [9, 10, 11, 12]])
    np.testing.assert_array_equal(read_result_boxes(path, 2, allow_longer=True), [[1, 2, 3, 4], [5.5, 6, 0, 8]])
    times = _write(tmp_path / "time.txt", "0.1\n0.2\n-0.3\n")
    with pytest.raises(ValueError, match=r"time\.txt:3: negative time"):
        read_result_times(times, 3)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        read_result_boxes(str(tmp_path / "missing.txt"), 3)
    with pytest.raises(ValueError, match="frame 2 has the invalid box"):
        check_boxes(np.array([[1.0, 2, 3, 4], [1, 2, np.nan, 4]]), "T on seq")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    base = tmp_path_factory.mktemp("strict")
    got = make_got10k(str(base / "got10k"), {"train": 2, "val": 2}, num_frames=(6, 8), image_size=(64, 48), seed=3)
    lasot = make_lasot(str(base / "lasot"), ("cube",), per_category=1, test_per_category=1, num_frames=(6, 8),
                       image_size=(64, 48), seed=3)
    return base, got, lasot


def _corrupt(path: str, line_no: int, text: str) -> None:
    with open(path) as f:
        lines = f.read().splitlines()
    lines[line_no - 1] = text
    _write(path, "\n".join(lines) + "\n")


def test_evaluate_names_the_file_and_line_of_an_invalid_result(data, tmp_path):
    _, got, lasot = data
    results = str(tmp_path / "results")
    run("got10k", got, "val", "fb", results, baseline="first-box", progress=False)
    box_file = result_paths(results, "got10k", "fb", "GOT-10k_Val_000002")[0]
    _corrupt(box_file, 3, "nan,1,2,3")
    with pytest.raises(ValueError, match=rf"{re.escape(box_file)}:3: NaN or infinite"):
        evaluate("got10k", got, "val", results, ["fb"], str(tmp_path / "reports"), plots=False)
    _corrupt(box_file, 3, "1,1,-2,3")
    with pytest.raises(ValueError, match=rf"{re.escape(box_file)}:3: negative width"):
        evaluate("got10k", got, "val", results, ["fb"], str(tmp_path / "reports"), plots=False)
    # a result cut short by a crash: evaluate names it, and run refuses to keep it unless told to overwrite
    with open(box_file) as f:
        _write(box_file, "".join(f.readlines()[:-2]))
    with pytest.raises(ValueError, match=rf"{re.escape(box_file)}: \d+ lines for a sequence of \d+ frames"):
        evaluate("got10k", got, "val", results, ["fb"], str(tmp_path / "reports"), plots=False)
    with pytest.raises(ValueError, match="--overwrite"):
        run("got10k", got, "val", "fb", results, baseline="first-box", progress=False)
    run("got10k", got, "val", "fb", results, baseline="first-box", overwrite=True, progress=False)
    assert evaluate("got10k", got, "val", results, ["fb"], str(tmp_path / "reports"), plots=False)

    run("lasot", lasot, "test", "fb", results, baseline="first-box", progress=False)
    lasot_file = result_paths(results, "lasot", "fb", "cube-1")[0]
    _corrupt(lasot_file, 2, "1,2,3")
    with pytest.raises(ValueError, match=rf"{re.escape(lasot_file)}:2: expected 4 numbers"):
        evaluate("lasot", lasot, "test", results, ["fb"], str(tmp_path / "reports"), plots=False)


def test_run_refuses_a_sequence_whose_first_box_is_invalid(data):
    _, got, _ = data
    from visionssm.tracking.data.got10k import Got10k

    seq = Got10k(got, "val")[0]
    seq.boxes[0, 2] = np.nan
    with pytest.raises(ValueError, match=r"groundtruth\.txt:1: the first frame's box"):
        track_sequence(FirstBoxTracker(), seq)


CONFIG = "configs/tracking/smoke_synthetic.yaml"  # shipped with the package: found from any directory


def test_a_failed_start_leaves_no_output_folder(data, tmp_path, monkeypatch):
    _, got, _ = data
    out = tmp_path / "never"
    with pytest.raises(FileNotFoundError, match="list.txt"):
        missing_data = [f"output_dir={out}", f"data.train=[{{type: got10k, root: {tmp_path}}}]"]
        train_module.train(load_config(CONFIG, missing_data), progress=False)
    assert not out.exists()

    def failing_loss(*args, **kwargs):
        raise RuntimeError("the first step fails")

    monkeypatch.setattr(train_module, "tracking_loss", failing_loss)
    overrides = [f"output_dir={out}", f"data.train=[{{type: got10k, root: {got}}}]", "data.pairs_per_epoch=4"]
    with pytest.raises(RuntimeError, match="the first step fails"):
        train_module.train(load_config(CONFIG, overrides), progress=False)
    assert not out.exists()
    # a folder the user made is never removed
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="the first step fails"):
        train_module.train(load_config(CONFIG, overrides), progress=False)
    assert (out / "notes.txt").read_text() == "mine"
    assert os.path.exists(out / "config.yaml")


def test_switches_take_only_true_or_false():
    assert load_config(CONFIG, ["train.deterministic=true"])["train"]["deterministic"] is True
    assert load_config(CONFIG)["train"]["deterministic"] is False
    for text in ("sometimes", "1"):
        with pytest.raises(TypeError, match="train.deterministic"):
            load_config(CONFIG, [f"train.deterministic={text}"])


def test_a_bare_no_on_the_command_line_means_no_mixed_precision():
    assert load_config(CONFIG, ["train.mixed_precision=no"])["train"]["mixed_precision"] == "no"
    with pytest.raises(ValueError, match="train.mixed_precision"):
        load_config(CONFIG, ["train.mixed_precision=fp8"])


def test_compile_is_off_on_or_a_mode():
    assert load_config(CONFIG)["train"]["compile"] is None
    assert load_config(CONFIG, ["train.compile=true"])["train"]["compile"] is True
    assert load_config(CONFIG, ["train.compile=reduce-overhead"])["train"]["compile"] == "reduce-overhead"
    assert load_config(CONFIG, ["train.compile=false"])["train"]["compile"] is False
    for text in ("fastest", "1", "[max-autotune]"):
        with pytest.raises(ValueError, match="train.compile must be .*max-autotune"):
            load_config(CONFIG, [f"train.compile={text}"])


def test_compile_runs_the_tracker_compiled_in_place(data, tmp_path, monkeypatch):
    """On a backend that counts dynamo's graphs and runs them as traced (Inductor would compile C++ for minutes)."""
    import torch

    _, got, _ = data
    modes, graphs = [], []
    real_compile = torch.nn.Module.compile

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def compile_counting(module, *args, mode=None, **kwargs):
        modes.append(mode)
        real_compile(module, backend=counting_backend)

    monkeypatch.setattr(torch.nn.Module, "compile", compile_counting)
    out = tmp_path / "compiled"
    overrides = [f"output_dir={out}", f"data.train=[{{type: got10k, root: {got}}}]", "data.pairs_per_epoch=4",
                 "train.epochs=1", "train.compile=max-autotune"]
    try:
        train_module.train(load_config(CONFIG, overrides), progress=False)
    finally:
        torch._dynamo.reset()  # the counting backend's code caches stay out of the tests after this one
    assert modes == ["max-autotune"] and graphs, "the training step ran through torch.compile"
    # in place: final.pth holds the plain tracker's keys, as an eager run's
    keys = torch.load(out / "final.pth", weights_only=False)["model"].keys()
    assert keys and not [k for k in keys if k.startswith(("_orig_mod.", "module."))]
