"""What each hand-written fusion and host-time shortcut of the backbones is worth: the model with one of them turned
off, against the model as shipped, in the same process (batch 256, 224², bf16 autocast, channels_last, as
``visionssm-benchmark``).

    python benchmarks/shortcuts.py                                   # comba_vision_T, comba_vision_S, gka_vision_T
    python benchmarks/shortcuts.py --models comba_vision_S --compile --out benchmarks/results

Variants (each applies to the models that have the shortcut; ``default`` is the model as shipped):

- ``unchained``: Comba blocks called one by one (``can_chain`` false): the residual add that ends each block runs on
  its own instead of inside the next block's first norm;
- ``norm_out_fp32``: the LayerNorms before linear layers write float32 under autocast (``autocast_output`` off);
- ``plain_norm``: ``fused_norm=False``, ``nn.LayerNorm`` and plain residual adds;
- ``prologue_torch`` / ``out_norm_torch``: the ``mixer_prologue`` / ``gated_rmsnorm`` op on its PyTorch composition
  (the ``reference`` launch setting);
- ``triton_launch``: every kernel launched through Triton's ``JITFunction`` call instead of the direct relaunch of
  its compiled kernel (:class:`visionssm.kernels.utils.DirectLaunch`).

Each variant is timed ``--rounds`` times, interleaved with the others; the best round is kept (the variants differ in
host work, and a round's rate moves with the host's load). Printed: img/s and the ratio to ``default`` per mode, and
whether the host set the rate. With ``--compile`` the model is ``torch.compile``d (default mode): there the norms are
``nn.LayerNorm`` and the residual adds plain adds for the compiler to fuse, so the norm variants must come out equal.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from unittest import mock

import torch

import visionssm  # noqa: F401 - registers the models
from visionssm.benchmark.config import BenchmarkConfig
from visionssm.benchmark.harness import HOST_REPEATS, environment, save_results, time_fn
from visionssm.benchmark.measure import create_model, inference_step, maybe_compile, release_memory, training_step
from visionssm.kernels import tuning, utils
from visionssm.layers.common import LayerNorm
from visionssm.models import comba_vision


def _unchained():
    return mock.patch.object(comba_vision, "can_chain", lambda blocks: False)


@contextlib.contextmanager
def _triton_launch():
    # the plans are rebuilt inside the override's generation (no direct runner yet) and again after it
    with mock.patch.object(utils, "DIRECT_LAUNCH", False), tuning.launch_overrides("layer_norm"):
        yield


def _norm_out_fp32(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, LayerNorm):
            module.autocast_output = False


def _has_comba_blocks(model) -> bool:
    return any(isinstance(m, comba_vision.CombaBlock) for m in model.modules())


def _has_ln_kernels(model) -> bool:
    return any(isinstance(m, LayerNorm) for m in model.modules())


def _has_fused_layer_ops(model) -> bool:
    """Comba and GKA layers: the mixer_prologue and gated_rmsnorm ops around the mixer."""
    return any(hasattr(m, "_prologue_spec") for m in model.modules())


#: name -> (applies to the model, extra model kwargs, context of the timed calls, model edit)
VARIANTS = {
    "default": (lambda m: True, {}, contextlib.nullcontext, None),
    "unchained": (_has_comba_blocks, {}, _unchained, None),
    "norm_out_fp32": (_has_ln_kernels, {}, contextlib.nullcontext, _norm_out_fp32),
    "plain_norm": (_has_comba_blocks, {"fused_norm": False}, contextlib.nullcontext, None),
    "prologue_torch": (_has_fused_layer_ops, {}, lambda: tuning.launch_overrides("mixer_prologue", reference=True),
                       None),
    "out_norm_torch": (_has_fused_layer_ops, {}, lambda: tuning.launch_overrides("gated_rmsnorm", reference=True),
                       None),
    "triton_launch": (lambda m: True, {}, _triton_launch, None),
}


def applicable(name: str, variants: list[str]) -> list[str]:
    """The ``variants`` that apply to model ``name`` (judged on the model as shipped, built on the CPU)."""
    model = create_model(name, BenchmarkConfig(models=[name], device="cpu"), torch.device("cpu"))
    return [v for v in variants if VARIANTS[v][0](model)]


def measure(name: str, variant: str, cfg: BenchmarkConfig, device: torch.device) -> dict:
    _, kwargs, context, edit = VARIANTS[variant]
    cfg = BenchmarkConfig(**{**vars(cfg), "model_kwargs": {**cfg.model_kwargs, **kwargs}})
    model = create_model(name, cfg, device)
    if edit is not None:
        edit(model)
    runner = maybe_compile(model, cfg)
    row = {"model": name, "variant": variant, "compile": cfg.compile}
    host_repeats = 0 if cfg.compile else HOST_REPEATS
    with context():
        for mode, make in (("infer", inference_step), ("train", training_step)):
            step = make(model, runner, cfg, cfg.batch_size, device)
            timing = time_fn(step, warmup=cfg.warmup, repeats=cfg.repeats, device=device, host_repeats=host_repeats)
            row[f"{mode}_img_s"] = cfg.batch_size * 1e3 / timing.median_ms
            row[f"{mode}_host_bound"] = timing.host_bound
    del model, runner
    release_memory(device)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["comba_vision_T", "comba_vision_S", "gka_vision_T"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--compile", action="store_true", help="torch.compile every variant (default mode)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None, help="folder for the JSON/CSV (default: print only)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: the shortcuts are GPU paths")
    device = torch.device("cuda")
    cfg = BenchmarkConfig(models=args.models, batch_size=args.batch_size, channels_last=True, compile=args.compile,
                          warmup=args.warmup, repeats=args.repeats)
    variants = ["default", *[v for v in args.variants if v != "default"]]
    env = environment(device)
    print(f"{env['device']}  {time.strftime('%Y-%m-%d %H:%M')}  torch {torch.__version__}  batch {args.batch_size}"
          f"  {'compiled' if args.compile else 'eager'}")
    rows = []
    for name in args.models:
        best: dict[str, dict] = {}
        for _ in range(args.rounds):
            for variant in applicable(name, variants):
                row = measure(name, variant, cfg, device)
                kept = best.setdefault(variant, row)
                for key in ("infer", "train"):
                    if row[f"{key}_img_s"] > kept[f"{key}_img_s"]:
                        kept.update({k: row[k] for k in (f"{key}_img_s", f"{key}_host_bound")})
        base = best["default"]
        for variant, row in best.items():
            for mode in ("infer", "train"):
                row[f"{mode}_vs_default"] = row[f"{mode}_img_s"] / base[f"{mode}_img_s"]
            print(f"{name:16s} {variant:16s} infer {row['infer_img_s']:9.0f} ({row['infer_vs_default']:.3f})"
                  f"{' host' if row['infer_host_bound'] else '     '}  train {row['train_img_s']:8.0f}"
                  f" ({row['train_vs_default']:.3f}){' host' if row['train_host_bound'] else ''}")
            rows.append(row)
    if args.out:
        paths = save_results("shortcuts-compiled" if args.compile else "shortcuts-eager", rows, out_dir=args.out,
                             env=env)
        print("saved", *paths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
