"""The README and docs say what the code does: every ```python block of README.md and docs/*.md
is checked against the public API, and a block that is a complete program is run.

Static checks, per block (each failure names the file, the line in it and the wrong name):

* it parses and compiles (top-level ``await``/``async with`` allowed, as in ``python -m asyncio``);
* ``ftstate.NAME`` is in ``ftstate.__all__`` (or a subpackage the block imports), and every
  attribute read further down the chain exists (``ftstate.RuntimeConfig.from_dict``);
  ``from ftstate... import NAME`` imports;
* a call of anything ftstate (``ftstate.Runtime(...)``, ``RuntimeConfig.from_dict(...)``, a method
  of the runtime) binds to its real signature: no unknown keyword, no missing argument;
* the keys of a dict literal given to ``RuntimeConfig.from_dict`` are config fields, nested
  blocks included (``fault_tolerance.enable``: :func:`ftstate.core.config.leaf_paths`);
* on a runtime (a name bound by ``async with ftstate.Runtime(...) as rt`` or ``rt = ...``) only
  public attributes of :class:`ftstate.Runtime` are used, and what ``await rt.sync()`` returns
  is read only for :class:`ftstate.SyncReport` fields;
* a worker class defined in the block and handed to the runtime subclasses the right base,
  implements the hooks the runtime needs (``state_dict``, ``load_weights``), overrides base
  hooks with signatures the runtime can call, and defines every method the block calls by name
  (``rt.trainer("train_step", ...)``); a method named almost like a hook is flagged as a typo.
  Other methods are the user's own and are not constrained.

A block or a reference that imports an integration whose framework is not installed here
(``ftstate.integrations.vllm`` without vLLM: ``IntegrationUnavailable``) cannot be bound to real
objects in this venv: the block is skipped naming the extra, and the suite of that extra
checks it (``tests/vllm/test_vllm_docs.py``, in ``make test-vllm``).

A block that uses no name it does not define and compiles without top-level ``await`` is a
complete program: it is run for real (on the session's Ray cluster when it uses a Runtime).
Inline code in the prose naming a module path (``ftstate.core.spec``, ``ftstate/core/config.py``)
must name one that exists.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import dataclasses
import difflib
import importlib
import inspect
import io
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ftstate
from ftstate.core.config import leaf_paths
from ftstate.core.errors import IntegrationUnavailable
from ftstate.core.worker import Worker
from tests.integration.conftest import ray_cluster  # noqa: F401 - the session's Ray cluster, for runnable blocks

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$")

#: Hooks the runtime calls on a worker class handed to it, which the base does not implement.
REQUIRED_HOOKS = {"trainer": ("state_dict",), "rollout": ("load_weights",)}
WORKER_BASES = {"trainer": ftstate.TrainerWorker, "rollout": ftstate.RolloutWorker}
#: Runtime methods whose first argument names a method of the worker class of that role.
BY_NAME_CALLS = {"trainer": "trainer", "rollout": "rollout", "rollout_map": "rollout"}


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int  # the line of the block's first code line in the file
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}:{self.line}"

    def at(self, node: ast.AST | int) -> str:
        """``README.md:42``: where ``node`` (or a block line number) is in the file."""
        line = node if isinstance(node, int) else getattr(node, "lineno", 1)
        return f"{self.path.relative_to(ROOT).as_posix()}:{self.line + line - 1}"


def python_blocks(path: Path) -> Iterator[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m["fence"], (m["info"].strip().split() or [""])[0].lower()
        body_start = i + 1
        j = body_start
        while j < len(lines) and not re.match(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            j += 1
        if lang in {"python", "py", "python3"}:
            indent = len(m["indent"])
            code = "\n".join(line[indent:] for line in lines[body_start:j]) + "\n"
            yield Block(path, body_start + 1, code)
        i = j + 1


BLOCKS = [b for path in DOCS for b in python_blocks(path)]


def parse(block: Block) -> ast.Module:
    return ast.parse(block.code, filename=block.name)


# -- what the block's names are bound to ----------------------------------------------------


def is_runnable(block: Block) -> bool:
    """A complete program: compiles without top-level await and uses no name it does not define."""
    try:
        compile(block.code, block.name, "exec")
    except SyntaxError:
        return False
    return not undefined_names(parse(block))


def undefined_names(tree: ast.Module) -> set[str]:
    bound: set[str] = set()
    loaded: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound - set(dir(builtins))


class Unknown:
    """What an expression the checker cannot evaluate resolves to."""


UNKNOWN = Unknown()
#: What an inline reference into an integration whose framework is not installed resolves to.
NEEDS_EXTRA = Unknown()


class Checker:
    """Static checks of one block against the real objects of the public API."""

    def __init__(self, block: Block) -> None:
        self.block = block
        self.tree = parse(block)
        self.problems: list[str] = []
        self.names: dict[str, Any] = {}  # local name -> the ftstate object it is bound to
        self.submodules: set[str] = set()  # "ftstate.transport" when the block imports it
        self.runtimes: set[str] = set()  # names bound to a Runtime
        self.reports: set[str] = set()  # names bound to what `await rt.sync()` returns
        self.classes = {n.name: n for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)}
        self._runtime = runtime_instance()

    def problem(self, node: ast.AST, text: str) -> None:
        message = f"{self.block.at(node)}: {text}"
        if message not in self.problems:
            self.problems.append(message)

    # -- resolving expressions to ftstate objects ------------------------------------------

    def resolve(self, node: ast.AST) -> Any:
        """The ftstate object ``node`` stands for, UNKNOWN if not an ftstate name (or broken)."""
        if isinstance(node, ast.Name):
            return self.names.get(node.id, UNKNOWN)
        if isinstance(node, ast.Attribute):
            owner = self.resolve(node.value)
            if owner is UNKNOWN:
                return UNKNOWN
            if owner is ftstate:
                sub = f"ftstate.{node.attr}"
                if node.attr not in ftstate.__all__ and sub not in self.submodules:
                    self.problem(node, f"`{sub}` is not a public name of ftstate (not in ftstate.__all__)")
                    return UNKNOWN
                return importlib.import_module(sub) if sub in self.submodules else getattr(ftstate, node.attr)
            try:
                return getattr(owner, node.attr)
            except AttributeError:
                self.problem(node, f"`{ast.unparse(node)}`: {describe(owner)} has no attribute {node.attr!r}")
                return UNKNOWN
        return UNKNOWN

    def bind_imports(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "ftstate" or alias.name.startswith("ftstate."):
                        if alias.asname:
                            self.names[alias.asname] = self.import_module(node, alias.name)
                        else:
                            self.names["ftstate"] = ftstate
                            if alias.name != "ftstate":
                                self.import_module(node, alias.name)
                                parts = alias.name.split(".")
                                self.submodules |= {".".join(parts[:k]) for k in range(2, len(parts) + 1)}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module != "ftstate" and not node.module.startswith("ftstate."):
                    continue
                module = self.import_module(node, node.module)
                if module is None:
                    continue
                for alias in node.names:
                    if hasattr(module, alias.name):
                        self.names[alias.asname or alias.name] = getattr(module, alias.name)
                    else:
                        try:
                            self.names[alias.asname or alias.name] = importlib.import_module(
                                f"{node.module}.{alias.name}"
                            )
                        except ImportError:
                            self.problem(node, f"`from {node.module} import {alias.name}`: no such name")

    def import_module(self, node: ast.AST, name: str) -> Any:
        try:
            return importlib.import_module(name)
        except IntegrationUnavailable as exc:
            pytest.skip(f"{self.block.at(node)} imports {name}, which needs ftstate[{exc.extra}] "
                        f"(checked in that extra's suite)")
        except ImportError as exc:
            self.problem(node, f"`import {name}`: {exc}")
            return None

    # -- the checks ------------------------------------------------------------------------

    def run(self) -> list[str]:
        self.bind_imports()
        self.find_runtimes_and_reports()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Attribute):
                self.resolve(node)
                self.check_runtime_and_report_attribute(node)
            elif isinstance(node, ast.Call):
                self.check_call(node)
        for cls in self.classes.values():
            self.check_worker_class(cls)
        return self.problems

    def find_runtimes_and_reports(self) -> None:
        def is_runtime_call(expr: ast.AST | None) -> bool:
            return isinstance(expr, ast.Call) and self.resolve(expr.func) is ftstate.Runtime

        for node in ast.walk(self.tree):
            if isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    if is_runtime_call(item.context_expr) and isinstance(item.optional_vars, ast.Name):
                        self.runtimes.add(item.optional_vars.id)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and is_runtime_call(node.value):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                self.runtimes |= {t.id for t in targets if isinstance(t, ast.Name)}
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and self.is_sync(node.value):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                self.reports |= {t.id for t in targets if isinstance(t, ast.Name)}

    def is_sync(self, expr: ast.AST | None) -> bool:
        """``await rt.sync()`` on a runtime of this block."""
        return (
            isinstance(expr, ast.Await)
            and isinstance(expr.value, ast.Call)
            and isinstance(expr.value.func, ast.Attribute)
            and expr.value.func.attr == "sync"
            and isinstance(expr.value.func.value, ast.Name)
            and expr.value.func.value.id in self.runtimes
        )

    def check_runtime_and_report_attribute(self, node: ast.Attribute) -> None:
        value = node.value
        if isinstance(value, ast.Name) and value.id in self.runtimes:
            public = sorted(a for a in dir(self._runtime) if not a.startswith("_"))
            if node.attr not in public:
                self.problem(node, f"`{ast.unparse(node)}`: ftstate.Runtime has no public attribute {node.attr!r}"
                             f"{did_you_mean(node.attr, public)}")
        elif (isinstance(value, ast.Name) and value.id in self.reports) or self.is_sync(value):
            fields = [f.name for f in dataclasses.fields(ftstate.SyncReport)]
            if node.attr not in fields:
                self.problem(node, f"`{ast.unparse(node)}`: ftstate.SyncReport has no field {node.attr!r} "
                             f"(its fields: {', '.join(fields)}){did_you_mean(node.attr, fields)}")

    def callee(self, call: ast.Call) -> Any:
        """The real ftstate callable a call reaches (a runtime's bound method included)."""
        func = call.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in self.runtimes:
            return getattr(self._runtime, func.attr, UNKNOWN)
        return self.resolve(func)

    def check_call(self, call: ast.Call) -> None:
        target = self.callee(call)
        if target is UNKNOWN or not callable(target) or isinstance(target, types.ModuleType):
            return
        starred = any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords)
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            return
        if not starred:
            try:
                signature.bind(*call.args, **{k.arg: k.value for k in call.keywords if k.arg})
            except TypeError as exc:
                self.problem(call, f"`{ast.unparse(call.func)}(...)`: {exc} (signature: {signature})")
        if target == ftstate.RuntimeConfig.from_dict:
            data = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "data"), None)
            if isinstance(data, ast.Dict):
                self.check_config_keys(data, "")
        if target is ftstate.Runtime:
            self.check_runtime_classes(call)

    def check_config_keys(self, data: ast.Dict, prefix: str) -> None:
        paths = leaf_paths()
        for key, value in zip(data.keys, data.values, strict=True):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                continue
            path = f"{prefix}{key.value}"
            is_block = any(p.startswith(f"{path}.") for p in paths)
            if path in paths:
                continue
            if is_block:
                if isinstance(value, ast.Dict):
                    self.check_config_keys(value, f"{path}.")
                continue
            self.problem(key, f"config key {path!r} is not a field of ftstate.RuntimeConfig"
                         f"{did_you_mean(path, sorted(paths))}")

    def check_runtime_classes(self, call: ast.Call) -> None:
        for kw in call.keywords:
            if kw.arg not in WORKER_BASES or not isinstance(kw.value, ast.Name):
                continue
            cls = self.classes.get(kw.value.id)
            if cls is None:
                continue
            role = kw.arg
            if not self.subclasses(cls, WORKER_BASES[role]):
                self.problem(cls, f"class {cls.name} is passed as {role}= but does not subclass "
                             f"ftstate.{WORKER_BASES[role].__name__}")
                continue
            methods = self.methods(cls)
            for hook in REQUIRED_HOOKS[role]:
                if hook not in methods:
                    self.problem(cls, f"class {cls.name} ({role}) does not define {hook}(), which the runtime calls")
            for node in ast.walk(self.tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name) and node.func.value.id in self.runtimes
                        and BY_NAME_CALLS.get(node.func.attr) == role and node.args
                        and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                    continue
                name = node.args[0].value
                if name not in methods and not hasattr(WORKER_BASES[role], name):
                    self.problem(node, f"`rt.{node.func.attr}({name!r}, ...)`: {cls.name} has no method {name!r}"
                                 f"{did_you_mean(name, sorted(methods))}")

    def subclasses(self, cls: ast.ClassDef, base: type) -> bool:
        for b in cls.bases:
            real = self.resolve(b)
            if isinstance(real, type) and issubclass(real, base):
                return True
            if isinstance(b, ast.Name) and b.id in self.classes and self.subclasses(self.classes[b.id], base):
                return True
        return False

    def methods(self, cls: ast.ClassDef) -> set[str]:
        """Methods the class defines, with those of its bases defined in the block and of real
        bases below ftstate's own (e.g. ``VLLMRollout``, which implements ``load_weights``)."""
        own = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for b in cls.bases:
            if isinstance(b, ast.Name) and b.id in self.classes:
                own |= self.methods(self.classes[b.id])
            real = self.resolve(b)
            if isinstance(real, type):
                for klass in real.__mro__:
                    if klass in (*WORKER_BASES.values(), Worker, object):
                        break
                    own |= {n for n, v in vars(klass).items() if callable(v)}
        return own

    def check_worker_class(self, cls: ast.ClassDef) -> None:
        base = next((b for b in WORKER_BASES.values() if self.subclasses(cls, b)), None)
        if base is None:
            return
        hooks = {n for n in dir(base) if not n.startswith("_") and callable(getattr(base, n))}
        for fn in cls.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name.startswith("_"):
                continue
            if fn.name in hooks:
                self.check_override(cls, fn, getattr(base, fn.name))
                continue
            close = difflib.get_close_matches(fn.name, sorted(hooks), n=1, cutoff=0.85)
            if close:
                self.problem(fn, f"{cls.name}.{fn.name}() is not a hook of ftstate.{base.__name__}: "
                             f"did you mean {close[0]}()?")

    def check_override(self, cls: ast.ClassDef, fn: ast.FunctionDef | ast.AsyncFunctionDef, hook: Any) -> None:
        """The runtime calls the hook with the base's positional parameters: the override must take them."""
        wanted = [p for p in list(inspect.signature(hook).parameters.values())[1:]
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        args = fn.args
        positional = [*args.posonlyargs, *args.args][1:]  # without self
        required = len(positional) - len(args.defaults)
        takes = len(wanted) <= len(positional) or args.vararg is not None
        if not takes or required > len(wanted):
            self.problem(fn, f"{cls.name}.{fn.name}({', '.join(a.arg for a in positional)}) cannot be called as "
                         f"the runtime calls it: {fn.name}({', '.join(p.name for p in wanted)})")


def describe(obj: Any) -> str:
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__}"
    if isinstance(obj, type):
        return f"{obj.__module__.split('.')[0]}.{obj.__qualname__}"
    return repr(obj)


def did_you_mean(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


_RUNTIME: list[Any] = []


def runtime_instance() -> Any:
    """An unstarted Runtime: its public attributes include those set in ``__init__``."""
    if not _RUNTIME:
        _RUNTIME.append(ftstate.Runtime(ftstate.RuntimeConfig(), trainer=ftstate.TrainerWorker,
                                        rollout=ftstate.RolloutWorker))
    return _RUNTIME[0]


# -- the tests -------------------------------------------------------------------------------


def test_the_docs_have_python_blocks_to_check() -> None:
    names = {b.path.name for b in BLOCKS}
    assert {"README.md", "integration.md"} <= names, names
    assert any(is_runnable(b) for b in BLOCKS), "no block is a complete program any more"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_a_python_block_compiles(block: Block) -> None:
    try:
        tree = parse(block)
        compile(tree, block.name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as exc:
        pytest.fail(f"{block.at(exc.lineno or 1)}: the python block does not compile: {exc.msg}")


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_a_python_block_uses_only_the_real_public_api(block: Block) -> None:
    problems = Checker(block).run()
    assert not problems, "\n".join(problems)


RUNNABLE = [
    pytest.param(b, id=b.name, marks=[pytest.mark.ray] if "Runtime" in b.code else [])
    for b in BLOCKS
    if is_runnable(b)
]


@pytest.mark.parametrize("block", RUNNABLE)
def test_a_complete_program_runs(block: Block, request: pytest.FixtureRequest, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    if "Runtime" in block.code:
        request.getfixturevalue("ray_cluster")  # the program's Runtime joins it
    monkeypatch.chdir(tmp_path)  # what the program writes (an audit log) stays in tmp_path
    # A module name nobody can import: Ray's cloudpickle ships the program's classes by value,
    # as it does for a user's script run as __main__.
    module = f"ftstate_docs_example_{abs(hash(block.name))}"
    assert module not in sys.modules
    # An exception propagates with the block's name as its file (traceback lines count from
    # the block's first line).
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(block.code, block.name, "exec"), {"__name__": module})


INLINE = re.compile(r"`(ftstate(?:\.[A-Za-z_][A-Za-z0-9_]*)+|ftstate/[A-Za-z0-9_/]+\.py)(?:\(\))?`")


def inline_references() -> list[tuple[str, str]]:
    refs = []
    for path in DOCS:
        in_fence = False
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if FENCE.match(line):
                in_fence = not in_fence
                continue
            if not in_fence:
                refs += [(f"{path.relative_to(ROOT).as_posix()}:{n}", m[1]) for m in INLINE.finditer(line)]
    return refs


def resolve_reference(ref: str) -> Any:
    """What a dotted ``ftstate....`` reference names: the longest importable prefix, then
    attributes (UNKNOWN where one is missing, None where nothing imports; NEEDS_EXTRA inside an
    integration whose framework is not installed)."""
    parts = ref.split(".")
    obj: Any = None
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except IntegrationUnavailable:
            return NEEDS_EXTRA  # its framework is not here: its own suite checks it
        except ImportError:
            continue
        for attr in parts[k:]:
            obj = getattr(obj, attr, UNKNOWN)
        break
    return obj


def test_the_docs_name_modules_and_objects_that_exist() -> None:
    refs = inline_references()
    assert refs, "no inline reference found: is the pattern still right?"
    problems = []
    for where, ref in refs:
        if "/" in ref:
            if not (ROOT / ref).is_file():
                problems.append(f"{where}: `{ref}` does not exist")
            continue
        obj = resolve_reference(ref)
        if obj is UNKNOWN or obj is None:
            problems.append(f"{where}: `{ref}` names nothing that exists")
    assert not problems, "\n".join(problems)


# -- the checker itself: each kind of drift is caught, naming the line and the wrong name ----

GOOD = '''import ftstate

class T(ftstate.TrainerWorker):
    def state_dict(self): ...
    def step(self, n): ...

class R(ftstate.RolloutWorker):
    def load_weights(self, state, version): ...
    def generate(self, prompts): ...

cfg = ftstate.RuntimeConfig.from_dict({"rollout_workers": 2, "fault_tolerance": {"enable": True}})
async with ftstate.Runtime(cfg, trainer=T, rollout=R) as rt:
    await rt.trainer("step", 1)
    report = await rt.sync()
    print(report.weights_version, report.nbytes, rt.weights_version)
    await rt.rollout_map("generate", [1, 2])
'''


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("report.nbytes", "report.bytes", "README.md:15: `report.bytes`: ftstate.SyncReport has no field 'bytes'"),
        ("rt.weights_version)", "rt.version)", "README.md:15: `rt.version`: ftstate.Runtime has no public attribute"),
        ('"enable": True', '"enabled": True', "config key 'fault_tolerance.enabled' is not a field"),
        ('"rollout_workers"', '"rollouts"', "README.md:11: config key 'rollouts' is not a field"),
        ("trainer=T,", "trainer=T, trainer_kwarg={},", "README.md:12: `ftstate.Runtime(...)`: got an unexpected"),
        ("from_dict(", "from_dicts(", "ftstate.RuntimeConfig has no attribute 'from_dicts'"),
        ("ftstate.Runtime(", "ftstate.Runtimes(", "`ftstate.Runtimes` is not a public name of ftstate"),
        ('rt.trainer("step"', 'rt.trainer("stepp"', "README.md:13: `rt.trainer('stepp', ...)`: T has no method"),
        ("def load_weights(self, state, version)", "def load_weights(self, state)",
         "R.load_weights(state) cannot be called as the runtime calls it: load_weights(state, version)"),
        ("def load_weights(", "def load_weight(", "R.load_weight() is not a hook of ftstate.RolloutWorker: did you"),
        ("def state_dict(self)", "def get_state(self)", "class T (trainer) does not define state_dict()"),
        ("import ftstate\n", "import ftstate\nfrom ftstate.core.config import leaf_path\n", "no such name"),
    ],
)
def test_the_checker_catches_drift(old: str, new: str, expected: str) -> None:
    assert Checker(Block(ROOT / "README.md", 1, GOOD)).run() == []
    assert old in GOOD
    problems = Checker(Block(ROOT / "README.md", 1, GOOD.replace(old, new, 1))).run()
    assert any(expected in p for p in problems), problems
