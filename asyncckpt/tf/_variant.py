"""Variant tensors of a save (``tf.data`` iterator state): captured at the call, encoded later.

A ``tf.data`` iterator serializes to a ``DT_VARIANT`` tensor (TensorFlow's
``SerializeIterator`` op, which ``tf.train.Checkpoint`` runs too): one
element per piece of the pipeline's state (positions, shuffle and prefetch
buffers, seed generators). That op is the snapshot. It runs at the save
call, on the calling thread, and what it returns is immutable: its elements
hold their own reference to the state's tensors (which ``tf.data`` never
writes into), so the iterator's later ``next()`` calls cannot change it.

What is left is turning each element into bytes (``Variant::Encode``, which
for iterator state also compresses it): in one measurement 0.13 s for a
4.9 MB state whose serialization took 0.3 s. That part runs on the writer
thread, like the rest of the write.

The bytes come from TensorFlow itself: ``SerializeTensor`` of a variant
tensor stores each element's ``Variant::Encode`` (a serialized
``VariantTensorDataProto``) in the ``TensorProto``'s ``tensor_content`` as
a list (every length as a varint32, then every element's bytes). Those are
the bytes ``SaveV2`` writes for each element (``WriteVariantTensor``);
``_bundlewrite`` frames them as it does, so the files are byte-identical.
"""

from __future__ import annotations

import logging

import numpy as np

from asyncckpt.tf import _compat
from asyncckpt.tf._bundle import read_varint
from asyncckpt.tf._compat import tf

logger = logging.getLogger(__name__)


def split_variant_list(content: bytes, count: int) -> list[memoryview]:
    """The ``count`` elements of a variant list (``port::EncodeVariantList``).

    Raises:
        ValueError: ``content`` is not such a list of ``count`` elements.
    """
    buf = memoryview(content)
    pos = 0
    lengths = []
    for _ in range(count):
        n, pos = read_varint(buf, pos)
        lengths.append(n)
    if pos + sum(lengths) != len(buf):
        raise ValueError(f"{len(buf)} bytes do not hold {count} elements of the lengths listed")
    out = []
    for n in lengths:
        out.append(buf[pos:pos + n])
        pos += n
    return out


class CapturedVariant:
    """A variant tensor held from the save call until it is written.

    Attributes:
        tensor: The variant tensor, as the save call captured it.
        shape: Its shape.
    """

    def __init__(self, tensor: tf.Tensor):
        self.tensor = tensor
        self.shape: tuple[int, ...] = tuple(int(d) for d in tensor.shape)
        self._elements: list[memoryview] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of its encoded elements (0 until ``elements`` has run)."""
        return sum(len(e) for e in self._elements) if self._elements is not None else 0

    def elements(self) -> list[memoryview] | None:
        """Each element's ``Variant::Encode`` bytes, in row-major order (computed once).

        Runs TensorFlow's ``SerializeTensor`` (on the writer thread). None
        when TensorFlow's encoding is not the element list described in
        the module docstring; the caller then lets ``SaveV2`` write the tensor.

        Raises:
            tf.errors.OpError: TensorFlow cannot encode the tensor (``SaveV2``
                could not either).
        """
        if self._elements is not None:
            return self._elements
        from tensorflow.core.framework import tensor_pb2

        with _compat.sync_executor_scope(), tf.device("CPU:0"):
            encoded = tf.io.serialize_tensor(self.tensor).numpy()
        proto = tensor_pb2.TensorProto.FromString(encoded)
        count = int(np.prod(self.shape, dtype=np.int64))
        if proto.dtype != tf.variant.as_datatype_enum or proto.variant_val:
            logger.debug("variant tensor not encoded as an element list")
            return None
        try:
            self._elements = split_variant_list(proto.tensor_content, count)
        except ValueError as e:
            logger.debug("variant tensor encoding not recognized: %s", e)
            return None
        return self._elements
