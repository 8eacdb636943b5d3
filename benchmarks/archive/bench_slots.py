"""Blocking of the first saves of a fresh checkpointer against a memcpy (issue 13).

For each framework and size: a fresh ``asyncckpt.tf.Checkpoint`` or
``asyncckpt.jax.CheckpointManager``, then saves 1..N with ``--steps`` training
steps between them (so save 2 runs while save 1 is still being written and
takes a slot never used before, as in the demo). Each save's blocking is
reported next to a memcpy of the same tensors into warm buffers, timed in the
same run right after the save, and split into the wait for a free slot (disk
bound) and the staging itself.

    python benchmarks/archive/bench_slots.py --sizes 16,256 --arrays 20 --saves 5
    python benchmarks/archive/bench_slots.py --profile jax   # cProfile of 200 16 MiB saves
    python benchmarks/archive/bench_slots.py --steady 60 --sizes 16,64   # steady saves vs memcpy
    python benchmarks/archive/bench_slots.py --bursts 8 --sizes 16,64    # back-to-back vs memcpy
    python benchmarks/archive/bench_slots.py --bursts 4 --early-spare both --repeat 3  # A/B, paired
    python benchmarks/archive/bench_slots.py --bursts 8 --yield-to-saves both --repeat 3  # A/B
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks, tests


def _memcpy_floor(arrays: list[np.ndarray], dsts: list[np.ndarray]) -> float:
    t0 = time.perf_counter()
    for d, s in zip(dsts, arrays, strict=True):
        np.copyto(d, s)
    return time.perf_counter() - t0


def _host_arrays(fw: str, state) -> list[np.ndarray]:
    if fw == "tf":
        return [v.numpy() for v in state.variables.values()]
    return [np.asarray(v).copy() for v in state.tree.values()]


def _checkpointer(fw: str, state, workdir: str, options=None):
    """Returns (save(step), sync(), engine, close()); ``options``: AsyncOptions or None."""
    if fw == "tf":
        import asyncckpt.tf as at

        ckpt = at.Checkpoint(**state.variables, async_options=options)

        def save(step: int) -> None:
            ckpt.write(os.path.join(workdir, f"ckpt-{step}"))

        return save, ckpt.sync, lambda: ckpt.engine, ckpt.sync
    import asyncckpt.jax as aj

    manager = aj.CheckpointManager(workdir, async_options=options)

    def save(step: int) -> None:
        manager.save(step, state.tree, force=True)

    return save, manager.wait_until_finished, lambda: manager.engine, manager.close


def run(fw: str, mib: int, arrays: int, saves: int, steps: int) -> dict:
    from benchmarks.suite import engines as eng

    state = (eng.TFState if fw == "tf" else eng.JAXState)(mib << 20, arrays)
    host = _host_arrays(fw, state)
    dsts = [np.empty_like(a) for a in host]
    for d, s in zip(dsts, host, strict=True):
        np.copyto(d, s)
    with tempfile.TemporaryDirectory(dir=os.environ.get("ASYNCCKPT_BENCH_DIR")) as workdir:
        save, sync, engine, close = _checkpointer(fw, state, workdir)
        blocking, memcpy = [], []
        for i in range(1, saves + 1):
            for _ in range(steps):
                state.step()
            if fw == "jax":
                state.block()
            t0 = time.perf_counter()
            save(i)
            blocking.append(time.perf_counter() - t0)
            memcpy.append(_memcpy_floor(host, dsts))
        sync()
        stats = list(engine().history)[-saves:]
        close()
    waits = [s.slot_wait_s for s in stats]
    return {"blocking": blocking, "memcpy": memcpy, "slot_wait": waits}


def _report(fw: str, mib: int, arrays: int, r: dict) -> None:
    ms = lambda xs: ",".join(f"{x * 1e3:.1f}" for x in xs)  # noqa: E731
    mem = statistics.median(r["memcpy"])
    staging = [b - w for b, w in zip(r["blocking"], r["slot_wait"], strict=True)]
    print(f"{fw} {mib} MiB in {arrays} arrays: memcpy median {mem * 1e3:.2f} ms")
    print(f"  blocking ms per save   {ms(r['blocking'])}")
    print(f"  of which slot wait ms  {ms(r['slot_wait'])}")
    print("  staging / memcpy       " + ",".join(f"{s / mem:.2f}" for s in staging))
    later = staging[1:]
    if later:
        print(f"  saves 2..: max staging / memcpy {max(later) / mem:.2f}, "
              f"median {statistics.median(later) / mem:.2f}")


def _bench_state(fw: str, mib: int):
    """The bench's state of ``mib`` MiB for ``fw``: ``(nbytes, tensors, state)``."""
    from benchmarks.suite import engines as eng

    nbytes = mib << 20
    tensors = eng.tensors_for(nbytes)
    return nbytes, tensors, (eng.TFState if fw == "tf" else eng.JAXState)(nbytes, tensors)


def _own_floor(fw: str, state):
    """JAX: a memcpy from the state's own XLA buffers (``JAXState.memcpy_floor``), else None.

    XLA keeps its buffers on 4 KiB pages, the NumPy floor is on huge pages:
    both floors are reported, as in ``asyncckpt bench``. After a training
    step its first call also takes views of the new shards, as a save does.
    """
    if fw != "jax":
        return None
    memcpy = state.memcpy_floor()
    return lambda: _timed(memcpy)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _own_ratio(times: list[float], own: list[float]) -> str:
    if not own:
        return ""
    o = statistics.median(own)
    return (f"; jax-arrays floor {o * 1e3:.2f} ms -> {statistics.median(times) / o:.2f}x "
            f"(max {max(times) / o:.2f}x)")


def steady(fw: str, mib: int, n: int) -> None:
    """Steady-state saves of the bench's state: blocking against a memcpy (issue 13.4).

    Each timed save follows a training step and the end of the previous
    write, and is followed by a memcpy of the same bytes into one warm
    buffer. Reports the medians, the minima (least disturbed by other load)
    and the saving thread's CPU time per save (``time.thread_time``).
    """
    from benchmarks.suite import engines as eng

    nbytes, tensors, state = _bench_state(fw, mib)
    with tempfile.TemporaryDirectory(dir=os.environ.get("ASYNCCKPT_BENCH_DIR")) as workdir:
        floors = eng.Floors(nbytes, 1, os.path.join(workdir, "floors"))
        save, sync, _, close = _checkpointer(fw, state, workdir)
        own_floor = _own_floor(fw, state)
        for i in range(3):
            save(i)
            sync()
        blocking, cpu, memcpy, own = [], [], [], []
        for i in range(3, n + 3):
            state.step()
            getattr(state, "block", lambda: None)()
            sync()
            t0, c0 = time.perf_counter(), time.thread_time()
            save(i)
            blocking.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            sync()
            memcpy.append(_timed(floors.memcpy))
            if own_floor is not None:
                own.append(own_floor())
        close()
    b, m = statistics.median(blocking), statistics.median(memcpy)
    print(f"{fw} {mib} MiB in {tensors} arrays, {n} saves: blocking median {b * 1e3:.2f} ms, "
          f"memcpy {m * 1e3:.2f} ms -> {b / m:.2f}x; min/min {min(blocking) / min(memcpy):.2f}x; "
          f"saving thread CPU {statistics.median(cpu) * 1e3:.2f} ms per save"
          + _own_ratio(blocking, own))


def bursts(fw: str, mib: int, n: int, size: int = 3, early: bool | None = None,
           yield_: bool | None = None) -> None:
    """Bursts of back-to-back saves against a memcpy of the state (issue 13.3).

    As the bench's back-to-back case: ``size`` saves with one training step
    between them, then a wait until all are durable; ``n`` bursts. After each
    burst, one memcpy of the state into a warm buffer per save in it, so save
    and floor alternate in one process and share its noise. Reports each save
    of the first burst, then the medians over the later bursts of every save
    position after the first, as a ratio to the memcpy median, with the wait
    for a free slot, and the pool's slots and staging memory at the end.
    ``early`` sets ``AsyncOptions.early_spare``, ``yield_``
    ``AsyncOptions.yield_to_saves`` (None: the default). Also reports the
    median time from each burst's first save to all three durable, against
    the same with the other setting when run as an A/B.
    """
    from asyncckpt import AsyncOptions
    from benchmarks.suite import engines as eng

    nbytes, tensors, state = _bench_state(fw, mib)
    with tempfile.TemporaryDirectory(dir=os.environ.get("ASYNCCKPT_BENCH_DIR")) as workdir:
        floors = eng.Floors(nbytes, 1, os.path.join(workdir, "floors"))
        kw = {} if early is None else {"early_spare": early}
        if yield_ is not None:
            kw["yield_to_saves"] = yield_
        opts = AsyncOptions(**kw) if kw else None
        save, sync, engine, close = _checkpointer(fw, state, workdir, opts)
        own_floor = _own_floor(fw, state)
        save(0)  # the first save of all (allocation, tracing), not timed
        sync()
        blocking: list[list[float]] = []
        memcpy: list[float] = []
        own: list[float] = []
        i = 1
        durable: list[float] = []
        for _ in range(n):
            times = []
            start = time.perf_counter()
            for _ in range(size):
                t0 = time.perf_counter()
                save(i)
                times.append(time.perf_counter() - t0)
                state.step()
                getattr(state, "block", lambda: None)()  # JAX: the step's compute, untimed
                i += 1
            sync()
            durable.append(time.perf_counter() - start)
            blocking.append(times)
            for _ in range(size):
                memcpy.append(_timed(floors.memcpy))
                if own_floor is not None:
                    own.append(own_floor())
        waits = [s.slot_wait_s for s in list(engine().history)[-n * size:]]
        slots, staging = engine()._pool.num_slots, engine().staging_bytes
        close()
    m = statistics.median(memcpy)
    first = ",".join(f"{t * 1e3:.1f}" for t in blocking[0])
    ratios = ",".join(f"{t / m:.2f}" for t in blocking[0])
    tag = "" if early is None else f" (early_spare={early})"
    tag += "" if yield_ is None else f" (yield_to_saves={yield_})"
    print(f"{fw} {mib} MiB in {tensors} arrays, {n} bursts of {size}{tag}: memcpy median "
          f"{m * 1e3:.2f} ms; first burst ms {first} = x memcpy {ratios}, slot wait ms "
          + ",".join(f"{w * 1e3:.1f}" for w in waits[:size])
          + f"; slots {slots}, staging {staging / 2**20:.0f} MiB; burst to durable median "
          f"{statistics.median(durable) * 1e3:.0f} ms")
    for pos in range(1, size):
        later = [b[pos] for b in blocking[1:]]
        wait = [waits[k * size + pos] for k in range(1, n) if k * size + pos < len(waits)]
        print(f"  save {pos + 1} of later bursts: median {statistics.median(later) * 1e3:.2f} ms "
              f"= {statistics.median(later) / m:.2f}x memcpy (max {max(later) / m:.2f}x), "
              f"slot wait median {statistics.median(wait) * 1e3:.2f} ms" + _own_ratio(later, own))


def _profile(fw: str, n: int = 200) -> None:
    from benchmarks.suite import engines as eng

    state = (eng.TFState if fw == "tf" else eng.JAXState)(16 << 20, 20)
    with tempfile.TemporaryDirectory() as workdir:
        save, sync, _, close = _checkpointer(fw, state, workdir)
        for i in range(3):
            save(i)
            sync()
        prof = cProfile.Profile()
        for i in range(3, n + 3):
            prof.enable()
            save(i)
            prof.disable()
            sync()
        close()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frameworks", default="tf,jax")
    p.add_argument("--sizes", default="16,256", help="MiB, comma separated")
    p.add_argument("--arrays", type=int, default=20)
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="training steps between saves")
    p.add_argument("--profile", choices=["tf", "jax"])
    p.add_argument("--steady", type=int, default=0, metavar="N",
                   help="instead: N steady-state saves per framework and size (issue 13.4)")
    p.add_argument("--bursts", type=int, default=0, metavar="N",
                   help="instead: N bursts of 3 back-to-back saves (issue 13.3)")
    p.add_argument("--early-spare", choices=["default", "on", "off", "both"], default="default",
                   help="--bursts: AsyncOptions.early_spare; both: off and on alternately, "
                        "--repeat times per framework and size")
    p.add_argument("--yield-to-saves", choices=["default", "on", "off", "both"],
                   default="default",
                   help="--bursts: AsyncOptions.yield_to_saves; both: off and on alternately")
    p.add_argument("--repeat", type=int, default=1)
    args = p.parse_args()
    if args.profile:
        _profile(args.profile)
        return 0
    if args.bursts:
        modes = {"default": [None], "on": [True], "off": [False], "both": [False, True]}
        for fw in args.frameworks.split(","):
            for mib in (int(x) for x in args.sizes.split(",")):
                for _ in range(args.repeat):
                    for early in modes[args.early_spare]:
                        for y in modes[args.yield_to_saves]:
                            bursts(fw, mib, args.bursts, early=early, yield_=y)
        return 0
    if args.steady:
        for fw in args.frameworks.split(","):
            for mib in (int(x) for x in args.sizes.split(",")):
                steady(fw, mib, args.steady)
        return 0
    for fw in args.frameworks.split(","):
        for mib in (int(s) for s in args.sizes.split(",")):
            _report(fw, mib, args.arrays, run(fw, mib, args.arrays, args.saves, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
