"""Real client code: a JAX training script written against orbax, run unchanged but for one import.

``scripts/jax_train.py`` checkpoints a sharded Flax/optax training run the way
large JAX codebases' checkpointing modules do, with every ``CheckpointManager``
spelling of issue 27 (policy objects, commit-file temporary path, orbax's
``AsyncOptions``, ``logger``, ``item_names`` with ``item_handlers``, one handler,
``SaveArgs`` with default fields and ``chunk_byte_size``, the positional
``AsyncCheckpointer`` form, ``manager.directory`` as a path). It runs twice, in
subprocesses at once: as written (orbax) and with ``from orbax.checkpoint import
CheckpointManager`` changed to ``asyncckpt.jax``. Both runs must report the
same saves and steps, and orbax's own managers, built by the script's own
functions, must restore asyncckpt's checkpoints to the values of orbax's.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
ocp = pytest.importorskip("orbax.checkpoint")
pytest.importorskip("flax")
pytest.importorskip("optax")

import asyncckpt.jax as aj  # noqa: E402
from tests.helpers import start_python  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "jax_train.py"
ORBAX_IMPORT = "from orbax.checkpoint import CheckpointManager  # the line a user changes"
OUR_IMPORT = "from asyncckpt.jax import CheckpointManager  # the line a user changes"
STEPS = 8


def _load_script(name: str, manager: type) -> object:
    """The script as a module (its checkpointing functions), with ``manager`` as its
    ``CheckpointManager``; ``main`` is not run."""
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.CheckpointManager = manager
    return module


def _result(proc) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _equal(a, b) -> None:
    for x, y in zip(_leaves(a), _leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_training_script_runs_unchanged_and_orbax_restores_it(tmp_path):
    source = SCRIPT.read_text()
    assert source.count(ORBAX_IMPORT) == 1
    ours_script = tmp_path / "jax_train_asyncckpt.py"
    ours_script.write_text(source.replace(ORBAX_IMPORT, OUR_IMPORT))
    runs = {"orbax": tmp_path / "orbax", "ours": tmp_path / "ours"}
    for d in runs.values():
        d.mkdir()
    procs = {"orbax": start_python(SCRIPT, str(runs["orbax"]), str(STEPS)),
             "ours": start_python(ours_script, str(runs["ours"]), str(STEPS))}
    results = {who: _result(p) for who, p in procs.items()}
    assert results["ours"] == results["orbax"], results
    assert results["ours"]["committed_callbacks"] == len(results["ours"]["saved"]) > 0

    def events(who):
        with open(runs[who] / "checkpoint_events.jsonl") as f:
            return [(e["event_type"], e["step"], sorted(e)) for e in map(json.loads, f)]

    assert events("ours") == events("orbax")
    # Each manager's checkpoints, read by orbax's own managers configured by the
    # script's own functions (and asyncckpt's): the values of orbax's own run.
    theirs = _load_script("jax_train_orbax", ocp.CheckpointManager)
    mine = _load_script("jax_train_ours", aj.CheckpointManager)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(1, -1), ("data", "model"))
    abstract = theirs.abstract_of(theirs.make_state(mesh))
    latest = results["ours"]["all_steps"][-1]
    args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                              run_metadata=ocp.args.JsonRestore())
    restored = {}
    for reader, who in ((theirs, "orbax"), (theirs, "ours"), (mine, "ours")):
        root = runs[who]
        config = reader.CheckpointConfig(directory=str(root / "checkpoints"))
        with reader.create_checkpoint_manager(config, logger=None,
                                              on_committed=None) as mngr:
            assert list(mngr.all_steps()) == results["ours"]["all_steps"]
            restored[reader.__name__, who, "state"] = mngr.restore(latest, args=args)
        with reader.create_best_manager(str(root / "best")) as best:
            step = results["ours"]["best_steps"][-1]
            restored[reader.__name__, who, "best"] = best.restore(step)
        with reader.create_export_manager(str(root / "export")) as export:
            restored[reader.__name__, who, "export"] = export.restore(STEPS)
    reference = {k[2]: v for k, v in restored.items() if k[:2] == ("jax_train_orbax", "orbax")}
    for (reader, who, what), value in restored.items():
        if what == "state":
            assert value.run_metadata["step"] == latest, (reader, who)
            _equal(value.state, reference["state"].state)
        else:
            _equal(value, reference[what])
    final = np.load(runs["ours"] / "final_params.npz")
    exported = restored["jax_train_orbax", "ours", "export"]
    flat = {"/".join(str(k.key) for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(exported)}
    assert sorted(flat) == sorted(final.files)
    for name in final.files:
        np.testing.assert_array_equal(flat[name], final[name])
    # The chunk_byte_size of the script's SaveArgs: the large kernel is in chunks.
    kernel = runs["ours"] / "checkpoints" / str(latest) / "state" / "params.Dense_0.kernel"
    assert len([n for n in os.listdir(kernel) if n != ".zarray"]) > 8
