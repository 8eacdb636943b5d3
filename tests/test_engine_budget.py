"""The host memory budget: staging never holds more than ``AsyncOptions.host_memory_limit``."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from asyncckpt import AsyncOptions
from asyncckpt._engine import budget as budget_lib
from asyncckpt._engine.writer import AsyncEngine
from asyncckpt.errors import HostMemoryError
from tests.helpers import subprocess_env, write_script
from tests.test_engine_slots import _LAYOUT, _bytes_of, _Recorder, _state


class _Reserving(_Recorder):
    """The recorder's stage function, saying the state's size first as the adapters do."""

    def stage(self, name, state):
        inner = super().stage(name, state)

        def stage(slot):
            slot.reserve(sum(v.nbytes for v in state.values()))
            return inner(slot)

        return stage


def _nbytes(state) -> int:
    return sum(v.nbytes for v in state.values())


def test_fewer_slots_when_the_budget_allows_fewer_copies(tmp_path, caplog):
    gate = threading.Event()  # holds the writer: the first save keeps its slot
    rec = _Reserving(str(tmp_path), gate)
    state = _state(1, _LAYOUT)
    nbytes = _nbytes(state)
    opts = AsyncOptions(num_slots=2, host_memory_limit=nbytes * 3 // 2)
    with caplog.at_level(logging.WARNING, logger="asyncckpt._engine.slots"), \
            AsyncEngine(options=opts, name="budget") as engine:
        engine.save(rec.stage("a", state), label="a")
        assert engine._pool.num_slots == 1 and engine._pool.slot_cap == 1
        assert engine.staging_bytes == nbytes  # never a second copy
        # The second save waits for the one slot rather than over-committing.
        done = []
        t = threading.Thread(target=lambda: done.append(
            engine.save(rec.stage("b", _state(2, _LAYOUT)), label="b")))
        t.start()
        t.join(0.3)
        assert t.is_alive() and not done
        gate.set()
        t.join(60)
        assert done and engine.staging_bytes == nbytes
        engine.save(rec.stage("c", _state(3, _LAYOUT)), label="c")
        engine.wait_until_finished()
        assert engine._pool.num_slots == 1
    assert rec.read("b") == _bytes_of(_state(2, _LAYOUT))
    warnings = [r for r in caplog.records if "host memory budget" in r.getMessage()]
    assert len(warnings) == 1  # said once
    assert "1 of 2 staging slots" in warnings[0].getMessage()


def test_a_state_over_the_budget_is_refused_before_anything_is_allocated(tmp_path):
    gate = threading.Event()
    gate.set()
    rec = _Reserving(str(tmp_path), gate)
    big = _state(1, _LAYOUT)
    small = {"x": np.arange(1000, dtype=np.float32)}
    with AsyncEngine(options=AsyncOptions(host_memory_limit=_nbytes(big) // 2)) as engine:
        with pytest.raises(HostMemoryError) as info:
            engine.save(rec.stage("big", big), label="big")
        assert engine.staging_bytes == 0  # refused before the first buffer
        err = info.value
        assert isinstance(err, MemoryError)
        assert err.state_nbytes == _nbytes(big) and err.budget_nbytes == _nbytes(big) // 2
        assert f"{_nbytes(big) / 2**20:.1f} MiB" in str(err) and "host_memory_limit" in str(err)
        with pytest.raises(HostMemoryError):  # prepare() says so too, before building
            engine.prepare_staging({k: v.nbytes for k, v in big.items()})
        assert engine.staging_bytes == 0
        engine.save(rec.stage("small", small), label="small")  # the engine goes on
        engine.wait_until_finished()
    assert rec.read("small") == _bytes_of(small)


def test_spares_stay_within_the_budget(tmp_path):
    gate = threading.Event()  # holds the writer: every save keeps its slot
    rec = _Reserving(str(tmp_path), gate)
    state = _state(1, _LAYOUT)
    nbytes = _nbytes(state)
    opts = AsyncOptions(num_slots=1, max_slots=3, early_spare=True,
                        host_memory_limit=2 * nbytes + nbytes // 2)
    with AsyncEngine(options=opts) as engine:
        pool = engine._pool
        engine.save(rec.stage("s0", state), label="s0")
        # The writer starts the early spare as it takes s0; it fits the budget.
        deadline = time.monotonic() + 60
        while pool.num_slots < 2 and time.monotonic() < deadline:
            pool.wait_prepared(1)
        assert pool.num_slots == 2
        engine.save(rec.stage("s1", state), label="s1")  # takes the spare
        t = threading.Thread(target=engine.save, args=(rec.stage("s2", state),),
                             kwargs={"label": "s2"})
        t.start()
        t.join(0.3)
        # A third copy is over the budget: no spare is built, the save waits.
        assert t.is_alive() and pool._spare is None and pool.num_slots == 2
        assert engine.staging_bytes == 2 * nbytes
        gate.set()
        t.join(60)
        engine.wait_until_finished()
        assert pool.num_slots == 2 and engine.staging_bytes == 2 * nbytes
    assert rec.read("s2") == _bytes_of(state)


def test_options_are_checked():
    assert not AsyncOptions().early_spare
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="host_memory_limit"):
            AsyncOptions(host_memory_limit=bad)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="host_memory_fraction"):
            AsyncOptions(host_memory_fraction=bad)


def test_default_budget_is_a_fraction_of_what_the_process_can_still_take():
    room = budget_lib.headroom()
    assert room is not None and room.nbytes > 0
    b = budget_lib.staging_budget(None, 0.5, held=1 << 20)
    assert b.nbytes is not None
    # Read twice (the machine moves): within a margin of half the headroom plus staging.
    assert abs(b.nbytes - (room.nbytes + (1 << 20)) // 2) < 256 << 20
    assert budget_lib.staging_budget(123, 0.5, held=0).nbytes == 123


_CHILD = """
    import json, os, resource, sys
    import numpy as np
    from asyncckpt import AsyncOptions
    from asyncckpt._engine.writer import AsyncEngine
    from asyncckpt._engine.budget import headroom
    from asyncckpt.errors import HostMemoryError
    from tests.test_engine_slots import _Recorder

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    S = int(sys.argv[2])
    limit = status("VmSize") + S + 5 * S // 2  # the state, and room for 2.5 more copies
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = {"limit": limit, "headroom_source": headroom().source}
    state = {f"w{i}": np.full(S // 8 // 4, i, np.float64) for i in range(4)}  # S bytes

    class Reserving(_Recorder):
        def stage(self, name, st):
            inner = super().stage(name, st)
            def stage(slot):
                slot.reserve(sum(v.nbytes for v in st.values()))
                return inner(slot)
            return stage

    import threading
    gate = threading.Event(); gate.set()
    rec = Reserving(sys.argv[1], gate)
    # The old defaults (two slots and an early spare: three copies) cannot fit here.
    with AsyncEngine(options=AsyncOptions(num_slots=2, max_slots=3, early_spare=True)) as engine:
        for step in range(4):
            for v in state.values():
                v += 1
            engine.save(rec.stage(f"s{step}", state), label=f"s{step}")
        engine.wait_until_finished()
        out["slots"] = engine._pool.num_slots
        out["staging_bytes"] = engine.staging_bytes
        with open(os.path.join(sys.argv[1], "s3", "data.bin"), "rb") as f:  # piece by piece:
            out["saved_ok"] = all(f.read(state[k].nbytes) == state[k].tobytes()  # little room
                                  for k in sorted(state))
    del state
    # A state above half the limit (or, where thread arenas took address space, as
    # much as is left): not even one copy of it fits beside it. Refused with an
    # error that says so, before allocating; the process is not killed.
    room = limit - status("VmSize")
    big = {"big": np.ones(min(limit // 2 + (1 << 20), room - (48 << 20)) // 8)}
    with AsyncEngine() as engine:
        try:
            engine.save(rec.stage("big", big), label="big")
            out["big"] = "saved"
        except HostMemoryError as e:
            out["big"] = str(e)
        out["big_staging_bytes"] = engine.staging_bytes
    out["vm_peak"] = status("VmPeak")
    out["rss_peak"] = status("VmHWM")
    print(json.dumps(out))
"""


def test_saves_complete_under_a_real_memory_limit(tmp_path):
    """A real ``RLIMIT_AS``: the default budget keeps staging to what fits; nothing is killed."""
    state_bytes = 96 << 20
    script = write_script(tmp_path, "child.py", _CHILD)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "out"), str(state_bytes)],
                          env=subprocess_env(MALLOC_ARENA_MAX="2"), capture_output=True,
                          text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["headroom_source"] == "RLIMIT_AS"
    assert out["slots"] == 1 and out["staging_bytes"] == state_bytes  # one copy fits, not two
    assert out["saved_ok"]
    assert out["big"].startswith("a staging copy of this state needs")
    assert out["big_staging_bytes"] == 0
    assert out["vm_peak"] <= out["limit"]


def test_framework_saves_say_their_size_before_allocating(tmp_path):
    """Both adapters reserve: a state over the budget is refused by save() and prepare()."""
    tf = pytest.importorskip("tensorflow")
    jax = pytest.importorskip("jax")
    import asyncckpt.jax as aj
    import asyncckpt.tf as at

    limit = AsyncOptions(host_memory_limit=1 << 20)  # 1 MiB: under the 4 MiB states below
    ckpt = tf.train.Checkpoint(v=tf.Variable(np.ones((1024, 1024), np.float32)))
    with at.CheckpointManager(ckpt, str(tmp_path / "tf"), max_to_keep=1,
                              async_options=limit) as mgr:
        with pytest.raises(HostMemoryError, match=r"4\.0 MiB"):
            mgr.prepare()
        with pytest.raises(HostMemoryError, match=r"4\.0 MiB"):
            mgr.save()
        assert mgr.engine.staging_bytes == 0 and mgr.checkpoints == []
    state = {"w": jax.numpy.ones((1024, 1024), jax.numpy.float32)}
    with aj.CheckpointManager(str(tmp_path / "jax"), async_options=limit) as mgr:
        with pytest.raises(HostMemoryError, match=r"4\.0 MiB"):
            mgr.prepare(state)
        with pytest.raises(HostMemoryError, match=r"4\.0 MiB"):
            mgr.save(1, state)
        assert mgr.engine.staging_bytes == 0 and mgr.all_steps() == []


class _ReservingBeside(_Recorder):
    """Says the state's size and a writer's copy beside the slots, as the OCDBT writer does."""

    def __init__(self, directory, gate, beside: int):
        super().__init__(directory, gate)
        self.beside = beside

    def stage(self, name, state):
        inner = super().stage(name, state)

        def stage(slot):
            slot.reserve(_nbytes(state), beside=self.beside)
            return inner(slot)

        return stage


def test_the_writers_copy_beside_the_slots_counts_once_in_the_budget(tmp_path, caplog):
    gate = threading.Event()  # holds the writer: the first save keeps its slot
    state = _state(1, _LAYOUT)
    nbytes = _nbytes(state)
    # Two copies fit the budget; two copies and the writer's copy of half a state do not.
    opts = AsyncOptions(num_slots=2, host_memory_limit=2 * nbytes + nbytes // 4)
    with AsyncEngine(options=opts) as engine:
        rec = _ReservingBeside(str(tmp_path), gate, beside=nbytes // 2)
        engine.save(rec.stage("a", state), label="a")
        try:
            assert engine._pool.slot_cap == 1 and engine._pool.num_slots == 1
        finally:
            gate.set()  # a failed check must not leave close() waiting on the writer
        engine.wait_until_finished()
    assert rec.read("a") == _bytes_of(state)
    with AsyncEngine(options=opts) as engine:  # the same state without a writer's copy
        rec = _ReservingBeside(str(tmp_path / "plain"), gate, beside=0)
        engine.save(rec.stage("a", state), label="a")
        assert engine._pool.slot_cap == 2
        engine.wait_until_finished()
    # One copy and the writer's copy over the budget: refused, naming both, nothing allocated.
    with AsyncEngine(options=AsyncOptions(host_memory_limit=nbytes + nbytes // 4)) as engine:
        rec = _ReservingBeside(str(tmp_path / "over"), gate, beside=nbytes // 2)
        with pytest.raises(HostMemoryError, match="OCDBT B-tree") as info:
            engine.save(rec.stage("a", state), label="a")
        assert info.value.state_nbytes == nbytes and engine.staging_bytes == 0


def test_an_ocdbt_save_counts_its_copies_of_small_values_only(tmp_path):
    """Values written into data files from the slot cost no copy; values small enough for
    the B-tree's leaves are copied there, and counted."""
    jax = pytest.importorskip("jax")
    import asyncckpt.jax as aj
    from asyncckpt.jax._ocdbt import MAX_INLINE_VALUE_BYTES, held_copy_bytes

    mib = 1 << 20
    inline = MAX_INLINE_VALUE_BYTES
    assert held_copy_bytes([("w/0.0", 4 * mib, False)]) == 0  # into a data file, uncopied
    assert held_copy_bytes([("w/0", inline + 1, False)]) == 0
    assert held_copy_bytes([("w/0", inline, False)]) == inline  # into the leaf: copied
    assert held_copy_bytes([("w/.zarray", 300, True)]) == 0  # bytes: the plan holds them
    small = [(f"s/{i}", 1000, False) for i in range(1000)]
    assert held_copy_bytes([*small, ("big/0", 4 * mib, False)]) == 1_000_000

    jnp = jax.numpy
    one = {"w": jnp.ones((512, 1024), jnp.float32)}  # 2 MiB, one chunk: from the slot
    tiny = {f"w{i:04d}": jnp.ones((256,), jnp.float32) for i in range(2048)}  # 2048 x 1 KiB
    limit = AsyncOptions(host_memory_limit=3 * mib)  # one copy of either fits; not two
    with aj.CheckpointManager(str(tmp_path / "large"), async_options=limit) as mgr:
        mgr.save(1, one)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1]
        got = mgr.restore(1)
    np.testing.assert_array_equal(np.asarray(got["w"]), np.ones((512, 1024), np.float32))
    with aj.CheckpointManager(str(tmp_path / "small"), async_options=limit) as mgr:
        with pytest.raises(HostMemoryError, match="OCDBT B-tree"):
            mgr.save(1, tiny)  # 2 MiB staged and 2 MiB copied into the leaf
        assert mgr.engine.staging_bytes == 0 and mgr.all_steps() == []
    with aj.CheckpointManager(str(tmp_path / "zarr"), async_options=limit,
                              format_options=aj.FormatOptions(use_ocdbt=False)) as mgr:
        mgr.save(1, tiny)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1]


_LARGE_OCDBT_CHILD = """
    import json, sys
    import numpy as np
    import jax, jax.numpy as jnp
    import orbax.checkpoint as ocp
    import tensorstore  # noqa: F401  (loaded before the baseline: every OCDBT save loads it)
    import asyncckpt.jax as aj
    from asyncckpt import AsyncOptions
    from asyncckpt.errors import HostMemoryError

    MiB = 1 << 20

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    directory = sys.argv[1]
    bump = jax.jit(lambda t: {k: v + 1 for k, v in t.items()}, donate_argnums=0)
    jax.block_until_ready(bump({"w": jnp.zeros(4)}))  # JAX and its compiler warmed up
    out = {}
    try:  # the peak so far (imports) forgotten where the kernel allows it
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    base = status("VmRSS")
    state = {f"w{i}": jnp.full((8 * MiB,), float(i), jnp.float32) for i in range(8)}  # 256 MiB
    opts = AsyncOptions(host_memory_limit=450 * MiB)
    with aj.CheckpointManager(f"{directory}/fits", async_options=opts) as mgr:
        for step in range(3):
            mgr.save(step, state)  # staged into the slot before it returns
            state = bump(state)
        mgr.wait_until_finished()
        out["steps"] = mgr.all_steps()
        out["slots"] = mgr.engine._pool.num_slots
        out["staging_bytes"] = mgr.engine.staging_bytes
        out["growth"] = status("VmHWM") - base
        del state
        got = mgr.restore(2)
        out["asyncckpt_ok"] = all(
            bool((np.asarray(got[f"w{i}"]) == i + 2).all()) for i in range(8))
        del got
    with ocp.CheckpointManager(f"{directory}/fits") as orbax_mgr:
        got = orbax_mgr.restore(2, args=ocp.args.StandardRestore())
        out["orbax_ok"] = all(bool((np.asarray(got[f"w{i}"]) == i + 2).all()) for i in range(8))
        del got
    small = {f"w{i}": jnp.full((8 * MiB,), float(i), jnp.float32) for i in range(8)}
    with aj.CheckpointManager(f"{directory}/over",
                              async_options=AsyncOptions(host_memory_limit=100 * MiB)) as mgr:
        try:
            mgr.save(0, small)
            out["over"] = "saved"
        except HostMemoryError as e:
            out["over"] = str(e)
        out["over_staging_bytes"] = mgr.engine.staging_bytes
        out["over_steps"] = mgr.all_steps()
    print(json.dumps(out))
"""


def test_large_ocdbt_values_cost_no_copy_beside_the_slot(tmp_path):
    """A 256 MiB state of 32 MiB arrays under a 450 MiB budget: one slot, no writer copy.

    Measured in a process of its own (peak RSS, VmHWM): the saves grow it by
    the state, its one staging slot and less than 160 MiB more (TensorStore,
    JAX's transfers, the allocator), where a copy of the values by the writer
    would add 256 MiB. 100 MiB is still refused before anything is allocated.
    """
    pytest.importorskip("jax")
    pytest.importorskip("tensorstore")
    script = write_script(tmp_path, "child.py", _LARGE_OCDBT_CHILD)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)],
                          env=subprocess_env(MALLOC_ARENA_MAX="2"), capture_output=True,
                          text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    mib = 1 << 20
    assert out["steps"] == [0, 1, 2]
    assert out["slots"] == 1 and out["staging_bytes"] == 256 * mib
    assert out["asyncckpt_ok"] and out["orbax_ok"]
    assert out["growth"] <= (256 + 256 + 160) * mib, out["growth"] / mib
    assert out["over"].startswith("a staging copy of this state needs 256.0 MiB"), out["over"]
    assert out["over_staging_bytes"] == 0 and out["over_steps"] == []


def test_a_restore_makes_room_by_freeing_idle_staging(tmp_path):
    """Staging plus a restore's memory stay within the budget: idle slots give way."""
    gate = threading.Event()
    gate.set()
    rec = _Reserving(str(tmp_path), gate)
    state = _state(1, _LAYOUT)
    nbytes = _nbytes(state)
    opts = AsyncOptions(num_slots=2, host_memory_limit=2 * nbytes + nbytes // 2)
    with AsyncEngine(options=opts) as engine:
        engine.save(rec.stage("a", state), label="a")
        engine.wait_until_finished()
        assert engine.staging_bytes == 2 * nbytes  # two copies fit ...
        assert engine.make_room_for_restore() == nbytes  # ... but not a third for a restore
        assert engine.staging_bytes == nbytes
        assert engine.make_room_for_restore() == 0  # it fits now
        engine.save(rec.stage("b", _state(2, _LAYOUT)), label="b")  # slots come back on demand
        engine.wait_until_finished()
    assert rec.read("b") == _bytes_of(_state(2, _LAYOUT))
    with AsyncEngine(options=AsyncOptions(num_slots=2)) as engine:  # the machine has room
        engine.save(rec.stage("c", state), label="c")
        engine.wait_until_finished()
        assert engine.make_room_for_restore() == 0 and engine.staging_bytes == 2 * nbytes


def test_framework_restores_make_room(tmp_path):
    tf = pytest.importorskip("tensorflow")
    jax = pytest.importorskip("jax")
    import asyncckpt.jax as aj
    import asyncckpt.tf as at

    nbytes = 4 << 20
    limit = AsyncOptions(host_memory_limit=2 * nbytes + nbytes // 2)
    v = tf.Variable(np.ones((1024, 1024), np.float32))
    with at.CheckpointManager(tf.train.Checkpoint(v=v), str(tmp_path / "tf"), max_to_keep=1,
                              async_options=limit) as mgr:
        mgr.save()
        mgr.sync()
        assert mgr.engine.staging_bytes // nbytes == 2  # (and the save counter's 8 bytes)
        v.assign(np.zeros((1024, 1024), np.float32))
        assert mgr.restore_or_initialize() is not None
        assert mgr.engine.staging_bytes // nbytes == 1 and float(v.numpy()[0, 0]) == 1.0
    state = {"w": jax.numpy.ones((1024, 1024), jax.numpy.float32)}
    # Zarr files: no TensorStore copy beside the slots, so two slots fit this budget.
    with aj.CheckpointManager(str(tmp_path / "jax"), async_options=limit,
                              format_options=aj.FormatOptions(use_ocdbt=False)) as mgr:
        mgr.save(1, state)
        mgr.wait_until_finished()
        assert mgr.engine.staging_bytes == 2 * nbytes
        got = mgr.restore(1)
        assert mgr.engine.staging_bytes == nbytes
    np.testing.assert_array_equal(np.asarray(got["w"]), np.ones((1024, 1024), np.float32))
