"""Opening the store for a location."""

from __future__ import annotations

import os

from asyncckpt.storage.base import ObjectStore
from asyncckpt.storage.url import Location, parse_location


def open_store(location: str | os.PathLike | Location, *, part_size: int = 16 << 20
               ) -> ObjectStore:
    """The object store of a local directory, ``s3://`` or ``gs://`` URL.

    Raises:
        UnsupportedURLError: an unsupported or malformed URL.
        ImportError: the client library for the scheme is not installed.
    """
    loc = location if isinstance(location, Location) else parse_location(location)
    if loc.scheme == "s3":
        from asyncckpt.storage.s3 import S3ObjectStore

        return S3ObjectStore(loc.bucket, loc.prefix, part_size=part_size)
    if loc.scheme == "gs":
        from asyncckpt.storage.gcs import GCSObjectStore

        return GCSObjectStore(loc.bucket, loc.prefix, part_size=part_size)
    from asyncckpt.storage.local import LocalObjectStore

    return LocalObjectStore(loc.prefix)
