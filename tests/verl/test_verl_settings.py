"""The engine_kwargs.ftstate block: checked once, errors naming the key, the env override."""

from __future__ import annotations

import pytest

from ftstate.core.errors import ConfigError


def test_defaults_and_runtime_names() -> None:
    from ftstate.integrations.verl import EngineSettings

    s = EngineSettings.from_kwargs({"init_timeout_s": 5, "fault_tolerance": {"max_failovers": 1}})
    assert (s.commit_mode, s.group, s.runtime.init_timeout_s) == ("stream", "verl-weights", 5.0)
    assert s.runtime.fault_tolerance.max_failovers == 1
    assert EngineSettings.from_kwargs(s.to_kwargs()).to_kwargs() == s.to_kwargs()


@pytest.mark.parametrize(("kwargs", "path"), [
    ({"commit_mode": "eager"}, "checkpoint_engine.engine_kwargs.ftstate.commit_mode"),
    ({"init_timeout": 5}, "checkpoint_engine.engine_kwargs.ftstate.init_timeout"),
    ({"rollout_workers": 3}, "checkpoint_engine.engine_kwargs.ftstate.rollout_workers"),
    ({"init_timeout_s": -1}, "checkpoint_engine.engine_kwargs.ftstate.init_timeout_s"),
    ({"group": "a/b"}, "checkpoint_engine.engine_kwargs.ftstate.group"),
])
def test_a_wrong_key_or_value_is_a_config_error_naming_it(kwargs, path) -> None:
    from ftstate.integrations.verl import EngineSettings, FTStateCheckpointEngine

    with pytest.raises(ConfigError) as info:
        EngineSettings.from_kwargs(kwargs)
    assert info.value.path == path
    with pytest.raises(ConfigError):  # what verl's CheckpointEngineRegistry.new does with the block
        FTStateCheckpointEngine(1 << 20, **kwargs)


def test_the_env_override_wins_over_the_block(monkeypatch) -> None:
    from ftstate.integrations.verl import EngineSettings

    monkeypatch.setenv("FTSTATE_INIT_TIMEOUT_S", "7")
    assert EngineSettings.from_kwargs({"init_timeout_s": 600}).runtime.init_timeout_s == 7.0


def test_the_manager_refuses_another_backend() -> None:
    from verl.workers.config import CheckpointEngineConfig

    from ftstate.integrations.verl import FTStateCheckpointEngineManager

    with pytest.raises(ConfigError, match=r"checkpoint_engine\.backend: .*needs backend 'ftstate'"):
        FTStateCheckpointEngineManager(config=CheckpointEngineConfig(backend="naive"), actor_wg=None, replicas=[])


def test_verl_finds_the_backend_by_name_after_importing_the_module() -> None:
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs("ftstate.integrations.verl")
    from ftstate.integrations.verl import FTStateCheckpointEngine

    assert CheckpointEngineRegistry.get("ftstate") is FTStateCheckpointEngine
