"""Faults with real processes and servers: SIGKILL during uploads, a server that stops.

Kill trials draw their timing from a seed that is printed; set
ASYNCCKPT_KILL_SEED to replay one.
"""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

from asyncckpt import catalog
from asyncckpt.errors import CheckpointNotFoundError
from asyncckpt.storage import RetryPolicy, StorageError
from asyncckpt.storage import protocol as proto
from asyncckpt.storage.stores import open_store
from tests.helpers import start_python, subprocess_env, write_script

pytest.importorskip("jax")

CHILD = """
import sys
import numpy as np
import asyncckpt.jax as aj

url, steps = sys.argv[1], int(sys.argv[2])

def state(step):
    rng = np.random.default_rng(step)
    return {f"w{i}": rng.standard_normal(256 * 1024, dtype=np.float32) for i in range(6)}

mgr = aj.CheckpointManager(url, max_to_keep=3)
for step in range(1, steps + 1):
    mgr.save(step, state(step))
    print("saved", step, flush=True)
mgr.close()
print("closed", flush=True)
"""


def _state(step):
    rng = np.random.default_rng(step)
    return {f"w{i}": rng.standard_normal(256 * 1024, dtype=np.float32) for i in range(6)}


def _seeds(n: int) -> list[int]:
    fixed = os.environ.get("ASYNCCKPT_KILL_SEED")
    if fixed is not None:
        return [int(fixed)]
    return [int(s) for s in np.random.SeedSequence().generate_state(n)]


@pytest.mark.slow
def test_sigkill_while_uploading_never_lists_a_partial_step(remote_url, tmp_path):
    import asyncckpt.jax as aj

    script = write_script(tmp_path, "child.py", CHILD)
    for trial, seed in enumerate(_seeds(2)):
        rng = np.random.default_rng(seed)
        url = f"{remote_url}-t{trial}"
        kill_after = int(rng.integers(1, 6))
        extra_delay = float(rng.uniform(0.0, 0.4))
        print(f"trial {trial}: seed {seed} (ASYNCCKPT_KILL_SEED={seed}), kill after save "
              f"{kill_after} + {extra_delay:.3f} s, {url}")
        proc = start_python(script, url, "8", env=subprocess_env())
        try:
            for line in proc.stdout:
                if line.strip() == f"saved {kill_after}":
                    break
            threading.Event().wait(extra_delay)  # fault-injection timing, not synchronisation
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait(60)
        store = open_store(url)
        committed = proto.list_committed(store)
        # Every listed step is complete: it downloads and matches every CRC32.
        for remote in committed:
            dest = tmp_path / f"dl-{trial}-{remote.name}"
            proto.download_checkpoint(store, remote, str(dest), retry=RetryPolicy())
            catalog.verify(catalog.list_checkpoints(str(dest))[0])
        if committed:
            newest = committed[-1].step
            with aj.CheckpointManager(url) as mgr:
                got = mgr.restore(target=_state(0))
            for k, v in _state(newest).items():
                assert np.array_equal(np.asarray(got[k]), v)


@pytest.mark.slow
def test_server_stopped_then_restarted(own_s3, tmp_path):
    import asyncckpt.jax as aj
    from asyncckpt.storage.tier import RemoteOptions

    local = str(tmp_path / "local")
    opts = RemoteOptions(max_to_keep=2, retry=RetryPolicy(deadline_s=3.0,
                                                          initial_backoff_s=0.1))
    url = "s3://outage/run"
    with aj.CheckpointManager(local, remote=url, remote_options=opts) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
        mgr.wait_until_finished()
        own_s3.kill()  # as a crash would: SIGTERM takes SeaweedFS ~10 s
        mgr.save(3, _state(3))  # commits locally; its upload fails once the deadline passes
        with pytest.raises(StorageError, match="failed after"):
            mgr.wait_until_finished()
        # The local tier is intact and restores while the remote is down.
        assert 3 in mgr.all_steps()
        got = mgr.restore(3, target=_state(0))
        assert np.array_equal(np.asarray(got["w0"]), _state(3)["w0"])
        # A bucket directory: durable means committed remotely, so nothing is listed.
        url_opts = RemoteOptions(retry=opts.retry)  # a URL directory: no max_to_keep of its own
        with aj.CheckpointManager("s3://outage/only", remote_options=url_opts) as only:
            only.save(1, _state(1))
            with pytest.raises(StorageError, match="failed after"):
                only.wait_until_finished()
            assert only.all_steps() == []
            with pytest.raises(CheckpointNotFoundError):
                only.restore(target=_state(0))
        own_s3.start()  # same port, same data
        # The failed upload of 3 deleted nothing: retention waits for a newer commit.
        assert [c.name for c in proto.list_committed(open_store(url))] == ["1", "2"]
        mgr.save(4, _state(4))  # uploads resume
        mgr.wait_until_finished()
    assert [c.name for c in proto.list_committed(open_store(url))] == ["2", "4"]
