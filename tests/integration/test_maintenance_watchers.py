"""The maintenance watchers against real HTTP: loopback servers speaking each provider's
protocol (tests/integration/metadata_servers.py), servers that fail in every way, and the
per-node actor on the local Ray cluster.

Nothing here reaches a real metadata address: every watcher is given a 127.0.0.1 URL, and the
off-cloud detection test forbids the network outright.
"""

from __future__ import annotations

import asyncio
import calendar
import json
import socket
import time

import pytest

from ftstate.controller.maintenance import MaintenanceWatcher, Notice, PollProblem, watchers_for
from ftstate.controller.maintenance.aws import AwsWatcher
from ftstate.controller.maintenance.azure import AzureWatcher
from ftstate.controller.maintenance.gce import GceWatcher
from ftstate.controller.maintenance.notice_file import NoticeFileWatcher
from ftstate.controller.maintenance.ray_drain import RayDrainWatcher
from ftstate.core.config import RuntimeConfig
from tests.integration.metadata_servers import (
    AwsServer,
    AzureServer,
    DripServer,
    FixedServer,
    GceServer,
    SilentServer,
    closed_port,
)

TIMEOUT = 0.3  # seconds: the bound on a request that must time out (a silent or dripping server)
ANSWERED_S = 30.0  # the bound on a request to a server that answers: never reached, however loaded the machine


def utc(*fields: int) -> float:
    """Epoch seconds of a UTC time (year, month, day, hour, minute, second)."""
    return float(calendar.timegm((*fields, 0, 0, 0)))


class Recorder:
    """The runner's callbacks, recorded."""

    def __init__(self) -> None:
        self.notices: list[Notice] = []
        self.withdrawn: list[Notice] = []
        self.problems: list[PollProblem] = []
        self.recovered: list[tuple[str, int]] = []

    def runner(self, watchers, interval: float = 0.05) -> MaintenanceWatcher:
        return MaintenanceWatcher(watchers, interval=interval, on_notice=self.notices.append,
                                  on_withdrawn=self.withdrawn.append, on_problem=self.problems.append,
                                  on_recovered=lambda label, n: self.recovered.append((label, n)))


# -- GCE ------------------------------------------------------------------------------------------


class TestGce:
    def test_nothing_announced_is_no_notice_and_every_request_carries_the_flavor_header(self):
        with GceServer() as srv:
            result = GceWatcher(srv.url, timeout=ANSWERED_S).poll()
        assert result.notices == () and result.problems == ()
        assert srv.paths() == ["/computeMetadata/v1/instance/maintenance-event", "/computeMetadata/v1/instance/preempted",
                               "/computeMetadata/v1/instance/upcoming-maintenance"]
        assert all(h.get("metadata-flavor") == "Google" for _, _, h, _ in srv.requests)

    def test_the_server_refuses_a_request_without_the_header(self):
        # The fake is faithful: what the watcher sends is what makes the difference.
        import http.client

        with GceServer() as srv:
            conn = http.client.HTTPConnection("127.0.0.1", int(srv.url.rsplit(":", 1)[1]), timeout=ANSWERED_S)
            conn.request("GET", "/computeMetadata/v1/instance/maintenance-event")
            assert conn.getresponse().status == 403
            conn.close()

    def test_terminate_with_an_upcoming_window_then_withdrawn(self):
        start = "2031-05-06T07:08:09Z"
        with GceServer() as srv:
            srv.state["maintenance-event"] = "TERMINATE_ON_HOST_MAINTENANCE"
            srv.state["upcoming-maintenance"] = {"window_start_time": start, "window_end_time": "2031-05-06T08:08:09Z",
                                                 "maintenance_status": "PENDING", "type": "SCHEDULED",
                                                 "can_reschedule": False}
            rec = Recorder()
            runner = rec.runner([GceWatcher(srv.url, timeout=ANSWERED_S)])

            async def scenario():
                await runner.poll_once()
                await runner.poll_once()  # the same notices again: reported once
                srv.state["maintenance-event"] = "NONE"
                srv.state["upcoming-maintenance"] = None
                await runner.poll_once()

            asyncio.run(scenario())
            runner.close()
        assert [(n.kind, n.deadline) for n in rec.notices] == [("terminate", utc(2031, 5, 6, 7, 8, 9)), ("maintenance", utc(2031, 5, 6, 7, 8, 9))]
        assert {n.kind for n in rec.withdrawn} == {"terminate", "maintenance"}
        assert rec.problems == [] and runner.current == []

    def test_a_preempted_spot_vm(self):
        with GceServer() as srv:
            srv.state["preempted"] = "TRUE"
            result = GceWatcher(srv.url, timeout=ANSWERED_S).poll()
        assert [(n.source, n.kind, n.deadline) for n in result.notices] == [("gce", "preempt", None)]

    def test_an_answer_without_the_flavor_header_is_not_a_gce_server(self):
        with FixedServer(200, b"TERMINATE_ON_HOST_MAINTENANCE") as srv:
            result = GceWatcher(srv.url, timeout=ANSWERED_S).poll()
        assert result.notices == ()
        assert result.problems and all(p.problem == "malformed" for p in result.problems)
        assert "Metadata-Flavor" in result.problems[0].detail


# -- AWS ------------------------------------------------------------------------------------------


class TestAws:
    def test_the_token_handshake_then_gets_with_the_token(self):
        with AwsServer() as srv:
            w = AwsWatcher(srv.url, timeout=ANSWERED_S)
            first, second = w.poll(), w.poll()
        assert first.problems == () and second.problems == () and first.notices == ()
        methods = [(m, p) for m, p, _, _ in srv.requests]
        assert methods[0] == ("PUT", "/latest/api/token")
        assert methods.count(("PUT", "/latest/api/token")) == 1  # the token is kept between polls
        assert srv.token_ttls == ["21600"]
        token = next(iter(srv.tokens))
        gets = [h for m, _, h, _ in srv.requests if m == "GET"]
        assert len(gets) == 6 and all(h.get("x-aws-ec2-metadata-token") == token for h in gets)

    def test_a_get_without_a_valid_token_is_refused(self):
        import http.client

        with AwsServer() as srv:
            conn = http.client.HTTPConnection("127.0.0.1", int(srv.url.rsplit(":", 1)[1]), timeout=ANSWERED_S)
            conn.request("GET", "/latest/meta-data/spot/instance-action")
            assert conn.getresponse().status == 401
            conn.close()

    def test_a_401_renews_the_token_once(self):
        with AwsServer() as srv:
            w = AwsWatcher(srv.url, timeout=ANSWERED_S)
            w.poll()
            srv.revoke_tokens()
            srv.state["spot"] = {"action": "terminate", "time": "2031-01-02T03:04:05Z"}
            result = w.poll()
        assert result.problems == ()
        assert [(n.kind, n.deadline) for n in result.notices] == [("preempt", utc(2031, 1, 2, 3, 4, 5))]
        assert srv.paths("PUT") == ["/latest/api/token", "/latest/api/token"]

    def test_spot_rebalance_and_scheduled_events_then_withdrawn(self):
        with AwsServer() as srv:
            srv.state["spot"] = {"action": "stop", "time": "2031-01-02T03:04:05Z"}
            srv.state["rebalance"] = {"noticeTime": "2031-01-02T03:00:00Z"}
            srv.state["scheduled"] = [
                {"NotBefore": "21 Jan 2031 09:00:43 GMT", "Code": "system-reboot", "Description": "scheduled reboot",
                 "EventId": "instance-event-0d59937288b749b32", "NotAfter": "21 Jan 2031 09:17:23 GMT", "State": "active"},
                {"NotBefore": "1 Jan 2020 00:00:00 GMT", "Code": "instance-stop", "Description": "[Completed] done",
                 "EventId": "instance-event-old", "State": "completed"},
            ]
            rec = Recorder()
            runner = rec.runner([AwsWatcher(srv.url, timeout=ANSWERED_S)])
            asyncio.run(runner.poll_once())
            srv.state.update(spot=None, rebalance=None, scheduled=[])
            asyncio.run(runner.poll_once())
            runner.close()
        assert sorted((n.kind, n.event_id) for n in rec.notices) == [
            ("preempt", None), ("rebalance", None), ("reboot", "instance-event-0d59937288b749b32")]
        assert len(rec.withdrawn) == 3 and rec.problems == []


# -- Azure ----------------------------------------------------------------------------------------


EVENT = {"EventId": "602d9444-d2cd-49c7-8624-8643e7171297", "EventStatus": "Scheduled", "EventType": "Preempt",
         "ResourceType": "VirtualMachine", "Resources": ["vm-a"], "NotBefore": "Mon, 19 Sep 2033 18:29:47 GMT",
         "Description": "Spot eviction", "EventSource": "Platform", "DurationInSeconds": -1}


class TestAzure:
    def test_an_event_for_this_vm_then_acknowledged(self):
        with AzureServer(vm_name="vm-a") as srv:
            other = {**EVENT, "EventId": "other", "EventType": "Reboot", "Resources": ["vm-b"]}
            srv.state["Events"] = [EVENT, other]
            w = AzureWatcher(srv.url, timeout=ANSWERED_S)
            result = w.poll()
            assert result.problems == ()
            assert [(n.kind, n.event_id, n.deadline) for n in result.notices] == [
                ("preempt", EVENT["EventId"], utc(2033, 9, 19, 18, 29, 47))]  # vm-b's reboot is not this node's
            assert w.acknowledge(EVENT["EventId"]) is None
        assert srv.acknowledged == [{"StartRequests": [{"EventId": EVENT["EventId"]}]}]
        assert all(h.get("metadata") == "true" for _, _, h, _ in srv.requests)
        post = next(r for r in srv.requests if r[0] == "POST")
        assert post[1] == "/metadata/scheduledevents?api-version=2020-07-01"
        assert post[2].get("content-type") == "application/json"

    def test_the_server_refuses_a_request_without_the_metadata_header(self):
        import http.client

        with AzureServer() as srv:
            conn = http.client.HTTPConnection("127.0.0.1", int(srv.url.rsplit(":", 1)[1]), timeout=ANSWERED_S)
            conn.request("GET", AzureServer.EVENTS)
            assert conn.getresponse().status == 400
            conn.close()

    def test_a_refused_acknowledgement_is_a_problem_not_an_exception(self):
        with FixedServer(500, b"oops") as srv:
            problem = AzureWatcher(srv.url, timeout=TIMEOUT, vm_name="vm-a").acknowledge("x")
        assert isinstance(problem, PollProblem) and problem.problem == "http_status"


# -- bad servers: a warning, never a notice, never an exception, never a hang -------------------------


def all_watchers(url: str):
    return [GceWatcher(url, timeout=TIMEOUT), AwsWatcher(url, timeout=TIMEOUT), AzureWatcher(url, timeout=TIMEOUT)]


@pytest.mark.parametrize(
    ("status", "body", "headers"),
    [
        (404, b"Not Found", {}),
        (500, b"Internal Server Error", {"Metadata-Flavor": "Google"}),
        (200, b"\x00\xffgarbage<html>", {"Metadata-Flavor": "Google"}),
        (200, b'{"action": "explode", "time": "soon"}', {"Metadata-Flavor": "Google"}),
    ],
    ids=["404", "500", "garbage", "wrong-json"],
)
def test_a_bad_answer_is_a_problem_and_never_a_notice(status, body, headers):
    with FixedServer(status, body, headers) as srv:
        for w in all_watchers(srv.url):
            if isinstance(w, AzureWatcher):
                w.vm_name = "vm-a"
            result = w.poll()
            assert result.notices == (), (w.source, result)
            assert result.problems, (w.source, result)
            assert all(isinstance(p, PollProblem) for p in result.problems)


def test_a_server_that_never_answers_costs_one_timeout_per_poll():
    with SilentServer() as srv:
        watchers = all_watchers(srv.url)
        for w in watchers:
            t0 = time.monotonic()
            result = w.poll()
            took = time.monotonic() - t0
            assert result.notices == ()
            assert [p.problem for p in result.problems] == ["timeout"], result
            assert took >= TIMEOUT * 0.9, (w.source, took)  # the request's timer cut it
        # one request a poll timed out, and the poll stopped there rather than waiting on every
        # path: counted at the server, not by a clock (each request is a connection of its own)
        end = time.monotonic() + 10
        while len(srv.accepted) < len(watchers) and time.monotonic() < end:
            time.sleep(0.01)
        assert len(srv.accepted) == len(watchers), srv.accepted


def test_a_server_that_drips_its_answer_is_cut_at_the_timeout():
    with DripServer(every=0.05) as srv:
        t0 = time.monotonic()
        result = GceWatcher(srv.url, timeout=TIMEOUT).poll()
        took = time.monotonic() - t0
    assert result.notices == () and [p.problem for p in result.problems] == ["timeout"]
    # each byte arrives within the socket timeout, so only the request's timer cuts it; uncut, the
    # body takes 5000 s: ten timeouts tell the two apart with room for a loaded machine
    assert took < 10 * TIMEOUT, took


def test_a_closed_port_is_unreachable_at_once():
    url = closed_port()
    # a request bound far longer than a refusal takes: "at once" means long before it, whatever
    # the machine's load (waiting it out would also read as "timeout", not "unreachable")
    bound = 30.0
    for w in (GceWatcher(url, timeout=bound), AwsWatcher(url, timeout=bound), AzureWatcher(url, timeout=bound)):
        t0 = time.monotonic()
        result = w.poll()
        assert time.monotonic() - t0 < bound / 2
        assert result.notices == () and [p.problem for p in result.problems] == ["unreachable"], result


def test_problems_are_reported_once_per_streak_and_a_recovery_once():
    """A server down for many intervals is one warning, not one per interval; and a notice
    standing before it went down is not withdrawn while it cannot be read."""
    with GceServer() as srv:
        srv.state["maintenance-event"] = "MIGRATE_ON_HOST_MAINTENANCE"
        w = GceWatcher(srv.url, timeout=ANSWERED_S)
        rec = Recorder()
        runner = rec.runner([w])

        async def scenario():
            await runner.poll_once()
            w.base_url = closed_port()
            for _ in range(4):
                await runner.poll_once()
            w.base_url = srv.url
            await runner.poll_once()

        asyncio.run(scenario())
        runner.close()
    assert [n.kind for n in rec.notices] == ["migrate"]
    assert rec.withdrawn == []
    assert [p.problem for p in rec.problems] == ["unreachable"]
    assert rec.recovered == [("gce", 4)]


def test_the_runner_polls_every_interval_and_a_silent_server_does_not_hold_up_the_others(tmp_path):
    notice_file = tmp_path / "notice.json"
    with SilentServer() as silent, GceServer() as gce_srv:
        gce_srv.state["preempted"] = "TRUE"
        rec = Recorder()
        runner = rec.runner([GceWatcher(silent.url, timeout=TIMEOUT), GceWatcher(gce_srv.url, timeout=ANSWERED_S),
                             NoticeFileWatcher(notice_file)], interval=0.05)

        async def scenario():
            task = asyncio.create_task(runner.run())
            await asyncio.sleep(0.1)
            notice_file.write_text(json.dumps({"kind": "terminate", "deadline": 2000000000, "node": "node-7"}))
            t0 = time.monotonic()
            while len(rec.notices) < 2 and time.monotonic() - t0 < 3:
                await asyncio.sleep(0.02)
            task.cancel()
            return time.monotonic() - t0

        asyncio.run(scenario())
        runner.close()
    kinds = sorted((n.source, n.kind, n.node) for n in rec.notices)
    assert kinds == [("file", "terminate", "node-7"), ("gce", "preempt", None)]
    assert [p.problem for p in rec.problems] == ["timeout"]  # the silent one, once


# -- the file source --------------------------------------------------------------------------------


def test_the_file_source_notice_withdrawal_and_a_malformed_file(tmp_path):
    path = tmp_path / "maintenance.json"
    w = NoticeFileWatcher(path)
    assert w.poll().notices == () and w.poll().problems == ()  # no file: no notice, no warning
    path.write_text('{"kind": "drain", "deadline": "2031-01-02T03:04:05Z"}')
    assert [(n.kind, n.deadline, n.node) for n in w.poll().notices] == [("drain", utc(2031, 1, 2, 3, 4, 5), None)]
    path.write_text("{not json")
    result = w.poll()
    assert result.notices == () and [p.problem for p in result.problems] == ["malformed"]
    path.write_text("")
    assert w.poll().notices == () and w.poll().problems == ()


# -- detection off-cloud stays quiet ------------------------------------------------------------------


def test_off_cloud_auto_detection_runs_only_ray_records_once_and_touches_no_network(tmp_path, monkeypatch):
    dmi = tmp_path / "dmi"
    dmi.mkdir()
    (dmi / "sys_vendor").write_text("QEMU\n")
    (dmi / "product_name").write_text("Standard PC (Q35 + ICH9, 2009)\n")
    calls: list[object] = []

    def no_network(*args, **kwargs):
        calls.append(args)
        raise AssertionError(f"network used: {args}")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    cfg = RuntimeConfig.from_dict({"fault_tolerance": {"detect_node_maintenance": False}}, environ={})
    detection, watchers = watchers_for(cfg.fault_tolerance, environ={}, dmi_dir=dmi,
                                       ray_draining=lambda timeout: {})
    assert detection.sources == ("ray",) and detection.cloud is None and detection.auto
    assert "not on GCE, AWS or Azure" in detection.note and "QEMU" in detection.note
    assert [type(w) for w in watchers] == [RayDrainWatcher]
    rec = Recorder()
    runner = rec.runner(watchers)

    async def rounds():
        for _ in range(5):
            await runner.poll_once()

    asyncio.run(rounds())
    runner.close()
    assert rec.notices == [] and rec.problems == [] and calls == []


def test_a_provider_variable_on_the_node_points_auto_at_its_server():
    with GceServer() as srv:
        srv.state["maintenance-event"] = "MIGRATE_ON_HOST_MAINTENANCE"
        host = srv.url.removeprefix("http://")
        cfg = RuntimeConfig.from_dict({}, environ={})
        detection, watchers = watchers_for(cfg.fault_tolerance, include=("gce",), environ={"GCE_METADATA_HOST": host},
                                           dmi={})
        assert detection.sources == ("gce", "ray")
        assert [w.poll().notices[0].kind for w in watchers] == ["migrate"]


# -- the per-node actor --------------------------------------------------------------------------------


@pytest.mark.ray
def test_the_node_watcher_actor_reads_its_nodes_server_and_stamps_its_node(ray_cluster):
    from ftstate.controller.maintenance.node_actor import NodeWatcherActor, actor_watchers
    from ftstate.controller.ray.backend import RayBackend

    ray = ray_cluster
    node_id = ray.get_runtime_context().get_node_id()
    with GceServer() as srv:
        srv.state["maintenance-event"] = "TERMINATE_ON_HOST_MAINTENANCE"
        cfg = RuntimeConfig.from_dict({"fault_tolerance": {"maintenance_sources": ["gce"],
                                                            "maintenance_endpoints": {"gce": srv.url},
                                                            "maintenance_request_timeout_s": TIMEOUT}}, environ={})
        backend = RayBackend()
        handle = backend.start_node_watcher(node_id, NodeWatcherActor.options_from(cfg.fault_tolerance))
        rec = Recorder()

        async def scenario():
            detection, watchers = await actor_watchers(backend, handle, 60.0)
            runner = rec.runner(watchers)
            await runner.poll_once()
            srv.state["maintenance-event"] = "NONE"
            await runner.poll_once()
            runner.close()
            return detection, watchers

        try:
            detection, watchers = asyncio.run(scenario())
        finally:
            ray.kill(handle)
    assert detection.sources == ("gce",) and [w.label for w in watchers] == [f"gce@{node_id[:12]}"]
    assert [(n.source, n.kind, n.node) for n in rec.notices] == [("gce", "terminate", node_id)]
    assert [n.kind for n in rec.withdrawn] == ["terminate"] and rec.problems == []
