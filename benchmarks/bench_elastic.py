"""Lose a host, keep training: how long from the failure to the first step on the new plan, and
what checkpointing every step costs.

qwen3-small on local processes named after hetero4's hosts (laptop, desktop, pi4, pi3) with
synthetic per-host costs in hetero4's CPU ratios (no profiling: the figures below are about the
recovery, not the plan). Two parts:

1. Checkpoint cost: the same 4-rank plan run warm (one process pool, imports paid once) with no
   checkpoint, ``--checkpoint-every 1`` written in the step, and ``--checkpoint-every 1
   --checkpoint-background``; the added seconds per step over the step time.
2. Recovery: `torchpp run --elastic`'s driver on the plan; one rank is SIGKILLed after checkpoint
   K; printed: detection, stopping the survivors, re-plan, process start-up, reshard/load of the
   checkpoint, the first step on the new plan, their sum, and the steps lost. Against it, a
   restart by hand: `torchpp plan` from the command line plus the same start-up, load and first
   step (the time a person takes to notice is not counted, in the hand restart's favour).

    .venv/bin/python benchmarks/bench_elastic.py [--out out/bench_elastic] [--steps 8]
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


def first_plan(d: Path) -> Path:
    """A 4-stage pipeline over the four hosts (the failure must hit a host the plan uses)."""
    from torchpp.models.presets import load_config, model_info
    from torchpp.planner.simple import make_plan

    info = model_info(load_config(MODEL), MODEL)
    make_plan(info, seq_len=32, global_batch=8, num_microbatches=4, layer_ranges=[(0, 3), (3, 5), (5, 7), (7, 8)],
              group_sizes=[1, 1, 1, 1], hosts=list(HOSTS)).save(d / "plan.json")
    return d / "plan.json"


def _timed_train(rank: int, world: int, cfg) -> dict:
    from torchpp.runtime.trainer import train

    t0 = time.perf_counter()
    s = train(cfg)
    return {"wall_s": time.perf_counter() - t0, "step_s": s.step_times_s}


def checkpoint_cost(d: Path, plan: Path, steps: int) -> dict:
    """Per-step seconds a checkpoint adds, in the step and in the background, over the step time."""
    from torchpp.runtime.launch import RankPool
    from torchpp.runtime.trainer import TrainConfig

    kinds = {"none": {}, "sync": {"checkpoint_every": 1}, "background": {"checkpoint_every": 1,
                                                                         "checkpoint_background": True}}
    out = {}
    with RankPool(4, threads=1) as pool:
        pool.run(_timed_train, TrainConfig(plan=plan, steps=2, threads=1, timeout_s=120), timeout_s=300)  # warm-up
        for name, extra in kinds.items():
            cfg = TrainConfig(plan=plan, steps=steps, threads=1, timeout_s=120, keep_checkpoints=2,
                              checkpoint_dir=d / f"ck_{name}" if extra else None, **extra)
            r = pool.run(_timed_train, cfg, timeout_s=300)
            out[name] = {"wall_s": max(x["wall_s"] for x in r), "step_s": sorted(r[0]["step_s"])[len(r[0]["step_s"]) // 2]}
    base = out["none"]
    for name in ("sync", "background"):
        added = (out[name]["wall_s"] - base["wall_s"]) / steps
        out[name]["added_per_step_s"] = added
        out[name]["ratio"] = added / base["step_s"]
    return out


def _kill_after(ck: Path, step: int, rank: int, box: dict) -> None:
    from torchpp.runtime.launch import kill_rank_after_checkpoint

    kill_rank_after_checkpoint(ck, step, rank, box, timeout_s=240, poll_s=0.01)


def recovery(d: Path, plan: Path, meas: dict, steps: int, kill_after: int) -> dict:
    from torchpp.elastic.driver import Driver, ElasticConfig, LocalLauncher

    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ck, logs = d / "ck_elastic", d / "tb"
    train = ["--steps", str(steps), "--threads", "1", "--checkpoint-every", "1", "--checkpoint-background",
             "--log-dir", str(logs)]
    cfg = ElasticConfig(plan=plan, train_args=train, checkpoint_dir=ck, work_dir=d / "work", timeout_s=30,
                        startup_s=240, max_restarts=1, **meas)
    box: dict = {}
    threading.Thread(target=_kill_after, args=(ck, kill_after, 1, box), daemon=True).start()
    res = Driver(cfg, LocalLauncher(env)).run()
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


def by_hand(d: Path, meas: dict) -> float:
    """`torchpp plan` on the three hosts left, from the command line (what a person re-runs)."""
    devices = d / "devices_left.json"
    devices.write_text(json.dumps({h: 2.0 for h in HOSTS if h != "desktop"}))
    cmd = [sys.executable, "-m", "torchpp", "plan", "--layers", *map(str, meas["layers"]), "--bandwidth",
           str(meas["bandwidth"]), "--devices", str(devices), "--global-batch", "8", "--out-dir", str(d / "hand")]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("out/bench_elastic"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kill-after", type=int, default=3)
    args = ap.parse_args()
    d = args.out
    meas = measurements(d / "inputs")
    plan = first_plan(d)
    cost = checkpoint_cost(d, plan, args.steps)
    print(f"checkpoint every step ({MODEL}, 4 ranks, median step {cost['none']['step_s']:.3f} s):")
    for name in ("sync", "background"):
        c = cost[name]
        print(f"  {name:<10} +{c['added_per_step_s'] * 1e3:7.1f} ms/step  ratio {c['ratio'] * 100:5.1f}% of a step")
    rec = recovery(d, plan, meas, args.steps, args.kill_after)
    hand_plan = by_hand(d, meas)
    hand = hand_plan + rec["start_up_s"] + rec["reshard_load_s"] + rec["first_step_s"]
    print(f"recovery after SIGKILL of rank 1 (desktop) at step {args.kill_after}: new plan {rec['new_plan']}, "
          f"resumed from step {rec['resumed_step']}, {rec['lost_steps']} step(s) of work lost")
    for k in ("detection_s", "stop_survivors_s", "replan_s", "start_up_s", "reshard_load_s", "first_step_s", "total_s"):
        print(f"  {k[:-2]:<18} {rec[k]:7.2f} s")
    print(f"  by hand (torchpp plan {hand_plan:.2f} s + the same start-up, load, first step; noticing not counted): "
          f"{hand:.2f} s  -> elastic/hand {rec['total_s'] / hand:.2f}")
    (d / "results.json").write_text(json.dumps({"checkpoint": cost, "recovery": rec, "by_hand_s": hand}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
