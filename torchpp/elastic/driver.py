"""Lose a device, keep training: run the ranks of a plan, and when one fails or stalls, re-plan
over the hosts still alive and resume from the newest complete checkpoint.

Why not torchrun's agent alone: `torch.distributed.elastic` restarts the *same* workers (the same
command, ``--nproc-per-node`` fixed per node) and, with ``--nnodes=MIN:MAX``, lets the world
shrink by whole nodes, but every worker keeps the arguments it was started with. A torchpp rank
is a place in a plan (its layers, its group, its share of each micro-batch), so a smaller world
needs a new plan first, and the planner needs the measured costs of exactly the hosts left. The
driver therefore does what the agent cannot (choose the hosts, plan, pass the new plan) and
leaves to each rank what torch already does: rendezvous on ``MASTER_ADDR`` (env://), a bounded
timeout in every collective (the rank names the peer it lost), and per-attempt store keys
(``TORCHELASTIC_RESTART_COUNT``, which the driver sets to the attempt number as the agent would).
Checkpoints are keyed by HF parameter names, so the new split loads the old one's files.

One attempt: start every rank (locally, or in the hosts of an emulated cluster), watch their exit
codes and per-step heartbeats; on a failure stop the survivors (SIGTERM, then SIGKILL: checkpoints
are atomic, nothing half-written is ever loaded), re-plan, and start again with ``--resume``. A
host that appears in ``--hosts-file`` is planned in once the next checkpoint is complete. Every
decision is appended to ``decisions.jsonl``, which the ranks copy into metrics.jsonl,
TensorBoard and their traces' metadata.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from ..runtime import checkpoint as ckpt
from ..runtime.elastic_hooks import read_heartbeats
from .errors import ElasticError

Progress = Callable[[str], None]


@dataclass(kw_only=True)
class ElasticConfig:
    """What the driver needs besides the ranks' own arguments."""

    plan: Path
    """The first plan."""
    train_args: list[str]
    """Arguments of `torchpp.train` other than --plan, --checkpoint-dir, --resume (steps, lr, seed, …)."""
    checkpoint_dir: Path
    work_dir: Path
    """Plans of each attempt, decisions.jsonl, heartbeats and the ranks' logs."""
    layers: list[Path] = field(default_factory=list)
    """Measured layers files (re-planning needs them; without them a failure ends the run)."""
    devices: Path | None = None
    bandwidth: Path | None = None
    capacities: Path | None = None
    memory_model: Path | None = None
    hosts_file: Path | None = None
    """Hosts allowed in the run (JSON list or one name a line), re-read while running."""
    timeout_s: float = 60.0
    """A rank without a step for this long (after its first) is stalled; also the ranks' --timeout-s."""
    startup_s: float = 300.0
    """Time a fresh attempt may take to its first step."""
    max_restarts: int = 3
    elastic: bool = True
    """False: one attempt, its exit code is the result (no re-planning)."""
    schedule: str | None = None
    """The schedule kinds a re-plan searches (as `torchpp plan --schedule`); default: those the first
    plan's search allowed (its ``plan_meta.json``), else every kind."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.startup_s <= 0:
            raise ValueError(f"--timeout-s/--startup-s: expected seconds > 0, got {self.timeout_s}/{self.startup_s}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts: expected >= 0, got {self.max_restarts}")
        if self.schedule is not None:
            from ..formats import parse_kinds as schedule_kinds

            schedule_kinds(self.schedule)  # ValueError naming the kinds
        if self.elastic and not (self.layers and self.devices and self.bandwidth):
            raise ValueError("--elastic: re-planning needs --layers, --devices and --bandwidth (the measurements "
                             "the plan was made from)")


@dataclass
class Worker:
    rank: int
    host: str
    proc: subprocess.Popen
    log: Path


class Launcher(Protocol):
    def start(self, plan: Path, argv: list[str], log_dir: Path, attempt: int) -> list[Worker]: ...

    def stop(self, workers: list[Worker], grace_s: float) -> None: ...


@dataclass
class Outcome:
    """How an attempt ended: ``done``, ``failure`` (``failed`` hosts) or ``join`` (``joined`` hosts)."""

    kind: str
    failed: list[str] = field(default_factory=list)
    how: dict[str, str] = field(default_factory=dict)
    joined: list[str] = field(default_factory=list)
    detected_at: float = 0.0
    """time.time() when the driver saw it."""
    last_step: int = 0


@dataclass
class Attempt:
    """One attempt's record, for the summary and the benchmark."""

    index: int
    plan: str
    hosts: list[str]
    world_size: int
    resume_step: int
    started_at: float
    outcome: str = ""
    failed: list[str] = field(default_factory=list)
    detected_at: float | None = None
    stopped_at: float | None = None
    replan_s: float | None = None


@dataclass
class ElasticResult:
    attempts: list[Attempt]
    decisions: Path
    exit_code: int


# ----------------------------------------------------------------------------- launchers
def _train_cmd(plan: Path, argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "torchpp.train", "--plan", str(plan), *argv]


class LocalLauncher:
    """Every rank a process on this machine, as torchrun starts them on one node (env://)."""

    def __init__(self, env: dict[str, str] | None = None):
        self.env = dict(os.environ if env is None else env)

    def start(self, plan: Path, argv: list[str], log_dir: Path, attempt: int) -> list[Worker]:
        from ..formats import Plan
        from ..runtime.launch import free_port, torchrun_env

        p = Plan.load(plan)
        port, out = free_port(), []
        log_dir.mkdir(parents=True, exist_ok=True)
        for r in range(p.world_size):
            host = p.device_of_rank(r).host
            env = {**self.env, **torchrun_env(r, p.world_size, port), "HOST": host, "TORCHPP_HOST": host,
                   "TORCHELASTIC_RESTART_COUNT": str(attempt)}
            log = log_dir / f"{host}.rank{r}.log"
            with open(log, "wb") as f:
                proc = subprocess.Popen(_train_cmd(plan, argv), env=env, stdout=f, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            out.append(Worker(r, host, proc, log))
        return out

    def stop(self, workers: list[Worker], grace_s: float) -> None:
        _stop_procs([w.proc for w in workers], grace_s)


class ClusterLauncher:
    """Every rank in its host's namespace and cgroup of an emulated cluster (`torchpp cluster up`)."""

    def __init__(self, name: str):
        from ..cluster import cluster

        state = cluster.load_state(name)
        if state is None or state.get("phase") != "up":
            raise ElasticError(f"cluster '{name}' is not up")
        self.state = state
        self.fill = contextlib.ExitStack()

    def start(self, plan: Path, argv: list[str], log_dir: Path, attempt: int) -> list[Worker]:
        from ..cluster import cgroups, cluster, netns
        from ..formats import Plan

        places = cluster.plan_placements(self.state, Plan.load(plan), str(plan))
        master = next(p.host_index for p in places if p.rank == 0)
        hier = cgroups.detect()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.fill.close()  # steady_cpu: the attempt's hosts have their idle time filled until stop()
        self.fill.enter_context(cluster.idle_filled(self.state, [p.host_index for p in places], hier))
        out = []
        for p in places:
            h = self.state["hosts"][p.host_index]
            env = {**cluster.placement_env(self.state, p, master), "TORCHELASTIC_RESTART_COUNT": str(attempt)}
            log = log_dir / f"{p.label}.log"
            with open(log, "wb") as f:
                proc = subprocess.Popen(netns.exec_argv(h["netns"], _train_cmd(plan, argv)), env=env, stdout=f,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=cluster.host_preexec(h, hier))
            out.append(Worker(p.rank, p.host, proc, log))
        return out

    def stop(self, workers: list[Worker], grace_s: float) -> None:
        _stop_procs([w.proc for w in workers], grace_s)
        self.fill.close()


def _stop_procs(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM each process group (a stopped one is continued so it can die), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for p in procs:
            if p.poll() is None:
                for s in (sig, signal.SIGCONT):
                    try:
                        os.killpg(p.pid, s)
                    except (ProcessLookupError, PermissionError):
                        pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.02)
    for p in procs:
        try:
            p.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass


# ----------------------------------------------------------------------------- watching one attempt
def _is_stopped(proc: subprocess.Popen) -> bool:
    """A process frozen by SIGSTOP (how a stalled host is emulated) or a whole stopped session."""
    try:
        import psutil

        return psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED
    except Exception:  # noqa: BLE001 (gone, or no psutil)
        return False


def _last_error_line(log: Path) -> str:
    """A rank's own error line from its log (the last line that says ``error``, else the last line)."""
    try:
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return f"exited with code 2 (no log at {log})"
    errors = [x for x in lines if "error" in x.lower()]
    return (errors or lines or [f"exited with code 2 ({log} is empty)"])[-1].strip()


class ConfigurationError(ElasticError):
    """A rank exited 2 (a bad argument, plan or file): the run stops with that rank's line."""


def _exit_how(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exited with code {code}"


class Watch:
    """Polls one attempt: exit codes, heartbeats, the hosts file and new complete checkpoints."""

    PEER_ERROR = 1
    """torchpp.train's exit code when a peer failed (the rank itself is fine)."""
    CONFIG_ERROR = 2
    """torchpp.train's exit code for a bad argument, plan or file: no host is at fault and another
    attempt would fail alike, so the run stops with the rank's own line."""

    def __init__(self, cfg: ElasticConfig, workers: list[Worker], hb_dir: Path, hosts_now: list[str],
                 allowed: Callable[[], list[str] | None]):
        self.cfg, self.workers, self.hb_dir, self.allowed = cfg, workers, hb_dir, allowed
        self.hosts_now = set(hosts_now)
        self.t_start = time.monotonic()
        self.last_progress = (time.monotonic(), -1)
        self.first_peer_error: float | None = None
        self.join_after: int | None = None
        self.joined: list[str] = []

    def poll(self) -> Outcome | None:
        codes = {w.rank: w.proc.poll() for w in self.workers}
        steps = {r: s for r, (s, _) in read_heartbeats(self.hb_dir).items()}
        last = max(steps.values(), default=-1)
        # -1 (``startup_s`` applies) until every rank has set up and written its first heartbeat
        progress = sum(steps.values()) if len(steps) >= len(self.workers) else -1
        if progress > self.last_progress[1]:
            self.last_progress = (time.monotonic(), progress)
        if all(c == 0 for c in codes.values()):
            return Outcome("done", detected_at=time.time(), last_step=last)
        config = [w for w in self.workers if codes[w.rank] == self.CONFIG_ERROR]
        if config:
            w = config[0]
            return Outcome("config", how={w.host: _last_error_line(w.log)}, detected_at=time.time(), last_step=last)
        failed = self._failed(codes)
        if failed:
            return Outcome("failure", failed=sorted(failed), how=failed, detected_at=time.time(), last_step=last)
        return self._join(last)

    def _failed(self, codes: dict[int, int | None]) -> dict[str, str]:
        """Hosts to blame: a rank killed or failing on its own; a frozen rank once the run is stuck;
        the ranks still running 3 s after another gave up on a peer (ranks time out on a silent
        peer within --timeout-s, so the one still waiting is the silent one); all running ranks
        when nothing moved for twice the limit."""
        now = time.monotonic()
        out = {w.host: _exit_how(codes[w.rank]) for w in self.workers
               if codes[w.rank] not in (None, 0, self.PEER_ERROR)}
        if out:
            return out
        if self.first_peer_error is None and any(c == self.PEER_ERROR for c in codes.values()):
            self.first_peer_error = now
        quiet = now - self.last_progress[0]
        limit = self.cfg.timeout_s if self.last_progress[1] >= 0 else self.cfg.startup_s
        running = [w for w in self.workers if codes[w.rank] is None]
        if quiet > limit or self.first_peer_error is not None:
            out = {w.host: "stalled (process stopped)" for w in running if _is_stopped(w.proc)}
        if not out and ((self.first_peer_error is not None and now - self.first_peer_error > 3.0) or quiet > 2 * limit):
            out = {w.host: f"no step for {quiet:.0f} s" for w in running}
            if not out:
                out = {w.host: "every rank lost a peer" for w in self.workers}
        return out

    def _join(self, last_step: int) -> Outcome | None:
        """A host newly allowed by the hosts file joins once the next checkpoint is complete."""
        allowed = self.allowed()
        if allowed is None or not self.cfg.elastic:
            return None
        new = sorted(set(allowed) - self.hosts_now)
        if new and self.join_after is None:
            self.join_after, self.joined = ckpt.latest_local(self.cfg.checkpoint_dir), new
        if self.join_after is not None and ckpt.latest_local(self.cfg.checkpoint_dir) > self.join_after:
            return Outcome("join", joined=self.joined, detected_at=time.time(), last_step=last_step)
        return None


# ----------------------------------------------------------------------------- the driver
class Driver:
    """Attempts until the ranks finish, a failure cannot be planned around, or restarts run out."""

    def __init__(self, cfg: ElasticConfig, launcher: Launcher, progress: Progress | None = None):
        from ..formats import Plan

        self.cfg, self.launcher, self.say = cfg, launcher, progress or (lambda _: None)
        cfg.work_dir.mkdir(parents=True, exist_ok=True)
        self.decisions = cfg.work_dir / "decisions.jsonl"
        self.decisions.write_text("")
        self.plan_path, self.plan = cfg.plan, Plan.load(cfg.plan)
        self.failed: set[str] = set()
        self.hosts_mtime = self._hosts_mtime()
        self.attempts: list[Attempt] = []

    def decide(self, kind: str, **record: Any) -> None:
        rec = {"kind": kind, "time": time.time(), "attempt": len(self.attempts) - 1, **record}
        with open(self.decisions, "a") as f:
            f.write(json.dumps(rec) + "\n")
        self.say(f"elastic: {kind}: " + ", ".join(f"{k} {v}" for k, v in record.items()))

    def _hosts_mtime(self) -> float:
        f = self.cfg.hosts_file
        return f.stat().st_mtime if f is not None and f.is_file() else 0.0

    def allowed(self) -> list[str] | None:
        """Hosts the hosts file allows now, less those that failed since it was last written."""
        from .survivors import read_hosts_file

        hosts = read_hosts_file(self.cfg.hosts_file)
        if hosts is None:
            return None
        if self._hosts_mtime() > self.hosts_mtime:  # rewritten: a failed host listed again has come back
            self.failed.clear()
            self.hosts_mtime = self._hosts_mtime()
        return [h for h in hosts if h not in self.failed]

    def run(self) -> ElasticResult:
        while True:
            outcome = self._attempt()
            if outcome.kind == "done":
                return ElasticResult(self.attempts, self.decisions, 0)
            if outcome.kind == "config":
                line = next(iter(outcome.how.values()))
                self.decide("stop", reason=line)
                raise ConfigurationError(line)
            if not self.cfg.elastic:
                return ElasticResult(self.attempts, self.decisions, 1)
            if len(self.attempts) > self.cfg.max_restarts:
                raise ElasticError(f"gave up after {self.cfg.max_restarts} restart(s); see {self.decisions}")
            self._replan(outcome)

    def _attempt(self) -> Outcome:
        n = len(self.attempts)
        resume = max(0, ckpt.latest_local(self.cfg.checkpoint_dir))
        hosts = sorted({d.host for s in self.plan.stages for d in s.devices})
        att = Attempt(n, str(self.plan_path), hosts, self.plan.world_size, resume, time.time())
        self.attempts.append(att)
        if n > 0:
            self.decide("resume", step=resume, world_size=self.plan.world_size, plan=str(self.plan_path))
        hb = self.cfg.work_dir / f"attempt{n}" / "heartbeat"
        argv = [*self.cfg.train_args, "--checkpoint-dir", str(self.cfg.checkpoint_dir), "--resume",
                "--timeout-s", str(self.cfg.timeout_s), "--heartbeat-dir", str(hb), "--elastic-log", str(self.decisions)]
        workers = self.launcher.start(self.plan_path, argv, self.cfg.work_dir / f"attempt{n}" / "logs", n)
        watch = Watch(self.cfg, workers, hb, hosts, self.allowed)
        try:
            while (outcome := watch.poll()) is None:
                time.sleep(0.05)
        finally:
            if any(w.proc.poll() is None for w in workers):
                self.launcher.stop(workers, grace_s=2.0)
        att.outcome, att.failed, att.detected_at, att.stopped_at = (outcome.kind, outcome.failed,
                                                                    outcome.detected_at, time.time())
        if outcome.kind == "failure":
            self.failed |= set(outcome.failed)
            self.decide("failure", hosts=outcome.failed, how=outcome.how, last_step=outcome.last_step,
                        ranks=[w.rank for w in workers if w.host in outcome.failed])
        elif outcome.kind == "join":
            self.decide("join", hosts=outcome.joined, at_step=ckpt.latest_local(self.cfg.checkpoint_dir))
        return outcome

    def _replan(self, outcome: Outcome) -> None:
        from .survivors import plan_survivors

        allowed = self.allowed()
        pool = allowed if allowed is not None else _device_hosts(self.cfg.devices)
        hosts = [h for h in pool if h not in self.failed]
        t0 = time.perf_counter()
        try:
            new = plan_survivors(self.cfg, self.plan, hosts, self.cfg.work_dir / f"attempt{len(self.attempts)}" / "plan")
        except ElasticError as e:
            self.decide("stop", reason=str(e))
            raise
        self.attempts[-1].replan_s = time.perf_counter() - t0
        self.plan_path, self.plan = new.plan_path, new.plan
        self.decide("plan", world_size=new.plan.world_size, hosts=new.hosts, plan=str(new.plan_path),
                    stages=new.plan.num_stages, predicted_step_s=round(new.predicted_step_s, 6),
                    replan_s=round(new.seconds, 3))


def _device_hosts(devices: Path | None) -> list[str]:
    from ..formats import read_json

    return list(read_json(devices)) if devices is not None else []


def attempt_records(result: ElasticResult) -> list[dict[str, Any]]:
    return [asdict(a) for a in result.attempts]
