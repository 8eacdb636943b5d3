"""``PreemptionCheckpointHandler`` driving ``asyncckpt.keras.BackupAndRestore``.

Keras's ``fit`` owns the training loop, so the callback calls the handler at
every batch boundary (``save_checkpoint_if_preempted``, once per batch
trained) and the handler decides, with its agreed step and its grace-period
margin, when the backup is taken and when the process exits. The handler
saves through ``KerasTarget``: a backup at the current boundary, in the
callback's own ``ArrayStore``, holding the handler's bookkeeping (its run
count is the number of batches trained, and its timing samples) in the
backup's metadata, so a restarted job starts from its measured estimates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncckpt._engine.writer import AsyncEngine
from asyncckpt.preemption._targets import Target
from asyncckpt.preemption.agreement import AgreementOptions
from asyncckpt.preemption.config import TerminationConfig
from asyncckpt.preemption.grace import GraceOptions

if TYPE_CHECKING:
    from asyncckpt.jobrunner.store import ArrayStore

logger = logging.getLogger(__name__)

METADATA_KEY = "preemption"


@dataclass(frozen=True, kw_only=True)
class PreemptionOptions:
    """The ``PreemptionCheckpointHandler`` a ``BackupAndRestore`` runs during ``fit``.

    Attributes:
        termination_config: Watchers, grace period and exit function (unset
            fields come from the detected platform's preset, as for the
            handler itself).
        grace_options: Tuning of the grace-period margin.
        agreement_options: Timeouts of the multi-worker protocol.
        coordinator: How workers agree; default: the one the handler would
            pick for the Keras backend in use.
    """

    termination_config: TerminationConfig | None = None
    grace_options: GraceOptions | None = None
    agreement_options: AgreementOptions | None = None
    coordinator: Any = None


class KerasTarget(Target):
    """The handler's view of a ``BackupAndRestore`` during ``fit``.

    Created by the handler (through ``BackupAndRestore.make_preemption_target``)
    when the callback starts it in ``on_train_begin``, after the newest backup
    was read, so the run count and estimates come from that backup.

    Args:
        store: The callback's backup store.
        bookkeeping: Returns the run count (batches trained) and estimates
            of the newest backup.
        track: Records the handler's run count and estimates, for the
            metadata of the next backup.
        save: Takes a backup at the current batch boundary.
    """

    framework = "keras"

    def __init__(self, store: ArrayStore, *, bookkeeping: Callable[[], tuple[int, dict]],
                 track: Callable[[int, dict | None], None], save: Callable[[], None]):
        self._store = store
        self._bookkeeping = bookkeeping
        self._track = track
        self._save = save

    @property
    def engine(self) -> AsyncEngine:
        return self._store.engine

    @property
    def directory(self) -> str:
        return self._store.directory

    def restore_bookkeeping(self) -> tuple[int, dict]:
        return self._bookkeeping()

    def track(self, runs: int, estimates: dict | None) -> None:
        self._track(runs, estimates)

    def save(self, runs: int, estimates: dict, state: Any, args: tuple,
             kwargs: dict) -> str | None:
        if state is not None or args or kwargs:
            raise TypeError(f"unexpected save arguments for a Keras backup: {args} {kwargs}")
        self.track(runs, estimates)
        self._save()
        return None

    def wait_until_finished(self) -> None:
        self._store.wait_until_finished()
