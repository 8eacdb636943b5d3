"""Where a checkpoint directory lives: a local path, ``gs://bucket/prefix`` or ``s3://bucket/prefix``.

One function decides, so every entry point (managers, CLI) accepts and rejects
the same strings. Anything that looks like a URL but is not one of the
supported kinds (``hdfs://x``, ``foo://x``, a typo such as ``gs:/x``) is an
error naming the supported schemes; it never becomes a local folder named
after the URL.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from asyncckpt.errors import AsyncCkptError

SUPPORTED_SCHEMES = ("gs", "s3")

# "scheme:/..." with a scheme of two or more letters (so "C:/x" stays a path).
_URLISH = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):(/|$)")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._\-]{1,221}[a-z0-9]$")


class UnsupportedURLError(AsyncCkptError, ValueError):
    """A directory given as a URL of a kind asyncckpt cannot write to."""


@dataclass(frozen=True, kw_only=True)
class Location:
    """A parsed checkpoint directory.

    Attributes:
        scheme: ``"file"``, ``"gs"`` or ``"s3"``.
        bucket: Bucket name (empty for local paths).
        prefix: Key prefix inside the bucket, no leading or trailing ``/``
            (for local paths: the absolute path).
    """

    scheme: str
    bucket: str
    prefix: str

    @property
    def is_remote(self) -> bool:
        return self.scheme != "file"

    @property
    def url(self) -> str:
        """The canonical form: ``s3://bucket/prefix`` or the absolute local path."""
        if not self.is_remote:
            return self.prefix
        return f"{self.scheme}://{self.bucket}/{self.prefix}".rstrip("/")

    def __str__(self) -> str:
        return self.url


def _unsupported(text: str, why: str) -> UnsupportedURLError:
    schemes = ", ".join(f"{s}://bucket/path" for s in SUPPORTED_SCHEMES)
    return UnsupportedURLError(
        f"{text!r} is not a supported checkpoint location ({why}); use a local directory or "
        f"one of: {schemes}"
    )


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` is written as a URL (``scheme://...`` or ``scheme:/...``)."""
    return isinstance(path, str) and bool(_URLISH.match(path))


def parse_location(path: str | os.PathLike) -> Location:
    """Parses a local directory or a ``gs://`` / ``s3://`` URL.

    Raises:
        UnsupportedURLError: ``path`` looks like a URL of another kind, or a
            supported URL is malformed (no bucket, bad bucket name, ``gs:/x``).
    """
    if not isinstance(path, str):
        return Location(scheme="file", bucket="", prefix=os.path.abspath(os.fspath(path)))
    m = _URLISH.match(path)
    if m is None:
        return Location(scheme="file", bucket="", prefix=os.path.abspath(path))
    scheme = m.group(1).lower()
    if scheme not in SUPPORTED_SCHEMES:
        raise _unsupported(path, f"scheme {scheme!r} is not supported")
    if not path[len(scheme) + 1 :].startswith("//"):
        raise _unsupported(path, f"a {scheme} URL starts with '{scheme}://'")
    rest = path[len(scheme) + 3 :]
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket):
        raise _unsupported(path, f"{bucket!r} is not a valid bucket name")
    parts = [p for p in prefix.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise _unsupported(path, "'.' and '..' are not allowed in an object key")
    return Location(scheme=scheme, bucket=bucket, prefix="/".join(parts))
