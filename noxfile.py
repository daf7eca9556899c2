"""Sessions: ``conformance`` (the main job), ``tests``, ``selftest``, ``perf``, ``lint``, ``versions``, ``report``.

The torch installed into every session is ``$FSDP_CONFORMANCE_TORCH`` — a pip requirement
(``torch==2.13.0``, the default) or a path to a wheel: how a vendor tests its own torch build.
Virtualenvs are reused between runs (``.nox/``), so a second run starts in seconds.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import nox

nox.options.sessions = ["conformance"]
nox.options.reuse_venv = "yes"
nox.options.default_venv_backend = "venv"

TORCH = os.environ.get("FSDP_CONFORMANCE_TORCH", "torch==2.13.0")
# numpy: torch's object collectives (all_gather_object, broadcast_object_list) need it.
# jinja2: the HTML scoreboard's template (conformance/html/); torch depends on it already.
TEST_DEPS = ["pytest>=8", "hypothesis>=6", "pytest-benchmark>=4", "numpy", "jinja2>=3"]


def install_torch(session: nox.Session) -> None:
    """Install the torch under test first, so nothing else can pull another build."""
    session.install(TORCH)
    session.install(*TEST_DEPS)
    extra = os.environ.get("FSDP_CONFORMANCE_EXTRA_PIP")  # e.g. a vendor plug-in package
    if extra:
        session.install(*extra.split())


@nox.session
def conformance(session: nox.Session) -> None:
    """Run the conformance suite; arguments after ``--`` go to it (see ``python -m conformance --help``)."""
    install_torch(session)
    # The env var makes the reports' rerun lines say "nox -s conformance -- ..."
    # (conformance.reporting). On Ctrl-C nox sends SIGTERM after interrupt_timeout seconds and
    # SIGKILL soon after: give the suite time to stop its workers and write the partial reports.
    session.run(
        "python", "-m", "conformance", *session.posargs,
        env={"FSDP_CONFORMANCE_LAUNCHER": "nox"}, interrupt_timeout=60,
    )  # fmt: skip


@nox.session
def tests(session: nox.Session) -> None:
    """The project's own tests, a conformance smoke run (every built-in, world sizes 1-3) and the
    perf suite in quick mode (correctness only)."""
    install_torch(session)
    session.install(MUTATION_ENGINE)  # tests/harness/test_mutation.py runs a tiny campaign
    session.run("python", "-m", "pytest", "tests", *session.posargs)
    session.run(
        "python",
        "-m",
        "conformance",
        "--world-sizes",
        "1,2,3",
        "--reports-dir",
        "reports/smoke",
        "-q",
    )
    # Order independence (docs/running.md, "Isolation between checks"): world size 1 again in a
    # shuffled order; every case must end as in the smoke run's collection order.
    session.run(
        "python", "-m", "conformance", "--world-sizes", "1", "--shuffle", "25",
        "--reports-dir", "reports/shuffled", "-q", success_codes=[0, 1],
    )  # fmt: skip
    session.run(
        "python", "-m", "conformance.runner.order", "reports/smoke/conformance.json",
        "reports/shuffled/conformance.json", "--world-size", "1",
    )  # fmt: skip
    session.run(
        "python", "-m", "pytest", "perf", "--quick", "-q", "--perf-reports-dir", "reports/smoke"
    )


@nox.session
def selftest(session: nox.Session) -> None:
    """The suite against its seeded faults (``conformance/selftest/``): which checks catch each
    fault, the mutation score, ``reports/selftest.json`` / ``.md``. Arguments after ``--`` go to
    ``python -m conformance selftest`` (``-k`` fault selection, ``--fast``, ``--world-sizes``,
    ``--checks``, ``--reports-dir``)."""
    install_torch(session)
    session.run("python", "-m", "conformance", "selftest", *session.posargs)


@nox.session
def perf(session: nox.Session) -> None:
    """Benchmarks of the all-gather, padding and state-dict paths next to their floors (``perf/``).

    Arguments after ``--`` go to pytest: ``--impl``, ``--world-sizes``, ``--sizes``, ``--budget``,
    ``--threads-per-rank``, ``--quick`` (see ``pytest perf --help``, group "fsdp perf"). Writes
    pytest-benchmark's ``reports/perf.json``, ``reports/perf.md`` and ``reports/perf-*.png``.
    """
    install_torch(session)
    # matplotlib is installed here only: the PNG plots are the one thing that needs it, and the
    # conformance/tests sessions should not pull a plotting stack next to the torch under test.
    session.install("matplotlib>=3.7")
    session.run(
        "python",
        "-m",
        "pytest",
        "perf",
        "-p",
        "no:cacheprovider",
        "--benchmark-json",
        "reports/perf.json",
        "--benchmark-group-by",
        "group",
        "--benchmark-columns",
        "median,iqr,min,max,rounds",
        *session.posargs,
    )


# the mutation engine (its operators and mutate_code; see conformance/mutation/): installed only
# where a campaign runs, like matplotlib in perf
MUTATION_ENGINE = "cosmic-ray==8.7.0"


@nox.session
def mutation(session: nox.Session) -> None:
    """A sampled mutation campaign on ``reference/`` (``conformance/mutation/``): cosmic-ray's
    operators mutate a private copy of the tree, the cases that execute each mutated statement run
    against it. ``-- --target torch`` mutates the installed torch's FSDP sources instead (a private
    copy; in-memory code swaps on the ranks, never the installed files), judged against
    torch-fsdp2 / torch-fsdp1. Resumable (rerun the same command), shardable (``--shard i/n`` then
    ``--merge``).
    Writes ``reports/mutation.json`` / ``.md`` / ``mutation-gaps.md``. Arguments after ``--`` go to
    ``python -m conformance.mutation`` (``--sample``, ``--seed``, ``--shard``, ``--files``,
    ``--checks``, ``--world-sizes``, ``--ids``, ``--merge``; see its ``--help``)."""
    install_torch(session)
    session.install(MUTATION_ENGINE)
    session.run("python", "-m", "conformance.mutation", *session.posargs)


# -- versions: the suite over several torch releases, one virtualenv per torch ------------------
# The supported releases (docs/torch-versions.md); each installs here (2.13.0 from the local CPU
# wheel, the others as their PyPI builds). Override: $FSDP_CONFORMANCE_TORCH_VERSIONS (whitespace-
# separated pip requirements or wheel paths) or requirements among the posargs.
VERSIONS = "torch==2.11.0 torch==2.12.1 torch==2.13.0 torch==2.14.1"
_TORCH_REQUIREMENT = re.compile(r"torch\s*(==|>=|<=|~=|!=|<|>|@)|.*\.whl$")


def _versions_env(session: nox.Session, requirement: str) -> tuple[str, str]:
    """(python of the virtualenv for ``requirement``, a file-name-safe label), the virtualenv
    created under .nox/ on first use and then reused like the sessions' own."""
    label = re.sub(
        r"[^\w.+-]+", "_", Path(requirement).name if requirement.endswith(".whl") else requirement
    )
    env = Path(".nox") / f"versions-{label}"
    python = env / "bin" / "python"
    if not python.exists():
        session.run(sys.executable, "-m", "venv", str(env), external=True)
    session.run(str(python), "-m", "pip", "install", "-q", requirement, *TEST_DEPS, external=True)
    extra = os.environ.get("FSDP_CONFORMANCE_EXTRA_PIP")
    if extra:
        session.run(str(python), "-m", "pip", "install", "-q", *extra.split(), external=True)
    return str(python), label


@nox.session
def versions(session: nox.Session) -> None:
    """The suite on each torch of a list, then one cross-version matrix: ``reports/versions.md``
    and ``reports/versions.json`` (``conformance/versions.py``); each run's reports are in
    ``reports/versions/<requirement>/``. The list: torch requirements or wheels among the
    arguments after ``--``, else ``$FSDP_CONFORMANCE_TORCH_VERSIONS``, else the supported
    releases; the other arguments go to every run (``nox -s versions -- torch==2.12.1
    torch==2.14.1 --world-sizes 1,2``). Fails when a run fails, after writing the matrix."""
    requirements = [a for a in session.posargs if _TORCH_REQUIREMENT.match(a)]
    suite_args = [a for a in session.posargs if not _TORCH_REQUIREMENT.match(a)]
    requirements = (
        requirements or os.environ.get("FSDP_CONFORMANCE_TORCH_VERSIONS", VERSIONS).split()
    )
    reports, failed = [], []
    for requirement in requirements:
        python, label = _versions_env(session, requirement)
        out = Path("reports") / "versions" / label
        # failures print a rerun line for this torch: FSDP_CONFORMANCE_TORCH=... nox -s conformance
        launcher = {"FSDP_CONFORMANCE_LAUNCHER": "nox", "FSDP_CONFORMANCE_TORCH": requirement}
        session.run(
            python, "-m", "conformance", "--reports-dir", str(out), *suite_args,
            external=True, success_codes=[0, 1], env=launcher,
        )  # fmt: skip
        reports.append(str(out / "conformance.json"))
        summary = json.loads((out / "conformance.json").read_text()).get("summary", {})
        if summary.get("fail"):
            failed.append(f"{requirement} ({summary['fail']})")
    session.run("python", "-m", "conformance.versions", *reports, "--output-dir", "reports")
    if failed:
        session.error(f"failures on {', '.join(failed)}: see reports/versions.md")


@nox.session
def report(session: nox.Session) -> None:
    """One HTML scoreboard from several runs (``conformance/html/``): the runs' report
    directories or ``conformance.json`` files after ``--``, in column order, and ``-o PAGE``
    (default ``reports/scoreboard.html``); without any, the runs of ``nox -s versions``
    (``reports/versions/*/``), else ``reports/``."""
    session.install("jinja2>=3")  # the page's template engine; nothing else: no torch needed
    runs = session.posargs or (
        sorted(str(p) for p in Path("reports/versions").glob("*/conformance.json")) or ["reports"]
    )
    session.run("python", "-m", "conformance.html", *runs)  # = python -m conformance report


LINTED = ["reference", "conformance", "perf", "tests", "tools", "noxfile.py"]


@nox.session
def lint(session: nox.Session) -> None:
    """``ruff check`` and ``ruff format --check`` over the whole tree (CI runs this session too)."""
    session.install("ruff==0.17.6")  # pinned: another ruff may format differently
    session.run("ruff", "check", *LINTED)
    session.run("ruff", "format", "--check", *LINTED)
