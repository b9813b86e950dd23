"""Benchmarks of hsd-opt, each a script run from the repository root as ``python -m benchmarks.NAME`` (it writes
``benchmarks/results/``); none is imported by the package (tests import a few for their parsers and checks)."""
