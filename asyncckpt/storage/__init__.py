"""Checkpoint storage: local disk, S3 and GCS behind one small interface.

Framework-free (imports neither TensorFlow nor JAX). Layers, bottom up:

* ``url``: what a location string means (``parse_location``);
* ``base`` and one module per kind (``local``, ``s3``, ``gcs``): the object
  store interface (put, ranged get, list, delete, create-only put);
* ``protocol``: committing a checkpoint to a store without rename (data,
  manifest, verified, then a create-only commit marker), listing, download;
* ``tier``: the remote tier that uploads locally committed checkpoints in the
  background, and the managers' view of a local + remote directory.
"""

from asyncckpt.storage.base import (
    AlreadyExistsError,
    ObjectInfo,
    ObjectStore,
    RetryPolicy,
    StorageError,
)
from asyncckpt.storage.stores import open_store
from asyncckpt.storage.tier import RemoteOptions, RemoteTier, TieredDirectory
from asyncckpt.storage.url import (
    SUPPORTED_SCHEMES,
    Location,
    UnsupportedURLError,
    is_url,
    parse_location,
)

__all__ = [
    "SUPPORTED_SCHEMES",
    "AlreadyExistsError",
    "Location",
    "ObjectInfo",
    "ObjectStore",
    "RemoteOptions",
    "RemoteTier",
    "RetryPolicy",
    "StorageError",
    "TieredDirectory",
    "UnsupportedURLError",
    "is_url",
    "open_store",
    "parse_location",
]
