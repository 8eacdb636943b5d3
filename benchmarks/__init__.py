"""asyncckpt's benchmarks, run from a source checkout (not part of the installed package).

``benchmarks.suite`` is ``asyncckpt bench`` (``python -m benchmarks.suite``); the
``bench_*.py`` scripts measure one thing each (``python benchmarks/bench_x.py`` or
``python -m benchmarks.bench_x`` from the checkout's root). See README.md here.
"""
