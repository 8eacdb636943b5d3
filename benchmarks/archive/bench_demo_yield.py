"""The JAX demo's per-save blocking (x memcpy), with and without ``yield_to_saves``.

Runs ``examples.jax_demo.run_jax_demo`` alternately with
``AsyncOptions(yield_to_saves=False)`` and ``True`` in one process (off
first in even rounds, on first in odd ones), so both settings meet the same
load, and reads each run's per-save table (the demo
prints each save's blocking over a memcpy of the state timed in the same
loop). Reports, per setting, the median and the worst of the saves after
the first, over all rounds, and each round's worst.

    python benchmarks/archive/bench_demo_yield.py --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks, tests

_ROW = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)x\s+([\d.]+)x\s*$")


def _ratios(text: str) -> list[float]:
    """The ``x memcpy`` column of the demo's table, one per save, in order."""
    return [float(m.group(5)) for line in text.splitlines() if (m := _ROW.match(line))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    from asyncckpt import AsyncOptions
    from examples.jax_demo import run_jax_demo

    later: dict[bool, list[float]] = {False: [], True: []}
    worst: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):  # order alternates
            with tempfile.TemporaryDirectory(dir=os.environ.get("ASYNCCKPT_BENCH_DIR")) as d:
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    ok = run_jax_demo(os.path.join(d, "jax"), steps=args.steps,
                                      async_options=AsyncOptions(yield_to_saves=on))
            ratios = _ratios(out.getvalue())
            if not ok or len(ratios) < 2:
                print(out.getvalue())
                print(f"round {r}, yield_to_saves={on}: demo failed or printed no table")
                return 1
            later[on] += ratios[1:]
            worst[on].append(max(ratios[1:]))
            print(f"round {r} yield_to_saves={on}: saves x memcpy "
                  + ",".join(f"{x:.2f}" for x in ratios), flush=True)
    for on in (False, True):
        med = statistics.median(later[on])
        print(f"yield_to_saves={on}: saves after the first, median {med:.2f}x memcpy, "
              f"max {max(later[on]):.2f}x; per-round max "
              + ",".join(f"{x:.2f}" for x in worst[on]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
