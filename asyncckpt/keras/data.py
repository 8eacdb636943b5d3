"""``ResumableDataset``: input whose batch order is a pure function of (seed, epoch).

Keras 3's ``fit`` cannot start an epoch at batch *k*. To resume exactly, the
data must (1) give the same batches in the same order in every run, and (2)
be able to leave out the *k* batches the interrupted run already applied.
``ResumableDataset`` does both: the order of epoch *e* comes from a NumPy
generator seeded with ``(shuffle_seed, e)``, never from global RNG state, and
``BackupAndRestore`` tells it the epoch and how many batches to leave out of
the epoch it resumes in (that epoch is then *k* batches shorter; the next ones
are full again).

Pass ``shuffle=False`` to ``fit``: Keras's own shuffle of a ``PyDataset``
permutes batch indices with Python's global ``random``, which no restart
reproduces, so the dataset refuses out-of-order indices; it shuffles itself
with ``shuffle_seed``. Batches are produced by one worker (``workers=1``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

logger = logging.getLogger(__name__)


def _take(tree: Any, idx: np.ndarray) -> Any:
    if tree is None:
        return None
    if isinstance(tree, dict):
        return {k: _take(v, idx) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_take(v, idx) for v in tree)
    return np.asarray(tree)[idx]


def _num_samples(tree: Any) -> int:
    if isinstance(tree, dict):
        return _num_samples(next(iter(tree.values())))
    if isinstance(tree, (list, tuple)):
        return _num_samples(tree[0])
    return len(tree)


class ResumableDataset(keras.utils.PyDataset):
    """Batches from arrays or an indexable sequence, in an order fixed per epoch.

    Either ``x`` (with optional ``y`` and ``sample_weight``) are arrays (or
    dicts/lists of arrays) cut into batches of ``batch_size``, shuffled per
    epoch when ``shuffle_seed`` is given; or ``sequence`` is anything with
    ``len()`` and ``[i]`` returning a whole batch (a ``PyDataset``, a
    ``keras.utils.Sequence``, a list), whose batch order is shuffled per epoch
    when ``shuffle_seed`` is given.

    Args:
        x: Inputs (arrays mode).
        y: Targets (arrays mode).
        sample_weight: Sample weights (arrays mode).
        batch_size: Samples per batch (arrays mode).
        sequence: Batches (sequence mode).
        shuffle_seed: Seed of the per-epoch order; None keeps the natural order.
        drop_remainder: Arrays mode: leave out the last, smaller batch.
    """

    def __init__(
        self,
        x: Any = None,
        y: Any = None,
        sample_weight: Any = None,
        *,
        batch_size: int = 32,
        sequence: Sequence | None = None,
        shuffle_seed: int | None = None,
        drop_remainder: bool = False,
    ):
        super().__init__(workers=1, use_multiprocessing=False)
        if (x is None) == (sequence is None):
            raise ValueError("give either x (arrays) or sequence (batches), not both")
        self._x, self._y, self._sw = x, y, sample_weight
        self._seq = sequence
        self._seed = shuffle_seed
        if sequence is not None:
            self._n = len(sequence)
            self._samples = None
        else:
            self._samples = _num_samples(x)
            if batch_size < 1:
                raise ValueError(f"batch_size must be positive, got {batch_size}")
            self._bs = int(batch_size)
            full, rest = divmod(self._samples, self._bs)
            self._n = full + (1 if rest and not drop_remainder else 0)
        if self._n < 1:
            raise ValueError("the dataset has no batches")
        self._lock = threading.Lock()
        self._epoch = -1  # the epoch being served; -1 before the first
        self._next_epoch: int | None = None
        self._skip = 0
        self._pending_skip = 0
        self._last_index = -1
        self._within = False

    # -- position, set by BackupAndRestore ------------------------------------------------

    @property
    def batches_per_epoch(self) -> int:
        """Batches in a full epoch."""
        return self._n

    @property
    def epoch(self) -> int:
        """The epoch being served (or last served)."""
        return self._epoch

    def set_position(self, epoch: int, skip: int = 0) -> None:
        """Makes the next epoch that starts be ``epoch``, leaving out its first ``skip`` batches."""
        if not 0 <= skip < self._n:
            raise ValueError(f"skip must be in [0, {self._n}), got {skip}")
        with self._lock:
            self._next_epoch = int(epoch)
            self._pending_skip = int(skip)

    # -- PyDataset -----------------------------------------------------------------------

    @property
    def num_batches(self) -> int:
        with self._lock:
            if self._within:
                return self._n - self._skip
            if self._next_epoch is not None:
                return self._n - self._pending_skip
            return self._n

    def __len__(self) -> int:
        return self.num_batches

    def on_epoch_begin(self) -> None:
        with self._lock:
            if self._next_epoch is not None:
                self._epoch, self._skip = self._next_epoch, self._pending_skip
                self._next_epoch, self._pending_skip = None, 0
            else:
                self._epoch, self._skip = self._epoch + 1, 0
            self._last_index = -1
            self._within = True

    def on_epoch_end(self) -> None:
        with self._lock:
            self._within = False
            self._skip = 0

    def order(self, epoch: int) -> np.ndarray:
        """Batch (sequence mode) or sample (arrays mode) order of ``epoch``."""
        size = self._n if self._seq is not None else self._samples
        if self._seed is None:
            return np.arange(size)
        return np.random.default_rng([int(self._seed), int(epoch)]).permutation(size)

    def batch(self, epoch: int, j: int) -> Any:
        """Batch ``j`` of epoch ``epoch`` (what an uninterrupted run serves there)."""
        order = self.order(epoch)
        if self._seq is not None:
            return self._seq[int(order[j])]
        idx = order[j * self._bs : (j + 1) * self._bs]
        out = tuple(_take(t, idx) for t in (self._x, self._y, self._sw) if t is not None)
        return out[0] if len(out) == 1 else out

    def __getitem__(self, index: int) -> Any:
        index = int(index)
        with self._lock:
            if not self._within:
                # Keras samples a batch or two for the tensor spec before training.
                return self.batch(max(self._epoch, 0), index % self._n)
            epoch, skip = self._epoch, self._skip
            # Keras's own shuffle (fit(shuffle=True)) permutes the indices with
            # Python's global RNG, which no restart reproduces: refuse it. Calls
            # come in order 0, 1, 2, ... (a new iterator may start again at 0).
            if index not in (0, self._last_index + 1):
                raise ValueError(
                    f"ResumableDataset got batch index {index} after {self._last_index}: "
                    "pass shuffle=False to fit() (the dataset shuffles itself, per epoch, "
                    "with its shuffle_seed)"
                )
            self._last_index = index
        if skip + index >= self._n:
            raise IndexError(f"epoch {epoch} has only {self._n} batches")
        return self.batch(epoch, skip + index)
