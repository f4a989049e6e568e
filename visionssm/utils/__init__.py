"""Utilities shared by training, tracking and the benchmarks."""
