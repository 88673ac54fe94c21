"""Pricing and simulating torchpp's schedules.

- :mod:`.types`: what the simulator prices with and returns (``CostModel``, ``Span``,
  ``Timeline``, ``SimOptions``, ``SimResult``).
- :mod:`.engine`: ``simulate(schedule, cost, options)``: the stepping core (:mod:`.core`, per-rank
  cursors and a heap of predicted finishes over a schedule flattened by :mod:`.compiled`) with
  one of two comm models plugged in: :mod:`.links` (contention-free FIFO per directed link)
  or :mod:`.shared` (one prioritised channel per rank: :mod:`.tiers`, interference,
  :mod:`.congestion`).
- :mod:`.replay`: ``replay(schedule, cost) -> Timeline``, the ``links`` model, what the planner
  ranks plans with (its reference, a plain loop, is ``tests/replay_reference.py``).
- :mod:`.parametric`: the seed-002 parameter world (``n``, ``stages``, lengths, impacts,
  ``sync_freq``) as a plan priced by the engine (the ``schedule`` policy).
- :mod:`.seed002`: the seed 002 compatibility policy, fenced off: the original simulator's
  own rules, kept to reproduce its numbers; :mod:`.seed002.reference` checks them against
  its recorded cases.
- :mod:`.sweep`, :mod:`.heatmap`, :mod:`.gantt`, :mod:`.trace`: sweeps into CSV, heatmaps,
  Gantt charts and predicted Chrome traces; :mod:`.cli` is ``torchpp simulate``.

Commands::

    torchpp simulate run --stages 4 -n 8 --congestion --show-throttling --style dual
    torchpp simulate sweep -c configs/sim_experiment.json --output results.csv   # re-run resumes
    torchpp simulate heatmap results.csv -o heatmaps/
    torchpp simulate all -c configs/sim_experiment.json          # outputs/data, outputs/heatmaps
    torchpp simulate plan out/plan.json --bandwidth bandwidth.json --layers layers_*.json
    torchpp simulate check-reference cases.csv                   # seed002 policy vs the original
"""
