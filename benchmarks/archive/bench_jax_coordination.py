"""Coordination cost of multi-process JAX saves and restores, counted on the real KV client.

Usage: python benchmarks/archive/bench_jax_coordination.py [--processes 2,4] [--leaves 100,500]
       [--layouts ocdbt,zarr] [--saves 3] [--devices 2]

Runs N real ``jax.distributed`` processes on 127.0.0.1 (``--devices`` CPU
devices each). Each process wraps the coordination service's real client
(``jax._src.distributed.global_state.client``) in a counting proxy: every
call (``key_value_set``, ``blocking_key_value_get``, ``key_value_try_get``,
``key_value_delete``, ...) and the bytes of its keys and values are counted,
then passed on unchanged. A state of ``--leaves`` float32 arrays of 64 KiB,
each split over every device of the run, is saved ``--saves`` times (after
one untimed first save, which also agrees on the run token) and restored
once onto the same shardings.

Reported per configuration: files of one step, key-value calls and bytes
per save and per restore (process 0, and the most of any other process),
and process 0's commit stage time (the writer's ``commit_s``, medians).
Runs against whatever asyncckpt is first on ``PYTHONPATH``: pointing it at
an older checkout measures that one (``--layouts zarr`` only, for versions
without ``FormatOptions``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks, tests

WORKER = r'''
import json, os, statistics, sys
pid, nproc, port, root, leaves_list, layouts, saves, devices = sys.argv[1:]
pid, nproc, saves, devices = int(pid), int(nproc), int(saves), int(devices)
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                           initialization_timeout=300)
from jax._src import distributed


class Counting:
    """The real client, counting calls and the bytes of keys and values."""

    def __init__(self, inner):
        self._inner = inner
        self.calls = {}
        self.bytes = 0

    def _count(self, name, *texts):
        self.calls[name] = self.calls.get(name, 0) + 1
        self.bytes += sum(len(t) for t in texts if isinstance(t, (str, bytes)))

    def key_value_set(self, key, value, *args, **kw):
        self._count("set", key, value)
        return self._inner.key_value_set(key, value, *args, **kw)

    def blocking_key_value_get(self, key, timeout_ms):
        try:
            value = self._inner.blocking_key_value_get(key, timeout_ms)
        except Exception:
            self._count("get", key)
            raise
        self._count("get", key, value)
        return value

    def key_value_try_get(self, key):
        try:
            value = self._inner.key_value_try_get(key)
        except Exception:
            self._count("try_get", key)
            raise
        self._count("try_get", key, value)
        return value

    def key_value_delete(self, key):
        self._count("delete", key)
        return self._inner.key_value_delete(key)

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if callable(attr):
            def counted(*args, **kw):
                self._count(name, *[a for a in args if isinstance(a, str)])
                return attr(*args, **kw)
            return counted
        return attr

    def snapshot(self):
        return sum(self.calls.values()), self.bytes


jax.devices()  # the backend takes the real client (its collectives need its type)
raw = distributed.global_state.client
counter = Counting(raw)
distributed.global_state.client = counter
import asyncckpt.jax as aj

mesh = Mesh(np.array(jax.devices()), ("d",))
sharding = NamedSharding(mesh, P("d"))
out = []
for layout in layouts.split(","):
    kwargs = {}
    if hasattr(aj, "FormatOptions"):
        kwargs["format_options"] = aj.FormatOptions(use_ocdbt=layout == "ocdbt")
    elif layout != "zarr":
        continue
    for leaves in (int(n) for n in leaves_list.split(",")):
        value = np.arange(16384, dtype=np.float32)  # 64 KiB
        def state(step):
            return {f"p{i}": jax.make_array_from_callback(
                (16384,), sharding, lambda idx, i=i: value[idx] + step + i)
                for i in range(leaves)}
        directory = os.path.join(root, f"{layout}-{leaves}")
        mgr = aj.CheckpointManager(directory, max_to_keep=2, coordination_timeout_s=300,
                                   **kwargs)
        mgr.save(0, state(0))
        mgr.wait_until_finished()
        raw.wait_at_barrier(f"warm-{layout}-{leaves}", 300_000)
        c0, b0 = counter.snapshot()
        for s in range(1, saves + 1):
            mgr.save(s, state(s))
            mgr.wait_until_finished()
        c1, b1 = counter.snapshot()
        raw.wait_at_barrier(f"saved-{layout}-{leaves}", 300_000)
        target = {k: jax.ShapeDtypeStruct((16384,), jnp.float32, sharding=sharding)
                  for k in state(0)}
        c2, b2 = counter.snapshot()
        got = mgr.restore(saves, target=target)
        c3, b3 = counter.snapshot()
        ok = all(np.array_equal(np.asarray(s.data), value[s.index] + saves + int(k[1:]))
                 for k, a in got.items() for s in a.addressable_shards)
        step_dir = mgr.step_dir(saves)
        files = sum(len(f) for _, _, f in os.walk(step_dir)) if pid == 0 else 0
        commit = statistics.median(h.commit_s for h in mgr.engine.history[1:])
        mgr.close()
        out.append({"layout": layout, "leaves": leaves, "files": files, "restored": ok,
                    "save_calls": (c1 - c0) / saves, "save_bytes": (b1 - b0) / saves,
                    "restore_calls": c3 - c2, "restore_bytes": b3 - b2, "commit_s": commit})
        raw.wait_at_barrier(f"done-{layout}-{leaves}", 300_000)
print("RESULT " + json.dumps(out), flush=True)
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="2,4")
    parser.add_argument("--leaves", default="100,500")
    parser.add_argument("--layouts", default="ocdbt,zarr")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    from tests.servers import free_port

    with tempfile.TemporaryDirectory(prefix="coord-bench-") as tmp:
        script = os.path.join(tmp, "worker.py")
        with open(script, "w") as f:
            f.write(WORKER)
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        print(f"{'N':>2} {'leaves':>6} {'layout':>6} {'files/step':>10} "
              f"{'save calls p0/other':>20} {'save bytes p0/other':>22} "
              f"{'restore calls p0/other':>23} {'restore bytes p0/other':>24} "
              f"{'p0 commit ms':>12}", flush=True)
        for n in (int(x) for x in args.processes.split(",")):
            root = os.path.join(tmp, f"n{n}")
            port = str(free_port())
            procs = [subprocess.Popen(
                [sys.executable, script, str(i), str(n), port, root, args.leaves, args.layouts,
                 str(args.saves), str(args.devices)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                for i in range(n)]
            outs = [p.communicate(timeout=3600) for p in procs]
            results = []
            for p, (out, err) in zip(procs, outs, strict=True):
                lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
                if p.returncode != 0 or not lines:
                    raise SystemExit(f"worker failed ({p.returncode}):\n{out}\n{err[-3000:]}")
                results.append(json.loads(lines[-1][len("RESULT "):]))
            for k, r0 in enumerate(results[0]):
                others = [r[k] for r in results[1:]]

                def pair(key, fmt="{:.0f}", r0=r0, others=others):
                    return (fmt.format(r0[key]) + "/"
                            + fmt.format(max(o[key] for o in others)))

                assert all(r[k]["restored"] for r in results), "a restore was not exact"
                print(f"{n:>2} {r0['leaves']:>6} {r0['layout']:>6} {r0['files']:>10} "
                      f"{pair('save_calls', '{:.1f}'):>20} {pair('save_bytes'):>22} "
                      f"{pair('restore_calls'):>23} {pair('restore_bytes'):>24} "
                      f"{r0['commit_s'] * 1e3:12.1f}", flush=True)


if __name__ == "__main__":
    main()
