"""Blocking time of one JAX save against memcpy floors, paired in one process.

Usage: python benchmarks/archive/bench_jax_blocking.py [--mib 16,64] [--tensors 4,100] [--reps 40]
       [--step] [--profile] [--page-sizes] [--phases]

Per state size and tensor count, every repetition runs each case once, in
rotating order, after the previous save's write has finished (untimed):

- ``asyncckpt jax``: ``CheckpointManager.save`` of the pytree (blocking part);
- ``memcpy (bench floor)``: ``asyncckpt bench``'s floor, one ``np.copyto`` of
  a separate NumPy array of the same bytes into a preallocated one;
- ``memcpy per tensor (bench floor)``: the same, tensor by tensor;
- ``memcpy of the jax arrays``: ``np.copyto`` of each leaf's host view into
  a preallocated NumPy array per leaf: the copy a save cannot avoid, from the
  same source memory as the save;
- ``memcpy of the jax arrays, huge pages``: the same into warm buffers made
  as the staging slots make theirs (``aligned_empty``: 2 MiB pages where the
  kernel gives them), the closest floor to what a save's copy does.

The bench floor copies a NumPy array that NumPy itself put on transparent
huge pages into another; XLA's buffers are on 4 KiB pages, so a copy from
them walks 512x the page-table entries on the source side.

``--page-sizes`` adds two copies of the same bytes into the same huge-page
buffers from private mappings of 4 KiB pages and of huge pages, which tells
how much of the gap to the bench floor is the source memory's page size.

With ``--step`` a training step (the bench's donating matmul) runs before
every case, untimed, so each case starts from the cache state a training
loop leaves. ``--profile`` prints where one save's time goes (cProfile over
the asyncckpt saves). ``--phases`` also times the copy into the slot inside
each save (``copy_arrays``, wrapped for timing only) and reports the rest of
the save (Python bookkeeping) apart. Reported: medians and ratios to each floor.
"""

from __future__ import annotations

import argparse
import cProfile
import mmap
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks, tests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", default="16,64")
    parser.add_argument("--tensors", default="4,100")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--step", action="store_true", help="a training step before each case")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--page-sizes", action="store_true",
                        help="also copy from 4 KiB-page and huge-page copies of the arrays")
    parser.add_argument("--phases", action="store_true",
                        help="time the copy into the slot apart from the rest of each save")
    args = parser.parse_args()

    import jax

    import asyncckpt.jax as aj
    from asyncckpt._engine._pages import aligned_empty
    from benchmarks.suite import engines as eng

    copy_ns: list[int] = []
    if args.phases:
        from asyncckpt.jax import _snapshot

        copy_arrays = _snapshot.copy_arrays

        def timed_copy(pairs, copy_arrays=copy_arrays):
            t = time.perf_counter_ns()
            copy_arrays(pairs)
            copy_ns.append(time.perf_counter_ns() - t)

        _snapshot.copy_arrays = timed_copy
    print(f"jax {jax.__version__}, devices {jax.devices()}, load {os.getloadavg()}")
    for mib in (int(m) for m in args.mib.split(",")):
        for tensors in (int(t) for t in args.tensors.split(",")):
            nbytes = mib << 20
            state = eng.JAXState(nbytes, tensors)
            floors = eng.Floors(state.nbytes, tensors, tempfile.mkdtemp(prefix="jaxblk-"))
            dsts = [np.zeros(v.shape, v.dtype) for v in state.tree.values()]
            huge = [aligned_empty(v.nbytes).view(v.dtype).reshape(v.shape)
                    for v in state.tree.values()]
            work = tempfile.mkdtemp(prefix="jaxblk-")
            mgr = aj.CheckpointManager(work, max_to_keep=2)
            step_no = [0]
            extra: dict = {}

            def ours(mgr=mgr, state=state, step_no=step_no):
                step_no[0] += 1
                mgr.save(step_no[0], state.tree, force=True)

            def jax_memcpy(state=state, dsts=dsts):
                for d, v in zip(dsts, state.tree.values(), strict=True):
                    np.copyto(d, np.asarray(v))

            def jax_memcpy_huge(state=state, dsts=huge):
                for d, v in zip(dsts, state.tree.values(), strict=True):
                    np.copyto(d, np.asarray(v))

            if args.page_sizes:
                for label, huge_src in (("4 KiB", False), ("huge", True)):
                    copies = [_mapped(v.nbytes, huge_src).view(v.dtype).reshape(v.shape)
                              for v in state.tree.values()]
                    for c, v in zip(copies, state.tree.values(), strict=True):
                        np.copyto(c, np.asarray(v))

                    def from_pages(copies=copies, dsts=huge):
                        for d, c in zip(dsts, copies, strict=True):
                            np.copyto(d, c)

                    extra[f"memcpy from {label}-page copies, huge pages"] = from_pages
            cases = {
                "asyncckpt jax": ours,
                "memcpy (bench floor)": floors.memcpy,
                "memcpy per tensor (bench floor)": floors.memcpy_per_tensor,
                "memcpy of the jax arrays": jax_memcpy,
                "memcpy of the jax arrays, huge pages": jax_memcpy_huge,
                **extra,
            }
            times: dict[str, list[float]] = {k: [] for k in cases}
            names = list(cases)
            prof = cProfile.Profile() if args.profile else None
            for rep in range(args.reps + 3):  # three warm-up repetitions
                for name in names[rep % len(names):] + names[: rep % len(names)]:
                    mgr.wait_until_finished()
                    if args.step:
                        state.step()
                        state.block()
                    fn = cases[name]
                    if prof is not None and name == "asyncckpt jax" and rep >= 3:
                        prof.enable()
                    t0 = time.perf_counter()
                    fn()
                    dt = time.perf_counter() - t0
                    if prof is not None and name == "asyncckpt jax" and rep >= 3:
                        prof.disable()
                    if rep >= 3:
                        times[name].append(dt)
                    elif name == "asyncckpt jax":
                        copy_ns.clear()  # warm-up saves
            mgr.close()
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"\n{mib} MiB in {tensors} tensors ({state.nbytes / 2**20:.1f} MiB), "
                  f"{args.reps} reps{', step before each' if args.step else ''}, "
                  f"load {os.getloadavg()[0]:.2f}")
            for k, v in med.items():
                print(f"  {k:38s} {v * 1e3:7.3f} ms  (min {min(times[k]) * 1e3:.3f})")
            for floor in names[1:]:
                print(f"  ratio asyncckpt / {floor:38s} {med[names[0]] / med[floor]:.2f}x")
            # Per-repetition ratios (paired), median of those.
            paired = [a / b for a, b in zip(times[names[0]], times[names[1]], strict=True)]
            print(f"  median of paired ratios vs bench floor: {statistics.median(paired):.2f}x")
            if args.phases:
                copies = [c / 1e9 for c in copy_ns]
                rest = [t - c for t, c in zip(times[names[0]], copies, strict=True)]
                floor = med[names[1]]
                print(f"  phases: copy into the slot {statistics.median(copies) * 1e3:.3f} ms "
                      f"({statistics.median(copies) / floor:.2f}x bench floor), rest of the "
                      f"save {statistics.median(rest) * 1e3:.3f} ms "
                      f"({statistics.median(rest) / floor:.2f}x)")
                copy_ns.clear()
            if prof is not None:
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def _mapped(nbytes: int, huge: bool) -> np.ndarray:
    """A private anonymous mapping, 2 MiB aligned, on huge pages or kept off them."""
    region = mmap.mmap(-1, nbytes + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    raw = np.frombuffer(region, dtype=np.uint8)
    offset = (-raw.ctypes.data) % (2 << 20)
    return raw[offset : offset + nbytes]


if __name__ == "__main__":
    main()
