"""The ImageNet trainer behind ``visionssm-train``: ``state`` (configuration, training state, checkpoints, metrics;
no torch at import, so the command parses its arguments first), ``setup`` (what a run is built from), ``loop`` (the
run: :func:`~visionssm.training.loop.train`)."""
