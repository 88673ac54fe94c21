"""Start ranks in fresh processes on one gloo world, under a deadline.

This is the one in-Python launcher that tests and benchmarks use to run a function on several
ranks (the product's own launch is ``torchrun -m torchpp.train``). Each rank is a spawned
process; each call joins the ranks to a new gloo process group through a FileStore in a
private temporary directory (no port to race for), runs ``fn(rank, world, *args, **kwargs)``
and sends its return value back. A rank that raises is reported with its rank and traceback; a
call that overruns its deadline has every process killed. Either way nothing is left running.

``RankPool`` keeps the processes alive across calls, so what they imported (torch,
transformers) is paid for once; ``run_ranks`` is a pool used for one call. ``popen_ranks`` and
``wait_ranks`` are for tests of a command line itself (``torchpp.train``, ``bandwidth probe``):
one process per rank with torchrun's variables on a free loopback port, under one deadline.
``launch_local`` runs a command line on every rank as torchrun does on one node, without its
agent (``python -m torchpp.runtime.local_cli``: the demo's local hosts).

The function, its arguments and its return value cross the process boundary by pickle: they
are the caller's own code and data, never a peer's. The function must be importable by name
(a module-level function), and it is unpickled only after the rank's environment is set, so
``env`` (say ``OMP_NUM_THREADS``) is in place before the function's module imports torch.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import socket
import subprocess
import tempfile
import time
import traceback
from typing import Any, Callable


class RankError(RuntimeError):
    """One rank raised or died; ``rank`` and the rank's ``details`` (its traceback) say where."""

    def __init__(self, rank: int, message: str, details: str = ""):
        self.rank, self.message, self.details = rank, message, details
        super().__init__(f"rank {rank}: {message}" + (f"\n{details}" if details else ""))


class RanksTimedOut(TimeoutError):
    """The call's deadline passed with ``ranks`` still running; every process was killed."""

    def __init__(self, ranks: list[int], timeout_s: float):
        self.ranks, self.timeout_s = ranks, timeout_s
        super().__init__(f"ranks {ranks} still running after {timeout_s:g} s; all ranks killed")


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (for launches that must use env://)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables torchrun gives a rank on one node (env:// rendezvous on loopback)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def popen_ranks(cmd: list[str], world: int, *, env: dict[str, str] | None = None,
                per_rank: Callable[[int], dict[str, str]] | None = None, **popen: Any) -> list[subprocess.Popen]:
    """Start ``cmd`` once per rank as torchrun would on one node, without its agent: ``env``
    (default: this process's) plus ``torchrun_env`` on a free port plus ``per_rank(rank)``;
    ``popen`` goes to ``subprocess.Popen``. End them with ``wait_ranks``."""
    port, procs = free_port(), []
    try:
        for r in range(world):
            rank_env = {**(os.environ if env is None else env), **torchrun_env(r, world, port),
                        **(per_rank(r) if per_rank else {})}
            procs.append(subprocess.Popen(cmd, env=rank_env, **popen))
    except BaseException:
        _kill_all(procs)
        raise
    return procs


def wait_ranks(procs: list[subprocess.Popen], timeout_s: float) -> list[tuple[int, Any, Any]]:
    """Each rank's (exit code, stdout, stderr) once all have exited within ``timeout_s``;
    otherwise every one is killed and ``RanksTimedOut`` names those still running."""
    out, deadline = [], time.monotonic() + timeout_s
    try:
        for p in procs:
            try:
                o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RanksTimedOut([i for i, q in enumerate(procs) if q.poll() is None], timeout_s) from None
            out.append((p.returncode, o, e))
    finally:
        _kill_all(procs)
    return out


def launch_local(cmd: list[str], world: int, *, per_rank: Callable[[int], dict[str, str]] | None = None,
                 grace_s: float = 10.0, poll_s: float = 0.05) -> tuple[int, int | None]:
    """Run ``cmd`` once per rank on this machine as ``torchrun --standalone --nproc-per-node world``
    starts it (its variables on a free loopback port, ``OMP_NUM_THREADS=1`` where unset and several
    ranks, output to this process's), without its agent: an interpreter less, one that imports
    torch, per run. Each rank gets a parent-death signal, so none outlives this process however it
    ends; when one rank fails the others are stopped (SIGTERM, SIGKILL after ``grace_s``), as the
    agent does. Returns the exit code and the rank that failed (None when every rank exited 0).
    SIGTERM or SIGINT to this process stops every rank and returns ``128 + signal``."""
    import signal

    from .lifecycle import die_with_parent

    env = dict(os.environ)
    if world > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    port, procs = free_port(), []
    stopped: list[int] = []

    def on_signal(sig: int, _frame: Any) -> None:
        stopped.append(sig)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for r in range(world):
            rank_env = {**env, **torchrun_env(r, world, port), "TORCHELASTIC_RESTART_COUNT": "0",
                        **(per_rank(r) if per_rank else {})}
            procs.append(subprocess.Popen(cmd, env=rank_env, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent))
        while not stopped:
            codes = [p.poll() for p in procs]
            bad = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
            if bad is not None:
                code = codes[bad]
                return (code if code > 0 else 128 - code), bad
            if all(c == 0 for c in codes):
                return 0, None
            time.sleep(poll_s)
        return 128 + stopped[0], None
    finally:
        _stop(procs, grace_s)
        for s, h in old.items():
            signal.signal(s, h)


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every process still running, SIGKILL those left after ``grace_s``; all reaped."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    _kill_all(procs)


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _redirect_output(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _call(rank: int, task: bytes, workdir: str) -> tuple:
    """Run one task on this rank inside its own process group; the reply to send back."""
    import datetime

    import torch.distributed as dist

    try:
        n, world, pg_timeout_s, fn, args, kwargs = pickle.loads(task)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        dist.init_process_group("gloo", init_method=f"file://{workdir}/store_{n}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        try:
            value = fn(rank, world, *args, **kwargs)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        return ("ok", value)
    except BaseException as e:  # noqa: BLE001 (reported to the parent, which raises it)
        return ("error", f"{type(e).__name__}: {e}", traceback.format_exc())


def _serve(rank: int, conn: multiprocessing.connection.Connection, workdir: str, threads: int,
           env: dict[str, str], log: str | None) -> None:
    """A rank's process: set up once, then run tasks until the parent closes the pipe (or dies:
    a parent killed outright closes nothing, and a rank mid-task would run on alone)."""
    from .lifecycle import die_with_parent

    die_with_parent()
    os.environ.update(env)
    if log is not None:
        _redirect_output(log)
    import torch

    torch.set_num_threads(threads)
    while True:
        try:
            task = conn.recv_bytes()
        except (EOFError, OSError):
            return
        reply = _call(rank, task, workdir)
        try:
            data = pickle.dumps(reply)
        except Exception as e:  # noqa: BLE001
            data = pickle.dumps(("error", f"return value cannot be sent back: {type(e).__name__}: {e}", ""))
        conn.send_bytes(data)


def _kill_tree(proc: multiprocessing.process.BaseProcess) -> None:
    """Kill a rank and whatever it started (a rank may run subprocesses of its own)."""
    try:
        import psutil

        children = psutil.Process(proc.pid).children(recursive=True) if proc.pid else []
    except Exception:  # noqa: BLE001 (already gone, or psutil missing: the rank alone)
        children = []
    for c in children:
        try:
            c.kill()
        except Exception:  # noqa: BLE001
            pass
    proc.kill()
    proc.join(10)


class RankPool:
    """``world`` rank processes that run one call after another (see the module docstring).

    ``threads`` is each rank's ``torch.set_num_threads``; ``env`` is added to each rank's
    environment before anything is imported there; ``log`` (with ``{rank}`` in it) sends each
    rank's stdout and stderr to a file instead of the caller's. After a failure or a timeout
    the processes are gone and the pool refuses further calls. ``start_method="fork"`` starts
    the ranks as copies of this process: what it has imported is shared with them rather than
    loaded again (a small host's memory), which is safe only before this process has run
    multi-threaded torch work (a forked child cannot use the parent's OpenMP threads).
    """

    def __init__(self, world: int, *, threads: int = 1, env: dict[str, str] | None = None, log: str | None = None,
                 start_method: str = "spawn"):
        if world < 1:
            raise ValueError(f"world: expected >= 1 ranks, got {world}")
        if start_method not in ("spawn", "fork"):
            raise ValueError(f"start_method: expected 'spawn' or 'fork', got {start_method!r}")
        self.world, self._runs, self._closed = world, 0, False
        self._workdir = tempfile.mkdtemp(prefix="torchpp-ranks-")
        ctx = multiprocessing.get_context(start_method)
        self._conns, self._procs = [], []
        env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads), **(env or {})}
        try:
            for r in range(world):
                mine, theirs = ctx.Pipe()
                p = ctx.Process(target=_serve, name=f"rank{r}", daemon=True,
                                args=(r, theirs, self._workdir, threads, env, log.format(rank=r) if log else None))
                p.start()
                theirs.close()  # so that the rank's death reads as end of file here
                self._conns.append(mine)
                self._procs.append(p)
        except BaseException:
            self.kill()
            raise

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is None:
            self.close()
        else:  # the caller is unwinding (an error, ^C): no grace for ranks that may be mid-call
            self.kill()

    def run(self, fn: Callable[..., Any], *args: Any, world: int | None = None, timeout_s: float = 120.0,
            pg_timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """``fn(rank, world, *args, **kwargs)`` on ranks ``0..world-1`` (default: all); their
        return values by rank. Raises ``RankError`` for the first rank that fails and
        ``RanksTimedOut`` after ``timeout_s``; either kills the pool. ``pg_timeout_s`` bounds
        each collective (default ``timeout_s``)."""
        world = self.world if world is None else world
        if self._closed:
            raise RuntimeError("this pool's ranks were stopped (after a failure, a timeout or close())")
        if not 1 <= world <= self.world:
            raise ValueError(f"world: expected 1..{self.world} ranks, got {world}")
        task = pickle.dumps((self._runs, world, pg_timeout_s or timeout_s, fn, args, kwargs))
        self._runs += 1
        deadline = time.monotonic() + timeout_s
        pending = {self._conns[r]: r for r in range(world)}
        for conn, rank in pending.items():
            try:
                conn.send_bytes(task)
            except OSError:
                self._reply(rank, conn)  # the rank is gone: raises with its exit code
        results: dict[int, Any] = {}
        while pending:
            ready = multiprocessing.connection.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.kill()
                raise RanksTimedOut(sorted(pending.values()), timeout_s)
            for conn in ready:
                rank = pending.pop(conn)
                results[rank] = self._reply(rank, conn)
        return [results[r] for r in range(world)]

    def _reply(self, rank: int, conn: multiprocessing.connection.Connection) -> Any:
        try:
            reply = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            self._procs[rank].join(5)
            code = self._procs[rank].exitcode
            self.kill()
            raise RankError(rank, f"the process exited (code {code}) before answering") from None
        if reply[0] != "ok":
            self.kill()
            raise RankError(rank, reply[1], reply[2])
        return reply[1]

    def close(self) -> None:
        """Let the ranks exit (end of their pipe), kill any that do not, remove the temp dir."""
        if not self._closed:
            for conn in self._conns:
                conn.close()
            deadline = time.monotonic() + 10
            for p in self._procs:
                p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill every rank now (and what they started); remove the temp dir."""
        self._closed = True
        for p in self._procs:
            if p.is_alive():
                _kill_tree(p)
        for conn in self._conns:
            conn.close()
        shutil.rmtree(self._workdir, ignore_errors=True)


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0, threads: int = 1,
              env: dict[str, str] | None = None, log: str | None = None, pg_timeout_s: float | None = None,
              **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world, *args, **kwargs)`` on ``world`` fresh gloo ranks; their return
    values by rank (see ``RankPool`` for the options and the errors)."""
    with RankPool(world, threads=threads, env=env, log=log) as pool:
        return pool.run(fn, *args, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s, **kwargs)


def kill_rank_after_checkpoint(checkpoint_dir, step: int, rank: int, box: dict, timeout_s: float = 150.0,
                               poll_s: float = 0.02) -> None:
    """Fault injection for tests and benchmarks of elastic runs: SIGKILL the first attempt's
    ``rank`` (a child process of this one with ``RANK`` and ``TORCHELASTIC_RESTART_COUNT=0``) as soon
    as checkpoint ``step`` is complete; ``box["killed_at"]`` gets the wall-clock time of the kill."""
    import psutil

    from . import checkpoint as ckpt

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ckpt.is_complete(ckpt.step_dir(checkpoint_dir, step)):
            for p in psutil.Process().children(recursive=True):
                try:
                    env = p.environ()
                except psutil.Error:
                    continue
                if env.get("RANK") == str(rank) and env.get("TORCHELASTIC_RESTART_COUNT") == "0":
                    box["killed_at"] = time.time()
                    p.kill()
                    return
        time.sleep(poll_s)
