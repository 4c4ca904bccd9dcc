"""What the suites that run in a virtual environment of their own (verl, vLLM) share.

Each such suite's folder is collected in the core venv too, where its framework is missing:
its tests are then skipped with a reason naming the make target that runs them. The project
root goes first on ``sys.path`` (verl's wheel installs a top-level ``tests`` package of its own).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def root_first() -> None:
    """Put the project root first on ``sys.path``, so ``tests.…`` is always this project's."""
    if str(ROOT) not in sys.path[:1]:
        sys.path.insert(0, str(ROOT))


def skip_without(module: str, folder: Path, items: list[pytest.Item], *, suite: str, target: str) -> None:
    """Without ``module`` importable, mark every test under ``folder`` skipped, naming ``target``."""
    if importlib.util.find_spec(module) is not None:
        return
    skip = pytest.mark.skip(reason=f"the {suite} suite runs in its own venv: make {target}")
    for item in items:
        if Path(item.path).resolve().is_relative_to(folder):
            item.add_marker(skip)
