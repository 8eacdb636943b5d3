"""Each process's part of a multi-process checkpoint's manifest, kept next to its files.

In a multi-process save every process writes the records of its own files
(name, size, checksum) into its *part*, ``asyncckpt.part-<process>.json``
at the root of the step's temporary directory (or, without a shared
directory, uploads it with its files), and tells process 0 only that it is
done and the part's digest: a few bytes through the coordination service,
whatever the number of files. Process 0 reads the parts in parallel, checks
each against its digest, and writes the one manifest of the checkpoint.
A part that process 0 cannot find means the processes do not share the
directory (the save then fails on every process, naming it). Parts are not
part of the published checkpoint: process 0 removes them before the commit
(an object store keeps them beside the step, unlisted, until it is deleted).
"""

from __future__ import annotations

import contextlib
import json
import os
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from asyncckpt._engine import commit as commit_lib
from asyncckpt._engine.files import FileRecord

_FORMAT = 1
_READERS = 16  # parts read at once by process 0


def part_name(process: int) -> str:
    """The file name of a process's part, relative to the step."""
    return f"asyncckpt.part-{process}.json"


def encode(process: int, records: Sequence[FileRecord]) -> tuple[bytes, str]:
    """A part's bytes, and its digest (``<files>:<crc32>``) for the coordination message."""
    data = json.dumps({"format": _FORMAT, "process": process,
                       "files": [r.to_json() for r in records]},
                      separators=(",", ":")).encode()
    return data, f"{len(records)}:{zlib.crc32(data):08x}"


def write(directory: str, process: int, records: Sequence[FileRecord], *,
          fsync: bool) -> tuple[FileRecord, str]:
    """Writes a process's part into the step directory ``directory`` (atomically, durably).

    Returns:
        The part's own record (to upload it) and its digest.
    """
    data, digest = encode(process, records)
    name = part_name(process)
    commit_lib.write_text_atomic(os.path.join(directory, name), data.decode(), fsync=fsync)
    return FileRecord(name, len(data), None), digest


def read_all(digests: dict[int, str], read: Callable[[str], bytes | None], *, where: str
             ) -> tuple[dict[int, list[FileRecord]], dict[int, str]]:
    """Process 0: every other process's part, read in parallel and checked.

    Args:
        digests: Each process's digest, as it reported it.
        read: Reads a part by name (None: not there).
        where: Where process 0 looks, for the message of a missing part.

    Returns:
        ``(records by process, failures by process)``.
    """
    def one(item: tuple[int, str]) -> tuple[int, list[FileRecord] | None, str | None]:
        process, digest = item
        name = part_name(process)
        try:
            data = read(name)
        except OSError as e:
            return process, None, f"its manifest part {name} cannot be read from {where}: {e}"
        if data is None:
            return process, None, (
                f"its files are not in {where}, where process 0 commits ({name} is missing). "
                "A multi-process save needs a directory every process shares "
                "(see docs/storage.md)")
        count, _, crc = digest.partition(":")
        if f"{zlib.crc32(data):08x}" != crc:
            return process, None, f"its manifest part {name} in {where} is not the one it wrote"
        try:
            body = json.loads(data)
            records = [FileRecord.from_json(d) for d in body["files"]]
        except (ValueError, KeyError, TypeError) as e:
            return process, None, f"its manifest part {name} is unreadable: {e}"
        if str(len(records)) != count:
            return process, None, f"its manifest part {name} lists {len(records)} files, " \
                                  f"not {count}"
        return process, records, None

    parts: dict[int, list[FileRecord]] = {}
    failures: dict[int, str] = {}
    if not digests:
        return parts, failures
    with ThreadPoolExecutor(min(_READERS, len(digests)),
                            thread_name_prefix="asyncckpt-parts") as pool:
        for process, records, failure in pool.map(one, sorted(digests.items())):
            if failure is not None:
                failures[process] = failure
            else:
                parts[process] = records  # type: ignore[assignment]
    return parts, failures


def local_reader(directory: str) -> Callable[[str], bytes | None]:
    """Reads parts from a (shared) step directory."""
    def read(name: str) -> bytes | None:
        try:
            with open(os.path.join(directory, name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    return read


def remove(directory: str, processes: Sequence[int]) -> None:
    """Removes the parts of these processes from a step directory (before its commit)."""
    for process in processes:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, part_name(process)))
