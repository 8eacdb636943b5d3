"""Names on disk, in one place: what is a checkpoint, where its manifest lives.

Framework-neutral, so tools (the CLI, verification) can list and check
checkpoints of either framework without importing it.
"""

from __future__ import annotations

import os
import re

# TensorFlow: a checkpoint is a prefix; `<prefix>.index` is its commit marker.
TF_INDEX_SUFFIX = ".index"
TF_MANIFEST_SUFFIX = ".asyncckpt-manifest.json"
TF_STATE_FILE = "checkpoint"

# JAX/orbax: a checkpoint is a directory named by its step.
JAX_MANIFEST_NAME = "asyncckpt.manifest.json"

_TRAILING_NUMBER = re.compile(r"-(\d+)$")


def tf_manifest_path(prefix: str) -> str:
    """Manifest of the TensorFlow checkpoint at ``prefix``."""
    return prefix + TF_MANIFEST_SUFFIX


def jax_manifest_path(step_dir: str) -> str:
    """Manifest of the JAX checkpoint in ``step_dir``."""
    return os.path.join(step_dir, JAX_MANIFEST_NAME)


def tf_step_of(prefix: str) -> int | None:
    """The number at the end of a TensorFlow prefix (``ckpt-12`` -> 12)."""
    m = _TRAILING_NUMBER.search(os.path.basename(prefix))
    return int(m.group(1)) if m else None
