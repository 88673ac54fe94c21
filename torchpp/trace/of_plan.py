"""Is a timeline a run of this plan? The checks ``analyze --plan`` and ``replan`` make before
reading numbers off it: a wrong pid or a micro-batch the plan never had would otherwise be
analysed as a rank or a micro-batch of their own (confident, wrong figures)."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping, Sequence

from ..formats import FormatError, Plan
from .analyze import Event


def check_trace_of_plan(path: str, trace: dict[str, Any], events: list[Event], plan: Plan, plan_src: str) -> None:
    """The timeline must come from this plan: same ranks, chunks, layer ranges and micro-batches.

    ``trace`` has passed :func:`torchpp.formats.check_trace` (its numbers are typed and bounded)."""
    md = trace.get("metadata") or {}
    ws = md.get("world_size")
    if ws is not None and ws != plan.world_size:
        raise FormatError(path, "metadata.world_size", f"{plan.world_size} (the ranks of {plan_src})", ws)
    ranks = set(plan.ranks)
    chunks = {r: [s.index for s in plan.stages_of_rank(r)] for r in ranks}
    for r, info in (md.get("ranks") or {}).items():
        if int(r) not in ranks:
            raise FormatError(path, f"metadata.ranks.{r}", f"a rank of {plan_src} (0..{plan.world_size - 1})")
        want = chunks[int(r)]
        if isinstance(info, Mapping) and info.get("stage") is not None and info["stage"] != want[0]:
            raise FormatError(path, f"metadata.ranks.{r}.stage", f"{want[0]} (rank {r}'s {_which(want)} in {plan_src})",
                              info["stage"])
        if isinstance(info, Mapping) and info.get("stages") is not None and list(info["stages"]) != want:
            raise FormatError(path, f"metadata.ranks.{r}.stages", f"{want} (rank {r}'s chunks in {plan_src})",
                              info["stages"])
    for i, ev in enumerate(trace["traceEvents"]):
        args = ev.get("args") or {}
        if ev.get("ph") != "X" or "stage" not in args or ev.get("cat") == "block":
            continue
        r = ev["pid"]
        if r not in ranks:
            raise FormatError(path, f"traceEvents[{i}].pid", f"a rank of {plan_src} (0..{plan.world_size - 1})", r)
        if "layers" not in args:  # a transfer or all-reduce: its stage names the message, not always a chunk of r
            continue
        if args["stage"] not in chunks[r]:
            want = chunks[r][0] if len(chunks[r]) == 1 else f"one of {chunks[r]}"
            raise FormatError(path, f"traceEvents[{i}].args.stage",
                              f"{want} (rank {r}'s {_which(chunks[r])} in {plan_src})", args["stage"])
        if list(args["layers"]) != list(plan.stages[args["stage"]].layers):
            st = plan.stages[args["stage"]]
            raise FormatError(path, f"traceEvents[{i}].args.layers",
                              f"{list(st.layers)} (stage {st.index}'s layers in {plan_src})", args["layers"])
    check_microbatches(path, events, chunks, plan.num_microbatches, f"{plan_src}: num_microbatches")


def _which(chunks: Sequence[int]) -> str:
    return "stage" if len(chunks) == 1 else f"first chunk (of {list(chunks)})"


def check_microbatches(path: str, events: list[Event], chunks: Mapping[int, Sequence[int]] | None = None,
                       n: int | None = None, why: str = "") -> None:
    """Every chunk of every rank forwarded micro-batches ``0..n-1``.

    Without a plan (``chunks``/``n`` None) the ranks and chunks are the trace's own and ``n`` the
    most micro-batches one of them forwarded: each must have forwarded the same ``0..n-1``.
    """
    seen: dict[tuple[int, int], set] = defaultdict(set)
    for e in events:
        if e.kind == "F":
            seen[(e.rank, e.stage)].add(e.microbatch)
    if chunks is None:
        chunks = defaultdict(list)
        for r, c in sorted(seen):
            chunks[r].append(c)
        n = max((len(v) for v in seen.values()), default=0)
        why = "as many as the rank that forwarded most"
    want_mb = set(range(n))
    for r in sorted(chunks):
        for c in chunks[r]:
            if seen.get((r, c), set()) != want_mb:
                where = f"rank {r}" if len(chunks[r]) == 1 else f"rank {r}, stage {c}"
                raise FormatError(path, f"traceEvents (F<mb> of {where})", f"micro-batches 0..{n - 1} ({why})",
                                  sorted(seen.get((r, c), set()), key=lambda m: (m is None, m or 0)))


def check_trace_alone(path: str, trace: dict[str, Any], events: list[Event]) -> None:
    """Without a plan, a timeline must still be whole: every rank of ``metadata.world_size`` ran
    pipeline events, and every chunk forwarded the same micro-batches ``0..n-1``."""
    world = (trace.get("metadata") or {}).get("world_size")
    if world is not None:
        ran = {e.rank for e in events}
        if ran != set(range(world)):
            raise FormatError(path, "metadata.world_size", f"the ranks with events ({len(ran)}: "
                              f"{', '.join(map(str, sorted(ran)[:8]))}{'…' if len(ran) > 8 else ''})", world)
    check_microbatches(path, events)
