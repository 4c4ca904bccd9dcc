"""The command line and what it shows: ``ftstate demo``, ``audit``, ``diagram``, ``config``.

:mod:`~ftstate.cli.main` is the typer app; :mod:`~ftstate.cli.audit_view` renders a trail
as a timeline, :mod:`~ftstate.cli.plot` draws it (matplotlib, the ``plot`` extra),
:mod:`~ftstate.cli.docs` regenerates the reference docs, and :mod:`ftstate.cli.demo` is the
main job: real RL on a local Ray cluster with workers SIGKILLed along the way (or, with
``--maintenance``, a node drained ahead of a cloud's maintenance notice).
"""

from ftstate.cli.main import main

__all__ = ["main"]
