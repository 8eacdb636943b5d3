"""TF Model Garden's ``SavedModelCheckpointManager`` over an ``asyncckpt.tf.Checkpoint``.

The class (``official/core/savedmodel_checkpoint_manager.py`` of the
installed ``tf-models-official``, loaded from its file: the package's
``__init__`` needs ``gin``, which its wheel does not pull in) is TensorFlow's
``tf.train.CheckpointManager`` plus a ``SavedModel`` export per checkpoint:
after ``super().save()`` it exports beside the new checkpoint and deletes
every export whose checkpoint is not in ``self.checkpoints``. TensorFlow's
manager fills ``checkpoints`` in the write callback of the save, so that
callback must run at the call even while the write is slow: held here at a
gate around asyncckpt's real bundle writer (the ``gate`` fixture).
"""

from __future__ import annotations

import importlib.util
import os
import threading
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import asyncckpt.tf as at  # noqa: E402


def _model_garden_manager_class():
    spec = importlib.util.find_spec("official")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("tf-models-official is not installed: install the test extras (`make test`, "
                    "or tf-models-official with --no-deps)")
    path = Path(spec.submodule_search_locations[0]) / "core" / "savedmodel_checkpoint_manager.py"
    module_spec = importlib.util.spec_from_file_location("model_garden_smcm", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.SavedModelCheckpointManager


class _Exported(tf.Module):
    """A module Model Garden exports: it reads ``saved_model_signatures``."""

    def __init__(self):
        super().__init__()
        self.w = tf.Variable([1.0, 2.0])

    @tf.function(input_signature=[tf.TensorSpec([2], tf.float32)])
    def serve(self, x):
        return {"y": x * self.w}

    @property
    def saved_model_signatures(self):
        return {"serving_default": self.serve}


def _restores(path: str, want: list[float]) -> None:
    for reader in (at.Checkpoint, tf.train.Checkpoint):
        got = tf.Module()
        got.w = tf.Variable([0.0, 0.0])
        reader(model=got).restore(path).expect_partial()
        assert got.w.numpy().tolist() == want, reader


def test_model_garden_keeps_the_export_of_a_checkpoint_still_being_written(ckpt_dir, gate):
    manager_class = _model_garden_manager_class()
    model = _Exported()
    ckpt = gate.Checkpoint(model=model)  # an asyncckpt.tf.Checkpoint whose writes wait
    inits = []
    mgr = manager_class(ckpt, str(ckpt_dir), max_to_keep=2, modules_to_export={"model": model},
                        init_fn=lambda: inits.append(1))
    gate.open.clear()
    first = mgr.save()  # returns while the write is held at the gate
    assert gate.entered.acquire(timeout=30)
    export = first + "_saved_modules"
    assert not os.path.exists(first + ".index")  # not written yet...
    # ...yet TensorFlow's manager lists it, so Model Garden keeps the export it made.
    assert mgr.checkpoints == [first] and mgr.latest_checkpoint == first
    assert mgr.savedmodels == [export] and os.path.isdir(os.path.join(export, "model"))
    # A recovery (Model Garden's RecoveryAction: restore_or_initialize) restores it
    # once written, instead of initializing.
    model.w.assign([9.0, 9.0])
    done, result = threading.Event(), []
    t = threading.Thread(target=lambda: (result.append(mgr.restore_or_initialize()),
                                         done.set()))
    t.start()
    assert not done.wait(0.5)  # waiting for the write
    gate.open.set()
    t.join(60)
    assert result == [first] and not inits and model.w.numpy().tolist() == [1.0, 2.0]

    paths = []
    for value in (3.0, 5.0):
        model.w.assign([value, value + 1])
        paths.append(mgr.save())
    ckpt.sync()
    # max_to_keep=2: the first checkpoint and its export are gone, the others kept.
    assert mgr.checkpoints == paths
    assert mgr.savedmodels == [p + "_saved_modules" for p in paths]
    assert not os.path.exists(export) and not os.path.exists(first + ".index")
    assert tf.train.latest_checkpoint(str(ckpt_dir)) == paths[-1]
    _restores(paths[-1], [5.0, 6.0])
    loaded = tf.saved_model.load(os.path.join(paths[-1] + "_saved_modules", "model"))
    out = loaded.signatures["serving_default"](tf.constant([1.0, 1.0]))
    np.testing.assert_array_equal(out["y"].numpy(), [5.0, 6.0])
    ckpt.close()
