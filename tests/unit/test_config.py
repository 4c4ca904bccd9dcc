"""RuntimeConfig: defaults, YAML, the environment override, and an error naming the field's
path for every kind of bad value."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftstate.core.config import RuntimeConfig, describe
from ftstate.core.errors import ConfigError


def build(data=None, env=None) -> RuntimeConfig:
    return RuntimeConfig.from_dict(data or {}, environ=env or {})


class TestDefaults:
    def test_the_design_cards_defaults(self):
        cfg = build()
        assert (cfg.trainer_workers, cfg.rollout_workers, cfg.backend) == (1, 2, "gloo")
        assert (cfg.init_timeout_s, cfg.sync_timeout_s, cfg.failover_timeout_s) == (600, 600, 120)
        assert (cfg.heartbeat_interval_s, cfg.heartbeat_timeout_s) == (1, 10)
        ft = cfg.fault_tolerance
        assert (ft.enable, ft.mode, ft.standby_workers, ft.min_rollout_workers) == (False, "standby", 1, 1)
        # issue 43: no total by default; a window's rate, a slot's and a node's limits instead
        assert (ft.max_failovers, ft.failover_window_s, ft.max_failovers_per_window, ft.max_slot_failovers,
                ft.max_node_failures) == (None, 3600, 20, 3, 3)

    def test_verls_field_names_are_in_the_fault_tolerance_block(self):
        names = {row["path"] for row in describe()}
        for name in ("enable", "mode", "standby_resource_pool", "detect_node_maintenance",
                     "maintenance_check_interval", "reverse_weight_sync", "max_failovers"):
            assert f"fault_tolerance.{name}" in names

    def test_every_field_is_documented(self):
        assert all(row["doc"] for row in describe())


class TestSpares:
    @pytest.mark.parametrize(("ranks", "per", "standby", "expected"), [
        (1, 8, 1, 1), (8, 8, 1, 1), (9, 8, 1, 2), (16, 4, 2, 8), (3, 1, 1, 3)])
    def test_trainer_spares_scale_with_the_ranks(self, ranks, per, standby, expected):
        cfg = RuntimeConfig.from_dict({"trainer_workers": ranks, "fault_tolerance": {
            "enable": True, "standby_workers": standby, "trainer_ranks_per_spare": per}}, environ={})
        assert (cfg.spares("trainer"), cfg.spares("rollout")) == (expected, standby)

    @pytest.mark.parametrize(("rollouts", "standby", "fleet", "expected"), [
        (2, 1, 2, 1), (2, 1, 8, 4), (2, 1, 7, 4), (2, 1, 1, 1), (4, 2, 2, 1), (4, 2, 12, 6), (2, 3, 4, 6)])
    def test_rollout_spares_keep_their_ratio_as_the_fleet_grows_and_shrinks(self, rollouts, standby, fleet, expected):
        cfg = RuntimeConfig.from_dict({"rollout_workers": rollouts, "fault_tolerance": {
            "enable": True, "standby_workers": standby}}, environ={})
        assert cfg.spares("rollout", fleet) == expected
        assert cfg.spares("rollout", rollouts) == cfg.spares("rollout") == standby
        assert cfg.spares("trainer", fleet) == cfg.spares("trainer")  # the trainer's spares follow its ranks only

    def test_no_spares_without_standby(self):
        cold = {"enable": True, "mode": "cold"}
        for ft in ({"enable": False}, cold):
            cfg = RuntimeConfig.from_dict({"trainer_workers": 4, "fault_tolerance": ft}, environ={})
            assert (cfg.spares("trainer"), cfg.spares("rollout")) == (0, 0)


class TestSources:
    def test_env_overrides_init_timeout(self):
        assert build({"init_timeout_s": 30}, env={"FTSTATE_INIT_TIMEOUT_S": "7.5"}).init_timeout_s == 7.5

    def test_a_bad_env_value_names_the_variable(self):
        with pytest.raises(ConfigError, match=r"init_timeout_s \(from env FTSTATE_INIT_TIMEOUT_S\): must be a number"):
            build(env={"FTSTATE_INIT_TIMEOUT_S": "soon"})

    def test_a_non_positive_env_value_is_rejected(self):
        with pytest.raises(ConfigError, match=r"must be > 0, got -1"):
            build(env={"FTSTATE_INIT_TIMEOUT_S": "-1"})

    def test_from_yaml(self, tmp_path: Path):
        p = tmp_path / "ft.yaml"
        p.write_text("rollout_workers: 4\nfault_tolerance:\n  enable: true\n  mode: cold\n")
        cfg = RuntimeConfig.from_yaml(p, environ={})
        assert cfg.rollout_workers == 4 and cfg.fault_tolerance.mode == "cold"

    def test_yaml_errors_name_the_file_and_the_field(self, tmp_path: Path):
        p = tmp_path / "ft.yaml"
        p.write_text("fault_tolerance:\n  max_failovers: -1\n")
        with pytest.raises(ConfigError, match=r"fault_tolerance\.max_failovers: must be >= 0, got -1 \(in .*ft\.yaml\)"):
            RuntimeConfig.from_yaml(p, environ={})

    def test_a_yaml_list_at_the_top_is_rejected(self, tmp_path: Path):
        p = tmp_path / "ft.yaml"
        p.write_text("- 1\n")
        with pytest.raises(ConfigError, match=r"expected a mapping at the top level, got list"):
            RuntimeConfig.from_yaml(p, environ={})

    def test_replace_by_dotted_path(self):
        cfg = build().replace(**{"fault_tolerance.enable": True, "sync_timeout_s": 5.0})
        assert cfg.fault_tolerance.enable and cfg.sync_timeout_s == 5.0


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"fault_tolerance": {"max_failovers": -1}}, "fault_tolerance.max_failovers: must be >= 0, got -1"),
        ({"rollout_workers": 0}, "rollout_workers: must be >= 1, got 0"),
        ({"init_timeout_s": 0}, "init_timeout_s: must be > 0, got 0"),
        ({"sync_timeout_s": -5}, "sync_timeout_s: must be > 0, got -5"),
        ({"bucket_size_mb": 0}, "bucket_size_mb: must be > 0, got 0"),
        ({"rollout_wrokers": 2}, "rollout_wrokers: unknown key; expected one of: "),
        ({"fault_tolerance": {"enabled": True}}, "fault_tolerance.enabled: unknown key; expected one of: "),
        ({"backend": "mpi"}, "backend: must be one of 'gloo', 'nccl', got 'mpi'"),
        ({"fault_tolerance": {"mode": "hot"}}, "fault_tolerance.mode: must be one of 'standby', 'cold', got 'hot'"),
        ({"rollout_workers": "2"}, "rollout_workers: must be an integer, got '2'"),
        ({"rollout_workers": 2.5}, "rollout_workers: must be an integer, got 2.5"),
        ({"trainer_workers": True}, "trainer_workers: must be an integer, got True"),
        ({"fault_tolerance": {"enable": "yes"}}, "fault_tolerance.enable: must be true or false, got 'yes'"),
        ({"fault_tolerance": 3}, "fault_tolerance: expected a mapping, got int"),
        ({"audit_log": ""}, "audit_log: must be a non-empty string, got ''"),
        ({"backend": None}, "backend: must not be null"),
        ({"heartbeat_timeout_s": 1.0}, "heartbeat_timeout_s: must be greater than heartbeat_interval_s (1), got 1"),
        ({"held_weights_proof": "sometimes"}, "held_weights_proof: must be one of 'every_sync', 'admission'"),
        ({"held_weights_proof_fraction": 1.5}, "held_weights_proof_fraction: must be <= 1 (a fraction of the loads), got 1.5"),
        ({"held_weights_proof_fraction": -0.1}, "held_weights_proof_fraction: must be >= 0"),
        ({"rollout_workers": 2, "fault_tolerance": {"min_rollout_workers": 3}},
         "fault_tolerance.min_rollout_workers: must be <= rollout_workers (2), got 3"),
        ({"fault_tolerance": {"enable": True, "standby_workers": 0}},
         "fault_tolerance.standby_workers: must be >= 1 when fault_tolerance.mode is 'standby'"),
    ],
)
def test_bad_values_are_rejected_naming_the_field(data, message):
    with pytest.raises(ConfigError) as info:
        build(data)
    assert str(info.value).startswith(message), str(info.value)


def test_numbers_are_coerced_to_the_declared_type():
    cfg = build({"init_timeout_s": 5, "fault_tolerance": {"max_failovers": 2.0}})
    assert isinstance(cfg.init_timeout_s, float) and cfg.fault_tolerance.max_failovers == 2


class TestMaintenanceKeys:
    def test_the_defaults_detect_the_sources_and_bound_every_request(self):
        ft = build().fault_tolerance
        assert ft.maintenance_sources == ["auto"] and ft.maintenance_endpoints == {}
        assert ft.maintenance_file is None and ft.maintenance_request_timeout_s == 2.0

    def test_auto_may_be_written_three_ways(self):
        for value in ("auto", ["auto"], []):
            assert build({"fault_tolerance": {"maintenance_sources": value}}).fault_tolerance.maintenance_sources == ["auto"]

    def test_named_sources_endpoints_and_a_file(self):
        ft = build({"fault_tolerance": {"maintenance_sources": ["gce", "ray", "file"],
                                        "maintenance_file": "/run/ftstate/notice.json",
                                        "maintenance_endpoints": {"gce": "http://127.0.0.1:8080"}}}).fault_tolerance
        assert ft.maintenance_sources == ["gce", "ray", "file"]
        assert ft.maintenance_endpoints == {"gce": "http://127.0.0.1:8080"}

    @pytest.mark.parametrize(
        ("data", "message"),
        [
            ({"maintenance_sources": ["gce", "gcp"]},
             "fault_tolerance.maintenance_sources[1]: must be one of 'gce', 'aws', 'azure', 'ray', 'file', 'auto', got 'gcp'"),
            ({"maintenance_sources": ["ray", 7]}, "fault_tolerance.maintenance_sources[1]: must be a non-empty string, got 7"),
            ({"maintenance_sources": ["ray", "ray"]}, "fault_tolerance.maintenance_sources[1]: 'ray' is named twice"),
            ({"maintenance_sources": ["auto", "aws"]},
             "fault_tolerance.maintenance_sources: 'auto' cannot be combined with named sources"),
            ({"maintenance_sources": "gce"}, "fault_tolerance.maintenance_sources: must be a list, got 'gce'"),
            ({"maintenance_sources": ["file"]},
             "fault_tolerance.maintenance_file: required when maintenance_sources names 'file'"),
            ({"maintenance_endpoints": {"gcp": "http://127.0.0.1:1"}},
             "fault_tolerance.maintenance_endpoints.gcp: unknown key; expected one of: gce, aws, azure"),
            ({"maintenance_endpoints": {"aws": "169.254.169.254"}},
             "fault_tolerance.maintenance_endpoints.aws: must be an http:// or https:// URL, got '169.254.169.254'"),
            ({"maintenance_endpoints": {"aws": ""}}, "fault_tolerance.maintenance_endpoints.aws: must be a non-empty string"),
            ({"maintenance_request_timeout_s": 0}, "fault_tolerance.maintenance_request_timeout_s: must be > 0, got 0"),
        ],
    )
    def test_bad_values_name_the_field_and_the_element(self, data, message):
        with pytest.raises(ConfigError) as info:
            build({"fault_tolerance": data})
        assert str(info.value).startswith(message), str(info.value)


class TestTheDigestTellsConfigsApart:
    """A run's first record carries the config's digest: equal configs compare equal, and one
    setting changed anywhere (top level or nested) changes it."""

    def test_the_same_config_has_the_same_digest(self):
        assert build({"rollout_workers": 3}).digest() == build({"rollout_workers": 3}).digest()

    def test_one_setting_changed_changes_the_digest(self):
        base = build({"rollout_workers": 3})
        others = [build({"rollout_workers": 4}), build({"rollout_workers": 3, "sync_timeout_s": 30}),
                  build({"rollout_workers": 3, "fault_tolerance": {"max_failovers": 9}})]
        digests = {base.digest(), *(c.digest() for c in others)}
        assert len(digests) == 1 + len(others), digests
