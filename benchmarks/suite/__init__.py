"""The benchmark suite: asyncckpt against TensorFlow, orbax and the machine's floors.

Run from a source checkout's root: ``python -m benchmarks [options]`` (``make bench``,
``make bench-quick``; ``python -m benchmarks.suite`` is the same). Not part of the wheel.
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
