"""The command line, run in the user's shell: the typer app (:mod:`~ftstate.cli.main`), trail views and
pictures, the docs generator, and :mod:`ftstate.cli.demo`."""

from ftstate.cli.main import main

__all__ = ["main"]
