"""`torchpp throttle cpu|mem|net ... [-- COMMAND]`, `status`, `clear`."""
from .cli import configure_throttle as configure  # noqa: F401
