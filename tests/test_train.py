"""The ImageNet trainer (visionssm.train, through the checkout's train_imagenet.py) end to end on a tiny generated
ImageFolder (CPU), plus its config, schedule, data and checkpoint parts.

The runs are subprocesses (accelerate keeps process-wide state): a 3-epoch run with persistent loader workers, the
same run resumed from its first epoch's checkpoint (which must reproduce the uninterrupted run's metrics and weights
exactly), a run SIGKILLed while writing a mid-epoch checkpoint and then resumed (likewise), a 2-process run with
``accelerate launch`` and ``--eval-only`` against its metrics, and a missing split.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from visionssm.data.loader import SafeImageFolder, build_split, collate_skipping
from visionssm.data.synthetic import SyntheticSpec, ensure_synthetic_dataset
from visionssm.training.setup import build_scheduler, fit_schedule
from visionssm.training.state import (
    CheckpointManager,
    TrainState,
    deterministic_algorithms,
    parse_config,
    scaled_lr,
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "train_imagenet.py"
CONFIGS = ROOT / "configs" / "imagenet"

# 3 classes x 16 training images (one of them corrupt) = 6 batches of 8; 3 x 4 validation images + 1 corrupt.
# One loader worker: persistent workers create their iterators once per process, which a resumed run must not
# let shift its random streams (a run without workers cannot show that).
TINY_MODEL = ["--model", "mamba_vision_T", "--model-kwargs",
              "{dims: 8, depths: [1, 1, 1, 1], stem_dim: 8, num_heads: [1, 1, 2, 2], window_size: [8, 8, 2, 2]}"]
TINY_RUN = [*TINY_MODEL, "--img-size", "16", "--batch-size", "8", "--workers", "1", "--epochs", "3",
            "--warmup-epochs", "0", "--lr", "1e-3", "--seed", "1", "--checkpoint-every-steps", "2", "--keep-last", "2",
            "--aa", "rand-m9-mstd0.5-inc1", "--mixup", "0.8", "--cutmix", "1.0", "--reprob", "0.25",
            "--model-ema-decay", "0.9", "--log-interval", "1",
            # equal to the last bit on a GPU too, where these runs go when the machine has one
            "--deterministic"]
UPDATES_PER_EPOCH = 6
METRIC_KEYS = {"epoch", "train_loss", "val_top1", "val_top5", "ema_val_top1", "ema_val_top5", "lr",
               "train_img_per_s", "train_data_wait_s", "epoch_seconds", "peak_memory_mib", "skipped_images",
               "global_update"}


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("VISIONSSM_KERNELS", "torch")
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
    return env


def _run(args, cwd, timeout=240, launcher=None, env=None) -> subprocess.CompletedProcess:
    cmd = (launcher or [sys.executable]) + [str(SCRIPT), *args]
    proc = subprocess.run(cmd, cwd=cwd, env={**_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")
    return proc


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    root = ensure_synthetic_dataset(tmp_path_factory.mktemp("data") / "tiny",
                                    SyntheticSpec(classes=3, train_per_class=16, val_per_class=4, image_size=16),
                                    workers=1, verbose=False)
    (root / "train" / "00_disc" / "000000.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    (root / "val" / "01_square" / "broken.png").write_bytes(b"")
    return root


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The uninterrupted reference run, keeping every checkpoint (pruning has its own test)."""
    out = tmp_path_factory.mktemp("runs") / "reference"
    proc = _run(["--data-dir", str(tiny_data), "--output", str(out), *TINY_RUN, "--keep-last", "20"], cwd=out.parent)
    return out, proc


# ---------------------------------------------------------------------------------------------------------------
# Configuration


def test_command_line_overrides_every_key_with_typed_values():
    cfg = parse_config(["--lr", "5e-4", "--epochs", "3", "--amp", "bf16", "--no-model-ema", "--img-size", "null",
                        "--scale", "[0.5, 1.0]", "--model", "resnet10t", "--workers", "1", "--seed", "7",
                        "--batch-size", "16"])
    assert cfg["lr"] == 5e-4 and cfg["epochs"] == 3 and cfg["amp"] == "bf16" and cfg["model_ema"] is False
    assert cfg["img_size"] is None and cfg["scale"] == [0.5, 1.0] and cfg["batch_size"] == 16
    assert cfg["model_kwargs"] == {}, "a new --model must not inherit the default model's kwargs"
    assert parse_config([])["model_kwargs"], "the embedded default shrinks its model through model_kwargs"
    assert parse_config(["--resume"])["resume"] == "latest"
    with pytest.raises(SystemExit):
        parse_config(["--epochs", "two"])
    with pytest.raises(ValueError, match="amp"):
        parse_config(["--amp", "fp8"])


def test_recipes_parse_and_name_registered_models(tmp_path):
    import timm

    import visionssm.models  # noqa: F401

    expected = {"mamba_vision_T", "mamba_vision_T2", "mamba_vision_S", "mamba_vision_B", "mamba_vision_L",
                "mamba_vision_L2", "gka_vision_T", "comba_vision_T", "comba_vision_S"}
    assert expected <= {p.stem for p in CONFIGS.glob("*.yaml")}
    for name in expected:
        cfg = parse_config(["--config", str(CONFIGS / f"{name}.yaml")])
        assert cfg["model"] == name and timm.is_model(name)
        assert cfg["model_kwargs"] == {} and cfg["img_size"] == 224
    mv = parse_config(["--config", str(CONFIGS / "mamba_vision_T.yaml")])
    assert (mv["opt"], mv["lr_base"], mv["lr_base_size"], mv["epochs"], mv["cooldown_epochs"]) == ("lamb", 5e-3,
                                                                                                   4096, 320, 10)
    # the shipped recipes are found by name from any directory; a file of the user's own still works
    for name in ("mamba_vision_T", "mamba_vision_T.yaml", "imagenet/mamba_vision_T.yaml",
                 "configs/imagenet/mamba_vision_T.yaml"):
        assert parse_config(["--config", name]) == dict(mv, config=name)
    with pytest.raises(FileNotFoundError, match="mamba_vision_T"):
        parse_config(["--config", "mamba_vision_X"])
    assert (mv["model_ema_decay"], mv["clip_grad"], mv["mixup"], mv["cutmix"]) == (0.9998, 5.0, 0.8, 1.0)
    assert parse_config(["--config", str(CONFIGS / "mamba_vision_L.yaml")])["weight_decay"] == 0.12
    gka = parse_config(["--config", str(CONFIGS / "gka_vision_T.yaml")])
    assert (gka["opt"], gka["lr_base"], gka["weight_decay"]) == ("adamw", 5e-4, 0.05)
    assert scaled_lr(5e-4, 512, 1024, "linear") == pytest.approx(1e-3)
    assert scaled_lr(5e-3, 4096, 1024, "sqrt") == pytest.approx(2.5e-3)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: resnet10t\nlearning_rate: 0.1\n")
    with pytest.raises(ValueError, match="learning_rate"):
        parse_config(["--config", str(bad)])


@pytest.mark.parametrize(("epochs", "warmup", "cooldown", "prefix", "fitted"), [
    (1, 20, 10, False, (0, 0)),  # a 320-epoch recipe run for one epoch: one epoch, the lr decaying in it
    (5, 20, 10, False, (2, 1)),
    (5, 20, 10, True, (2, 1)),
    (320, 20, 10, False, (20, 10)),  # the recipe as written
    (10, 1, 0, True, (1, 0)),
])
def test_epochs_is_the_whole_run(epochs, warmup, cooldown, prefix, fitted):
    """--epochs N runs N epochs: timm adds the cooldown (and a prefixed warmup) to its cycle, so the trainer gives it
    what is left, shrinking warmup and cooldown when they do not fit, with a note."""
    assert fit_schedule(epochs, warmup, cooldown)[:2] == fitted
    cfg = parse_config(["--epochs", str(epochs), "--warmup-epochs", str(warmup), "--cooldown-epochs", str(cooldown),
                        "--warmup-prefix" if prefix else "--no-warmup-prefix", "--lr", "0.1", "--min-lr", "0.001"])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    notes = []
    updates = 3
    scheduler = build_scheduler(cfg, optimizer, updates_per_epoch=updates, say=notes.append)
    assert bool(notes) == (fitted != (warmup, cooldown))
    lrs = []
    for update in range(1, epochs * updates + 1):
        scheduler.step_update(num_updates=update)
        lrs.append(optimizer.param_groups[0]["lr"])
    peak = lrs.index(max(lrs))
    assert peak <= max(fitted[0] * updates, 1), "the lr rises no longer than the fitted warmup"
    assert lrs[-1] == pytest.approx(0.001), "and reaches min_lr by the last update of the run"
    with pytest.raises(ValueError, match="epochs"):
        fit_schedule(0, 1, 0)


# ---------------------------------------------------------------------------------------------------------------
# Data


def test_unreadable_images_are_skipped_and_counted(tiny_data):
    train = SafeImageFolder(tiny_data / "train", on_error="replace")
    broken = [i for i, (path, _) in enumerate(train.samples) if path.endswith("00_disc/000000.png")]
    assert len(broken) == 1
    with pytest.warns(RuntimeWarning, match="skipping unreadable image"):
        image, target, unreadable = train[broken[0]]
    assert unreadable == 1 and image is not None and target == train.samples[broken[0] + 1][1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning is given once per file
        assert train[broken[0]][2] == 1

    val = SafeImageFolder(tiny_data / "val", on_error="drop", class_to_idx=train.class_to_idx)
    with pytest.warns(RuntimeWarning, match="skipping unreadable image"):
        items = [val[i] for i in range(len(val))]
    images, targets, unreadable = collate_skipping(
        [(torch.zeros(1) if img is not None else None, t, n) for img, t, n in items])
    assert int(unreadable) == 1 and len(targets) == len(val) - 1 == 12


def test_persistent_workers_draw_each_epochs_augmentation_from_the_epoch_tag(tiny_data):
    """train_imagenet.py keeps its loader workers across epochs; the sampler's (epoch, index) tags must give every
    epoch exactly the batches a fresh single-process loader gives after ``set_epoch``."""
    from timm.data import create_transform
    from torch.utils.data import DataLoader

    from visionssm.data.loader import EpochShuffleSampler

    transform = create_transform(16, is_training=True, auto_augment="rand-m9-mstd0.5", re_prob=0.25)

    def loader(tagged: bool, workers: int):
        dataset = SafeImageFolder(tiny_data / "train", transform=transform, augment_seed=3)
        sampler = EpochShuffleSampler(len(dataset), seed=5, tag_epoch=tagged)
        dl = DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=workers, collate_fn=collate_skipping,
                        persistent_workers=workers > 0)
        return dataset, sampler, dl

    def epoch_batches(dataset, sampler, dl, epoch):
        sampler.set_epoch(epoch)
        dataset.set_epoch(epoch)
        return [images for images, _, _ in dl]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the corrupt file in tiny_data
        persistent = loader(tagged=True, workers=1)
        fresh = loader(tagged=False, workers=0)
        seen = []
        for epoch in (0, 1):
            got, expected = epoch_batches(*persistent, epoch), epoch_batches(*fresh, epoch)
            assert len(got) == len(expected) == 6
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            seen.append(torch.cat(got))
    assert not torch.equal(seen[0], seen[1]), "each epoch draws new augmentations"


def test_randaugment_posterize_at_full_magnitude_runs():
    """timm's inc1 policies ask Pillow for 0-bit posterize at magnitude 10, which current Pillow rejects."""
    from PIL import Image
    from timm.data.auto_augment import AugmentOp

    from visionssm.data.loader import patch_timm_posterize

    patch_timm_posterize()
    op = AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10, hparams={"magnitude_std": 0})
    assert op(Image.new("RGB", (8, 8), (200, 100, 50))).getpixel((0, 0)) == (0, 0, 0)


def test_missing_or_empty_split_is_a_clear_error(tmp_path, tiny_data):
    with pytest.raises(FileNotFoundError, match="split 'validation' not found"):
        build_split(tiny_data, "validation", None, "drop")
    (tmp_path / "train" / "cls").mkdir(parents=True)
    (tmp_path / "train" / "cls" / "notes.txt").write_text("no images here")
    with pytest.raises(FileNotFoundError, match="split 'train' at .* is empty"):
        build_split(tmp_path, "train", None, "replace")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_split(tmp_path / "nowhere", "train", None, "replace")


def test_missing_split_stops_the_trainer_with_the_message(tmp_path, tiny_data, capsys):
    """In process (the trainer stops before any work: its checks come first)."""
    from visionssm.train import main

    data = tmp_path / "data"
    shutil.copytree(tiny_data / "train", data / "train")
    assert main(["--data-dir", str(data), "--output", str(tmp_path / "o"), *TINY_MODEL, "--workers", "0"]) == 2
    assert "visionssm-train: error: --data-dir: split 'val' not found" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------------------------
# Training runs


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# Everything a record holds that training decides (timings and memory are left out).
TRAINED_KEYS = ("epoch", "global_update", "train_loss", "val_top1", "val_top5", "val_loss", "ema_val_top1",
                "ema_val_top5", "ema_val_loss", "lr", "skipped_images", "val_images")


def _assert_same_training(out: Path, reference: Path, epochs: list[int]) -> None:
    """The records of ``epochs`` and the final weights are bit-for-bit those of the reference run."""
    got = {r["epoch"]: r for r in _records(out)}
    expected = {r["epoch"]: r for r in _records(reference)}
    assert sorted(got) == epochs
    for epoch in epochs:
        assert {k: got[epoch][k] for k in TRAINED_KEYS} == {k: expected[epoch][k] for k in TRAINED_KEYS}, epoch
    last = f"epoch_{epochs[-1]:04d}"
    for name in ("model.safetensors", "custom_checkpoint_2.pkl"):  # the weights and the EMA
        load = load_file if name.endswith(".safetensors") else lambda f: torch.load(f, weights_only=True)
        final = load(str(out / "checkpoints" / last / name))
        wanted = load(str(reference / "checkpoints" / last / name))
        assert final.keys() == wanted.keys()
        for key in wanted:
            torch.testing.assert_close(final[key], wanted[key], rtol=0, atol=0, msg=f"{name}: {key}")


def test_three_epoch_run_writes_metrics_checkpoints_and_curves(trained):
    out, proc = trained
    records = _records(out)
    assert [r["epoch"] for r in records] == [1, 2, 3]
    for r in records:
        assert r.keys() >= METRIC_KEYS
        assert r["global_update"] == UPDATES_PER_EPOCH * r["epoch"]
        assert r["skipped_train_images"] == 1 and r["skipped_val_images"] == 1 and r["skipped_images"] == 2
        assert r["val_images"] == 12 and 0 <= r["val_top1"] <= r["val_top5"] <= 100
        assert r["train_img_per_s"] > 0 and r["peak_memory_mib"] > 0 and r["train_loss"] > 0
    assert records[2]["lr"] < records[1]["lr"] < records[0]["lr"], "the cosine schedule is stepped per update"
    # every 2 updates within an epoch, and at each epoch's end
    assert {p.name for p in (out / "checkpoints").iterdir()} == {
        "step_00000002", "step_00000004", "epoch_0001", "step_00000008", "step_00000010", "epoch_0002",
        "step_00000014", "step_00000016", "epoch_0003"}
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "model_best.safetensors").is_file()
    config = (out / "config.yaml").read_text()
    assert "global_batch: 8" in config and "updates_per_epoch: 6" in config and "total_epochs: 3" in config
    assert "skipping unreadable image" in proc.stderr


def test_deterministic_algorithms_switch_on_inside_and_back_after():
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)
    with deterministic_algorithms(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # strict: a nondeterministic op raises
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] in (":4096:8", ":16:8")
        with pytest.raises(RuntimeError, match="a failing run"), deterministic_algorithms(True):
            raise RuntimeError("a failing run")
        assert torch.are_deterministic_algorithms_enabled()  # the inner block restored the outer one's settings
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark) == before
    with deterministic_algorithms(False):
        assert torch.are_deterministic_algorithms_enabled() == before[0]


def test_deterministic_is_a_flag_on_the_command_line():
    assert parse_config([])["deterministic"] is False
    assert parse_config(["--deterministic"])["deterministic"] is True
    assert parse_config(["--deterministic", "--no-deterministic"])["deterministic"] is False
    with pytest.raises(SystemExit):
        parse_config(["--deterministic", "sometimes"])


def test_checkpoint_manager_keeps_the_last_k_and_the_best(tmp_path):
    class OneProcess:  # what CheckpointManager asks of accelerate
        is_main_process = True

        def wait_for_everyone(self):
            pass

        def save_state(self, path):
            Path(path).mkdir(parents=True)
            (Path(path) / "model.safetensors").write_bytes(b"weights")

    manager = CheckpointManager(OneProcess(), tmp_path, keep_last=2)
    state = TrainState()
    for update, best in ((1, False), (2, True), (3, False), (4, False), (5, False)):
        state.global_update = state.batch_in_epoch = update
        manager.save(f"step_{update:08d}", state, is_best=best)
    assert {p.name for p in (tmp_path / "checkpoints").iterdir()} == {"step_00000002", "step_00000004",
                                                                      "step_00000005"}
    assert manager.latest().name == "step_00000005"


def test_background_checkpoint_writes_the_state_of_the_save_call_and_reports_errors(tmp_path):
    """save returns before the files are written; they hold the state at the call (training goes on mutating it),
    the checkpoint appears complete or not at all, and a failed write raises at the next save."""
    weights = {"w": torch.randn(64)}

    class OneProcess:
        is_main_process = True
        fail = False

        def wait_for_everyone(self):
            pass

        def save_state(self, path):
            Path(path).mkdir(parents=True)
            torch.save(weights, Path(path) / "model.bin")  # what accelerate calls; captured as a CPU copy
            if self.fail:
                torch.save(weights, Path(path) / "missing" / "optimizer.bin")

    accelerator = OneProcess()
    manager = CheckpointManager(accelerator, tmp_path, keep_last=2, background=True)
    state = TrainState(global_update=1)
    saved = weights["w"].clone()
    manager.save("step_00000001", state)
    weights["w"].add_(1.0)  # the next training step
    state.global_update = 2
    manager.wait()
    (path, record), = CheckpointManager.complete(tmp_path / "checkpoints")
    assert path.name == "step_00000001" and record["global_update"] == 1
    torch.testing.assert_close(torch.load(path / "model.bin", weights_only=True)["w"], saved, rtol=0, atol=0)

    accelerator.fail = True
    manager.save("step_00000002", state)
    accelerator.fail = False
    with pytest.raises(RuntimeError, match="writing a checkpoint .* failed"):
        manager.save("step_00000003", state)
    assert [p.name for p, _ in CheckpointManager.complete(tmp_path / "checkpoints")] == ["step_00000001"]


def test_resume_from_a_mid_run_checkpoint_reproduces_the_uninterrupted_run(trained, tiny_data, tmp_path):
    """Epochs 2 and 3 again, from the reference's end-of-epoch-1 checkpoint: data order, augmentation, drop path,
    Mixup, optimizer, schedule and EMA must all continue where they were, to the last bit."""
    reference, _ = trained
    out = tmp_path / "resumed"
    proc = _run(["--data-dir", str(tiny_data), "--output", str(out), *TINY_RUN,
                 "--resume", str(reference / "checkpoints" / "epoch_0001")], cwd=tmp_path)
    assert "resumed from" in proc.stdout and "epoch 1/3:" not in proc.stdout
    _assert_same_training(out, reference, epochs=[2, 3])


def test_sigkill_while_checkpointing_then_resume_matches_uninterrupted_run(trained, tiny_data, tmp_path):
    reference, _ = trained
    out = tmp_path / "killed"
    args = ["--data-dir", str(tiny_data), "--output", str(out), *TINY_RUN]
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=tmp_path, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # Kill while the checkpoint after update 10 (epoch 2, batch 4 of 6) is being written, or right after it.
    target = f"step_{UPDATES_PER_EPOCH + 4:08d}"
    deadline = time.monotonic() + 240
    killed_during_save = False
    while proc.poll() is None and time.monotonic() < deadline:
        root = out / "checkpoints"
        if (root / f".tmp-{target}").exists():
            killed_during_save = True
            break
        if (root / target).exists():
            break
        time.sleep(0.001)
    assert proc.poll() is None, f"the run ended before it could be killed:\n{proc.stderr.read()[-3000:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    print(f"killed {'while writing' if killed_during_save else 'after'} {target}")
    proc.stderr.close()

    complete = CheckpointManager.complete(out / "checkpoints")
    assert complete, "the checkpoints written before the kill survive"
    for path, _ in complete:  # every checkpoint that looks complete is complete
        assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl"} <= {
            p.name for p in path.iterdir()}
        load_file(str(path / "model.safetensors"))
    expected_latest = f"step_{UPDATES_PER_EPOCH + 2:08d}" if killed_during_save else target
    assert complete[-1][0].name == expected_latest
    assert complete[-1][1]["epoch"] == 1 and 0 < complete[-1][1]["batch_in_epoch"] < UPDATES_PER_EPOCH

    resumed = _run(args, cwd=tmp_path)
    assert f"resumed from {out / 'checkpoints' / expected_latest}" in resumed.stdout
    assert "epoch 1/3:" not in resumed.stdout and "epoch 2/3:" in resumed.stdout
    # Same data order, RNG, optimizer, schedule and EMA: the resumed run ends exactly where the uninterrupted did.
    _assert_same_training(out, reference, epochs=[1, 2, 3])


def test_two_process_cpu_run_with_accelerate_launch(tiny_data, tmp_path):
    # CPU processes also on a machine with a GPU (two processes cannot share its one GPU, and the evaluation below
    # must run on the device the training ran on to reproduce its metrics)
    cpu_only = {"CUDA_VISIBLE_DEVICES": ""}
    out = tmp_path / "ddp"
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", "29533"]
    args = ["--data-dir", str(tiny_data), "--output", str(out), *TINY_RUN, "--batch-size", "4", "--epochs", "1",
            "--checkpoint-every-steps", "0", "--workers", "0"]
    proc = _run(args, cwd=tmp_path, launcher=launcher, env=cpu_only)
    assert "2 process(es)" in proc.stdout
    records = _records(out)
    assert [r["epoch"] for r in records] == [1]
    # 47 readable + 1 corrupt training images, 4 per process and step: 6 updates; all 12 val images counted once
    assert records[0]["global_update"] == UPDATES_PER_EPOCH and records[0]["val_images"] == 12
    assert records[0]["skipped_val_images"] == 1
    checkpoint = out / "checkpoints" / "epoch_0001"
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= {p.name for p in checkpoint.iterdir()}
    # --eval-only: the DDP-wrapped weights (and their EMA) evaluate in one process to what the two processes recorded
    proc = _run(["--data-dir", str(tiny_data), "--output", str(tmp_path / "eval"), *TINY_RUN, "--eval-only",
                 "--checkpoint", str(checkpoint)], cwd=tmp_path, env=cpu_only)
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    for key in ("val_top1", "val_top5", "ema_val_top1", "ema_val_top5"):
        assert result[key] == pytest.approx(records[0][key], abs=1e-9), key
    assert result["img_per_s"] > 0 and result["skipped_val_images"] == 1 and result["val_images"] == 12
    assert '"val_top1"' in proc.stdout


# The trainer with its torch.compile on a backend that counts the graphs dynamo hands it and runs them as traced:
# the plumbing of --compile without Inductor's C++ compile of every kernel (minutes on a CPU).
COMPILED_RUN = textwrap.dedent("""\
    import json, sys
    import torch
    import visionssm.training.loop as loop
    from visionssm.train import main

    modes, graphs, stepped = {}, [], set()
    real_compile = torch.nn.Module.compile

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def compile_counting(module, *args, mode=None, **kwargs):
        modes[id(module)] = mode
        real_compile(module, backend=counting_backend)

    torch.nn.Module.compile = compile_counting
    real_step = loop._train_step

    def step(run, images, targets):
        stepped.add(id(run.model))
        return real_step(run, images, targets)

    loop._train_step = step
    status = main(sys.argv[1:])
    print("RESULT " + json.dumps({"status": status, "modes": list(modes.values()), "graphs": len(graphs),
                                  "stepped": [modes.get(i) for i in stepped]}))
    """)


def test_compile_runs_the_training_step_through_torch_compile_in_its_mode(tiny_data, tmp_path):
    args = ["--data-dir", str(tiny_data), "--output", str(tmp_path / "out"), *TINY_MODEL, "--img-size", "16",
            "--batch-size", "8", "--workers", "0", "--epochs", "1", "--no-model-ema", "--compile", "reduce-overhead"]
    proc = subprocess.run([sys.executable, "-c", COMPILED_RUN, *args], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["status"] == 0 and result["modes"] == ["reduce-overhead"]
    assert result["stepped"] == ["reduce-overhead"], "every training step called the compiled model"
    assert result["graphs"] >= 2, "dynamo traced the training and the evaluation forward"
    # compiled in place: the checkpoint's weights are the plain model's, loadable by an eager run
    keys = load_file(str(tmp_path / "out" / "checkpoints" / "epoch_0001" / "model.safetensors")).keys()
    assert keys and not [k for k in keys if k.startswith(("_orig_mod.", "module."))]
    assert "compile: reduce-overhead" in (tmp_path / "out" / "config.yaml").read_text().splitlines()


# The trainer on the gpu data backend's code with the CPU as its device (torchvision's CPU decoder): what a GPU run
# does, minus nvJPEG. resolve_data_backend is the only piece replaced.
GPU_BACKEND_RUN = textwrap.dedent("""\
    import sys
    import visionssm.training.loop as loop
    from visionssm.train import main

    loop.resolve_data_backend = lambda choice, device, say: "gpu"
    sys.exit(main(sys.argv[1:]))
    """)


def test_gpu_data_backend_code_trains_validates_and_counts_unreadable_files_on_cpu(tiny_data, tmp_path):
    out = tmp_path / "gpu-backend"
    args = ["--data-dir", str(tiny_data), "--output", str(out), *TINY_RUN, "--epochs", "2", "--workers", "1",
            "--checkpoint-every-steps", "0"]
    proc = subprocess.run([sys.executable, "-c", GPU_BACKEND_RUN, *args], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "gpu backend" in proc.stdout
    records = _records(out)
    assert [r["epoch"] for r in records] == [1, 2]
    for r in records:  # the same counts as the PIL path: one corrupt training file replaced, one val file dropped
        assert r["global_update"] == UPDATES_PER_EPOCH * r["epoch"] and r["val_images"] == 12
        assert r["skipped_train_images"] == 1 and r["skipped_val_images"] == 1
        assert math.isfinite(r["train_loss"]) and 0 <= r["val_top1"] <= 100
    assert "skipping unreadable image" in proc.stderr and "000000.png" in proc.stderr
    assert "data_backend: gpu" in (out / "config.yaml").read_text().splitlines()
    # resumed from epoch 1: epoch 2 again, to the last bit (same images, order and augmentation draws)
    resumed = tmp_path / "gpu-resumed"
    proc = subprocess.run([sys.executable, "-c", GPU_BACKEND_RUN, *args[:2], "--output", str(resumed), *args[4:],
                           "--resume", str(out / "checkpoints" / "epoch_0001")], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    _assert_same_training(resumed, out, epochs=[2])


# tiny presets of every family (tests/test_compile.py's layouts) at 32 px
_TINY_HIERARCHICAL = "{dims: 8, depths: [1, 1, 1, 1], stem_dim: 8, num_heads: [1, 1, 2, 2], window_size: [8, 8, 2, 1]}"
FAMILY_RUNS = {
    "mamba_vision_T": _TINY_HIERARCHICAL,
    "gka_vision_T": _TINY_HIERARCHICAL,
    "echo_vision_T": _TINY_HIERARCHICAL[:-1] + ", attn_mixer_kwargs: {zero_init_output: false}}",
    "comba_vision_T": "{img_size: 32, patch_size: 8, embed_dim: 32, depth: 2, num_heads: 2, mlp_ratio: 2.0, "
                      "mixer_kwargs: {gate_rank: 4}}",
}


@pytest.mark.cuda
@pytest.mark.parametrize("model", sorted(FAMILY_RUNS))
def test_cuda_fp16_with_grad_scaler_trains_every_family(model, tiny_data, tmp_path):
    """--amp fp16 (autocast + GradScaler) on the Triton kernels: finite losses and weights, and the scaler did not
    skip most steps (each overflow halves its scale from 65536)."""
    out = tmp_path / model
    _run(["--data-dir", str(tiny_data), "--output", str(out), "--model", model, "--model-kwargs", FAMILY_RUNS[model],
          "--img-size", "32", "--batch-size", "8", "--workers", "1", "--epochs", "2", "--warmup-epochs", "0",
          "--lr", "1e-3", "--amp", "fp16", "--aa", "rand-m9-mstd0.5-inc1", "--mixup", "0.8", "--cutmix", "1.0",
          "--reprob", "0.25"], cwd=tmp_path, env={"VISIONSSM_KERNELS": "triton"})
    records = _records(out)
    assert len(records) == 2 and all(math.isfinite(r["train_loss"]) and math.isfinite(r["val_loss"])
                                     for r in records)
    last = out / "checkpoints" / "epoch_0002"
    for key, value in load_file(str(last / "model.safetensors")).items():
        assert torch.isfinite(value).all(), key
    scale = torch.load(last / "scaler.pt", weights_only=True)["scale"]
    assert scale > 65536 / 2 ** UPDATES_PER_EPOCH, f"GradScaler skipped most of the {2 * UPDATES_PER_EPOCH} steps"


@pytest.mark.cuda
def test_cuda_gpu_data_backend_trains_from_jpegs(tiny_data, tmp_path):
    """nvJPEG decode and the GPU augmentation in a real run: a few steps, the corrupt files counted."""
    from PIL import Image

    data = tmp_path / "jpegs"
    for source in tiny_data.rglob("*.png"):
        target = data / source.relative_to(tiny_data).with_suffix(".jpg")
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            with Image.open(source) as image:
                image.convert("RGB").save(target, quality=90)
        except OSError:
            target.write_bytes(b"\xff\xd8\xff\xe0 corrupt")
    out = tmp_path / "out"
    proc = _run(["--data-dir", str(data), "--output", str(out), *TINY_RUN, "--no-deterministic", "--epochs", "1",
                 "--data-backend", "gpu", "--checkpoint-every-steps", "0"], cwd=tmp_path)
    assert "gpu backend" in proc.stdout
    record = _records(out)[0]
    assert record["skipped_train_images"] == 1 and record["skipped_val_images"] == 1 and record["val_images"] == 12
    assert math.isfinite(record["train_loss"])
    # where the loop's time went: the stage's decode and transform seconds, beside the loop's wait for batches
    assert record["data_stage_decode_s"] > 0 and record["data_stage_transform_s"] > 0
    assert 0 <= record["train_data_wait_s"] < record["epoch_seconds"]
