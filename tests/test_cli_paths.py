"""``asyncckpt inspect`` and ``verify`` on one checkpoint's own path.

A JAX checkpointer (``StandardCheckpointer``) saves to a path that is the
checkpoint itself, with its pytree at the root (OCDBT or zarr files). Users
point the command at that path, at a manager's step directory or at a
TensorFlow prefix as readily as at the directory that holds them; each is
inspected and verified as the one checkpoint it is. A directory without
checkpoints is an error for ``inspect`` as for ``verify``, not an empty
success.
"""

from __future__ import annotations

import numpy as np
import pytest

from asyncckpt import catalog, cli
from asyncckpt.errors import CheckpointNotFoundError


def _checkpointer_save(path, **kwargs):
    import jax.numpy as jnp

    import asyncckpt.jax as aj

    with aj.StandardCheckpointer(**kwargs) as ckptr:
        ckptr.save(str(path), {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.zeros(5, jnp.int32)})
        ckptr.wait_until_finished()


def _corrupt_largest_file(directory) -> None:
    files = [p for p in directory.rglob("*") if p.is_file() and not p.name.startswith("asyncckpt")]
    victim = max(files, key=lambda p: p.stat().st_size)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))


@pytest.mark.parametrize("use_ocdbt", [True, False], ids=["ocdbt", "zarr"])
def test_a_checkpointers_path_is_inspected_and_verified_as_one_checkpoint(
        tmp_path, capsys, use_ocdbt):
    path = tmp_path / "one"
    _checkpointer_save(path, use_ocdbt=use_ocdbt)

    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint {path} (jax" in out
    assert "2 arrays" in out
    assert "w " in out and "[3, 4]" in out and "48" in out  # 12 float32
    assert "b " in out and "[5]" in out and "20" in out
    assert cli.main(["verify", str(path)]) == 0
    assert "1/1 checkpoint(s) verified" in capsys.readouterr().out

    _corrupt_largest_file(path)
    assert cli.main(["verify", str(path)]) == 1
    assert "FAIL  one" in capsys.readouterr().out


def test_a_step_directory_and_a_tensorflow_prefix_are_one_checkpoint(tmp_path, capsys):
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    import tensorflow as tf

    import asyncckpt.jax as aj
    import asyncckpt.tf as at

    with aj.CheckpointManager(str(tmp_path / "jax")) as manager:
        for step in (1, 2):
            manager.save(step, args=ocp.args.StandardSave({"w": jnp.full(4, float(step))}))
        manager.wait_until_finished()
    step_dir = tmp_path / "jax" / "2"
    assert [c.name for c in catalog.select(str(step_dir), None)] == ["2"]
    assert cli.main(["inspect", str(step_dir)]) == 0
    assert "(jax, step 2)" in capsys.readouterr().out
    assert cli.main(["verify", str(step_dir), "2"]) == 0
    capsys.readouterr()
    with pytest.raises(CheckpointNotFoundError, match="checkpoints there: 2"):
        catalog.select(str(step_dir), "1")  # the path names step 2 only

    ckpt = at.Checkpoint(v=tf.Variable(np.arange(6.0).reshape(2, 3)))
    prefix = ckpt.save(str(tmp_path / "tf" / "ckpt"))
    ckpt.sync()
    assert cli.main(["inspect", prefix]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint {prefix} (tensorflow, step 1)" in out and "[2, 3]" in out
    assert cli.main(["verify", prefix]) == 0
    assert "OK    ckpt-1" in capsys.readouterr().out


def test_inspect_of_a_directory_without_checkpoints_is_an_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli.main(["inspect", str(tmp_path / "empty")]) == 1
    assert "no checkpoints in" in capsys.readouterr().out
    assert cli.main(["verify", str(tmp_path / "empty")]) == 1
