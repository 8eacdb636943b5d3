"""The storage interface: what the commit protocol needs from a bucket or a disk.

Keys are ``/``-separated and relative to the store's root (the URL's prefix).
Every implementation offers the same six operations; the conformance suite in
``tests/storage`` runs one set of tests against each.

Errors: a missing key raises ``FileNotFoundError``; a create-only put of an
existing key raises ``AlreadyExistsError`` where the server enforces the
condition (fake-gcs-server, for one, does not: the commit protocol does not
depend on it); anything else is a ``StorageError`` or the client's own
``OSError``, retried by ``retry_call`` when it is transient.
"""

from __future__ import annotations

import abc
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from asyncckpt.errors import AsyncCkptError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class StorageError(AsyncCkptError, OSError):
    """A storage operation failed (after its retries)."""


class AlreadyExistsError(StorageError, FileExistsError):
    """A create-only put found the key already there."""


@dataclass(frozen=True)
class ObjectInfo:
    """One object: its key (relative to the store's root) and size in bytes."""

    key: str
    size: int


class ObjectStore(abc.ABC):
    """A flat key space of immutable objects (a bucket prefix, or a local directory).

    Implementations are thread-safe: the uploader calls them from a pool.
    """

    #: The location, for messages (``s3://bucket/prefix`` or a path).
    url: str = ""
    #: Whether ``put(create_only=True)`` is enforced by the server.
    create_only_enforced: bool = True

    @abc.abstractmethod
    def put(self, key: str, data: bytes | memoryview, *, create_only: bool = False) -> None:
        """Writes one object atomically (readers see all of it or nothing).

        Raises:
            AlreadyExistsError: ``create_only`` and the key exists (where enforced).
        """

    @abc.abstractmethod
    def put_file(self, key: str, path: str) -> None:
        """Uploads a local file, in parallel parts when it is large."""

    @abc.abstractmethod
    def get_range(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of an object (``end=None``: to its end).

        Raises:
            FileNotFoundError: no such key.
        """

    def get(self, key: str) -> bytes:
        """The whole object.

        Raises:
            FileNotFoundError: no such key.
        """
        return self.get_range(key)

    @abc.abstractmethod
    def get_file(self, key: str, path: str) -> int:
        """Downloads an object into a new local file; returns its size."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix``, sorted by key."""

    @abc.abstractmethod
    def delete(self, keys: list[str]) -> None:
        """Deletes objects; keys already gone are ignored."""

    def abort_incomplete_uploads(self, *, older_than_s: float = 0.0) -> int:
        """Aborts multipart uploads started more than ``older_than_s`` ago (left by killed
        writers); returns how many. Stores without such uploads have nothing to abort."""
        del older_than_s
        return 0

    def close(self) -> None:  # noqa: B027 (optional hook: most clients hold nothing to close)
        """Releases connections."""


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Retries of transient storage errors: exponential backoff within a deadline.

    Attributes:
        deadline_s: Give up once this much time has passed since the first try.
        initial_backoff_s: First wait; doubles every retry, with jitter.
        max_backoff_s: Longest single wait.
    """

    deadline_s: float = 120.0
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 10.0


def _is_permanent(e: BaseException) -> bool:
    return isinstance(e, FileNotFoundError | FileExistsError | PermissionError | ValueError |
                      TypeError | NotImplementedError)


def retry_call(fn: Callable[[], T], *, what: str, policy: RetryPolicy,
               should_stop: Callable[[], bool] | None = None) -> T:
    """Calls ``fn`` until it succeeds, a permanent error, or the deadline.

    Raises:
        StorageError: the last transient error, once the deadline has passed
            (the message says what was tried and for how long).
        Exception: a permanent error (missing key, exists, permission) at once.
    """
    start = time.monotonic()
    backoff = policy.initial_backoff_s
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as e:
            if _is_permanent(e):
                raise
            elapsed = time.monotonic() - start
            wait = min(backoff * (0.5 + random.random()), policy.max_backoff_s)
            if elapsed + wait > policy.deadline_s or (should_stop is not None and should_stop()):
                raise StorageError(
                    f"{what} failed after {attempt} attempt(s) in {elapsed:.1f} s: "
                    f"{type(e).__name__}: {e}"
                ) from e
            logger.info("%s failed (%s: %s); retrying in %.2f s", what, type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "", wait)
            time.sleep(wait)  # backoff between network retries, not synchronisation
            backoff *= 2
