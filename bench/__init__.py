"""Benchmark suite: `python -m bench.run [--quick] [--only NAME ...]` (see bench/run.py).

Every figure is measured side by side with its baseline in the same run and reported as a ratio.
"""
