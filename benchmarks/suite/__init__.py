"""Latency benchmarks of asyncckpt against TensorFlow and orbax (``asyncckpt bench``)."""
