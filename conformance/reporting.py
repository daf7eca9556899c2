"""Reports: the terminal matrix, ``reports/conformance.json`` and ``reports/conformance.md``.

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

import json
import os
import platform
import shlex
import shutil
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

OUTCOMES = ("pass", "fail", "xfail", "not-supported", "skip")
_SHORT = {"pass": "p", "fail": "F", "xfail": "x", "not-supported": "n", "skip": "s"}


MESSAGE_LIMIT = 20000  # characters of a case's message kept in the reports
RUNS_KEPT = 20  # per-run report directories kept under <reports>/runs/


@dataclass(frozen=True)
class Rerun:
    """What a case's repro command carries besides its implementation, world size and device:
    environment assignments and options of the run that change outcomes."""

    env: tuple[str, ...] = ()
    options: tuple[str, ...] = ()


def rerun_options(opt, validated) -> Rerun:
    """The :class:`Rerun` of this run: every non-default option that can change an outcome."""
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
    env = tuple(
        f"{var}={shlex.quote(os.environ[var])}"
        for var in ("FSDP_CONFORMANCE_TORCH", "FSDP_CONFORMANCE_EXTRA_PIP")
        if os.environ.get(var)
    )
    return Rerun(env, tuple(args))


def repro_command(meta) -> str:
    """One line that reruns just this case the way it ran."""
    env = "".join(f"{assignment} " for assignment in meta.rerun.env)
    args = [
        "--impl", meta.impl_spec, "--world-sizes", str(meta.world_size),
        "--device", meta.device, "--backend", meta.backend, *meta.rerun.options, meta.nodeid,
    ]  # fmt: skip
    return f"{env}nox -s conformance -- " + " ".join(shlex.quote(a) for a in args)


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
        "message": _message(report, outcome),
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
    }


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
    if session.run_dir is not None:
        reports = session.options.reports_dir
        tr.write_line(
            f"reports: {reports}/conformance.{{json,md,xml}} (this run: {session.run_dir})"
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
        "command": _command_line(),
    }


def _command_line() -> str:
    argv = list(sys.argv)
    if argv and argv[0].endswith(("conformance/__main__.py", "conformance\\__main__.py")):
        argv = ["python", "-m", "conformance", *argv[1:]]
    return " ".join(shlex.quote(a) for a in argv)


def write_files(session, wall: float, stale, directory: Path) -> None:
    """``conformance.json`` and ``conformance.md`` of this run into ``directory`` (atomically)."""
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


# [Note: report files]
# Each run writes into its own directory, <reports>/runs/<UTC time>-<pid>/ (created at start, with a
# ".running" file naming the driver's pid), and at its end copies its files to <reports>/ itself:
# the top-level conformance.{json,md,xml} are always the latest finished run's, and a run never
# overwrites another run's files. Every file is written to a temporary name and renamed into place,
# so a reader never sees half a file. A run that starts while another one is writing into the same
# directory says so. The newest RUNS_KEPT run directories are kept.


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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
    """Copy the run's report files to ``reports_dir`` (atomically) and prune old run directories."""
    for path in sorted(run_dir.glob("conformance.*")):
        write_atomic(reports_dir / path.name, path.read_text())
    (run_dir / ".running").unlink(missing_ok=True)
    finished = sorted(d for d in run_dir.parent.iterdir() if not (d / ".running").exists())
    for old in finished[:-RUNS_KEPT]:
        shutil.rmtree(old, ignore_errors=True)


def markdown(env: dict, records: list[dict], stale) -> str:
    impls = "; ".join(f"{i['name']} ({i['version']})" for i in env["implementations"])
    placement = ", ".join(
        f"ws{ws} {p['device']}/{p['backend']}" for ws, p in env["placement"].items()
    )
    out = [
        "# FSDP conformance report",
        "",
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
