"""Exact resumes of ``fit`` on a ``tf.data.Dataset`` (``KERAS_BACKEND=tensorflow``).

Keras's TensorFlow trainer iterates a ``tf.data.Dataset`` through an iterator
that its epoch iterator creates at the start of each epoch. That iterator's
state is checkpointable (``tf.train.Checkpoint(iterator=...)`` saves it the
same way): its position, its prefetch and shuffle buffers, and the state of
the dataset's shuffle seed generator, so restoring it also makes every later
epoch's reshuffle what it would have been. A backup serializes the state of
the iterator at its batch boundary (one ``SerializeIterator`` op, stored as a
byte array beside the weights); a resume restores it into the iterator the
resumed epoch starts with, before its first batch.

Only pipelines TensorFlow can serialize qualify: ``from_generator`` and
``py_function`` stages cannot be (they are reported once, and the resume
then restarts the epoch, as Keras's own callback does); and only with
``steps_per_epoch=None`` and a known number of batches per epoch.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import keras
import numpy as np
from keras.src.trainers.epoch_iterator import EpochIterator

from asyncckpt.keras import _callbacks

logger = logging.getLogger(__name__)

ITERATOR_KEY = "data/tf_iterator"


def find_tf_data_input() -> EpochIterator | None:
    """``fit``'s epoch iterator when it trains on a ``tf.data.Dataset`` with TensorFlow.

    Looked up among the calling frames (``fit``'s local ``epoch_iterator``),
    so call it from a callback hook that ``fit`` runs.
    """
    if keras.backend.backend() != "tensorflow":
        return None
    from keras.src.trainers.data_adapters.tf_dataset_adapter import TFDatasetAdapter

    iterator = _callbacks.find_local("epoch_iterator", EpochIterator)
    if iterator is None or not isinstance(iterator.data_adapter, TFDatasetAdapter):
        return None
    if iterator.steps_per_epoch or not iterator._num_batches:
        # Keras then keeps one iterator across epochs, or lets the data run out:
        # the epoch cannot be shortened to resume mid-way.
        logger.info("tf.data input with steps_per_epoch or unknown cardinality: a mid-epoch "
                    "backup resumes at the start of its epoch")
        return None
    return iterator


def input_spec(adapter: Any) -> Any | None:
    """Shapes and dtypes of a ``tf.data`` input's batches (what building a model needs).

    Taken from the element spec, so no iterator is made (making one would
    draw from the dataset's shuffle seeds).
    """
    if adapter is None or type(adapter).__name__ != "TFDatasetAdapter":
        return None
    import tensorflow as tf

    return tf.nest.map_structure(
        lambda s: SimpleNamespace(shape=tuple(s.shape), dtype=s.dtype.name),
        adapter.get_tf_dataset().element_spec,
    )


def _tf_iterator(epoch_iterator: EpochIterator) -> Any | None:
    it = getattr(epoch_iterator, "_current_iterator", None)
    if it is None or not hasattr(it, "_serialize_to_tensors"):
        return None
    return it


def serialize(epoch_iterator: EpochIterator) -> np.ndarray | None:
    """The state of the epoch's ``tf.data`` iterator as bytes, or None if it has none."""
    import tensorflow as tf

    it = _tf_iterator(epoch_iterator)
    if it is None:
        return None
    try:
        state = it._serialize_to_tensors()["_STATE"]
        data = tf.io.serialize_tensor(state).numpy()
    except (tf.errors.OpError, KeyError, TypeError, ValueError) as e:
        if not getattr(epoch_iterator, "_asyncckpt_warned", False):
            epoch_iterator._asyncckpt_warned = True
            logger.warning("the tf.data pipeline's iterator cannot be checkpointed (%s); a "
                           "mid-epoch resume restarts the epoch", e)
        return None
    return np.frombuffer(data, dtype=np.uint8)


def restore(epoch_iterator: EpochIterator, saved: np.ndarray) -> None:
    """Restores ``saved`` into the iterator the epoch has just started with."""
    import tensorflow as tf

    it = _tf_iterator(epoch_iterator)
    if it is None:
        raise RuntimeError("fit() has no tf.data iterator to restore the backup's position into")
    state = tf.io.parse_tensor(np.ascontiguousarray(saved).tobytes(), tf.variant)
    it._restore_from_tensors({"_STATE": state})
