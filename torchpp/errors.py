"""Errors every part of torchpp may raise; a leaf module, so library code never imports a CLI."""
from __future__ import annotations


class UsageError(ValueError):
    """Bad user input: printed as one line naming the argument, exit code 2."""
