"""The coordination service carries a fixed number of small messages per save and restore.

Two real ``jax.distributed`` processes on 127.0.0.1 (2 CPU devices each)
wrap the coordination service's real client in a counting proxy and save,
then restore, states of 10 and of 100 arrays (each split over all 4
devices), in both layouts. The key-value calls and bytes per save and per
restore must not grow with the number of arrays, whose files the manifest
parts carry instead. (Waits that poll for another process's failure make
extra calls as time passes, whatever the files: they are counted apart and
not compared.) The scale benchmark (``python -m benchmarks --scale``) counts
the same at more processes and arrays.
"""

from __future__ import annotations

import pytest

pytest.importorskip("jax")

from tests.helpers import run_workers, subprocess_env, write_script
from tests.servers import free_port

WORKER = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

pid, port, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                           initialization_timeout=120)
from jax._src import distributed


class Counting:
    # The real client; counts sets and answered gets (calls, bytes of keys and values).
    def __init__(self, inner):
        self._inner = inner
        self.counts = {"set": [0, 0], "get": [0, 0], "other": [0, 0]}

    def _add(self, kind, *texts):
        self.counts[kind][0] += 1
        self.counts[kind][1] += sum(len(t) for t in texts if isinstance(t, (str, bytes)))

    def key_value_set(self, key, value, *args, **kw):
        self._add("set", key, value)
        return self._inner.key_value_set(key, value, *args, **kw)

    def blocking_key_value_get(self, key, timeout_ms):
        try:
            value = self._inner.blocking_key_value_get(key, timeout_ms)
        except Exception:
            self._add("other", key)  # a wait that timed out (and polls again)
            raise
        self._add("get", key, value)
        return value

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def counted(*args, **kw):
            self._add("other", *[a for a in args if isinstance(a, str)])
            return attr(*args, **kw)

        return counted

    def snapshot(self):
        return {k: list(v) for k, v in self.counts.items()}


jax.devices()  # the backend takes the real client
raw = distributed.global_state.client
counter = Counting(raw)
distributed.global_state.client = counter
import asyncckpt.jax as aj

sharding = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), P("d"))


def state(leaves, step):
    return {f"p{i}": jax.make_array_from_callback(
        (4096,), sharding, lambda idx, i=i: np.arange(4096, dtype=np.float32)[idx] + step + i)
        for i in range(leaves)}


def delta(before, after):
    return {k: [after[k][0] - before[k][0], after[k][1] - before[k][1]] for k in before}


out = {}
for layout in ("ocdbt", "zarr"):
    for leaves in (10, 100):
        name = f"{layout}-{leaves}"
        mgr = aj.CheckpointManager(os.path.join(root, name), max_to_keep=2,
                                   coordination_timeout_s=60,
                                   format_options=aj.FormatOptions(use_ocdbt=layout == "ocdbt"))
        mgr.save(0, state(leaves, 0))  # the first save also agrees on the run token
        mgr.wait_until_finished()
        raw.wait_at_barrier(f"warm-{name}", 60_000)
        before = counter.snapshot()
        for step in (1, 2):
            mgr.save(step, state(leaves, step))
            mgr.wait_until_finished()
        saved = counter.snapshot()
        raw.wait_at_barrier(f"saved-{name}", 60_000)
        mid = counter.snapshot()
        target = {k: jax.ShapeDtypeStruct((4096,), jnp.float32, sharding=sharding)
                  for k in state(leaves, 0)}
        got = mgr.restore(2, target=target)
        restored = counter.snapshot()
        ok = all(np.array_equal(np.asarray(s.data), np.arange(4096)[s.index] + 2 + int(k[1:]))
                 for k, a in got.items() for s in a.addressable_shards)
        mgr.close()
        out[name] = {"save": delta(before, saved), "restore": delta(mid, restored),
                     "ok": bool(ok)}
        raw.wait_at_barrier(f"done-{name}", 60_000)
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.slow
def test_key_value_traffic_per_save_and_restore_does_not_grow_with_the_arrays(tmp_path):
    script = write_script(tmp_path, "worker.py", WORKER)
    port = str(free_port())
    results = run_workers(script, [[str(i), port, str(tmp_path)] for i in range(2)],
                          env=subprocess_env(JAX_PLATFORMS="cpu"))
    for pid, result in enumerate(results):
        for layout in ("ocdbt", "zarr"):
            few, many = result[f"{layout}-10"], result[f"{layout}-100"]
            print(f"process {pid} {layout}: 10 arrays {few}, 100 arrays {many}")
            assert few["ok"] and many["ok"]
            for phase in ("save", "restore"):
                for kind in ("set", "get"):
                    (calls_few, bytes_few), (calls_many, bytes_many) = (
                        few[phase][kind], many[phase][kind])
                    assert calls_many == calls_few, (pid, layout, phase, kind, few, many)
                    # The same messages; a count written in them may gain a digit.
                    assert bytes_many <= bytes_few + 8, (pid, layout, phase, kind, few, many)
            # Two saves: a set and an answered get each on process 1; process 0 reads
            # process 1's answer and sets the commit.
            assert many["save"]["set"][0] == 2 and many["save"]["get"][0] == 2
            assert many["save"]["set"][1] < 300
