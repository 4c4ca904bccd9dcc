"""The mutation check counts a mutation caught only when a named test failed and said why.

Its verdicts are read from pytest's junit report; these tests feed it small synthetic reports
of each kind a mutant's run can give (the shape pytest 9 writes with ``junit_family=xunit1``).
"""

from __future__ import annotations

from tests.mutation.check_mutations import MUTATIONS, VENVS, classify, ftstate_errors, read_junit, stale

OWN = ftstate_errors()


def report(*cases: str) -> str:
    return ('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
            + "".join(cases) + "</testsuite></testsuites>")


def case(name: str, body: str = "", cls: str = "tests.unit.test_x.TestA") -> str:
    return f'<testcase classname="{cls}" name="{name}" file="tests/unit/test_x.py" line="3">{body}</testcase>'


def failure(message: str, raised: str) -> str:
    return f'<failure message="{message}">def test():\nE       {message}\n\ntests/unit/test_x.py:9: {raised}</failure>'


ASSERTION = case("test_a", failure("assert 1 == 2", "AssertionError"))
DID_NOT_RAISE = case("test_b", failure("Failed: DID NOT RAISE ManifestError", "Failed"))
OWN_ERROR = case("test_c", failure("ftstate.core.errors.ChecksumMismatch: bucket 3", "ChecksumMismatch"))
THROUGH_RAY = case("test_d", failure("ray.exceptions.RayTaskError(ChecksumMismatch): x",
                                     "RayTaskError(ChecksumMismatch)"))
TYPE_ERROR = case("test_e", failure("TypeError: unsupported operand", "TypeError"))
FIXTURE = case("test_f", '<error message="failed on setup with &quot;RuntimeError: ray&quot;">'
                         "E   RuntimeError: ray\n\ntests/conftest.py:40: RuntimeError</error>")
SKIPPED = case("test_g", '<skipped type="pytest.skip" message="no verl">tests/unit/test_x.py:22: no verl</skipped>')
PASSED = case("test_h")


class TestCaughtOnlyWhenATestSaysWhy:
    def test_an_assertion_a_did_not_raise_and_an_ftstate_error_each_catch_and_name_the_test(self):
        for body, test in ((ASSERTION, "test_a"), (DID_NOT_RAISE, "test_b"), (OWN_ERROR, "test_c"),
                           (THROUGH_RAY, "test_d")):
            verdict = classify(read_junit(report(body, PASSED)), 1, OWN)
            assert verdict.kind == "caught", (test, verdict)
            assert verdict.by == (f"tests/unit/test_x.py::TestA::{test}",)

    def test_another_exception_is_unknown_even_with_exit_status_1(self):
        verdict = classify(read_junit(report(TYPE_ERROR, PASSED)), 1, OWN)
        assert verdict.kind == "unknown" and "TypeError" in verdict.detail

    def test_a_fixture_or_start_up_error_is_unknown(self):
        verdict = classify(read_junit(report(FIXTURE, PASSED)), 1, OWN)
        assert verdict.kind == "unknown" and "error" in verdict.detail

    def test_a_claim_failure_beside_an_unrelated_error_still_catches(self):
        verdict = classify(read_junit(report(FIXTURE, ASSERTION)), 1, OWN)
        assert verdict.kind == "caught" and verdict.by == ("tests/unit/test_x.py::TestA::test_a",)


class TestNothingElseReadsAsACatch:
    def test_a_timeout_is_unknown_whatever_ran_before_it(self):
        assert classify(read_junit(report(PASSED)), None, OWN).kind == "unknown"
        assert classify([], None, OWN).kind == "unknown"

    def test_a_collection_error_is_unknown(self):
        # pytest exits 2 (interrupted) with no test case, or only the collection's error case
        assert classify([], 2, OWN).kind == "unknown"
        collect = case("tests.unit.test_x", '<error message="collection failure">E   SyntaxError: x\n\n'
                                            "tests/unit/test_x.py:1: SyntaxError</error>", cls="")
        assert classify(read_junit(report(collect)), 2, OWN).kind == "unknown"

    def test_skipped_tests_are_unknown_not_survived(self):
        assert classify(read_junit(report(SKIPPED, PASSED)), 0, OWN).kind == "unknown"

    def test_all_passed_is_survived(self):
        verdict = classify(read_junit(report(PASSED, PASSED)), 0, OWN)
        assert verdict.kind == "survived" and "2 test(s)" in verdict.detail


def test_every_mutation_names_a_known_venv_and_a_claim():
    names = [m.name for m in MUTATIONS]
    assert len(names) == len(set(names))
    for m in MUTATIONS:
        assert m.venv == "core" or m.venv in VENVS, m.name
        assert m.tests and m.claim and m.edits, m.name


def test_every_mutation_applies_to_the_code_as_it_is():
    # the main suite fails in a second where a line a mutation edits has moved, rather than the
    # mutation check failing at its end
    assert [why for why in map(stale, MUTATIONS) if why] == []
