"""visionssm.tracking: single-object tracking (OSTrack-style one-stream tracker) on any visionssm backbone.

The template (128², 2× the target) and the search region (256², 4× the target) go through the backbone as one token
sequence, template first, with the sequence mixers non-causal; OSTrack's centre head reads the 16×16 search map.

Modules (imported on use, so ``import visionssm.tracking`` stays light):

- ``model``: pair adapters for ``comba_vision_*`` (isotropic) and ``mamba_vision_*`` / ``gka_vision_*``
  (hierarchical) backbones, :class:`~visionssm.tracking.model.head.CenterHead`, ``build_model``;
- ``losses``: CenterNet focal loss (α=2, β=4) + 2·GIoU + 5·L1;
- ``data``: GOT-10k and LaSOT loaders (official layouts), generated videos in both layouts (``data.synthetic``),
  crops/jitter (``data.processing``), albumentations augmentation, the training pair sampler;
- ``tracker``: ``Tracker.initialize(image, box)`` / ``track(image) -> box``;
- ``train`` / ``run`` / ``evaluate``: command-line entry points (``python -m visionssm.tracking.<name> --help``),
  which parse their arguments before importing torch; their work is ``trainer`` / ``runner`` / ``evaluation``;
- ``results``: result files read strictly (file and line named for anything invalid) and written atomically;
- ``metrics``: GOT-10k (toolkit rules) and LaSOT (pytracking convention) metrics.

See ``tracking/README.md`` for the recipe, the commands and the conventions.
"""

__all__ = ["config", "data", "evaluate", "evaluation", "losses", "metrics", "model", "results", "run", "runner",
           "tracker", "train", "trainer"]
