"""Spare staging slots: the pool learns the depth of a burst of saves (issue 13, item 3)."""

from __future__ import annotations

import dataclasses
import gc
import threading
import weakref

import numpy as np
import pytest

from asyncckpt import AsyncOptions
from asyncckpt._engine.budget import Budget
from asyncckpt._engine.slots import StagingPool
from asyncckpt._engine.writer import AsyncEngine
from tests.test_engine_slots import _LAYOUT, _bytes_of, _Recorder, _state

_MB = 1 << 20


class _GatedPool(StagingPool):
    """A real pool whose spare builds stop at a gate before their first page."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.pieces: list[weakref.ref] = []

    def _fault_piece(self, piece: np.ndarray) -> None:
        self.pieces.append(weakref.ref(piece.base))
        self.entered.set()
        assert self.gate.wait(60), "test never opened the gate"
        super()._fault_piece(piece)


def _spare_done(pool: StagingPool) -> bool:
    with pool._cond:
        return pool._cond.wait_for(lambda: pool._spare is None, timeout=60)


def _first_save(pool: StagingPool, layout: dict[str, int]):
    """Acquires a slot, stages ``layout`` into it and teaches the pool; returns the slot."""
    slot, _ = pool.acquire()
    for key, nbytes in layout.items():
        slot.buffer(key, (nbytes,), np.uint8)
    slot.trim()
    pool.learn(slot)
    pool.start_early_spare()  # as the engine does once the save is queued
    return slot


def _acquire_in_thread(pool: StagingPool) -> tuple[threading.Thread, list]:
    got: list = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(timeout=60)[0]))
    t.start()
    return t, got


_POOL_LAYOUT = {"a": 3 * _MB, "b": 9 * _MB, "c": 100}


@pytest.mark.parametrize("first", ["released", "spare"])
def test_a_waiting_save_takes_a_released_slot_or_the_finished_spare_never_a_half_built_one(first):
    pool = _GatedPool(2, max_slots=3)
    a = _first_save(pool, _POOL_LAYOUT)
    b, _ = pool.acquire()
    t, got = _acquire_in_thread(pool)  # finds no free slot: a spare is started
    assert pool.entered.wait(30)
    t.join(0.2)
    assert t.is_alive() and not got  # the spare is held at the gate, unfinished
    assert pool.num_slots == 2 and len(pool._free) == 0
    # Memory accounting counts what the build has allocated already.
    assert pool.nbytes > 2 * sum(_POOL_LAYOUT.values())
    if first == "released":
        pool.release(a)
        t.join(60)
        assert got == [a]
        pool.gate.set()
    else:
        pool.gate.set()
        t.join(60)
        spare = got[0]
        assert spare not in (a, b) and spare.index == 2
        assert spare.layout() == _POOL_LAYOUT and spare._ready == pool._version
        assert spare.prepared == len(_POOL_LAYOUT)
        for key, nbytes in _POOL_LAYOUT.items():  # every buffer ready: nothing allocated
            spare.buffer(key, (nbytes,), np.uint8)
        assert spare.allocations == 0
    assert _spare_done(pool)
    assert pool.num_slots == 3
    assert pool.nbytes == 3 * sum(_POOL_LAYOUT.values())
    pool.close()
    assert pool.nbytes == 0


def _close_while_building(pool, held) -> None:
    """Closes ``pool`` while its spare build waits at the gate; nothing hangs or stays."""
    spare_thread = pool._spare
    assert spare_thread is not None
    closer = threading.Thread(target=pool.close)
    closer.start()
    pool.gate.set()
    closer.join(60)
    assert not closer.is_alive() and not spare_thread.is_alive()
    assert pool.num_slots == 1 and pool.nbytes == 0 and held.layout() == {}
    gc.collect()
    assert pool.pieces and all(ref() is None for ref in pool.pieces)  # the spare's memory is gone


def test_close_during_a_spare_build_neither_hangs_nor_leaks():
    pool = _GatedPool(1, max_slots=2)
    held = _first_save(pool, _POOL_LAYOUT)
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0.01)  # no free slot: starts a spare, then gives up waiting
    assert pool.entered.wait(30)
    _close_while_building(pool, held)
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0.01)  # closed: no spare is started any more
    assert pool._spare is None and pool.num_slots == 1


def test_engine_pool_grows_to_the_burst_depth_and_stops_at_the_cap(tmp_path):
    gate = threading.Event()  # closed: every save stays in flight
    rec = _Recorder(str(tmp_path), gate)
    state = _state(3, _LAYOUT)
    expected = {}
    n = 0

    def save():
        nonlocal n
        name = f"c{n}"
        n += 1
        engine.save(rec.stage(name, state), label=name, slot_timeout=60)
        expected[name] = _bytes_of(state)
        for v in state.values():  # the training step between saves
            v += 1

    # Spares built on waits only (an early spare is tested below).
    opts = AsyncOptions(num_slots=2, max_slots=4, early_spare=False)
    with AsyncEngine(options=opts, name="spares") as engine:
        pool = engine._pool
        try:
            for _ in range(3):  # a burst of 3: the third save can only get a spare
                save()
        finally:
            gate.set()
        engine.wait_until_finished()
        assert pool.num_slots == 3
        assert rec.seen[2] == (2, 0)  # the spare, complete: it allocated nothing
        gate.clear()
        try:
            for _ in range(3):  # the same burst again: every save finds a free slot
                save()
            assert pool.num_slots == 3
            save()  # a fourth: the pool grows to the cap, 4
            assert pool.num_slots == 4
            assert _spare_done(pool)
            # One more, at the cap: it waits for a write, as with fixed slots.
            t = threading.Thread(target=save)
            t.start()
            t.join(0.3)
            assert t.is_alive() and pool.num_slots == 4 and pool._spare is None
        finally:
            gate.set()
        t.join(60)
        engine.wait_until_finished()
        assert pool.num_slots == 4
        assert engine.staging_bytes == 4 * sum(v.nbytes for v in state.values())
        assert all(a == 0 for _, a in rec.seen[1:])  # only the first save allocated
    for name, want in expected.items():
        assert rec.read(name) == want


def test_fixed_slots_never_grow(tmp_path):
    gate = threading.Event()
    rec = _Recorder(str(tmp_path), gate)
    state = _state(4, _LAYOUT)
    with AsyncEngine(options=AsyncOptions(num_slots=1, max_slots=1), name="fixed") as engine:
        engine.save(rec.stage("a", state), label="a")
        with pytest.raises(TimeoutError):
            engine.save(rec.stage("b", state), label="b", slot_timeout=0.05)
        assert engine._pool.num_slots == 1 and engine._pool._spare is None
        gate.set()
    assert rec.read("a") == _bytes_of(state)


def test_max_slots_option_is_validated_and_defaults_to_one_spare():
    assert AsyncOptions().slot_cap == 3
    assert AsyncOptions(num_slots=4).slot_cap == 5
    assert AsyncOptions(num_slots=2, max_slots=2).slot_cap == 2
    assert dataclasses.replace(AsyncOptions(), num_slots=5).slot_cap == 6
    for bad in (1, 0, -3, 2.5, "4", True):
        with pytest.raises(ValueError, match="max_slots must be an int >= num_slots"):
            AsyncOptions(num_slots=2, max_slots=bad)
    with pytest.raises(TypeError):
        AsyncOptions(2, 3)  # keyword-only
    with pytest.raises(ValueError, match="max_slots"):
        StagingPool(3, max_slots=2)


class _SetBudget:
    """A host memory budget the test sets (the engine's reads the machine's figures)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def __call__(self, held: int) -> Budget:
        return Budget(self.nbytes, "set by the test")


_POOL_BYTES = sum(_POOL_LAYOUT.values())


def test_no_spare_is_built_beyond_the_memory_budget():
    budget = _SetBudget(_POOL_BYTES)  # one copy of the state: no memory to spare at all
    pool = _GatedPool(1, max_slots=3, budget=budget)
    _first_save(pool, _POOL_LAYOUT)
    for _ in range(2):  # refused each time a save waits: it waits as with fixed slots
        with pytest.raises(TimeoutError):
            pool.acquire(timeout=0.01)
        assert pool._spare is None and pool.num_slots == 1
    budget.nbytes = 3 * _POOL_BYTES
    # Memory again: this wait starts a spare. The gate holds the spare's build,
    # which could otherwise finish within even a zero timeout on a loaded machine
    # (the wait lets the builder take the lock) and be handed to this very call.
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0.0)
    assert pool.entered.wait(30)
    pool.gate.set()
    assert _spare_done(pool) and pool.num_slots == 2
    slot, _ = pool.acquire(timeout=60)
    assert slot.index == 1 and slot.layout() == _POOL_LAYOUT
    pool.close()


def test_early_spare_is_built_after_the_first_save_and_only_handed_out_complete():
    pool = _GatedPool(2, max_slots=3, early_spare=True)
    a = _first_save(pool, _POOL_LAYOUT)
    assert pool.entered.wait(30)  # no save waited: the first layout started the spare
    assert pool._spare is not None and pool.num_slots == 2
    b, _ = pool.acquire(timeout=60)  # the second save: the other slot, complete
    assert b is not a and b.index < 2 and b._ready == pool._version
    t, got = _acquire_in_thread(pool)  # the third: only the spare is left
    t.join(0.2)
    assert t.is_alive() and not got  # held at the gate, unfinished: not handed out
    pool.gate.set()
    t.join(60)
    spare = got[0]
    assert spare.index == 2 and spare.layout() == _POOL_LAYOUT
    assert spare._ready == pool._version and spare.prepared == len(_POOL_LAYOUT)
    for key, nbytes in _POOL_LAYOUT.items():
        spare.buffer(key, (nbytes,), np.uint8)
    assert spare.allocations == 0
    for slot in (a, b, spare):
        pool.release(slot)
    pool.learn(a)  # the same layout again: no second early spare, no growth
    pool.start_early_spare()
    assert pool._spare is None and pool.num_slots == 3
    pool.close()
    assert pool.nbytes == 0


def test_close_during_an_early_spare_build_neither_hangs_nor_leaks():
    pool = _GatedPool(1, max_slots=2, early_spare=True)
    held = _first_save(pool, _POOL_LAYOUT)
    assert pool.entered.wait(30)
    _close_while_building(pool, held)


@pytest.mark.parametrize("early", [True, False])
def test_engine_early_spare_option(tmp_path, early):
    gate = threading.Event()
    gate.set()  # writes go through
    rec = _Recorder(str(tmp_path), gate)
    state = _state(5, _LAYOUT)
    nbytes = sum(v.nbytes for v in state.values())
    opts = AsyncOptions(early_spare=early)
    assert not AsyncOptions().early_spare  # off by default: num_slots states of memory
    with AsyncEngine(options=opts, name="early") as engine:
        engine.save(rec.stage("a", state), label="a")
        engine.wait_until_finished()
        pool = engine._pool
        assert pool.wait_prepared(60)
        # Early: one spare beside the two slots, with no save having waited.
        assert pool.num_slots == (3 if early else 2)
        assert engine.staging_bytes == pool.num_slots * nbytes
        engine.save(rec.stage("b", state), label="b")
        engine.wait_until_finished()
        assert pool.wait_prepared(60) and pool.num_slots == (3 if early else 2)
    assert rec.read("b") == _bytes_of(state)


def test_no_early_spare_beyond_the_memory_budget():
    budget = _SetBudget(_POOL_BYTES)
    pool = _GatedPool(1, max_slots=2, early_spare=True, budget=budget)
    _first_save(pool, _POOL_LAYOUT)
    assert pool._spare is None and pool.num_slots == 1
    budget.nbytes = 2 * _POOL_BYTES
    with pytest.raises(TimeoutError):  # gated: see test_no_spare_is_built_beyond_the_memory_budget
        pool.acquire(timeout=0.0)  # memory again: a save that waits still starts one
    assert pool.entered.wait(30)
    pool.gate.set()
    assert _spare_done(pool) and pool.num_slots == 2
    pool.close()
