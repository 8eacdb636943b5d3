"""Two real JAX processes: a remote tier is refused at construction on every process.

Multi-host saves with no shared filesystem are not supported yet; what must
never happen is a save reported as done that cannot be restored.
"""

from __future__ import annotations

import pytest

from asyncckpt.storage.servers import free_port
from tests.helpers import start_python, subprocess_env, write_script

pytest.importorskip("jax")

WORKER = r"""
import sys
import jax
pid, port, url = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                           initialization_timeout=120)
import asyncckpt.jax as aj
try:
    aj.CheckpointManager(url)
    print("ACCEPTED", flush=True)
except NotImplementedError as e:
    print("REFUSED", e, flush=True)
jax.distributed.shutdown()
"""


@pytest.mark.slow
def test_multiprocess_remote_directory_is_refused_on_every_process(s3_server, tmp_path):
    script = write_script(tmp_path, "worker.py", WORKER)
    port = str(free_port())
    url = "s3://asyncckpt-test/multi"
    procs = [start_python(script, str(i), port, url, env=subprocess_env()) for i in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    for out, err in outs:
        assert "REFUSED" in out and "shares" in out, out + err[-2000:]
