"""The search over schedule kinds: one-chunk kinds by the stage DP, multi-chunk kinds by
:mod:`torchpp.planner.chunks`, every candidate priced by replaying its own schedule.

The stage DP runs once, for the first one-chunk kind asked for (1F1B under ``auto``); its best
priced layouts of each micro-batch size are priced again under the other one-chunk kinds (ZB-H1, GPipe) and refined by
the local search under each, and their device groups seed the chunked search. On small instances
(at most :data:`SMALL_DEVICES` devices) every one-chunk kind gets its own DP, every sequence
of device groups seeds the chunked search, and where a kind has few ways to cut the layers into
its chunks (:data:`TINY_CUTS`) every cut is priced — the chunk DP balances chunks, not the sum
over a device's chunks, and the local search can stop in a local optimum — which is what makes
the planner equal exhaustive search there.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

from ..formats import MULTI_CHUNK, ONE_CHUNK, Plan
from ..schedules import REGISTRY
from .build import build_plan
from .exact import one_chunk
from .exactchunks import chunked
from .pricing import keep_priced, price_plan
from .prune import layout_bound
from .chunks import ChunkLayout, beaten, descend, fits_weights, layout_bound_of, every_cut, group_sequences, layouts, price_layout
from .refine import refine
from .reorder import layout_of
from .single import search_single
from .tables import StageCosts, Tables, infeasible_message
from .types import InfeasibleError, Problem, SearchResult, best_per, layout_choices, micro_batch_sizes

SMALL_DEVICES = 3
"""Up to this many devices the kinds are searched exhaustively over device groups (see above)."""
SEEDS = 6
"""Distinct one-chunk layouts whose device groups seed the other kinds."""
TINY_CUTS = 64
"""On small instances, a kind and chunk count with at most this many ways to cut the layers has every cut priced."""
EVERY_SIZE_DEVICES = 8
"""Up to this many devices each seed's groups are tried at every micro-batch size (past it, at the
seed's: 64 x 96 took 6.3 -> 8.7 s with every size)."""
UNPICKED_DEVICES = 4
"""Up to this many devices the chunked kinds also start from the DP's unpriced candidates
(``SearchResult.unpicked``), in a pass of their own. Its cost grows with the candidates: 5 hosts x
41 layers went 0.54 -> 0.93 s of CPU, 8 x 28 0.72 -> 0.98 s, for one better plan of 96 between them;
past 5 devices the order search varies the seeds."""
AROUND_SEEDS = 2
"""One-chunk plans of the device-order search (planner/reorder.py) the other kinds also start from."""
REPRICED = 3
"""Beyond small instances, one-chunk layouts of the DP's kind priced again under each other one-chunk
kind: this many of the best at each micro-batch size. The kinds rank sizes differently (1F1B's
fill favours small micro-batches, ZB-H1 fills it with W), so the DP kind's overall best few can
all share one size: on the homelab's costs its best three were all 16 × 2, and ZB-H1 at 8 × 4,
priced 10% faster than the plan chosen, was never priced."""
STARTS = 4
"""Priced chunked layouts the local search starts from."""
PRICED = 6
"""Beyond small instances, chunked layouts priced (best estimates) besides each kind's best estimate."""
DESCENT = 32
"""Beyond small instances and up to 16 devices, layouts each local search of the chunked kinds prices
(first improvements, ``chunks.descend``); most are rejected on their replay alone, before their memory
is worked out, at about a fifth of a full pricing."""
V_HEADS = 2
"""Beyond small instances and up to :data:`EVERY_SIZE_DEVICES` devices, devices a V is also seeded
with at its head (those fastest at the embedding and the lm_head), the others after it by speed
(:data:`V_DEPTHS` prefixes of them), where no seed put it at a V's head as deep already: a V keeps
both ends on its first position, and the one-chunk plans' groups, whose ends sit apart (their tied
weight all-reduced between them), can miss its best head. Their chunk DP checks the head's chunks
against the whole device and the others' against half (the usual half of the head rejects it where
the lm_head's weight is large: one tied tensor for both of its chunks); the weights are checked
again before pricing. They are priced and searched after the others, with a budget of their own:
the others' search runs as it did without them."""
V_DEPTHS = 3
"""Those seeds hold this many depths each: the deepest a V can be (every device, or half the layers),
and one and two fewer (the slowest left out); and the shortest, two and three positions."""
V_PRICED = 3
"""Of those seeds' layouts, this many (best estimates) priced."""
EXACT_DEVICES = 5
"""Up to this many devices every kind is also enumerated (:mod:`.exact`, :mod:`.exactchunks`) below the
best step found, within :data:`EXACT_WORK` and :data:`EXACT_CHUNK_WORK`: the stage DP ranks splits by
an estimate (on the homelab's measured costs its candidates missed a ZB-H1 split 4.3% faster), and
the chunked kinds start from seeds (none headed a V by a group of devices)."""
EXACT_WORK = 10_000
"""The one-chunk enumeration's budget: partial layouts visited, a priced layout counted as
:data:`.exact.PRICE_WORK` of them (about 0.3 s of CPU at most; the homelab's 4 hosts x 16 layers
complete in about 8,000)."""
EXACT_CHUNK_WORK = 5_000
"""The same for the chunked kinds (:mod:`.exactchunks`), after the one-chunk kinds: a V headed by a
group of devices, which no seed starts from, is found this way on small clusters."""
V_CLOSE = 1.25
"""The local search starts from the best of them where it is within this factor of the best step."""


def search_kinds(pb: Problem, kinds: Sequence[str], progress=None) -> SearchResult:
    """The best priced plan over ``kinds`` (see the module docstring)."""
    t0 = time.perf_counter()
    one = [k for k in kinds if k in ONE_CHUNK]
    multi = [k for k in kinds if k in MULTI_CHUNK]
    small = len(pb.hosts) <= SMALL_DEVICES
    first = next((k for k in one if REGISTRY[k].spec.every_m), "1f1b")  # the DP tries every m
    base = search_single(replace(pb, schedule=first), progress, also=[] if small else [k for k in one if k != first])
    t = base.tables
    priced: list[tuple[float, Plan]] = list(base.priced) if first in one else []
    # the other kinds start from the DP's plans as they would without the device-order search, and
    # from the best few that search found besides (it finds 1F1B plans a move apart, which would
    # otherwise crowd out the layouts another kind does best on)
    near = {id(p) for _, p in base.around}
    own = [x for x in base.priced if id(x[1]) not in near]
    extra = sorted(base.around, key=lambda x: x[0])[:AROUND_SEEDS]
    for k in [k for k in one if k != first]:
        pbk = replace(pb, schedule=k)
        priced += _search_one(pbk, t, own, small)
        if extra:
            priced += _reprice(pbk, t, extra)
    if multi:
        found = _search_chunks(pb, t, own, multi, small, base.skipped)
        if extra:
            found += _search_chunks(pb, t, extra, multi, small)
        if base.unpicked and not small and len(pb.hosts) <= UNPICKED_DEVICES:
            # more device groups, searched apart so the pass above is what it was without them
            found += _search_chunks(pb, t, [], multi, small, base.unpicked)
        if progress and found:
            progress(f"  chunked kinds: {len(found)} plan(s) priced, best step {min(s for s, _ in found):.4g} s")
        priced += found
    mode = f"{base.mode}; kinds {', '.join(kinds)}"
    if len(pb.hosts) <= EXACT_DEVICES:
        for name, ks, enumerate_, budget in (("one-chunk", one, one_chunk, EXACT_WORK),
                                             ("chunked", multi, chunked, EXACT_CHUNK_WORK)):
            if ks and pb.ledger.step_time_s < float("inf"):
                got = enumerate_(pb, t, ks, pb.ledger.step_time_s, max_work=budget)
                if got.plan is not None:
                    keep_priced(pb, got.plan, got.step_s)
                    priced.append((got.step_s, got.plan))
                mode += f"; {name} kinds {'exact' if got.complete else 'enumerated in part'} ({got.priced} priced" \
                        f"{', a faster plan found' if got.plan is not None else ''})"
    if not priced:
        if multi and not one and base.priced:  # the one-chunk DP found plans: only the chunked kinds do not fit
            best = min(base.priced, key=lambda x: x[0])
            v = [k for k in multi if REGISTRY[k].placement == "v"]
            why = (f"; a V placement ({'/'.join(v)}) holds both the embedding and the lm_head on one device"
                   if v else "")
            raise InfeasibleError(
                f"no plan of {', '.join(multi)} fits in memory or runs ({pb.memory.source}): each device holds "
                f"several chunks{why}; one chunk per device fits ({best[1].schedule}, {len(best[1].stages)} "
                f"stage(s), {best[1].num_microbatches} x {best[1].micro_batch_size}, {best[0]:.4g} s): "
                f"try --schedule auto")
        raise InfeasibleError(infeasible_message(pb, t))
    priced.sort(key=lambda x: x[0])
    best: dict[str, float] = {}
    for s, p in priced:
        best.setdefault(p.schedule, s)
    step, plan = priced[0]
    return SearchResult(plan=plan, step_time_s=step, candidates_priced=len(priced), dp_candidates=base.dp_candidates,
                        planning_time_s=time.perf_counter() - t0, priced=priced,
                        mode=mode, refined=base.refined, tables=t, kinds=best)


def _search_one(pb: Problem, t: Tables, plans: Sequence[tuple[float, Plan]], small: bool
                ) -> list[tuple[float, Plan]]:
    """Plans of the one-chunk kind ``pb.schedule``: its own DP on small instances, else (or where its
    order does not run every micro-batch count the DP tries) the given layouts re-priced."""
    if small:
        try:
            return search_single(pb).priced
        except ValueError:
            pass
    return _reprice(pb, t, best_per_size(plans, REPRICED))


def best_per_size(plans: Sequence[tuple[float, Plan]], n: int) -> list[tuple[float, Plan]]:
    """The ``n`` best priced plans of each micro-batch size, best first."""
    return best_per(plans, n, lambda p: p.micro_batch_size)


def _reprice(pb: Problem, t: Tables, plans: Sequence[tuple[float, Plan]]) -> list[tuple[float, Plan]]:
    """The given one-chunk layouts priced under ``pb.schedule``, then refined by the local search."""
    out, seeds = [], []
    for _, p in plans:
        layout = layout_of(pb, p)
        order, stages = layout_choices(layout)
        if layout_bound(t, layout, p.micro_batch_size, p.num_microbatches,
                        REGISTRY[pb.schedule].split_backward) >= pb.ledger.step_time_s:
            continue  # cannot beat the best priced plan (planner/prune.py)
        try:
            plan = build_plan(pb, t, order, stages, p.micro_batch_size, "optimal")
            if plan is None:
                continue
            s = price_plan(pb, plan)
        except ValueError:  # the kind's order does not run this micro-batch count on this many stages
            continue
        out.append((s, plan))
        seeds.append((s, p.micro_batch_size, layout))
    return out + refine(pb, t, seeds, 4 if len(pb.hosts) <= 16 else 0)


def _seed_groups(pb: Problem, plans: Sequence[tuple[float, Plan]], small: bool,
                 skipped: Sequence[tuple[int, tuple]] = ()) -> list[tuple[int, tuple]]:
    """(micro-batch size, device groups in pipeline order) to try the chunked kinds on: the best
    priced plans' groups, and those of the DP's candidates the one-chunk bound skipped (they seed as
    they would have had the bound not skipped them), each at every micro-batch size (up to
    :data:`EVERY_SIZE_DEVICES`)."""
    idx = {h: i for i, h in enumerate(pb.hosts)}
    out: dict[tuple, None] = {}
    for _, p in sorted(plans, key=lambda x: x[0]):
        if len(out) >= SEEDS:
            break
        out[(p.micro_batch_size, tuple(tuple(idx[d.host] for d in st.devices) for st in p.stages))] = None
    for x in skipped:
        out[x] = None
    sizes = micro_batch_sizes(pb) if len(pb.hosts) <= EVERY_SIZE_DEVICES else []
    for _, groups in list(out):  # a kind's best size is its own: ZBV fills with W what 1F1B fills with fewer, larger calls
        for b in sizes:
            if max(len(g) for g in groups) <= b:
                out[(b, groups)] = None
    if small:
        for b in micro_batch_sizes(pb):
            for groups in group_sequences(len(pb.hosts), b):
                out[(b, groups)] = None
    return list(out)


def _v_seeds(pb: Problem, t: Tables) -> list[tuple[tuple[int, ...], ...]]:
    """Device sequences a V starts from besides the one-chunk plans' (:data:`V_HEADS`)."""
    p, N = pb.profiles, len(pb.hosts)
    last = p.num_blocks - 1

    def ends(h: int) -> float:
        f, b = p.table(pb.hosts[h])
        return float(f[0] + b[0] + f[last] + b[last])

    out = []
    for head in sorted(range(N), key=lambda h: (ends(h), h))[:V_HEADS]:
        rest = sorted((h for h in range(N) if h != head), key=lambda h: (t.full_time[h], h))
        deepest = min(N, t.L // 2)  # a V at depth d has 2d chunks of a layer at least
        depths = sorted({*range(max(2, deepest - V_DEPTHS + 1), deepest + 1), *range(2, min(4, deepest + 1))})
        out += [((head,), *((h,) for h in rest[:d - 1])) for d in depths]
    return out


def _search_chunks(pb: Problem, t: Tables, plans: Sequence[tuple[float, Plan]], kinds: Sequence[str],
                   small: bool, skipped: Sequence[tuple[int, tuple]] = ()) -> list[tuple[float, Plan]]:
    """Every chunked kind's DP layout on each seed's groups; on small instances all of them priced,
    else the best :data:`PRICED` by estimate and the best of each kind; then the local search."""
    tables: dict[int, Tables] = {}
    costs: dict[tuple[int, int], StageCosts] = {}

    def costs_of(b: int, v: int) -> StageCosts:
        if v not in tables:  # each of a device's v chunks checked against 1/v of its memory
            tables[v] = Tables(replace(pb, budget={h: x / v for h, x in pb.budget.items()}))
        if (b, v) not in costs:
            costs[(b, v)] = StageCosts(tables[v], b, pb.global_batch // b, pb.allow_recompute)
        return costs[(b, v)]

    cands: dict[tuple, tuple[float, ChunkLayout]] = {}
    vee = [k for k in kinds if REGISTRY[k].placement == "v"]
    for b, groups in _seed_groups(pb, plans, small, skipped):
        found_here = layouts(lambda v: costs_of(b, v), kinds, groups, t.L)
        if vee and not small and len(groups) > 1:
            # a V's first position holds the lm_head, the part a one-chunk plan gives its last stage
            found_here += layouts(lambda v: costs_of(b, v), vee, groups[::-1], t.L)
        if small:
            found_here += [(0.0, x) for x in every_cut(kinds, b, groups, t.L, TINY_CUTS)]
        for est, lay in found_here:
            cands.setdefault(lay.key, (est, lay))
    heads = _v_head_layouts(pb, t, vee, cands) if vee and not small and len(pb.hosts) <= EVERY_SIZE_DEVICES else {}
    ranked = sorted(cands.values(), key=lambda x: x[0])
    if small:  # ranked by the quick bound, so the first plans priced prune the most (planner/prune.py)
        ranked = [x for x in ranked if fits_weights(pb, t, x[1])]
        quick = {lay.key: layout_bound_of(t, lay, pb.global_batch // lay.b, quick=True) for _, lay in ranked}
        ranked = sorted(ranked, key=lambda x: quick[x[1].key])
    if not small:
        top = {x[1].key: x for x in ranked[:PRICED]}
        for kind in kinds:
            first = next((x for x in ranked if x[1].kind == kind), None)
            if first is not None:
                top.setdefault(first[1].key, first)
        ranked = list(top.values())
    seen: dict[tuple, float] = {}
    budget = 1000 if small else DESCENT if len(pb.hosts) <= 16 else 4
    found, starts = _price_ranked(pb, t, ranked, seen, quick if small else None)
    found += descend(pb, t, starts if small else starts[:STARTS], kinds, budget, seen, first=not small)
    if heads:  # after the others' search, with a budget of its own: the same plans as without it, or better
        got, starts = _price_ranked(pb, t, sorted(heads.values(), key=lambda x: x[0])[:V_PRICED], seen, None)
        found += got
        if starts and starts[0][0] < V_CLOSE * pb.ledger.step_time_s:  # a start that may end ahead
            found += descend(pb, t, starts[:1], kinds, budget, seen, first=True)
    return found


def _v_head_layouts(pb: Problem, t: Tables, vee: Sequence[str], cands: dict[tuple, tuple[float, ChunkLayout]]
                    ) -> dict[tuple, tuple[float, ChunkLayout]]:
    """The V kinds' layouts of :func:`_v_seeds` at every micro-batch size, those ``cands`` lacks
    whose weights fit, with their estimates (:data:`V_HEADS`)."""
    out: dict[tuple, tuple[float, ChunkLayout]] = {}
    tables: dict[int, Tables] = {}
    costs: dict[tuple[int, int], StageCosts] = {}
    tried = {(lay.groups[0], len(lay.groups)) for _, lay in cands.values() if lay.kind in vee}
    for groups in _v_seeds(pb, t):
        head = groups[0][0]
        if (groups[0], len(groups)) in tried:
            continue  # the one-chunk plans' groups already head a V as deep with it
        if head not in tables:  # the head's whole device for its chunks, half of the others'
            tables[head] = Tables(replace(pb, budget={h: x if h == pb.hosts[head] else x / 2
                                                      for h, x in pb.budget.items()}))
        for b in micro_batch_sizes(pb):
            if (head, b) not in costs:
                costs[(head, b)] = StageCosts(tables[head], b, pb.global_batch // b, pb.allow_recompute)
            sc = costs[(head, b)]
            for est, lay in layouts(lambda v: sc, vee, groups, t.L):
                if lay.key not in cands and fits_weights(pb, t, lay):
                    out.setdefault(lay.key, (est, lay))
    return out


def _price_ranked(pb: Problem, t: Tables, ranked: Sequence[tuple[float, ChunkLayout]], seen: dict,
                  quick: dict | None) -> tuple[list[tuple[float, Plan]], list[tuple[float, ChunkLayout]]]:
    """The layouts priced in turn, but those that cannot beat the best priced step (``quick``: the
    small path's ranking bound, after which none can); their plans, and the layouts by step."""
    starts: list[tuple[float, ChunkLayout]] = []
    found: list[tuple[float, Plan]] = []
    for _, lay in ranked:
        if quick is not None and quick[lay.key] >= pb.ledger.step_time_s:
            break  # nor can any after it (ranked by this bound; the best step only falls)
        if beaten(t, lay, pb.global_batch // lay.b, pb.ledger.step_time_s):
            continue  # cannot beat the best priced plan (planner/prune.py)
        got = price_layout(pb, t, lay)
        seen[lay.key] = got[0] if got else float("inf")
        if got:
            starts.append((got[0], lay))
            found.append(got)
    starts.sort(key=lambda x: x[0])
    return found, starts
