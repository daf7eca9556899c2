"""Rerun lines name the run's interpreter (issue 26, point 6): ``python`` only when that is the
first ``python`` on PATH, else ``sys.executable``, so a line pasted into another shell runs under
the interpreter that has torch and the harness."""

from __future__ import annotations

import os
import sys

from conformance import reporting


def _bin_with_python(tmp_path, target: str):
    directory = tmp_path / "bin"
    directory.mkdir()
    os.symlink(target, directory / "python")
    return directory


def test_a_python_elsewhere_on_path_gives_the_interpreter_path(tmp_path, monkeypatch):
    other = _bin_with_python(tmp_path, "/bin/sh")  # "python" on PATH: not this interpreter
    monkeypatch.setenv("PATH", str(other))
    assert reporting.python_command() == sys.executable
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no python on PATH at all
    assert reporting.python_command() == sys.executable
    monkeypatch.delenv(reporting.LAUNCHER_ENV, raising=False)
    assert reporting.rerun_options(_Opt(), _Opt()).launcher == f"{sys.executable} -m conformance"


def test_the_first_python_on_path_gives_python(monkeypatch):
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))
    if os.path.basename(sys.executable) != "python":
        monkeypatch.setattr(
            sys, "executable", os.path.join(os.path.dirname(sys.executable), "python")
        )
    assert reporting.python_command() == "python"


class _Opt:
    """The options rerun_options reads, at their defaults."""

    def __init__(self):
        from conformance import expectations, options

        self.expectations_dir = expectations.DEFAULT_DIR
        self.check_timeout = options.DEFAULT_CHECK_TIMEOUT
        self.grace, self.threads_per_rank = 5.0, 1
        self.check_dir, self.respawn_every_check, self.fuzz_examples = [], False, None
