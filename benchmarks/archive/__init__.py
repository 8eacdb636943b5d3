"""Benchmarks of past investigations, kept with their results (see README.md here).

Not maintained and not run by the tests: each ran against the code of its results' date.
Run one from the checkout's root by path (``python benchmarks/archive/bench_x.py``) or
as ``python -m benchmarks.archive.bench_x``.
"""
