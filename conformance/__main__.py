"""``python -m conformance [options] [pytest args]``: the conformance suite without nox.

Equivalent to ``python -m pytest -p conformance.plugin conformance/checks [--check-dir dirs] [args]``;
``python -m conformance --help`` lists the options (group "fsdp conformance"). Its exit codes are
described in docs/running.md ("Exit codes and signals") and in ``conformance.plugin.exit_status``.

``python -m conformance <subcommand> [args]`` runs one of :data:`SUBCOMMANDS` instead.
"""

import importlib
import sys
from pathlib import Path

import pytest

# name -> "module:function"; the function takes the remaining arguments and returns an exit code
SUBCOMMANDS: dict[str, str] = {
    "selftest": "conformance.selftest.run:main",  # seeded faults and the mutation score
    "diff": "conformance.diff:main",  # outcome changes between two runs' conformance.json
    "list-checks": "conformance.listing:main",  # each check's id, file and line, and SPEC ids
    "api-coverage": "conformance.apisurface.report:main",  # public API entries and their checks
    "report": "conformance.html:main",  # one HTML scoreboard from one or more runs
}


def _check_dirs(argv: list[str]) -> list[str]:
    dirs = []
    for i, arg in enumerate(argv):
        if arg == "--check-dir" and i + 1 < len(argv):
            dirs.append(argv[i + 1])
        elif arg.startswith("--check-dir="):
            dirs.append(arg.split("=", 1)[1])
    return dirs


def run_suite(argv: list[str]) -> int:
    # an explicit target: a node id or an existing check file (option values such as
    # "--reports-dir DIR" are never mistaken for one)
    explicit = [a for a in argv if "::" in a or (a.endswith(".py") and Path(a).is_file())]
    targets = [] if explicit else [str(Path(__file__).parent / "checks"), *_check_dirs(argv)]
    # "-rfE": pytest's short summary lists only failures and errors, so that the matrix stays at
    # the end of the output; skips and expected failures are in the matrix and the reports (a
    # "-r" of the user's own, later on the line, wins).
    code = pytest.main(["-p", "conformance.plugin", "-rfE", *targets, *argv])
    from conformance import plugin  # after pytest.main, which imports it (assertion rewriting)

    if plugin._outcome.get("closed_stdout"):  # (pytest put the closed pipe back on fd 1)
        plugin.silence_stdout()
    return plugin.exit_status(code)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        module, _, function = SUBCOMMANDS[argv[0]].partition(":")
        return int(getattr(importlib.import_module(module), function)(argv[1:]) or 0)
    return run_suite(argv)


if __name__ == "__main__":
    sys.exit(main())
