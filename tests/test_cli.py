"""Every command line as a user meets it: a mistake in the arguments, config or files is one line
``prog: error: <message>`` on stderr and exit status 2, with no traceback and nothing written; plus the defaults
that depend on the machine (benchmark dtype, loader workers), ``--help`` texts and the learning-rate peak of a
shortened recipe."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from visionssm.benchmark import cli as bench_cli
from visionssm.benchmark.report import numerics
from visionssm.data import synthetic as image_synthetic
from visionssm.tracking import evaluate as tracking_evaluate
from visionssm.tracking import run as tracking_run
from visionssm.tracking import train as tracking_train
from visionssm.tracking.data import synthetic as video_synthetic
from visionssm.training.setup import build_scheduler, check_config
from visionssm.training.state import DEFAULT_CONFIG, key_docs, parse_config
from visionssm.utils import cli

ROOT = Path(__file__).resolve().parents[1]


def _call(main, argv) -> int:
    """``main(argv)``'s exit status, whether returned or raised (argparse exits)."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def _train_main(argv):
    from visionssm.train import main

    return main(argv)


# (main, argv, what the message must name); files the case needs are made by _prepare
USER_ERRORS = [
    (_train_main, ["--model", "nosuch_model"], "--model 'nosuch_model'"),
    (_train_main, ["--model", "gka_vision_t"], "did you mean gka_vision_T"),
    (_train_main, ["--config", "nosuch_recipe"], "--config"),
    (_train_main, ["--config", "typo.yaml"], "learning_rat"),
    (_train_main, ["--batch-sise", "3"], "did you mean --batch-size"),
    (_train_main, ["--epochs", "two"], "--epochs"),
    (_train_main, ["--epochs", "0"], "--epochs"),
    (_train_main, ["--data-dir", "no_such_dir"], "--data-dir"),
    (_train_main, ["--eval-only", "--checkpoint", "junk.pth"], "junk.pth"),
    (_train_main, ["--eval-only", "--checkpoint", "missing.pth"], "missing.pth"),
    (_train_main, ["--model-kwargs", "{dimz: 3}"], "--model-kwargs"),
    (_train_main, ["--opt", "adamx"], "--opt"),
    (_train_main, ["--sched", "cosin"], "--sched"),
    (_train_main, ["--resume", "latest"], "--resume"),
    (_train_main, ["--compile", "fastest"], "--compile must be"),
    (bench_cli.main, ["nosuch_model", "--device", "cpu"], "nosuch_model"),
    (bench_cli.main, ["test_resnet", "--device", "cpu", "--dtype", "fp8"], "dtype"),
    (bench_cli.main, ["kernels", "--opss", "gka"], "did you mean --ops"),
    (tracking_train.main, ["--config", "nosuch_recipe"], "--config"),
    (tracking_train.main, ["--config", "smoke_synthetic", "--set", "train.epoch=3"], "did you mean train.epochs"),
    (tracking_train.main, ["--config", "smoke_synthetic", "--set", "data.train.3.root=x"], "data.train.3"),
    (tracking_train.main, ["--config", "smoke_synthetic", "--set", "data.train.0.root=no_such_dir"], "no_such_dir"),
    (tracking_run.main, ["--dataset", "got10k", "--root", "no_such_dir", "--split", "val", "--baseline", "first-box",
                         "--name", "t"], "no_such_dir"),
    (tracking_run.main, ["--dataset", "got10k", "--root", "videos", "--split", "val", "--checkpoint", "junk.pth",
                         "--name", "t"], "junk.pth"),
    (tracking_evaluate.main, ["--dataset", "lasot", "--root", "no_such_dir", "--trackers", "t"], "no_such_dir"),
    (video_synthetic.main, ["got10k", "out", "--frames", "9", "3"], "--frames"),
    (image_synthetic.main, ["--out", "out", "--classes", "1"], "classes"),
]


def _prepare(tmp_path: Path) -> set[str]:
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint at all")
    (tmp_path / "typo.yaml").write_text("model: resnet10t\nlearning_rat: 0.1\n")
    video_synthetic.make_got10k(str(tmp_path / "videos"), {"val": 1}, num_frames=3, image_size=(32, 32))
    return set(os.listdir(tmp_path))


@pytest.mark.parametrize(("main", "argv", "named"), USER_ERRORS,
                         ids=[f"{m.__module__.split('.')[-1]}:{' '.join(a)[:40]}" for m, a, _ in USER_ERRORS])
def test_user_errors_are_one_line_exit_2_and_write_nothing(main, argv, named, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    before = _prepare(tmp_path)
    capsys.readouterr()
    assert _call(main, argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert ": error: " in lines[0] and named in lines[0], err
    assert "Traceback" not in err
    assert set(os.listdir(tmp_path)) == before, "a stopped command must not write into the working directory"


def test_the_installed_command_prints_one_line_and_no_traceback(tmp_path):
    """The whole path, interpreter start to exit status, once (the checkout's script = visionssm-train)."""
    proc = subprocess.run([sys.executable, str(ROOT / "train_imagenet.py"), "--model", "nosuch_model"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "visionssm-train: error: --model 'nosuch_model' is not a timm or visionssm model (timm.list_models() lists "
        "them)"]
    assert os.listdir(tmp_path) == []


def test_unexpected_exceptions_keep_their_traceback():
    def broken(argv):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        cli.run_main(broken, [], prog="p")
    assert cli.run_main(lambda argv: None, [], prog="p") == 0


def test_user_errors_are_also_the_builtin_exceptions_callers_catch():
    assert isinstance(cli.UserFileError("x"), FileNotFoundError)
    assert isinstance(cli.UserKeyError("x"), KeyError) and str(cli.UserKeyError("a  b\n c")) == "a b c"
    with pytest.raises(FileNotFoundError, match="nosuch"):
        parse_config(["--config", "nosuch"])


# ---------------------------------------------------------------------------------------------------------------
# Defaults that depend on the machine


def test_benchmark_runs_fp32_on_cpu_and_bf16_autocast_on_gpu_and_says_which():
    parser = bench_cli.build_parser()
    on_cpu = bench_cli._config_from_args(parser.parse_args(["test_resnet", "--device", "cpu"]))
    assert on_cpu.dtype == "float32"
    assert bench_cli._config_from_args(parser.parse_args(["test_resnet", "--device", "cpu", "--dtype", "bf16"])
                                       ).dtype == "bf16"
    if torch.cuda.is_available():
        assert bench_cli._config_from_args(parser.parse_args(["test_resnet"])).dtype == "bfloat16"
    assert numerics({"dtype": "float32", "precision": "amp"}) == "float32"  # amp at fp32 runs no autocast
    assert numerics({"dtype": "bfloat16", "precision": "amp"}) == "bfloat16 autocast"
    assert numerics({"dtype": "float16", "precision": "pure"}) == "float16 weights and inputs"


def test_loader_workers_are_capped_at_the_cpus_with_one_note(monkeypatch):
    monkeypatch.setattr(cli, "usable_cpus", lambda: 2)
    notes = []
    assert cli.cap_workers(8, "workers-test", notes.append) == 2
    assert cli.cap_workers(8, "workers-test", notes.append) == 2
    assert cli.cap_workers(1, "workers-test", notes.append) == 1
    assert notes == ["note: workers-test 8 -> 2 (this machine has 2 usable CPU(s))"]
    cfg = parse_config(["--config", "mamba_vision_T", "--data-dir", str(ROOT), "--train-split", "configs",
                        "--val-split", "configs", "--model-kwargs", "{dims: 8, depths: [1, 1, 1, 1]}"])
    assert cfg["workers"] == 8
    check_config(cfg, say=None)
    assert cfg["workers"] == 2


# ---------------------------------------------------------------------------------------------------------------
# Help and the schedule


def test_every_training_flag_has_a_one_line_description_in_a_group(capsys):
    helps, groups = key_docs(DEFAULT_CONFIG)
    import yaml

    keys = yaml.safe_load(Path(DEFAULT_CONFIG).read_text())
    assert set(helps) == set(keys)
    assert [k for k in keys if len(helps[k]) < 10] == []
    assert [k for k in keys if groups[k] == "settings"] == []
    with pytest.raises(SystemExit):
        parse_config(["--help"], prog="visionssm-train")
    out = capsys.readouterr().out
    for heading in ("model:", "data:", "schedule", "output, checkpoints, logging:"):
        assert heading in out
    assert "stochastic depth rate" in out and "(default: null)" in out


def test_compile_is_off_on_or_a_mode_and_a_bare_flag_means_on(tmp_path):
    assert parse_config([])["compile"] is None
    assert parse_config(["--compile"])["compile"] is True
    assert parse_config(["--compile", "reduce-overhead"])["compile"] == "reduce-overhead"
    assert parse_config(["--compile", "--epochs", "2"])["compile"] is True
    assert parse_config(["--compile", "false"])["compile"] is False
    modes = [cli.compile_mode(value, "compile") for value in (None, False, True, "max-autotune")]
    assert modes == [None, None, "default", "max-autotune"]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("compile: fastest\n")
    for argv in (["--compile", "fastest"], ["--config", str(recipe)], ["--compile", "[1]"]):
        with pytest.raises(cli.UserValueError, match="--compile must be .*reduce-overhead"):
            parse_config(argv)


def _imported(importtime_log: str) -> set[str]:
    return {line.rsplit("|", 1)[-1].strip() for line in importtime_log.splitlines() if line.startswith("import time:")}


HEAVY = ("torch", "timm", "accelerate", "triton", "torchvision", "albumentations")


def _scripts_in_pyproject() -> dict[str, str]:
    """pyproject.toml's ``[project.scripts]``: console script -> module (of ``module:main``)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert all(target.endswith(":main") for target in scripts.values()), scripts
    return {name: target.split(":")[0] for name, target in scripts.items()}


def test_the_command_list_names_every_console_script():
    """visionssm.COMMANDS is the package's one list of commands (a process started as one skips the model import)."""
    import visionssm

    assert {script: module for module, script in visionssm.COMMANDS.items() if script} == _scripts_in_pyproject()
    for module in visionssm.COMMANDS:
        assert importlib.util.find_spec(module) is not None, module


def _command_lines() -> list[tuple[str, list[str]]]:
    """Every command as ``python -m MODULE`` and, where this environment installed it, as its console script."""
    import visionssm

    lines = [(module, [sys.executable, "-X", "importtime", "-m", module]) for module in visionssm.COMMANDS]
    lines.append(("visionssm.benchmark kernels", [sys.executable, "-X", "importtime", "-m", "visionssm.benchmark",
                                                  "kernels"]))
    for script in visionssm.COMMANDS.values():
        path = Path(sys.executable).with_name(script) if script else None
        if path is not None and path.is_file():
            lines.append((script, [sys.executable, "-X", "importtime", str(path)]))
    for name, module in visionssm.CHECKOUT_SCRIPTS.items():
        assert module in visionssm.COMMANDS and (ROOT / name).is_file(), name
        lines.append((name, [sys.executable, "-X", "importtime", str(ROOT / name)]))
    return lines


@pytest.mark.parametrize(("name", "command"), _command_lines(), ids=[name for name, _ in _command_lines()])
def test_help_and_a_mistyped_flag_answer_without_importing_torch(name, command, tmp_path):
    """Every ``--help`` used to load torch, timm and every model first (4-15 s); now the commands parse first."""
    cases = [(["--help"], 0), (["--no-such-flag"], 2)]
    if name in ("visionssm.train", "visionssm-train", "train_imagenet.py"):
        cases.append((["--compile", "fastest"], 2))  # a bad value of a known flag
    for argv, status in cases:
        proc = subprocess.run([*command, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == status, proc.stderr[-2000:]
        heavy = sorted(m for m in _imported(proc.stderr) if m.split(".")[0] in HEAVY)
        assert heavy == [], f"{name} {' '.join(argv)} imported {heavy[:5]}"
        messages = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
        if status == 0:
            assert proc.stdout.startswith("usage: ") and "--help" in proc.stdout and messages == [], proc.stderr
        else:
            assert proc.stdout == "" and len(messages) == 1 and ": error: " in messages[0], proc.stderr
            assert "Traceback" not in proc.stderr
        assert os.listdir(tmp_path) == []


def test_outside_a_command_import_visionssm_still_registers_the_models(tmp_path):
    code = "import visionssm, timm; print(timm.is_model('gka_vision_T'))"
    mine = tmp_path / "train_imagenet.py"  # a user's script that shares a checkout script's name
    mine.write_text(code + "\n")
    for command in ([sys.executable, "-c", code], [sys.executable, str(mine)]):
        proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.stdout.strip() == "True", proc.stderr[-2000:]


def test_a_spawned_child_of_a_command_imports_the_models(tmp_path):
    """A multiprocessing spawn child (the benchmark's data-parallel workers) carries its parent's sys.argv but runs
    no parser: it must get the models registered, while the command itself skipped them."""
    script = tmp_path / "visionssm-benchmark"  # started as the console script's name
    script.write_text(
        "import multiprocessing\n"
        "def registered(queue):\n"
        "    import timm, visionssm\n"
        "    queue.put(timm.is_model('gka_vision_T'))\n"
        "if __name__ == '__main__':\n"
        "    import sys, visionssm\n"
        "    print('command', 'visionssm.models' in sys.modules)\n"
        "    context = multiprocessing.get_context('spawn')\n"
        "    queue = context.Queue()\n"
        "    child = context.Process(target=registered, args=(queue,))\n"
        "    child.start()\n"
        "    print('child', queue.get(timeout=240))\n"
        "    child.join()\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.stdout.split() == ["command", "False", "child", "True"], proc.stdout + proc.stderr[-2000:]


def test_a_command_module_keeps_its_work_modules_names():
    """The tracking commands hold only their parsers; ``from visionssm.tracking.run import run`` still works."""
    from visionssm.tracking import evaluation, runner, trainer

    assert tracking_train.train is trainer.train and tracking_run.run is runner.run
    assert tracking_evaluate.format_report is evaluation.format_report
    with pytest.raises(AttributeError, match="visionssm.tracking.run' has no attribute 'nosuch'"):
        tracking_run.nosuch  # noqa: B018


def test_a_shortened_recipe_peaks_at_its_learning_rate():
    """--epochs 5 of the 320-epoch MambaVision recipe: the 2-epoch warmup inside a 4-epoch cosine would end at half
    the lr, so the warmup is prepended and the run reaches the lr it prints."""
    cfg = parse_config(["--config", "mamba_vision_T", "--epochs", "5", "--lr", "0.1"])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    notes = []
    updates = 4
    scheduler = build_scheduler(cfg, optimizer, updates_per_epoch=updates, say=notes.append)
    applied = [optimizer.param_groups[0]["lr"]]
    for update in range(1, 5 * updates + 1):
        scheduler.step_update(num_updates=update)
        applied.append(optimizer.param_groups[0]["lr"])
    assert max(applied) == pytest.approx(0.1)
    assert applied[2 * updates] == pytest.approx(0.1), "the epoch-2 record (end of warmup) shows the peak"
    assert any("warmup_prefix false -> true" in note for note in notes)
    full = parse_config(["--config", "mamba_vision_T", "--lr", "0.1"])
    notes.clear()
    build_scheduler(full, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), 1, notes.append)
    assert notes == [], "the recipe as written keeps upstream's warmup inside the cosine"
