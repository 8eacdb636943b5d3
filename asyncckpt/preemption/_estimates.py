"""The grace clock's persisted estimates: windows and their float-vector layout.

Checkpoints carry the recent save and step times so that a restarted job
starts with a margin learnt from its previous run. TensorFlow keeps them in a
float64 variable of fixed shape, so they are stored as one flat vector: a
version number, then each window, padded with NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Samples kept per quantity, in memory and in each checkpoint.
WRITE_WINDOW = 16
STEP_WINDOW = 32
# Final saves kept (in a file beside the checkpoints: see ``_targets``).
FINAL_WINDOW = 8
# Cold first saves of recent runs kept (same file).
COLD_WINDOW = 4
# Layout of the estimates as a flat float vector (TensorFlow stores them in a
# float64 variable of fixed shape): a version, then each window, NaN-padded.
ESTIMATES_VERSION = 2.0
_LAYOUT: tuple[tuple[str, int], ...] = (
    ("save_s", WRITE_WINDOW),
    ("save_bytes", WRITE_WINDOW),
    ("step_s", STEP_WINDOW),
)
ESTIMATES_LENGTH = 1 + sum(n for _, n in _LAYOUT)


def finite(value: object) -> float | None:
    """``value`` as a float if it is a finite, non-negative number, else None."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and value >= 0 else None


def finite_list(values: object) -> list[float]:
    """The finite, non-negative numbers of ``values`` (a scalar counts as a list of one)."""
    if not isinstance(values, (list, tuple)):
        values = [] if values is None else [values]
    return [v for v in (finite(x) for x in values) if v is not None]


def encode_estimates(estimates: dict | None) -> list[float]:
    """``estimates()`` as a fixed-length float vector (NaN-padded windows)."""
    estimates = estimates or {}
    out = [ESTIMATES_VERSION]
    for key, n in _LAYOUT:
        values = finite_list(estimates.get(key))[-n:]
        out += values + [float("nan")] * (n - len(values))
    return out


def decode_estimates(values: Sequence[float]) -> dict:
    """The inverse of ``encode_estimates``; ``{}`` for an unknown layout."""
    values = [float(v) for v in values]
    if len(values) != ESTIMATES_LENGTH or values[0] != ESTIMATES_VERSION:
        return {}
    out, i = {}, 1
    for key, n in _LAYOUT:
        out[key] = [v for v in values[i:i + n] if not math.isnan(v)]
        i += n
    return out
