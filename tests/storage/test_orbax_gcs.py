"""orbax itself lists and restores JAX checkpoints asyncckpt committed to gs://.

orbax is pointed at fake-gcs-server: etils' fsspec backend (gcsfs honours
STORAGE_EMULATOR_HOST) for paths, tensorstore's own variables for the arrays.
"""

from __future__ import annotations

import pytest

from tests.helpers import run_python, subprocess_env, write_script

pytest.importorskip("orbax.checkpoint")

SCRIPT = """
import sys
import numpy as np
import jax.numpy as jnp
import asyncckpt.jax as aj
import orbax.checkpoint as ocp

url = sys.argv[1]
state = {"w": jnp.arange(12.0).reshape(3, 4), "b": np.arange(5), "s": 3}
with aj.CheckpointManager(url) as mgr:
    mgr.save(5, state)
    mgr.save(6, {**state, "s": 4})
orbax_mgr = ocp.CheckpointManager(url)
assert orbax_mgr.all_steps() == [5, 6], orbax_mgr.all_steps()
got = orbax_mgr.restore(6, args=ocp.args.StandardRestore(state))
assert np.array_equal(np.asarray(got["w"]), np.asarray(state["w"]))
assert np.array_equal(np.asarray(got["b"]), state["b"]) and int(got["s"]) == 4

# orbax's prefixed, fixed-length step names (``ckpt_000007/``) on gs:// too.
opts = ocp.CheckpointManagerOptions(step_prefix="ckpt", step_format_fixed_length=6)
with aj.CheckpointManager(url + "-named", options=opts) as mgr:
    mgr.save(7, {**state, "s": 7})
orbax_mgr = ocp.CheckpointManager(url + "-named", options=opts)
assert orbax_mgr.all_steps() == [7], orbax_mgr.all_steps()
got = orbax_mgr.restore(7, args=ocp.args.StandardRestore(state))
assert np.array_equal(np.asarray(got["w"]), np.asarray(state["w"])) and int(got["s"]) == 7
print("ORBAX-OK")
"""


def test_orbax_restores_an_asyncckpt_gs_checkpoint(gcs_server, tmp_path):
    script = write_script(tmp_path, "orbax_gcs.py", SCRIPT)
    env = subprocess_env(
        EPATH_USE_TF="false",
        GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
        TENSORSTORE_GCS_HTTP_URL=gcs_server.endpoint,
        GOOGLE_AUTH_TOKEN_FOR_TESTING="emulator",
    )
    proc = run_python(script, "gs://asyncckpt-test/orbax-run", env=env, timeout=240)
    assert "ORBAX-OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]
