"""``CheckpointManager.prepare``: staging memory built before the first save.

Without it the first save allocates and faults in ``num_slots`` states'
worth of staging memory on the training thread (3.5 s for 1 GiB on the
project's VM). Each test here has a control: the same save without
``prepare`` allocates on the saving thread, so the checks cannot pass
vacuously.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import asyncckpt.jax as aj  # noqa: E402
from asyncckpt.errors import EngineClosedError, UnsupportedObjectError  # noqa: E402
from tests.helpers import run_python, write_script  # noqa: E402

logging.getLogger("absl").setLevel(logging.ERROR)


def _state(seed: int = 0) -> dict:
    """Sharded, replicated and single-device arrays, NumPy arrays and scalars."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    rng = np.random.default_rng(seed)
    return {
        "w": jax.device_put(rng.standard_normal((64, 32), dtype=np.float32),
                            NamedSharding(mesh, P("a", "b"))),
        "b": jax.device_put(jnp.asarray(rng.standard_normal(32), jnp.bfloat16),
                            NamedSharding(mesh, P("b"))),
        "r": jax.device_put(jnp.arange(6, dtype=jnp.int32), NamedSharding(mesh, P())),
        "mu": jnp.full((3, 5), float(seed), jnp.float32),
        "host": np.arange(10, dtype=np.int64) + seed,
        "step": seed,
    }


def _first_save_allocations(mgr, state) -> int:
    """Buffers the first save allocated on the saving thread."""
    assert mgr.save(1, state, force=True)
    allocated = max(s.allocations for s in mgr.engine._pool._slots)
    mgr.wait_until_finished()
    return allocated


def _assert_restores(mgr, step, state) -> None:
    got = mgr.restore(step, target=jax.tree.map(np.zeros_like, state))
    for key, value in state.items():
        assert np.array_equal(np.asarray(got[key]), np.asarray(value)), key


def test_prepared_slots_leave_the_first_save_nothing_to_allocate(tmp_path):
    state = _state()
    with aj.CheckpointManager(str(tmp_path / "control")) as mgr:
        assert mgr.engine.staging_bytes == 0
        assert _first_save_allocations(mgr, state) > 0  # the control: it allocates itself

    with aj.CheckpointManager(str(tmp_path / "prepared")) as mgr:
        mgr.prepare(state)
        assert mgr.engine._pool.wait_prepared(60)
        # Every slot of the pool holds the state's staging buffers before any save.
        assert mgr.engine.staging_bytes >= 2 * sum(np.asarray(v).nbytes for v in state.values())
        assert mgr.all_steps() == []  # nothing is written
        assert _first_save_allocations(mgr, state) == 0
        _assert_restores(mgr, 1, state)
        # No early spare by default: host memory stays at num_slots states.
        assert mgr.engine._pool.wait_prepared(60)
        assert len(mgr.engine._pool._slots) == 2


def test_prepare_takes_orbax_args_and_composite_items(tmp_path):
    import orbax.checkpoint as ocp

    state, extra = _state(), {"e": jnp.ones((8, 8))}
    args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                              extra=ocp.args.StandardSave(extra))
    with aj.CheckpointManager(str(tmp_path), item_names=("state", "extra")) as mgr:
        mgr.prepare(args=args)
        assert mgr.engine._pool.wait_prepared(60)
        assert mgr.save(1, args=args)
        assert max(s.allocations for s in mgr.engine._pool._slots) == 0
        mgr.wait_until_finished()


def test_a_save_of_another_structure_replaces_what_prepare_built(tmp_path):
    with aj.CheckpointManager(str(tmp_path)) as mgr:
        mgr.prepare({"other": jnp.zeros((128, 128))})
        assert mgr.engine._pool.wait_prepared(60)
        state = _state(3)
        assert _first_save_allocations(mgr, state) > 0
        _assert_restores(mgr, 1, state)
        # The stale buffers are gone: the pool holds the saved layout only.
        layout = mgr.engine._pool._layout
        assert not any("other" in key for key in layout)


def test_prepare_checks_its_input_and_the_manager(tmp_path):
    with aj.CheckpointManager(str(tmp_path / "a")) as mgr, pytest.raises(UnsupportedObjectError):
        mgr.prepare({"x": object()})
    with pytest.raises(EngineClosedError):
        mgr.prepare(_state())
    # A read-only manager never saves: nothing is built.
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(read_only=True)
    with aj.CheckpointManager(str(tmp_path / "a"), options=options) as ro:
        ro.prepare(_state())
        assert ro.engine._pool.wait_prepared(60)
        assert ro.engine.staging_bytes == 0


FIRST_SAVE = """
import sys
import jax.numpy as jnp
import asyncckpt.jax as aj

with aj.CheckpointManager(sys.argv[1]) as mgr:
    assert mgr.save(1, {"w": jnp.ones(4)}, force=True)
    mgr.wait_until_finished()
    print("orbax after a save:", "orbax.checkpoint" in sys.modules)
    try:
        mgr.save(1, {"w": jnp.ones(4)}, force=True)
    except aj.StepAlreadyExistsError as e:  # made when it is raised, orbax's subclass
        import orbax.checkpoint.checkpoint_manager as ocm
        print("raised orbax's:", isinstance(e, ocm.StepAlreadyExistsError))
"""


def test_the_first_save_does_not_import_orbax(tmp_path):
    """Its error type was made (orbax imported, 0.2 s) on the first save's clock."""
    proc = run_python(write_script(tmp_path, "first_save.py", FIRST_SAVE), str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "orbax after a save: False" in proc.stdout, proc.stdout
    assert "raised orbax's: True" in proc.stdout, proc.stdout


def test_the_preemption_handler_prepares_at_its_first_boundary(tmp_path):
    """The save at a notice then allocates nothing in the grace period."""
    import threading

    from asyncckpt.preemption import PreemptionCheckpointHandler, TerminationConfig

    notice = threading.Event()
    config = TerminationConfig(platform="other", exit_fn=lambda: None, poll_interval_s=0.01,
                               termination_watcher_fn=notice.is_set)
    with aj.CheckpointManager(str(tmp_path)) as mgr, \
            PreemptionCheckpointHandler(mgr, termination_config=config) as handler:
        state = _state()
        assert mgr.engine.staging_bytes == 0  # the control: nothing before a boundary
        state = handler.run(lambda s: {**s, "step": s["step"] + 1}, state)
        assert mgr.engine._pool.wait_prepared(60)
        assert mgr.engine.staging_bytes > 0 and mgr.all_steps() == []
        notice.set()
        while not handler.preempted:
            state = handler.run(lambda s: {**s, "step": s["step"] + 1}, state)
        assert handler.saves and mgr.all_steps()
        assert max(s.allocations for s in mgr.engine._pool._slots) == 0
