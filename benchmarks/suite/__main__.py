"""``python -m benchmarks.suite [options]``: the same as ``python -m benchmarks``.

Kept because older checkouts have it too: one command runs the suite on both sides of a
before/after comparison.
"""

import sys

from benchmarks.suite.cli import main

sys.exit(main())
