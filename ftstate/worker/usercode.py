"""The user's code as a worker host sees it: its errors marked with the method and user frames, and which
optional hooks the user's class really overrides."""

from __future__ import annotations

import os
import sysconfig
import traceback
from typing import Any

from ftstate.core.errors import WorkerInitError
from ftstate.core.text import bounded, clean

_FTSTATE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


def user_frames(exc: BaseException) -> tuple[str, str]:
    """The user's part of ``exc``'s traceback: ``(where, frames)``, frames outside ftstate and the standard
    library (bounded), ``where`` the innermost in the user's own files (not site-packages)."""
    outside = [f for f in traceback.extract_tb(exc.__traceback__)
               if not f.filename.startswith("<")
               and not os.path.abspath(f.filename).startswith((_FTSTATE_DIR, _STDLIB_DIR))]
    own = [f for f in outside if f"{os.sep}site-packages{os.sep}" not in f.filename] or outside
    where = f"{own[-1].filename}:{own[-1].lineno} in {own[-1].name}" if own else ""
    return where, bounded(clean("".join(traceback.format_list(outside[-20:]))), 8000)


def init_error(member: str, role: str, user_cls: Any, exc: BaseException) -> WorkerInitError:
    """The :class:`~ftstate.core.errors.WorkerInitError` of a user class that could not start."""
    where, frames = user_frames(exc)
    return WorkerInitError(member=member, role=role, cls=getattr(user_cls, "__name__", repr(user_cls)),
                           exc_type=type(exc).__name__, message=bounded(clean(str(exc))), where=where,
                           traceback=frames)


def mark_user_error(exc: BaseException, method: str) -> None:
    """Mark ``exc`` (attributes survive Ray's pickling) with the user method that raised it and where; the
    innermost marking wins."""
    if getattr(exc, "ftstate_method", None):
        return
    where, frames = user_frames(exc)
    try:
        exc.ftstate_method = method  # type: ignore[attr-defined]
        exc.ftstate_where = where  # type: ignore[attr-defined]
        exc.ftstate_frames = frames  # type: ignore[attr-defined]
    except (AttributeError, TypeError):  # an exception class without a __dict__: reported without them
        pass


def overrides(user: Any, hook: str) -> bool:
    """Whether the user's class defines ``hook`` itself rather than inheriting the "not provided" default:
    optional hooks change what the host does."""
    from ftstate.core import worker

    fn = getattr(type(user), hook, None)
    defaults = (getattr(worker.RolloutWorker, hook, None), getattr(worker.TrainerWorker, hook, None))
    return fn is not None and fn not in defaults
