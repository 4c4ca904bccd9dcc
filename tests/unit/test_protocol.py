"""The controller→worker protocol holds both sides to one list of calls: a call that the worker
host or the simulated member lacks, or that takes or answers another type than declared, fails
here, before anything runs."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pickle
from pathlib import Path

import pytest

import ftstate
from ftstate.core import protocol
from ftstate.core.protocol import Request, WorkerAPI, requests
from ftstate.simulation.members import SimulatedMember
from ftstate.worker.host import WorkerHost

#: Calls the simulation does not model, and why: they exist only where real processes run.
RAY_ONLY = {
    "adopt_node_copy": "node copies are shared memory on a real node (staging: node is Ray-only)",
    "fetch_node_copy": "node copies are shared memory on a real node (staging: node is Ray-only)",
    "bench_raw_broadcast": "a benchmark's bare broadcast of real bytes",
    "chaos_kill": "the simulation kills its members itself (SimulatedCluster.kill_member)",
    "chaos_hang": "the simulation hangs its members itself (SimulatedCluster.hang_member)",
    "chaos_corrupt_next_bucket": "the simulation moves no bytes to corrupt",
}
#: Handlers of the simulated helper actors (the node agent, the maintenance watcher): not worker calls.
HELPERS = {"heartbeats", "ready", "describe"}


def api() -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in inspect.getmembers(WorkerAPI, inspect.isfunction)
            if not name.startswith("_")}


def test_every_request_names_one_worker_api_method_and_each_method_one_request():
    by_method = {cls.method: cls for cls in requests()}
    assert len(by_method) == len(requests()), "two request classes name the same method"
    assert set(by_method) == set(api())
    for name, sig in api().items():
        (req,) = [p for p in sig.parameters.values() if p.name != "self"]
        assert req.annotation == by_method[name].__name__, f"WorkerAPI.{name} takes {req.annotation}"


@pytest.mark.parametrize("name", sorted(api()))
def test_the_worker_host_answers_each_call_with_the_declared_types(name):
    fn = getattr(WorkerHost, name, None)
    assert fn is not None and inspect.iscoroutinefunction(fn), f"WorkerHost.{name} is missing or not async"
    want, got = api()[name], inspect.signature(fn)
    # (ray.remote wraps an actor class's methods in place with a tracing keyword: not ours)
    params = [p for p in got.parameters if not p.startswith("_ray")]
    assert params == ["self", "req"], f"WorkerHost.{name}{got}: one request, no other argument"
    assert got.parameters["req"].annotation == want.parameters["req"].annotation
    assert got.return_annotation == want.return_annotation, f"WorkerHost.{name} answers {got.return_annotation}"


@pytest.mark.parametrize("name", sorted(set(api()) - set(RAY_ONLY)))
def test_the_simulated_member_answers_each_call_it_models_with_its_request(name):
    handler = getattr(SimulatedMember, f"_on_{name}", None)
    assert handler is not None, f"SimulatedMember has no _on_{name}"
    params = list(inspect.signature(handler).parameters.values())
    assert [p.name for p in params] == ["self", "fut", "req"]
    assert params[2].annotation == api()[name].parameters["req"].annotation


def test_the_simulated_member_has_no_handler_outside_the_protocol():
    handlers = {n[len("_on_"):] for n in dir(SimulatedMember) if n.startswith("_on_")}
    assert handlers - set(api()) <= HELPERS, handlers - set(api()) - HELPERS


def test_requests_are_frozen_and_survive_the_wire():
    for cls in requests():
        fields = {f.name: _sample(f.type) for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                  and f.default_factory is dataclasses.MISSING}
        req = cls(**fields)
        for name in fields:
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(req, name, None)
        assert pickle.loads(pickle.dumps(req)) == req


def _sample(annotation: str) -> object:
    return {"int": 1, "float": 1.0, "str": "x", "bool": True, "str | None": "x", "int | None": 1}.get(
        annotation, {} if annotation.startswith("Mapping") else ())


def test_the_controller_names_no_worker_method_by_a_string():
    """Worker calls go out as requests; a string method name is allowed only for ftstate's own
    helper actors (``call_helper``) and inside the Ray adapter, which sends a request by its name."""
    package = Path(ftstate.__file__).resolve().parent
    wrong = []
    for path in sorted((package / "controller").rglob("*.py")) + sorted((package / "simulation").rglob("*.py")):
        if path.parts[-2] == "ray":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                    "call", "fan_out") and any(isinstance(a, ast.Constant) and isinstance(a.value, str)
                                               for a in node.args):
                wrong.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not wrong, f"worker calls by a method's name: {wrong}"


def test_the_protocol_module_declares_requests_and_replies_only():
    assert all(dataclasses.is_dataclass(getattr(protocol, n)) or n in ("WorkerAPI", "requests")
               for n in protocol.__all__)
    assert issubclass(protocol.Beat, Request)
