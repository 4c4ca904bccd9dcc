"""The providers' answers, parsed without a socket: every documented body becomes the right
notice, and anything else a PollProblem, never a notice. Also the date formats, the notice
itself, and which cloud a DMI identity names (detection makes no request)."""

from __future__ import annotations

import calendar
import json

import pytest

from ftstate.controller.maintenance import aws, azure, gce
from ftstate.controller.maintenance.base import (
    Notice,
    PollProblem,
    PollResult,
    parse_http_date,
    parse_rfc3339,
)
from ftstate.controller.maintenance.detect import detect_sources, identify_cloud, read_dmi
from ftstate.controller.maintenance.notice_file import parse_notice_file
from ftstate.controller.maintenance.ray_drain import RayDrainWatcher, parse_draining
from ftstate.controller.maintenance.registry import REGISTRY, build_watchers


def utc(*fields: int) -> float:
    return float(calendar.timegm((*fields, 0, 0, 0)))


def problem(result, kind: str = "malformed") -> PollProblem:
    assert isinstance(result, PollProblem), result
    assert result.problem == kind, result
    return result


class TestGceMaintenanceEvent:
    def test_none_is_no_notice(self):
        assert gce.parse_maintenance_event(200, "NONE") == []
        assert gce.parse_maintenance_event(200, "NONE\n") == []

    @pytest.mark.parametrize(("value", "kind"), [("MIGRATE_ON_HOST_MAINTENANCE", "migrate"),
                                                 ("TERMINATE_ON_HOST_MAINTENANCE", "terminate")])
    def test_migrate_and_terminate(self, value, kind):
        [n] = gce.parse_maintenance_event(200, value)
        assert (n.source, n.kind, n.deadline, n.node) == ("gce", kind, None, None)
        assert value in n.raw

    @pytest.mark.parametrize("body", ["", "none", "<html>Error</html>", "TERMINATE", "MIGRATE_ON_HOST_MAINTENANCE x"])
    def test_anything_else_is_a_problem(self, body):
        problem(gce.parse_maintenance_event(200, body))

    @pytest.mark.parametrize("status", [403, 404, 500, 503])
    def test_an_error_status_is_a_problem(self, status):
        problem(gce.parse_maintenance_event(status, "MIGRATE_ON_HOST_MAINTENANCE"), "http_status")


class TestGcePreempted:
    def test_true_and_false(self):
        assert gce.parse_preempted(200, "FALSE") == []
        [n] = gce.parse_preempted(200, "TRUE")
        assert (n.kind, n.deadline) == ("preempt", None)

    @pytest.mark.parametrize("body", ["", "yes", "1", "{}"])
    def test_garbage_is_a_problem(self, body):
        problem(gce.parse_preempted(200, body))

    def test_an_error_status_is_a_problem(self):
        problem(gce.parse_preempted(500, "TRUE"), "http_status")


WINDOW = {"can_reschedule": False, "latest_window_start_time": "2031-05-06T09:00:00Z",
          "maintenance_status": "PENDING", "type": "SCHEDULED", "window_end_time": "2031-05-06T08:08:09Z",
          "window_start_time": "2031-05-06T07:08:09Z"}


class TestGceUpcomingMaintenance:

    def test_404_or_empty_is_nothing_scheduled(self):
        assert gce.parse_upcoming_maintenance(404, "Not Found") == []
        assert gce.parse_upcoming_maintenance(200, "") == []

    def test_a_window_is_a_maintenance_notice_due_at_its_start(self):
        [n] = gce.parse_upcoming_maintenance(200, json.dumps(WINDOW))
        assert (n.kind, n.deadline) == ("maintenance", utc(2031, 5, 6, 7, 8, 9))
        assert "SCHEDULED" in n.raw and "PENDING" in n.raw

    def test_the_rest_apis_camel_case_is_read_too(self):
        [n] = gce.parse_upcoming_maintenance(200, json.dumps({"windowStartTime": "2031-05-06T07:08:09.123456789+00:00"}))
        assert n.deadline == pytest.approx(utc(2031, 5, 6, 7, 8, 9) + 0.123456)

    @pytest.mark.parametrize("body", ["{", "[]", "null", json.dumps({"type": "SCHEDULED"}),
                                      json.dumps({"window_start_time": "next tuesday"})])
    def test_malformed_windows_are_problems(self, body):
        problem(gce.parse_upcoming_maintenance(200, body))

    def test_an_error_status_is_a_problem(self):
        problem(gce.parse_upcoming_maintenance(500, ""), "http_status")

    def test_the_event_takes_the_windows_start_as_its_deadline(self):
        event = gce.parse_maintenance_event(200, "TERMINATE_ON_HOST_MAINTENANCE")
        window = gce.parse_upcoming_maintenance(200, json.dumps(WINDOW))
        out = gce.combine(event, [], window)
        assert [(n.kind, n.deadline) for n in out] == [("terminate", utc(2031, 5, 6, 7, 8, 9)),
                                                       ("maintenance", utc(2031, 5, 6, 7, 8, 9))]
        assert gce.combine(event, [], []) == event


class TestAws:
    def test_spot_404_is_none_and_an_action_is_a_preempt_notice(self):
        assert aws.parse_spot_action(404, "Not Found") == []
        for action in ("terminate", "stop", "hibernate"):
            [n] = aws.parse_spot_action(200, json.dumps({"action": action, "time": "2031-01-02T03:04:05Z"}))
            assert (n.source, n.kind, n.deadline) == ("aws", "preempt", utc(2031, 1, 2, 3, 4, 5))
            assert action in n.raw

    @pytest.mark.parametrize("body", ["", "garbage", "[]", json.dumps({"action": "reboot", "time": "2031-01-02T03:04:05Z"}),
                                      json.dumps({"action": "terminate"}), json.dumps({"action": "terminate", "time": 5})])
    def test_malformed_spot_actions_are_problems(self, body):
        problem(aws.parse_spot_action(200, body))

    def test_spot_error_status(self):
        problem(aws.parse_spot_action(500, ""), "http_status")

    def test_rebalance(self):
        assert aws.parse_rebalance(404, "") == []
        [n] = aws.parse_rebalance(200, json.dumps({"noticeTime": "2031-01-02T03:04:05Z"}))
        assert (n.kind, n.deadline) == ("rebalance", None)  # the notice time is not a deadline
        problem(aws.parse_rebalance(200, "{}"))
        problem(aws.parse_rebalance(200, json.dumps({"noticeTime": "soon"})))
        problem(aws.parse_rebalance(503, ""), "http_status")

    def test_scheduled_events(self):
        body = json.dumps([
            {"NotBefore": "21 Jan 2031 09:00:43 GMT", "Code": "system-reboot", "Description": "scheduled reboot",
             "EventId": "instance-event-1", "NotAfter": "21 Jan 2031 09:17:23 GMT", "State": "active"},
            {"NotBefore": "22 Jan 2031 00:00:00 GMT", "Code": "instance-retirement", "EventId": "instance-event-2",
             "State": "active"},
            {"NotBefore": "23 Jan 2031 00:00:00 GMT", "Code": "system-maintenance", "EventId": "instance-event-3"},
            {"NotBefore": "1 Jan 2020 00:00:00 GMT", "Code": "instance-stop", "EventId": "e4", "State": "completed"},
            {"NotBefore": "1 Jan 2020 00:00:00 GMT", "Code": "instance-stop", "EventId": "e5", "State": "canceled"},
            {"NotBefore": "1 Jan 2020 00:00:00 GMT", "Code": "instance-stop", "EventId": "e6",
             "Description": "[Completed] stopped"},
        ])
        out = aws.parse_scheduled(200, body)
        assert [(n.kind, n.event_id, n.deadline) for n in out] == [
            ("reboot", "instance-event-1", utc(2031, 1, 21, 9, 0, 43)),
            ("terminate", "instance-event-2", utc(2031, 1, 22, 0, 0, 0)),
            ("maintenance", "instance-event-3", utc(2031, 1, 23, 0, 0, 0)),
        ]
        assert aws.parse_scheduled(200, "[]") == [] and aws.parse_scheduled(404, "") == []

    @pytest.mark.parametrize("body", ["{", "{}", json.dumps([{"EventId": "x"}]), json.dumps(["x"]),
                                      json.dumps([{"Code": "system-reboot", "NotBefore": "whenever"}])])
    def test_malformed_scheduled_events_are_problems(self, body):
        problem(aws.parse_scheduled(200, body))


EVENT = {"EventId": "602d9444-d2cd-49c7-8624-8643e7171297", "EventStatus": "Scheduled", "EventType": "Freeze",
         "ResourceType": "VirtualMachine", "Resources": ["vm-a", "vm-b"], "NotBefore": "Mon, 19 Sep 2033 18:29:47 GMT",
         "Description": "Host update", "EventSource": "Platform", "DurationInSeconds": 9}


class TestAzure:
    def test_no_events(self):
        assert azure.parse_events(200, json.dumps({"DocumentIncarnation": 0, "Events": []})) == []

    @pytest.mark.parametrize(("etype", "kind"), [("Freeze", "freeze"), ("Reboot", "reboot"), ("Redeploy", "redeploy"),
                                                 ("Preempt", "preempt"), ("Terminate", "terminate"),
                                                 ("LiveMigration", "maintenance")])
    def test_each_event_type_and_its_not_before(self, etype, kind):
        [n] = azure.parse_events(200, json.dumps({"Events": [{**EVENT, "EventType": etype}]}), vm_name="vm-a")
        assert (n.source, n.kind, n.event_id, n.node) == ("azure", kind, EVENT["EventId"], None)
        assert n.deadline == utc(2033, 9, 19, 18, 29, 47)

    def test_a_started_event_has_no_deadline(self):
        [n] = azure.parse_events(200, json.dumps({"Events": [{**EVENT, "EventStatus": "Started", "NotBefore": ""}]}))
        assert n.deadline is None and "Started" in n.raw

    def test_only_this_vms_events_and_without_its_name_every_event_names_its_resources(self):
        doc = json.dumps({"Events": [EVENT, {**EVENT, "EventId": "e2", "Resources": ["vm-c"]}]})
        assert [n.event_id for n in azure.parse_events(200, doc, vm_name="VM-A")] == [EVENT["EventId"]]
        assert [n.node for n in azure.parse_events(200, doc)] == ["vm-a,vm-b", "vm-c"]

    @pytest.mark.parametrize("body", ["", "{", "[]", "{}", json.dumps({"Events": {}}), json.dumps({"Events": [{}]}),
                                      json.dumps({"Events": [{**EVENT, "EventType": ""}]}),
                                      json.dumps({"Events": [{**EVENT, "Resources": "vm-a"}]}),
                                      json.dumps({"Events": [{**EVENT, "NotBefore": "tomorrow-ish"}]})])
    def test_malformed_documents_are_problems(self, body):
        problem(azure.parse_events(200, body))

    def test_an_error_status_is_a_problem(self):
        problem(azure.parse_events(400, "{}"), "http_status")

    def test_the_acknowledgement_body(self):
        assert json.loads(azure.acknowledgement("abc")) == {"StartRequests": [{"EventId": "abc"}]}


class TestRayAndFile:
    def test_draining_nodes_are_drain_notices(self):
        out = parse_draining({"bb": 0, "aa": 1_924_916_645_500})
        assert [(n.source, n.kind, n.node, n.deadline) for n in out] == [
            ("ray", "drain", "aa", 1_924_916_645.5), ("ray", "drain", "bb", None)]
        assert parse_draining({}) == []
        problem(parse_draining(None))
        problem(parse_draining({"aa": "soon"}))

    def test_a_failing_rpc_is_a_problem(self):
        def down(timeout: float):
            raise TimeoutError("GCS timed out")

        result = RayDrainWatcher(timeout=0.1, draining=down).poll()
        assert result.notices == () and [p.problem for p in result.problems] == ["timeout"]
        assert RayDrainWatcher(timeout=0.1, draining=lambda t: {"n1": 0}).poll().notices[0].node == "n1"

    def test_notice_files(self):
        assert parse_notice_file("") == [] and parse_notice_file(" \n") == []
        [n] = parse_notice_file('{"kind": "terminate", "deadline": 1924916645, "node": "10.0.0.7", "event_id": "r12"}')
        assert (n.source, n.kind, n.deadline, n.node, n.event_id) == ("file", "terminate", 1924916645.0, "10.0.0.7", "r12")
        two = parse_notice_file('[{"kind": "drain"}, {"kind": "reboot", "deadline": "2031-01-02T03:04:05+01:00"}]')
        assert [(n.kind, n.deadline) for n in two] == [("drain", None), ("reboot", utc(2031, 1, 2, 2, 4, 5))]

    @pytest.mark.parametrize("text", ["{", "3", '"drain"', "{}", '{"kind": "explode"}', '{"kind": "drain", "deadline": "x"}',
                                      '{"kind": "drain", "deadline": true}', '{"kind": "drain", "node": 7}',
                                      '{"kind": "drain", "when": 1}', '[{"kind": "drain"}, 5]'])
    def test_malformed_notice_files_are_problems(self, text):
        problem(parse_notice_file(text))


class TestDatesAndNotices:
    def test_rfc3339(self):
        assert parse_rfc3339("2031-01-02T03:04:05Z") == utc(2031, 1, 2, 3, 4, 5)
        assert parse_rfc3339("2031-01-02T03:04:05.5-02:00") == utc(2031, 1, 2, 5, 4, 5) + 0.5
        assert parse_rfc3339("2031-01-02T03:04:05") == utc(2031, 1, 2, 3, 4, 5)  # no offset: UTC
        for bad in ("", "soon", "2031-13-02T03:04:05Z"):
            with pytest.raises(ValueError):
                parse_rfc3339(bad)

    def test_http_dates(self):
        assert parse_http_date("Mon, 19 Sep 2033 18:29:47 GMT") == utc(2033, 9, 19, 18, 29, 47)
        assert parse_http_date("21 Jan 2031 09:00:43 GMT") == utc(2031, 1, 21, 9, 0, 43)
        for bad in ("", "yesterday", "Mon, 99 Foo 2033"):
            with pytest.raises(ValueError):
                parse_http_date(bad)

    def test_a_notice_is_checked_keyed_without_its_deadline_and_kept_short(self):
        with pytest.raises(ValueError, match="kind"):
            Notice("gce", "explode")
        with pytest.raises(ValueError, match="source"):
            Notice("gcp", "migrate")
        a = Notice("aws", "reboot", 1.0, event_id="e1", raw="x" * 500)
        assert a.key == Notice("aws", "reboot", 2.0, event_id="e1").key
        assert len(a.raw) == 200 and a.fields()["event_id"] == "e1"
        assert a.on_node("n1").node == "n1" and Notice("file", "drain", node="n2").on_node("n1").node == "n2"
        result = PollResult("aws", (a,), ())
        assert result.complete and result.on_node("n9").notices[0].node == "n9"

    def test_a_problem_reads_as_one_line(self):
        p = PollProblem("gce", "http://127.0.0.1:1/x", "timeout", "no answer\nat all", 2.0)
        assert "\n" not in p.message and p.message.startswith("gce maintenance source http://127.0.0.1:1/x: timeout")


class TestDetection:
    @pytest.mark.parametrize(("dmi", "cloud"), [
        ({"product_name": "Google Compute Engine", "sys_vendor": "Google"}, "gce"),
        ({"bios_vendor": "Google"}, "gce"),
        ({"sys_vendor": "Amazon EC2", "product_name": "p4d.24xlarge"}, "aws"),
        ({"sys_vendor": "Xen", "bios_version": "4.11.amazon"}, "aws"),
        ({"sys_vendor": "Microsoft Corporation", "product_name": "Virtual Machine",
          "chassis_asset_tag": "7783-7084-3265-9085-8269-3286-77"}, "azure"),
        ({"sys_vendor": "Microsoft Corporation", "product_name": "Virtual Machine"}, "azure"),
        ({"sys_vendor": "Microsoft Corporation", "product_name": "Virtual Machine", "chassis_asset_tag": "1234"}, None),
        ({"sys_vendor": "QEMU", "product_name": "Standard PC (Q35 + ICH9, 2009)"}, None),
        ({}, None),
    ], ids=["gce", "gce-bios", "aws-nitro", "aws-xen", "azure", "azure-no-tag", "hyper-v-on-prem", "qemu", "none"])
    def test_the_dmi_identity_names_the_cloud(self, dmi, cloud):
        assert identify_cloud(dmi) == cloud

    def test_reading_a_dmi_directory(self, tmp_path):
        (tmp_path / "sys_vendor").write_text("Amazon EC2\n")
        assert read_dmi(tmp_path) == {"sys_vendor": "Amazon EC2"}
        assert read_dmi(tmp_path / "missing") == {}

    def test_off_cloud_auto_is_ray_alone_with_one_line_saying_so(self):
        d = detect_sources(["auto"], environ={}, dmi={"sys_vendor": "QEMU"})
        assert d.sources == ("ray",) and d.cloud is None and d.auto
        assert "not on GCE, AWS or Azure" in d.note and "\n" not in d.note
        assert detect_sources([], environ={}, dmi={}).sources == ("ray",)

    def test_on_a_cloud_auto_adds_it(self):
        d = detect_sources(["auto"], environ={}, dmi={"product_name": "Google Compute Engine"})
        assert d.sources == ("gce", "ray") and d.cloud == "gce" and "on GCE" in d.note

    def test_endpoints_variables_and_the_file_add_their_sources(self):
        d = detect_sources(["auto"], endpoints={"azure": "http://127.0.0.1:9"}, maintenance_file="/tmp/n.json",
                           environ={"AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://127.0.0.1:8"}, dmi={})
        assert d.sources == ("aws", "azure", "ray", "file")

    def test_configured_sources_are_taken_as_they_are(self):
        d = detect_sources(["file", "gce"], environ={"GCE_METADATA_HOST": "x"}, dmi={"sys_vendor": "Amazon EC2"})
        assert d.sources == ("gce", "file") and not d.auto and d.cloud is None
        with pytest.raises(ValueError, match="gcp"):
            detect_sources(["gcp"])


class TestEndpointsAndRegistry:
    def test_override_then_variable_then_the_providers_address(self):
        assert gce.endpoint("http://127.0.0.1:5/", {"GCE_METADATA_HOST": "10.0.0.1"}) == "http://127.0.0.1:5"
        assert gce.endpoint(None, {"GCE_METADATA_HOST": "127.0.0.1:8080"}) == "http://127.0.0.1:8080"
        assert gce.endpoint(None, {}) == "http://metadata.google.internal"
        assert aws.endpoint(None, {"AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://[fd00:ec2::254]"}) == "http://[fd00:ec2::254]"
        assert aws.endpoint(None, {}) == "http://169.254.169.254"
        assert azure.endpoint(None, {}) == "http://169.254.169.254"
        assert azure.endpoint("http://127.0.0.1:7", {}) == "http://127.0.0.1:7"

    def test_every_source_has_a_factory_and_building_contacts_nothing(self):
        assert set(REGISTRY) == {"gce", "aws", "azure", "ray", "file"}
        ws = build_watchers(["gce", "aws", "azure", "ray", "file"], timeout=1.0, maintenance_file="/nonexistent",
                            environ={})
        assert [w.source for w in ws] == ["gce", "aws", "azure", "ray", "file"]
        assert ws[0].base_url == "http://metadata.google.internal" and ws[1].base_url == "http://169.254.169.254"
        assert [w.bound_s for w in ws[:3]] == [3.0, 6.0, 2.0]
