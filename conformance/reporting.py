"""Reports: the terminal matrix, ``reports/conformance.json``, ``.md`` and ``.html`` (conformance/html/).

(JUnit XML comes from pytest's own ``--junitxml``, which the plugin points at
``reports/conformance.xml`` unless you pass another path.)

[Note: outcomes]
pass           every rank returned
fail           a rank raised, hung (stacks attached), died, or an expected failure passed (strict)
xfail          failed as its expectations entry says it will
not-supported  the implementation does not declare a capability the check needs
skip           skipped for another reason (e.g. pytest's own skip)
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

OUTCOMES = ("pass", "fail", "xfail", "not-supported", "skip")
_SHORT = {"pass": "p", "fail": "F", "xfail": "x", "not-supported": "n", "skip": "s"}


MESSAGE_LIMIT = 20000  # characters of a case's message kept in the reports
RUNS_KEPT = 20  # per-run report directories kept under <reports>/runs/


# [Note: rerun lines]
# A case's repro command (and the report's "command") reruns it the way the run was started:
# ``nox -s conformance -- ...`` when the conformance nox session started it (the session sets
# LAUNCHER_ENV), else ``python -m conformance ...`` (also for ``python -m pytest -p
# conformance.plugin``, which it is equivalent to). It carries the ``--impl`` spec as given, every
# option that can change an outcome, ``FSDP_CONFORMANCE_TORCH`` / ``FSDP_CONFORMANCE_EXTRA_PIP`` under
# nox (they mean nothing to ``python -m``), and ``PYTHONPATH=`` with the import path the plug-ins
# needed (see import_paths). It is run from the directory the run started in (the checkout).

LAUNCHER_ENV = "FSDP_CONFORMANCE_LAUNCHER"  # "nox": set by noxfile.py's conformance session
NOX_ENV = ("FSDP_CONFORMANCE_TORCH", "FSDP_CONFORMANCE_EXTRA_PIP")


@dataclass(frozen=True)
class Rerun:
    """How a case's repro command starts the suite besides its implementation, world size and
    device (see [Note: rerun lines])."""

    env: tuple[str, ...] = ()  # assignments, e.g. "FSDP_CONFORMANCE_TORCH=torch==2.14.1"
    options: tuple[str, ...] = ()  # options of the run that change outcomes
    launcher: str = "python -m conformance"  # or "nox -s conformance --"
    paths: tuple[str, ...] = ()  # sys.path entries the plug-ins need (PYTHONPATH of the command)

    def command(self, args) -> str:
        """``args`` (after the launcher) as one shell line with this run's environment."""
        env = [f"PYTHONPATH={shlex.quote(os.pathsep.join(self.paths))}"] if self.paths else []
        return " ".join([*env, *self.env, self.launcher, *(shlex.quote(a) for a in args)])


def under_nox() -> bool:
    return os.environ.get(LAUNCHER_ENV) == "nox"


def rerun_options(opt, validated, specs=()) -> Rerun:
    """The :class:`Rerun` of this run: the launcher, every non-default option that can change an
    outcome, and the import path the implementations ``specs`` (already loaded) needed."""
    from conformance import expectations, options

    args: list[str] = []
    if validated.expectations_dir.resolve() != expectations.DEFAULT_DIR.resolve():
        args += ["--expectations-dir", str(opt.expectations_dir)]
    for flag, value, default in (
        ("--check-timeout", validated.check_timeout, options.DEFAULT_CHECK_TIMEOUT),
        ("--grace", validated.grace, 5.0),
        ("--threads-per-rank", validated.threads_per_rank, 1),
    ):
        if value != default:
            args += [flag, f"{value:g}"]
    for directory in opt.check_dir:
        args += ["--check-dir", directory]
    if opt.respawn_every_check:
        args.append("--respawn-every-check")
    if getattr(opt, "fuzz_examples", None) is not None:
        args += ["--fuzz-examples", str(opt.fuzz_examples)]
    nox = under_nox()
    env = tuple(
        f"{var}={shlex.quote(os.environ[var])}" for var in NOX_ENV if nox and os.environ.get(var)
    )
    launcher = "nox -s conformance --" if nox else f"{python_command()} -m conformance"
    return Rerun(env, tuple(args), launcher, import_paths(specs))


def python_command() -> str:
    """How a rerun line names this run's interpreter: ``python`` when that is the first
    ``python`` on PATH, else the interpreter's path (``sys.executable``), so that the line pasted
    into a shell whose ``python`` lacks torch still runs (a venv's python is not the interpreter
    its symlink points to: only the same path, or the same file outside a venv, counts)."""
    first = shutil.which("python")
    if first and os.path.abspath(first) == os.path.abspath(sys.executable):
        return "python"
    if first and sys.prefix == sys.base_prefix:
        with contextlib.suppress(OSError):
            if os.path.samefile(first, sys.executable):
                return "python"
    return shlex.quote(sys.executable) if sys.executable else "python"


def import_paths(specs) -> tuple[str, ...]:
    """The import path a rerun of implementations ``specs`` needs besides what a fresh interpreter
    started in this directory has: every ``$PYTHONPATH`` entry, then the ``sys.path`` entry each
    plug-in's module (``package.module:attr``, or an entry point's module and distribution) was
    found in, when neither is this directory nor on a fresh interpreter's path (site-packages, a
    ``.pth`` file's entries, the standard library)."""
    from conformance.adapters.registry import BUILTINS, ENTRY_POINT_GROUP

    roots: list[Path] = []
    for spec in specs:
        if spec in BUILTINS:
            continue
        eps = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
        if spec in eps:
            module = eps[spec].module
            dist = getattr(eps[spec], "dist", None)
            if dist is not None:
                try:
                    roots.append(Path(dist.locate_file("")))
                except Exception:  # noqa: BLE001 - a distribution that cannot say where it is
                    pass
        elif ":" in spec:
            module = spec.partition(":")[0]
        else:
            continue
        root = _module_root(module)
        if root is not None:
            roots.append(root)
    python_path = [Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if not python_path and not roots:
        return ()
    skip = {Path.cwd().resolve(), *(Path(p).resolve() for p in _fresh_sys_path())}
    paths: list[str] = []
    for path in python_path + roots:
        if path.resolve() not in skip and str(path.resolve()) not in paths:
            paths.append(str(path.resolve()))
    return tuple(paths)


def _module_root(name: str) -> Path | None:
    """The ``sys.path`` entry module ``name`` (imported) was found in."""
    module = sys.modules.get(name)
    origin = getattr(module, "__file__", None)
    if not origin:
        return None
    path = Path(origin).resolve()
    if path.name.startswith("__init__."):
        path = path.parent
    depth = len(name.split("."))
    return path.parents[depth - 1] if len(path.parents) >= depth else None


@functools.cache
def _fresh_sys_path() -> tuple[str, ...]:
    """``sys.path`` of a fresh interpreter of this Python without ``$PYTHONPATH`` (its first
    entry, the script directory, left out)."""
    try:
        out = subprocess.run(
            [sys.executable, "-E", "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
        return tuple(p for p in json.loads(out) if p)
    except (OSError, ValueError, subprocess.SubprocessError):
        return tuple(p for p in sys.path if p and "site-packages" in p)


def repro_command(meta) -> str:
    """One line that reruns just this case the way it ran (see [Note: rerun lines])."""
    return meta.rerun.command(
        [
            "--impl",
            meta.impl_spec,
            "--world-sizes",
            str(meta.world_size),
            "--device",
            meta.device,
            "--backend",
            meta.backend,
            *meta.rerun.options,
            meta.nodeid,
        ]  # fmt: skip
    )


def _message(report, outcome: str) -> str:
    if outcome == "xfail":
        return f"expected failure: {report.wasxfail}"
    if report.skipped and isinstance(report.longrepr, tuple):
        return report.longrepr[2].removeprefix("Skipped: ")
    if report.failed:
        return shorten(str(report.longrepr))
    return ""


def shorten(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """``text`` cut to about ``limit`` characters, keeping its start and, above all, its end (the
    cause of an error is at the end of a traceback)."""
    if len(text) <= limit:
        return text
    head = limit // 10
    dropped = len(text) - limit
    return (
        f"{text[:head]}\n... ({dropped} characters cut) ...\n{text[len(text) - (limit - head) :]}"
    )


def case_record(report, meta, outcome: str) -> dict:
    message = _message(report, outcome)
    return {
        "id": meta.case_id,
        "nodeid": report.nodeid,
        "area": meta.spec.area,
        "check": meta.spec.name,
        "rule": meta.spec.rule,
        "impl": meta.impl_name,
        "world_size": meta.world_size,
        "case": meta.case,
        "device": meta.device,
        "backend": meta.backend,
        "outcome": outcome,
        "duration_s": round(report.duration, 4),
        "message": message,
        "ranks": [
            {
                "rank": r["rank"],
                "status": r["status"],
                "duration_s": round(r["duration"], 4),
                "detail": shorten(r["detail"]),
            }
            for r in getattr(report, "rank_results", [])
        ],
        "repro": repro_command(meta),
        **{k: v for k, v in report.user_properties if k in ("repro_script", "fuzz")},  # fuzz
        **({"capability": gate_of(message)} if outcome == "not-supported" else {}),
        **({"expectation": expectation_of(message)} if outcome == "xfail" else {}),
    }


# the two NotSupported skips of conformance.plugin: a capability the check declares it needs, or
# what the implementation raised NotSupported for while the check ran
# "NotSupported: <impl> does not declare <capabilities>" or "NotSupported: <impl>: <the adapter's
# own text>" (conformance.adapters.base.not_supported_reason); "does not support" in older reports
_GATE = re.compile(
    r"NotSupported: (?:\S+? does not (?:declare|support) |[^\s:]+: )(?P<gate>.+)", re.S
)
# an expected failure's message: "expected failure: <reason> [<file:line>; <signature>]"
_ENTRY = re.compile(
    r"(?:expected failure: )?(?P<reason>.*) \[(?P<source>[^;\[\]]+:\d+); (?P<signature>.*)\]\s*$",
    re.S,
)


def gate_of(message: str) -> str:
    """What gated a not-supported case (the capabilities, or what the implementation does not
    support), from its message; "" when the message says neither."""
    found = _GATE.search(message or "")
    return found["gate"].strip() if found else ""


def expectation_of(message: str) -> dict | None:
    """An expected failure's entry (``reason``, ``source`` file:line, ``signature``) from its
    message; None when the message does not end with one."""
    found = _ENTRY.match(message or "")
    return {k: found[k].strip() for k in ("reason", "source", "signature")} if found else None


def matrix(records) -> tuple[list[tuple[str, str]], list[int], dict]:
    """Rows (area, implementation), columns (world sizes) and the outcome counters per cell."""
    cells: dict = defaultdict(Counter)
    for rec in records:
        cells[(rec["area"], rec["impl"], rec["world_size"])][rec["outcome"]] += 1
    rows = sorted({(k[0], k[1]) for k in cells})
    columns = sorted({k[2] for k in cells})
    return rows, columns, cells


def _cell(counter: Counter) -> str:
    if not counter:
        return "-"
    return " ".join(f"{counter[o]}{_SHORT[o]}" for o in OUTCOMES if counter[o])


def matrix_lines(records) -> list[str]:
    """The matrix as text. A row whose every case is not supported says nothing per world size:
    such rows are folded into one line under the table (area: implementations)."""
    rows, columns, cells = matrix(records)
    if not rows:
        return ["(no cases ran)"]
    unsupported = {
        row for row in rows
        if all(set(cells[(*row, ws)]) <= {"not-supported"} for ws in columns)
    }  # fmt: skip
    header = ["area", "implementation"] + [f"ws{ws}" for ws in columns]
    table = [
        [area, impl] + [_cell(cells[(area, impl, ws)]) for ws in columns]
        for area, impl in rows
        if (area, impl) not in unsupported
    ]
    total = Counter()
    for c in cells.values():
        total.update(c)
    widths = [max(len(r[i]) for r in [header] + table) for i in range(len(header))]
    fmt = lambda r: "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()  # noqa: E731
    lines = [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in table]
    if unsupported:
        by_area: dict[str, list[str]] = defaultdict(list)
        for area, impl in sorted(unsupported):
            by_area[area].append(impl)
        folded = "; ".join(f"{area}: {', '.join(impls)}" for area, impls in by_area.items())
        lines.append(f"not supported at any world size (rows folded): {folded}")
    lines.append("legend: p pass, F fail, x expected failure, n not supported, s skipped")
    lines.append("total: " + ", ".join(f"{total[o]} {o}" for o in OUTCOMES if total[o]))
    return lines


def terminal_summary(tr, session, wall: float, stale) -> None:
    records = list(session.records.values())
    tr.section("FSDP conformance matrix")
    for line in matrix_lines(records):
        tr.write_line(line)
    failures = [r for r in records if r.get("outcome") == "fail"]
    if failures:
        tr.write_line("")
        tr.write_line(f"{len(failures)} failing case(s); rerun one with:")
        for rec in failures[:20]:
            tr.write_line(f"  {rec['repro']}")
    for entry in stale:
        tr.write_line(
            f"WARNING stale expectation {entry.prefix!r} ({entry.source}) matches no case"
        )
    spawns = ", ".join(f"ws{ws}: {n}" for ws, n in sorted(session.spawns.items()))
    if session.torchrun:
        spawns = "none (torchrun: checks ran in-process)"
    tr.write_line(f"wall time {wall:.1f} s; process groups spawned: {spawns or 'none'}")
    state = run_state(session)
    reports = session.options.reports_dir
    if state["interrupted"]:
        tr.write_line(
            interrupted_line(state) + "; the matrix above is partial", red=True, bold=True
        )
        if session.run_dir is not None:
            tr.write_line(
                f"partial reports: {session.run_dir}/conformance.{{json,md,xml,html}} (marked "
                f"interrupted); {reports}/conformance.* still hold the latest finished run"
            )
    elif session.run_dir is not None:
        tr.write_line(
            f"reports: {reports}/conformance.{{json,md,xml,html}} (this run: {session.run_dir})"
        )


def run_state(session) -> dict:
    """Whether the run was interrupted (and by which signal) and how many of its selected cases
    ran: ``cases_not_run`` is None when the run stopped before its cases were known."""
    selected = session.selected
    return {
        "interrupted": session.interrupted is not None,
        "signal": session.interrupted,
        "cases_run": len(session.records),
        "cases_not_run": None if selected is None else len(set(selected) - set(session.records)),
    }


def interrupted_line(state: dict) -> str:
    not_run = state["cases_not_run"]
    return f"INTERRUPTED by {state['signal']}: {state['cases_run']} case(s) ran, " + (
        "the others were never collected" if not_run is None else f"{not_run} did not run"
    )


def _environment(session, wall: float) -> dict:
    import torch

    return {
        "tool": "fsdp-conformance",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_time_s": round(wall, 2),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "world_sizes": session.world_sizes,
        "placement": {
            str(ws): {"device": d, "backend": b} for ws, (d, b) in session.placement.items()
        },
        "torchrun": session.torchrun,
        "implementations": [
            {
                "spec": spec,
                "name": impl.name,
                "version": impl.version,
                "capabilities": sorted(impl.capabilities),
            }
            for spec, impl in session.impls.items()
        ],
        "process_group_spawns": {str(k): v for k, v in session.spawns.items()},
        "command": _command_line(session.rerun),
        **run_state(session),
    }


def _command_line(rerun: Rerun) -> str:
    """The run's command line, started as it was (see [Note: rerun lines])."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(("conformance/__main__.py", "conformance\\__main__.py")):
        return rerun.command(argv[1:])
    return " ".join(shlex.quote(a) for a in argv)


def write_files(session, wall: float, stale, directory: Path) -> None:
    """``conformance.json``, ``.md`` and ``.html`` of this run into ``directory`` (atomically)."""
    records = list(session.records.values())
    env = _environment(session, wall)
    summary = Counter(r["outcome"] for r in records)
    doc = {
        **env,
        "summary": {o: summary[o] for o in OUTCOMES},
        "stale_expectations": [{"prefix": e.prefix, "source": e.source} for e in stale],
        "cases": records,
    }
    write_atomic(directory / "conformance.json", json.dumps(doc, indent=1))
    write_atomic(directory / "conformance.md", markdown(env, records, stale))
    try:  # the scoreboard (conformance/html/); a page that cannot be built loses no other report
        from conformance import html

        page = html.page([doc])
    except Exception as exc:  # noqa: BLE001
        print(f"WARNING conformance.html not built: {type(exc).__name__}: {exc}", file=sys.stderr)
        return
    write_atomic(directory / "conformance.html", page)


# [Note: report files]
# Each run writes into its own directory, <reports>/runs/<UTC time>-<pid>/ (created at start, with a
# ".running" file naming the driver's pid), and at its end copies its files to <reports>/ itself:
# the top-level conformance.{json,md,xml,html} are always the latest finished run's, and a run never
# overwrites another run's files. An interrupted run (Ctrl-C, SIGTERM) is not finished: its partial
# reports, marked interrupted, stay in its own directory only (see keep_partial_run). Every file is written to a temporary name and renamed into place,
# so a reader never sees half a file. A run that starts while another one is writing into the same
# directory says so. The newest RUNS_KEPT run directories are kept.


class ReportsNotWritten(OSError):
    """A report file could not be written (a full disk, a file-size limit): ``str()`` is the one
    line the run ends with (exit code 2); the files that were there before are untouched."""

    def __init__(self, directory: Path, needed: int, cause: OSError):
        from conformance.runner.memory import format_size

        try:
            free = format_size(shutil.disk_usage(directory).free)
        except OSError:
            free = "unknown"
        super().__init__(
            cause.errno,
            f"cannot write the reports into {directory} ({cause.strerror or cause}): they need "
            f"about {format_size(needed)} free there, {free} is; free some space (or lift the "
            f"file-size limit) or pass another --reports-dir, then rerun",
        )

    def __str__(self) -> str:
        return self.strerror


def _write_tmp(path: Path, text: str) -> Path:
    """``text`` into a temporary file beside ``path``; on failure nothing is left behind."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = text.encode()
    try:
        with open(tmp, "wb") as f:
            f.write(data)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ReportsNotWritten(path.parent, len(data), exc) from exc
    return tmp


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a reader (or a full
    disk) never leaves half a file; raises :class:`ReportsNotWritten` with ``path`` untouched."""
    os.replace(_write_tmp(path, text), path)


def start_run(reports_dir: Path) -> tuple[Path, list[int]]:
    """Create this run's directory; return it and the pids of other runs still writing here."""
    runs = reports_dir / "runs"
    others = []
    for marker in runs.glob("*/.running"):
        try:
            pid = int(marker.read_text())
            os.kill(pid, 0)
            others.append(pid)
        except (OSError, ValueError):
            continue
    run_dir = runs / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ".running").write_text(str(os.getpid()))
    return run_dir, others


def publish_run(run_dir: Path, reports_dir: Path) -> None:
    """Copy the run's report files to ``reports_dir`` and prune old run directories. All or
    nothing: every file is written to a temporary name first, and only when all are written are
    they renamed into place (a full disk leaves the previous run's files as they were)."""
    written: list[tuple[Path, Path]] = []
    try:
        for path in sorted(run_dir.glob("conformance.*")):
            target = reports_dir / path.name
            written.append((_write_tmp(target, path.read_text()), target))
    except OSError:
        for tmp, _ in written:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, target in written:
        os.replace(tmp, target)
    _end_run(run_dir)


def keep_partial_run(run_dir: Path) -> None:
    """End an interrupted run: its reports stay in ``run_dir``; the top-level files are left
    alone (they are the latest *finished* run's)."""
    _end_run(run_dir)


def _end_run(run_dir: Path) -> None:
    (run_dir / ".running").unlink(missing_ok=True)
    finished = sorted(d for d in run_dir.parent.iterdir() if not (d / ".running").exists())
    for old in finished[:-RUNS_KEPT]:
        shutil.rmtree(old, ignore_errors=True)


def markdown(env: dict, records: list[dict], stale) -> str:
    impls = "; ".join(f"{i['name']} ({i['version']})" for i in env["implementations"])
    placement = ", ".join(
        f"ws{ws} {p['device']}/{p['backend']}" for ws, p in env["placement"].items()
    )
    out = ["# FSDP conformance report", ""]
    if env["interrupted"]:
        out += [f"**{interrupted_line(env)}. This report is partial.**", ""]
    out += [
        f"- created: {env['created']}, wall time {env['wall_time_s']} s",
        f"- torch {env['torch']}, Python {env['python']}, {env['platform']}",
        f"- implementations: {impls}",
        f"- world sizes: {placement}",
        f"- command: `{env['command']}`",
        "",
        "## Matrix",
        "",
        "```",
        *matrix_lines(records),
        "```",
        "",
    ]
    unsupported = Counter(
        (r["impl"], r["message"]) for r in records if r["outcome"] == "not-supported"
    )
    if unsupported:
        out += ["## Not supported", "", "| implementation | reason | cases |", "|---|---|---|"]
        out += [f"| {impl} | {msg} | {n} |" for (impl, msg), n in sorted(unsupported.items())] + [
            ""
        ]
    for title, outcome in (("Failures", "fail"), ("Expected failures", "xfail")):
        chosen = [r for r in records if r["outcome"] == outcome]
        if not chosen:
            continue
        out += [f"## {title} ({len(chosen)})", ""]
        for rec in chosen:
            out.append(f"### `{rec['id']}` on {rec['impl']}")
            if rec["rule"]:
                out.append(f"Rule: {rec['rule']}  ")
            out.append(f"Rerun: `{rec['repro']}`")
            if rec["message"]:
                out += ["", "```", rec["message"].rstrip(), "```"]
            out.append("")
    if stale:
        out += (
            ["## Stale expectations", ""] + [f"- `{e.prefix}` ({e.source})" for e in stale] + [""]
        )
    return "\n".join(out)
