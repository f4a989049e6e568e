"""The kernel suites run by :mod:`visionssm.benchmark.kernel_suites`, one module per kernel op (named after it): each
has ``ANCHOR`` and ``run(quick, copy_gbps)`` returning its rows; running a module (``python -m
visionssm.benchmark.suites.<op>``) prints the op's GPU time per kernel where it has such a diagnostic."""
