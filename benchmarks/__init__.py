"""Benchmarks of hsd-opt, each a script run from the repository root as ``python -m benchmarks.NAME`` (it writes
``benchmarks/results/``); none is imported by the package or its tests."""
