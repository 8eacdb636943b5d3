"""Checkpoint storage: local disk, S3 and GCS behind one small interface.

Framework-free (imports neither TensorFlow nor JAX). What a user writes is
the managers' ``directory="s3://bucket/run"`` or ``remote="gs://bucket/run"``,
and the options and errors listed here. Layers, bottom up (internal: import
from the module that defines a name):

* ``url``: what a location string means (``parse_location``);
* ``base`` and one module per kind (``local``, ``s3``, ``gcs``): the object
  store interface (put, ranged get, list, delete, create-only put);
* ``protocol``: committing a checkpoint to a store without rename (data,
  manifest, verified, then a create-only commit marker), listing, download;
* ``tier``: the remote tier that uploads locally committed checkpoints in the
  background, and the managers' view of a local + remote directory.
"""

from asyncckpt import _deprecation
from asyncckpt.storage.base import RetryPolicy, StorageError
from asyncckpt.storage.tier import RemoteOptions
from asyncckpt.storage.url import UnsupportedURLError

__all__ = [
    "RemoteOptions",
    "RetryPolicy",
    "StorageError",
    "UnsupportedURLError",
]

_INTERNAL = ("internal since asyncckpt 0.2: the managers take directory='s3://...' or "
             "remote='gs://...'; import it from {} if you must")

# Names that left this namespace in asyncckpt 0.2: they warn, for one release.
__getattr__ = _deprecation.moved(__name__, {
    name: (f"asyncckpt.storage.{module}", name, _INTERNAL.format(f"asyncckpt.storage.{module}"))
    for module, names in {
        "base": ("AlreadyExistsError", "ObjectInfo", "ObjectStore"),
        "stores": ("open_store",),
        "tier": ("RemoteTier", "TieredDirectory"),
        "url": ("SUPPORTED_SCHEMES", "Location", "is_url", "parse_location"),
    }.items() for name in names
})
