"""Re-planning: correct the cost model from a run's timelines, then plan again.

    torchpp replan --plan out/plan.json --traces TRACE_DIR [--layers layers_*.json …] \\
        [--capacities …] [--bandwidth …] [--memory-model …] [--devices …] --out-dir out2/

The run's merged timelines (``timeline_step<N>_all.json``, read with
:mod:`torchpp.trace.analyze`) say how long each rank's forward and backward of every
micro-batch took (every chunk a rank holds, and the I/W halves of a zero-bubble schedule's
backward). The plan's cost model (:class:`~torchpp.cost.MeasuredCost`) says
how long they should have taken. Per host, scale factors are fitted by non-negative least
squares (``scipy.optimize.nnls``): one forward and one backward factor per group of blocks
the data can tell apart (a host that ran two different layer ranges gets one factor per
range piece; blocks it did not run get its overall factor). The factors multiply that host's
own table (its layers file, or the scaled reference it was priced with), so the corrected
table is the host's own from then on. Links get the throughput measured from matched
send/receive pairs: a message's transfer time runs from when both ends had posted it to when
it arrived, so waiting for the sender is not counted (a message whose slice start was set by
the previous message on its row is left out). The runtime's own time between two compute
calls beyond waiting for data (dispatch, posting messages) is measured per host (each step's
mean, the median over steps, as the step time is the median step) and priced on every forward
and backward (``LayersFile.call_overhead_s``). The optimizer's seconds per
parameter byte and, from the ranks' peak RSS, the memory model are refitted too. The corrected
layers, bandwidth, capacities and memory files are written to the output folder, the same
search as ``torchpp plan`` runs on them (``--schedule``, default auto: every schedule kind), and
``replan_summary.txt/json`` say what changed:
per host the old and new speed, the links that changed, the old plan's measured step time
against its prediction, the old plan re-priced with the corrected costs, the new plan's
predicted step time and the predicted gain.

The package is split along the command's seams: :mod:`.read` (the old inputs and the traced
run), :mod:`.fit` (hosts, call overhead, links, optimizer, memory), :mod:`.write` (the corrected
layers files), :mod:`.summary` (``replan_summary.json``/``.txt``) and :mod:`.cli` (the verb).
"""
from .fit import (CostFit, HostFit, LinkFit, MemoryFit, corrected_bandwidth, corrected_table, fit_host, fit_hosts,
                  fit_links, fit_memory, fit_optimizer, memory_terms, optimizer_rates, refit_memory)
from .read import (Compute, Measurements, OldCosts, Transfer, call_gaps, find_merged, read_old_costs, read_run)
from .summary import LINK_CHANGE, add_new_plan, build_summary, summary_text
from .write import Written, corrected_layers_file, template_from_model, write_corrected

__all__ = ["LINK_CHANGE", "Compute", "CostFit", "HostFit", "LinkFit", "Measurements", "MemoryFit", "OldCosts",
           "Transfer", "Written", "add_new_plan", "build_summary", "call_gaps", "corrected_bandwidth",
           "corrected_layers_file", "corrected_table", "find_merged", "fit_host", "fit_hosts", "fit_links",
           "fit_memory", "fit_optimizer", "memory_terms", "optimizer_rates", "read_old_costs", "read_run",
           "refit_memory", "summary_text", "template_from_model", "write_corrected"]
