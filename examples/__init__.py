"""Examples of asyncckpt, run from a source checkout's root (``python -m examples.demo``)."""
