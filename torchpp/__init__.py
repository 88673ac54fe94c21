"""torchpp: measure, plan, run, analyse and simulate pipeline-parallel training on small, uneven clusters."""
__version__ = "0.1.0"
