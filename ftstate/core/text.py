"""Text that reaches a person (messages, logs, audit records), in any process: :func:`clean` strips terminal
escapes, which would garble a screen or hide and fake trail lines, and :func:`bounded` keeps one hostile value
from making a message of megabytes."""

from __future__ import annotations

import functools
import re
import reprlib
from collections.abc import Iterable

#: ANSI/VT100 escape sequences: CSI (``ESC [ ... final``), OSC (``ESC ] ... BEL|ST``) and
#: the two-byte ones (``ESC x``).
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
#: Other control characters (not tab or newline), including a stray ESC and C1 controls.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def strip_ansi(text: str) -> str:
    """``text`` without terminal escape sequences."""
    return _ANSI.sub("", text)


def clean(text: str) -> str:
    """``text`` without terminal escapes and control characters (tab and newline stay)."""
    return _CONTROL.sub("", _ANSI.sub("", text))


def bounded(text: str, limit: int = 2000) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


@functools.cache
def _repr_of_width(width: int) -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxstring = r.maxother = width
    r.maxlist = r.maxdict = 6
    r.maxlong = 40
    r.maxlevel = 3
    return r


def short_repr(value: object, width: int = 80) -> str:
    """A bounded repr of a value from outside (a config file, the environment, the wire), for error messages:
    strings and other values cut near ``width``, at most 6 items of a container, 3 levels deep."""
    try:
        return _repr_of_width(width).repr(value)
    except Exception:  # noqa: BLE001 - the repr of hostile data must never be the crash
        return f"<{type(value).__name__}>"


def listed(items: Iterable[object], first: int = 5, sep: str = "; ") -> str:
    """The first ``first`` of ``items`` joined by ``sep``, then "and N more", so a message stays one line (the
    full list belongs in attributes and the trail)."""
    items = [str(i) for i in items]
    shown = sep.join(bounded(i, 300) for i in items[:first])
    return f"{shown}{sep}and {len(items) - first} more" if len(items) > first else shown


__all__ = ["bounded", "clean", "listed", "short_repr", "strip_ansi"]
