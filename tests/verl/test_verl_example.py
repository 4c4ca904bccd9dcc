"""docs/examples/verl_update.py runs as written (the integration guide's runnable example)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "verl_update.py"


def test_the_integration_guides_example_runs_and_says_what_it_claims(ray_cluster, capsys) -> None:
    spec = importlib.util.spec_from_file_location("verl_update_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.main()
    printed = capsys.readouterr().out
    assert printed.count("every rollout bit-equal: True") == 3, printed
    assert [r["replica"] for r in out["removed"]] == [1]
    assert out["states"]["rollout replica 0 worker 0"] == "READY"
    assert out["states"]["rollout replica 1 worker 0"] == "RETIRED"
