"""orbax's policy objects, called with the inputs orbax's own manager gives them.

``CheckpointManagerOptions(save_decision_policy=..., preservation_policy=...)``
hands the manager objects with orbax's public methods: a save-decision policy's
``should_save(step, previous_steps, *, context)`` and a preservation policy's
``should_preserve(checkpoints, *, context)``. orbax's ``CheckpointManager``
calls them with ``CheckpointInfo`` records (step, time of the save, metrics)
of the steps it lists, oldest first, a ``DecisionContext`` (a save in flight,
the preemption sync point, the multiprocessing options) and an empty
``PreservationContext``. This module builds exactly those inputs from the
manager's directory view and calls the policy: any policy orbax ships
(``FixedIntervalPolicy``, ``LatestN``, ``BestN``, ``AnySavePolicy``, ...) and
any user subclass behaves as under orbax. orbax is imported only here and
only when a policy is configured.

The time of a save is ``datetime.datetime.now(tz=UTC)`` looked up when the
save is called (``now()``), as orbax's manager takes it: code that controls
the clock (a test patching ``datetime.datetime``) gets the decisions orbax's
manager makes. Conversions use the real class, bound at import.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Sequence
from typing import Any

_UTC = datetime.UTC
_DATETIME = datetime.datetime  # the real class: conversions work with a patched clock too


def now() -> float:
    """The time of a save as orbax's manager takes it: ``datetime.datetime.now(tz=UTC)``,
    looked up at the call (so a patched clock is honoured), as a POSIX timestamp."""
    return datetime.datetime.now(tz=_UTC).timestamp()


@functools.cache
def _orbax() -> tuple[Any, Any, Any, Any]:
    """orbax's ``CheckpointInfo``, ``DecisionContext``, ``PreservationContext`` and
    default ``MultiprocessingOptions`` class (imported once, on first use)."""
    from orbax.checkpoint import checkpoint_managers, options
    from orbax.checkpoint.checkpoint_manager import CheckpointInfo

    return (CheckpointInfo, checkpoint_managers.DecisionContext,
            checkpoint_managers.PreservationContext, options.MultiprocessingOptions)


def checkpoint_info(step: int, timestamp: float, metrics: Any) -> Any:
    """orbax's ``CheckpointInfo`` of a step saved at ``timestamp`` (``time.time()``)."""
    info_cls = _orbax()[0]
    return info_cls(step=step, time=_DATETIME.fromtimestamp(timestamp, tz=_UTC),
                    metrics=metrics)


class StepInfos(Sequence):
    """The listed steps as orbax's ``CheckpointInfo`` records, built when read.

    A policy that looks only at the step (``FixedIntervalPolicy``) or at the
    count (``InitialSavePolicy``) never makes them, so a ``should_save`` per
    training step does not read every step's metadata.

    Args:
        steps: The listed steps, oldest first.
        record: Reads a step's ``(timestamp, metrics)``.
    """

    def __init__(self, steps: Sequence[int], record: Callable[[int], tuple[float, Any]]):
        self._steps = list(steps)
        self._record = record
        self._infos: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self._steps)

    def _info(self, i: int) -> Any:
        info = self._infos.get(i)
        if info is None:
            step = self._steps[i]
            info = self._infos[i] = checkpoint_info(step, *self._record(step))
        return info

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self._info(i) for i in range(*index.indices(len(self._steps)))]
        if index < 0:
            index += len(self._steps)
        if not 0 <= index < len(self._steps):
            raise IndexError(index)
        return self._info(index)

    def __repr__(self) -> str:
        return f"StepInfos(steps={self._steps})"


def should_save(policy: Any, step: int, previous: Sequence[Any], *, saving: bool,
                preempted: bool, multiprocessing_options: Any) -> bool:
    """``policy.should_save`` with the step and context orbax's manager gives it.

    Args:
        policy: The save-decision policy.
        step: The step asked about (its info carries the time now, no metrics).
        previous: The listed steps' infos, oldest first (``StepInfos``).
        saving: Whether a save is in flight.
        preempted: Whether ``step`` is JAX's preemption sync point.
        multiprocessing_options: orbax's ``MultiprocessingOptions`` (None: default).
    """
    _, context_cls, _, mp_cls = _orbax()
    context = context_cls(is_saving_in_progress=saving, reached_preemption=preempted,
                          multiprocessing_options=multiprocessing_options or mp_cls())
    info = checkpoint_info(step, now(), None)
    return bool(policy.should_save(info, previous_steps=previous, context=context))


@functools.cache
def every_n_seconds(interval_s: int) -> Any:
    """orbax's ``EveryNSeconds`` policy: what its manager builds from ``keep_time_interval``."""
    from orbax.checkpoint import checkpoint_managers

    return checkpoint_managers.EveryNSeconds(interval_secs=interval_s)


def preserved(policy: Any, infos: Sequence[Any]) -> list[bool]:
    """``policy.should_preserve`` of the listed steps' infos, one flag per step.

    Raises:
        ValueError: the policy answered for a different number of steps.
    """
    context = _orbax()[2]()
    flags = [bool(f) for f in policy.should_preserve(infos, context=context)]
    if len(flags) != len(infos):
        raise ValueError(f"preservation policy {policy!r} answered {len(flags)} flags for "
                         f"{len(infos)} checkpoints")
    return flags
