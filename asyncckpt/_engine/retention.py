"""Retention stage: which committed checkpoints to keep.

The one retention rule set of asyncckpt, shared by the TensorFlow and JAX
managers, the job runner's ``ArrayStore`` and ``JobRunner``, and the remote
tier (``storage.tier``). A pure function over the list of committed
checkpoints, so each rule can be tested without files. Rules, applied only
to checkpoints already durable:

* keep the newest ``max_to_keep`` (or, with a metric, the best ``max_to_keep``);
* the newest checkpoint is never deleted, whatever its metric, unless
  ``max_to_keep`` is 0 (orbax's "keep none": then only the preserving rules
  below keep it);
* keep forever any step divisible by ``keep_period`` (orbax's rule);
* keep forever one checkpoint every ``keep_every_n_hours`` (TensorFlow's rule).

``check_max_to_keep`` is the one validation of a ``max_to_keep`` argument.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal


def check_max_to_keep(value: Any, *, allow_zero: bool) -> int | None:
    """``value`` as a ``max_to_keep``: None (keep all) or an int >= 1.

    Args:
        value: What the caller was given (an ``int``, a NumPy integer, or
            anything else with ``__index__``; never a bool).
        allow_zero: Accept 0 as well ("keep none", orbax's rule: only the
            preserving rules keep a checkpoint). TensorFlow's manager, the
            job runner and the remote tier do not.

    Raises:
        ValueError: anything else.
    """
    if value is None:
        return None
    minimum = 0 if allow_zero else 1
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < minimum:
        raise ValueError(f"max_to_keep must be None or an int >= {minimum}, got {value!r}")
    return n


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """Which checkpoints a manager keeps.

    Attributes:
        max_to_keep: How many to keep (None keeps all; 0 keeps none but
            what the preserving rules keep).
        keep_every_n_hours: Preserve, outside the ``max_to_keep`` count, one
            checkpoint per this many hours.
        keep_period: Preserve every step divisible by this.
        best_mode: ``"max"`` or ``"min"`` to rank by metric instead of recency;
            None ranks by recency.
        keep_checkpoints_without_metrics: With ``best_mode``, keep checkpoints
            that have no metric (outside the count) rather than deleting them.
    """

    max_to_keep: int | None = None
    keep_every_n_hours: float | None = None
    keep_period: int | None = None
    best_mode: Literal["max", "min"] | None = None
    keep_checkpoints_without_metrics: bool = True

    def __post_init__(self) -> None:
        check_max_to_keep(self.max_to_keep, allow_zero=True)
        if self.keep_period is not None and self.keep_period < 1:
            raise ValueError(f"keep_period must be a positive int or None, got {self.keep_period}")
        if self.keep_every_n_hours is not None and self.keep_every_n_hours <= 0:
            raise ValueError(
                f"keep_every_n_hours must be positive or None, got {self.keep_every_n_hours}"
            )
        if self.best_mode not in (None, "max", "min"):
            raise ValueError(f"best_mode must be 'max', 'min' or None, got {self.best_mode!r}")


@dataclass(frozen=True)
class Candidate:
    """One committed checkpoint as retention sees it.

    Attributes:
        key: The manager's handle for it (a path or a step as text).
        step: Training step, when known.
        timestamp: Commit time (``time.time()``).
        metric: The value ranked by ``best_mode``, when given.
    """

    key: str
    step: int | None
    timestamp: float
    metric: float | None = None


@dataclass(frozen=True)
class Decision:
    """Outcome of applying a policy.

    Attributes:
        keep: Still managed (subject to later decisions), oldest first.
        delete: To delete now.
        preserve: Kept forever; no longer counted against ``max_to_keep``.
        last_preserved_timestamp: Updated clock of the ``keep_every_n_hours`` rule.
    """

    keep: list[Candidate] = field(default_factory=list)
    delete: list[Candidate] = field(default_factory=list)
    preserve: list[Candidate] = field(default_factory=list)
    last_preserved_timestamp: float = 0.0


def _by_metric(candidates: Sequence[Candidate], mode: str) -> list[Candidate]:
    # Best first; ties go to the newer checkpoint.
    sign = -1.0 if mode == "max" else 1.0
    order = sorted(
        range(len(candidates)),
        key=lambda i: (sign * float(candidates[i].metric), -i),  # type: ignore[arg-type]
    )
    return [candidates[i] for i in order]


def _on_period(c: Candidate, period: int | None) -> bool:
    return period is not None and c.step is not None and c.step % period == 0


def apply(
    candidates: Sequence[Candidate],
    policy: RetentionPolicy,
    *,
    last_preserved_timestamp: float = 0.0,
) -> Decision:
    """Decides which checkpoints to keep, delete and preserve.

    Args:
        candidates: Committed checkpoints, oldest first.
        policy: The rules.
        last_preserved_timestamp: Time of the last checkpoint preserved by the
            ``keep_every_n_hours`` rule.
    """
    if not candidates or policy.max_to_keep is None:
        return Decision(list(candidates), [], [], last_preserved_timestamp)
    newest = candidates[-1]
    keep_none = policy.max_to_keep == 0
    n = max(policy.max_to_keep, 1)
    if policy.best_mode is None:
        kept_ids = {id(c) for c in candidates[-n:]}
    else:
        with_metric = [c for c in candidates if c.metric is not None]
        kept_ids = {id(c) for c in _by_metric(with_metric, policy.best_mode)[:n]}
        if policy.keep_checkpoints_without_metrics:
            kept_ids |= {id(c) for c in candidates if c.metric is None}
    if keep_none:  # the newest too stays only if a preserving rule (below) says so
        kept_ids.discard(id(newest))
    else:
        kept_ids.add(id(newest))

    keep, delete, preserve = [], [], []
    last = last_preserved_timestamp
    for c in candidates:  # oldest first, as the hours rule needs
        if id(c) in kept_ids:
            keep.append(c)
        elif _on_period(c, policy.keep_period):
            preserve.append(c)
        elif policy.keep_every_n_hours is not None and (
            c.timestamp - policy.keep_every_n_hours * 3600.0 >= last
        ):
            preserve.append(c)
            last = c.timestamp
        else:
            delete.append(c)
    return Decision(keep, delete, preserve, last)
