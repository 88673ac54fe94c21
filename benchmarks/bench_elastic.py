"""Lose a host, keep training: how long from the failure to the first step on the new plan, and
what checkpointing every step costs.

qwen3-small on local processes named after hetero4's hosts (laptop, desktop, pi4, pi3) with
synthetic per-host costs in hetero4's CPU ratios (no profiling: the figures below are about the
recovery, not the plan). Two parts:

1. Checkpoint cost: the same 4-rank plan (and, with ``--cost-ranks 2 4``, a 2-rank one: no more
   ranks than this machine's cores) run warm (one process pool, imports paid once) with no
   checkpoint, ``--checkpoint-every 1`` written in the step, ``--checkpoint-every 1
   --checkpoint-background`` (both: a full checkpoint every ``--full-every`` steps, gradient logs
   between) and the same with a full checkpoint every step; the added wall seconds of the steps
   (the last checkpoint's completion included) per step, over the step time, against the
   <= 5% target. Give ``--cost-steps`` at least twice ``--full-every`` so that the measured
   steps carry their share of full checkpoints.
2. Recovery: `torchpp run --elastic`'s driver on the plan; one rank is SIGKILLed after checkpoint
   K; printed: detection, stopping the survivors, re-plan, process start-up, reshard/load of the
   checkpoint, the first step on the new plan, their sum, and the steps lost. Against it, a
   restart by hand: `torchpp plan` from the command line plus the same start-up, load and first
   step (the time a person takes to notice is not counted, in the hand restart's favour).

With ``--scenario homelab`` (root: the demo's emulated homelab cluster, an old laptop and
three Raspberry Pis training qwen3-homelab, which none of them can hold alone) both parts run on
the cluster instead: every host is measured and the plan made as `torchpp demo` does, the
checkpoint cost is the period between consecutive steps (metrics.jsonl's wall clock, so a
checkpoint written after a step counts) with and without a checkpoint every step, and the
recovery kills the host on Wi-Fi (pi4b) and re-plans over the three left.

    .venv/bin/python benchmarks/bench_elastic.py [--scenario hetero4|homelab] [--out out/bench_elastic]
        [--steps 8] [--cost-steps 21] [--full-every 10] [--only cost|recovery] [--cost-ranks 2 4] [--rounds 2]
    .venv/bin/python benchmarks/bench_elastic.py --quick --out /tmp/elastic   # both parts, fewest steps: checks that it runs

``--quick`` (hetero4): the checkpoint cost on 2 ranks, one round of 3 steps, a full checkpoint every 2; the
recovery over 4 steps with the kill after checkpoint 2. Seconds, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HOSTS = {"laptop": 0.8, "desktop": 0.5, "pi4": 0.4, "pi3": 0.3}
MODEL = "qwen3-small"


def measurements(d: Path) -> dict:
    from torchpp.models.presets import load_config
    from torchpp.planner.synthetic import layers_file, uniform_links

    cfg = load_config(MODEL)
    d.mkdir(parents=True, exist_ok=True)
    files = []
    for h, cpu in HOSTS.items():
        f = d / f"layers_{h}.json"
        layers_file(h, num_layers=cfg.num_hidden_layers, speed=cpu, batch=2, seq_len=32, model_name=MODEL,
                    hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, tied=True, layer_fwd_s=0.01,
                    embed_fwd_s=0.002, tail_fwd_s=0.02, layer_param_bytes=3_200_000, embed_param_bytes=4_200_000,
                    tail_param_bytes=4_200_000, act_bytes_per_sample=32 * 256 * 4).save(f)
        files.append(f)
    uniform_links(list(HOSTS), 12.5e6, 1e-3).save(d / "bandwidth.json")
    (d / "devices.json").write_text(json.dumps({h: 2.0 for h in HOSTS}))
    return dict(layers=files, devices=d / "devices.json", bandwidth=d / "bandwidth.json")


def first_plan(d: Path, ranks: int = 4) -> Path:
    """A pipeline over the first ``ranks`` hosts, one stage each (4: the failure must hit a host the
    plan uses; 2: no more ranks than this machine's cores, for the checkpoint cost)."""
    from torchpp.models.presets import load_config, model_info
    from torchpp.planner.simple import make_plan

    info = model_info(load_config(MODEL), MODEL)
    cuts = {4: [(0, 3), (3, 5), (5, 7), (7, 8)], 2: [(0, 4), (4, 8)]}[ranks]
    path = d / ("plan.json" if ranks == 4 else f"plan{ranks}.json")
    make_plan(info, seq_len=32, global_batch=8, num_microbatches=4, layer_ranges=cuts,
              group_sizes=[1] * ranks, hosts=list(HOSTS)[:ranks]).save(path)
    return path


def _timed_train(rank: int, world: int, cfg) -> dict:
    from torchpp.runtime.trainer import train

    s = train(cfg)
    return {"wall_s": s.steps_wall_s, "cpu_s": s.steps_cpu_s, "step_s": s.step_times_s}


KINDS = {"none": {}, "sync": {"checkpoint_every": 1},
         "background": {"checkpoint_every": 1, "checkpoint_background": True},
         "background_full": {"checkpoint_every": 1, "checkpoint_background": True, "full_checkpoint_every": 1}}
"""``sync`` and ``background`` write a full checkpoint every ``--full-every`` steps and gradient
logs between (torchpp.train's default); ``background_full`` a full one every step."""
CHECKPOINTED = [k for k in KINDS if k != "none"]


def checkpoint_cost(d: Path, plan: Path, steps: int, ranks: int, rounds: int = 2, full_every: int = 10) -> dict:
    """Per-step seconds a checkpoint adds, written in the step and in the background, over the
    step time: the wall time of the steps (set-up and export excluded, the last checkpoint's
    completion included), each kind run ``rounds`` times interleaved and its fastest run kept
    (the machine is shared: the minimum is the least disturbed)."""
    from torchpp.runtime.launch import RankPool
    from torchpp.runtime.trainer import TrainConfig

    runs: dict[str, list[dict]] = {k: [] for k in KINDS}
    with RankPool(ranks, threads=1) as pool:
        pool.run(_timed_train, TrainConfig(plan=plan, steps=2, threads=1, timeout_s=120), timeout_s=300)  # warm-up
        for i in range(rounds):
            for name, extra in KINDS.items():
                extra = {"full_checkpoint_every": full_every, **extra} if extra else {}
                cfg = TrainConfig(plan=plan, steps=steps, threads=1, timeout_s=120, keep_checkpoints=2,
                                  checkpoint_dir=d / f"ck{ranks}_{name}_{i}" if extra else None, **extra)
                r = pool.run(_timed_train, cfg, timeout_s=300)
                med = sorted(r[0]["step_s"])[len(r[0]["step_s"]) // 2]
                runs[name].append({"wall_s": max(x["wall_s"] for x in r), "cpu_s": sum(x["cpu_s"] for x in r),
                                   "step_s": med})
    out = {name: min(rs, key=lambda x: x["wall_s"]) | {"walls_s": [x["wall_s"] for x in rs]}
           for name, rs in runs.items()}
    base = out["none"]["wall_s"] / steps
    out["none"]["per_step_s"] = base
    for name in CHECKPOINTED:
        added = (out[name]["wall_s"] - out["none"]["wall_s"]) / steps
        out[name]["added_per_step_s"] = added
        out[name]["ratio"] = added / base
        cpu = min(x["cpu_s"] for x in runs[name]) - min(x["cpu_s"] for x in runs["none"])
        out[name]["cpu_ratio"] = cpu / min(x["cpu_s"] for x in runs["none"])
    out["load_avg"] = os.getloadavg()
    return out


TARGET = 0.05
"""The target: a checkpoint every step costs at most 5% of the step time."""


def print_cost(cost: dict, what: str) -> None:
    since = f", steps {cost['steady_from_step']} on" if "steady_from_step" in cost else ""
    print(f"checkpoint every step ({what}{since}, {cost['none']['per_step_s']:.3f} s/step without, "
          f"load average {cost['load_avg'][0]:.1f}):")
    for name in (k for k in CHECKPOINTED if k in cost):
        c = cost[name]
        ok = "meets" if c["ratio"] <= TARGET else "misses"
        cpu = f"; CPU time of all ranks +{c['cpu_ratio'] * 100:.1f}%" if "cpu_ratio" in c else ""
        runs = f"; runs {', '.join(f'{x:.3f}' for x in c['periods_s'])} s/step" if "periods_s" in c else ""
        whole = (f"; from step 2 (the first checkpoints' files new) {c['whole_run_ratio'] * 100:+.1f}%"
                 if "whole_run_ratio" in c else "")
        print(f"  {name:<15} +{c['added_per_step_s'] * 1e3:7.1f} ms/step  ratio {c['ratio'] * 100:5.1f}% of a step "
              f"({ok} the <= {TARGET * 100:.0f}% target){cpu}{runs}{whole}")
    for name in (k for k in CHECKPOINTED if k in cost):
        cpus = cost[name].get("writer_cpu_s", [])
        for i, w in enumerate(cost[name].get("writer_wait_s", [])):
            cpu = f"; the writer's CPU {' '.join(f'{x * 1e3:.0f}' for x in cpus[i])} ms" if i < len(cpus) else ""
            print(f"  {name} run {i + 1}: updates waited for the writer {' '.join(f'{x * 1e3:.0f}' for x in w)} "
                  f"ms/step per stage{cpu}")
    if "periods_s" in cost["none"]:
        print(f"  {'none':<15} runs {', '.join(f'{x:.3f}' for x in cost['none']['periods_s'])} s/step")


def step_period(log_dir: Path, first: int = 2) -> float:
    """Seconds from one step's report to the next, from step ``first`` to the last (the steps before
    it left out: start-up, and the first checkpoints' files being created rather than
    overwritten), from metrics.jsonl's wall clock."""
    rows = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    t = sorted((r["step"], r["time"]) for r in rows if "step_time_s" in r and r["step"] >= first)
    if len(t) < 3:
        raise RuntimeError(f"{log_dir}/metrics.jsonl: expected >= 3 steps from step {first}, got {len(t)}")
    return (t[-1][1] - t[0][1]) / (t[-1][0] - t[0][0])


def writer_means(log_dir: Path, key: str = "checkpoint_wait_s", first: int = 3) -> list[float]:
    """Per stage, the mean over the steps from ``first`` of ``key``: seconds an update waited for
    the background writer, or (``checkpoint_cpu_s``) CPU seconds of the writer."""
    rows = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    waits = [r[key] for r in sorted((r for r in rows if key in r and r["step"] >= first), key=lambda r: r["step"])]
    return [sum(w[s] for w in waits) / len(waits) for s in range(len(waits[0]))] if waits else []


def cluster_checkpoint_cost(demo, plan: Path, steps: int, rounds: int, keep: int = 2, full_every: int = 10) -> dict:
    """The checkpoint cost on the emulated cluster: each kind trained ``rounds`` times,
    interleaved, for ``steps`` steps (`torchpp cluster run --plan`); per kind its fastest run's
    steady step period."""
    import shutil

    periods: dict[str, list[float]] = {k: [] for k in KINDS}
    whole: dict[str, list[float]] = {k: [] for k in KINDS}
    # the steady state of a long run: from the step after the second full checkpoint, once the first
    # chain's gradient logs (written into new files: nothing was retired yet to overwrite) are behind
    steady_from = full_every + 2 if steps >= 2 * full_every + 2 else 2
    waits: dict[str, list[list[float]]] = {}
    cpus: dict[str, list[list[float]]] = {}
    for i in range(rounds):
        for name, extra in KINDS.items():
            d = demo.path("checkpoint_cost", f"{name}{i}")
            shutil.rmtree(d, ignore_errors=True)
            argv = ["-m", "torchpp.train", "--plan", str(plan), "--data", "synthetic", "--steps", str(steps),
                    "--threads", "1", "--seed", "0", "--log-dir", str(d / "logs"), "--timeout-s", "300", "--no-output"]
            if extra:
                argv += ["--checkpoint-every", "1", "--keep-checkpoints", str(keep), "--checkpoint-dir", str(d / "ck")]
                argv += ["--checkpoint-background"] if extra.get("checkpoint_background") else []
                argv += ["--full-checkpoint-every", str(extra.get("full_checkpoint_every", full_every))]
            demo.p.run(f"checkpoint cost: {name} (round {i + 1}/{rounds}, {steps} steps)",
                       demo.hosts.ranks(plan, argv, d / "hosts"), timeout=600)
            periods[name].append(step_period(d / "logs", steady_from))
            whole[name].append(step_period(d / "logs"))
            if extra.get("checkpoint_background"):
                waits.setdefault(name, []).append(writer_means(d / "logs", first=max(3, steady_from)))
                cpus.setdefault(name, []).append(writer_means(d / "logs", "checkpoint_cpu_s", max(3, steady_from)))
            shutil.rmtree(d / "ck", ignore_errors=True)
    base = min(periods["none"])
    out: dict = {"none": {"per_step_s": base, "periods_s": periods["none"], "whole_run_periods_s": whole["none"]}}
    for name in CHECKPOINTED:
        added = min(periods[name]) - base
        out[name] = {"per_step_s": min(periods[name]), "added_per_step_s": added, "ratio": added / base,
                     "periods_s": periods[name], "writer_wait_s": waits.get(name, []),
                     "writer_cpu_s": cpus.get(name, []), "whole_run_periods_s": whole[name],
                     "whole_run_ratio": min(whole[name]) / min(whole["none"]) - 1}
    out["full_every"], out["steady_from_step"] = full_every, steady_from
    out["load_avg"] = os.getloadavg()
    return out


def _kill_after(ck: Path, step: int, rank: int, box: dict, within_s: float = 240) -> None:
    from torchpp.runtime.launch import kill_rank_after_checkpoint

    kill_rank_after_checkpoint(ck, step, rank, box, timeout_s=within_s, poll_s=0.01)


def recovery(d: Path, plan: Path, meas: dict, steps: int, kill_after: int, victim: int = 1,
             launcher=None, timeout_s: float = 30) -> dict:
    """`torchpp run --elastic`'s driver on ``plan``; rank ``victim`` is killed after checkpoint
    ``kill_after`` (local processes unless a ``launcher`` is given). ``timeout_s``: the driver's
    and the ranks' ``--timeout-s`` (a killed rank is seen by its exit, not by this)."""
    import shutil

    from torchpp.elastic.driver import Driver, ElasticConfig, LocalLauncher

    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ck, logs = d / "ck_elastic", d / "tb"
    for old in (ck, logs, d / "work"):  # an earlier run's checkpoints, metrics and heartbeats must not count
        shutil.rmtree(old, ignore_errors=True)
    train = ["--steps", str(steps), "--threads", "1", "--checkpoint-every", "1", "--checkpoint-background",
             "--log-dir", str(logs)]
    cfg = ElasticConfig(plan=plan, train_args=train, checkpoint_dir=ck, work_dir=d / "work", timeout_s=timeout_s,
                        startup_s=240, max_restarts=1, **meas)
    box: dict = {}
    threading.Thread(target=_kill_after, args=(ck, kill_after, victim, box, 8 * timeout_s), daemon=True).start()
    res = Driver(cfg, launcher or LocalLauncher(env)).run()
    first, second = res.attempts[:2]
    events = [json.loads(x) for x in (logs / "metrics.jsonl").read_text().splitlines()]
    resume = next(e for e in events if e.get("event") == "resume")
    step1 = next(e for e in events if e.get("step") == second.resume_step + 1 and "loss" in e
                 and events.index(e) > events.index(resume))
    parts = {"detection_s": first.detected_at - box["killed_at"], "stop_survivors_s": first.stopped_at - first.detected_at,
             "replan_s": first.replan_s, "start_up_s": resume["time"] - resume["load_s"] - second.started_at,
             "reshard_load_s": resume["load_s"], "first_step_s": step1["step_time_s"]}
    parts["total_s"] = sum(parts.values())
    parts["lost_steps"] = max(0, _done_before_kill(d) - second.resume_step)
    parts["new_plan"] = f"{second.world_size} ranks on {', '.join(second.hosts)}"
    parts["resumed_step"] = second.resume_step
    return parts


def _done_before_kill(d: Path) -> int:
    """Steps the first attempt finished before the kill (from its heartbeats)."""
    hb = d / "work" / "attempt0" / "heartbeat"
    return max((int(p.read_text()) for p in hb.glob("rank*")), default=0)


def by_hand(d: Path, meas: dict, lost: str, global_batch: int) -> float:
    """`torchpp plan` on the hosts left, from the command line (what a person re-runs)."""
    devices = d / "devices_left.json"
    devices.write_text(json.dumps({h: v for h, v in json.loads(Path(meas["devices"]).read_text()).items()
                                   if h != lost}))
    extra = [[f"--{k.replace('_', '-')}", str(meas[k])] for k in ("capacities", "memory_model") if meas.get(k)]
    cmd = [sys.executable, "-m", "torchpp", "plan", "--layers", *map(str, meas["layers"]), "--bandwidth",
           str(meas["bandwidth"]), "--devices", str(devices), "--global-batch", str(global_batch),
           *[x for pair in extra for x in pair], "--out-dir", str(d / "hand")]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return time.perf_counter() - t0


def print_recovery(rec: dict, hand_plan: float, victim: str, kill_after: int) -> float:
    hand = hand_plan + rec["start_up_s"] + rec["reshard_load_s"] + rec["first_step_s"]
    print(f"recovery after SIGKILL of {victim} at step {kill_after}: new plan {rec['new_plan']}, "
          f"resumed from step {rec['resumed_step']}, {rec['lost_steps']} step(s) of work lost")
    for k in ("detection_s", "stop_survivors_s", "replan_s", "start_up_s", "reshard_load_s", "first_step_s",
              "total_s"):
        print(f"  {k[:-2]:<18} {rec[k]:7.2f} s")
    print(f"  by hand (torchpp plan {hand_plan:.2f} s + the same start-up, load, first step; noticing not "
          f"counted): {hand:.2f} s  -> elastic/hand {rec['total_s'] / hand:.2f}")
    return hand


def hetero4(args: argparse.Namespace) -> dict:
    """qwen3-small on local processes named after hetero4's hosts (synthetic costs)."""
    d = args.out
    meas = measurements(d / "inputs")
    plan = first_plan(d)
    results: dict = {}
    if args.only in (None, "cost"):
        for ranks in args.cost_ranks:
            cost = checkpoint_cost(d, first_plan(d, ranks), args.cost_steps or args.steps, ranks, args.rounds,
                                   args.full_every)
            print_cost(cost, f"{MODEL}, {ranks} ranks on {os.cpu_count()} cores")
            results[f"checkpoint_{ranks}ranks"] = cost
    if args.only in (None, "recovery"):
        # --quick: on a loaded machine 4 ranks may take minutes to start and to step, which is no failure
        rec = recovery(d, plan, meas, args.steps, args.kill_after, timeout_s=300 if args.quick else 30)
        hand = print_recovery(rec, by_hand(d, meas, "desktop", 8), "rank 1 (desktop)", args.kill_after)
        results |= {"recovery": rec, "by_hand_s": hand}
    return results


VICTIM = "pi4b"
"""The homelab host that drops out: the Raspberry Pi on Wi-Fi."""


def homelab(args: argparse.Namespace) -> dict:
    """The demo's homelab scenario on the emulated cluster: measured, planned, then both parts."""
    from torchpp.demo import DemoConfig, DemoError, cluster_available, demo_hosts
    from torchpp.elastic.driver import ClusterLauncher
    from torchpp.formats import Plan

    why = cluster_available()
    if why is not None:
        print(f"bench_elastic: the homelab scenario needs the emulated cluster, which this machine cannot host: {why}")
        return {"skipped": why}
    cfg = DemoConfig(steps=args.steps)
    results: dict = {}
    try:
        with demo_hosts(cfg, args.out / "homelab", False, 2) as demo:
            demo.p.total = 7 + len(KINDS) * args.rounds * (args.only != "recovery")  # up, 5 to plan, runs, down
            m = demo.measure_and_plan()
            meas = dict(layers=m.files, devices=m.devices, bandwidth=m.bandwidth, capacities=m.capacities,
                        memory_model=m.memory)
            plan = Plan.load(m.plan)
            what = f"{cfg.model} on {demo.hosts.mode}, {plan.num_stages} stage(s), {plan.num_microbatches} micro-batches"
            results["plan"] = what
            if args.only in (None, "cost"):
                cost = cluster_checkpoint_cost(demo, m.plan, args.cost_steps or args.steps, args.rounds,
                                               args.keep_checkpoints, args.full_every)
                print_cost(cost, what)
                results["checkpoint"] = cost
            if args.only in (None, "recovery"):
                hosts = [plan.device_of_rank(r).host for r in range(plan.world_size)]
                lost = VICTIM if VICTIM in hosts else hosts[-1]  # the plan may leave the Wi-Fi Pi out
                victim = hosts.index(lost)
                demo.p.note(f"recovery: rank {victim} ({lost}) is killed after checkpoint {args.kill_after}")
                rec = recovery(demo.path("elastic"), m.plan, meas, args.steps, args.kill_after, victim,
                               ClusterLauncher(demo.hosts.cfg.name))
                hand = print_recovery(rec, by_hand(demo.path("elastic"), meas, lost, cfg.global_batch),
                                      f"rank {victim} ({lost})", args.kill_after)
                results |= {"recovery": rec, "by_hand_s": hand}
    except DemoError as e:
        raise SystemExit(f"bench_elastic: {e}") from None
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", choices=("hetero4", "homelab"), default="hetero4",
                    help="hetero4: local processes, synthetic costs; homelab: the emulated cluster (root)")
    ap.add_argument("--out", type=Path, default=Path("out/bench_elastic"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kill-after", type=int, default=3)
    ap.add_argument("--only", choices=("cost", "recovery"), default=None, help="run one part only")
    ap.add_argument("--cost-ranks", type=int, nargs="+", choices=(2, 4), default=[4],
                    help="hetero4: world sizes of the checkpoint-cost part (2: no more ranks than cores)")
    ap.add_argument("--keep-checkpoints", type=int, default=2,
                    help="homelab checkpoint cost: complete checkpoints kept (torchpp.train's --keep-checkpoints)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved runs of each kind (the fastest is kept)")
    ap.add_argument("--cost-steps", type=int, default=None,
                    help="steps of the checkpoint-cost runs (default --steps); at least twice --full-every, so "
                         "that the measured steps hold full checkpoints in their share")
    ap.add_argument("--full-every", type=int, default=10,
                    help="a full checkpoint every N steps, gradient logs between (torchpp.train's "
                         "--full-checkpoint-every)")
    ap.add_argument("--quick", action="store_true", help="hetero4: 2-rank cost of 3 steps, one round, a 4-step "
                    "recovery killed after checkpoint 2: checks that it runs, no measurement")
    args = ap.parse_args()
    if args.quick and args.scenario != "hetero4":
        ap.error("--quick: runs the hetero4 scenario only (the homelab one measures and plans on the emulated "
                 "cluster for minutes)")
    if args.quick:
        args.steps, args.cost_steps, args.kill_after, args.rounds, args.full_every = 4, 3, 2, 1, 2
        args.cost_ranks = [2]
    results = homelab(args) if args.scenario == "homelab" else hetero4(args)
    name = f"results{'_' + args.scenario if args.scenario != 'hetero4' else ''}{'_' + args.only if args.only else ''}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
