"""Device-to-host paths for a JAX pytree: what a snapshot can cost on this backend.

Measures, for one pytree of ``--mib`` MiB sharded over every local device, the
blocking time of the ways a checkpoint engine can get the values into host
memory, next to the host memcpy floor of the same bytes:

* ``device_get``: ``jax.device_get`` (new pageable NumPy arrays every time);
* ``async + copy into reused buffers``: ``copy_to_host_async`` on every shard
  at once, then a copy of each shard into buffers kept from save to save
  (what ``asyncckpt.jax`` does);
* ``device_put pinned_host``: an XLA copy into pinned host memory (on GPUs
  the DMA engine's fastest path; absent on backends without memory kinds);
* ``memcpy``: NumPy copy of the same bytes between two host buffers.

On CPU the "device" is host memory, so every path is a memcpy; on a GPU the
device-to-host bandwidth bounds them. Run:

    python benchmarks/archive/bench_jax_d2h.py --mib 1024 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if "jax" not in sys.modules:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def make_tree(nbytes: int, leaves: int) -> dict:
    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("d",))
    rows = max(len(devices), nbytes // leaves // 4 // 1024)
    rows -= rows % len(devices)
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    tree = {
        f"w{i}": jax.device_put(jnp.full((rows, 1024), float(i), jnp.float32), sharding)
        for i in range(leaves)
    }
    jax.block_until_ready(tree)
    return tree


def device_get(tree: dict) -> None:
    jax.device_get(tree)


def async_then_asarray(tree: dict) -> None:
    arrays = list(tree.values())
    for a in arrays:
        a.copy_to_host_async()
    for a in arrays:
        np.asarray(a)


class ReusedBuffers:
    """Starts every shard's transfer at once, then copies into kept buffers."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, int], np.ndarray] = {}

    def __call__(self, tree: dict) -> None:
        shards = [(k, i, s) for k, a in tree.items() for i, s in enumerate(a.addressable_shards)]
        for _, _, s in shards:
            s.data.copy_to_host_async()
        for k, i, s in shards:
            host = np.asarray(s.data)
            buf = self.buffers.get((k, i))
            if buf is None or buf.shape != host.shape:
                buf = self.buffers[(k, i)] = np.empty_like(host)
            np.copyto(buf, host)


def pinned_host_put(tree: dict) -> dict:
    out = {
        k: jax.device_put(a, a.sharding.with_memory_kind("pinned_host")) for k, a in tree.items()
    }
    return jax.block_until_ready(out)


def pinned_host_then_numpy(tree: dict) -> None:
    for a in pinned_host_put(tree).values():
        for s in a.addressable_shards:
            np.asarray(s.data)


def has_pinned_host() -> bool:
    try:
        return any(m.kind == "pinned_host" for m in jax.devices()[0].addressable_memories())
    except Exception:
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--leaves", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    nbytes = args.mib << 20
    tree = make_tree(nbytes, args.leaves)
    total = sum(a.nbytes for a in tree.values())
    src = np.ones(total // 4, np.float32)
    dst = np.zeros_like(src)
    cases = {
        "device_get": device_get,
        "copy_to_host_async + asarray": async_then_asarray,
        "async + copy into reused buffers": ReusedBuffers(),
        "memcpy": lambda _t: np.copyto(dst, src),
    }
    if has_pinned_host():
        cases["device_put pinned_host"] = pinned_host_put
        cases["pinned_host + numpy of shards"] = pinned_host_then_numpy
    bump = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)
    times: dict[str, list[float]] = {k: [] for k in cases}
    for rep in range(args.reps + 1):  # the first round warms up
        for name, fn in cases.items():
            # New device buffers every time: a jax.Array caches its host copy,
            # so reading the same array twice would time a cache hit.
            tree = jax.block_until_ready(bump(tree))
            t0 = time.perf_counter()
            fn(tree)
            dt = time.perf_counter() - t0
            if rep:
                times[name].append(dt)
    dev = jax.devices()[0]
    print(f"{total / 2**20:.0f} MiB in {len(tree)} leaves on {len(jax.devices())} x "
          f"{dev.platform} ({getattr(dev, 'device_kind', '?')}), jax {jax.__version__}")
    floor = statistics.median(times["memcpy"])
    out = {"nbytes": total, "platform": dev.platform, "device_kind": dev.device_kind,
           "jax": jax.__version__, "cases": {}}
    print(f"{'path':<36} {'median ms':>10} {'GB/s':>8} {'vs memcpy':>10}")
    for name, ts in times.items():
        med = statistics.median(ts)
        out["cases"][name] = {"median_s": med, "all_s": ts}
        print(f"{name:<36} {med * 1e3:>10.1f} {total / med / 1e9:>8.1f} {med / floor:>9.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
