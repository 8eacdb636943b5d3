"""``python -m benchmarks [options]``: the benchmark suite, run from a source checkout's root.

The same as ``python -m benchmarks.suite`` (``benchmarks/suite/cli.py``); ``--help`` lists
the options, ``make bench`` / ``make bench-quick`` run it with the checkout's ``.venv``.
"""

import sys

from benchmarks.suite.cli import main

sys.exit(main())
