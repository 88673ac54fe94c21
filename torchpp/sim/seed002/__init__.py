"""Seed 002 compatibility: the original 1F1B simulator's rules and numbers, step for step.

This policy (``--policy seed002``) exists to reproduce the completion times of the
simulator that seed 002 describes, and nothing else: its task graph (:mod:`.tasks`), its
greedy forward-first compute rule, its sync placement, its channel tiers and
fixed-repetition congestion algorithm (:mod:`.channels`) and its time stepping (every step
at least 1e-9, so a zero-length task costs 1e-9; :mod:`.loop`). The one behaviour it does
not copy is the livelock: where the original would crawl forever it raises
:class:`LivelockError` naming the task. :mod:`.reference` checks it against the original's
recorded cases. torchpp's own pricing (the default ``schedule`` policy) is
:mod:`torchpp.sim.engine`, on torchpp's action lists; nothing outside this package depends
on these rules.
"""
from .channels import EPS
from .loop import CRAWL_LIMIT, LivelockError, Seed002Result, simulate_seed002

__all__ = ["CRAWL_LIMIT", "EPS", "LivelockError", "Seed002Result", "simulate_seed002"]
