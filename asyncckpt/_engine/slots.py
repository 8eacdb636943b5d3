"""Snapshot stage: the pool of host staging slots.

A slot is a set of host buffers large enough for one copy of the training
state. A save takes a free slot, copies the state into it on the caller's
thread, and hands it to the background writer, which gives it back once the
bytes are in files. The pool is the writer/reader semaphore pair of the
classic design: ``acquire`` waits for a free slot (the writer semaphore), the
writer's queue plays the reader side.

Buffers are kept from save to save, keyed by a name the framework adapter
chooses, so the steady state allocates nothing and touches only warm pages.

First use of a slot allocates and pre-faults a whole state's worth of memory
(100+ ms for a few hundred MiB). So the save that shows the pool a new layout
(buffer names and sizes: the first save, or one whose state changed shape)
builds the same buffers in the other free slots before it returns, touching
pages on the copy threads in parallel, and every later save finds its slot
complete. (A background preparer, ``prepare(layout)``, does the same off the
calling thread for a layout known in advance; at the writer's low priority it
was too often unfinished when the second save came.) Buffers are installed
only while the slot is free, so ``acquire`` may take a slot at any moment and
never sees a half-built buffer: whatever is still missing is allocated on
demand. A save that finds every slot busy makes the pool grow by one slot,
built in the background (``_spares``), up to ``max_slots``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from asyncckpt._engine import _spares
from asyncckpt._engine._copy import prefault_all
from asyncckpt._engine._pages import aligned_empty, packed_empty, touch_pages
from asyncckpt._engine.budget import Budget
from asyncckpt._threads import lower_thread_priority
from asyncckpt.errors import HostMemoryError

__all__ = ["Slot", "StagingPool"]

logger = logging.getLogger(__name__)


def _size(nbytes: int) -> str:
    """``nbytes`` for a message: MiB, or KiB below a tenth of one."""
    if nbytes < 2**20 // 10:
        return f"{nbytes / 2**10:.1f} KiB"
    return f"{nbytes / 2**20:.1f} MiB"


class Slot:
    """One set of reusable host buffers, holding at most one staged save.

    Attributes:
        index: Position in the pool.
        allocations: Buffers allocated on demand (on the saving thread) by
            the save staged last; 0 when the slot was ready for its layout.
        prepared: Buffers the pool's preparer has built in this slot, in all.
    """

    def __init__(self, index: int):
        self.index = index
        self.allocations = 0
        self.prepared = 0
        self._buffers: dict[str, np.ndarray] = {}
        # key -> (raw buffer, shape, dtype, typed view): the view handed out
        # last, reused while the buffer and the request are the same.
        self._views: dict[str, tuple[np.ndarray, tuple, np.dtype, np.ndarray]] = {}
        self._used: set[str] = set()
        self._changed = True  # allocated or trimmed since the pool last learned from it
        self._ready = -1  # the pool's layout version this slot holds in full
        # The list ``buffers`` handed out last, with its arguments; forgotten
        # whenever a buffer or view is made, replaced or dropped (it must
        # neither hand out a stale view nor keep a dropped buffer alive).
        self._batch: tuple[tuple, tuple, tuple, list[np.ndarray]] | None = None
        # The pool's admission check of a state's size (see reserve); None: no budget.
        self._admit: Callable[[int, int], None] | None = None
        self._reserved = 0  # bytes the save being staged said it will ask for
        self._beside = 0  # bytes its writer will hold copied beside the slots

    def reserve(self, nbytes: int, *, beside: int = 0) -> None:
        """Says how many more bytes the save being staged will ask for, before it asks.

        Adapters call it after planning and before their ``buffer`` calls
        (once per save, or once per part of a state staged in parts): a
        state that does not fit the pool's host memory budget then raises
        ``HostMemoryError`` before its buffers are allocated. Costs one
        comparison for sizes the pool has let through before.

        Args:
            nbytes: Bytes of staging buffers this part will ask for.
            beside: Bytes its writer will hold copied outside the slots while
                it writes (the OCDBT writer's copies of the small values it
                stores in its B-tree leaves), which the budget counts once
                beside the slots. Values written from the slot itself (larger
                ones, into data files) are not counted.

        Raises:
            HostMemoryError: Not even one staging copy of the state fits.
        """
        self._reserved += nbytes
        self._beside += beside
        admit = self._admit
        if admit is not None:
            admit(self._reserved, self._beside)

    def begin(self) -> None:
        """Starts filling the slot for a new save."""
        self._used.clear()
        self.allocations = 0
        self._reserved = 0
        self._beside = 0

    def buffer(self, key: str, shape: Iterable[int], dtype: np.dtype | type) -> np.ndarray:
        """Returns a writable C-contiguous host buffer for one array.

        The same key with the same byte size gets the same memory back on the
        next save; a new key or size allocates (and pre-faults) a new buffer.

        Args:
            key: Stable name of the array within the state.
            shape: Shape of the array.
            dtype: NumPy dtype (extension dtypes such as bfloat16 work).
        """
        dtype = np.dtype(dtype)
        if type(shape) is not tuple:
            shape = tuple(int(d) for d in shape)
        self._used.add(key)
        raw = self._buffers.get(key)
        # Steady state: the same buffer asked for the same way as last time.
        hit = self._views.get(key)
        if hit is not None and hit[0] is raw and hit[1] == shape and hit[2] == dtype:
            return hit[3]
        nbytes = math.prod(shape) * dtype.itemsize
        if raw is None or raw.nbytes != nbytes:
            raw = aligned_empty(nbytes)
            self._buffers[key] = raw
            self.allocations += 1
            self._changed = True
        view = raw.view(dtype).reshape(shape)
        self._views[key] = (raw, shape, dtype, view)
        self._batch = None
        return view

    def buffers(self, keys: tuple[str, ...], shapes: tuple[tuple[int, ...], ...],
                dtypes: tuple[np.dtype, ...]) -> list[np.ndarray]:
        """``buffer`` for each key in turn, as one list.

        For a state of many arrays, one Python call per array per save adds
        up (about 1 us each): when the same three tuple objects come again (a
        cached plan's columns) and no buffer of this slot changed since, the
        list made last time is returned as it is. The caller must not change it.
        """
        last = self._batch
        if last is not None and last[0] is keys and last[1] is shapes and last[2] is dtypes:
            self._used.update(keys)
            return last[3]
        wanted = [math.prod(shape) * np.dtype(dtype).itemsize
                  for shape, dtype in zip(shapes, dtypes, strict=True)]
        missing = [(key, n) for key, n in zip(keys, wanted, strict=True)
                   if (b := self._buffers.get(key)) is None or b.nbytes != n]
        if len(missing) > 1:  # allocated together: the small ones packed (``packed_empty``)
            for (key, _), buf in zip(missing, packed_empty([n for _, n in missing]),
                                     strict=True):
                self._buffers[key] = buf
                self._views.pop(key, None)
            self.allocations += len(missing)
            self._changed = True
        out = list(map(self.buffer, keys, shapes, dtypes))
        self._batch = (keys, shapes, dtypes, out)
        return out

    def _install(self, key: str, buf: np.ndarray) -> None:
        """Puts a buffer built elsewhere (the pool's preparer) in place of ``key``'s."""
        self._buffers[key] = buf
        self._views.pop(key, None)
        self._batch = None

    def _drop(self, key: str) -> None:
        del self._buffers[key]
        self._views.pop(key, None)
        self._batch = None

    def trim(self) -> None:
        """Frees buffers that the save being staged did not use."""
        unused = [k for k in self._buffers if k not in self._used]
        for key in unused:
            self._drop(key)
        if unused:
            self._changed = True

    def layout(self) -> dict[str, int]:
        """Byte size of each buffer, by key."""
        return {k: b.nbytes for k, b in self._buffers.items()}

    def _missing(self, layout: Mapping[str, int]) -> list[tuple[str, int]]:
        """The ``(key, nbytes)`` of ``layout`` this slot has no buffer for."""
        out = []
        for key, nbytes in layout.items():
            b = self._buffers.get(key)
            if b is None or b.nbytes != nbytes:
                out.append((key, nbytes))
        return out

    @property
    def nbytes(self) -> int:
        """Host memory held by this slot."""
        # list() copies the values atomically: the preparer may be installing one.
        return sum(b.nbytes for b in list(self._buffers.values()))

    def clear(self) -> None:
        """Drops every buffer (used when the pool is closed)."""
        self._buffers.clear()
        self._views.clear()
        self._used.clear()
        self._batch = None


class StagingPool:
    """Slots that saves take in turn; ``acquire`` blocks while all are in use.

    The pool starts with ``num_slots`` slots. A save that finds every slot
    busy starts building one more (same layout, pre-faulted) on a background
    thread and takes whichever comes first, a released slot or the finished
    spare; so the pool grows to the deepest burst of saves, up to
    ``max_slots``, and keeps the spares until ``close``. With
    ``early_spare`` the first spare is started as soon as the pool has
    learnt its first layout (``start_early_spare``, after the first save),
    so the first burst finds it built.

    Args:
        num_slots: Number of slots to start with.
        max_slots: Most slots the pool grows to (None: ``num_slots``, fixed).
        prepare_nice: Niceness added to the preparer and spare-building threads.
        early_spare: Build one spare once the first layout is learnt.
        pause: Called by a spare build between its 8 MiB pieces; the engine
            passes its ``SaveGate.wait``, so a build yields to a save's copy.
        budget: Given the bytes staging holds now, the host memory budget
            (``asyncckpt._engine.budget.staging_budget``). With one, the pool
            keeps only as many slots (spares included) as copies of the
            state fit, fewer than ``num_slots`` if need be (saves then wait
            for a slot), and ``Slot.reserve`` refuses a state of which not
            even one copy fits. None: no limit.
    """

    def __init__(
        self,
        num_slots: int,
        *,
        max_slots: int | None = None,
        prepare_nice: int = 0,
        early_spare: bool = False,
        pause: Callable[[], None] | None = None,
        budget: Callable[[int], Budget] | None = None,
    ):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self._num_slots = num_slots
        self._max_slots = num_slots if max_slots is None else max_slots
        if self._max_slots < num_slots:
            raise ValueError(f"max_slots must be >= num_slots ({num_slots}), got {max_slots}")
        self._budget = budget
        self._admitted = -1  # the state size reserve() last let through
        self._admitted_beside = 0  # and its writer's copy beside the slots
        self._beside = 0  # the writer's copy of the latest state admitted, held once
        self._slot_cap: int | None = None  # slots the budget allows for the layout
        self._cap_logged = False
        self._slots = [self._new_slot(i) for i in range(num_slots)]
        self._free = list(self._slots)
        self._cond = threading.Condition()
        self._prepare_nice = prepare_nice
        self._pause = pause
        self._layout: dict[str, int] = {}
        self._version = 0  # bumped whenever the layout changes
        self._preparer: threading.Thread | None = None
        self._spare: threading.Thread | None = None  # building one more slot
        self._spare_bytes = 0  # allocated so far by that build
        self._spare_failed = False
        self._spare_refused = False
        self._early_spare = early_spare  # cleared once the first layout is learnt
        self._early_due = False  # a layout is learnt: start_early_spare() builds one
        self._closed = False

    def _new_slot(self, index: int) -> Slot:
        slot = Slot(index)
        if self._budget is not None:
            slot._admit = self._admit
        return slot

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def layout_nbytes(self) -> int:
        """Bytes of one staged state of the layout learnt last (0 before any)."""
        return sum(self._layout.values())

    @property
    def slot_cap(self) -> int | None:
        """Slots the host memory budget allows for the current layout (None: no cap)."""
        return self._slot_cap

    def _admit(self, nbytes: int, beside: int = 0) -> None:
        """``Slot.reserve``: refuses a state of which not even one copy fits the budget.

        ``beside``: what the state's writer holds copied outside the slots,
        counted once with the one copy.
        """
        if nbytes <= self._admitted and beside <= self._admitted_beside:
            return
        assert self._budget is not None
        budget = self._budget(self.nbytes)
        if budget.nbytes is not None and nbytes + beside > budget.nbytes:
            writer = (f" and its writer {_size(beside)} more while it writes "
                      "(copies of small values for the leaves of an OCDBT B-tree)" if beside
                      else "")
            raise HostMemoryError(
                f"a staging copy of this state needs {nbytes / 2**20:.1f} MiB{writer}, over the "
                f"host memory budget for staging of {budget.nbytes / 2**20:.1f} MiB "
                f"({budget.why}); nothing was allocated. Raise AsyncOptions.host_memory_limit "
                "(or host_memory_fraction) if the host has the memory, or save less state.",
                state_nbytes=nbytes, budget_nbytes=budget.nbytes)
        self._admitted = max(self._admitted, nbytes)
        self._admitted_beside = max(self._admitted_beside, beside)
        self._beside = beside

    def _apply_budget(self, state_nbytes: int) -> int | None:
        """Caps the slots at the copies of the state the budget allows; ``_cond`` held.

        Free slots over the cap are dropped now, busy ones as they are
        released. Returns the number of copies that fit (None: no limit),
        which may be 0.
        """
        if self._budget is None or state_nbytes <= 0:
            return None
        budget = self._budget(self.nbytes)
        fits = budget.slots_for(state_nbytes, beside=self._beside)
        self._slot_cap = None if fits is None else max(1, fits)
        if self._slot_cap is None:
            return None
        if self._slot_cap < self._num_slots and not self._cap_logged:
            self._cap_logged = True
            logger.warning(
                "host memory budget: %d of %d staging slots for this state (%.1f MiB each; "
                "budget %.1f MiB: %s); a save waits for a free slot instead",
                self._slot_cap, self._num_slots, state_nbytes / 2**20,
                (budget.nbytes or 0) / 2**20, budget.why)
        while len(self._slots) > self._slot_cap and self._free:
            # The coldest free slot goes: the one holding least of the layout.
            victim = min(self._free, key=lambda s: (s._ready == self._version, s.nbytes))
            self._retire(victim)
        return fits

    def make_room(self, nbytes: int) -> int:
        """Frees idle slots' buffers so that staging plus ``nbytes`` more fit the budget.

        For a restore, whose destination arrays need host memory while the
        slots hold theirs: free slots give their buffers up (the next save
        allocates them again, as a first save does); busy ones keep theirs.
        Returns the bytes freed (0 without a budget, or when it all fits).
        """
        if self._budget is None or nbytes <= 0:
            return 0
        with self._cond:
            budget = self._budget(self.nbytes)
            if budget.nbytes is None:
                return 0
            freed = 0
            for slot in sorted(self._free, key=lambda s: s.nbytes, reverse=True):
                if self.nbytes + nbytes <= budget.nbytes or not slot.nbytes:
                    break
                freed += slot.nbytes
                slot.clear()
                slot._ready, slot._changed = -1, True
            if self.nbytes + nbytes > budget.nbytes:
                logger.warning(
                    "host memory budget: a restore of about %.1f MiB beside %.1f MiB of staging "
                    "in use is over the budget of %.1f MiB (%s)", nbytes / 2**20,
                    self.nbytes / 2**20, budget.nbytes / 2**20, budget.why)
            elif freed:
                logger.info("host memory budget: freed %.1f MiB of idle staging for a restore "
                            "of about %.1f MiB", freed / 2**20, nbytes / 2**20)
            return freed

    def _retire(self, slot: Slot) -> None:
        """Drops a slot the budget no longer allows, freeing its memory; ``_cond`` held."""
        if slot in self._free:
            self._free.remove(slot)
        self._slots.remove(slot)
        slot.clear()
        logger.debug("staging pool shrank to %d slots", len(self._slots))

    @property
    def in_use(self) -> int:
        with self._cond:
            return len(self._slots) - len(self._free)

    @property
    def max_slots(self) -> int:
        return self._max_slots

    @property
    def nbytes(self) -> int:
        """Host memory held by all slots, a spare being built included."""
        return sum(s.nbytes for s in list(self._slots)) + self._spare_bytes

    def acquire(self, timeout: float | None = None) -> tuple[Slot, float]:
        """Takes a free slot, waiting for the writer to release one if needed.

        Returns:
            The slot and the seconds spent waiting for it.

        Raises:
            TimeoutError: No slot became free within ``timeout`` seconds.
        """
        start = time.perf_counter()
        with self._cond:
            if not self._free:
                self._grow()
            if not self._free and not self._cond.wait_for(lambda: self._free, timeout=timeout):
                raise TimeoutError(f"no staging slot became free within {timeout} s")
            # Prefer the most recently released slot that holds the whole
            # layout: its pages are the warmest, and it allocates nothing.
            pick = len(self._free) - 1
            for i in range(pick, -1, -1):
                if self._free[i]._ready == self._version:
                    pick = i
                    break
            slot = self._free.pop(pick)
        slot.begin()
        return slot, time.perf_counter() - start

    def _grow(self) -> None:
        """Starts building one more slot of the layout, if allowed; ``_cond`` held."""
        if (self._closed or self._spare is not None or self._spare_failed or not self._layout
                or len(self._slots) >= self._max_slots):
            return
        layout = dict(self._layout)
        fits = self._apply_budget(sum(layout.values()))  # memory may have changed since
        if fits is not None and len(self._slots) + 1 > fits:
            if not self._spare_refused:  # said once; checked again at the next wait
                self._spare_refused = True
                logger.info("no spare staging slot: %d copies of %.1f MiB would be over the "
                            "host memory budget", len(self._slots) + 1,
                            sum(layout.values()) / 2**20)
            return
        self._spare = threading.Thread(
            target=self._build_spare, args=(layout,), name="asyncckpt-spare", daemon=True
        )
        self._spare.start()

    def _fault_piece(self, piece: np.ndarray) -> None:
        """Touches the pages of one piece of a spare's buffer (a hook for tests)."""
        touch_pages(piece)

    def _count_spare(self, nbytes: int) -> None:
        self._spare_bytes += nbytes  # only the spare's thread writes it

    def _build_spare(self, layout: Mapping[str, int]) -> None:
        """The spare's thread: builds every buffer, then adds the slot as a free one."""
        bufs = None
        try:
            lower_thread_priority(self._prepare_nice)
            bufs = _spares.build_buffers(
                layout, lambda: self._closed, self._fault_piece, self._count_spare,
                pause=self._pause)
        except Exception:  # e.g. MemoryError: saves wait for a slot, as without spares
            logger.exception("building a spare staging slot failed; saves wait for a free one")
            self._spare_failed = True
        finally:
            with self._cond:
                self._spare = None
                self._spare_bytes = 0
                cap = self._slot_cap
                if bufs is not None and not self._closed and (cap is None
                                                              or len(self._slots) < cap):
                    slot = self._new_slot(len(self._slots))
                    for key, buf in bufs.items():
                        if self._layout.get(key) == buf.nbytes:  # else: the layout changed
                            slot._install(key, buf)
                            slot.prepared += 1
                    if not slot._missing(self._layout):
                        slot._ready, slot._changed = self._version, False
                    self._slots.append(slot)
                    self._free.append(slot)
                    logger.debug("staging pool grew to %d slots", len(self._slots))
                self._cond.notify_all()

    def release(self, slot: Slot) -> None:
        """Returns a slot to the pool once its bytes are safely in files."""
        with self._cond:
            if slot in self._free:
                raise RuntimeError(f"staging slot {slot.index} released twice")
            if self._slot_cap is not None and len(self._slots) > self._slot_cap:
                self._retire(slot)  # over the host memory budget: its memory goes
                return
            self._free.append(slot)
            self._cond.notify()

    def learn(self, slot: Slot) -> None:
        """Records the layout ``slot`` was just staged with, and prepares the others.

        Called on the saving thread after staging (and ``trim``); costs
        nothing when the layout is the one already known.
        """
        if not slot._changed and slot._ready == self._version:
            return
        slot._changed = False
        self.prepare(slot.layout(), _ready=slot, background=False)
        if self._early_spare:
            self._early_due, self._early_spare = True, False

    def start_early_spare(self) -> None:
        """Starts the early spare once the first layout is known (see ``early_spare``).

        Called by the writer thread as it takes a save (starting a thread
        waits until it runs: not on the saving thread); costs one attribute
        read for every other save.
        """
        if not self._early_due:
            return
        with self._cond:
            self._early_due = False
            self._grow()

    def prepare(
        self,
        layout: Mapping[str, int],
        *,
        background: bool = True,
        _ready: Slot | None = None,
    ) -> None:
        """Builds buffers of ``layout`` (key to byte size) in the free slots.

        Buffers a free slot holds outside ``layout`` are dropped first, so a
        layout change does not hold two layouts' memory.

        Args:
            layout: Byte size of each buffer, by key.
            background: Build on the preparer thread and return at once;
                otherwise build now, on this thread and the copy threads,
                and return when every free slot holds the layout. A save
                that has just learned a new layout does the latter (see
                ``learn``).

        Raises:
            HostMemoryError: (``background``) not even one copy of the
                layout fits the host memory budget; nothing is built.
        """
        with self._cond:
            if self._closed:
                return
            if background and self._budget is not None:
                self._admit(sum(layout.values()))
            if layout != self._layout:
                self._layout = dict(layout)
                self._version += 1
            self._apply_budget(sum(self._layout.values()))
            if _ready is not None:
                _ready._ready = self._version
            if not background:
                self._build_now()
                return
            if self._preparer is None and self._next_work() is not None:
                self._preparer = threading.Thread(
                    target=self._prepare_loop, name="asyncckpt-prepare", daemon=True
                )
                self._preparer.start()

    def _build_now(self) -> None:
        """Builds what the free slots miss of the layout, on this thread and the copy threads.

        Called with ``_cond`` held; releases it while pages are touched (in
        parallel, without the GIL), and installs a slot's buffers only while
        the slot is still free, as the preparer thread does.
        """
        while not self._closed:
            work = self._next_work()
            if work is None:
                return
            slot, missing = work
            self._cond.release()
            try:
                bufs = packed_empty([nbytes for _, nbytes in missing], prefault=False)
                prefault_all(bufs)
            except Exception:  # e.g. MemoryError: the save itself succeeded
                logger.exception("preparing staging slots failed; they are filled on demand")
                return
            finally:
                self._cond.acquire()
            if slot not in self._free:
                continue  # taken meanwhile: it fills itself on demand
            for (key, nbytes), buf in zip(missing, bufs, strict=True):
                if self._layout.get(key) == nbytes:
                    slot._install(key, buf)
                    slot.prepared += 1
            del bufs, work, slot

    def wait_prepared(self, timeout: float | None = None) -> bool:
        """Waits until the preparer and any spare build are done; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._preparer is None and self._spare is None, timeout=timeout
            )

    def _next_work(self) -> tuple[Slot, list[tuple[str, int]]] | None:
        """The next buffers to build: a free slot and what it misses of the layout.

        Called with ``_cond`` held. Drops stale buffers of free slots on the way.
        """
        for slot in reversed(self._free):
            stale = [k for k in slot._buffers if k not in self._layout]
            for key in stale:
                slot._drop(key)
            if slot._ready == self._version:
                continue
            missing = slot._missing(self._layout)
            if missing:
                return slot, missing
            slot._ready = self._version
        return None

    def _prepare_loop(self) -> None:
        """The preparer thread: builds one buffer at a time, then exits when idle.

        It holds the pool only while there is work, so a dropped engine's
        staging memory is freed as usual.
        """
        lower_thread_priority(self._prepare_nice)
        built = 0
        try:
            while True:
                with self._cond:
                    work = None if self._closed else self._next_work()
                    if work is None:
                        self._preparer = None
                        self._cond.notify_all()
                        break
                slot, missing = work
                bufs = packed_empty([nbytes for _, nbytes in missing])
                with self._cond:
                    # Installed only into a slot nobody holds, and only where
                    # the layout still wants them: acquire() never sees a
                    # half-built buffer.
                    if not self._closed and slot in self._free:
                        for (key, nbytes), buf in zip(missing, bufs, strict=True):
                            if self._layout.get(key) == nbytes:
                                slot._install(key, buf)
                                slot.prepared += 1
                                built += 1
                del bufs, work, slot, missing
        except BaseException:
            logger.exception("preparing staging slots failed; they are filled on demand")
            with self._cond:
                self._preparer = None
                self._cond.notify_all()
        if built:
            logger.debug("prepared %d staging buffer(s) in the background", built)

    def close(self) -> None:
        """Frees all host buffers."""
        with self._cond:
            self._closed = True
            for slot in self._slots:
                slot.clear()
            spare = self._spare
            self._cond.notify_all()
        if spare is not None and spare is not threading.current_thread():
            spare.join()  # it stops within one 8 MiB piece and drops what it built
