"""Spec loading and validation: the shipped specs load, and each kind of malformed spec
fails at load with an error naming the file, the state or transition, and the problem."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from ftstate.core.errors import SpecError
from ftstate.core.spec import RESYNCED, MachineSpec, load_machines, load_spec, machines_dir

CARD_STATES = {"INIT", "RENDEZVOUS", "READY", "DEGRADED", "PROMOTING", "RESYNCED", "FAILED", "STOPPED"}


def minimal() -> dict:
    """A small valid machine with a serving state, a deadline and a budget."""
    return {
        "name": "mini",
        "initial": "INIT",
        "serving": ["READY"],
        "states": {
            "INIT": {"deadline": {"key": "init_timeout_s", "on_expiry": "timeout", "error": "RendezvousTimeout"}},
            "STALE": None,
            "RESYNCED": None,
            "READY": None,
            "PROMOTING": {
                "budget": {
                    "key": "fault_tolerance.max_failovers",
                    "on_exhausted": "give_up",
                    "error": "FailoverBudgetExhausted",
                }
            },
            "FAILED": {"terminal": True},
        },
        "transitions": [
            {"trigger": "joined", "source": "INIT", "dest": "STALE"},
            {"trigger": "timeout", "source": "INIT", "dest": "FAILED"},
            {"trigger": "verified", "source": "STALE", "dest": "RESYNCED"},
            {"trigger": "admit", "source": "RESYNCED", "dest": "READY"},
            {"trigger": "lost", "source": "READY", "dest": "STALE"},
            {"trigger": "promote", "source": "STALE", "dest": "PROMOTING"},
            {"trigger": "give_up", "source": "STALE", "dest": "FAILED"},
            {"trigger": "promoted", "source": "PROMOTING", "dest": "STALE"},
            {"trigger": "fail", "source": "*", "dest": "FAILED"},
        ],
    }


def load(data: dict) -> MachineSpec:
    return MachineSpec.from_dict(data, source="mini.yaml")


class TestShippedSpecs:
    def test_every_spec_in_machines_loads(self):
        specs = load_machines()
        assert {"group", "worker"} <= set(specs)

    def test_the_card_states_are_in_the_group_machine(self):
        assert set(load_machines()["group"].states) >= CARD_STATES

    def test_the_worker_machine_adds_standby_stale_lost_retired(self):
        states = set(load_machines()["worker"].states)
        assert states >= {"STANDBY", "STALE", "LOST", "RETIRED", RESYNCED, "READY", "FAILED", "STOPPED"}

    def test_the_worker_machine_serves_only_in_ready_syncing_and_draining(self):
        # DRAINING serves on (a drain is not a failure) and is entered only from READY.
        worker = load_machines()["worker"]
        assert worker.serving_states == {"READY", "SYNCING", "DRAINING"}
        assert {t.source for t in worker.transitions if t.dest == "DRAINING"} == {"READY"}

    def test_every_way_into_serving_from_outside_passes_resynced(self):
        worker = load_machines()["worker"]
        for t in worker.transitions:
            if t.dest in worker.serving_states and t.source not in worker.serving_states:
                assert t.source == RESYNCED, t

    def test_lost_stale_and_standby_cannot_reach_ready_without_resynced(self):
        worker = load_machines()["worker"]
        # Search the graph with RESYNCED removed: no path from these states to a serving state.
        for start in ("LOST", "STALE", "STANDBY", "INIT", "SUSPECT"):
            seen, frontier = {start}, [start]
            while frontier:
                s = frontier.pop()
                for t in worker.transitions:
                    if t.source == s and t.dest != RESYNCED and t.dest not in seen:
                        seen.add(t.dest)
                        frontier.append(t.dest)
            assert not (seen & worker.serving_states), (start, seen & worker.serving_states)

    def test_the_budget_sits_on_promoting(self):
        group = load_machines()["group"]
        assert group.states["PROMOTING"].budget.key == "fault_tolerance.max_failovers"

    def test_the_deadline_keys_are_the_design_cards(self):
        keys = {s.deadline.key for spec in load_machines().values() for s in spec.states.values() if s.deadline}
        assert keys == {"init_timeout_s", "sync_timeout_s", "failover_timeout_s", "heartbeat_timeout_s"}

    def test_a_minimal_spec_is_valid(self):
        spec = load(minimal())
        assert spec.next_state("STALE", "verified") == RESYNCED
        assert spec.next_state("READY", "verified") is None


def broken(mutate) -> dict:
    data = copy.deepcopy(minimal())
    mutate(data)
    return data


class TestMalformedSpecs:
    def test_unknown_dest_state_is_named(self):
        data = broken(lambda d: d["transitions"].append({"trigger": "x", "source": "INIT", "dest": "NOWHERE"}))
        with pytest.raises(SpecError, match=r"mini\.yaml: transition #10 \(x\): unknown dest state 'NOWHERE'"):
            load(data)

    def test_unknown_source_state_is_named(self):
        data = broken(lambda d: d["transitions"].append({"trigger": "x", "source": "NOPE", "dest": "READY"}))
        with pytest.raises(SpecError, match=r"transition #10 \(x\): unknown source state 'NOPE'"):
            load(data)

    def test_unreachable_state_is_named(self):
        data = broken(lambda d: d["states"].update({"ORPHAN": {"doc": "x"}}) or d["transitions"].append(
            {"trigger": "leave", "source": "ORPHAN", "dest": "READY"}))
        with pytest.raises(SpecError, match=r"state ORPHAN: unreachable from the initial state INIT"):
            load(data)

    def test_non_terminal_state_with_no_way_out_is_named(self):
        def mutate(d):
            d["transitions"] = [t for t in d["transitions"] if t["trigger"] != "promoted"]
        with pytest.raises(SpecError, match=r"state PROMOTING: non-terminal state with no way out"):
            load(broken(mutate))

    def test_terminal_state_with_a_way_out_is_named(self):
        data = broken(lambda d: d["transitions"].append({"trigger": "revive", "source": "FAILED", "dest": "INIT"}))
        with pytest.raises(SpecError, match=r"state FAILED: terminal but has transitions out to INIT"):
            load(data)

    def test_deadline_naming_an_unknown_config_key_is_named(self):
        data = broken(lambda d: d["states"]["INIT"]["deadline"].update(key="init_timeout"))
        with pytest.raises(SpecError, match=r"state INIT: deadline: key 'init_timeout' is not a timeout in the config"):
            load(data)

    def test_deadline_whose_expiry_trigger_the_state_does_not_accept(self):
        data = broken(lambda d: d["states"]["INIT"]["deadline"].update(on_expiry="boom"))
        with pytest.raises(SpecError, match=r"on_expiry trigger 'boom' has no transition from INIT"):
            load(data)

    def test_deadline_error_must_be_a_deadline_error(self):
        data = broken(lambda d: d["states"]["INIT"]["deadline"].update(error="ConfigError"))
        with pytest.raises(SpecError, match=r"error 'ConfigError' is not a DeadlineExceeded class"):
            load(data)

    def test_budget_without_an_exhaustion_edge_from_every_entry(self):
        data = broken(lambda d: d["transitions"].append({"trigger": "promote", "source": "READY", "dest": "PROMOTING"}))
        with pytest.raises(SpecError, match=r"on_exhausted trigger 'give_up' has no transition from READY"):
            load(data)

    def test_serving_state_entered_without_resynced_is_rejected(self):
        data = broken(lambda d: d["transitions"].append({"trigger": "shortcut", "source": "STALE", "dest": "READY"}))
        with pytest.raises(SpecError, match=r"transition shortcut \(STALE -> READY\): enters serving state READY "
                                            r"from non-serving state STALE without passing RESYNCED"):
            load(data)

    def test_wildcard_into_a_serving_state_is_rejected(self):
        data = broken(lambda d: d["transitions"].append({"trigger": "serve_all", "source": "*", "dest": "READY"}))
        with pytest.raises(SpecError, match=r"serve_all \(INIT -> READY\).*without passing RESYNCED"):
            load(data)

    def test_resynced_itself_must_not_serve(self):
        data = broken(lambda d: d["serving"].append("RESYNCED"))
        with pytest.raises(SpecError, match=r"RESYNCED is the gate into serving and must not itself serve"):
            load(data)

    def test_ambiguous_trigger_is_named(self):
        data = broken(lambda d: d["transitions"].append({"trigger": "joined", "source": "INIT", "dest": "READY"}))
        with pytest.raises(SpecError, match=r"trigger 'joined' from INIT is ambiguous: it already leads to STALE"):
            load(data)

    def test_unknown_key_in_a_state_is_named(self):
        data = broken(lambda d: d["states"].update(READY={"timeout": 3}))
        with pytest.raises(SpecError, match=r"state READY: unknown key 'timeout'"):
            load(data)

    def test_unknown_initial_state(self):
        data = broken(lambda d: d.update(initial="START"))
        with pytest.raises(SpecError, match=r"initial: unknown state 'START'"):
            load(data)

    def test_unknown_serving_state(self):
        data = broken(lambda d: d["serving"].append("SERVING"))
        with pytest.raises(SpecError, match=r"serving: SERVING: unknown state"):
            load(data)

    def test_file_errors_name_the_file(self, tmp_path: Path):
        bad = tmp_path / "mini.yaml"
        bad.write_text("name: mini\nstates: [\n")
        with pytest.raises(SpecError, match=r"mini\.yaml: not valid YAML"):
            load_spec(bad)

    def test_name_must_match_the_file(self, tmp_path: Path):
        p = tmp_path / "other.yaml"
        p.write_text(yaml.safe_dump(minimal()))
        with pytest.raises(SpecError, match=r"other\.yaml: name: must match the file name 'other', got 'mini'"):
            load_spec(p)

    def test_the_machines_directory_is_found(self):
        assert (machines_dir() / "group.yaml").is_file()
