"""The JAX half of the demo: a plain-JAX MLP with asynchronous checkpoints.

A small MLP and a hand-written momentum-SGD optimizer, parameters sharded
over every device (8 CPU devices with the demo's XLA flag), a jitted train
step that donates the old state, and ``asyncckpt.jax.CheckpointManager``
saving every few steps. For each save it prints how long training was blocked
next to the background write time and a synchronous orbax save of the same
state; then it restores into a fresh target, with asyncckpt and with orbax's
own API, and checks every value.
"""

from __future__ import annotations

import itertools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import asyncckpt.jax as aj
from asyncckpt import AsyncOptions
from examples.demo_report import MemcpyFloor, median, print_saves


def _init(key: jax.Array, widths: list[int], mesh: Mesh) -> dict:
    """Parameters (columns sharded over the mesh), zero momentum, a step counter."""
    params = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        k = jax.random.fold_in(key, i)
        w = jax.random.normal(k, (fan_in, fan_out), jnp.float32) / np.sqrt(fan_in)
        last = i == len(widths) - 2
        col = P() if last else P(None, "d")
        params.append({
            "w": jax.device_put(w, NamedSharding(mesh, col)),
            "b": jax.device_put(jnp.zeros(fan_out), NamedSharding(mesh, P() if last else P("d"))),
        })
    momentum = jax.tree.map(jnp.zeros_like, params)
    return {"params": params, "momentum": momentum, "step": jnp.int32(0)}


def _loss(params: list, x: jax.Array, y: jax.Array) -> jax.Array:
    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    out = h @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean((out - y) ** 2)


def _train_step(state: dict, x: jax.Array, y: jax.Array, lr: float = 1e-2, beta: float = 0.9):
    loss, grads = jax.value_and_grad(_loss)(state["params"], x, y)
    momentum = jax.tree.map(lambda m, g: beta * m + g, state["momentum"], grads)
    params = jax.tree.map(lambda p, m: p - lr * m, state["params"], momentum)
    return {"params": params, "momentum": momentum, "step": state["step"] + 1}, loss


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def _sync_orbax_seconds(workdir: str, state: dict) -> tuple[float, str]:
    """One synchronous orbax save of the same state (the second, after a warm-up)."""
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        return _sync_numpy_seconds(workdir, state), "np.save + fsync"
    import logging

    logging.getLogger("absl").setLevel(logging.ERROR)
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    with ocp.CheckpointManager(os.path.join(workdir, "orbax-sync"), options=options) as mgr:
        mgr.save(0, args=ocp.args.StandardSave(state))
        t0 = time.perf_counter()
        mgr.save(1, args=ocp.args.StandardSave(state))
        mgr.wait_until_finished()
        return time.perf_counter() - t0, "orbax synchronous save (no fsync)"


def _sync_numpy_seconds(workdir: str, state: dict) -> float:
    path = os.path.join(workdir, "numpy-sync.npz")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        np.savez(f, *[np.asarray(x) for x in jax.tree.leaves(state)])
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def _orbax_restore_matches(directory: str, step: int, target, expected) -> bool | None:
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        return None
    with ocp.CheckpointManager(directory) as mgr:
        got = mgr.restore(step, args=ocp.args.StandardRestore(target))
    return _equal(expected, got)


def _equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb, strict=True)
    )


def run_jax_demo(workdir: str, *, steps: int = 30, every: int = 5, width: int = 1536,
                 async_options: AsyncOptions | None = None) -> bool:
    """Trains, saves asynchronously, restores; returns whether every value matched.

    ``async_options`` go to the manager that saves (benchmarks compare settings).
    """
    os.makedirs(workdir, exist_ok=True)
    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("d",))
    widths = [256, width, width, width, width, 16]
    state = _init(jax.random.key(0), widths, mesh)
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.standard_normal((256, widths[0]), np.float32), NamedSharding(mesh, P()))
    y = jax.device_put(rng.standard_normal((256, widths[-1]), np.float32),
                       NamedSharding(mesh, P()))
    step_fn = jax.jit(_train_step, donate_argnums=0)
    state, _ = step_fn(state, x, y)  # compile outside the timings
    jax.block_until_ready(state)
    mib = sum(a.nbytes for a in jax.tree.leaves(state)) / 2**20
    sync_s, sync_name = _sync_orbax_seconds(workdir, state)
    print(f"state: {mib:.0f} MiB over {len(devices)} {devices[0].platform} devices; "
          f"{sync_name}: {sync_s * 1e3:.0f} ms")

    directory = os.path.join(workdir, "jax")
    handles = []
    floor = MemcpyFloor(sum(a.nbytes for a in jax.tree.leaves(state)))
    with aj.CheckpointManager(directory, max_to_keep=3, save_interval_steps=every,
                              async_options=async_options) as mgr:
        mgr.prepare(state)  # staging memory built in the background, not at the first save
        step = int(state["step"])  # 1: the compiling step above counted
        while step < steps:
            state, loss = step_fn(state, x, y)  # the old state is donated
            step = int(state["step"])
            floor.measure()
            if mgr.save(step, state, metrics={"loss": float(loss)}):
                handles.append((step, mgr.last_save))
        mgr.wait_until_finished()
        print_saves(handles, floor, sync_s)
        blocked = median([h.result().blocking_s for _, h in handles])
        latest = mgr.latest_step()
        print(f"median: training blocked {blocked * 1e3:.1f} ms per save instead of "
              f"{sync_s * 1e3:.0f} ms ({sync_s / blocked:.1f}x less); kept steps "
              f"{mgr.all_steps()}")

    # A fresh manager, as after a restart; the target says where each array goes.
    with aj.CheckpointManager(directory) as fresh:
        restored = fresh.restore(target=_abstract(state))
    ok = _equal(state, restored) and int(restored["step"]) == latest
    print(f"restored step {latest} with asyncckpt.jax: "
          f"{'all values match' if ok else 'MISMATCH'}")
    orbax_ok = _orbax_restore_matches(directory, latest, _abstract(state), state)
    if orbax_ok is not None:
        print(f"restored step {latest} with orbax.checkpoint.CheckpointManager: "
              f"{'all values match' if orbax_ok else 'MISMATCH'}")
    return ok and orbax_ok is not False
