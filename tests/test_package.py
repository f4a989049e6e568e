"""The package as a user gets it, and the README's commands as the README writes them.

A wheel is built from this checkout and installed into a fresh virtual environment whose only link to this
machine's packages is a ``.pth`` line to the running interpreter's site-packages (torch and the other heavy
dependencies come from there; the checkout itself is not importable, which is checked). From a directory outside
the checkout every command of the README's bash blocks that needs no GPU then runs, at toy size through the
commands' own flags; README_COMMANDS says how each command is run, or why it is not. The commands run in two driver
processes side by side, each running its commands one after another in-process with ``runpy``, as ``python FILE``,
``python -m MODULE`` or the installed console script would: the interpreter and its imports start twice in all
instead of once per command.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from visionssm.layers import mixer_kernel_ops

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "visionssm", "kernels", "tracking", "configs")
SUITE_OPS = tuple(mixer_kernel_ops())  # every kernel op of a registered mixer has a suite

# The toy sizes: a 3-class generated set of 16-pixel images, one epoch.
TOY_SET = ["--synthetic-classes", "3", "--synthetic-train-per-class", "8", "--synthetic-val-per-class", "4",
           "--synthetic-image-size", "16", "--img-size", "16", "--batch-size", "8", "--workers", "0"]
TOY_MAMBA = ["--model-kwargs", "{dims: 8, depths: [1, 1, 1, 1], stem_dim: 8, num_heads: [1, 1, 2, 2], "
             "window_size: [8, 8, 2, 1]}", "--img-size", "16", "--batch-size", "8", "--workers", "0"]
TOY_TRACKER = ["model.pretrained=null", "model.head_channels=16", "data.pairs_per_epoch=4", "data.num_workers=0",
               "model.backbone_kwargs={dims: 8, depths: [1, 1, 1, 1], stem_dim: 8, num_heads: [1, 1, 2, 2]}",
               "train.epochs=1", "train.batch_size=2", "train.mixed_precision=no", "train.log_every=1"]
TRACKING_CHECKPOINT = "output/tracking/gka_vision_T_got10k_ep100/final.pth"

# Every command of the README's bash blocks: the step that runs it below, or why it is not run.
NOT_RUN = "not run: "
README_COMMANDS = {
    "pip install -e . && python train_imagenet.py": "train-default",  # the install: this test's, from the wheel
    'pip install -e ".[dev]" && pytest -q': NOT_RUN + "it is this test suite",
    "python train_imagenet.py": "train-default",
    "accelerate launch train_imagenet.py --config configs/imagenet/mamba_vision_T.yaml --data-dir /data/imagenet "
    "--output out/mvt": NOT_RUN + "needs ImageNet; the same recipe runs at toy size through the visionssm-train line "
                                  "(accelerate launch only starts that program once per process; tests/test_train.py "
                                  "runs a 2-process launch)",
    "python train_imagenet.py --eval-only --checkpoint out/mvt/checkpoints/epoch_0010 --output out/mvt": "eval-only",
    "visionssm-train --config mamba_vision_T --data-dir /data/imagenet --epochs 5 --output out/short": "recipe",
    "python -m visionssm.data.synthetic --out data/shapes10 --classes 10": "synthetic-set",
    "python -m visionssm.tracking.train --config configs/tracking/gka_vision_T_got10k_ep100.yaml": "tracking-train",
    "python -m visionssm.tracking.run --dataset got10k --root data/GOT-10k --split val --checkpoint "
    f"{TRACKING_CHECKPOINT} --name gkat": "tracking-run",
    "python -m visionssm.tracking.evaluate --dataset got10k --root data/GOT-10k --trackers gkat": "tracking-evaluate",
    "visionssm-benchmark mamba_vision_T gka_vision_T comba_vision_T convnext_tiny resnet50 --batch-size 256 "
    "--img-size 224 --dtype bf16 --channels-last --baseline convnext_tiny": NOT_RUN + "a GPU measurement (bf16, "
                                                                            "batch 256); its CPU twin below runs",
    "visionssm-benchmark comba_vision_S deit_small_patch16_224 --channels-last --compile": NOT_RUN + "a GPU "
    "measurement; tests/test_benchmark_cli.py parses --compile, tests/test_compile.py compiles the models",
    "visionssm-benchmark gka_vision_T mamba_vision_T --img-size 224 512 1024 --model-kwargs global_mixer=True": NOT_RUN
    + "a GPU measurement; tests/test_benchmark_cli.py runs several --img-size and --model-kwargs on CPU",
    "visionssm-benchmark resnet18 test_vit --device cpu --batch-size 4 --img-size 64": "benchmark-cpu",
    "visionssm-benchmark kernels --ops gka comba selective_scan ska": "benchmark-kernels",
    "python -m visionssm.benchmark.memory comba_vision_S deit_small_patch16_224 --img-size 1024": NOT_RUN + "minutes "
    "on a CPU at 1024 px; tests/test_memory.py runs the command on a toy model",
    "python benchmarks/train_throughput.py --models comba_vision_T --backends pil gpu": NOT_RUN + "a GPU measurement "
    "(whole training runs at ImageNet size, nvJPEG decoding)",
    "python benchmarks/check_regression.py /tmp/fresh/throughput-<gpu>-<date>.json": "check-regression",
}


def readme_commands(text: str) -> list[str]:
    """The commands of the bash blocks: continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for command in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+#.*$", "", command).strip()
            if command:
                commands.append(" ".join(command.split()))
    return commands


# The steps below that run README commands (the driver's, and the ones the tests run themselves).
STEPS = {"train-default", "eval-only", "synthetic-set", "tracking-train", "tracking-run", "tracking-evaluate",
         "recipe", "benchmark-cpu", "benchmark-kernels", "check-regression"}


def test_every_readme_command_is_run_or_says_why_not():
    commands = readme_commands((ROOT / "README.md").read_text())
    assert sorted(set(commands)) == sorted(README_COMMANDS), "README_COMMANDS must list the README's commands"
    assert {how for how in README_COMMANDS.values() if not how.startswith(NOT_RUN)} == STEPS


# ---------------------------------------------------------------------------------------------------------------
# Files named in the documents (README.md, CONTRIBUTING.md, the tracking README, the results history)

# Paths in the documents that stand for the reader's own files, or for files a command writes.
PLACEHOLDERS = ("/data/imagenet", "out/", "OUT/", "data/", "/tmp/", "output/", "DATA", "results/", "reports/",
                "checkpoints/", "benchmark-results")
PATH_PATTERN = re.compile(r"(?<![\w./*-])((?:[\w.*-]+/)+[\w.{},*-]*)")


def _expand(path: str) -> list[str]:
    match = re.search(r"\{([^}]*)\}", path)
    if not match:
        return [path]
    return [p for part in match.group(1).split(",") for p in _expand(path[:match.start()] + part + path[match.end():])]


def _named_paths(text: str, folder: Path) -> set[str]:
    """Repository paths written in inline code or code blocks. Left out: templates (``kernels/<op>/``), the
    placeholders above, and slashes between plain words (``JSON/CSV/PNG``): a path starts at a folder of the checkout
    or names a file with an extension."""
    spans = re.findall(r"```.*?```", text, flags=re.S) + re.findall(r"`([^`\n]+)`", text)
    found = set()
    for span in spans:
        for match in PATH_PATTERN.finditer(span):
            path = match.group(1).rstrip(".,")
            if span[match.end():match.end() + 1] == "<" or "<" in path or path.startswith(PLACEHOLDERS):
                continue
            first, last = path.split("/")[0], path.rstrip("/").split("/")[-1]
            if (ROOT / first).exists() or (folder / first).exists() or "." in last:
                found.update(_expand(path))
    return found


def _exists(path: str, folder: Path) -> bool:
    """A file or folder of the checkout, relative to its root or to the document's folder; globs must match."""
    return any(any(base.glob(path)) if "*" in path else (base / path).exists() for base in (ROOT, folder))


@pytest.mark.parametrize("document", ["README.md", "CONTRIBUTING.md", "tracking/README.md",
                                      "benchmarks/results/README.md"])
def test_documents_name_files_that_exist(document):
    folder = (ROOT / document).parent
    missing = sorted(p for p in _named_paths((ROOT / document).read_text(), folder) if not _exists(p, folder)
                     and not p.startswith(("visionssm.", "github.com", "huggingface.co")))
    assert not missing, f"{document} names files that do not exist: {missing}"


def test_results_index_lists_every_committed_result():
    """benchmarks/results/README.md names each file of its folder (one line per run, its files in braces), and names
    nothing that is not there: a results file is committed with its line, and its line leaves with it."""
    folder = ROOT / "benchmarks" / "results"
    spans = re.findall(r"`([^`\n]+)`", (folder / "README.md").read_text())
    names = (span for span in spans if re.fullmatch(r"(train/)?[\w.{},-]+\.(\w+|\{[\w,]+\})", span))
    listed = {path for name in names for path in _expand(name)}
    present = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != "README.md"}
    assert present - listed == set(), "committed results missing from the index"
    assert listed - present == set(), "the index names results that are not committed"


# ---------------------------------------------------------------------------------------------------------------
# The wheel


def _build_wheel(work: Path) -> Path:
    src = work / "src"
    for name in PACKAGE_SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy(source, src / name)
    # The backend installed with the dev extras builds it: no download, no isolated build environment.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(work / "dist"), str(src)], check=True, capture_output=True, text=True)
    (wheel,) = (work / "dist").glob("visionssm-*.whl")
    return wheel


def _make_venv(work: Path, wheel: Path) -> Path:
    """A fresh venv holding the wheel, borrowing this interpreter's dependencies through a .pth file."""
    env_dir = work / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # Site-packages folders only (CI's venv lives inside the checkout, so its folder is allowed): the checkout's root,
    # where the source visionssm/ sits, is never among them, and their .pth files (the editable install's finder)
    # are not run for folders a .pth file adds.
    borrowed = [p for p in dict.fromkeys(site.getsitepackages() + [sysconfig.get_paths()["purelib"]] + sys.path)
                if p and Path(p).name in ("site-packages", "dist-packages") and Path(p).resolve() != ROOT]
    (Path(purelib) / "_borrowed_dependencies.pth").write_text("\n".join(borrowed) + "\n")
    # --ignore-installed: the suite's own (editable) visionssm is visible through the .pth and must be left alone.
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "--ignore-installed", "--no-compile", "-q", str(wheel)], check=True, capture_output=True,
                   text=True)
    return env_dir


def _user_env() -> dict:
    """The environment a user of a CPU machine has: none of the suite's settings (it forces the reference kernels on
    CPU), and no GPU even where the suite runs on a machine with one (the steps' expectations are a CPU run's; the
    GPU paths have their own tests)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "VISIONSSM_KERNELS", "PYTHONPATH", "PYTEST_XDIST_WORKER")}
    env.update(PYTHONNOUSERSITE="1", PYTHONUNBUFFERED="1", TQDM_DISABLE="1", OMP_NUM_THREADS="1", MPLBACKEND="Agg",
               CUDA_VISIBLE_DEVICES="")
    return env


# Runs steps one after another in one process, each as `python FILE` / `python -m MODULE` / a console script would
# run (runpy), so that the interpreter starts once per driver; a failed step is reported and the next one runs.
DRIVER = textwrap.dedent('''\
    import glob, json, os, runpy, sys, time, traceback
    import visionssm, visionssm.configs, visionssm.kernels, visionssm.tracking
    print("MODULES " + json.dumps({m.__name__: m.__file__ for m in (visionssm, visionssm.configs,
                                                                    visionssm.kernels, visionssm.tracking)}))
    failed = 0
    for step in json.loads(sys.argv[1]):
        print("STEP " + step["tag"], flush=True)
        start = time.perf_counter()
        os.makedirs(step["cwd"], exist_ok=True)
        os.chdir(step["cwd"])
        argv = [a for arg in step["argv"] for a in (sorted(glob.glob(arg[5:])) if arg.startswith("glob:") else [arg])]
        sys.argv = [step["target"], *argv]
        try:
            if step["kind"] == "script":
                runpy.run_path(step["target"], run_name="__main__")
            elif step["kind"] == "module":
                runpy.run_module(step["target"], run_name="__main__", alter_sys=True)
            else:
                exec(compile(step["target"], "README.md (python block)", "exec"), {"__name__": "__readme__"})
        except SystemExit as stop:
            if stop.code not in (0, None):
                print(f"FAIL {step['tag']}: exit status {stop.code}", flush=True)
                failed += 1
                continue
        except Exception:
            traceback.print_exc(file=sys.stdout)
            print(f"FAIL {step['tag']}", flush=True)
            failed += 1
            continue
        print(f"DONE {step['tag']} in {time.perf_counter() - start:.1f} s", flush=True)
    sys.exit(1 if failed else 0)
    ''')


def _drivers(readme: str, bin_dir: Path, cwd: Path, toy_set: Path) -> list[list[dict]]:
    """The README's runnable commands at toy size, as two drivers' step lists (run side by side)."""
    quick_start = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert len(quick_start) == 1, "the README has one python block, the quick start"
    script = str(ROOT / "train_imagenet.py")

    def step(tag, kind, target, *argv, where=cwd):
        return {"tag": tag, "kind": kind, "target": str(target), "argv": list(argv), "cwd": str(where)}

    imagenet_and_benchmarks = [
        step("train-default", "script", script, *TOY_SET, "--epochs", "1"),
        step("eval-only", "script", script, *TOY_SET, "--eval-only", "--checkpoint",  # the run above's checkpoint
             "output/train/checkpoints/epoch_0001", "--output", "output/train"),
        step("recipe", "script", bin_dir / "visionssm-train", "--config", "mamba_vision_T", "--data-dir", str(toy_set),
             "--epochs", "5", "--output", "out/short", *TOY_MAMBA, "--epochs", "1"),
        step("synthetic-set", "module", "visionssm.data.synthetic", "--out", "data/shapes10", "--classes", "10",
             "--train-per-class", "1", "--val-per-class", "1", "--image-size", "8", "--workers", "1"),
        step("benchmark-cpu", "script", bin_dir / "visionssm-benchmark", "resnet18", "test_vit", "--device", "cpu",
             "--batch-size", "4", "--img-size", "64", "--warmup", "1", "--repeats", "2"),
        # There is no committed CPU run to compare with: the fresh run is compared with itself.
        step("check-regression", "script", ROOT / "benchmarks/check_regression.py", "glob:**/throughput-*.json",
             "--against", "glob:**/throughput-*.json"),
    ]
    tracking_and_more = [
        step("tracking-data", "module", "visionssm.tracking.data.synthetic", "got10k", "data/GOT-10k", "--train", "2",
             "--val", "2", "--test", "0", "--frames", "6", "8", "--size", "64", "48", "--workers", "1"),
        step("tracking-train", "module", "visionssm.tracking.train", "--config",
             "configs/tracking/gka_vision_T_got10k_ep100.yaml", "--no-progress", "--set", *TOY_TRACKER),
        step("tracking-run", "module", "visionssm.tracking.run", "--dataset", "got10k", "--root", "data/GOT-10k",
             "--split", "val", "--checkpoint", TRACKING_CHECKPOINT, "--name", "gkat"),
        step("tracking-evaluate", "module", "visionssm.tracking.evaluate", "--dataset", "got10k", "--root",
             "data/GOT-10k", "--trackers", "gkat"),
        # 224-pixel GKA on a CPU takes a minute: the quick start runs at 64 pixels.
        step("quick-start", "exec", quick_start[0].replace("224, 224", "64, 64")),
        step("benchmark-kernels", "script", bin_dir / "visionssm-benchmark", "kernels", "--ops", *SUITE_OPS,
             where=cwd / "kernel-suites"),
    ]
    return [imagenet_and_benchmarks, tracking_and_more]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel, its venv, and the README's commands run from a directory outside the checkout."""
    work = tmp_path_factory.mktemp("package")
    wheel = _build_wheel(work)
    env_dir = _make_venv(work, wheel)
    cwd = work / "user"
    from visionssm.data.synthetic import SyntheticSpec, ensure_synthetic_dataset

    toy_set = ensure_synthetic_dataset(cwd / "data" / "toy", SyntheticSpec(classes=3, train_per_class=8,
                                                                            val_per_class=4, image_size=16),
                                       workers=1, verbose=False)
    driver = work / "driver.py"
    driver.write_text(DRIVER)
    drivers = _drivers((ROOT / "README.md").read_text(), env_dir / "bin", cwd, toy_set)

    def launch(steps):
        return subprocess.run([str(env_dir / "bin" / "python"), str(driver), json.dumps(steps)], cwd=cwd,
                              env=_user_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=500)

    with ThreadPoolExecutor(len(drivers)) as pool:
        outputs = [proc.stdout for proc in pool.map(launch, drivers)]
    return {"wheel": wheel, "env": env_dir, "cwd": cwd, "output": "\n".join(outputs)}


def _step_output(installed: dict, tag: str) -> str:
    """What step ``tag`` printed; fails with it unless the step succeeded."""
    output = installed["output"]
    match = re.search(rf"^STEP {tag}\n(.*?)^(DONE|FAIL) {tag}\b", output, flags=re.S | re.M)
    assert match, f"step {tag} did not run:\n{output[-6000:]}"
    assert match.group(2) == "DONE", f"step {tag} failed:\n{match.group(1)[-6000:]}"
    return match.group(1)


def test_wheel_holds_the_package_and_its_recipes_and_nothing_else(installed):
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    dist_info = installed["wheel"].name.split("-py")[0] + ".dist-info"
    assert {name.split("/")[0] for name in names} == {"visionssm", dist_info}
    for name in ("visionssm/train.py", "visionssm/configs/imagenet/default.yaml",
                 "visionssm/configs/imagenet/mamba_vision_T.yaml", "visionssm/configs/tracking/smoke_synthetic.yaml",
                 "visionssm/kernels/gka/__init__.py", "visionssm/tracking/train.py"):
        assert name in names, name
    scripts = zipfile.ZipFile(installed["wheel"]).read(f"{dist_info}/entry_points.txt").decode()
    assert "visionssm-train = visionssm.train:main" in scripts and "visionssm-benchmark" in scripts
    modules = json.loads(re.search(r"^MODULES (.*)$", installed["output"], flags=re.M).group(1))
    for name, path in modules.items():  # the wheel's copy, not the checkout
        assert Path(path).resolve().is_relative_to(installed["env"].resolve()), f"{name} imported from {path}"


def test_training_commands_from_the_wheel_outside_the_checkout(installed):
    _step_output(installed, "train-default")
    cwd = installed["cwd"]
    records = [json.loads(line) for line in (cwd / "output/train/metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1]  # the defaults write under the working directory
    assert any((cwd / "data/generated").iterdir())
    _step_output(installed, "eval-only")
    evaluated = json.loads((cwd / "output/train/eval.json").read_text())
    assert (evaluated["val_top1"], evaluated["ema_val_top1"]) == (records[0]["val_top1"], records[0]["ema_val_top1"])
    _step_output(installed, "synthetic-set")
    assert len(list((cwd / "data/shapes10/train").iterdir())) == 10


def test_a_recipe_from_the_console_script_runs_exactly_the_epochs_asked(installed):
    printed = _step_output(installed, "recipe")
    records = [json.loads(line) for line in (installed["cwd"] / "out/short/metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1]  # the recipe's 20 warmup and 10 cooldown epochs shrink to fit
    assert "warmup 20 -> 0 and cooldown 10 -> 0" in printed


def test_tracking_commands_and_the_quick_start(installed):
    for tag in ("tracking-data", "tracking-train", "tracking-run", "tracking-evaluate", "quick-start"):
        _step_output(installed, tag)
    report = json.loads((installed["cwd"] / "reports/GOT-10k/performance.json").read_text())
    assert 0 <= report["trackers"]["gkat"]["ao"] <= 1 and report["trackers"]["gkat"]["frames"] > 0


def test_the_cpu_benchmark_and_the_regression_check(installed):
    printed = _step_output(installed, "benchmark-cpu")
    assert "resnet18" in printed and "test_vit" in printed
    _step_output(installed, "check-regression")


def test_the_kernel_suites_skip_on_cpu_with_a_line_each_and_write_nothing(installed):
    printed = _step_output(installed, "benchmark-kernels").lower().splitlines()
    for op in SUITE_OPS:
        assert sum(op in line and "skip" in line for line in printed) == 1, f"one skip line for {op}: {printed}"
    assert not any((installed["cwd"] / "kernel-suites").rglob("*")), "nothing is written for skipped suites"
