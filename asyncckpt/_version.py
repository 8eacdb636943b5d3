"""Version of the asyncckpt package."""

__version__ = "0.2.0"
