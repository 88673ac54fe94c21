"""An emulated cluster on one machine: each host a network namespace, cgroup and shaped link.

```
            namespace torchpp-<name>-sw
   ┌──────────────── bridge br0 ────────────────┐
   h0 (downlink shaping)   h1 ...               hN-1
   │ veth                  │                    │
 eth0 (uplink shaping)   eth0                 eth0      <- one namespace per host,
 torchpp-<name>-<host0>  ...                             address <subnet>.i+1
```

Nothing is added to the caller's namespace: the bridge lives in its own namespace and every
link is created inside its target namespace. ``up`` records what it is about to create in a
state file *before* creating it, so ``down`` removes everything after a failed ``up`` or a
killed command; ``down`` also finds leftovers by their ``torchpp-<name>-`` prefix when the
state file itself is gone.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..formats import FormatError, Plan, read_json, write_json
from . import cgroups, netns, runtime_cache, tc
from .config import HOST_DEV, ClusterConfig
from .system import CAP_NET_ADMIN, CAP_SYS_ADMIN, PREFIX, STATE_DIR, require_caps

BRIDGE = "br0"


class ClusterError(RuntimeError):
    """A cluster operation cannot proceed (already up, not up, ...)."""


def state_path(name: str) -> Path:
    return STATE_DIR / f"cluster-{name}.json"


def load_state(name: str) -> dict[str, Any] | None:
    p = state_path(name)
    return read_json(p) if p.exists() else None


def _save_state(state: dict[str, Any]) -> None:
    write_json(state_path(state["name"]), state)


def _require(action: str) -> None:
    require_caps(action, CAP_SYS_ADMIN, CAP_NET_ADMIN)


TCP_KEY = "net.ipv4.tcp_congestion_control"


def machine_tcp() -> str:
    return Path(f"/proc/sys/{TCP_KEY.replace('.', '/')}").read_text().strip()


def host_tcp(wanted: str) -> str:
    """The congestion control the hosts get: ``auto`` is CUBIC where a namespace may pick it
    (``tcp_allowed_congestion_control``), else Reno, which every kernel has; a named one must
    be allowed, or the error says which are."""
    allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
    if wanted == "auto":
        return "cubic" if "cubic" in allowed else "reno"
    if wanted != "machine" and wanted not in allowed + ["reno"]:
        raise ClusterError(f"tcp '{wanted}': a network namespace here may only use {' '.join(allowed)} "
                           f"(/proc/sys/net/ipv4/tcp_allowed_congestion_control), or 'machine'")
    return wanted


def _host_network(cfg: ClusterConfig, i: int, tcp: str) -> bool:
    """Host ``i``'s namespace on the switch, its address, TCP and shaped links; whether its veth
    takes one segment per packet (:func:`netns.one_segment_per_packet`)."""
    ns, port = cfg.host_ns(i), cfg.switch_port(i)
    netns.add(ns)
    netns.add_veth(cfg.switch_ns, port, ns, HOST_DEV)
    segmented = netns.one_segment_per_packet(ns, HOST_DEV) and netns.one_segment_per_packet(cfg.switch_ns, port)
    netns.set_master(cfg.switch_ns, port, BRIDGE)
    netns.up(cfg.switch_ns, port)
    netns.add_address(ns, HOST_DEV, cfg.cidr(i))
    netns.up(ns, HOST_DEV)
    if tcp != "machine":
        netns.sysctl(ns, TCP_KEY, tcp)
    for eg in (cfg.uplink(i), cfg.downlink(i)):
        if not (eg.default.is_noop and not eg.per_dst):
            tc.apply(eg)
    return segmented


def up(cfg: ClusterConfig, skip_netem: bool = False, log=print) -> dict[str, Any]:
    """Create the cluster. On any failure (or Ctrl-C) everything made so far is removed."""
    _require(f"`torchpp cluster up` ({cfg.name})")
    if load_state(cfg.name) is not None or leftovers(cfg.name)["namespaces"]:
        raise ClusterError(f"cluster '{cfg.name}' is already up (or left over); "
                           f"run `torchpp cluster down -n {cfg.name}` first")
    dropped = False
    if cfg.needs_netem and not tc.netem_available():
        if not skip_netem:
            raise tc.Unsupported(f"{cfg.source}: delays/losses are configured but " + tc._NO_NETEM +
                                 "; pass --skip-netem to run with rates only")
        cfg, dropped = cfg.without_netem(), True
        log(f"cluster {cfg.name}: this kernel has no netem; delays and losses are left out")
    tcp = host_tcp(cfg.tcp)
    hosts = [{"name": h.name, "netns": cfg.host_ns(i), "address": cfg.address(i), "cgroup": cfg.cgroup_name(i),
              "cpu": h.cpu, "memory": h.memory, "uplink": h.up.describe(), "downlink": h.down.describe()}
             for i, h in enumerate(cfg.hosts)]
    state = {"format": "torchpp.cluster-state/1", "name": cfg.name, "config": cfg.source,
             "phase": "creating", "switch_ns": cfg.switch_ns, "subnet": cfg.subnet,
             "master_addr": cfg.address(0), "master_port": cfg.master_port, "netem_dropped": dropped,
             "tcp": tcp if tcp != "machine" else f"{machine_tcp()} (the machine's)",
             "hosts": hosts, "created_at": time.time()}
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    _save_state(state)
    try:
        netns.add(cfg.switch_ns)
        netns.add_bridge(cfg.switch_ns, BRIDGE)
        quotas = cfg.quotas()
        try:
            cores = cfg.cores(len(os.sched_getaffinity(0))) if cfg.steady_cpu else None
        except ValueError as e:
            raise ClusterError(str(e)) from None
        unsegmented: list[str] = []
        for i, h in enumerate(cfg.hosts):
            if not _host_network(cfg, i, tcp):
                unsegmented.append(h.name)
            # Unlimited hosts still get a group: it is how run/down find every process they started.
            ctl = (tuple(c for c, v in (("cpu", h.cpu), ("memory", h.memory)) if v is not None)
                   or tuple(c for c in cgroups.CONTROLLERS if c in cgroups.detect())[:1])
            group = cgroups.Cgroup(cfg.cgroup_name(i), ctl).create()
            if h.cpu is not None:
                group.set_cpu(quotas[i], period_us=int(round(cfg.cpu_period_ms * 1000)))
                group.reserve(quotas[i])  # on a busy machine each host still gets its quota (cgroups.py)
            if h.memory is not None:
                group.set_memory(h.memory)
            if cores is not None:
                hosts[i]["core"] = cores[i]  # `run` pins the host's processes there and fills its idle time
            log(f"  {h.name:<10} {cfg.address(i):<12} cpu {h.cpu if h.cpu else 'all':<5} "
                f"memory {_gib(h.memory):<8} up: {hosts[i]['uplink']}; down: {hosts[i]['downlink']}")
        cgroups.weigh_inner_groups()
        log(f"  every host: TCP congestion control {state['tcp']}, CPU quota period {cfg.cpu_period_ms:g} ms"
            + (f", {cfg.cpu_period_cost_ms:g} ms of it lost per period: quotas "
               + ", ".join(f"{h.name} {q:.3g}" for h, q in zip(cfg.hosts, quotas) if q is not None) + " cores"
               if cfg.cpu_period_cost_ms else "")
            + (", each pinned to a core with its idle time filled while it runs (steady_cpu): "
               + ", ".join(f"{h.name} core {c}" for h, c in zip(cfg.hosts, cores)) if cores is not None else ""))
        for l in cfg.links:
            log(f"  link {l.src} -> {l.dst}: {l.shape.describe()}")
        if unsegmented:
            log(f"  warning: `ip link set ... gso_max_segs 1` was refused for {', '.join(unsegmented)}: their "
                f"shaped links pass up to 64 kB at once after a pause, faster than the rate (a newer iproute2 "
                f"and kernel fix this)")
        total = sum(h.cpu or os.cpu_count() or 1 for h in cfg.hosts)
        if total > (os.cpu_count() or 1):
            log(f"  note: the hosts' CPU quotas add up to {total:g} cores on a {os.cpu_count()}-core machine; "
                f"busy hosts will get less than their quota")
        state["phase"] = "up"
        _save_state(state)
    except BaseException:
        log(f"cluster {cfg.name}: up failed; removing what was created")
        down(cfg.name, log=lambda *_: None)
        raise
    return state


def _gib(n: int | None) -> str:
    return f"{n / 2**30:.3g}G" if n else "all"


def leftovers(name: str) -> dict[str, list[str]]:
    """What exists now for cluster ``name``, whether or not a state file says so."""
    prefix = f"{PREFIX}-{name}-"
    spaces = [n for n in netns.list_all() if n.startswith(prefix)]
    groups = [g for g in cgroups.list_groups() if g == f"cluster-{name}" or g.startswith(f"cluster-{name}/")]
    return {"namespaces": spaces, "cgroups": groups}


def down(name: str, log=print) -> dict[str, list[str]]:
    """Kill the cluster's processes and remove its namespaces (with their links and qdiscs),
    cgroups and state file. Safe to call repeatedly and after partial failures."""
    _require(f"`torchpp cluster down` ({name})")
    state = load_state(name) or {}
    found = leftovers(name)
    spaces = sorted(set(found["namespaces"]) | {h["netns"] for h in state.get("hosts", [])} |
                    ({state["switch_ns"]} if "switch_ns" in state else set()))
    # Processes first (cgroup members and anything else inside the namespaces), then network.
    cgroups.existing(f"cluster-{name}").remove()
    removed = []
    for ns in spaces:
        if netns.exists(ns):
            netns.delete(ns)
            removed.append(ns)
    with contextlib.suppress(FileNotFoundError):
        state_path(name).unlink()
    with contextlib.suppress(OSError):
        STATE_DIR.rmdir()  # only when no other cluster's state is left in it
    cgroups.weigh_inner_groups()  # other clusters' parent no longer counts this one
    if removed or found["cgroups"]:
        log(f"cluster {name}: removed {len(removed)} namespace(s) and {len(found['cgroups'])} cgroup(s)")
    else:
        log(f"cluster {name}: nothing to remove")
    return {"namespaces": removed, "cgroups": found["cgroups"]}


def list_clusters() -> list[str]:
    names = {p.stem.removeprefix("cluster-") for p in STATE_DIR.glob("cluster-*.json")} if STATE_DIR.is_dir() else set()
    with contextlib.suppress(Exception):
        for ns in netns.list_all():
            if ns.startswith(PREFIX + "-") and ns.count("-") >= 2 and not ns.startswith(f"{PREFIX}-probe-"):
                names.add(ns.split("-")[1])
    return sorted(names)


def status(name: str) -> str:
    state = load_state(name)
    found = leftovers(name)
    if state is None:
        if found["namespaces"] or found["cgroups"]:
            return (f"cluster {name}: no state file, but leftovers exist: {found}; "
                    f"run `torchpp cluster down -n {name}`")
        return f"cluster {name}: not up"
    lines = [f"cluster {name}: {state['phase']} (config {state['config']}, subnet {state['subnet']}, "
             f"master {state['master_addr']}:{state['master_port']})"
             + ("; delays/losses left out (no netem)" if state.get("netem_dropped") else "")]
    hier = cgroups.detect()
    for h in state["hosts"]:
        alive = netns.exists(h["netns"])
        procs = netns.pids(h["netns"]) if alive else []
        lim = cgroups.existing(h["cgroup"], hier).limits() if alive else {}
        lines.append(f"  {h['name']:<10} {h['address']:<12} netns {'ok' if alive else 'MISSING'}  "
                     f"{len(procs)} process(es)  limits {lim}  up: {h['uplink']}; down: {h['downlink']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- run
@dataclass
class HostResult:
    host: str
    returncode: int
    log: Path
    seconds: float
    rank: int | None = None
    """Plan rank of the process (None when one process ran per host)."""
    why: str | None = None
    """Why it ended when that is known beyond its exit code (the kernel's OOM killer)."""


def oom_message(host: str, rank: int | None, limit: int | None) -> str:
    """One line saying which process the kernel killed for its host's memory limit."""
    who = f"rank {rank} on host {host}" if rank is not None else f"the process on host {host}"
    lim = f" ({limit / 2**30:.2f} GiB)" if limit else ""
    return f"{who} was killed by the kernel for exceeding its memory limit{lim}"


class _OomWatch:
    """Attributes a SIGKILLed process to its host's OOM killer when that group's count grew."""

    def __init__(self, groups: dict[int, Any]):
        self.groups = groups
        self.seen = {i: g.oom_kills() for i, g in groups.items()}

    def why(self, host_index: int, host: str, rank: int | None, returncode: int) -> str | None:
        if returncode not in (-9, 137):
            return None
        g = self.groups[host_index]
        now = g.oom_kills()
        if now <= self.seen[host_index]:
            return None
        self.seen[host_index] += 1
        return oom_message(host, rank, g.memory_limit())


def host_env(state: dict[str, Any], i: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of host ``i``: torch.distributed's variables for one process per host, and
    torchrun's PET_* defaults so `torchrun` without --nnodes/--node-rank/--master-* just works."""
    hosts = state["hosts"]
    env = dict(os.environ if base is None else base)
    n = str(len(hosts))
    env.update(HOST=hosts[i]["name"], NODE_RANK=str(i), NNODES=n, RANK=str(i), WORLD_SIZE=n, LOCAL_RANK="0",
               LOCAL_WORLD_SIZE="1", MASTER_ADDR=state["master_addr"], MASTER_PORT=str(state["master_port"]),
               PET_NNODES=n, PET_NODE_RANK=str(i), PET_MASTER_ADDR=state["master_addr"],
               PET_MASTER_PORT=str(state["master_port"]), GLOO_SOCKET_IFNAME=HOST_DEV,
               TORCHPP_CLUSTER=state["name"])
    env["TORCHPP_HOST"] = env["HOST"]  # torchpp.hostname's rule reads it before HOST
    _threads(env, hosts[i].get("cpu"), 1, base)
    _memory(env, hosts[i].get("memory"))
    return env


def _memory(env: dict[str, str], limit: int | None) -> None:
    """TORCHPP_HOST_MEMORY: the host's memory limit in bytes, which a process in its namespace cannot
    read (`ip netns exec` mounts a fresh /sys, hiding the cgroup files) and psutil does not see."""
    if limit:
        env["TORCHPP_HOST_MEMORY"] = str(int(limit))


def _threads(env: dict[str, str], cpu: float | None, ranks_here: int, base: dict[str, str] | None) -> None:
    """OMP_NUM_THREADS from the host's quota shared by its ranks: more threads than quota only
    adds throttling. A value the caller set is kept."""
    if cpu and "OMP_NUM_THREADS" not in (os.environ if base is None else base):
        env["OMP_NUM_THREADS"] = str(max(1, math.ceil(cpu / ranks_here)))


@dataclass(frozen=True, kw_only=True)
class Placement:
    """One process of a run: which host runs it and, under a plan, which rank it is."""

    host_index: int
    """Index of the host in the cluster state."""
    host: str
    rank: int | None = None
    """Plan rank; None when the command runs once per host without a plan."""
    node_rank: int = 0
    nnodes: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    world_size: int = 1

    @property
    def label(self) -> str:
        """Log file stem and prefix of echoed lines."""
        return self.host if self.rank is None else f"{self.host}.rank{self.rank}"


def host_placements(state: dict[str, Any]) -> list[Placement]:
    """One process per host (no plan)."""
    n = len(state["hosts"])
    return [Placement(host_index=i, host=h["name"], node_rank=i, nnodes=n, world_size=n)
            for i, h in enumerate(state["hosts"])]


def plan_placements(state: dict[str, Any], plan: Plan, source: str) -> list[Placement]:
    """One process per plan rank, on the rank's host; hosts the plan does not name get nothing.

    Nodes are the plan's hosts numbered in the order of their lowest rank, so rank 0's host is
    node 0 (the one torch.distributed's store runs on). Ranks sharing a host get consecutive
    local ranks in rank order, as torchrun would number them."""
    names = [h["name"] for h in state["hosts"]]
    devices = sorted(((d.rank, d.host, si, di) for si, s in enumerate(plan.stages) for di, d in enumerate(s.devices)))
    for rank, host, si, di in devices:
        if host not in names:
            raise FormatError(source, f"stages[{si}].devices[{di}].host",
                              f"a host of cluster '{state['name']}' ({', '.join(names)})", host)
    # a rank holding several chunks (interleaved, V) appears in several stages: one process each rank
    devices = [next(d for d in devices if d[0] == r) for r in sorted({d[0] for d in devices})]
    order: list[str] = []
    for _, host, _, _ in devices:
        if host not in order:
            order.append(host)
    on_host = {h: [r for r, hh, _, _ in devices if hh == h] for h in order}
    return [Placement(host_index=names.index(host), host=host, rank=rank, node_rank=order.index(host),
                      nnodes=len(order), local_rank=on_host[host].index(rank), local_world_size=len(on_host[host]),
                      world_size=plan.world_size)
            for rank, host, _, _ in devices]


def placement_env(state: dict[str, Any], p: Placement, master: int, base: dict[str, str] | None = None
                  ) -> dict[str, str]:
    """Environment of one plan rank: torch.distributed's env:// variables (no torchrun needed),
    with the store on ``master`` (the host index of rank 0)."""
    h = state["hosts"][p.host_index]
    env = dict(os.environ if base is None else base)
    for k in [k for k in env if k.startswith(("PET_", "TORCHELASTIC_"))]:
        del env[k]  # a launcher above us must not renumber these ranks
    addr = state["hosts"][master]["address"]
    env.update(HOST=p.host, RANK=str(p.rank), WORLD_SIZE=str(p.world_size), LOCAL_RANK=str(p.local_rank),
               LOCAL_WORLD_SIZE=str(p.local_world_size), NODE_RANK=str(p.node_rank), GROUP_RANK=str(p.node_rank),
               NNODES=str(p.nnodes), MASTER_ADDR=addr, MASTER_PORT=str(state["master_port"]),
               GLOO_SOCKET_IFNAME=HOST_DEV, TORCHPP_CLUSTER=state["name"])
    env["TORCHPP_HOST"] = env["HOST"]  # torchpp.hostname's rule reads it before HOST
    _threads(env, h.get("cpu"), p.local_world_size, base)
    _memory(env, h.get("memory"))
    return env


def worst(codes: list[int]) -> int:
    """The exit code to report for a set of processes: any failure beats success; a signal
    death -N is reported the shell's way (128 + N)."""
    norm = [128 - c if c < 0 else c for c in codes]
    return max(norm, default=0)


class _Follower:
    """Passes each complete new line of the host logs to ``emit(host, line)`` (live progress)."""

    def __init__(self, paths: dict[str, Path], emit):
        self.paths, self.emit, self.pos, self.partial = paths, emit, {h: 0 for h in paths}, {h: b"" for h in paths}

    def poll(self, final: bool = False) -> None:
        for host, path in self.paths.items():
            try:
                with open(path, "rb") as f:
                    f.seek(self.pos[host])
                    data = f.read()
            except OSError:
                continue
            self.pos[host] += len(data)
            *lines, self.partial[host] = (self.partial[host] + data).split(b"\n")
            if final and self.partial[host]:
                lines.append(self.partial[host])
                self.partial[host] = b""
            for line in lines:
                self.emit(host, line.decode(errors="replace"))


def expand(argv: list[str], p: Placement) -> list[str]:
    """``{host}`` and ``{rank}`` in the command's words become this process's host name and rank
    (its plan rank, else its host's index), e.g. ``--out layers_{host}.json``."""
    rank = str(p.node_rank if p.rank is None else p.rank)
    return [w.replace("{host}", p.host).replace("{rank}", rank) for w in argv]


def run(name: str, argv: list[str], log_dir: Path, timeout: float | None = None, log=print,
        grace_s: float = 5.0, follow=None, plan: str | os.PathLike | None = None, warm_runtime: bool = True
        ) -> tuple[int, list[HostResult]]:
    """Run ``argv`` once in every host (its namespace and cgroup), or with ``plan`` once per
    plan rank on that rank's host, and wait for all of them. ``{host}`` and ``{rank}`` in
    ``argv`` are replaced per process (see ``expand``).

    Each process's stdout and stderr go to ``log_dir/<host>.log`` (``<host>.rank<R>.log`` under
    a plan; with ``follow``, line by line to ``follow(label, line)`` as well). On timeout,
    Ctrl-C or SIGTERM every process of the cluster is killed (SIGTERM, then SIGKILL after
    ``grace_s``). With ``warm_runtime`` the runtime's files are first read here, so no host's
    memory limit is charged for them (see :mod:`.runtime_cache`)."""
    state, places, envs = _placements(name, argv, plan)
    if warm_runtime and any(h.get("memory") for h in state["hosts"]):
        runtime_cache.warm()
    log_dir.mkdir(parents=True, exist_ok=True)
    hier = cgroups.detect()
    groups = {p.host_index: cgroups.existing(state["hosts"][p.host_index]["cgroup"], hier) for p in places}
    paths = [log_dir / f"{p.label}.log" for p in places]
    tmp = log_dir / "tmp"  # torchrun's torchelastic_* folders land here and go with the run
    tmp.mkdir(exist_ok=True)
    envs = [{**env, "TMPDIR": str(tmp.absolute())} for env in envs]
    watchdog = _watchdog([d for g in groups.values() for d in g.dirs()], tmp)
    procs: list[subprocess.Popen] = []
    files = []
    follower = _Follower({p.label: path for p, path in zip(places, paths)}, follow) if follow else None
    t0 = time.monotonic()
    ends: dict[int, float] = {}
    codes: dict[int, int] = {}
    whys: dict[int, str] = {}
    oom = _OomWatch(groups)
    fill = contextlib.ExitStack()
    try:
        fill.enter_context(idle_filled(state, groups, hier))
        for p, env, path in zip(places, envs, paths):
            f = open(path, "wb")
            files.append(f)
            procs.append(subprocess.Popen(netns.exec_argv(state["hosts"][p.host_index]["netns"], expand(argv, p)), env=env,
                                          stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          preexec_fn=host_preexec(state["hosts"][p.host_index], hier),
                                          start_new_session=True))
        while len(codes) < len(procs):
            for i, p in enumerate(procs):
                if i not in codes and p.poll() is not None:
                    codes[i], ends[i] = p.returncode, time.monotonic() - t0
                    why = oom.why(places[i].host_index, places[i].host, places[i].rank, p.returncode)
                    if why:
                        whys[i] = why
                        log(why)
                    elif p.returncode != 0:
                        log(f"  {places[i].label}: exited {p.returncode} after {ends[i]:.1f}s")
            if timeout is not None and time.monotonic() - t0 > timeout and len(codes) < len(procs):
                log(f"cluster {name}: timeout after {timeout:g}s; killing all hosts")
                _kill_all(procs, list(groups.values()), grace_s)
                for i, p in enumerate(procs):
                    if i not in codes:
                        codes[i], ends[i] = 124, time.monotonic() - t0
                break
            if follower:
                follower.poll()
            time.sleep(0.05)
    except BaseException:
        _kill_all(procs, list(groups.values()), grace_s)
        raise
    finally:
        fill.close()
        for f in files:
            f.close()
        if follower:
            follower.poll(final=True)
        watchdog.kill()
        watchdog.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    results = [HostResult(p.host, codes.get(i, 1), path, ends.get(i, 0.0), rank=p.rank, why=whys.get(i))
               for i, (p, path) in enumerate(zip(places, paths))]
    write_json(log_dir / "run.json", {"cluster": name, "argv": argv, "timeout_s": timeout,
                                      "plan": None if plan is None else str(plan),
                                      "hosts": [{"host": r.host, "rank": r.rank, "returncode": r.returncode,
                                                 "why": r.why, "seconds": r.seconds, "log": str(r.log)} for r in results]})
    return worst([r.returncode for r in results]), results


def _placements(name: str, argv: list[str], plan: str | os.PathLike | None) -> tuple[dict, list, list[dict]]:
    """The cluster's state, where each process runs (one per host, or one per plan rank) and its
    environment; errors before anything starts."""
    _require(f"`torchpp cluster run` ({name})")
    state = load_state(name)
    if state is None or state.get("phase") != "up":
        raise ClusterError(f"cluster '{name}' is not up; run `torchpp cluster up -c configs/cluster/{name}.json`")
    if not argv:
        raise ClusterError("cluster run: give the command after `--`")
    if plan is None:
        places = host_placements(state)
        return state, places, [host_env(state, p.host_index) for p in places]
    places = plan_placements(state, Plan.load(plan), str(plan))
    master = next(p.host_index for p in places if p.rank == 0)
    return state, places, [placement_env(state, p, master) for p in places]


_PR_SET_PDEATHSIG = 1

_WATCHDOG = """
import os, shutil, signal, sys, time
parent, tmp, dirs = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
while os.getppid() == parent:
    time.sleep(0.2)
for _ in range(3):
    for d in dirs:
        for root, _, files in os.walk(d):
            if "cgroup.procs" in files:
                for pid in open(os.path.join(root, "cgroup.procs")).read().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, PermissionError, ValueError):
                        pass
    time.sleep(0.2)
shutil.rmtree(tmp, ignore_errors=True)
"""


def _watchdog(dirs: list[Path], tmp: Path) -> subprocess.Popen:
    """A process that outlives a SIGKILLed `cluster run` and kills what it started.

    ``cluster run`` cannot clean up after SIGKILL, and its hosts' processes sit in their own
    sessions (so a terminal's Ctrl-C reaches only torchpp, which forwards it): without this
    they kept training until `cluster down`. The watchdog sees its parent change, SIGKILLs
    every process in the hosts' cgroups and removes the run's temporary folder. A normal end
    kills the watchdog first."""
    return subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(tmp), *map(str, dirs)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)


@contextlib.contextmanager
def idle_filled(state: dict[str, Any], host_indices, hier: dict | None = None):
    """While the block runs, each of these hosts pinned by ``steady_cpu`` has its idle time filled
    (:meth:`~.cgroups.Cgroup.fill_idle`); only then, so that work outside a run (the launcher's
    own steps) is not starved of the cores. Yields host index -> filler pid."""
    groups = {i: cgroups.existing(state["hosts"][i]["cgroup"], hier) for i in sorted(set(host_indices))
              if state["hosts"][i].get("core") is not None}
    pids = {}
    try:
        for i, g in groups.items():
            pids[i] = g.fill_idle(state["hosts"][i]["core"])
        yield pids
    finally:
        for g in groups.values():
            g.stop_fill()


def host_preexec(host: dict[str, Any], hier: dict | None = None):
    """``preexec_fn`` for a process of one host of the cluster state (its group and core)."""
    return _child_setup(cgroups.existing(host["cgroup"], hier), host.get("core"))


def _child_setup(group: cgroups.Cgroup, core: int | None = None):
    """``preexec_fn``: join the host's cgroup (and its core, with ``steady_cpu``) and get SIGTERM if
    `cluster run` dies (PR_SET_PDEATHSIG)."""
    def setup() -> None:
        group.preexec()
        if core is not None:
            os.sched_setaffinity(0, {core})
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    return setup


def _kill_all(procs: list[subprocess.Popen], groups: list[cgroups.Cgroup], grace_s: float) -> None:
    """SIGTERM every process group and cgroup member, then SIGKILL whatever is left."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, sig)
        for g in groups:
            g.kill(sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and (any(p.poll() is None for p in procs) or any(g.pids() for g in groups)):
            time.sleep(0.05)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=1)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def config_name(path_or_name: str) -> str:
    """``-c configs/cluster/pi3.json`` or ``-n pi3`` both name cluster pi3."""
    if path_or_name.endswith(".json") or os.sep in path_or_name:
        return ClusterConfig.load(path_or_name).name
    return path_or_name

