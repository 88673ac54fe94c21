"""`torchpp cluster up|run|down|status`."""
from .cli import configure_cluster as configure  # noqa: F401
