"""`torchpp demo`: the whole loop on an embedded default, one command.

profile each host → capacities → bandwidth probe → calibrate memory → plan (pricing every
baseline at its own best micro-batching) → the best single device, confirmed by a real run
where the planner says it does not fit → train the even 1F1B split and the plan with traces →
analyse → replan → train again, then a table of each baseline, the plan, the re-plan and the
lower bound, measured next to predicted, and one line on why the plan looks as it does.

The default scenario is ``homelab`` (configs/cluster/homelab.json: an old laptop and three
Raspberry Pis, and the qwen3-homelab model that none of them can train alone); ``--scenario
hetero4`` is the earlier one (qwen3-small, which fits the laptop); ``--scenario slowlink`` puts
homelab's devices on 10-20 Mbit/s Wi-Fi (configs/cluster/slowlink.json) and plans twice from the
same measurements, fp32 everywhere and with ``--allow-lossy``, trains both and puts them side by
side: bytes on the wire, loss and speed-up (instead of the even split and the re-plan). On a
machine that allows network namespaces and cgroups the hosts are the emulated cluster; otherwise
they are local processes on this machine, and the demo says so. Every step is a ``torchpp`` command reading and
writing files under ``--out``; each command line and its output is kept in ``--out/logs``, so
any step can be re-run alone.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Protocol, Sequence

if TYPE_CHECKING:
    from .formats import Plan

PY = sys.executable


@dataclass(kw_only=True)
class DemoConfig:
    """Sizes of the demo; ``quick`` shrinks them for a smoke run."""

    model: str = "qwen3-homelab"
    seq_len: int = 32
    profile_batches: str = "1,4,8"
    """Batch sizes each host is profiled at: spanning the micro-batch sizes the planner may pick,
    so a call's time is interpolated, not extrapolated."""
    profile_iters: int = 6
    """Profiled steps per batch size: a small host's pass times vary with where it falls in its CPU
    quota's periods, so the means need more than a few steps."""
    global_batch: int = 32
    steps: int = 6
    """Optimizer steps per training run; the first is warm-up and not counted."""
    memory_samples: int = 8
    memory_zb_samples: int | None = None
    """Memory spans run in a ZB-H1 stage's order (``calibrate-memory --zb-samples``); None: a
    quarter of ``memory_samples``, at least 5."""
    data: str = "synthetic"
    """What the training runs read: ``synthetic`` tokens, or a corpus prepared by ``torchpp data
    prepare``. Profiles time synthetic tokens either way (a call's time does not depend on the
    token values), so a corpus changes what is learnt, not the plan."""
    cluster: str = "configs/cluster/homelab.json"
    local_hosts: int = 2
    timeout_s: float = 900.0
    compare: str = "even,pp,dp,single"
    """Baselines the planner prices next to its plan, each at its own best micro-batching."""
    call_probe_steps: int | None = None
    """Steps of each profile's call probe (``torchpp profile --call-probe-steps``); None: the
    profile's default (64, whose mean holds on a small CPU quota)."""
    speed_check: bool = False
    """Before each training run, every host times its profiled layers again (``torchpp speed-check``,
    all hosts at once as profiled) and the run is also predicted at the speed the hosts have then
    (``predicted_now_s``). Needs ``capacity_layers``: the check re-runs those few layers."""
    capacity_layers: int | None = 2
    """Profile the whole model on the first host only and this many layers on every host (for
    their speeds): hosts that cannot hold the model cannot profile it either. None: every host
    profiles the whole model."""
    speed_rounds: int = 3
    """With ``capacity_layers``: rounds of speed profiles, all hosts at once in each, whose median
    gives each host's capacity (``torchpp capacities`` with ``--inputs`` per round). The first
    host's speed divides every capacity, and one profile of it under a passing load moved them all
    by ~20%; three rounds outvote one. Round 2 is the first host's whole-model profile with the
    others repeating theirs; each further round is one more step of ~40 s."""
    lossy: str | None = None
    """Lossy choices (``torchpp plan --allow-lossy``, e.g. ``bf16,int8``): the demo plans a second time
    from the same measurements with these allowed and trains that plan beside the fp32 one, in place
    of the even split and the re-plan. None: every plan fp32, as without the option."""

    @staticmethod
    def quick() -> "DemoConfig":
        return DemoConfig(model="qwen3-tiny", seq_len=32, profile_batches="1,2,8", profile_iters=3, global_batch=8,
                          steps=3, memory_samples=4, capacity_layers=None)

    @staticmethod
    def smoke() -> "DemoConfig":
        """The benchmarks' quick modes: :meth:`quick`'s model and batch with the fewest measurements
        that still run every step of the loop (one timed step per profiled size, a call probe of three
        steps, three memory spans and one in a ZB-H1 stage's order, each a fresh process, two training
        steps): a check that it runs, no measurement."""
        return dataclasses.replace(DemoConfig.quick(), profile_batches="1,8", profile_iters=1, steps=2,
                                   memory_samples=3, memory_zb_samples=1, call_probe_steps=3)

    @staticmethod
    def scenario(name: str) -> "DemoConfig":
        """``homelab``: a model no single host can train (the default); ``hetero4``: qwen3-small,
        which one laptop trains fastest, on four unevenly fast hosts; ``slowlink``: homelab's model
        and devices on 10-20 Mbit/s Wi-Fi, planned fp32 and with bf16 and int8 allowed on links and
        group all-reduces (not DiLoCo or PowerSGD, which change the optimisation itself rather than
        round what crosses a link; the model is untied, so no tied-weight sync is chosen)."""
        if name not in SCENARIOS:
            raise ValueError(f"--scenario: expected one of {', '.join(SCENARIOS)}, got {name!r}")
        if name == "hetero4":
            return DemoConfig(model="qwen3-small", seq_len=64, profile_batches="1,4,16", global_batch=16,
                              capacity_layers=None, cluster="configs/cluster/hetero4.json")
        if name == "slowlink":
            return DemoConfig(cluster="configs/cluster/slowlink.json", lossy="bf16,int8")
        return DemoConfig()


SCENARIOS = ("homelab", "hetero4", "slowlink")


@dataclass
class Progress:
    """Numbered steps with elapsed time; each command's output is kept in a log file."""

    total: int
    log_dir: Path
    done: int = 0
    t0: float = field(default_factory=time.monotonic)

    def run(self, title: str, cmd: Sequence[str], timeout: float = 900, allow_failure: bool = False) -> str:
        self.done += 1
        tag = f"[{self.done:2d}/{self.total}]"
        print(f"{tag} {title} ...", flush=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        slug = "".join(c if c.isalnum() else "_" for c in title.lower())[:40].strip("_")
        log = self.log_dir / f"{self.done:02d}_{slug}.log"
        t = time.monotonic()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        with open(log, "w") as f:
            f.write("$ " + shlex.join(cmd) + "\n")
            f.flush()
            try:
                proc = subprocess.run(list(cmd), stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = 124
        text = log.read_text(errors="replace")
        if rc != 0 and not allow_failure:
            tail = "\n".join(text.splitlines()[-20:])
            raise DemoError(f"{tag} {title} failed (exit {rc}); full log in {log}:\n{tail}")
        print(f"{tag} {title}: {time.monotonic() - t:.1f}s (total {time.monotonic() - self.t0:.0f}s)", flush=True)
        return text

    @staticmethod
    def note(text: str) -> None:
        for line in text.splitlines():
            print(f"        {line}", flush=True)


class DemoError(RuntimeError):
    """A step of the demo failed; the message names the step and shows its log's tail."""


def cluster_available() -> str | None:
    """None when this machine can host the emulated cluster, else why not (said to the user)."""
    from .cluster import cgroups, system

    try:
        system.require_caps("the emulated cluster", system.CAP_SYS_ADMIN, system.CAP_NET_ADMIN)
        system.tool("ip")
        system.tool("tc")
        cgroups.detect()
    except Exception as e:  # noqa: BLE001 - any reason is reported, none is fatal
        return str(e)
    return None


# ----------------------------------------------------------------------------- where the hosts are
class Hosts(Protocol):
    """Where the loop's commands run: once per host (profile, probe) or once per plan rank (train)."""

    names: list[str]
    mode: str

    def each_host(self, shell: str, log_dir: Path) -> list[str]: ...

    def probe(self, argv: list[str], log_dir: Path) -> list[str]: ...

    def ranks(self, plan: Path, argv: list[str], log_dir: Path) -> list[str]: ...

    def devices(self) -> dict[str, dict]: ...


LOCAL_RANKS = [PY, "-m", "torchpp.runtime.local_cli", "--nproc-per-node"]
"""The command that starts a local run's ranks, the count after it (see :mod:`torchpp.runtime.local_cli`)."""


class LocalHosts:
    """Local processes on this machine, one per "host", each with one thread."""

    mode = "local processes"

    def __init__(self, n: int):
        self.names = [f"local{i}" for i in range(n)]

    def each_host(self, shell: str, log_dir: Path) -> list[str]:
        # one after the other, so each host is measured without the others competing for the cores
        loop = "; ".join(f"HOST={h} RANK=0 WORLD_SIZE=1 sh -c {shlex.quote(shell)} || exit 1" for h in self.names)
        return ["sh", "-c", loop]

    # Ranks start as `torchrun --standalone` starts them, without its agent (an interpreter that imports
    # torch, seconds of CPU per run): `python -m torchpp.runtime.local_cli`
    def probe(self, argv: list[str], log_dir: Path) -> list[str]:
        return [*LOCAL_RANKS, str(len(self.names)), "--host-prefix", "local", "--", *argv]

    def ranks(self, plan: Path, argv: list[str], log_dir: Path) -> list[str]:
        from .formats import Plan

        return [*LOCAL_RANKS, str(Plan.load(plan).world_size), "--", PY, *argv]

    def devices(self) -> dict[str, dict]:
        import psutil

        gb = psutil.virtual_memory().total / 2**30 / len(self.names)
        return {h: {"memory_gb": round(gb, 2)} for h in self.names}


class ClusterHosts:
    """The emulated cluster: each host a network namespace with its own CPU, memory and links."""

    mode = "emulated cluster"

    def __init__(self, config: Path):
        from .cluster.config import ClusterConfig

        self.config = config
        self.cfg = ClusterConfig.load(config)
        self.names = [h.name for h in self.cfg.hosts]
        self.mode = f"emulated cluster {self.cfg.name}"

    def _run(self, log_dir: Path, argv: list[str], plan: Path | None = None) -> list[str]:
        """`torchpp cluster run`: one process per host, or one per plan rank on its host."""
        head = [PY, "-m", "torchpp", "cluster", "run", "-c", str(self.config), "-q", "--logs", str(log_dir)]
        return head + (["--plan", str(plan)] if plan else []) + ["--", *argv]

    def each_host(self, shell: str, log_dir: Path) -> list[str]:
        return self._run(log_dir, ["sh", "-c", shell])

    def probe(self, argv: list[str], log_dir: Path) -> list[str]:
        return self._run(log_dir, [PY, *argv[1:]])

    def ranks(self, plan: Path, argv: list[str], log_dir: Path) -> list[str]:
        return self._run(log_dir, [PY, *argv], plan)

    def devices(self) -> dict[str, dict]:
        out = {}
        for h in self.cfg.hosts:
            out[h.name] = {"memory_gb": round((h.memory or 2**33) / 2**30, 3)}
        return out


# ----------------------------------------------------------------------------- the loop
@dataclass
class Measured:
    """The files the loop's measuring steps wrote and the plan made from them."""

    files: list[Path]
    capacities: Path
    bandwidth: Path
    memory: Path
    devices: Path
    plan: Path


def price_fixed(path: Path, m: Measured) -> None:
    """Give a fixed-strategy plan the planner's prediction (step time, per-device memory) from
    the same measurements as the searched plan, so analyze compares its memory too."""
    from .formats import Plan
    from .planner import api

    plan = Plan.load(path)
    costs = api.load(api.PlanInputs(layers=list(m.files), capacities=m.capacities, bandwidth=m.bandwidth,
                                    devices=m.devices, memory_model=m.memory))
    plan.predicted = api.predict_plan(plan, costs)
    plan.save(path)


@dataclass
class RunResult:
    name: str
    plan: str
    measured_step_s: float
    predicted_step_s: float | None
    steps_s: list[float]
    report: str
    trace_dir: str
    memory_mib: list[dict] = field(default_factory=list)
    """Per rank with a prediction: predicted and measured peak MiB of its stage, and the error."""
    predicted_now_s: float | None = None
    """The prediction at the speed each host had just before the run (its speed check), if checked."""
    speed_now: dict[str, float] = field(default_factory=dict)
    """Each host's speed check just before the run: measured / profiled seconds per layer."""
    loss: float | None = None
    """The training loss of the run's last step (rank 0's metrics.jsonl)."""
    wire_bytes: int | None = None
    """Bytes the ranks put on the wire in the last traced step (``wire_bytes_per_step``)."""
    cpu_steal: dict | None = None
    """The analysis' ``cpu_steal``: per host, the cores other guests of a virtual machine took during
    the traced steps (``torchpp.trace.cpu_steal``)."""
    compute_split: dict | None = None
    """The analysis' ``compute_split``: the critical path's compute measured against predicted, and the
    error left with it as measured (``torchpp.trace.report.compute_split``)."""

    @property
    def error(self) -> float | None:
        if self.predicted_step_s is None:
            return None
        return (self.predicted_step_s - self.measured_step_s) / self.measured_step_s

    @property
    def error_now(self) -> float | None:
        if self.predicted_now_s is None:
            return None
        return (self.predicted_now_s - self.measured_step_s) / self.measured_step_s

    @property
    def windows(self) -> list[float]:
        """Medians of three consecutive windows of the measured steps (fewer with fewer steps)."""
        return window_medians(self.steps_s)

    @property
    def spread(self) -> float:
        """(slowest - fastest window) / the median step: how much the measurement itself moves."""
        w = self.windows
        return (max(w) - min(w)) / self.measured_step_s if len(w) > 1 else 0.0

    @property
    def stolen_cores(self) -> float | None:
        """The most any host's machine lost to steal on average over the traced steps."""
        hosts = (self.cpu_steal or {}).get("hosts") or {}
        return max((v["cores"] for v in hosts.values()), default=None)

    @property
    def memory_error(self) -> float | None:
        """The worst rank's relative error of predicted against measured peak memory."""
        return max((x["error"] for x in self.memory_mib), key=abs, default=None)


def predicted_step(simulate_output: str) -> float | None:
    """The step time ``torchpp simulate plan`` printed."""
    return next((float(x.split()[3]) for x in simulate_output.splitlines() if x.startswith("predicted step time")),
                None)


def window_medians(steps: Sequence[float], n: int = 3) -> list[float]:
    """Split the steps into ``n`` consecutive windows (as even as possible) and take each one's median."""
    n = max(1, min(n, len(steps)))
    size, extra = divmod(len(steps), n)
    out, a = [], 0
    for i in range(n):
        b = a + size + (1 if i < extra else 0)
        out.append(statistics.median(steps[a:b]))
        a = b
    return out


@dataclass
class Baseline:
    """A strategy the planner priced (at its own best micro-batching) and, where it does not fit,
    what a real run of it did."""

    name: str
    predicted_step_s: float | None
    fits: bool
    memory: str
    """Worst device's predicted memory / budget (host)."""
    note: str = ""
    """What a real run showed, e.g. the kernel's OOM kill."""


def memory_rows(rep: dict[str, Any]) -> list[dict]:
    """Per rank with both, the predicted and measured peak MiB of an analysis (``report.json``)."""
    out = []
    for r, v in sorted((rep.get("memory") or {}).items(), key=lambda kv: int(kv[0])):
        p, q = v.get("predicted_peak_bytes"), v.get("measured_peak_bytes")
        if p and q:
            out.append({"rank": int(r), "predicted": p / 2**20, "measured": q / 2**20, "error": (p - q) / q})
    return out


def last_run_records(log_dir: Path) -> list[dict]:
    """Rank 0's metrics.jsonl records of its last run: the trainer appends, so a resumed or repeated
    run adds to the file."""
    rows = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    starts = [i for i, r in enumerate(rows) if r.get("event") == "start"]
    return rows[starts[-1]:] if starts else rows


def measured_step_times(log_dir: Path) -> list[float]:
    """Rank 0's step times (metrics.jsonl) of its last run, the first step left out as warm-up."""
    rows = last_run_records(log_dir)
    steps = sorted((r["step"], r["step_time_s"]) for r in rows if "step" in r and "step_time_s" in r)
    return [t for s, t in steps if s > 1] or [t for _, t in steps]


def final_loss(log_dir: Path) -> float | None:
    """The training loss of the last run's last step (metrics.jsonl), None if no step logged one."""
    steps = sorted((r["step"], r["loss"]) for r in last_run_records(log_dir) if "step" in r and "loss" in r)
    return float(steps[-1][1]) if steps else None


"""Trace events whose ``bytes`` went on the wire: each p2p send as encoded, each rank's all-reduce payload."""


def wire_bytes_per_step(trace_dir: Path) -> int | None:
    """Bytes every rank put on the wire in the last traced step (the merged timeline): each send of
    activations or gradients as its wire format encoded it, and each rank's all-reduce payload as
    encoded. None where the run wrote no merged timeline."""
    from .trace.analyze import wire_bytes
    from .trace.report import find_timelines

    try:
        _, last = find_timelines(trace_dir)[-1]
    except FileNotFoundError:
        return None
    return wire_bytes([json.loads(last.read_text())])


def run_verdict(run_json: Path, text: str) -> str:
    """One line on how a run that was expected not to fit ended (`cluster run`'s run.json)."""
    ranks = json.loads(run_json.read_text())["hosts"] if run_json.exists() else []
    why = next((r["why"] for r in ranks if r.get("why")), None)
    if why:
        return why
    if ranks and all(r["returncode"] == 0 for r in ranks):
        return "it ran: the planner's memory model is cautious here"
    codes = ", ".join(str(r["returncode"]) for r in ranks) or "?"
    last = next((x for x in reversed(text.splitlines()) if x.strip()), "")
    return f"it failed (exit {codes}) without an OOM kill: {last[:160]}"


MAX_RETAKES = 2
"""Times the demo re-takes speed rounds that disagree before it goes on with the median it has."""


class Demo:
    def __init__(self, cfg: DemoConfig, out: Path, hosts: Hosts):
        self.cfg, self.out, self.hosts = cfg, out, hosts
        self.rounds: list[list[Path]] = []
        """Each speed round's files, in host order, as the capacities were last computed from them."""
        self.consensus: dict[str, Path] | None = None
        """Per host, the profile its speed checks compare against (``consensus_references``)."""
        # profile, capacities, probe, memory, plan, then the even split and the re-plan, or the lossy plan
        fixed = 6 if cfg.lossy else 7
        self.p = Progress(total=fixed + len(self.runs) * self.steps_per_run + len(self.extra_rounds),
                          log_dir=out / "logs")
        self.tp = [PY, "-m", "torchpp"]

    @property
    def runs(self) -> tuple[str, ...]:
        """The training runs, in order: the fp32 plan and the lossy one, or the even split, the plan
        and the re-plan."""
        return ("plan", "lossy") if self.cfg.lossy else ("even", "plan", "replan")

    @property
    def checks_speed(self) -> bool:
        """Whether each run is preceded by a speed check (it re-runs the hosts' few profiled layers)."""
        return self.cfg.speed_check and self.cfg.capacity_layers is not None

    @property
    def extra_rounds(self) -> list[str]:
        """File prefixes of the speed rounds after the profile's two (one step each)."""
        if self.cfg.capacity_layers is None:
            return []
        return [f"again{k}" for k in range(3, self.cfg.speed_rounds + 1)]

    @property
    def steps_per_run(self) -> int:
        """Numbered steps of one training run: predict, train, analyse (and the speed check, priced)."""
        return 5 if self.checks_speed else 3

    def path(self, *parts: str) -> Path:
        return self.out.joinpath(*parts)

    # --- measure
    def profile(self) -> tuple[list[Path], list[list[Path]]]:
        """Layers files for the plan and the rounds of files capacities are computed from. With
        ``capacity_layers``, hosts that cannot hold the whole model are not asked to: the first
        host profiles it all, and every host its first ``capacity_layers`` layers, which give
        each host's speed relative to the first, in ``speed_rounds`` rounds."""
        c, d = self.cfg, self.path("hosts")
        d.mkdir(parents=True, exist_ok=True)
        q = shlex.quote(str(d))
        cmd = (f"{shlex.quote(PY)} -m torchpp profile --model {c.model} --seq-len {c.seq_len} "
               f"--batch {c.profile_batches} --iters {c.profile_iters} --warmup 1 --threads 1 --quiet --host \"$HOST\""
               + self.probe_steps)
        names = self.hosts.names
        if c.capacity_layers is None:
            shell = f"exec {cmd} --out {q}/layers_\"$HOST\".json"
        else:
            # speeds first, every host at once (the ratios under one load); then the first host profiles the
            # whole model while the others repeat theirs, so it sees the contention a training step will
            ref = shlex.quote(names[0])
            speed = f"{cmd} --layers {c.capacity_layers} --out {q}/speed_\"$HOST\".json"
            again = f"{cmd} --layers {c.capacity_layers} --no-call-probe --out {q}/busy_\"$HOST\".json"
            shell = (f"{speed} || exit 1; if [ \"$HOST\" = {ref} ]; then exec {cmd} --out {q}/layers_\"$HOST\".json; "
                     f"else exec {again}; fi")
        argv = self.hosts.each_host(shell, self.path("logs", "profile"))
        what = "" if c.capacity_layers is None else f"; the others their first {c.capacity_layers} layers"
        self.p.run(f"profile {len(names)} hosts ({c.model}, batch {c.profile_batches}{what})", argv)
        for k, prefix in enumerate(self.extra_rounds, start=3):
            self.speed_round(prefix, f"speed round {k} of {c.speed_rounds}")
        if c.capacity_layers is None:
            files = [d / f"layers_{h}.json" for h in names]
            rounds = [files]
        else:
            files = [d / f"layers_{names[0]}.json"]
            rounds = [[d / f"speed_{h}.json" for h in names]]
            if c.speed_rounds >= 2:
                rounds.append([*files, *(d / f"busy_{h}.json" for h in names[1:])])
            rounds += [[d / f"{prefix}_{h}.json" for h in names] for prefix in self.extra_rounds]
        missing = [str(f) for f in {*files, *(f for r in rounds for f in r)} if not f.exists()]
        if missing:
            raise DemoError(f"profile wrote no {', '.join(sorted(missing))}")
        return files, rounds

    @property
    def probe_steps(self) -> str:
        """`` --call-probe-steps N`` where the config sets the call probe's steps, else nothing."""
        n = self.cfg.call_probe_steps
        return "" if n is None else f" --call-probe-steps {n}"

    def speed_round(self, prefix: str, title: str, call_probe: bool = False) -> list[Path]:
        """One more round of speed profiles, every host at once: their first ``capacity_layers`` layers
        (``call_probe``: with the runtime's call probe, as the first round, whose files give each host's
        call overhead and rates)."""
        c, d = self.cfg, self.path("hosts")
        cmd = (f"{shlex.quote(PY)} -m torchpp profile --model {c.model} --seq-len {c.seq_len} "
               f"--batch {c.profile_batches} --iters {c.profile_iters} --warmup 1 --threads 1 --quiet --host \"$HOST\" "
               f"--layers {c.capacity_layers}{self.probe_steps if call_probe else ' --no-call-probe'} "
               f"--out {shlex.quote(str(d))}/{prefix}_\"$HOST\".json")
        self.p.run(f"{title}: {len(self.hosts.names)} hosts at once, their first {c.capacity_layers} layers",
                   self.hosts.each_host(f"exec {cmd}", self.path("logs", prefix)))
        return [d / f"{prefix}_{h}.json" for h in self.hosts.names]

    def settled_capacities(self, rounds: list[list[Path]]) -> Path:
        """Capacities whose rounds agree: a round that ``torchpp capacities`` reports as an outlier
        for some host (farther from the host's median than its profiles' spread explains) is taken
        again, all hosts at once, up to ``MAX_RETAKES`` times; what still disagrees is said."""
        from .formats import Capacities

        out = self.capacities(rounds)
        for n in range(1, MAX_RETAKES + 1):
            cap = Capacities.load(out)
            bad = sorted({o.round for o in cap.outliers})
            if not bad or self.cfg.capacity_layers is None:
                break
            self.p.note("outlier: " + "; ".join(o.line() for o in cap.outliers)
                        + f"; re-taking round(s) {', '.join(str(k + 1) for k in bad)}")
            self.p.total += len(bad) + 1
            for k in bad:
                # round 1 again as it was taken: its files give the call overhead and rates
                rounds[k] = self.speed_round(f"retake{n}_{k + 1}", f"re-take of speed round {k + 1}", call_probe=k == 0)
            out = self.capacities(rounds)
        else:
            left = Capacities.load(out).outliers
            if left:
                self.p.note(f"still outlying after {MAX_RETAKES} re-takes: " + "; ".join(o.line() for o in left))
        self.rounds = rounds
        return out

    def consensus_references(self) -> dict[str, Path]:
        """Per host, the speed profile its launch-time speed check compares against: the one of the
        round whose capacity is the host's median (capacities.json's ``consensus_round``), not round 1,
        which may be the round that went wrong. The reference host's whole-model profile is no speed
        profile (a check would re-run the whole model): among its few-layer rounds, the one in which
        it ran at median speed."""
        from .formats import Capacities, LayersFile
        from .planner.capacities import block_seconds, median_index

        d, names = self.path("hosts"), self.hosts.names
        cap = Capacities.load(self.path("capacities.json"))
        rounds = self.rounds or [[d / f"speed_{h}.json" for h in names]]  # rounds not taken here: round 1's
        out = {}
        for i, h in enumerate(names):
            files = [r[i] for r in rounds]
            layers = [LayersFile.load(f) for f in files]
            few = [k for k, lf in enumerate(layers) if len(lf.layers) == len(layers[0].layers)]
            k = cap.consensus_round.get(h, 0)
            if k not in few:
                shared = set.intersection(*(set(block_seconds(layers[j])) for j in few))
                k = few[median_index([sum(block_seconds(layers[j])[b] for b in shared) for j in few])]
            out[h] = d / f"consensus_{h}.json"
            shutil.copyfile(files[k], out[h])
        return out

    def capacities(self, rounds: list[list[Path]]) -> Path:
        out = self.path("capacities.json")
        text = self.p.run("capacities" + (f" (median of {len(rounds)} rounds)" if len(rounds) > 1 else ""),
                          [*self.tp, "capacities", *(a for r in rounds for a in ("--inputs", *map(str, r))),
                           "--ref-host", self.hosts.names[0], "--out", str(out)])
        self.p.note("\n".join(x for x in text.splitlines() if "capacity" in x))
        if self.cfg.capacity_layers is not None:
            # per-host tables of a few layers do not describe the whole model; keep the speeds, which
            # scale the first host's whole-model profile
            data = json.loads(out.read_text())
            data.pop("tables", None)
            out.write_text(json.dumps(data, indent=1) + "\n")
        return out

    def bandwidth(self) -> Path:
        d = self.path("bandwidth")
        argv = [*self.tp, "bandwidth", "probe", "--out-dir", str(d), "--sizes", "64K,512K", "--repeats", "3",
                "--pair-budget", "4", "--timeout", "120"]
        if isinstance(self.hosts, LocalHosts):  # one machine's loopback: no host interface to find
            argv += ["--fan-seconds", "0"]
        cmd = self.hosts.probe(argv, self.path("logs", "probe"))
        text = self.p.run("bandwidth probe (all pairs, gloo)", cmd)
        self.p.note("\n".join(x.strip() for x in text.splitlines() if "->" in x and "Mbit/s" in x))
        return d / "bandwidth.json"

    def memory(self, ref_layers: Path) -> Path:
        out = self.path("memory_model.json")
        text = self.p.run("calibrate memory (random spans, fresh processes)",
                          [*self.tp, "calibrate-memory", "--layers", str(ref_layers), "--model", self.cfg.model,
                           "--samples", str(self.cfg.memory_samples),
                           # by default two spans with the tail (Kwt) and three without, one at each
                           # of the probes' ZB-H1 positions (Kz; Kw is counted by the probes)
                           "--zb-samples", str(self.zb_samples), "--microbatch",
                           f"{max(1, self.cfg.global_batch // 8)},{max(2, self.cfg.global_batch // 2)}",
                           "--threads", "1",
                           "--out", str(out)])
        self.p.note(text.strip().splitlines()[-1])
        return out

    @property
    def zb_samples(self) -> int:
        """Memory spans in a ZB-H1 stage's order (``DemoConfig.memory_zb_samples``)."""
        c = self.cfg
        return max(5, c.memory_samples // 4) if c.memory_zb_samples is None else c.memory_zb_samples

    # --- plan
    def plan(self, m: Measured, lossy: str | None = None) -> Path:
        """The plan from ``m``'s files (``plan/``, the baselines priced beside it); with ``lossy``, the
        same search with those lossy choices allowed (``plan_lossy/``)."""
        from .planner.certify import MAX_DEVICES

        d = self.path("plan_lossy" if lossy else "plan")
        certify = not lossy and len(self.hosts.names) <= MAX_DEVICES
        title = (f"plan again from the same measurements, --allow-lossy {lossy}" if lossy
                 else "plan (DP over stages, groups, device orders, micro-batching"
                 + ("; how far from the best plan: --certify)" if certify else ")"))
        text = self.p.run(title, [*self.tp, "plan", "--layers", *map(str, m.files), "--capacities", str(m.capacities),
                                  "--bandwidth", str(m.bandwidth), "--memory-model", str(m.memory), "--devices",
                                  str(m.devices), "--global-batch", str(self.cfg.global_batch),
                                  *(("--allow-lossy", lossy) if lossy else ("--compare", self.cfg.compare)),
                                  *(("--certify",) if certify else ()), "--out-dir", str(d)])
        shown = ("plan:", "predicted", "stage ", "    ", "wire formats", "within ")
        self.p.note("\n".join(x for x in text.splitlines() if x.startswith(shown) and "candidate" not in x)[:2000])
        return d / "plan.json"

    def plan_meta(self) -> dict:
        return json.loads(self.path("plan", "plan_meta.json").read_text())

    def certificate(self) -> dict | None:
        """The plan's certificate (plan_meta.json): how far it can be from the best plan of the space
        searched; None where it was not certified."""
        return self.plan_meta().get("certificate")

    def compared(self) -> dict[str, dict]:
        """The planner's comparison rows (plan_meta.json), by name."""
        return {r["name"]: r for r in self.plan_meta().get("compare", [])}

    def even_plan(self, planned: Path, m: Measured | None = None) -> Path:
        """The even 1F1B split over every host, at its own best micro-batching as the planner priced it."""
        from .formats import Plan

        p = Plan.load(planned)
        n = min(len(self.hosts.names), p.model.num_layers)
        mb = self.compared().get("even", {}).get("num_microbatches", p.num_microbatches)
        out = self.path("even", "plan.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        self.p.run(f"even split over {n} hosts, {mb} micro-batches (its best)",
                   [*self.tp, "plan", "--strategy", "pp", "--stages", str(n), "--model",
                    self.cfg.model, "--global-batch", str(self.cfg.global_batch), "--microbatches",
                    str(mb), "--seq-len", str(self.cfg.seq_len), "--hosts",
                    ",".join(self.hosts.names[:n]), "--out", str(out)])
        if m is not None:
            price_fixed(out, m)
        return out

    def baselines(self, m: Measured) -> list[Baseline]:
        """The best single device and data parallelism as the planner priced them; a single device
        that does not fit is run for real on its host, to show the memory limit stop it."""
        rows = self.compared()
        out = []
        for name in ("single", "dp"):
            r = rows.get(name)
            if r is None:
                continue
            b = Baseline(name=f"{name} ({r['hosts'][0]})" if name == "single" else name,
                         predicted_step_s=None if r["oom"] else r["step_time_s"], fits=not r["oom"], memory=r["memory"])
            if name == "single" and r["oom"] and isinstance(self.hosts, ClusterHosts):
                b.note = self.confirm_does_not_fit(r["hosts"][0], r["num_microbatches"])
            out.append(b)
        return out

    def confirm_does_not_fit(self, host: str, microbatches: int) -> str:
        """Train the whole model on ``host`` for two steps; return what stopped it (one line)."""
        c, plan = self.cfg, self.path("single", "plan.json")
        plan.parent.mkdir(parents=True, exist_ok=True)
        self.p.total += 2
        self.p.note(f"2 more steps: the planner says {host} alone does not fit, so a real run confirms it")
        self.p.run(f"single device ({host}): the whole model", [
            *self.tp, "plan", "--strategy", "dp", "--devices", "1", "--hosts", host, "--model", c.model,
            "--global-batch", str(c.global_batch), "--microbatches", str(microbatches), "--seq-len", str(c.seq_len),
            "--out", str(plan)])
        argv = ["-m", "torchpp.train", "--plan", str(plan), "--model", c.model, "--data", c.data, "--steps", "2",
                "--threads", "1", "--seed", "0", "--timeout-s", "120", "--no-output"]
        text = self.p.run(f"single device ({host}): train it (the planner says it does not fit)",
                          self.hosts.ranks(plan, argv, self.path("single", "hosts")), timeout=300, allow_failure=True)
        self.p.note(ran := run_verdict(self.path("single", "hosts", "run.json"), text))
        return ran

    # --- run and look
    def train(self, name: str, plan: Path, m: Measured) -> RunResult:
        c, d = self.cfg, self.path("runs", name)
        shutil.rmtree(d, ignore_errors=True)  # an earlier demo's logs and traces must not mix into this run's
        d.mkdir(parents=True, exist_ok=True)
        pred = d / "predicted.json"
        price = [*self.tp, "simulate", "plan", str(plan), "--bandwidth", str(m.bandwidth), "--layers",
                 *map(str, m.files), "--capacities", str(m.capacities), "--comm", "links"]
        text = self.p.run(f"{name}: predict (simulate the plan's action lists)", [*price, "--trace", str(pred)])
        predicted = predicted_step(text)
        checks = self.speed_check(d / "speed") if self.checks_speed else []
        predicted_now, speed_now = None, {}
        if checks:
            from .formats import speed_ratios

            speed_now = speed_ratios(checks)
            text = self.p.run(f"{name}: predict at the hosts' speed now",
                              [*price, "--speed-check", *map(str, checks), "--trace", str(d / "predicted_now.json")])
            predicted_now = predicted_step(text)
            self.p.note(next(x for x in text.splitlines() if x.startswith("speed check")))
        traces, logs = d / "traces", d / "logs"
        trace_steps = ",".join(str(s) for s in range(2, c.steps + 1))
        argv = ["-m", "torchpp.train", "--plan", str(plan), "--model", c.model, "--data", c.data, "--steps",
                str(c.steps), "--threads", "1", "--seed", "0", "--trace-dir", str(traces), "--trace-steps",
                trace_steps, "--log-dir", str(logs), "--timeout-s", "300", "--no-output"]
        self.p.run(f"{name}: train {c.steps} steps with traces", self.hosts.ranks(plan, argv, d / "hosts"),
                   timeout=c.timeout_s)
        steps = measured_step_times(logs)
        report = d / "report"
        text = self.p.run(f"{name}: analyse the timelines",
                          [*self.tp, "analyze", str(traces), "--plan", str(plan), "--predicted", str(pred), "--out",
                           str(report)])
        self.p.note("\n".join([x for x in text.splitlines() if not x.startswith("$")][:2]))
        rep = json.loads((report / "report.json").read_text()) if (report / "report.json").exists() else {}
        return RunResult(name=name, plan=str(plan), measured_step_s=statistics.median(steps),
                         predicted_step_s=predicted, steps_s=steps, report=str(report / "report.md"),
                         trace_dir=str(traces), memory_mib=memory_rows(rep),
                         predicted_now_s=predicted_now, speed_now=speed_now, loss=final_loss(logs),
                         wire_bytes=wire_bytes_per_step(traces), cpu_steal=rep.get("cpu_steal"),
                         compute_split=rep.get("compute_split"))

    def speed_check(self, d: Path) -> list[Path]:
        """Every host times its profiled layers again, all at once (as their speed files were taken),
        against its consensus round's profile (``consensus_references``)."""
        d.mkdir(parents=True, exist_ok=True)
        hosts, q = self.path("hosts"), shlex.quote
        if self.consensus is None:
            self.consensus = self.consensus_references()
        shell = (f"exec {q(PY)} -m torchpp speed-check --reference {q(str(hosts))}/consensus_\"$HOST\".json "
                 f"--out {q(str(d))}/speed_check_\"$HOST\".json --quiet")
        self.p.run(f"speed check of {len(self.hosts.names)} hosts (their profiled layers again)",
                   self.hosts.each_host(shell, d / "logs"))
        return [d / f"speed_check_{h}.json" for h in self.hosts.names]

    def replan(self, res: RunResult, m: Measured) -> Path:
        d = self.path("replan")
        text = self.p.run("replan from the measured timelines",
                          [*self.tp, "replan", "--plan", res.plan, "--traces", res.trace_dir, "--layers",
                           *map(str, m.files), "--capacities", str(m.capacities), "--bandwidth", str(m.bandwidth),
                           "--memory-model", str(m.memory), "--devices", str(m.devices), "--out-dir", str(d)])
        summary = d / "replan_summary.txt"
        self.p.note("\n".join((summary.read_text() if summary.exists() else text).splitlines()[:40]))
        return d / "plan.json"

    def measure_and_plan(self) -> Measured:
        """The loop's first half: every host measured, then the plan."""
        c = self.cfg
        data = "synthetic tokens" if c.data == "synthetic" else f"corpus {c.data}"
        print(f"torchpp demo: {c.model} on {data}, seq {c.seq_len}, global batch {c.global_batch}, on {self.hosts.mode} "
              f"({', '.join(self.hosts.names)}); outputs in {self.out}", flush=True)
        files, rounds = self.profile()
        cap = self.settled_capacities(rounds)
        bw = self.bandwidth()
        mem = self.memory(files[0])
        devices = self.path("devices.json")
        devices.write_text(json.dumps(self.hosts.devices(), indent=1) + "\n")
        m = Measured(files=files, capacities=cap, bandwidth=bw, memory=mem, devices=devices, plan=Path())
        m.plan = self.plan(m)
        return m

    def main(self) -> dict:
        m = self.measure_and_plan()
        base = self.baselines(m)
        if self.cfg.lossy:
            lossy = self.plan(m, self.cfg.lossy)
            return self.summarise([self.train("plan", m.plan, m), self.train("lossy", lossy, m)], base)
        even = self.even_plan(m.plan, m)
        results = [self.train("even", even, m), self.train("plan", m.plan, m)]
        replanned = self.replan(results[1], m)
        results.append(self.train("replan", replanned, m))
        return self.summarise(results, base)

    def summarise(self, results: list[RunResult], baselines: Sequence[Baseline] = ()) -> dict:
        from .formats import Plan

        plan = Plan.load(next(r.plan for r in results if r.name == "plan"))
        second = (f"- lossy plan summary {self.path('plan_lossy', 'summary.txt')}" if self.cfg.lossy
                  else f"- replan summary {self.path('replan', 'replan_summary.txt')}")
        cert = self.certificate()
        text = "\n".join(summary_lines(self.cfg, self.hosts.mode, self.hosts.names, results, baselines, plan, cert)
                         + ["", "files:"] + [f"- {r.name}: plan {r.plan}, report {r.report}, timelines {r.trace_dir}"
                                             for r in results]
                         + [f"- plan summary {self.path('plan', 'summary.txt')}, Gantt {self.path('plan', 'gantt.png')}",
                            second, f"- every command and its output: {self.p.log_dir}"])
        self.path("summary.md").write_text(text + "\n")
        summary = {"format": "torchpp.demo/1", "mode": self.hosts.mode, "hosts": self.hosts.names,
                   "config": asdict(self.cfg), "runs": [{**asdict(r), "error": r.error, "error_now": r.error_now,
                                                         "memory_error": r.memory_error,
                                                         "stolen_cores": r.stolen_cores,
                                                         "windows_s": r.windows, "spread": r.spread} for r in results],
                   "baselines": [asdict(b) for b in baselines],
                   "lower_bound_s": (plan.predicted or {}).get("lower_bound_s"), "certificate": cert,
                   "seconds": time.monotonic() - self.p.t0}
        wire = wire_comparison(results)
        if wire is not None:
            summary["wire"] = {"allow_lossy": self.cfg.lossy, **wire}
        self.path("summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        print("\n" + text, flush=True)
        print(f"\ndone in {summary['seconds']:.0f}s; open the timelines in https://ui.perfetto.dev or "
              "chrome://tracing", flush=True)
        return summary


def summary_lines(cfg: DemoConfig, mode: str, hosts: Sequence[str], results: Sequence[RunResult],
                  baselines: Sequence[Baseline], plan: "Plan", certificate: dict | None = None) -> list[str]:
    """The closing table: each baseline, the plan, the re-plan (or the lossy plan, then the two side by
    side: ``wire_lines``), the bound proven for the planner's space (``certificate``, plan_meta's) and
    the lower bound, then why."""
    ref = next(r.measured_step_s for r in results if r.name == "plan")
    now = any(r.predicted_now_s is not None for r in results)
    at, dash = (" at launch (error) |", " – |") if now else ("", "")
    lines = [f"# torchpp demo ({mode}: {', '.join(hosts)})", "",
             f"{cfg.model}, seq {cfg.seq_len}, global batch {cfg.global_batch}; measured = median of rank 0's step "
             f"times after the first ({cfg.steps - 1} steps), spread = (slowest - fastest of 3 windows) / median; "
             "every strategy at its own best micro-batching", "",
             "| run | micro-batches | measured step (s) | spread | predicted (s) | error |" + at + " step / plan's | "
             "peak memory error (worst rank) |", "|---|---|---|---|---|---|" + "---|" * bool(now) + "---|---|"]
    for b in baselines:
        pred = f"{b.predicted_step_s:.3f}" if b.predicted_step_s is not None else "does not fit"
        meas = b.note or ("not run" if b.fits else "does not fit")
        vs = f"{b.predicted_step_s / ref:.2f}x (predicted)" if b.predicted_step_s else "–"
        lines.append(f"| {b.name} | – | {meas} | – | {pred} | – |{dash} {vs} | {b.memory} |")
    for r in results:
        p = _plan_of(r)
        pred = f"{r.predicted_step_s:.3f}" if r.predicted_step_s is not None else "–"
        err = f"{100 * r.error:+.1f}%" if r.error is not None else "–"
        me = r.memory_error
        mem = f"{100 * me:+.1f}% ({len(r.memory_mib)} rank(s))" if me is not None else "–"
        cell = (f" {r.predicted_now_s:.3f} ({100 * r.error_now:+.1f}%) |" if r.predicted_now_s is not None else dash)
        lines.append(f"| {r.name} | {p.num_microbatches} x {p.micro_batch_size} | {r.measured_step_s:.3f} | "
                     f"{100 * r.spread:.0f}% | {pred} | {err} |{cell} {r.measured_step_s / ref:.2f}x | {mem} |")
    if certificate:
        lines.append(f"| best plan of the planner's space, proven at least | – | – | – | {certificate['bound_s']:.3f} "
                     f"| – |{dash} {certificate['bound_s'] / ref:.2f}x | – |")
    bound = (plan.predicted or {}).get("lower_bound_s")
    if bound:
        lines.append(f"| lower bound (all work incl. the optimizer over all capacity) | – | – | – | {bound:.3f} | – |"
                     f"{dash} {bound / ref:.2f}x | – |")
    wire = wire_comparison(results)
    out = lines + (wire_lines(cfg, wire) if wire is not None else []) + ["", "why: " + why_line(plan, baselines)]
    if certificate:
        space = ("the space it searched (every split, device group, order, micro-batching and schedule kind under "
                 "each host's memory)")
        if certificate["gap"] <= 0:
            out.append(f"certificate: the plan's predicted {certificate['step_s']:.3f} s is the best of {space}: "
                       f"every other plan was priced or proven no faster (`torchpp plan --certify`)")
        else:
            out.append(f"certificate: the plan's predicted {certificate['step_s']:.3f} s is within "
                       f"{100 * certificate['gap']:.1f}% of the best plan of {space}, whose step is proven at least "
                       f"{certificate['bound_s']:.3f} s (`torchpp plan --certify`)")
    verdict = replan_line(results)
    if verdict:
        out.append(verdict)
    gap = (plan.predicted or {}).get("gap_to_bound")
    if gap:
        from .planner.gap import Gap

        out.append("above the bound (predicted; each part taken out of the same replay in turn): "
                   + Gap(**gap).line())
    if now:
        out.append("at launch: predicted at the speed each host's `torchpp speed-check` read just before the run ("
                   + "; ".join(f"{r.name}: " + ", ".join(f"{h} x{x:.2f}" for h, x in r.speed_now.items())
                               for r in results if r.speed_now) + ")")
    for extra in (compute_speed_line(results), steal_line(results)):
        if extra:
            out.append(extra)
    return out


def compute_speed_line(results: Sequence[RunResult]) -> str | None:
    """Each run's error apart from its hosts' speed: where a machine's speed moves from run to run,
    a prediction misses by that whatever the model does; what is left is the model's."""
    runs = [(r.name, r.compute_split) for r in results if r.compute_split]
    if not runs:
        return None
    return ("apart from the hosts' speed (each run priced with its critical path's compute as measured): "
            + "; ".join(f"{n} {100 * c['step_error']:+.1f}% (compute {c['ratio']:.2f}x its prediction)" for n, c in runs))


def steal_line(results: Sequence[RunResult]) -> str | None:
    """How much CPU other guests of a virtual machine took during each run (None where no trace said):
    a run that lost a few percent of the machine measures slower than any prediction."""
    from .trace import cpu_steal as cs

    runs = [(r, r.stolen_cores, max(v["cpus"] for v in r.cpu_steal["hosts"].values()))
            for r in results if r.stolen_cores is not None]
    if not runs:
        return None
    said = "; ".join(f"{r.name} {cs.describe(c, n)}" + (" (slower for it)" if cs.slowed(c, n) else "")
                     for r, c, n in runs)
    return f"steal (CPU other guests of a virtual machine took during the traced steps, worst host): {said}"


def replan_line(results: Sequence[RunResult]) -> str | None:
    """Whether the re-plan paid off, measured, beside what it predicted (``replan_summary.json``
    beside its plan.json): a re-plan slower than the plan it replaced is said, not left to the table."""
    by = {r.name: r for r in results}
    if "replan" not in by or "plan" not in by:
        return None
    new, old = by["replan"], by["plan"]
    change = new.measured_step_s / old.measured_step_s - 1
    gain, choice = None, ""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        s = json.loads((Path(new.plan).parent / "replan_summary.json").read_text())
        gain, choice = s["predicted_gain"], s.get("plan_choice") or ""
    if choice.startswith("plan kept"):
        return (f"re-plan: {choice}; the same plan measured {new.measured_step_s:.3f} s against "
                f"{old.measured_step_s:.3f} s ({100 * change:+.1f}%: the runs' own noise; their step spread "
                f"{100 * old.spread:.0f}% and {100 * new.spread:.0f}%)")
    said = ("slower than the plan it replaced: its corrected costs misjudged the new layout (per host in "
            "replan_summary.txt)" if change > 0 else "faster than the plan it replaced")
    return (f"re-plan: measured {new.measured_step_s:.3f} s against the plan's {old.measured_step_s:.3f} s "
            f"({100 * change:+.1f}%), {said}"
            + (f"; it predicted {100 * gain:+.1f}% throughput" if gain is not None else "")
            + f"; the two runs' step spread {100 * old.spread:.0f}% and {100 * new.spread:.0f}%")


def _plan_of(r: RunResult) -> "Plan":
    from .formats import Plan

    return Plan.load(r.plan)


LOSS_TOLERANCE = {"bf16": 0.01, "fp16": 0.01, "int8": 0.02, "powersgd": 0.02, "diloco": 0.02}
"""How far a lossy plan's loss may be from fp32's at equal steps (bf16 wire within 1%, int8 within
2%, DiLoCo within 2%); a plan is held to its lossiest choice's."""
EXACT_TOLERANCE = 1e-4
"""A plan with no lossy choice (fp32 everywhere, or the tied weight's exact ``rows`` sync) trains the
fp32 plan's arithmetic: its loss equals fp32's up to the order of float sums."""


def lossy_kinds(plan: "Plan") -> set[str]:
    """The lossy formats and sync kinds ``plan`` uses (empty: fp32 everywhere, exact)."""
    kinds = {s.wire for s in plan.stages if s.wire not in (None, "fp32")}
    for sync in [*(s.sync for s in plan.stages), plan.tied_sync]:
        if sync is not None and sync.lossy:
            kinds.add(sync.kind if sync.kind in ("powersgd", "diloco") else sync.wire)
    return kinds


def wire_choices(plan: "Plan") -> list[str]:
    """What ``plan`` sends other than fp32 every step, by host: each link's format, each group's sync
    and the tied weight's (the plan's ``stages[i].wire``, ``stages[i].sync``, ``tied_sync``)."""
    hosts = {s.index: "+".join(d.host for d in s.devices) for s in plan.stages}
    plain = ("allreduce", "fp32")
    out = [f"{hosts[s.index]}→{hosts[s.index + 1]} {s.wire}" for s in plan.stages if s.wire not in (None, "fp32")]
    out += [f"{hosts[s.index]} all-reduce: {s.sync.kind} {s.sync.wire}" for s in plan.stages
            if s.sync is not None and (s.sync.kind, s.sync.wire) != plain]
    t = plan.tied_sync
    if t is not None and (t.kind, t.wire) != plain:
        out.append("tied weight: the touched rows (exact)" if t.kind == "rows" else f"tied weight: {t.kind} {t.wire}")
    return out


def wire_comparison(results: Sequence[RunResult]) -> dict | None:
    """The fp32 plan (run ``plan``) against the one planned with lossy choices allowed (run ``lossy``):
    speed-up measured and predicted, bytes on the wire, loss against the tolerance of its lossiest
    choice. None where the demo trained no lossy plan."""
    base = next((r for r in results if r.name == "plan"), None)
    lossy = next((r for r in results if r.name == "lossy"), None)
    if base is None or lossy is None:
        return None
    plan = _plan_of(lossy)
    kinds = lossy_kinds(plan)
    tol = max((LOSS_TOLERANCE[k] for k in kinds), default=EXACT_TOLERANCE)
    diff = lossy.loss / base.loss - 1 if lossy.loss is not None and base.loss else None
    pred = (base.predicted_step_s / lossy.predicted_step_s
            if base.predicted_step_s is not None and lossy.predicted_step_s else None)
    return {"wire_choices": wire_choices(plan), "lossy": sorted(kinds),
            "speedup": base.measured_step_s / lossy.measured_step_s, "predicted_speedup": pred,
            "loss_vs_fp32": diff, "loss_tolerance": tol, "loss_within": None if diff is None else abs(diff) <= tol,
            "fewer_bytes": base.wire_bytes / lossy.wire_bytes if base.wire_bytes and lossy.wire_bytes else None,
            "rows": {r.name: {"wire_choices": wire_choices(_plan_of(r)), "wire_bytes": r.wire_bytes, "loss": r.loss,
                              "predicted_step_s": r.predicted_step_s, "measured_step_s": r.measured_step_s}
                     for r in (base, lossy)}}


def _megabytes(n: int | None) -> str:
    return "–" if n is None else f"{n / 1e6:.2f} MB"


def wire_lines(cfg: DemoConfig, wire: dict) -> list[str]:
    """The fp32 plan and the lossy one side by side (``wire_comparison``): which links use which
    format, bytes on the wire, loss after the same steps and the speed-up."""
    base, lossy = wire["rows"]["plan"], wire["rows"]["lossy"]
    lines = ["", f"slow links: the fp32 plan beside the one planned from the same measurements with --allow-lossy "
             f"{cfg.lossy}, both trained {cfg.steps} steps on the same data and seed; bytes on the wire = what every "
             "rank sent in a traced step (each send as its format encodes it, each rank's all-reduce payload)", "",
             f"| run | wire (plan's choices) | bytes on the wire / step | loss after {cfg.steps} steps | vs fp32 | "
             "predicted step (s) | measured step (s) | speed-up (predicted) |", "|---|---|---|---|---|---|---|---|"]
    for name, r in (("plan", base), ("lossy", lossy)):
        loss = "–" if r["loss"] is None else f"{r['loss']:.4f}"
        pred = "–" if r["predicted_step_s"] is None else f"{r['predicted_step_s']:.3f}"
        vs, up = "–", "1.00x"
        if name == "lossy":
            d, tol = wire["loss_vs_fp32"], wire["loss_tolerance"]
            within = "within" if wire["loss_within"] else "outside"
            vs = "–" if d is None else f"{100 * d:+.2f}% ({within} {100 * tol:g}%)"
            p = wire["predicted_speedup"]
            up = f"{wire['speedup']:.2f}x" + (f" ({p:.2f}x)" if p is not None else "")
        lines.append(f"| {name} | {', '.join(r['wire_choices']) or 'fp32 everywhere'} | "
                     f"{_megabytes(r['wire_bytes'])} | {loss} | {vs} | {pred} | {r['measured_step_s']:.3f} | {up} |")
    return lines


def why_line(plan: "Plan", baselines: Sequence[Baseline]) -> str:
    """One sentence on why the plan looks as it does, read off the plan and the baselines."""
    single = next((b for b in baselines if b.name.startswith("single")), None)
    stages = "; ".join(f"{'+'.join(d.host for d in s.devices)} layers [{s.layers[0]},{s.layers[1]})"
                       + (" + embedding" if s.has_embed else "") + (" + lm_head" if s.has_tail else "")
                       for s in plan.stages)
    bub = (plan.predicted or {}).get("bubble", {})
    step = (plan.predicted or {}).get("step_time_s")
    share = bub.get("real", 0.0) / step if bub and step else None
    head = (f"no single host can hold the model with AdamW ({single.memory}), so it is split; "
            if single is not None and not single.fits else "")
    if plan.num_stages == 1 and len(plan.stages[0].devices) == 1:
        return head + f"one device ({stages}) is fastest: splitting would cost more in links than it gains"
    tail = f"; {plan.num_microbatches} micro-batches of {plan.micro_batch_size} keep the pipeline full"
    if share is not None:
        tail += f" (predicted idle {100 * share:.0f}% of the step)"
    return head + f"{plan.num_stages} stage(s) sized to each host's measured speed and memory: {stages}" + tail


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("out/demo"), help="where every file goes (default out/demo)")
    p.add_argument("--local", action="store_true", help="local processes even where the emulated cluster is possible")
    p.add_argument("--scenario", choices=SCENARIOS, default="homelab",
                   help="homelab (default): a model no single host can train; hetero4: qwen3-small, which fits one "
                   "host; slowlink: homelab's devices on 10-20 Mbit/s Wi-Fi, the fp32 plan beside the one planned "
                   "with --allow-lossy bf16,int8")
    p.add_argument("--cluster", type=Path, default=None, help="cluster config (default: the scenario's)")
    p.add_argument("--hosts", type=int, default=DemoConfig.local_hosts, help="local processes (default 2)")
    p.add_argument("--model", default=None, help=f"preset (default {DemoConfig.model})")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 6)")
    p.add_argument("--quick", action="store_true", help="a small, fast run (tiny model, 3 steps)")
    p.add_argument("--data", default=None,
                   help="a corpus prepared by `torchpp data prepare` for the training runs (default synthetic tokens; "
                   "profiles time synthetic tokens either way)")
    p.add_argument("--speed-check", action=argparse.BooleanOptionalAction, default=None,
                   help="time every host's profiled layers again before each run and predict the run at that speed "
                   "too (`torchpp speed-check`; off by default: it adds about two minutes to the homelab scenario)")
    p.add_argument("--speed-rounds", type=int, default=None,
                   help=f"rounds of speed profiles whose median gives each host's capacity (default "
                   f"{DemoConfig.speed_rounds}; homelab: each round past two adds about 40 s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .errors import UsageError

    base = DemoConfig.scenario(args.scenario)
    cfg = dataclasses.replace(DemoConfig.quick(), cluster=base.cluster, lossy=base.lossy) if args.quick else base
    if args.model:
        cfg.model = args.model
    if args.steps is not None:
        if args.steps < 2:
            raise UsageError(f"--steps: expected at least 2 (the first is warm-up), got {args.steps}")
        cfg.steps = args.steps
    if args.data is not None:
        cfg.data = check_corpus(args.data, cfg.model)
    if args.hosts < 1:
        raise UsageError(f"--hosts: expected at least 1, got {args.hosts}")
    if args.cluster is not None:
        cfg.cluster = str(args.cluster)
    if args.speed_check is not None:
        if args.speed_check and cfg.capacity_layers is None:
            raise UsageError("--speed-check: needs a scenario whose hosts profile a few layers for their speed "
                             "(homelab); this one profiles the whole model on every host")
        cfg.speed_check = args.speed_check
    if args.speed_rounds is not None:
        if args.speed_rounds < 1:
            raise UsageError(f"--speed-rounds: expected at least 1, got {args.speed_rounds}")
        cfg.speed_rounds = args.speed_rounds
    # a terminated demo still takes its cluster down: SIGTERM unwinds through demo_hosts' finally
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        with demo_hosts(cfg, args.out, args.local, args.hosts) as demo:
            demo.main()
    except DemoError as e:
        print(f"torchpp demo: error: {e}", file=sys.stderr)
        return 1
    return 0


def check_corpus(data: str, model: str) -> str:
    """A prepared corpus the demo's model can read, checked before any host starts: ranks on an
    emulated host see this machine's files, so an absolute path reaches them all."""
    from .data import DataError, resolve_data
    from .data.corpus import is_corpus
    from .errors import UsageError
    from .models.presets import load_config

    if data == "synthetic":
        return data
    if not is_corpus(data):
        raise UsageError(f"--data: {data}: expected a corpus prepared by `torchpp data prepare` (a folder with "
                         "index.json and tokens.bin) or 'synthetic'")
    try:
        resolve_data(data, flag="--data", tokenizer=None, model=model, model_vocab=int(load_config(model).vocab_size))
    except DataError as e:
        raise UsageError(str(e)) from None
    return str(Path(data).resolve())


@contextlib.contextmanager
def demo_hosts(cfg: DemoConfig, out: Path, local: bool, local_hosts: int, extra_steps: int = 0) -> Iterator[Demo]:
    """A :class:`Demo` on the emulated cluster (brought up here and always taken down) where the
    machine allows it and ``local`` is not asked for, else on local processes, said plainly."""
    why = "--local was given" if local else cluster_available()
    if why is not None:
        print(f"torchpp demo: not using the emulated cluster ({why}); the hosts are {local_hosts} local processes "
              "on this machine, which share its cores, so their speeds and links are this machine's", flush=True)
        if cfg.lossy:
            print("torchpp demo: so the links are not shaped to the scenario's rates either: the plan with "
                  f"--allow-lossy {cfg.lossy} compresses only what this machine's links make worth it", flush=True)
        demo = Demo(cfg, out, LocalHosts(local_hosts))
        demo.p.total += extra_steps
        yield demo
        return
    from .cluster import tc

    hosts = ClusterHosts(Path(cfg.cluster))
    up = [PY, "-m", "torchpp", "cluster", "up", "-c", cfg.cluster]
    if hosts.cfg.needs_netem and not tc.netem_available():
        print("torchpp demo: this kernel has no netem qdisc, so the cluster's link delays are left out; "
              "its link rates, CPU quotas and memory limits apply", flush=True)
        up.append("--skip-netem")
    demo = Demo(cfg, out, hosts)
    demo.p.total += 2 + extra_steps
    demo.p.run(f"cluster up ({hosts.cfg.name}: {len(hosts.names)} namespaces, cgroups, tc)", up)
    try:
        yield demo
    finally:
        demo.p.run(f"cluster down ({hosts.cfg.name})", [PY, "-m", "torchpp", "cluster", "down", "-c", cfg.cluster])
