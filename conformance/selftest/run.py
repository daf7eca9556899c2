"""``python -m conformance selftest``: run the suite against seeded faults and score it.

For each world size that a selected fault needs, ONE conformance run (one process group, reused
for every check) carries the unpatched implementation(s) the faults break (the control) and
every fault meant for that world size, each as its own implementation ``fault-<id>``. The runs'
``conformance.json`` reports then give each fault's verdict (see :mod:`.score`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from conformance.selftest import FAULTS, _patching, score

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m conformance selftest",
        description="Run the conformance suite against seeded faults (and the unpatched control) "
        "and report which checks catch each fault, and the mutation score. Other options are "
        "passed on to the conformance runs (e.g. --check-timeout).",
    )
    parser.add_argument(
        "-k",
        "--faults",
        default="",
        help="comma-separated fault ids or parts of ids (default: every fault)",
    )
    parser.add_argument(
        "--fast",
        action="store_true",
        help="only the fast subset (one fault per area; what `nox -s tests` runs)",
    )
    parser.add_argument(
        "--world-sizes",
        default="",
        help="only these world sizes: a fault runs at the ones it needs among them",
    )
    parser.add_argument(
        "--checks",
        default="",
        help="a pytest -k expression narrowing the checks (default: the whole suite)",
    )
    parser.add_argument(
        "--reports-dir",
        default="reports",
        help="selftest.json / selftest.md go here, each run's reports in "
        "selftest-ws<N>/ below it (default reports/)",
    )
    parser.add_argument(
        "--rescore",
        action="store_true",
        help="run nothing: score the selected faults from the runs' reports already in "
        "--reports-dir (selftest-ws<N>/conformance.json), e.g. after the rule changed or "
        "when world sizes were run by separate invocations",
    )
    parser.add_argument("--list", action="store_true", help="list the selected faults and exit")
    return parser.parse_known_args(argv)


def select(text: str, fast: bool) -> list:
    """The faults whose id equals or contains one of the comma-separated words."""
    chosen = [f for f in FAULTS.values() if f.fast or not fast]
    words = [w.strip() for w in text.split(",") if w.strip()]
    if words:
        chosen = [f for f in chosen if any(w == f.id or w in f.id for w in words)]
        unknown = [w for w in words if not any(w in f.id for f in FAULTS.values())]
        if unknown:
            raise SystemExit(f"selftest: no fault matches {unknown}; see --list")
    return chosen


def run_world_size(ws: int, faults: list, args, extra: list[str]) -> tuple[list[dict], str]:
    """One conformance run at world size ``ws``; returns its case records and a problem, if any."""
    controls = sorted({f.impl for f in faults})
    out_dir = Path(args.reports_dir) / f"selftest-ws{ws}"
    cmd = [
        sys.executable,
        "-m",
        "conformance",
        "--impl",
        ",".join(controls + [f.spec for f in faults]),
        "--world-sizes",
        str(ws),
        "--reports-dir",
        str(out_dir),
        "-q",
        "--tb=no",
        "-p",
        "no:cacheprovider",
        "-p",
        "conformance.selftest.no_shrink",
        *(["-k", args.checks] if args.checks else []),
        *extra,
    ]
    print(
        f"selftest: world size {ws}: {len(faults)} fault(s) + control {', '.join(controls)}",
        flush=True,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "selftest.log"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        tail: list[str] = []
        for line in proc.stdout:
            log.write(line)
            tail = (tail + [line.rstrip()])[-40:]
            if line.rstrip().endswith("%]"):  # pytest -q progress
                percent = line.rstrip().rsplit("[", 1)[-1].rstrip("]").strip()
                print(
                    f"selftest: world size {ws}: {percent} ({time.monotonic() - started:.0f} s)",
                    flush=True,
                )
        code = proc.wait()
    report = out_dir / "conformance.json"
    if code not in (0, 1) or not report.exists():
        print("\n".join(tail), file=sys.stderr)
        return [], f"the world-size-{ws} run exited {code} (log: {log_path})"
    return json.loads(report.read_text())["cases"], ""


def read_world_size(ws: int, faults: list, args, extra: list[str]) -> tuple[list[dict], str]:
    """``--rescore``: the case records of an earlier world-size-``ws`` run, and a problem, if any."""
    report = Path(args.reports_dir) / f"selftest-ws{ws}" / "conformance.json"
    if not report.exists():
        return [], f"no world-size-{ws} report to rescore: {report} (run without --rescore)"
    data = json.loads(report.read_text())
    cases = data["cases"]
    args.rescored_wall = getattr(args, "rescored_wall", 0.0) + float(data.get("wall_time_s") or 0)
    names = {f.adapter_name for f in faults}
    absent = sorted(names - {c["impl"] for c in cases})
    if absent:
        return cases, f"{report} holds no case of {', '.join(absent)}"
    return cases, ""


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(list(sys.argv[1:] if argv is None else argv))
    faults = select(args.faults, args.fast)
    if args.list:
        for f in faults:
            print(
                f"{f.id:34} {f.impl:16} {f.behaviour:4} ws {','.join(map(str, f.world_sizes)):5}"
                f" {f.description}"
            )
        return 0
    only = {int(w) for w in args.world_sizes.split(",") if w.strip()} or None
    started = time.time()
    verdicts, plans = {}, {}
    for f in faults:
        sizes = [w for w in f.world_sizes if only is None or w in only]
        try:
            _patching.resolve(f.target)  # a missing target is a broken fault, found before running
        except _patching.BrokenFault as exc:
            verdicts[f.id] = score.Verdict(
                f.id,
                f.impl,
                f.behaviour,
                f.area,
                f.description,
                sizes,
                score.BROKEN,
                detail=str(exc),
            )
            continue
        plans[f.id] = sizes
    by_ws: dict[int, list] = {}
    for f in faults:
        for w in plans.get(f.id, []):
            by_ws.setdefault(w, []).append(f)
    records, problems = [], []
    for ws in sorted(by_ws):
        run = read_world_size if args.rescore else run_world_size
        cases, problem = run(ws, by_ws[ws], args, extra)
        records += cases
        if problem:
            problems.append(problem)
    for f in faults:
        if f.id not in verdicts:
            verdicts[f.id] = score.judge(f, records, plans[f.id])
    ordered = [verdicts[f.id] for f in faults]
    controls = {f.impl for f in faults if plans.get(f.id)}
    control_fails = score.control_failures(records, controls)
    stats = score.summary(ordered)
    # --rescore: the wall time is that of the runs scored
    wall = getattr(args, "rescored_wall", None) or time.time() - started
    write_reports(Path(args.reports_dir), ordered, stats, control_fails, problems, wall, args)
    print()
    print("\n".join(score.table_lines(ordered)))
    for problem in problems:
        print(f"selftest: {problem}")
    if control_fails:
        print(f"selftest: the control failed {len(control_fails)} case(s):")
        print("\n".join(f"  {c}" for c in control_fails[:20]))
    print(f"selftest: {score.score_line(stats, wall)}; reports in {args.reports_dir}/selftest.md")
    return 1 if problems else score.exit_code(ordered, control_fails)


def write_reports(directory: Path, verdicts, stats, control_fails, problems, wall, args) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    data = {
        "summary": stats,
        "wall_s": round(wall, 1),
        "selection": {
            "faults": args.faults,
            "fast": args.fast,
            "world_sizes": args.world_sizes,
            "checks": args.checks,
            "rescored": args.rescore,
        },
        "faults": [v.as_dict() for v in verdicts],
        "control_failures": control_fails,
        "problems": problems,
    }
    (directory / "selftest.json").write_text(json.dumps(data, indent=2) + "\n")
    (directory / "selftest.md").write_text(score.markdown(verdicts, stats, control_fails, wall))
