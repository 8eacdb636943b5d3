"""Names read from a checkpoint, kept inside it; files opened only when they are files.

A checkpoint directory is input: a crash, a disk or a bad copy may have
damaged it, and whoever wrote or copied it chose every name in it. Names
read from its files (the manifest's entries, tree metadata keys, an OCDBT
B-tree's data file paths, the ``checkpoint`` state file's entries) are
joined to the checkpoint's directory only after ``check_name`` (or, for a
path, ``inside``) has accepted them: no ``..`` component, no absolute path,
no NUL. The check is on the name, as written: a symbolic link the directory
itself holds is followed, and what it points at must still match the
manifest's size and checksum like any file.

Files are opened with ``O_NONBLOCK`` and looked at (``fstat``) before they
are read: a directory, a FIFO, a socket or a device where a file should be
is damage (``CorruptCheckpointError`` naming it), never a blocking open or a
read of endless bytes.
"""

from __future__ import annotations

import os
import stat

from asyncckpt.errors import CorruptCheckpointError

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def name_problem(name: object) -> str | None:
    """Why ``name`` (``/``-separated, relative) could lead outside its directory; None if not.

    Only ``..`` components, absolute names and NUL bytes can: ``.`` and
    empty components stay where they are.
    """
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a file name"
    if not name:
        return "is empty"
    if "\x00" in name:
        return "holds a NUL byte"
    if name.startswith("/") or os.path.isabs(name):
        return "is an absolute path"
    if ".." in name.split("/") or (os.sep != "/" and ".." in name.split(os.sep)):
        return "leads out of the checkpoint's directory ('..')"
    return None


def check_name(name: object, *, checkpoint: str, source: str) -> str:
    """``name``, if it stays inside its directory.

    Args:
        name: A relative, ``/``-separated name read from a checkpoint file.
        checkpoint: The checkpoint, for the error.
        source: The file ``name`` was read from: the error names it.

    Raises:
        CorruptCheckpointError: ``name`` could lead outside (``name_problem``).
    """
    problem = name_problem(name)
    if problem is not None:
        raise CorruptCheckpointError(
            f"checkpoint {checkpoint!r} is corrupt: {source!r} names the file {name!r}, which "
            f"{problem}; it is not opened", checkpoint=checkpoint, file=source)
    return name  # type: ignore[return-value]


def member(root: str, name: object, *, checkpoint: str, source: str) -> str:
    """The path of ``name`` under ``root``, after ``check_name``."""
    return os.path.join(root, *check_name(name, checkpoint=checkpoint, source=source).split("/"))


def inside(directory: str, path: str) -> str | None:
    """``path`` (absolute, or relative to ``directory``) made absolute, if it lies in ``directory``.

    Decided on the names (``os.path.normpath``), as ``check_name``; None
    when the path leaves ``directory`` or holds a NUL byte.
    """
    if "\x00" in path:
        return None
    root = os.path.normpath(os.path.abspath(directory))
    full = os.path.normpath(os.path.join(root, path))
    if full == root or not full.startswith(root.rstrip(os.sep) + os.sep):
        return None
    return full


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def not_a_file(path: str, mode: int, *, checkpoint: str) -> CorruptCheckpointError:
    """The error for ``path`` not being a regular file (``mode``: its ``st_mode``)."""
    return CorruptCheckpointError(
        f"checkpoint {checkpoint!r} is corrupt: {path!r} is {_kind(mode)}, not a file",
        checkpoint=checkpoint, file=path)


def regular_size(path: str, *, checkpoint: str) -> int:
    """The size of the regular file at ``path`` (symbolic links followed).

    Raises:
        FileNotFoundError: nothing there.
        CorruptCheckpointError: a directory, FIFO, socket or device is there,
            or a symbolic link that loops or whose target is not a directory.
    """
    try:
        st = os.stat(path)
    except NotADirectoryError:
        raise FileNotFoundError(path) from None  # a file where a parent directory should be
    except OSError as e:
        if isinstance(e, FileNotFoundError | PermissionError):
            raise
        raise CorruptCheckpointError(f"checkpoint {checkpoint!r} is corrupt: {path!r} cannot "
                                     f"be looked at: {e}", checkpoint=checkpoint,
                                     file=path) from e
    if not stat.S_ISREG(st.st_mode):
        raise not_a_file(path, st.st_mode, checkpoint=checkpoint)
    return st.st_size


def open_regular(path: str, *, checkpoint: str) -> int:
    """A read-only descriptor of the regular file at ``path``; never blocks on a FIFO.

    The caller closes it.

    Raises:
        FileNotFoundError: nothing there.
        CorruptCheckpointError: not a regular file (``regular_size``).
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except NotADirectoryError:
        raise FileNotFoundError(path) from None
    except OSError as e:
        if isinstance(e, FileNotFoundError | PermissionError):
            raise
        raise CorruptCheckpointError(f"checkpoint {checkpoint!r} is corrupt: {path!r} cannot "
                                     f"be opened: {e}", checkpoint=checkpoint,
                                     file=path) from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_a_file(path, mode, checkpoint=checkpoint)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(path: str, *, checkpoint: str) -> bytes:
    """The contents of the regular file at ``path`` (a metadata file: read whole).

    Raises:
        FileNotFoundError: nothing there.
        CorruptCheckpointError: not a regular file (``open_regular``).
    """
    fd = open_regular(path, checkpoint=checkpoint)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)
