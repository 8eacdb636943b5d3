"""``python -m benchmarks.suite [options]``: ``asyncckpt bench`` run from a source checkout."""

import sys

from benchmarks.suite.cli import main

sys.exit(main())
