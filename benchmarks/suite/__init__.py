"""Latency benchmarks of asyncckpt against TensorFlow and orbax (``asyncckpt bench``).

Run from a source checkout: ``python -m benchmarks.suite [options]`` from its root, or
``asyncckpt bench [options]`` with the checkout's asyncckpt installed (``make bench``).
"""

from __future__ import annotations

import os
from pathlib import Path

#: The checkout's root: ``benchmarks`` and ``tests`` are packages under it.
ROOT = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child ``python -m benchmarks.suite...``: the checkout first on
    ``PYTHONPATH``, so the child imports the same benchmarks whatever its working directory."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env
