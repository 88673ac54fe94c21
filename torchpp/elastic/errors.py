"""The elastic driver's error, below both the driver and re-planning (which raise it)."""
from __future__ import annotations


class ElasticError(RuntimeError):
    """The run cannot go on: the survivors cannot hold the model, no host is left, too many restarts."""
