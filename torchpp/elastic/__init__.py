"""Elastic training: watch the ranks of a plan, and when a host fails re-plan over the survivors
and resume from the newest complete checkpoint (`torchpp run --elastic`).

It sits above the runtime, the emulated cluster and the planner, and drives all three; the
trainer's side of it (heartbeats, the decision log in traces and TensorBoard) is
:mod:`torchpp.runtime.elastic_hooks`.
"""
