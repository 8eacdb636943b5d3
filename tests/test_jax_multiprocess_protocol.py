"""The multi-process protocol's contract, with two real JAX processes.

``jax.distributed`` on 127.0.0.1, 4 CPU devices per process. Faults are
injected inside the workers by subclassing the real components (the durable
writer, the save job). One worker run covers: managers made in different
orders, the key-value store staying flat over 50 saves, a write failure on
process 1 and a commit failure on process 0 raising the same error on both
processes, a failure raised by a later ``save()`` that user code catches
(keys stay aligned, the next saves succeed), a restore where each process
reads only what it needs and corruption found by one process makes both fall
back, and a read error on one process failing the restore on both at once.
A second run gives each process its own local directory (not shared): the
save fails loudly on both, naming the missing files.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("jax")

from tests.helpers import run_workers, subprocess_env, write_script
from tests.servers import free_port

COMMON = r"""
import concurrent.futures, json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

pid, port, base = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                           initialization_timeout=120)
from jax._src import distributed
import asyncckpt.jax as aj
from asyncckpt._engine import files as files_lib
from asyncckpt.jax import _job
from asyncckpt.options import AsyncOptions

client = distributed.global_state.client
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
ROWS = 1024  # "w" is 1024 x 512 float32 (2 MiB): 8 chunks of 256 KiB, 4 per process


def expected(step):
    return np.arange(ROWS * 512, dtype=np.float32).reshape(ROWS, 512) + step


def state(step):
    value = expected(step)
    w = jax.make_array_from_callback(value.shape, NamedSharding(mesh, P("a", "b")),
                                     lambda idx: value[idx])
    return {"w": w, "step": step}


def target():
    return {"w": jax.ShapeDtypeStruct((ROWS, 512), jnp.float32,
                                      sharding=NamedSharding(mesh, P("a", "b"))), "step": 0}


def matches(got, step):
    ok = got["step"] == step
    for shard in got["w"].addressable_shards:
        ok = ok and np.array_equal(np.asarray(shard.data), expected(step)[shard.index])
    return bool(ok)


class FailingWriter(files_lib.DurableWriter):
    def write(self, name, chunks):
        if "/w/" in name:
            raise OSError(28, "No space left on device", name)
        return super().write(name, chunks)


def error_of(fn):
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


# The zarr-file layout, whose chunk files the checks below read and damage one by one
# (OCDBT with several processes: tests/test_jax_multiprocess.py).
OPTS = dict(coordination_timeout_s=20, async_options=AsyncOptions(fsync=False),
            format_options=aj.FormatOptions(use_ocdbt=False))
out = {}
"""

WORKER = COMMON + r"""
class FaultyJob(_job.JaxSaveJob):
    # The real save job. Its files are written by `writer` when one is set (a save
    # staged meanwhile), and with `fail_publish` process 0's commit of step 4 fails
    # after every process's files are in.
    writer = None
    fail_publish = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if FaultyJob.writer is not None:
            self.transaction.writer_class = FaultyJob.writer
        self.fail_publish = FaultyJob.fail_publish

    def _commit(self, stats):
        if self.fail_publish and pid == 0 and self.step == 4:
            raise OSError(5, "Input/output error", "publish of step 4")
        return super()._commit(stats)


class Manager(aj.CheckpointManager):
    _job_class = FaultyJob


# Managers made in a different order on each process: matched by directory.
a_dir, b_dir = os.path.join(base, "a"), os.path.join(base, "b")
if pid == 0:
    ma = Manager(a_dir, max_to_keep=3, **OPTS)
    mb = Manager(b_dir, max_to_keep=2, **OPTS)
else:
    mb = Manager(b_dir, max_to_keep=2, **OPTS)
    ma = Manager(a_dir, max_to_keep=3, **OPTS)

# The first saves in a different order too (each process saves both at once).
first = [ma, mb] if pid == 0 else [mb, ma]
for m in first:
    m.save(0, state(0) if m is ma else {"x": np.zeros(4, np.int32)})
for m in first:
    m.wait_until_finished()
out["first_saves"] = [ma.all_steps(), mb.all_steps()]

# 50 saves: the coordination keys do not pile up.
out["keys"] = []
for step in range(1, 51):
    mb.save(step, {"x": np.full(4, step, np.int32)})
    if step in (10, 50):
        mb.wait_until_finished()
        client.wait_at_barrier(f"count-{step}", 60_000)  # neither process is ahead
        out["keys"].append(len(client.key_value_dir_get("asyncckpt/")))
        client.wait_at_barrier(f"counted-{step}", 60_000)
out["b_steps"] = mb.all_steps()
mb.close()

ma.save(1, state(1))
ma.save(2, state(2))
ma.wait_until_finished()

# A write failure on process 1: the same error on both processes.
if pid == 1:
    FaultyJob.writer = FailingWriter
ma.save(3, state(3))
out["write_failure"] = error_of(ma.wait_until_finished)
FaultyJob.writer = None

# A commit failure on process 0 reaches process 1 as the same error.
FaultyJob.fail_publish = True
ma.save(4, state(4))
out["commit_failure"] = error_of(ma.wait_until_finished)
FaultyJob.fail_publish = False

# Process 1's save of step 5 fails, and process 1 has seen it fail before its
# next save(): that save() raises it. User code catches and goes on.
if pid == 1:
    FaultyJob.writer = FailingWriter
ma.save(5, state(5))
if pid == 1:
    concurrent.futures.wait([ma.last_save.committed])
FaultyJob.writer = None
raised = []
for step in (6, 7, 8):
    err = error_of(lambda: ma.save(step, state(step)))
    if err:
        raised.append([step, err])
err = error_of(ma.wait_until_finished)
if err:
    raised.append(["wait", err])
out["raised"] = raised
out["final_wait"] = error_of(ma.wait_until_finished)
out["a_steps"] = ma.all_steps()

# Restore: each process reads the chunks it needs (plus its share of the rest).
def read_bytes():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])

before = read_bytes()
got = ma.restore(target=target())
out["read_bytes"] = read_bytes() - before
out["restored_8"] = matches(got, 8)

# Corruption only process 1 reads (a chunk of its own rows): both fall back to 7.
if pid == 1:
    with open(os.path.join(ma.step_dir(8), "default", "w", "3.1"), "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
client.wait_at_barrier("corrupted", 60_000)
got = ma.restore(target=target())
out["fallback_7"] = matches(got, 7)

# A read that fails on process 1 for a reason other than integrity (an I/O
# error): process 1 raises it, process 0 hears of it at once (not a timeout).
from asyncckpt.jax import _restore


class FailingChunks(_restore.ChunkReader):
    def prefetch(self, paths):
        raise OSError(5, "Input/output error", "chunk read")


if pid == 1:
    _restore.ChunkReader = FailingChunks
out["peer_read_failure"] = error_of(lambda: ma.restore(target=target()))
_restore.ChunkReader = FailingChunks.__mro__[1]
got = ma.restore(target=target())  # the next restore works on both
out["after_peer_failure_7"] = matches(got, 7)

# Process 0 cannot stage step 9: process 1's save fails at once with its error,
# and process 1 removes the files it wrote (process 0 never will).
bad = state(9)
if pid == 0:
    bad["oops"] = "not an array"
out["primary_staging"] = error_of(lambda: ma.save(9, bad))
out["primary_staging_wait"] = error_of(ma.wait_until_finished)
ma.close()
print("RESULT " + json.dumps(out), flush=True)
"""

NOT_SHARED = COMMON + r"""
# Each process has its own local directory at the same relative path, as two
# hosts with a local disk each: process 1's files never reach process 0's.
host = os.path.join(base, f"host{pid}")
os.makedirs(host, exist_ok=True)
os.chdir(host)
mgr = aj.CheckpointManager("ckpts", **OPTS)
mgr.save(1, state(1))
out["failure"] = error_of(mgr.wait_until_finished)
out["steps"] = mgr.all_steps()
out["listing"] = sorted(n for n in os.listdir("ckpts") if not n.startswith("."))
mgr.close()
print("RESULT " + json.dumps(out), flush=True)
"""


def _run_two(tmp_path, code: str) -> list[dict]:
    script = write_script(tmp_path, "worker.py", code)
    port = str(free_port())
    env = subprocess_env(JAX_PLATFORMS="cpu")
    return run_workers(script, [[str(i), port, str(tmp_path)] for i in range(2)], env=env)


@pytest.mark.slow
def test_failures_agreed_keys_aligned_reaped_and_restore_verdicts_shared(tmp_path):
    p0, p1 = _run_two(tmp_path, WORKER)
    # Managers made in different orders still save (matched by directory).
    assert p0["first_saves"] == p1["first_saves"] == [[0], [0]]
    assert p0["b_steps"] == p1["b_steps"] == [49, 50]
    # The key-value store stays flat: as many keys after 50 saves as after 10.
    assert p0["keys"][1] <= p0["keys"][0] and p1["keys"][1] <= p1["keys"][0], (p0, p1)
    # Process 1's write failure: one error, the same on both, naming it.
    assert p0["write_failure"] == p1["write_failure"], (p0, p1)
    assert p0["write_failure"].startswith("DistributedSaveError")
    assert "process 1: OSError" in p0["write_failure"] and "No space left" in p0["write_failure"]
    # Process 0's commit failure: the same error on process 1.
    assert p0["commit_failure"] == p1["commit_failure"], (p0, p1)
    assert "process 0: OSError" in p0["commit_failure"] and "Input/output" in p0["commit_failure"]
    # The failure of step 5 raised once on each process (process 1 by save(6),
    # once its save was staged); no other save failed; steps 6-8 are saved.
    assert [r[0] for r in p1["raised"]] == [6], p1["raised"]
    assert len(p0["raised"]) == 1, p0["raised"]
    assert p0["raised"][0][1] == p1["raised"][0][1]
    assert "step 5 failed: process 1: OSError" in p1["raised"][0][1]
    assert p0["final_wait"] is None and p1["final_wait"] is None
    # (Not the whole listing: an older step that a failed save had condemned
    # comes back, and when depends on each process's timing.)
    assert p0["a_steps"][-3:] == p1["a_steps"][-3:] == [6, 7, 8], (p0, p1)
    # Restore: the 2 MiB of "w" is read about once in all, not once per process.
    total = 1024 * 512 * 4
    print(f"restore reads: process 0 {p0['read_bytes']} B, process 1 {p1['read_bytes']} B, "
          f"checkpoint {total} B; keys after 10 and 50 saves: {p0['keys']}")
    assert p0["restored_8"] and p1["restored_8"]
    assert p0["read_bytes"] + p1["read_bytes"] < 1.3 * total, (p0["read_bytes"],
                                                                p1["read_bytes"])
    # Corruption only process 1 read: both processes fall back to step 7.
    assert p0["fallback_7"] and p1["fallback_7"]
    # An I/O error on process 1 during a restore: process 1 raises it, process 0
    # raises PeerFailedError naming it (not a coordination timeout); the next
    # restore works on both.
    assert p1["peer_read_failure"].startswith("OSError"), p1
    assert p0["peer_read_failure"].startswith("PeerFailedError"), p0
    assert "worker 1 failed" in p0["peer_read_failure"] and "Input/output" in p0[
        "peer_read_failure"]
    assert p0["after_peer_failure_7"] and p1["after_peer_failure_7"]
    # Process 0 failed to stage step 9: process 1's save of it fails, naming why.
    assert p0["primary_staging"].startswith("UnsupportedLeafError"), p0
    assert p1["primary_staging"] is None
    assert p1["primary_staging_wait"].startswith("DistributedSaveError"), p1
    assert "process 0: did not take part" in p1["primary_staging_wait"]
    assert "UnsupportedLeafError" in p1["primary_staging_wait"]
    leftovers = [n for n in os.listdir(tmp_path / "a") if n.startswith(".asyncckpt-tmp-")]
    assert not leftovers


@pytest.mark.slow
def test_a_local_directory_not_shared_between_processes_fails_loudly_on_both(tmp_path):
    p0, p1 = _run_two(tmp_path, NOT_SHARED)
    assert p0["failure"] == p1["failure"], (p0, p1)
    failure = p0["failure"]
    assert failure.startswith("DistributedSaveError") and "process 1:" in failure, failure
    assert "asyncckpt.part-1.json is missing" in failure and "shares" in failure, failure
    # Never "saved but unrestorable": step 1 is published nowhere.
    assert p0["steps"] == p1["steps"] == []
    assert p0["listing"] == p1["listing"] == []
