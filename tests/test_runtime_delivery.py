"""A send is waited on inline only where the peer has surely received it.

``runtime.delivery`` names, for each send, the first action of the sender after which its peer
has waited on the matching receive. Checked here against vector clocks of the whole schedule
run as ``schedules.validate`` runs it (every order of the ranks that the lists allow gives the
same happens-before): at that action the sender must know that the peer finished its receive.
Also: most sends get such a point (what removes the waiter threads), and none gets one too early
in hand-made lists.
"""
from __future__ import annotations

from collections import deque

import pytest

from torchpp.models.presets import load_config, model_info
from torchpp.plans import make_chunked_plan
from torchpp.planner.simple import make_plan
from torchpp.runtime.delivery import delivery_points
from torchpp.schedules import RECVS, Action, Kind, build, build_forward

INFO = model_info(load_config("qwen3-tiny"), "qwen3-tiny")


def _plans() -> dict[str, object]:
    p = dict(seq_len=16)
    return {
        "1f1b_pp3": make_plan(INFO, global_batch=6, num_microbatches=6, layer_ranges=[(0, 1), (1, 2), (2, 4)],
                              group_sizes=[1, 1, 1], schedule="1f1b", **p),
        "gpipe_pp2": make_plan(INFO, global_batch=4, num_microbatches=4, layer_ranges=[(0, 2), (2, 4)],
                               group_sizes=[1, 1], schedule="gpipe", **p),
        "hybrid_21": make_plan(INFO, global_batch=12, num_microbatches=4, layer_ranges=[(0, 1), (1, 4)],
                               group_sizes=[2, 1], schedule="1f1b", shares=[[2.0, 1.0], [1.0]], **p),
        "hybrid_12": make_plan(INFO, global_batch=12, num_microbatches=4, layer_ranges=[(0, 2), (2, 4)],
                               group_sizes=[1, 2], schedule="1f1b", shares=[[1.0], [1.0, 2.0]], **p),
        "interleaved": make_chunked_plan(INFO, global_batch=8, num_microbatches=4, schedule="interleaved",
                                         layer_ranges=[(0, 1), (1, 2), (2, 3), (3, 4)], **p),
        "zbv": make_chunked_plan(INFO, global_batch=8, num_microbatches=4, schedule="zbv",
                                 layer_ranges=[(0, 0), (0, 1), (1, 3), (3, 4)], group_sizes=[1, 2], **p),
        "interleaved_zb": make_chunked_plan(INFO, global_batch=8, num_microbatches=4, schedule="interleaved-zb",
                                            layer_ranges=[(0, 1), (1, 3), (3, 4), (4, 4)], **p),
        "v": make_chunked_plan(INFO, global_batch=8, num_microbatches=4, schedule="v",
                               layer_ranges=[(0, 1), (1, 2), (2, 4), (4, 4)], group_sizes=[2, 1], **p),
    }


PLANS = _plans()


def known_progress(sched: dict[int, list[Action]]) -> dict[tuple[int, int], list[int]]:
    """(rank, index) -> after that action, how many actions of each rank it knows have run (vector
    clocks, merged on each receive from the send's clock and on each all-reduce from every member's)."""
    ranks = sorted(sched)
    pos = {r: 0 for r in ranks}
    clock = {r: [0] * (max(ranks) + 1) for r in ranks}
    links: dict[tuple, deque] = {}
    after: dict[tuple[int, int], list[int]] = {}
    moved = True
    while moved:
        moved = False
        for r in ranks:
            while pos[r] < len(sched[r]):
                i, a = pos[r], sched[r][pos[r]]
                if a.is_recv:
                    q = links.get((a.peer, r, RECVS[a.kind]))
                    if not q:
                        break
                    sent = q.popleft()
                    clock[r] = [max(x, y) for x, y in zip(clock[r], sent)]
                elif a.kind == Kind.ALLREDUCE:
                    heads = {m: sched[m][pos[m]] if pos[m] < len(sched[m]) else None for m in a.group}
                    if any(h is None or h.kind != Kind.ALLREDUCE for h in heads.values()):
                        break
                    merged = [max(xs) for xs in zip(*(clock[m] for m in a.group))]
                    for m in a.group:
                        clock[m] = list(merged)
                        clock[m][m] = pos[m] + 1
                        after[(m, pos[m])] = list(clock[m])
                        pos[m] += 1
                    moved = True
                    continue
                clock[r][r] = i + 1
                if a.is_send:
                    links.setdefault((r, a.peer, a.kind), deque()).append(list(clock[r]))
                after[(r, i)] = list(clock[r])
                pos[r] += 1
                moved = True
    assert all(pos[r] == len(sched[r]) for r in ranks)
    return after


def receive_index(sched: dict[int, list[Action]], rank: int, i: int) -> int:
    """The index on the peer of the receive that gets ``rank``'s send ``i`` (per link and kind, in order)."""
    a = sched[rank][i]
    n = sum(1 for b in sched[rank][:i] if b.is_send and b.peer == a.peer and b.kind == a.kind)
    recvs = [j for j, b in enumerate(sched[a.peer]) if b.is_recv and b.peer == rank and RECVS[b.kind] == a.kind]
    return recvs[n]


@pytest.mark.parametrize("name", list(PLANS))
@pytest.mark.parametrize("forward_only", [False, True])
def test_a_send_is_released_only_after_its_peer_received_it(name, forward_only):
    sched = (build_forward if forward_only else build)(PLANS[name])
    after = known_progress(sched)
    sends = released = 0
    for rank, acts in sched.items():
        points = delivery_points(sched, rank)
        seen = [j for js in points.values() for j in js]
        assert len(seen) == len(set(seen))  # each send once
        for at, js in points.items():
            for j in js:
                a = acts[j]
                assert a.is_send and at > j, (rank, at, a)
                peer_recv = receive_index(sched, rank, j)
                assert after[(rank, at)][a.peer] > peer_recv, (name, rank, a, acts[at])
        sends += sum(1 for a in acts if a.is_send)
        released += len(seen)
    if not forward_only and name != "gpipe_pp2":
        # only the last messages of a step (nothing comes back after them) keep a waiter thread
        assert released >= sends / 2, (released, sends)


def test_1f1b_activations_are_released_by_the_gradients_coming_back():
    """At the latest when its own gradient arrives (before the backward that frees it anyway)."""
    sched = build(PLANS["1f1b_pp3"])
    acts = sched[0]
    points = delivery_points(sched, 0)
    for at, js in points.items():
        for j in js:
            assert acts[j].kind == Kind.SEND_ACT
            assert acts[at].kind == Kind.RECV_GRAD and acts[at].microbatch <= acts[j].microbatch
    assert len([j for js in points.values() for j in js]) == PLANS["1f1b_pp3"].num_microbatches


def test_a_message_sent_before_the_peer_received_proves_nothing():
    """Rank 1 sends its reply before it receives rank 0's message: the reply's arrival does not
    prove rank 0's send delivered; a later all-reduce with rank 1 does."""
    s0 = [Action(Kind.SEND_ACT, 0, 0, peer=1, samples=(0, 1)), Action(Kind.RECV_GRAD, 0, 0, peer=1, samples=(0, 1)),
          Action(Kind.ALLREDUCE, 0, group=(0, 1)), Action(Kind.OPTIMIZER, 0)]
    s1 = [Action(Kind.SEND_GRAD, 1, 0, peer=0, samples=(0, 1)), Action(Kind.RECV_ACT, 1, 0, peer=0, samples=(0, 1)),
          Action(Kind.ALLREDUCE, 1, group=(0, 1)), Action(Kind.OPTIMIZER, 1)]
    sched = {0: s0, 1: s1}
    assert delivery_points(sched, 0) == {2: (0,)}
    assert delivery_points(sched, 1) == {2: (0,)}
    after = known_progress(sched)
    assert after[(0, 1)][1] == 1 and after[(0, 2)][1] >= 2
