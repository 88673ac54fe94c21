"""`torchpp throttle ...` and `torchpp cluster ...`."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

from .system import NotPermitted


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt, so the same `finally` clean-up runs for both."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _command(args: argparse.Namespace) -> list[str]:
    """The words after `--`; options given between a positional and `--` are parsed first."""
    cmd = list(args.command or [])
    if cmd and cmd[0].startswith("-") and cmd[0] != "--" and getattr(args, "_opts", None) is not None:
        head, sep, tail = cmd, [], []
        if "--" in cmd:
            k = cmd.index("--")
            head, sep, tail = cmd[:k], ["--"], cmd[k + 1:]
        args._opts.parse_args(head, namespace=args)
        cmd = sep + tail
    return cmd[1:] if cmd[:1] == ["--"] else cmd


def _guard(func):
    """NotPermitted / tc.Unsupported / ClusterError are user-facing: one line, exit 1."""
    def wrapped(args: argparse.Namespace) -> int:
        from .cluster import ClusterError
        from .tc import Unsupported
        try:
            with sigterm_as_interrupt():
                return func(args)
        except (NotPermitted, Unsupported, ClusterError) as e:
            print(f"torchpp {args.verb}: {e}", flush=True)
            return 1
    return wrapped


# ---------------------------------------------------------------------------------- throttle
def _cores(text: str) -> float:
    """``throttle cpu CORES``: a finite quota within this machine (``inf``, ``0``, ``1e-9`` refused)."""
    from .cgroups import check_cpu

    try:
        return check_cpu(float(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e) if "cores" in str(e) else f"expected a number, got {text!r}") from None


def configure_throttle(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", metavar="WHAT", required=True)
    for name, help_ in (("cpu", "CPU quota in cores for a command or an existing process tree"),
                        ("mem", "memory limit for a command or an existing process tree")):
        # Options may follow the positional (`cpu 0.5 --mem 1G -- CMD`); argparse would hand them
        # to the REMAINDER command, so _throttle_proc re-parses that part with `opts`.
        opts = argparse.ArgumentParser(add_help=False)
        if name == "cpu":
            opts.add_argument("--mem", default=None, help="also limit memory, e.g. 1G")
        opts.add_argument("--pid", type=int, default=None,
                          help="limit this running process and its descendants (until `throttle clear`)")
        q = sub.add_parser(name, help=help_, description=help_, parents=[opts])
        if name == "cpu":
            q.add_argument("cores", type=_cores, help="quota in cores, e.g. 0.25")
        else:
            q.add_argument("size", help="limit, e.g. 512M or 2G")
        q.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND: run it limited, then clean up")
        q.set_defaults(func=_guard(_throttle_proc), _opts=opts)
    q = sub.add_parser("net", help="egress rate/delay/loss on an interface",
                       description="Shape what leaves an interface: for the duration of COMMAND, or until "
                                   "`torchpp throttle clear`.")
    q.add_argument("--dev", required=True, help="interface, e.g. eth0")
    q.add_argument("--netns", default=None, help="network namespace holding --dev")
    q.add_argument("--rate", default=None, help="e.g. 10mbit")
    q.add_argument("--delay", default=None, help="one-way delay, e.g. 5ms (needs netem)")
    q.add_argument("--loss", default=None, help="drop probability, e.g. 1%% (needs netem)")
    q.add_argument("--dst", action="append", default=[], metavar="ADDR=RATE[/DELAY]",
                   help="per-destination override, e.g. 10.0.0.2=5mbit/20ms (repeatable)")
    q.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND")
    q.set_defaults(func=_guard(_throttle_net))
    q = sub.add_parser("status", help="torchpp cgroups and qdiscs that exist now")
    q.add_argument("--netns", default=None, help="also show devices in this namespace")
    q.set_defaults(func=_guard(_throttle_status))
    q = sub.add_parser("clear", help="remove torchpp throttles (cgroups `throttle-*`, qdiscs with handle 7470:)")
    q.add_argument("--netns", default=None, help="clear devices in this namespace instead")
    q.set_defaults(func=_guard(_throttle_clear))


def _throttle_proc(args: argparse.Namespace) -> int:
    import psutil
    from ..errors import UsageError
    from . import cgroups
    from .config import memory_limit

    cmd = _command(args)  # first: it may parse options written after the positional
    try:
        cpu = getattr(args, "cores", None)
        mem_text = args.size if args.what == "mem" else args.mem
        mem = memory_limit(mem_text) if mem_text else None
    except ValueError as e:
        raise UsageError(str(e)) from None
    if cpu is not None and not cpu > 0:
        raise UsageError(f"cores: expected a positive number, got {cpu}")
    if bool(cmd) == (args.pid is not None):
        raise UsageError("give either --pid PID or -- COMMAND")
    limits = f"{'cpu ' + format(cpu, 'g') + ' core(s)' if cpu else ''}{' ' if cpu and mem else ''}" \
             f"{'memory ' + mem_text if mem else ''}"
    if args.pid is not None:
        try:
            tree = [psutil.Process(args.pid), *psutil.Process(args.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            raise UsageError(f"--pid: no process {args.pid}") from None
        name = f"throttle-pid{args.pid}"
        ctl = tuple(c for c, v in (("cpu", cpu), ("memory", mem)) if v is not None)
        group = cgroups.Cgroup(name, ctl).create()
        if cpu:
            group.set_cpu(cpu)
            group.reserve(cpu)
        if mem:
            group.set_memory(mem)
        for p in tree:
            with contextlib.suppress(ProcessLookupError):
                group.add(p.pid)
        print(f"throttle: {len(tree)} process(es) of pid {args.pid} limited to {limits} "
              f"(cgroup torchpp/{name}; undo with `torchpp throttle clear`)")
        return 0
    if mem:
        from . import runtime_cache

        runtime_cache.warm()  # the runtime's file pages are charged here, not to the limit (runtime_cache.py)
    with cgroups.limited(f"throttle-{os.getpid()}", cpu=cpu, memory=mem) as group:
        print(f"throttle: running {' '.join(cmd)} with {limits}", flush=True)
        proc = subprocess.Popen(cmd, preexec_fn=group.preexec)
        try:
            return _wait(proc)
        except KeyboardInterrupt:
            group.kill(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            return 130


def _wait(proc: subprocess.Popen) -> int:
    rc = proc.wait()
    return 128 - rc if rc < 0 else rc


def _parse_shape(rate, delay, loss):
    from .tc import Shape
    from .units import parse_duration, parse_fraction, parse_rate
    return Shape(rate=parse_rate(rate) if rate else None, delay=parse_duration(delay) if delay else 0.0,
                 loss=parse_fraction(loss) if loss else 0.0)


def _throttle_net(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from . import tc

    try:
        default = _parse_shape(args.rate, args.delay, args.loss)
        per = {}
        for item in args.dst:
            addr, _, spec = item.partition("=")
            rate, _, delay = spec.partition("/")
            per[addr] = _parse_shape(rate or None, delay or None, None)
        eg = tc.Egress(dev=args.dev, netns=args.netns, default=default, per_dst=per)
    except ValueError as e:
        raise UsageError(str(e)) from None
    cmd = _command(args)
    where = f"{args.dev}{' in ' + args.netns if args.netns else ''}"
    desc = default.describe() + "".join(f"; to {a}: {s.describe()}" for a, s in per.items())
    if not cmd:
        tc.apply(eg)
        print(f"throttle: {where} shaped ({desc}); undo with `torchpp throttle clear`")
        return 0
    with tc.shaped(eg):
        print(f"throttle: {where} shaped ({desc}) while running {' '.join(cmd)}", flush=True)
        proc = subprocess.Popen(cmd)
        try:
            return _wait(proc)
        except KeyboardInterrupt:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            return 130


def _throttle_status(args: argparse.Namespace) -> int:
    from . import cgroups, tc
    print(f"cgroups: {cgroups.describe()}")
    names = cgroups.list_groups()
    hier = cgroups.detect()
    for n in names:
        g = cgroups.existing(n, hier)
        print(f"  torchpp/{n}: {len(g.pids())} process(es) {g.limits()}")
    if not names:
        print("  no torchpp cgroups")
    devs = tc.shaped_devices(args.netns)
    for d in devs:
        print(f"qdisc on {d}{' in ' + args.netns if args.netns else ''}:\n  " + tc.show(d, args.netns).replace("\n", "\n  "))
    if not devs:
        print("no torchpp qdiscs" + (f" in {args.netns}" if args.netns else " in this namespace"))
    return 0


def _throttle_clear(args: argparse.Namespace) -> int:
    from . import cgroups, tc
    hier = cgroups.detect()
    groups = [n for n in cgroups.list_groups(hier) if n.split("/")[0].startswith("throttle-")]
    for n in sorted({g.split("/")[0] for g in groups}):
        # Processes limited with --pid are the user's: release them, never kill them.
        cgroups.existing(n, hier).release()
    devs = tc.shaped_devices(args.netns)
    for d in devs:
        tc.clear(d, args.netns)
    print(f"throttle: removed {len({g.split('/')[0] for g in groups})} cgroup(s) and qdiscs on {len(devs)} device(s)")
    return 0


# ----------------------------------------------------------------------------------- cluster
def configure_cluster(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", metavar="WHAT", required=True)
    q = sub.add_parser("up", help="create the hosts of a cluster config")
    q.add_argument("-c", "--config", required=True, type=Path, help="configs/cluster/<name>.json")
    q.add_argument("--skip-netem", action="store_true",
                   help="if the kernel has no netem, leave delays/losses out instead of refusing")
    q.set_defaults(func=_guard(_cluster_up))
    q = sub.add_parser("run", help="run a command once in every host (or once per rank of --plan); "
                                   "exit code is the worst process's",
                       description="Run COMMAND once in every host's namespace and cgroup, with HOST, NODE_RANK, "
                                   "NNODES, RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set (torchrun also "
                                   "finds its --nnodes/--node-rank/--master-* there). With --plan, run it once per "
                                   "rank of the plan, on that rank's host, with RANK and WORLD_SIZE of the plan "
                                   "(no torchrun: `-- python -m torchpp.train --plan plan.json ...`). In COMMAND, "
                                   "{host} and {rank} become each process's host name and rank, e.g. "
                                   "`-- python -m torchpp profile --host {host} --out layers_{host}.json`.")
    _name_args(q)
    q.add_argument("--plan", type=Path, default=None,
                   help="plan.json: one process per rank, placed on the host its devices[] entry names")
    q.add_argument("--logs", type=Path, default=None, help="log folder (default runs/cluster-<name>/<time>)")
    q.add_argument("--timeout", type=float, default=None, help="kill all hosts after this many seconds (exit 124)")
    q.add_argument("-q", "--quiet", action="store_true", help="do not echo the hosts' output (it is still logged)")
    q.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND (e.g. torchrun ... -m torchpp.train ...)")
    q.set_defaults(func=_guard(_cluster_run))
    q = sub.add_parser("down", help="kill the cluster's processes and remove all it created")
    _name_args(q)
    q.set_defaults(func=_guard(_cluster_down))
    q = sub.add_parser("status", help="hosts, limits and processes of one or all clusters")
    q.add_argument("-c", "--config", default=None)
    q.add_argument("-n", "--name", default=None)
    q.set_defaults(func=_guard(_cluster_status))


def _name_args(q: argparse.ArgumentParser) -> None:
    g = q.add_mutually_exclusive_group(required=True)
    g.add_argument("-c", "--config", help="the cluster's config file")
    g.add_argument("-n", "--name", help="the cluster's name")


def _name(args: argparse.Namespace) -> str:
    from .cluster import config_name
    return args.name or config_name(args.config)


def _cluster_up(args: argparse.Namespace) -> int:
    from . import cluster
    from .config import ClusterConfig
    cfg = ClusterConfig.load(args.config)
    print(f"cluster {cfg.name}: creating {len(cfg.hosts)} host(s) on {cfg.subnet}")
    cluster.up(cfg, skip_netem=args.skip_netem)
    print(f"cluster {cfg.name}: up (state {cluster.state_path(cfg.name)}); "
          f"`torchpp cluster run -n {cfg.name} -- CMD`, `torchpp cluster down -n {cfg.name}`")
    return 0


def _cluster_run(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from . import cluster
    cmd = _command(args)
    if not cmd:
        raise UsageError("give the command after `--`")
    name = _name(args)
    logs = args.logs or Path("runs") / f"cluster-{name}" / time.strftime("%Y%m%d-%H%M%S")
    where = "on every host" if args.plan is None else f"once per rank of {args.plan}"
    print(f"cluster {name}: running `{' '.join(cmd)}` {where}; logs in {logs}", flush=True)
    try:
        width = 1 + max(len(h["name"]) for h in (cluster.load_state(name) or {}).get("hosts", [{"name": ""}]))
        width += 0 if args.plan is None else 7
        echo = None if args.quiet else (lambda host, line: print(f"{host + ':':<{width}} {line}", flush=True))
        rc, results = cluster.run(name, cmd, logs, timeout=args.timeout, follow=echo, plan=args.plan)
    except KeyboardInterrupt:
        print(f"cluster {name}: interrupted; all hosts killed", flush=True)
        return 130
    for r in results:
        who = r.host if r.rank is None else f"{r.host} rank {r.rank}"
        print(f"  {who:<16} exit {r.returncode:<4} {r.seconds:7.1f}s  {r.log}")
    if any(r.why for r in results):
        return rc  # the reason is one line, already said as it happened
    for r in results:
        if r.returncode != 0:
            print(f"--- last lines of {r.log}:\n{cluster.tail(r.log)}")
            break
    return rc


def _cluster_down(args: argparse.Namespace) -> int:
    from . import cluster
    cluster.down(_name(args))
    return 0


def _cluster_status(args: argparse.Namespace) -> int:
    from . import cluster
    names = [_name(args)] if (args.name or args.config) else cluster.list_clusters()
    if not names:
        print("no torchpp clusters")
    for n in names:
        print(cluster.status(n))
    return 0


def _sizes(text: str) -> list[int]:
    from .units import parse_size
    try:
        out = sorted({parse_size(x.strip()) for x in text.split(",") if x.strip()})
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not out:
        raise argparse.ArgumentTypeError("expected at least one size")
    return out


def _size_or_zero(text: str) -> int:
    from .units import parse_size
    if text.strip() == "0":
        return 0
    try:
        return parse_size(text.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def configure_probe(p: argparse.ArgumentParser) -> None:
    """`torchpp bandwidth probe`: all-pairs point-to-point throughput and latency over gloo."""
    p.add_argument("--host", default=None, help="this process's host name (default: $TORCHPP_HOST, else $HOST, else the hostname)")
    p.add_argument("--out-dir", type=Path, default=Path("."), help="where rank 0 writes the files")
    p.add_argument("--csv", default="bandwidth.csv", help="seed 000 CSV: src_host,dst_host,gbps (no header)")
    p.add_argument("--json", default="bandwidth.json", help="torchpp.bandwidth/1 file")
    p.add_argument("--sizes", type=_sizes, default=_sizes("64K,512K,2M,8M"), help="message sizes, e.g. 64K,1M,8M")
    p.add_argument("--repeats", type=int, default=3, help="messages per size (median is used)")
    p.add_argument("--pings", type=int, default=10, help="ping-pongs for latency")
    p.add_argument("--pair-budget", type=float, default=8.0, help="seconds per ordered pair before sizes are skipped")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any collective may block")
    p.add_argument("--burst-size", type=_size_or_zero, default=256 << 10,
                   help="bytes sent after a rest to measure each link's burst (0: not measured)")
    p.add_argument("--rest", type=float, default=0.3, help="seconds of silence before each burst message")
    p.add_argument("--fan-seconds", type=float, default=0.25,
                   help="with 3+ hosts, each host's fan-out and fan-in (do its sends share one interface?): "
                        "seconds of each message at its link's rate (0: not measured)")
    p.add_argument("--fan-repeats", type=int, default=2, help="timed fan-outs and fan-ins per host (median)")
    p.set_defaults(func=_probe)


def _probe(args: argparse.Namespace) -> int:
    from .probe import NicResult, PairResult, ProbeSettings, run, write

    def show(res: PairResult) -> None:
        print(f"  {res.src} -> {res.dst}: {res.bytes_per_sec * 8 / 1e6:9.2f} Mbit/s  "
              f"latency {res.latency_s * 1e3:7.3f} ms  burst {res.burst_bytes / 1e3:7.1f} kB  "
              f"({len(res.points)} size(s))", flush=True)

    def show_nic(res: NicResult) -> None:
        print(f"  {res.host}: to all peers at once {res.egress_bytes_per_sec * 8 / 1e6:9.2f} Mbit/s, "
              f"from all at once {res.ingress_bytes_per_sec * 8 / 1e6:9.2f} Mbit/s", flush=True)

    settings = ProbeSettings(host=args.host, sizes=args.sizes, repeats=args.repeats, pings=args.pings,
                             pair_budget=args.pair_budget, timeout=args.timeout, burst_size=args.burst_size,
                             rest_s=args.rest, fan_s=args.fan_seconds, fan_repeats=args.fan_repeats)
    t0 = time.perf_counter()
    results = run(settings, show, show_nic)
    if results is not None:
        print(f"probe: {len(results.pairs)} pair(s), {len(results.nics)} host(s)' interfaces in "
              f"{time.perf_counter() - t0:.1f}s", flush=True)
        write(results, args.out_dir, args.csv, args.json, args.sizes)
        print(f"wrote {args.out_dir / args.csv} and {args.out_dir / args.json}")
    return 0
