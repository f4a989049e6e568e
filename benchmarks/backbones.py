"""Backbone benchmark preset: every visionssm model of size T, T2 or S next to timm's CNN/ViT/MambaOut baselines.

    python benchmarks/backbones.py                          # batch 256, 224², bf16 autocast, channels_last
    python benchmarks/backbones.py --models mamba_vision_T convnext_tiny --no-channels-last
    (any other visionssm-benchmark option, e.g. --repeats, passes through; --out DIR moves the results)

A preset of ``visionssm-benchmark`` (visionssm/benchmark/: timing, FLOP and memory rules are stated there and in
every results JSON). The visionssm models come from the model registry, family by family, so a new family is
measured without editing this file. Ratios are to ``mamba_vision_T``; results go to
``benchmarks/results/backbones-<gpu>-<date>.*``. After the table it sets the measured img/s beside the official
MambaVision numbers (mamba_ssm's CUDA scan on an H100, batch 256, bf16 — a different GPU when this runs elsewhere,
so read those columns loosely).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from visionssm import benchmark  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SIZES = ("T", "T2", "S")
BASELINES = ["convnext_tiny", "deit_tiny_patch16_224", "deit_small_patch16_224", "mambaout_tiny"]
PRESET = ["--batch-size", "256", "--img-size", "224", "--dtype", "bf16", "--baseline", "mamba_vision_T",
          "--name", "backbones"]
# Official MambaVision numbers (H100, batch 256, bf16, mamba_ssm CUDA scan; channels_last inference).
OFFICIAL = {
    "mamba_vision_T": {"infer": 12832, "train": 3797},
    "mamba_vision_T2": {"infer": 10654},
    "mamba_vision_S": {"infer": 9697},
    "mamba_vision_B": {"infer": 6195},
    "convnext_tiny": {"infer": 7525, "train": 2731},
    "deit_small_patch16_224": {"train": 5165},
}


def official_comparison(rows: list[dict]) -> str:
    lines = ["model                    infer img/s (official)  train img/s (official)"]
    for row in rows:
        quoted = OFFICIAL.get(row.get("model"), {})
        if not quoted:
            continue
        cells = []
        for mode in ("infer", "train"):
            measured, official = row.get(f"{mode}_img_s"), quoted.get(mode)
            cells.append(f"{f'{measured:,.0f}' if measured else '-':>11} ({f'{official:,}' if official else '-':>6})")
        lines.append(f"{row['model']:<24} {cells[0]:>22}  {cells[1]:>22}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=benchmark.visionssm_models(SIZES) + BASELINES)
    parser.add_argument("--no-channels-last", dest="channels_last", action="store_false")
    parser.add_argument("--out", "--out-dir", dest="out", default=str(RESULTS_DIR), help="results folder "
                        "(default benchmarks/results)")
    args, passthrough = parser.parse_known_args(argv)
    status = benchmark.main(args.models + PRESET + (["--channels-last"] if args.channels_last else [])
                            + ["--out", args.out] + passthrough)
    if "--no-save" not in passthrough:
        latest = max(Path(args.out).glob("backbones-*.json"), key=lambda p: p.stat().st_mtime, default=None)
        if latest is not None:
            print(official_comparison(json.loads(latest.read_text())["results"]))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
