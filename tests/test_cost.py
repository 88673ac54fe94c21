"""The cost layer: one accessor of stage time and stage memory, equal in scalar and table form."""
import ast
import random
from pathlib import Path

import numpy as np
import pytest

import torchpp
from torchpp.cost import Links, MeasuredCost, MemoryEstimator, Profiles, Span, StageMemory, boundary_bytes, stage_time
from torchpp.formats import Bandwidth, PlanDevice, PlanStage
from torchpp.planner.types import Problem
from torchpp.planner.tables import Tables
from torchpp.planner.simple import make_plan
from torchpp.planner.synthetic import layers_file, random_instance
from torchpp.schedules import Kind, build, in_flight
from torchpp.sim.measured import price


def random_problem(seed: int) -> Problem:
    """Random hosts and layers; every host gets random per-sample and per-call tables and a call overhead."""
    rng = random.Random(seed)
    N, L = rng.randint(1, 4), rng.randint(1, 9)
    files, bw, mem = random_instance(rng, hosts=N, layers=L, batch=2)
    p = Profiles.from_layers(files)
    r = np.random.default_rng(seed)
    for f in files:
        fwd, bwd = r.uniform(0.01, 2.0, L + 2), r.uniform(0.01, 4.0, L + 2)
        p.set_table(f.host, fwd, bwd, rng.choice([1, 2, 4]), "random", fwd * r.uniform(0, 0.5, L + 2),
                    bwd * r.uniform(0, 0.5, L + 2))
        p.call[f.host] = rng.choice([0.0, r.uniform(0, 0.1)])
    memory = MemoryEstimator(r.uniform(0, 1e8), 4.0, r.uniform(1, 20), "random", kt=rng.choice([None, 2.0]))
    return Problem(profiles=p, links=Links(bw), hosts=[f.host for f in files], budget=mem, memory=memory,
                   global_batch=4)


@pytest.mark.parametrize("seed", range(12))
def test_tables_equal_the_scalar_accessor_exactly(seed):
    pb = random_problem(seed)
    t = Tables(pb)
    L, p = t.L, pb.profiles
    mem = StageMemory(p, pb.memory)
    for c in range(L):
        for c2 in range(c + 1, L + 1):
            for v in (0, 1):
                span = Span.of_cut(c, c2, L, recompute=bool(v))
                stage = PlanStage(index=0, layers=(c, c2), has_embed=c == 0, has_tail=c2 == L,
                                  devices=[PlanDevice(host=pb.hosts[0], rank=0, share=1.0, samples=1)],
                                  recompute=[bool(v)] * (c2 - c))
                assert Span.of_stage(stage) == span
                for h, name in enumerate(pb.hosts):
                    st = stage_time(p, name, stage)
                    assert t.tau[(h, v)][c, c2] == st.per_sample
                    assert t.tau0[(h, v)][c, c2] == st.per_call
                for n in (1, 2, 3, 8):
                    assert t.per_sample(v, n)[c, c2] == max(mem.per_sample(stage, n), 1e-30)
                assert t.static[c, c2] == mem.static(stage)
            assert t.out_bytes[c2] == float(boundary_bytes(p, stage))


@pytest.mark.parametrize("seed", range(8))
def test_scalar_accessor_is_the_sum_of_its_blocks(seed):
    """Against the definition, block by block, with random recompute flags."""
    pb = random_problem(100 + seed)
    p, mem, rng = pb.profiles, StageMemory(pb.profiles, pb.memory), random.Random(seed)
    L = p.model.num_layers
    c = rng.randrange(L)
    c2 = rng.randrange(c + 1, L + 1)
    flags = [rng.random() < 0.5 for _ in range(c2 - c)]
    stage = PlanStage(index=0, layers=(c, c2), has_embed=c == 0, has_tail=c2 == L, devices=[], recompute=flags)
    blocks = list(range(0 if c == 0 else c + 1, c2 + 2 if c2 == L else c2 + 1))
    rec = [c + 1 + i for i, r in enumerate(flags) if r]
    assert Span.of_cut(c, c2, L, flags) == Span.of_stage(stage)
    for host in pb.hosts:
        f, b = p.table(host)
        f0, b0 = p.fixed(host)
        call = p.call.get(host, 0.0)
        st = stage_time(p, host, stage)
        assert st.forward(3) == pytest.approx(sum(f0[blocks]) + call + 3 * sum(f[blocks]))
        assert st.backward(3) == pytest.approx(sum(b0[blocks]) + sum(f0[rec]) + call + 3 * (sum(b[blocks]) + sum(f[rec])))
        assert st.recompute(3) == pytest.approx(3 * sum(f[rec]))
        assert st.forward(0) == st.backward(0) == 0.0
    acts = pb.memory.activations(p.act_bytes)
    kept = sum(acts[blocks]) - sum(acts[rec])
    want = pb.memory.base + pb.memory.alpha * sum(p.param_bytes[blocks]) + 2 * (
        3 * (pb.memory.kp * kept + sum(acts[rec])) + pb.memory.kp * max([acts[j] for j in rec], default=0.0))
    assert mem.peak(stage, 2, 3) == pytest.approx(want)


def test_in_flight_is_read_off_the_order_and_equals_the_closed_forms():
    for S in range(1, 9):
        for s in range(S):
            for m in range(1, 20):
                assert in_flight("1f1b", S, s, m) == min(S - s, m)
                assert in_flight("gpipe", S, s, m) == m


def _fixture():
    files = [layers_file("a", num_layers=6, batch=4, layer_fwd_s=[1.0, 1.5, 0.7, 1.2, 0.9, 1.1], embed_fwd_s=0.3,
                         tail_fwd_s=2.5, fixed_fraction=0.2),
             layers_file("b", num_layers=6, batch=4, speed=1.7, layer_fwd_s=[1.0, 1.5, 0.7, 1.2, 0.9, 1.1],
                         embed_fwd_s=0.3, tail_fwd_s=2.5, fixed_fraction=0.1),
             layers_file("c", num_layers=6, batch=4, speed=0.6, layer_fwd_s=1.0, embed_fwd_s=0.3, tail_fwd_s=2.5)]
    files[1].call_overhead_s = 0.05
    hosts = ["a", "b", "c"]
    pairs = [(x, y) for x in hosts for y in hosts if x != y]
    rates = {Bandwidth.key(x, y): 1e7 * (1 + i) for i, (x, y) in enumerate(pairs)}
    bw = Bandwidth(bytes_per_sec=rates, latency_s={k: 1e-3 for k in rates}, source="fixture")
    plan = make_plan(files[0].model, seq_len=files[0].run.seq_len, global_batch=12, num_microbatches=3,
                     layer_ranges=[(0, 2), (2, 6)], group_sizes=[2, 1], hosts=hosts)
    plan.stages[1].recompute = [True, False, True, True]
    return plan, Profiles.from_layers(files), bw


# Prices of the fixture's actions before the cost layer existed (planner/cost.py's MeasuredCost and price).
BEFORE = {"0:0F0[0:2]": 1.6800000000000002, "0:0SA0>2[0:2]": 0.0010064, "0:0B0[0:2]": 3.3600000000000003,
          "0:0AR{0,1}": 0.0026, "0:0ART{0,1,2}": 0.004533333333333334, "0:0OPT": 6e-06,
          "1:0F0[2:4]": 0.9558823529411765, "1:0SA0>2[2:4]": 0.0010032, "1:0B0[2:4]": 1.861764705882353,
          "1:0OPT": 1.2e-05, "2:1F0[0:4]": 10.833333333333334, "2:1B0[0:4]": 26.666666666666668,
          "2:1SG0>0[0:2]": 0.00100256, "2:1SG0>1[2:4]": 0.0010021333333333333, "2:1OPT": 0.0}


def test_measured_cost_and_price_unchanged_on_a_fixture():
    plan, prof, bw = _fixture()
    opt = {"a": 1e-9, "b": 2e-9}
    cost = MeasuredCost(plan, prof, Links(bw), opt)
    got = {}
    for r, acts in build(plan).items():
        for a in acts:
            if a.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.OPTIMIZER):
                got[f"{r}:{a}"] = cost.compute_s(r, a)
            elif a.is_send:
                got[f"{r}:{a}"] = cost.transfer_s(r, a.peer, a)
            elif a.kind == Kind.ALLREDUCE:
                got[f"{r}:{a}"] = cost.allreduce_s(a)
    for k, v in BEFORE.items():
        assert got[k] == pytest.approx(v, rel=1e-12, abs=0), k
    assert price(plan, prof, bw, opt)[0] == pytest.approx(117.54915429333333, rel=1e-12)


def test_cost_imports_nothing_above_it():
    """cost/ imports only formats, schedules, numpy and the standard library."""
    root = Path(torchpp.__file__).parent / "cost"
    banned = ("torchpp.planner", "torchpp.sim", "torchpp.trace", "torchpp.runtime", "torch", "transformers",
              "scipy")
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level == 0:
                    names = [node.module or ""]
                else:  # relative: resolve against torchpp.cost
                    base = ["torchpp", "cost"][: 3 - node.level] if node.level <= 2 else []
                    names = [".".join(base + ([node.module] if node.module else []))]
            else:
                continue
            for name in names:
                assert not any(name == b or name.startswith(b + ".") for b in banned), f"{path.name} imports {name}"
                if name.startswith("torchpp.") and not name.startswith("torchpp.cost"):
                    assert name in ("torchpp.formats", "torchpp.schedules"), f"{path.name} imports {name}"
