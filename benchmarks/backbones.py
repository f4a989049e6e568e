"""Backbone benchmark: every visionssm T/S model next to timm's CNN/ViT/MambaOut baselines, in one run.

    python benchmarks/backbones.py                         # all models, batch 256, 224², bf16, channels_last
    python benchmarks/backbones.py --models mamba_vision_T convnext_tiny --batch-size 64 --quick

For each model: parameters, GFLOPs, inference and training throughput (img/s) and peak GPU memory.

- Precision: bf16 autocast (parameters stay float32, as in training), inputs in channels_last memory format
  (``--no-channels-last`` to turn it off); eager mode (no torch.compile).
- Inference: ``model.eval()`` under ``torch.inference_mode()``. Training: ``model.train()``, forward,
  cross-entropy on random labels, backward, SGD (momentum 0.9) step, ``zero_grad(set_to_none=True)``.
- Timing: visionssm.utils.benchmark.time_fn (CUDA events, warm-up, median of the timed runs); img/s = batch /
  median step time. Peak memory: ``torch.cuda.max_memory_allocated`` over the timed steps, in GiB.
- FLOPs rule: ``torch.utils.flop_counter.FlopCounterMode`` on one 224² image in the benchmark's precision:
  convolutions, linear layers and matmuls (including attention) with a multiply-add counted as 2 FLOPs. The
  sequence-mixer scans themselves (selective scan, GKA, Comba recurrences; Triton kernels on GPU) and elementwise
  ops are not counted, so GFLOPs / 2 is comparable with the "GMACs" of ptflops/fvcore that MambaVision's README and
  timm's results quote (MambaVision-T: 4.4 G).

Results go to ``benchmarks/results/backbones-<gpu>-<date>.{json,csv}``; the table gives ratios to
``mamba_vision_T`` and, where the issue lists one, the official MambaVision number (measured with mamba_ssm's CUDA
scan on an H100, batch 256, bf16 — a different GPU when this runs elsewhere, so read those columns loosely).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import timm  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import visionssm.models  # noqa: E402,F401  (registers the visionssm models with timm)
from visionssm.utils.benchmark import environment, save_results, side_by_side, time_fn  # noqa: E402

BASELINE = "mamba_vision_T"
VISIONSSM_MODELS = ["mamba_vision_T", "mamba_vision_T2", "mamba_vision_S", "gka_vision_T", "gka_vision_T2",
                    "gka_vision_S", "comba_vision_T", "comba_vision_S"]
TIMM_MODELS = ["convnext_tiny", "deit_tiny_patch16_224", "deit_small_patch16_224", "mambaout_tiny"]
# Official numbers quoted in the issue (H100, batch 256, bf16, mamba_ssm CUDA scan; channels_last inference).
OFFICIAL = {
    "mamba_vision_T": {"infer": 12832, "train": 3797},
    "mamba_vision_T2": {"infer": 10654},
    "mamba_vision_S": {"infer": 9697},
    "mamba_vision_B": {"infer": 6195},
    "convnext_tiny": {"infer": 7525, "train": 2731},
    "deit_small_patch16_224": {"train": 5165},
}


def count_gflops(model: torch.nn.Module, res: int, device: torch.device, channels_last: bool) -> float:
    x = torch.randn(1, 3, res, res, device=device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    model.eval()
    counter = FlopCounterMode(display=False)
    with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16), counter:
        model(x)
    return counter.get_total_flops() / 1e9


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def bench_model(name: str, args, device: torch.device) -> dict:
    row = {"model": name, "batch": args.batch_size, "res": args.res, "amp": "bf16",
           "channels_last": args.channels_last}
    model = timm.create_model(name, num_classes=1000).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    row["params_M"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 3)
    row["gflops"] = round(count_gflops(model, args.res, device, args.channels_last), 3)
    x = torch.randn(args.batch_size, 3, args.res, args.res, device=device)
    if args.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    target = torch.randint(0, 1000, (args.batch_size,), device=device)
    warmup, repeats = (2, 5) if args.quick else (args.warmup, args.repeats)

    model.eval()

    def infer():
        with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16):
            model(x)

    _reset_peak(device)
    timing = time_fn(infer, warmup=warmup, repeats=repeats, device=device)
    row.update(infer_ms=round(timing.median_ms, 3), infer_img_s=round(args.batch_size / timing.median_ms * 1e3, 1),
               infer_spread=round(timing.spread, 3), infer_peak_GiB=_peak_gib(device))

    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)

    def train_step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    _reset_peak(device)
    timing = time_fn(train_step, warmup=max(1, warmup // 2), repeats=max(3, repeats // 2), device=device)
    row.update(train_ms=round(timing.median_ms, 3), train_img_s=round(args.batch_size / timing.median_ms * 1e3, 1),
               train_spread=round(timing.spread, 3), train_peak_GiB=_peak_gib(device))
    for key, value in OFFICIAL.get(name, {}).items():
        row[f"official_{key}_img_s"] = value
    return row


def _table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["model"] == BASELINE and "error" not in r), None)
    cols = ["model", "params_M", "gflops", "infer_img_s", "train_img_s", "infer_peak_GiB", "train_peak_GiB",
            f"infer/{BASELINE}", f"train/{BASELINE}", "official_infer", "official_train"]
    lines = [cols]
    for r in rows:
        if "error" in r:
            lines.append([r["model"], "error: " + r["error"][:80]] + [""] * (len(cols) - 2))
            continue

        def ratio(key, r=r):
            return f"{r[key] / base[key]:.2f}x" if base and base.get(key) else "n/a"

        def fmt(v):
            return "" if v is None else (f"{v:,.2f}" if isinstance(v, float) and v < 100 else
                                         f"{v:,.0f}" if isinstance(v, (int, float)) else str(v))

        lines.append([r["model"], fmt(r["params_M"]), fmt(r["gflops"]), fmt(r["infer_img_s"]), fmt(r["train_img_s"]),
                      fmt(r["infer_peak_GiB"]), fmt(r["train_peak_GiB"]), ratio("infer_img_s"), ratio("train_img_s"),
                      fmt(r.get("official_infer_img_s")), fmt(r.get("official_train_img_s"))])
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(cols))]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(line, widths)) for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=VISIONSSM_MODELS + TIMM_MODELS)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--res", type=int, default=224)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--no-channels-last", dest="channels_last", action="store_false")
    parser.add_argument("--quick", action="store_true", help="few repeats (a smoke run)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds; models not started within it are skipped (their rows say so)")
    parser.add_argument("--out-dir", default=None, help="where to write JSON/CSV (default benchmarks/results)")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    env = environment()
    print(f"# {env['device']}  torch {env['torch']}  triton {env['triton']}  timm {timm.__version__}  {env['date']}  "
          f"batch {args.batch_size}  {args.res}px  bf16 autocast  channels_last={args.channels_last}", flush=True)
    start = time.monotonic()
    rows = []
    for name in args.models:
        if args.time_budget is not None and time.monotonic() - start > args.time_budget:
            rows.append({"model": name, "error": "skipped: time budget spent"})
            continue
        t0 = time.monotonic()
        try:
            row = bench_model(name, args, device)
        except Exception as exc:  # one model failing (e.g. out of memory) must not lose the others' numbers
            row = {"model": name, "error": f"{type(exc).__name__}: {exc}"}
        row["wall_s"] = round(time.monotonic() - t0, 1)
        rows.append(row)
        print({k: v for k, v in row.items() if k in ("model", "params_M", "gflops", "infer_img_s", "train_img_s",
                                                      "infer_peak_GiB", "train_peak_GiB", "wall_s", "error")},
              flush=True)
        _reset_peak(device)
        if not args.no_save:  # after every model, so a run cut short keeps what it measured
            paths = save_results("backbones", rows, out_dir=args.out_dir, env=env)
    if not args.no_save:
        print("wrote", *paths)
    ok = [r for r in rows if "error" not in r]
    long_rows = [{"metric": m, "impl": r["model"], "img/s": r[m]} for r in ok for m in ("infer_img_s", "train_img_s")]
    if any(r["impl"] == BASELINE for r in long_rows):
        print(side_by_side(long_rows, keys=["metric"], value="img/s", baseline=BASELINE, lower_is_better=False))
    print(_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
