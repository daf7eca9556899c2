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
import platform
import shlex
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

OUTCOMES = ("pass", "fail", "xfail", "not-supported", "skip")
_SHORT = {"pass": "p", "fail": "F", "xfail": "x", "not-supported": "n", "skip": "s"}


def repro_command(meta) -> str:
    nodeid = meta.nodeid
    extra = "".join(f" --check-dir {shlex.quote(d)}" for d in meta.check_dirs)
    return (
        f"nox -s conformance -- --impl {shlex.quote(meta.impl_spec)} "
        f"--world-sizes {meta.world_size}{extra} {shlex.quote(nodeid)}"
    )


def _message(report, outcome: str) -> str:
    if outcome == "xfail":
        return f"expected failure: {report.wasxfail}"
    if report.skipped and isinstance(report.longrepr, tuple):
        return report.longrepr[2].removeprefix("Skipped: ")
    if report.failed:
        text = str(report.longrepr)
        return text if len(text) < 20000 else text[:20000] + "\n... (truncated)"
    return ""


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
                "detail": r["detail"],
            }
            for r in getattr(report, "rank_results", [])
        ],
        "repro": repro_command(meta),
        **{k: v for k, v in report.user_properties if k == "repro_script"},  # fuzz failures
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
    tr.write_line(f"reports: {session.config.option.reports_dir}/conformance.{{json,md,xml}}")


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
    directory.mkdir(parents=True, exist_ok=True)
    records = list(session.records.values())
    env = _environment(session, wall)
    summary = Counter(r["outcome"] for r in records)
    doc = {
        **env,
        "summary": {o: summary[o] for o in OUTCOMES},
        "stale_expectations": [{"prefix": e.prefix, "source": e.source} for e in stale],
        "cases": records,
    }
    (directory / "conformance.json").write_text(json.dumps(doc, indent=1))
    (directory / "conformance.md").write_text(markdown(env, records, stale))


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
