"""The processes of a multiprocess vLLM engine (a separate engine core, its tensor-parallel workers), from the
rollout actor: found, watched, and never left behind. :class:`Reaper` starts a reaper process in its own session
(this file run as a script, standard library only) that SIGKILLs every recorded process below the actor and
unlinks their ``/dev/shm`` files (recorded at each scan: a separate core exits on its own with the actor, taking
its maps) when the actor dies, within ``REAP_S``; :class:`Watch` reports the first engine process to die.
Linux only (pidfds). docs/integration.md ("Tensor parallelism") says why."""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

#: Seconds between two scans of the actor's descendants while its engine starts.
SCAN_S = 0.2
#: Seconds from the actor's death (or an engine process's) until every recorded engine process is
#: gone and its /dev/shm files unlinked, at most.
REAP_S = 10.0


class Proc(NamedTuple):
    """One engine process: pid, start time (clock ticks since boot: with the pid, unique) and name."""

    pid: int
    start: int
    name: str


def read_proc(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time, name) of ``pid`` from /proc, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().split(b"\0")
    except OSError:
        return None
    name = cmd[0].decode(errors="replace").strip() if cmd and cmd[0] else "?"
    if b"resource_tracker" in b" ".join(cmd):  # python -c 'from multiprocessing.resource_tracker ...'
        name = "multiprocessing.resource_tracker"
    return int(fields[1]), int(fields[19]), name


def descendants(root: int) -> list[Proc]:
    """Every live process below ``root`` (one pass over /proc)."""
    parents: dict[int, list[tuple[int, int, str]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = read_proc(int(entry))
            if info is not None:
                parents.setdefault(info[0], []).append((int(entry), info[1], info[2]))
    out: list[Proc] = []
    todo = [root]
    while todo:
        for pid, start, name in parents.get(todo.pop(), []):
            out.append(Proc(pid, start, name))
            todo.append(pid)
    return out


def named(procs: Iterable[Proc], root: int) -> list[Proc]:
    """The engine's processes below ``root`` (the actor) named as vLLM titles them: its core
    ``VLLM::EngineCore`` and its workers ``VLLM::Worker_TP<rank>`` (``VLLM::Worker`` alone).

    vLLM's titles cannot be relied on: under ``python -B`` (``PYTHONDONTWRITEBYTECODE``, common in
    container images) setproctitle leaves the workers' names as ``python``. When any process lacks
    its title, all are named from the tree instead: the core is the actor's child with children of
    its own, and the workers take their ranks in the order they started, the order vLLM starts them in."""
    prefix = os.environ.get("VLLM_PROCESS_NAME_PREFIX", "VLLM") + "::"
    procs = list(procs)
    names = {p.pid: p.name for p in procs}
    engine = [p for p in procs if p.name != "multiprocessing.resource_tracker"]
    titled = re.compile(re.escape(prefix) + r"(EngineCore|Worker(_TP\d+)?)$")
    if not all(titled.match(p.name) for p in engine):
        parent = {p.pid: i[0] for p in procs if (i := read_proc(p.pid)) is not None}
        cores = [p for p in engine if parent.get(p.pid) == root and any(parent.get(q.pid) == p.pid for q in engine)]
        for p in cores:
            names[p.pid] = f"{prefix}EngineCore"
        workers = sorted((p for p in engine if p not in cores), key=lambda p: (p.start, p.pid))
        for rank, p in enumerate(workers):
            names[p.pid] = f"{prefix}Worker_TP{rank}" if len(workers) > 1 else f"{prefix}Worker"
    return [Proc(p.pid, p.start, names[p.pid]) for p in procs]


def shm_files(pid: int) -> set[str]:
    """The /dev/shm files ``pid`` has mapped and that still exist (vLLM's message queues)."""
    found: set[str] = set()
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
        for line in f:
            path = line.rstrip("\n").split(maxsplit=5)[-1]
            if path.startswith("/dev/shm/") and not path.endswith("(deleted)"):
                found.add(path)
    return found


def open_fd(proc: Proc) -> int | None:
    """A pidfd of ``proc``, or None if it is gone (or its pid now names another process)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:
        return None
    info = read_proc(proc.pid)
    if info is None or info[1] != proc.start:  # checked after the open: the fd pins the right one
        os.close(fd)
        return None
    return fd


def kill_tree(procs: Iterable[Proc], fds: dict[int, int] | None = None, *, files: Iterable[str] = (),
              within: float = REAP_S) -> list[Proc]:
    """SIGKILL every process of ``procs`` through a pidfd, wait up to ``within`` seconds, then unlink their
    /dev/shm files and ``files``; ``fds``: pidfds already open (closed here). Returns those still alive."""
    procs = list(procs)
    fds = dict(fds or {})
    for p in procs:
        if p.pid not in fds:
            fd = open_fd(p)
            if fd is not None:
                fds[p.pid] = fd
    shm: set[str] = set(files)
    for pid in fds:
        shm |= shm_files(pid)
    for fd in fds.values():
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    deadline = time.monotonic() + within
    alive = dict(fds)
    while alive and time.monotonic() < deadline:
        ready, _, _ = select.select(list(alive.values()), [], [], max(0.0, deadline - time.monotonic()))
        for fd in ready:
            alive = {pid: f for pid, f in alive.items() if f != fd}
    left = [p for p in procs if p.pid in alive]
    for fd in fds.values():
        os.close(fd)
    for path in shm:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return left


class Reaper:
    """The actor's end of the reaper process (see the module docstring)."""

    def __init__(self) -> None:
        # its own session: not reached by a kill of the actor's process group
        self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(os.getpid())],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
                                      close_fds=True)
        # it watches the actor once it says so: nothing of the engine starts before that
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], REAP_S)
        if not ready or self._proc.stdout.readline() != b"ready\n":
            self._proc.kill()
            raise RuntimeError(f"the engine's reaper process did not start within {REAP_S:g}s")

    @property
    def pid(self) -> int:
        return self._proc.pid

    def settle(self, procs: Iterable[Proc]) -> None:
        """The engine is up: the reaper stops scanning and records these processes' /dev/shm files."""
        self._send("settle " + " ".join(f"{p.pid}:{p.start}" for p in procs))

    def _send(self, line: str) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(line.encode() + b"\n")
        self._proc.stdin.flush()


class Watch:
    """A thread that reports the first of ``procs`` to die: ``on_death(proc)``, once."""

    def __init__(self, procs: Iterable[Proc], on_death: Callable[[Proc], None]) -> None:
        self.fds: dict[int, int] = {}
        self.procs = list(procs)
        for p in self.procs:
            fd = open_fd(p)
            if fd is None:  # gone already: reported as the first death
                self.fds.clear()
                self._dead = p
                break
            self.fds[p.pid] = fd
        else:
            self._dead = None
        self._on_death = on_death
        self._thread = threading.Thread(target=self._run, name="engine-process-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._dead is None:
            by_fd = {fd: p for p in self.procs for pid, fd in self.fds.items() if pid == p.pid}
            ready, _, _ = select.select(list(by_fd), [], [])
            self._dead = by_fd[ready[0]]
        self._on_death(self._dead)


def _reaper_main(actor: int) -> None:
    """The reaper process: record the actor's descendants, and kill them when it dies."""
    try:
        actor_fd = os.pidfd_open(actor)
    except OSError:
        return
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    known: dict[int, Proc] = {}
    files: set[str] = set()  # the engine's /dev/shm files, recorded when it settled
    settled = False
    stdin = sys.stdin.buffer.fileno()
    os.set_blocking(stdin, False)
    buf = b""
    while True:
        if not settled:
            for p in descendants(actor):
                if p.pid != os.getpid():
                    known.setdefault(p.pid, p)
                    # their files too, as they map them: a process that exits on its own when the
                    # actor dies (vLLM's engine core does) shows no maps by the time it is reaped
                    files |= shm_files(p.pid)
        ready, _, _ = select.select([actor_fd, stdin], [], [], None if settled else SCAN_S)
        # what the actor wrote before it died counts: read the pipe before acting on the death
        try:
            chunk = os.read(stdin, 65536) if stdin in ready or actor_fd in ready else None
        except BlockingIOError:
            chunk = None
        if chunk:
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                cmd, _, rest = line.decode().partition(" ")
                if cmd == "settle":  # the engine's processes, from the actor: added to those scanned
                    settled = True
                    for item in rest.split():
                        pid, start = (int(x) for x in item.split(":"))
                        info = read_proc(pid)
                        known[pid] = Proc(pid, start, info[2] if info else "?")
                        files |= shm_files(pid)
        if actor_fd in ready or chunk == b"":  # the actor died, or its pipe closed: it is gone
            break
    kill_tree(known.values(), files=files)


if __name__ == "__main__":
    # the actor's death must not take this process with it (it is what cleans up after)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _reaper_main(int(sys.argv[1]))
