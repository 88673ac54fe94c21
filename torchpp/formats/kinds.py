"""The schedule kinds: every name a plan's ``schedule`` may hold, and what its rows need to know.

This table is the one list of kinds. It sits in formats, the bottom of torchpp's layering,
because plan.json's own validation needs it (a kind's name and the placement of chunks it
implies) and formats imports nothing of torchpp; :mod:`torchpp.schedules` attaches each kind's
order function to these rows (its ``REGISTRY``), and the planner, the simulator and every
command's help read the names from there or from here.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KindSpec:
    """One schedule kind's static facts."""

    name: str
    placement: str
    """``single``: one chunk per device; ``interleaved``: chunk c on the devices of chunk c mod p
    (v chunks each); ``v``: chunks c and 2p-1-c on one device (the first and last chunk together)."""
    split_backward: bool
    """Backward split into input-gradient (I) and weight-gradient (W) actions (zero-bubble kinds)."""
    family: str | None
    """The kind of the same placement with the other backward (full / split), if any."""
    every_m: bool
    """Its order runs any number of micro-batches on any number of stages (zb-h1 and the interleaved
    kinds run them in rounds of the stage count)."""


SPECS: tuple[KindSpec, ...] = (
    KindSpec("1f1b", "single", False, "zb-h1", True),
    KindSpec("zb-h1", "single", True, "1f1b", False),
    KindSpec("gpipe", "single", False, None, True),
    KindSpec("interleaved", "interleaved", False, "interleaved-zb", False),
    KindSpec("interleaved-zb", "interleaved", True, "interleaved", False),
    KindSpec("v", "v", False, "zbv", True),
    KindSpec("zbv", "v", True, "v", True),
)
KINDS: dict[str, KindSpec] = {k.name: k for k in SPECS}
"""Every schedule kind by name, in the order the planner and the help list them."""
KIND_NAMES: tuple[str, ...] = tuple(KINDS)
ONE_CHUNK: tuple[str, ...] = tuple(k.name for k in SPECS if k.placement == "single")
"""Kinds with one chunk per device group (the planner's stage DP)."""
MULTI_CHUNK: tuple[str, ...] = tuple(k.name for k in SPECS if k.placement != "single")
"""Kinds whose groups hold several chunks (the planner's chunked search)."""
SPLIT_BACKWARD: tuple[str, ...] = tuple(k.name for k in SPECS if k.split_backward)
FULL_BACKWARD_ONE_CHUNK: tuple[str, ...] = tuple(k for k in ONE_CHUNK if not KINDS[k].split_backward)
"""The kinds of plan format 1, of fixed strategies and of the simulator's parametric plans."""


def parse_kinds(spec: str) -> list[str]:
    """``auto`` (every kind), one kind, or a comma-separated list -> the kinds to search."""
    if spec == "auto":
        return list(KIND_NAMES)
    kinds = [x.strip() for x in spec.split(",") if x.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"schedule: expected 'auto' or kinds from {', '.join(KIND_NAMES)}, got {spec!r}")
    return list(dict.fromkeys(kinds))
