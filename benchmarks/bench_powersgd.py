"""Does a PowerSGD all-reduce train as well as fp32? Data parallel on local ranks, real text.

Every run is a real torchpp training run (``torchpp.runtime.trainer.train`` on ``--ranks`` gloo
ranks, default 2) of one model from the same seed on the same batches (UTF-8 bytes of the vim
manual on this machine; ``--model small3``: qwen3-small cut to 3 layers, 6 x 64 tokens a step, the
model and batch of the plan the planner chose on the emulated 3-Pi cluster; ``tiny``: qwen3-tiny,
8 x 64). The plan: one stage on a group of ``--ranks`` whose sync is fp32 or
``{"kind": "powersgd", "rank": r}``, or with ``--tied`` a pipeline of ``--ranks`` stages whose
tied-weight all-reduce is. ``start`` is torch's ``start_powerSGD_iter`` (plain all-reduces before the
first compressed one; the runtime's is 2, the smallest torch allows with error feedback; others are
set inside the ranks here). The optimizer is AdamW (``torchpp.train``'s default) or, for contrast,
SGD with momentum 0.9 (the PowerSGD paper's), which ``torchpp.train`` does not offer (also set in
the ranks). Links play no part: PowerSGD changes the arithmetic, not only the bytes, so loss at
equal tokens is what is measured (the mean of the last ``--window`` steps, against the fp32 run of
the same optimizer and seed; with ``--seeds`` each run is repeated per training seed and the summary
gives each seed's gap and their mean and standard error: one seed's gap of 1-2% can be noise).

Outputs in ``--out``: ``results.json`` (every step's loss, the settings), ``summary.csv`` and
``loss_vs_step.png``.

    python benchmarks/bench_powersgd.py [--steps 250] [--runs adamw_fp32,adamw_r4_s2,...]
    python benchmarks/bench_powersgd.py --quick --out /tmp/q   # qwen3-tiny, 3 steps of fp32 and rank 4: checks that it runs
    python benchmarks/bench_powersgd.py --ranks 3 --runs adamw_fp32,adamw_r16_s2,adamw_r32_s2 --out .../dp3
    python benchmarks/bench_powersgd.py --ranks 4 --global-batch 8 --seeds 0,1,2 --runs adamw_fp32,adamw_r32_s2,... --out .../dp4
    python benchmarks/bench_powersgd.py --ranks 3 --tied --runs adamw_fp32,adamw_r8_s2,adamw_r16_s2 --out .../tied3
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_wire import _smooth, _text, mean_and_error  # noqa: E402

MODELS = {  # the cluster's planned DP plan's model and batch (bench_wire_cluster.PP); bench_wire's DP runs'
    "small3": dict(model="qwen3-small", layers=3, global_batch=6, seq_len=64),
    "tiny": dict(model="qwen3-tiny", layers=4, global_batch=8, seq_len=64),
}

RUNS = {  # name: optimizer, lr, PowerSGD rank (0: fp32 all-reduce), plain all-reduces before it
    "adamw_fp32": ("adamw", 1e-3, 0, 0),
    "adamw_r4_s2": ("adamw", 1e-3, 4, 2),
    "adamw_r4_s25": ("adamw", 1e-3, 4, 25),
    "adamw_r8_s2": ("adamw", 1e-3, 8, 2),
    "adamw_r16_s2": ("adamw", 1e-3, 16, 2),
    "adamw_r32_s2": ("adamw", 1e-3, 32, 2),
    "adamw_r48_s2": ("adamw", 1e-3, 48, 2),
    "adamw_r64_s2": ("adamw", 1e-3, 64, 2),
    "sgdm_fp32": ("sgdm", 0.1, 0, 0),
    "sgdm_r4_s2": ("sgdm", 0.1, 4, 2),
}


def _plan(tmp: Path, m: dict, rank: int, ranks: int, tied: bool) -> Path:
    """Data parallel over ``ranks`` with a PowerSGD group sync of ``rank`` (0: fp32); ``tied``: a pipeline of
    ``ranks`` stages instead (3 micro-batches), its tied-weight all-reduce in PowerSGD of ``rank``."""
    from torchpp.formats import Sync
    from torchpp.models.presets import load_config, model_info
    from torchpp.planner.simple import make_plan

    info = model_info(load_config(m["model"], num_layers=m["layers"]), m["model"])
    sync = Sync(kind="powersgd", rank=rank) if rank else None
    if tied:
        cuts = [round(i * m["layers"] / ranks) for i in range(ranks + 1)]
        p = make_plan(info, seq_len=m["seq_len"], global_batch=m["global_batch"], num_microbatches=3,
                      layer_ranges=list(zip(cuts, cuts[1:])), group_sizes=[1] * ranks, schedule="1f1b")
        p.tied_sync = sync
    else:
        p = make_plan(info, seq_len=m["seq_len"], global_batch=m["global_batch"], num_microbatches=1,
                      layer_ranges=[(0, m["layers"])], group_sizes=[ranks], schedule="1f1b")
        p.stages[0].sync = sync
    path = tmp / f"{'pp' if tied else 'dp'}{ranks}_r{rank}.json"
    p.save(path)
    return path


def _run_rank(rank: int, world: int, case: dict) -> None:
    import torch

    from torchpp.runtime import trainer, wire_links

    if case["optimizer"] == "sgdm":
        def sgdm(name, params, lr, weight_decay, *a, **k):
            return torch.optim.SGD(list(params), lr=lr, momentum=0.9, weight_decay=weight_decay)
        trainer.make_optimizer = sgdm
    start = case["start"]
    if start:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
        init = P.PowerSGDState.__init__

        def state(self, *a, **k):
            init(self, *a, **{**k, "start_powerSGD_iter": start})
        P.PowerSGDState.__init__ = state
    s = trainer.train(trainer.TrainConfig(**case["config"]))
    if rank == 0:
        Path(case["result"]).write_text(json.dumps({"losses": s.losses, "step_times_s": s.step_times_s}))
    del wire_links


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--model", default="small3", choices=list(MODELS),
                    help="small3: qwen3-small cut to 3 layers, 6 x 64 tokens a step; tiny: qwen3-tiny, 8 x 64")
    ap.add_argument("--warmup", type=int, default=20, help="learning-rate warm-up steps")
    ap.add_argument("--ranks", type=int, default=2, help="the data-parallel group's size (--tied: the stages)")
    ap.add_argument("--tied", action="store_true",
                    help="a pipeline of --ranks stages whose tied-weight all-reduce is the run's sync instead")
    ap.add_argument("--global-batch", type=int, default=None,
                    help="samples per step (default the model's: 6 for small3, 8 for tiny); a multiple of --ranks")
    ap.add_argument("--seeds", default="0", help="comma-separated training seeds; each run once per seed")
    ap.add_argument("--window", type=int, default=25, help="steps averaged at the end")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    ap.add_argument("--text", default=None, help="a text file (default: the vim manual, else tests/data/corpus.txt)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_wire" / "powersgd_adamw"))
    ap.add_argument("--quick", action="store_true",
                    help="qwen3-tiny, 3 steps of adamw_fp32 and adamw_r4_s2 on the test corpus: checks that it runs")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.warmup, args.window, args.runs = "tiny", 3, 1, 1, "adamw_fp32,adamw_r4_s2"
    bad = [x for x in args.runs.split(",") if x not in RUNS]
    if bad:
        raise SystemExit(f"--runs: expected names from {','.join(RUNS)}, got {bad[0]!r}")
    from torchpp.runtime.launch import RankPool

    m = dict(MODELS[args.model])
    if args.global_batch is not None:
        m["global_batch"] = args.global_batch
    if not args.tied and m["global_batch"] % args.ranks:
        raise SystemExit(f"--global-batch: expected a multiple of --ranks ({args.ranks}), got {m['global_batch']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench_powersgd_"))
    text = _text(args.text, args.quick, tmp)
    old = out / "results.json"
    results = json.loads(old.read_text())["runs"] if old.exists() else {}
    seeds = [int(x) for x in args.seeds.split(",")]
    with RankPool(args.ranks, threads=1) as pool:
        for seed in seeds:
            for name in args.runs.split(","):
                opt, lr, rank, start = RUNS[name]
                key = _key(name, seed)
                res = tmp / f"{key}.json"
                cfg = dict(plan=_plan(tmp, m, rank, args.ranks, args.tied), layers=m["layers"], steps=args.steps,
                           data=str(text), tokenizer="bytes", lr=lr, warmup_steps=args.warmup, seed=seed, threads=1,
                           timeout_s=120.0)
                case = {"config": cfg, "result": str(res), "optimizer": opt, "start": start if rank else 0}
                pool.run(_run_rank, case, world=args.ranks, timeout_s=3000, pg_timeout_s=120)
                r = json.loads(res.read_text())
                r.update(run=name, seed=seed, optimizer=opt, lr=lr, rank=rank, start=start if rank else None)
                results[key] = r
                print(f"{key}: last-{args.window} mean loss {sum(r['losses'][-args.window:]) / args.window:.4f}",
                      flush=True)
    rows = _rows(results, args.window)
    (out / "results.json").write_text(json.dumps({"settings": vars(args) | {"text": str(text), **m},
                                                  "runs": results}, indent=1))
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    _plot(results, out, args.window, m, args.ranks, args.tied)
    for row in rows:
        print(row)
    return 0


def _key(name: str, seed: int) -> str:
    """A run's key in results.json: its name for seed 0 (as before seeds), ``name@seedN`` otherwise."""
    return name if seed == 0 else f"{name}@seed{seed}"


def _rows(results: dict, window: int) -> list[dict]:
    """One row per run: its loss against the fp32 run of the same optimizer and seed, per seed and as
    mean ± standard error over the seeds (one seed's gap alone is within the noise of reordered sums)."""
    def last(r: dict) -> float:
        return sum(r["losses"][-window:]) / window

    gaps: dict[str, dict[int, float]] = {}
    meta: dict[str, dict] = {}
    for key, r in results.items():
        name, seed = r.get("run", key.split("@")[0]), r.get("seed", 0)
        base = results.get(_key(f"{r['optimizer']}_fp32", seed))
        if base is not None:
            gaps.setdefault(name, {})[seed] = 100 * (last(r) / last(base) - 1)
        meta.setdefault(name, r)
    rows = []
    for name, by_seed in gaps.items():
        r, vals = meta[name], [by_seed[k] for k in sorted(by_seed)]
        mean, se = mean_and_error(vals)
        rows.append({"run": name, "optimizer": r["optimizer"], "lr": r["lr"], "powersgd_rank": r["rank"] or "",
                     "start_powerSGD_iter": r["start"] or "", "seeds": " ".join(map(str, sorted(by_seed))),
                     "vs_fp32_by_seed": " ".join(f"{v:+.2f}%" for v in vals),
                     "vs_fp32_mean": f"{mean:+.2f}%", "standard_error": "" if se is None else f"{se:.2f}%"})
    return rows


def _plot(results: dict, out: Path, window: int, m: dict, ranks: int, tied: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, opt in zip(axes, ("adamw", "sgdm")):
        if not any(r["optimizer"] == opt for r in results.values()):
            ax.set_visible(False)
        for name, r in results.items():
            if r["optimizer"] == opt and r.get("seed", 0) == 0:
                ax.plot(range(1, len(r["losses"]) + 1), _smooth(r["losses"], window), label=name)
        ax.set(xlabel=f"step ({m['global_batch']} x {m['seq_len']} tokens each)", ylabel=f"training loss ({window}-step mean)",
               title={"adamw": "AdamW lr 1e-3", "sgdm": "SGD momentum 0.9, lr 0.1"}[opt])
        if ax.lines:
            ax.legend()
    fig.suptitle(f"{m['model']} ({m['layers']} layers), " + (f"a pipeline of {ranks} stages, the tied-weight sync"
                 if tied else f"data parallel over {ranks} ranks"))
    fig.tight_layout()
    fig.savefig(out / "loss_vs_step.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
