"""The generated docs match what the generator would write now."""

from __future__ import annotations

import pytest
import yaml

from ftstate.cli.docs import (
    CONFIGURATION_MD,
    STATE_MACHINES_MD,
    docs_dir,
    render_configuration_md,
    render_default_config_yaml,
    render_state_machines_md,
)
from ftstate.core.config import RuntimeConfig, describe
from ftstate.core.spec import load_machines


@pytest.mark.parametrize(
    ("name", "render"),
    [(STATE_MACHINES_MD, render_state_machines_md), (CONFIGURATION_MD, render_configuration_md)],
)
def test_the_committed_docs_are_current(name: str, render) -> None:
    path = docs_dir() / name
    assert path.exists(), f"docs/{name} is missing: run `make docs`"
    assert path.read_text(encoding="utf-8") == render(), f"docs/{name} is out of date: run `make docs`"


def test_state_machines_page_has_each_machine_its_diagram_and_every_state() -> None:
    text = render_state_machines_md()
    for spec in load_machines().values():
        assert f"## {spec.name}\n" in text
        for state in spec.states:
            assert f"| `{state}` |" in text
    assert text.count("```mermaid\n") == len(load_machines())
    assert "## Why RESYNCED is the only way back" in text


def test_configuration_page_lists_every_field() -> None:
    text = render_configuration_md()
    for row in describe():
        assert f"| `{row['path']}` |" in text
    assert "`FTSTATE_INIT_TIMEOUT_S`" in text


def test_the_default_yaml_loads_as_the_default_config() -> None:
    data = yaml.safe_load(render_default_config_yaml())
    assert RuntimeConfig.from_dict(data, environ={}) == RuntimeConfig()
