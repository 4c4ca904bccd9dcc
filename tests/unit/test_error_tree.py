"""The tree drawn in ``ftstate/core/errors.py``'s docstring is the class tree: every error
class is drawn, under its own parent, and nothing drawn is missing from the module. A usage
error stays outside the FTError tree (httpx's way): a handler of faults never catches it."""

from __future__ import annotations

import re

import ftstate
from ftstate.core import errors

DRAWN = re.compile(r"^    (?P<lead>(?:│   |    )*)(?:├── |└── )?(?P<name>[A-Z][A-Za-z]+)\s")


def drawn_tree() -> dict[str, str | None]:
    """Each class drawn in the docstring, with the class drawn above it (None for a root)."""
    parents: dict[str, str | None] = {}
    stack: list[str] = []
    for line in errors.__doc__.splitlines():
        m = DRAWN.match(line + " ")
        if m is None or not hasattr(errors, m.group("name")):
            continue
        depth = len(m.group("lead")) // 4 + (1 if ("├── " in line or "└── " in line) else 0)
        del stack[depth:]
        parents[m.group("name")] = stack[-1] if stack else None
        stack.append(m.group("name"))
    return parents


def test_the_drawn_tree_is_the_class_tree():
    drawn = drawn_tree()
    classes = {n: getattr(errors, n) for n in errors.__all__}
    assert set(drawn) == set(classes), (set(classes) - set(drawn), set(drawn) - set(classes))
    for name, cls in classes.items():
        ours = [b.__name__ for b in cls.__bases__ if b.__name__ in classes]
        assert drawn[name] == (ours[0] if ours else None), (name, drawn[name], ours)


def test_usage_errors_are_outside_the_fault_tree_and_exported():
    assert not issubclass(errors.UsageError, errors.FTError)
    assert issubclass(errors.UsageError, RuntimeError)
    assert set(errors.__all__) <= set(ftstate.__all__)
