"""The user's code as a worker host sees it: the errors it raises, marked with the method and
the user's own frames (which the controller puts in front of the caller), and which optional
hooks the user's class really overrides.
"""

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
    """The user's part of ``exc``'s traceback: ``(where, frames)``. frames: the frames outside
    ftstate and the standard library, formatted as ``traceback`` does (bounded); where: the
    innermost of them that is the user's own file (outside ``site-packages`` too: a library
    the user called is not where they look first), ``file:line in function``."""
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
    """Note on ``exc`` (as attributes, which travel with it through Ray's pickling) which user
    method raised it and where in the user's code; the first marking (the innermost call) wins."""
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
    """Whether the user's class defines ``hook`` itself rather than inheriting the base
    worker's default (which says "not provided"): the optional hooks (``held_weights``,
    ``load_weights_part``) change what the host does, so only a real override counts."""
    from ftstate.core import worker

    fn = getattr(type(user), hook, None)
    defaults = (getattr(worker.RolloutWorker, hook, None), getattr(worker.TrainerWorker, hook, None))
    return fn is not None and fn not in defaults
