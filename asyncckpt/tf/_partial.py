"""Partial restore: what a restore matched, and what it skipped, by name.

TensorFlow restores whatever part of a checkpoint matches the Python objects
it is given, and ``expect_partial()`` silences the warnings about the rest;
it does not say what the rest was. ``PartialRestore`` lists it: objects and
tensor keys of the checkpoint that nothing matched (not restored), and
Python objects that found no value (left as they were).
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncckpt.tf import _compat


@dataclass(frozen=True)
class PartialRestore:
    """Outcome of ``Checkpoint.restore_partial``.

    A snapshot taken when the restore returned: TensorFlow still matches
    values to objects created later (deferred restoration), which ``status``
    keeps doing.

    Attributes:
        status: TensorFlow's load status (``expect_partial()`` already called).
        restored: Paths (``model/dense/kernel``) of checkpoint objects whose
            values were restored.
        skipped_objects: Paths of checkpoint objects holding values that
            nothing in the restored object graph matched.
        skipped_keys: The checkpoint keys that were not restored (those of
            ``skipped_objects`` and unused attributes of matched objects).
        unmatched: Paths of Python objects with values of their own that got
            nothing from the checkpoint.
    """

    status: object
    restored: tuple[str, ...]
    skipped_objects: tuple[str, ...]
    skipped_keys: tuple[str, ...]
    unmatched: tuple[str, ...]

    @property
    def complete(self) -> bool:
        """Whether every value was restored and every object got one."""
        return not (self.skipped_keys or self.unmatched)


def _object_path(node) -> str:
    # An object's path is the start of its values' checkpoint keys
    # ("model/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE"), slot variables included.
    return node.attributes[0].checkpoint_key.partition("/.ATTRIBUTES/")[0]


def report(status, checkpoint) -> PartialRestore:
    """Builds the report of a restore into ``checkpoint`` that returned ``status``.

    Raises:
        TypeError: ``status`` is not an object-based load status (a TF1
            name-based checkpoint, or a restore of nothing).
    """
    coordinator = _compat.restore_coordinator(status)
    if coordinator is None:
        raise TypeError(
            "restore_partial needs an object-based TensorFlow checkpoint (one written by "
            f"tf.train.Checkpoint or asyncckpt.tf); the restore returned {type(status).__name__}"
        )
    status.expect_partial()
    proto = coordinator.object_graph_proto
    matched = coordinator.object_by_proto_id
    restored, skipped, keys = [], [], []
    for node_id, node in enumerate(proto.nodes):
        if not node.attributes:
            continue
        name = _object_path(node)
        if node_id in matched:
            restored.append(name)
        else:
            skipped.append(name)
            keys.extend(a.checkpoint_key for a in node.attributes)
    for node_id, attributes in coordinator.unused_attributes.items():
        for a in proto.nodes[node_id].attributes:
            if a.name in attributes:
                keys.append(a.checkpoint_key)
    objects, paths = _compat.traverse(checkpoint)
    bound = {id(o) for o in matched.values()}
    unmatched = [
        "/".join(ref.name for ref in paths[o]) or "(root)"
        for o in _compat.objects_with_values(objects)
        if id(o) not in bound
    ]
    return PartialRestore(
        status=status,
        restored=tuple(restored),
        skipped_objects=tuple(skipped),
        skipped_keys=tuple(keys),
        unmatched=tuple(unmatched),
    )
