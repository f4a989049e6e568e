#!/usr/bin/env python
"""Train (or evaluate) an image classifier: a checkout's entry to :mod:`visionssm.train`, the same program as the
``visionssm-train`` command and ``python -m visionssm.train`` (``--help`` lists every setting).

    python train_imagenet.py                      # embedded default: small model, generated shapes set, CPU-friendly
    accelerate launch train_imagenet.py --config configs/imagenet/mamba_vision_T.yaml --data-dir DATA --output OUT
    python train_imagenet.py --eval-only --checkpoint OUT/checkpoints/epoch_0012 --output OUT
"""

import sys
from pathlib import Path

# Python puts this file's folder first on sys.path; in a checkout that folder's visionssm/ lacks the kernels,
# tracking and configs subpackages an install maps in. Dropping it makes the installed package (editable or not)
# the one imported.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]

try:
    from visionssm.train import main
except ModuleNotFoundError as error:
    if error.name != "visionssm":
        raise
    raise SystemExit("visionssm is not installed: run pip install -e . in this folder first") from None

if __name__ == "__main__":
    sys.exit(main())
