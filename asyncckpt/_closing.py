"""``ClosingContext``: ``with obj:`` calls ``obj.close()``, never masking an error.

Engines, managers and the preemption handler are context managers with the
same exit: close, and if the ``with`` body raised, log (do not raise) an
error from ``close()``, so the caller sees the exception that stopped the
body rather than a background one it caused. Imports nothing from
asyncckpt, so the engine can use it without importing any framework.
"""

from __future__ import annotations

import logging
from typing import Self


class ClosingContext:
    """Mixin: ``__enter__`` returns self, ``__exit__`` calls ``self.close()``."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception:
            logging.getLogger(type(self).__module__).exception(
                "error while closing %s after another error", type(self).__name__
            )
