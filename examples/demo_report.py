"""The per-save table both halves of the demo print: blocking against a memcpy of the state."""

from __future__ import annotations

import time


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


class MemcpyFloor:
    """A memcpy of the state's bytes between two warm buffers, timed at every step.

    The floor a save's blocking is compared with: copying the state once in
    host memory is the least a snapshot can cost. Timed in the same loop as
    the saves (before each step's save call), so both meet the same load and
    the same background writes.
    """

    def __init__(self, nbytes: int):
        import numpy as np

        self._src = np.ones(nbytes, np.uint8)
        self._dst = np.empty_like(self._src)
        self._copy = np.copyto
        self._copy(self._dst, self._src)  # both buffers warm
        self.times: list[float] = []

    def measure(self) -> None:
        t0 = time.perf_counter()
        self._copy(self._dst, self._src)
        self.times.append(time.perf_counter() - t0)

    def median(self) -> float:
        return median(self.times)


def print_saves(handles: list, floor: MemcpyFloor, sync_s: float) -> None:
    """One line per save: blocking, background time, speed-up, blocking over a memcpy."""
    memcpy = floor.median()
    print(f"{'step':>5} {'blocked ms':>11} {'background ms':>14} {'speed-up vs sync':>17} "
          f"{'x memcpy':>9}")
    for step, handle in handles:
        s = handle.result()
        print(f"{step:>5} {s.blocking_s * 1e3:>11.1f} {s.background_s * 1e3:>14.0f} "
              f"{sync_s / s.blocking_s:>16.1f}x {s.blocking_s / memcpy:>8.2f}x")
    later = [h.result().blocking_s for _, h in handles[1:]]
    if later:
        print(f"memcpy of the state: {memcpy * 1e3:.1f} ms (median); saves after the first "
              f"blocked at most {max(later) / memcpy:.2f}x that")
