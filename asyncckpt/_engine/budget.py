"""How much host memory staging may hold: the budget behind ``AsyncOptions.host_memory_limit``.

Staging costs one full copy of the state per slot. On a host whose RAM is
not much larger than the state (a TPU VM, a GPU host with a large model),
the defaults (two slots, a spare for bursts) would push the process into the
OOM killer. The engine therefore keeps every staging buffer it holds (slots,
a spare being built) under a budget:

* ``AsyncOptions.host_memory_limit`` bytes when given;
* otherwise ``AsyncOptions.host_memory_fraction`` of the memory this process
  could still take, plus what staging already holds. "Could still take" is
  the smallest of: the kernel's ``MemAvailable``; the headroom of the
  process's memory cgroup (v2 ``memory.max - memory.current``, v1
  ``memory.limit_in_bytes - usage`` with reclaimable page cache left out);
  and the headroom under ``RLIMIT_AS`` and ``RLIMIT_DATA``.

The budget is read again at each decision (a new layout, a spare), so it
follows what the rest of the process has taken since.

Nothing here imports a framework.
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_CGROUP_ROOT = "/sys/fs/cgroup"
_UNLIMITED_V1 = 1 << 60  # cgroup v1 writes a huge number for "no limit"


@dataclass(frozen=True)
class Headroom:
    """Memory the process could still allocate, and which limit says so.

    Attributes:
        nbytes: The smallest headroom found, in bytes.
        source: What set it (``MemAvailable``, ``cgroup``, ``RLIMIT_AS``...).
    """

    nbytes: int
    source: str


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_headroom() -> int | None:
    """Bytes left under this process's memory cgroup limit; None without a limit."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best: int | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            base = os.path.join(_CGROUP_ROOT, path.lstrip("/"))
            limit = _read_int(os.path.join(base, "memory.max"))
            usage = _read_int(os.path.join(base, "memory.current"))
            reclaimable = _stat_value(os.path.join(base, "memory.stat"), "inactive_file")
        elif "memory" in controllers.split(","):  # cgroup v1
            base = os.path.join(_CGROUP_ROOT, "memory", path.lstrip("/"))
            if not os.path.isdir(base):
                base = os.path.join(_CGROUP_ROOT, "memory")  # a namespaced view of our own
            limit = _read_int(os.path.join(base, "memory.limit_in_bytes"))
            usage = _read_int(os.path.join(base, "memory.usage_in_bytes"))
            reclaimable = _stat_value(os.path.join(base, "memory.stat"), "total_inactive_file")
            if limit is not None and limit >= _UNLIMITED_V1:
                limit = None
        else:
            continue
        if limit is None or usage is None:
            continue
        room = max(0, limit - max(0, usage - reclaimable))
        best = room if best is None else min(best, room)
    return best


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _rlimit_headroom() -> tuple[int, str] | None:
    """Bytes left under ``RLIMIT_AS`` / ``RLIMIT_DATA``; None when neither is set."""
    best: tuple[int, str] | None = None
    for name, field in (("RLIMIT_AS", "VmSize"), ("RLIMIT_DATA", "VmData")):
        soft, _ = resource.getrlimit(getattr(resource, name))
        if soft == resource.RLIM_INFINITY:
            continue
        used = _status_kib(field)
        if used is None:
            continue
        room = max(0, soft - used)
        if best is None or room < best[0]:
            best = (room, name)
    return best


def headroom() -> Headroom | None:
    """The memory this process could still allocate; None where nothing says."""
    found: list[Headroom] = []
    avail = _meminfo_available()
    if avail is not None:
        found.append(Headroom(avail, "MemAvailable"))
    cgroup = _cgroup_headroom()
    if cgroup is not None:
        found.append(Headroom(cgroup, "cgroup memory limit"))
    rlimit = _rlimit_headroom()
    if rlimit is not None:
        found.append(Headroom(*rlimit))
    return min(found, key=lambda h: h.nbytes) if found else None


@dataclass(frozen=True)
class Budget:
    """The staging budget at one moment.

    Attributes:
        nbytes: Bytes staging may hold in all (None: unknown, no limit).
        why: How it was set, for log lines and errors.
    """

    nbytes: int | None
    why: str

    def slots_for(self, state_nbytes: int, *, beside: int = 0) -> int | None:
        """How many slots of ``state_nbytes`` fit beside ``beside`` bytes (None: any number).

        ``beside``: memory the writer holds outside the slots while it writes
        (the OCDBT writer's copies of small values for its B-tree leaves;
        values it writes from the slot cost nothing), once whatever the slots.
        """
        if self.nbytes is None or state_nbytes <= 0:
            return None
        return max(0, self.nbytes - beside) // state_nbytes


def staging_budget(limit: int | None, fraction: float, held: int) -> Budget:
    """The budget for staging, given ``AsyncOptions`` and the bytes staging holds now.

    Args:
        limit: ``AsyncOptions.host_memory_limit`` (bytes), or None.
        fraction: ``AsyncOptions.host_memory_fraction``, used without a limit.
        held: Bytes the staging buffers hold already (they count as taken
            by the kernel's figures, but are the budget's own).
    """
    if limit is not None:
        return Budget(limit, f"host_memory_limit={limit / 2**20:.0f} MiB")
    room = headroom()
    if room is None:
        return Budget(None, "no memory figure available")
    total = int(fraction * (room.nbytes + held))
    return Budget(total, f"{fraction:g} x ({room.source} {room.nbytes / 2**20:.0f} MiB "
                         f"+ {held / 2**20:.0f} MiB staged)")
