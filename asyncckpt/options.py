"""Options shared by every asyncckpt front end.

Options are keyword-only frozen dataclasses: they can be shared between
objects and threads without surprises, and a typo fails at construction.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncckpt import _deprecation


@dataclass(frozen=True, kw_only=True)
class AsyncOptions:
    """How saves are staged and written in the background.

    Attributes:
        num_slots: Host staging slots. A save blocks only for the copy into a
            free slot; with ``num_slots=2`` a second save can be staged while
            the first is still being written. Each slot holds one full copy of
            the state in host memory, so memory use is ``num_slots`` times the
            state size.
        max_slots: Most staging slots the pool may grow to (keyword-only,
            ``>= num_slots``; None, the default, means ``num_slots + 1``).
            A save that finds every slot still being written waits for one,
            and the pool then builds one more slot of the state's layout on a
            background thread, pre-faulted, so the next burst of saves of the
            same depth finds a slot free and blocks only for its copy. The
            pool so learns the deepest burst the run makes, up to this cap,
            and keeps the spare slots until the engine is closed. At the cap
            a save waits for a slot as with fixed slots; it is never an error.
            A spare is built only while the host memory budget (below) has
            room for it. Memory use is at most ``max_slots`` times the state
            size; set ``max_slots=num_slots`` for fixed slots.
        early_spare: Build the first spare slot (when ``max_slots`` and the
            budget allow one) on a background thread right after the first
            save, instead of when a save first finds every slot busy, so the
            first burst of saves does not wait for it either. It costs one
            more state of host memory from the first save on, whether or not
            the run ever saves in bursts. Off by default: with it, host
            memory is ``num_slots + 1`` states from the first save.
        host_memory_limit: Bytes that staging (slots and spares together,
            and the copy the JAX OCDBT writer hands TensorStore while it
            writes) may hold in host memory. None (the default) allows
            ``host_memory_fraction`` of the memory the process could still
            take (the smallest of ``MemAvailable``, its memory cgroup's
            headroom and its ``RLIMIT_AS``/``RLIMIT_DATA`` headroom, read at
            each decision), plus what staging holds already. When fewer
            copies of the state fit than ``num_slots``, the engine keeps
            fewer slots and logs it once; a save then waits for a free slot
            rather than over-committing. When not even one fits, ``save()``
            (and the managers' ``prepare()``) raises ``HostMemoryError``,
            naming the state size and the budget, before allocating.
        host_memory_fraction: The share of the available memory staging may
            take when ``host_memory_limit`` is None (``0 < f <= 1``). The
            rest is left to the training process's own growth (input
            pipelines, compilation) and its neighbours.
        fsync: Flush file data and directory entries to stable storage before a
            checkpoint is made visible. Turning it off trades durability after
            a power loss for speed; a crashed *process* still never leaves a
            partial checkpoint.
        checksums: Compute a checksum of every file as it is written (in the
            background writer) and record it in the checkpoint's manifest, so
            restores can detect corruption: CRC32C where the hardware one
            (``google_crc32c``'s C library) is installed, else zlib's CRC32;
            the manifest names which.
        exit_timeout_s: At interpreter exit, how long to wait for in-flight
            saves to become durable before giving up (with a log line).
        writer_nice: How much lower than the training threads the background
            writer runs (Linux thread niceness, 0 to 19; ignored elsewhere).
            Writing a checkpoint costs CPU (the kernel's copy into the page
            cache, checksums, serialization); at equal priority it takes that
            time from training steps that use every core, at a lower one it
            uses what training leaves idle and takes longer instead. 0 keeps
            the writer at the training threads' priority.
        background_copy: ``asyncckpt.tf`` (``Checkpoint``,
            ``CheckpointManager``): a save only reads the values in host
            (CPU) memory, which TensorFlow keeps unchanged for as long as the
            read is held (its variables are copy-on-write), and copies them
            into the staging slot on a background thread; ``save()`` then
            blocks for the reads alone. A training step that updates a
            variable before its copy is done pays a copy of that variable
            instead. Values in GPU/TPU memory are copied to the host on the
            calling thread either way. False copies everything on the calling
            thread (the save blocks about one memcpy of the state longer): use
            it for variables whose memory something outside TensorFlow writes
            (DLPack), which copy-on-write cannot see. The JAX front end and
            the Keras callbacks' own staging ignore it.
        yield_to_saves: While a save copies the state into its slot, the
            engine's background work (the writer between write pieces of
            1 MiB, files and fsyncs, TensorFlow's bundle writer between
            16 MiB ranges, a spare slot's build between 8 MiB pieces)
            pauses, and resumes when the copy is done, so the copy that
            training waits for has the cores, the memory bandwidth and the
            GIL to itself. A save waiting for a free slot does not pause
            the writer (it must free the slot). Uploads to object storage
            do not pause. False lets background work run on during copies
            (at ``writer_nice``) and writes in 64 MiB pieces.
        yield_max_wait_s: The longest background work pauses for one
            stretch of staging (one save, or overlapping saves of several
            threads): a staging that takes longer (a slow device-to-host
            transfer, a stage that blocks) then no longer holds it up.
    """

    num_slots: int = 2
    max_slots: int | None = None
    early_spare: bool = False
    host_memory_limit: int | None = None
    host_memory_fraction: float = 0.75
    fsync: bool = True
    checksums: bool = True
    exit_timeout_s: float = 600.0
    writer_nice: int = 10
    background_copy: bool = True
    yield_to_saves: bool = True
    yield_max_wait_s: float = 0.25

    def __post_init__(self) -> None:
        if not isinstance(self.num_slots, int) or self.num_slots < 1:
            raise ValueError(f"num_slots must be a positive int, got {self.num_slots!r}")
        cap = self.max_slots
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool)
                                or cap < self.num_slots):
            raise ValueError(
                f"max_slots must be an int >= num_slots ({self.num_slots}), "
                f"got {self.max_slots!r}"
            )
        limit = self.host_memory_limit
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)
                                  or limit <= 0):
            raise ValueError(f"host_memory_limit must be a positive int of bytes or None, "
                             f"got {limit!r}")
        if not 0 < self.host_memory_fraction <= 1:
            raise ValueError(f"host_memory_fraction must be in (0, 1], "
                             f"got {self.host_memory_fraction!r}")
        if self.exit_timeout_s < 0:
            raise ValueError(f"exit_timeout_s must be >= 0, got {self.exit_timeout_s!r}")
        if (not isinstance(self.writer_nice, int) or isinstance(self.writer_nice, bool)
                or not 0 <= self.writer_nice <= 19):
            raise ValueError(f"writer_nice must be an int from 0 to 19, got {self.writer_nice!r}")
        if not self.yield_max_wait_s >= 0:
            raise ValueError(f"yield_max_wait_s must be >= 0, got {self.yield_max_wait_s!r}")

    @property
    def slot_cap(self) -> int:
        """``max_slots``, with its default (``num_slots + 1``) resolved."""
        return self.num_slots + 1 if self.max_slots is None else self.max_slots


@_deprecation.renamed_fields(verify_checksums="checksums")
@dataclass(frozen=True, kw_only=True)
class RestoreOptions:
    """How a checkpoint is checked before it is restored.

    Attributes:
        checksums: Recompute every file's checksum (in the algorithm its
            manifest record names) and compare it with the manifest. File
            sizes are always checked; restores compute the checksums as the
            bytes arrive, other checks add one read pass. The one name of
            checksums in asyncckpt: ``AsyncOptions.checksums`` writes them,
            ``verify_checkpoint(checksums=...)`` checks them too. Spelled
            ``verify_checksums`` until asyncckpt 0.2 (deprecated).
    """

    checksums: bool = True
