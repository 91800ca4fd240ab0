"""dsv4: serve DeepSeek V4 from one machine."""

__version__ = "0.1.0"
