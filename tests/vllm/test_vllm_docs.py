"""The docs' vLLM examples against the real integration: what tests/unit/test_docs_examples.py
cannot check in the core venv (no vLLM there), checked here with the same checker."""

from __future__ import annotations

import pytest

from tests.unit.test_docs_examples import BLOCKS, UNKNOWN, Checker, inline_references, resolve_reference

VLLM_BLOCKS = [b for b in BLOCKS if "ftstate.integrations.vllm" in b.code]


def test_the_docs_have_vllm_examples() -> None:
    assert len(VLLM_BLOCKS) >= 2, [b.name for b in VLLM_BLOCKS]


@pytest.mark.parametrize("block", VLLM_BLOCKS, ids=lambda b: b.name)
def test_a_vllm_example_uses_only_the_real_api(block) -> None:
    problems = Checker(block).run()
    assert not problems, "\n".join(problems)


def test_the_docs_name_vllm_modules_and_objects_that_exist() -> None:
    refs = [(where, ref) for where, ref in inline_references() if ref.startswith("ftstate.integrations.vllm")]
    assert refs
    missing = [f"{where}: `{ref}`" for where, ref in refs if resolve_reference(ref) is UNKNOWN or resolve_reference(ref) is None]
    assert not missing, missing
