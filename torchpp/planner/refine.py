"""Local search on the priced step time of one-chunk plans: move a cut by one layer, shift a stage,
swap two stages' groups, merge or split stages, move a device between groups or in/out of idle."""
from __future__ import annotations

from typing import Sequence

from ..formats import Plan
from .build import build_plan
from .pricing import price_plan
from .prune import layout_bound
from ..schedules import REGISTRY
from .tables import Tables
from .types import INF, Layout, Problem, layout_choices, max_stages_of

def _neighbours(layout: Layout, n_hosts: int) -> list[Layout]:
    """Plans one move away: a cut ±1, a stage shifted ±1, two groups swapped, two stages merged, a
    stage split (onto an idle device or part of its group), one device moved or left idle."""
    S = len(layout)
    cuts = [c for c, _ in layout]
    groups = [g for _, g in layout]
    out: list[Layout] = []

    def with_bounds(bounds: list[int]) -> Layout | None:
        if any(bounds[i] >= bounds[i + 1] for i in range(S)):
            return None
        return [((bounds[i], bounds[i + 1]), groups[i]) for i in range(S)]

    bounds = [cuts[0][0]] + [c2 for _, c2 in cuts]
    for k in range(1, S):
        for d in (-1, 1):
            nb = list(bounds)
            nb[k] += d
            out.append(with_bounds(nb))
            if k + 1 < S:  # shift stage k (both of its cuts)
                nb2 = list(nb)
                nb2[k + 1] += d
                out.append(with_bounds(nb2))
    for i in range(S):
        for j in range(i + 1, S):
            g = list(groups)
            g[i], g[j] = g[j], g[i]
            out.append([(cuts[x], g[x]) for x in range(S)])
    for k in range(S - 1):  # merge two adjacent stages, keeping either group or both
        merged = (cuts[k][0], cuts[k + 1][1])
        for g in (groups[k], groups[k + 1], tuple(sorted(groups[k] + groups[k + 1]))):
            out.append([*layout[:k], (merged, g), *layout[k + 2:]])
    used = {h for g in groups for h in g}
    idle = [h for h in range(n_hosts) if h not in used]
    for k in range(S):  # split a stage: part of its layers to an idle device or to part of its group
        (c, c2), g = layout[k]
        options = [(g, (h,)) for h in idle] + [((h,), g) for h in idle]
        if len(g) > 1:
            options += [(g[:i], g[i:]) for i in range(1, len(g))]
        for x in range(c + 1, c2):
            for g1, g2 in options:
                out.append([*layout[:k], ((c, x), g1), ((x, c2), g2), *layout[k + 1:]])
    for h in range(n_hosts):
        src = next((i for i, g in enumerate(groups) if h in g), None)
        targets = [j for j in range(S) if j != src]
        for j in targets + ([None] if src is not None else []):
            g = [tuple(x for x in grp if x != h) for grp in groups]
            if j is not None:
                g[j] = tuple(sorted(g[j] + (h,)))
            if any(not x for x in g):
                continue
            if src is None and h in used:
                continue
            out.append([(cuts[x], g[x]) for x in range(S)])
    return [x for x in out if x is not None]


def refine(pb: Problem, t: Tables, seeds: Sequence[tuple[float, int, Layout]], budget: int
           ) -> list[tuple[float, Plan]]:
    """Steepest descent on the priced step time from the best seeds, pricing at most ``budget`` new plans."""
    if budget <= 0:
        return []
    exact = len(pb.hosts) <= pb.exact_devices
    max_stages = max_stages_of(pb)
    max_group = len(pb.hosts) if exact else pb.max_group

    def key(b: int, lay: Layout) -> tuple:
        return (b, tuple((c, tuple(sorted(g))) for c, g in lay))

    seen: dict[tuple, float] = {key(b, lay): s for s, b, lay in seeds}
    found: list[tuple[float, Plan]] = []
    starts = sorted(seeds, key=lambda x: x[0])
    used = 0
    done: set[tuple] = set()
    for step0, b, lay in starts:
        if used >= budget:
            break
        if key(b, lay) in done:
            continue
        cur, cur_s = lay, step0
        while used < budget:
            done.add(key(b, cur))
            best: tuple[float, Layout] | None = None
            for nb in _neighbours(cur, len(pb.hosts)):
                if len(nb) > max_stages or any(len(g) > min(max_group, b) for _, g in nb):
                    continue  # outside the search space the DP was given
                k = key(b, nb)
                if k in seen:
                    s = seen[k]
                elif layout_bound(t, nb, b, pb.global_batch // b, REGISTRY[pb.schedule].split_backward) >= cur_s:
                    continue  # cannot be a step down (planner/prune.py)
                else:
                    if used >= budget:
                        break
                    used += 1
                    plan = build_plan(pb, t, *layout_choices(nb), b, "optimal")
                    s = INF
                    if plan is not None:
                        s = price_plan(pb, plan)
                        found.append((s, plan))
                    seen[k] = s
                if s < cur_s * (1 - 1e-12) and (best is None or s < best[0]):
                    best = (s, nb)
            if best is None:
                break
            cur_s, cur = best
    return found

