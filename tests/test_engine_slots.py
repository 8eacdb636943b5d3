"""Staging slots prepared in the background after the first save (issue 13.3)."""

from __future__ import annotations

import os
import threading

import numpy as np

from asyncckpt import AsyncOptions
from asyncckpt._engine.slots import Slot, StagingPool
from asyncckpt._engine.writer import AsyncEngine
from tests.jobs import DirJob

_MB = 1 << 20


def _GatedJob(root: str, name: str, bufs: dict[str, np.ndarray], gate: threading.Event):
    """Writes the staged buffers, in key order, into one file; waits for a gate first."""
    return DirJob(root, name, [bufs[k] for k in sorted(bufs)], gate=gate)


class _Recorder:
    """A stage function factory that records, per save, what the slot had to allocate."""

    def __init__(self, root: str, gate: threading.Event):
        self.root, self.gate = root, gate
        self.seen: list[tuple[int, int]] = []  # (slot index, on-demand allocations)

    def stage(self, name: str, state: dict[str, np.ndarray]):
        def stage(slot):
            bufs = {}
            for key, value in state.items():
                bufs[key] = slot.buffer(key, value.shape, value.dtype)
                np.copyto(bufs[key], value)
            self.seen.append((slot.index, slot.allocations))
            return _GatedJob(self.root, name, bufs, self.gate)
        return stage

    def read(self, name: str) -> bytes:
        with open(os.path.join(self.root, name, "data.bin"), "rb") as f:
            return f.read()


def _state(seed: int, shapes: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (rng.random(shape) * 1000).astype(dtype) for k, (shape, dtype) in shapes.items()}


def _bytes_of(state: dict[str, np.ndarray]) -> bytes:
    return b"".join(state[k].tobytes() for k in sorted(state))


_LAYOUT = {f"w{i:02d}": ((64, 1024 + i), "float32") for i in range(20)}  # ~5 MiB


def test_later_saves_find_their_slot_prepared_and_save_the_values_at_the_call(tmp_path):
    gate = threading.Event()  # closed: every save stays in flight, so each takes a new slot
    rec = _Recorder(str(tmp_path), gate)
    state = _state(0, _LAYOUT)
    expected = []
    # No early spare slot here: this counts what the preparation built.
    opts = AsyncOptions(num_slots=3, early_spare=False)
    with AsyncEngine(options=opts, name="prep") as engine:
        try:
            for i in range(3):
                engine.save(rec.stage(f"c{i}", state), label=f"c{i}")
                expected.append(_bytes_of(state))
                if i == 0:
                    assert engine._pool.wait_prepared(60)
                for v in state.values():  # the training step after the save
                    v += 1
        finally:
            gate.set()
        engine.wait_until_finished()
        # Only the first save allocated; the others found every buffer built.
        assert [a for _, a in rec.seen] == [len(_LAYOUT), 0, 0]
        assert len({i for i, _ in rec.seen}) == 3
        slots = engine._pool._slots
        assert sum(s.prepared for s in slots) == 2 * len(_LAYOUT)
        assert all(s.layout() == slots[0].layout() for s in slots)
        # Saves after the writer released slots reuse them without allocating.
        for i in range(3, 6):
            engine.save(rec.stage(f"c{i}", state), label=f"c{i}").result(60)
            expected.append(_bytes_of(state))
            for v in state.values():
                v += 1
        assert [a for _, a in rec.seen[3:]] == [0, 0, 0]
    for i, want in enumerate(expected):
        assert rec.read(f"c{i}") == want


def test_a_layout_change_stages_correctly_and_is_prepared_again(tmp_path):
    gate = threading.Event()
    gate.set()
    rec = _Recorder(str(tmp_path), gate)
    with AsyncEngine(options=AsyncOptions(num_slots=2), name="relayout") as engine:
        state = _state(1, _LAYOUT)
        engine.save(rec.stage("a", state), label="a").result(60)
        assert engine._pool.wait_prepared(60)
        want_a = _bytes_of(state)

        # New keys, a resized key, a dropped key, a changed dtype of equal size.
        shapes = dict(_LAYOUT)
        del shapes["w00"]
        shapes["w01"] = ((128, 1025), "float32")
        shapes["w02"] = ((64, 1026), "int32")
        shapes["extra"] = ((3, 5), "float64")
        state = _state(2, shapes)
        gate.clear()  # keep "b" in flight, so "c" takes the other slot
        try:
            engine.save(rec.stage("b", state), label="b")
            want_b = _bytes_of(state)
            for v in state.values():
                v += 1
            assert engine._pool.wait_prepared(60)
            engine.save(rec.stage("c", state), label="c")
            want_c = _bytes_of(state)
        finally:
            gate.set()
        engine.wait_until_finished()
        (slot_b, alloc_b), (slot_c, alloc_c) = rec.seen[1:]
        assert slot_b != slot_c
        assert alloc_b == 2  # "w01" resized and "extra" new; the rest reused
        assert alloc_c == 0  # prepared for the new layout in the background
        want_layout = {k: np.dtype(d).itemsize * int(np.prod(s)) for k, (s, d) in shapes.items()}
        for slot in engine._pool._slots:
            assert slot.layout() == want_layout  # nothing of the old layout left
    assert rec.read("a") == want_a
    assert rec.read("b") == want_b
    assert rec.read("c") == want_c


def test_preparer_never_touches_a_held_slot_and_close_frees_everything():
    pool = StagingPool(3)
    held, _ = pool.acquire()
    layout = {"a": 3 * _MB, "b": 100, "c": 0}
    pool.prepare(layout)
    assert pool.wait_prepared(60)
    assert held.layout() == {}
    free = [s for s in pool._slots if s is not held]
    assert all(s.layout() == layout and s.prepared == 3 for s in free)
    # A ready slot is preferred over the (empty) one released last.
    pool.release(held)
    slot, _ = pool.acquire()
    assert slot is not held and slot.layout() == layout
    buf = slot.buffer("a", (3 * _MB // 4,), np.float32)
    assert slot.allocations == 0 and buf.ctypes.data % 64 == 0
    pool.release(slot)
    pool.close()
    assert pool.nbytes == 0
    pool.prepare({"z": _MB})  # after close: nothing is built
    assert pool.wait_prepared(60) and pool.nbytes == 0


def test_slot_hands_out_the_same_view_until_the_request_or_the_buffer_changes():
    slot = Slot(0)
    slot.begin()
    a = slot.buffer("k", (4, 4), np.float32)
    assert slot.buffer("k", (4, 4), np.float32) is a  # steady state: no new view
    b = slot.buffer("k", (16,), np.float32)  # same bytes, another shape
    assert b.shape == (16,) and np.shares_memory(a, b)
    c = slot.buffer("k", (4, 4), np.int32)  # same bytes, another dtype
    assert c.dtype == np.int32 and c.shape == (4, 4) and np.shares_memory(a, c)
    d = slot.buffer("k", (8, 4), np.float32)  # another size: a new buffer
    assert d.shape == (8, 4) and not np.shares_memory(a, d)
    slot.begin()
    slot.buffer("other", (2,), np.float64)
    slot.trim()  # "k" was not used by this save: dropped, view and all
    assert slot.layout() == {"other": 16}
    slot.begin()
    e = slot.buffer("k", (8, 4), np.float32)
    assert not np.shares_memory(d, e) and slot.allocations == 1


def test_slot_hands_out_the_same_buffer_list_until_a_buffer_of_it_changes():
    import gc
    import weakref

    slot = Slot(0)
    keys, shapes, dtypes = ("a", "b"), ((4,), (2, 2)), (np.dtype(np.float32),) * 2
    slot.begin()
    first = slot.buffers(keys, shapes, dtypes)
    assert [v.shape for v in first] == [(4,), (2, 2)] and slot.allocations == 2
    # The next save with the plan's same tuples: the same list, its keys in use.
    slot.begin()
    assert slot.buffers(keys, shapes, dtypes) is first
    slot.trim()
    assert slot.layout() == {"a": 16, "b": 16} and slot.allocations == 0
    # Equal but other tuples (another plan): built again, same memory.
    again = slot.buffers(tuple(list(keys)), tuple(list(shapes)), dtypes)
    assert again is not first and all(map(np.shares_memory, again, first))
    # A buffer of the list changed through buffer(): the list is built again.
    primed = slot.buffers(keys, shapes, dtypes)
    slot.buffer("a", (8,), np.float32)
    third = slot.buffers(keys, shapes, dtypes)
    assert third is not primed and not np.shares_memory(third[0], primed[0])
    assert third[0].shape == (4,) and np.shares_memory(third[1], primed[1])
    # A save that uses only "b" trims "a": the list neither keeps it alive
    # nor is handed out again without it.
    dropped = weakref.ref(slot._buffers["a"])
    slot.begin()
    slot.buffer("b", (2, 2), np.float32)
    slot.trim()
    del first, again, primed, third
    gc.collect()
    assert dropped() is None and slot.layout() == {"b": 16}
    slot.begin()
    assert slot.buffers(keys, shapes, dtypes)[0].shape == (4,) and slot.allocations == 1
    assert slot.layout() == {"a": 16, "b": 16}
    # The pool's preparer installs a buffer: the list is built again too.
    slot.begin()
    listed = slot.buffers(keys, shapes, dtypes)
    slot._install("b", np.zeros(16, np.uint8))
    fresh = slot.buffers(keys, shapes, dtypes)
    assert fresh is not listed and not np.shares_memory(fresh[1], listed[1])
