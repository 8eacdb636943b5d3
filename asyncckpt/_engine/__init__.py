"""The framework-neutral engine: snapshot, write, commit, retention (private).

Imports neither TensorFlow nor JAX. Framework adapters (``asyncckpt.tf``,
``asyncckpt.jax``, ...) stage their state into ``slots.Slot`` buffers and hand
the engine a ``_jobs.SaveJob`` that writes those buffers in their framework's
file format. Nothing here is public API: the names users need (``SaveHandle``,
``SaveStats``, the errors) are listed in ``asyncckpt``; the rest is imported
from the module that defines it. This package exports nothing.
"""
