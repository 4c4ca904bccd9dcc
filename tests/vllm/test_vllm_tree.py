"""The reaper of an engine's processes (:mod:`ftstate.integrations.vllm.tree`), without vLLM:
a stand-in actor (a Python process) starts the reaper, then two children and a grandchild that
map a /dev/shm file, as vLLM's workers map their message queues; SIGKILLed, whether it had
handed the reaper its engine's processes (``settle``) or was still starting (the reaper's
scan), it takes them and the file with it within ``REAP_S``; also when its processes exit on
their own as it dies (``exits``: vLLM's separate engine core does), unmapping the file before
the reaper could read their maps. Last, the same with a real engine (a separate core and two
ranks) killed as it maps its message queues.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

TREE = Path(__file__).resolve().parents[2] / "ftstate" / "integrations" / "vllm" / "tree.py"

# The stand-in actor: tree.py loaded by path (no vLLM import), the reaper first, then the
# "engine": two children, one with a child of its own, each mapping the /dev/shm file.
ACTOR = r"""
import importlib.util, json, mmap, os, subprocess, sys, time
spec = importlib.util.spec_from_file_location("tree", sys.argv[1])
tree = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tree)
reaper = tree.Reaper()
path, settle = sys.argv[2], sys.argv[3] == "settle"
HOLD = "import mmap, sys, time; f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 4096); time.sleep(600)"
NEST = HOLD.replace("time.sleep(600)", "import subprocess; subprocess.Popen([sys.executable, '-c', sys.argv[2], sys.argv[1]]); time.sleep(600)")
if sys.argv[3] == "exits":  # each exits as soon as its parent dies, as vLLM's engine core does
    EXIT = "import os; p = os.getppid()\nwhile os.getppid() == p: time.sleep(0.001)"
    HOLD, NEST = (code.replace("time.sleep(600)", EXIT) for code in (HOLD, NEST))
with open(path, "wb") as f:
    f.write(b"\0" * 4096)
kids = [subprocess.Popen([sys.executable, "-c", HOLD, path]), subprocess.Popen([sys.executable, "-c", NEST, path, HOLD])]
while len(tree.descendants(os.getpid())) < 4:  # the reaper, two children, one grandchild
    time.sleep(0.05)
procs = [p for p in tree.descendants(os.getpid()) if p.pid != reaper.pid]
while not all(tree.shm_files(p.pid) for p in procs):
    time.sleep(0.05)
if settle:
    reaper.settle(procs)
else:
    time.sleep(3 * tree.SCAN_S)  # still "starting": the reaper has only its scans to go on
print(json.dumps([p.pid for p in procs]), flush=True)
time.sleep(600)
"""


def running(pid: int) -> bool:
    """Alive and not a zombie (a zombie holds nothing: it waits for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("mode", ["settle", "starting", "exits"])
def test_an_actor_sigkilled_takes_its_engine_processes_and_their_shm_files_with_it(mode):
    import importlib.util

    spec = importlib.util.spec_from_file_location("ftstate_tree", TREE)  # by path: the package imports vLLM
    tree = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tree)
    path = f"/dev/shm/ftstate-test-reaper-{uuid.uuid4().hex[:8]}"
    actor = subprocess.Popen([sys.executable, "-c", ACTOR, str(TREE), path, mode], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(actor.stdout.readline())
        assert len(pids) == 3 and os.path.exists(path)
        t0 = time.monotonic()
        os.kill(actor.pid, signal.SIGKILL)
        actor.wait()
        while [p for p in pids if running(p)] or os.path.exists(path):
            assert time.monotonic() - t0 < tree.REAP_S, f"left: {[p for p in pids if running(p)]}, {path}"
            time.sleep(0.01)
    finally:
        actor.kill()
        for p in pids if "pids" in locals() else []:
            if running(p):
                os.kill(p, signal.SIGKILL)
        if os.path.exists(path):
            os.unlink(path)
    print(f"{mode}: engine processes and shm file gone {time.monotonic() - t0:.3f}s after the actor's SIGKILL")


# A real engine this time: a process (standing in for the actor) builds a separate-core TP=2
# VLLMRollout and is SIGKILLed as its engine maps its message queues (vLLM's psm_* segments).
ENGINE_ACTOR = r"""
import sys
from tests.vllm.harness import rollout_kwargs
from ftstate.integrations.vllm import VLLMRollout
kw = rollout_kwargs(tp=2)
kw["engine_env"] = {**kw["engine_env"], "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
VLLMRollout(sys.argv[1], **kw)
"""


def segments_mapped() -> set[str]:
    """Every /dev/shm path some live process maps (on a shared host: theirs are not leaks)."""
    out: set[str] = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/maps") as f:
                    out.update(line.split()[-1] for line in f if "/dev/shm/" in line)
            except OSError:
                pass
    return out


def test_an_engine_killed_while_its_processes_map_their_queues_leaves_no_process_and_no_segment(tiny_model):
    """The window the reaper's scans could miss: its actor SIGKILLed as the first of the engine's
    segments appears, before the engine settles. Within ``REAP_S`` no engine process
    of it is left, and no segment made since it started is left unmapped by every process."""
    from ftstate.integrations.vllm.tree import REAP_S, descendants

    before = set(os.listdir("/dev/shm"))
    env = {**os.environ, "PYTHONPATH": str(TREE.parents[3]), "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    actor = subprocess.Popen([sys.executable, "-c", ENGINE_ACTOR, tiny_model], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        while not [n for n in set(os.listdir("/dev/shm")) - before if n.startswith("psm_")]:
            assert actor.poll() is None, f"the engine's process ended (rc {actor.returncode}) before it mapped a queue"
            assert time.monotonic() - t0 < 600, "no engine segment within 600 s"
            time.sleep(0.01)
        engine = [p.pid for p in descendants(actor.pid)]
        os.kill(actor.pid, signal.SIGKILL)
        actor.wait()
        t1 = time.monotonic()

        def left() -> tuple[list[int], list[str]]:
            mapped = segments_mapped()
            return ([p for p in engine if running(p)],
                    [n for n in set(os.listdir("/dev/shm")) - before
                     if n.startswith("psm_") and f"/dev/shm/{n}" not in mapped])

        while left() != ([], []):
            assert time.monotonic() - t1 < REAP_S, f"left after {REAP_S:g}s: {left()}"
            time.sleep(0.1)
    finally:
        actor.kill()


def test_engine_processes_without_titles_are_named_from_the_tree():
    """Under ``python -B`` vLLM's workers keep the name ``python``: a core with two children is
    named from the tree (the core, then the workers by start order)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ftstate_tree", TREE)
    tree = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tree)
    kid = "import subprocess, sys, time; [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']) for _ in range(2)]; time.sleep(60)"
    core = subprocess.Popen([sys.executable, "-c", kid])
    try:
        while len(tree.descendants(core.pid)) < 2:
            time.sleep(0.05)
        procs = [p for p in tree.descendants(os.getpid()) if p.pid == core.pid or p in tree.descendants(core.pid)]
        assert all(not p.name.startswith("VLLM::") for p in procs), procs
        named = {p.pid: p.name for p in tree.named(procs, os.getpid())}
        workers = sorted(tree.descendants(core.pid), key=lambda p: (p.start, p.pid))
        assert named == {core.pid: "VLLM::EngineCore", workers[0].pid: "VLLM::Worker_TP0",
                         workers[1].pid: "VLLM::Worker_TP1"}
    finally:
        for p in tree.descendants(core.pid):
            os.kill(p.pid, signal.SIGKILL)
        core.kill()
        core.wait()
