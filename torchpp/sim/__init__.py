"""Pricing and simulating torchpp's schedules.

- :mod:`.replay`: contention-free pricing (``replay(schedule, cost) -> Timeline``), what the
  planner ranks plans with; it runs on the event engine's ``links`` model.
- :mod:`.engine`: the event-driven engine over ``schedules.build`` action lists: exclusive
  compute channel and shared, prioritised comm channel per rank, interference of gradient
  syncs on compute, receiver congestion.
- :mod:`.parametric`: the seed-002 parameter world (``n``, ``stages``, lengths, impacts,
  ``sync_freq``) as a plan priced by the engine (the ``schedule`` policy).
- :mod:`.seed002`: the original simulator's own rules (the ``seed002`` policy), kept to
  reproduce its numbers; :mod:`.reference` checks them against its recorded cases.
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
