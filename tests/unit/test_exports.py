"""The public surface: what `ftstate` exports, and that importing it loads no Ray or torch."""

from __future__ import annotations

import subprocess
import sys

import ftstate


def test_all_names_resolve():
    for name in ftstate.__all__:
        assert getattr(ftstate, name) is not None, name


def test_every_error_derives_from_fterror():
    from ftstate import errors

    for name in errors.__all__:
        assert issubclass(getattr(errors, name), ftstate.FTError), name


def test_importing_the_core_loads_neither_ray_nor_torch():
    code = (
        "import sys, ftstate, ftstate.spec, ftstate.machine, ftstate.audit, ftstate.config, ftstate.deadline;"
        "bad = [m for m in ('ray', 'torch') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
