"""The layout is the architecture: rooms that depend inward only, a core without Ray or
torch, no import circles, no module over 800 lines or leaning on another's private names, and
prose (docstrings, comments) at most 18% of the lines.

Rooms, innermost first: ``core`` (pure), ``transport`` (moves bytes; imports the core),
``worker`` (runs inside a worker process; imports core and transport, never the controller),
``controller`` (drives machines from Ray events; imports core and transport, and the worker only
from its Ray adapter, which starts the worker's actor),
``simulation`` (the controller's backend in virtual time; imports core, transport and
controller), ``integrations`` and ``cli`` (outermost). Every import counts, including those inside
functions and under ``TYPE_CHECKING``: a lazy import is still a dependency, and a circle
through one is still a circle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import ftstate

PACKAGE = Path(ftstate.__file__).resolve().parent
ROOMS = ("core", "transport", "worker", "controller", "simulation", "integrations", "cli")
#: What each room may import from the package (itself included).
ALLOWED = {
    "core": {"core"},
    "transport": {"core", "transport"},
    "worker": {"core", "transport", "worker"},
    "controller": {"core", "transport", "controller"},
    "simulation": {"core", "transport", "controller", "simulation"},
    "integrations": {"core", "transport", "controller", "integrations"},
    # the demo's --engine vllm runs the vLLM integration as any user would
    "cli": {"core", "transport", "controller", "simulation", "integrations", "cli"},
}
#: The one controller module that may import the worker: the Ray adapter names the actor class it starts.
STARTS_WORKERS = {"ftstate.controller.ray.backend": {"worker"}}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Package modules ``path`` imports (``from ftstate.x import y`` counts ``ftstate.x.y`` when
    that is a module, else ``ftstate.x``)."""
    out: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        out.update(n for n in names if n == "ftstate" or n.startswith("ftstate."))
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    # The top-level package only re-exports; importing it is not a dependency on its contents.
    return {name: {d for d in imports_of(path, known) if d != "ftstate" and d != name}
            for name, path in mods.items()}


def room(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else None


def test_every_module_lives_in_a_room() -> None:
    loose = [n for n in modules() if n not in ("ftstate", "ftstate.__main__") and room(n) is None]
    assert not loose, f"modules outside core/transport/worker/controller/simulation/integrations/cli: {loose}"


def test_rooms_depend_inward_only() -> None:
    wrong = []
    for name, deps in graph().items():
        r = room(name)
        if r is None:
            continue
        for d in deps:
            if room(d) not in ALLOWED[r] | STARTS_WORKERS.get(name, set()):
                wrong.append(f"{name} imports {d}")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_the_package_has_no_import_circle() -> None:
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for d in sorted(g.get(n, ())):
            if state.get(d) == 1:
                cycles.append([*stack[stack.index(d):], d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[n] = 2

    for n in sorted(g):
        if n not in state:
            visit(n)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_detector_sees_a_circle_and_a_wrong_way_import(tmp_path, monkeypatch) -> None:
    """The two checks above would fail on a circle through a lazy import, and on the core
    importing the controller (checked on a scratch package laid out like ftstate)."""
    pkg = tmp_path / "ftstate"
    for d in ("core", "controller"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("def f():\n    from ftstate.controller import b\n")
    (pkg / "controller" / "b.py").write_text("from ftstate.core.a import f\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    with pytest.raises(AssertionError, match=r"ftstate\.controller\.b -> ftstate\.core\.a -> ftstate\.controller\.b"):
        test_the_package_has_no_import_circle()
    with pytest.raises(AssertionError, match=r"ftstate\.core\.a imports ftstate\.controller\.b"):
        test_rooms_depend_inward_only()


HEAVY = ("ray", "torch", "numpy", "zmq", "cupy", "ftstate.transport", "ftstate.controller", "ftstate.cli")


def test_the_core_imports_neither_ray_nor_torch() -> None:
    """In a fresh interpreter: the whole core, and ``import ftstate`` itself, load none of
    the heavy libraries nor any outer room."""
    core = sorted(n for n in modules() if room(n) == "core")
    code = (
        "import sys, importlib\n"
        f"for m in {core!r}: importlib.import_module(m)\n"
        "import ftstate\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} or m.startswith({HEAVY!r}[4:]))\n"
        "print('|'.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing the core loaded: {out}"


#: The controller's modules that may import Ray: its Ray adapter (the backend, joining the
#: cluster, placement groups).
RAY_MODULES = {"ftstate.controller.ray.backend", "ftstate.controller.ray.cluster", "ftstate.controller.ray.placement"}


def ray_importers() -> list[str]:
    """The controller's modules that import Ray anywhere (a lazy import counts)."""
    out = []
    for name, path in modules().items():
        if room(name) != "controller":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            if any(n == "ray" or n.startswith("ray.") for n in names):
                out.append(name)
                break
    return sorted(out)


def test_the_controller_reaches_ray_only_through_its_backend() -> None:
    found = ray_importers()
    assert "ftstate.controller.ray.backend" in found  # the check sees a lazy import
    stray = sorted(set(found) - RAY_MODULES)
    assert not stray, f"controller modules importing Ray outside the backend: {stray}"


#: The most lines a module may have: one concept, read in one sitting.
MAX_LINES = 800


def test_no_module_is_over_the_line_bound() -> None:
    long = {name: n for name, path in modules().items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines: split them by concept"


def private_imports(path: Path) -> list[str]:
    """``from ftstate.x import _y`` in ``path``: a module leaning on another's internals."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
                node.module == "ftstate" or node.module.startswith("ftstate.")):
            out.extend(f"from {node.module} import {a.name}" for a in node.names
                       if a.name.startswith("_") and not a.name.startswith("__"))
    return out


def test_no_module_imports_another_modules_private_names() -> None:
    found = {name: bad for name, path in modules().items() if (bad := private_imports(path))}
    assert found == {}, "make the name public where another module needs it"


def test_the_private_import_check_sees_one(tmp_path) -> None:
    leaning = tmp_path / "m.py"
    leaning.write_text("from ftstate.transport.sync import _secret, Public\nfrom ftstate import __version__\n")
    assert private_imports(leaning) == ["from ftstate.transport.sync import _secret"]


#: Other packages' private names read on purpose, by the module that reads them; each has no public way.
FOREIGN_PRIVATES = {
    # Ray: an actor handle's id is the key its actor has in the state API (report) and in verl's groups
    ("ftstate.cli.demo.report", "_actor_id"),
    ("ftstate.integrations.verl.manager", "_actor_id"),
    # Ray: ray._private has the actor state (report), the GCS's draining nodes (backend) and the worker
    # log switch (cluster), none of them public
    ("ftstate.cli.demo.report", "_private"),
    ("ftstate.controller.ray.backend", "_private"),
    ("ftstate.controller.ray.cluster", "_private"),
    # torch: ProcessGroupGloo's options and its default-timeout setter are how gloo gets its timeouts
    ("ftstate.transport.gloo", "_Options"),
    ("ftstate.transport.gloo", "_set_default_timeout"),
    # torch: a storage's use count (torch._C of its _cdata) tells whether anyone else holds a buffer
    ("ftstate.transport.sync", "_C"),
    ("ftstate.transport.sync", "_cdata"),
    # a namedtuple's public API is spelled with an underscore
    ("ftstate.integrations.vllm.held", "_replace"),
}


def private_reads(path: Path) -> list[str]:
    """Reads of ``x._name`` where ``x`` is not ``self``, ``cls`` or ``super()`` and this module defines no
    attribute ``_name`` (assigned, or named in a class body or ``__slots__``): as far as the syntax tells,
    a private of an object whose class lives elsewhere."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    defined: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            defined.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    defined.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    defined.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    names = [t.id for t in item.targets if isinstance(t, ast.Name)]
                    defined.update(names)
                    if "__slots__" in names:
                        defined.update(c.value for c in ast.walk(item.value)
                                       if isinstance(c, ast.Constant) and isinstance(c.value, str))

    def own(value: ast.expr) -> bool:
        return (isinstance(value, ast.Name) and value.id in ("self", "cls")) or (
            isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super")

    return [f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr.startswith("_")
            and not node.attr.startswith("__") and node.attr not in defined and not own(node.value)]


def test_no_module_reads_another_modules_private_attributes() -> None:
    found = {}
    for name, path in modules().items():
        bad = [r for r in private_reads(path) if (name, "_" + r.rsplit("._", 1)[1]) not in FOREIGN_PRIVATES]
        if bad:
            found[name] = bad
    assert found == {}, "give the object a public property or method for what another module reads"


def test_the_private_read_check_sees_one(tmp_path) -> None:
    leaning = tmp_path / "m.py"
    leaning.write_text("class A:\n    _own = 1\n\n    def f(self, other):\n"
                       "        return self._mine, other._own, other._theirs, super()._base\n")
    assert private_reads(leaning) == ["5: other._theirs"]


#: The most of the package's non-blank lines that may be docstrings and comments: the code says
#: why in a line; essays, figures and history live in docs/ and the commit bodies.
MAX_PROSE_SHARE = 0.18


def prose_lines(source: str) -> set[int]:
    """The lines of ``source`` that are a docstring (module, class, function) or a comment."""
    import io
    import tokenize

    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    lines.update(tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                 if tok.type == tokenize.COMMENT)
    return lines


def test_docstrings_and_comments_are_at_most_their_share() -> None:
    prose = total = 0
    for path in modules().values():
        source = path.read_text(encoding="utf-8")
        filled = {i for i, line in enumerate(source.splitlines(), 1) if line.strip()}
        total += len(filled)
        prose += len(prose_lines(source) & filled)
    assert prose / total <= MAX_PROSE_SHARE, f"{prose}/{total} lines of prose"


def test_the_prose_count_sees_docstrings_and_comments() -> None:
    source = '"""Module."""\n\nx = 1  # why\n\n\ndef f():\n    """Two\n    lines."""\n    return "not prose"\n'
    assert prose_lines(source) == {1, 3, 7, 8}
