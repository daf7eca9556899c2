"""``python -m conformance.mutation`` (``nox -s mutation``): a sampled, resumable, shardable mutation campaign.

The engine is cosmic-ray (its parso-based operators, narrowed and extended in
:mod:`.operators`; its ``mutate_code`` applies a mutant). This module is the campaign around it:

1. copy the tree (``reference/``, ``conformance/``, ``pyproject.toml``) into the work directory;
   every mutant is written into that copy, never into the checkout;
2. measure the coverage map (:mod:`.coverage`; cached by a hash of the tree);
3. draw ``--sample`` mutants with ``--seed`` (:mod:`.population`), keep this shard's share
   (``--shard i/n``: every n-th, from the i-th), skip those the session file already holds;
4. for each mutant: write it, run ``python -m conformance`` on the cases that execute the mutated
   statement (``-x``: the first failing case ends the run) under a per-mutant timeout, restore the
   file, append the verdict to the session file (one JSON line, flushed);
5. merge every shard's session file of the same campaign into ``reports/mutation.{json,md}``
   (:mod:`.report`).

``--target torch`` mutates the FSDP sources of the torch under test instead: they are read from
the installed package into ``<work>/torch-src-*`` (never written where installed), the coverage map
traces ``torch-fsdp2`` / ``torch-fsdp1``, a mutant in a function body is swapped in on the ranks
(:mod:`.live`), any other runs in a fresh run that loads that one module from the mutant's text
(``overlay_site/sitecustomize.py``), and mutants a CPU run cannot observe by design are classed,
not judged (:mod:`.classes`).

Verdicts: ``killed`` (a case failed), ``timeout`` (a case hit ``--check-timeout`` or the whole
run its per-mutant timeout: a hang), ``survived`` (every selected case passed, or no case
executes the mutated statement: ``note`` says which), ``incompetent`` (the mutated module does not
compile or import), ``error`` (the harness itself failed; not scored, listed in the report), ``classed`` (the torch
target: not run, not scored; its class is counted).
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from conformance.mutation import classes, coverage, live, population, report

ROOT = Path(__file__).resolve().parents[2]
COPIED = ("reference", "conformance", "pyproject.toml")
DEFAULT_SAMPLE = 200
DEFAULT_SEED = 2026


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m conformance.mutation",
        description="Mutation campaign on reference/: sample mutants, run the cases that execute "
        "each mutated statement, score the suite. Resumable (rerun the same command); shardable "
        "(--shard i/n on several machines, then --merge with every shard's session file in the "
        "work directory).",
    )
    p.add_argument(
        "--target",
        choices=population.TARGETS,
        default="reference",
        help="what to mutate: reference (reference/, judged against reference / reference-fsdp1) "
        "or torch (the FSDP sources of the torch under test, read into a private copy, judged "
        "against torch-fsdp2 / torch-fsdp1; the installed files are never written)",
    )
    p.add_argument("--sample", type=int, default=DEFAULT_SAMPLE, help="mutants to draw (0: all)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the draw")
    p.add_argument("--shard", default="1/1", help="i/n: run the i-th of n shares (1-based)")
    p.add_argument("--world-sizes", default="1,2", help="world sizes of the cases (default 1,2)")
    p.add_argument(
        "--fallback-world-sizes",
        default="4",
        help="for a mutant whose statement no case at --world-sizes executes: the cases at these "
        "world sizes that do (default 4: e.g. an int reshard_after_forward needs a mesh of 4; "
        "'' for none); see [Note: fallback world sizes]",
    )
    p.add_argument("--check-timeout", type=float, default=30.0, help="per check, seconds")
    p.add_argument(
        "--timeout",
        type=float,
        default=0.0,
        help="per mutant, seconds (default: 60 + 4 x the selected cases' unmutated time)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=8,
        help="mutants per shared conformance run (see conformance/mutation/live.py; 1: a "
        "fresh run per mutant)",
    )
    p.add_argument("--work-dir", default="reports/mutation-work", help="tree copy, cache, sessions")
    p.add_argument("--reports-dir", default="reports", help="mutation.json / .md go here")
    p.add_argument(
        "--tree-from",
        default="",
        help="mutate a copy of this git revision (e.g. HEAD) instead of the checkout's files",
    )
    p.add_argument(
        "--files",
        default="",
        help="only mutants of these reference files (comma-separated globs, e.g. "
        "'reference/wrap/*'; default: all of reference/)",
    )
    p.add_argument(
        "--checks",
        default="",
        help="a pytest -k expression narrowing the cases a mutant may run (default: all)",
    )
    p.add_argument("--ids", default="", help="run only these mutant ids (comma-separated)")
    p.add_argument("--merge", action="store_true", help="only merge the session files and report")
    p.add_argument(
        "--draw-from",
        default="",
        help="draw the mutants of an earlier campaign instead of --sample/--seed: those of its "
        "session file(s) (comma-separated; globs allowed), found again by fingerprint, so the same "
        "draw survives edits that moved lines of reference/",
    )
    p.add_argument(
        "--carry",
        default="",
        help="an earlier campaign's session file(s) (comma-separated; globs allowed): their kills, "
        "timeouts and incompetent verdicts for mutants of this draw are taken over unjudged and "
        "marked carried; survivors and errors are judged again on the current suite (see "
        "[Note: carried verdicts])",
    )
    p.add_argument("--list", action="store_true", help="list the drawn mutants and exit")
    p.add_argument(
        "--triage",
        default=str(ROOT / "conformance" / "mutation" / "triage.toml"),
        help="the checked-in triage file (equivalent mutants, known gaps)",
    )
    args = p.parse_args(argv)
    m = re.fullmatch(r"(\d+)/(\d+)", args.shard)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        p.error(f"--shard {args.shard!r}: expected i/n with 1 <= i <= n, e.g. --shard 1/4")
    args.shard_i, args.shard_n = int(m.group(1)), int(m.group(2))
    try:
        args.ws = sorted({int(w) for w in args.world_sizes.split(",") if w.strip()})
    except ValueError:
        p.error(f"--world-sizes {args.world_sizes!r}: expected comma-separated integers, e.g. 1,2")
    if not args.ws or min(args.ws) < 1:
        p.error(f"--world-sizes {args.world_sizes!r}: give at least one size >= 1, e.g. 1,2")
    try:
        fallback = {int(w) for w in args.fallback_world_sizes.split(",") if w.strip()}
    except ValueError:
        p.error(
            f"--fallback-world-sizes {args.fallback_world_sizes!r}: expected comma-separated "
            "integers, e.g. 4, or '' for none"
        )
    args.fallback_ws = sorted(w for w in fallback if w not in args.ws)
    if args.sample < 0:
        p.error(f"--sample {args.sample}: give a count >= 0 (0 draws every mutant)")
    return args


def tree_hash(root: Path, parts=("reference", "conformance")) -> str:
    h = hashlib.sha256()
    for part in parts:
        for path in sorted((root / part).rglob("*.py")):
            if "__pycache__" in path.parts or path.parent.name == "mutation":
                continue  # caches, and the campaign's own code (it measures, it is not measured)
            h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def copy_tree(dest: Path, rev: str = "") -> None:
    """A fresh copy of what the suite needs, without caches: the checkout's files as they are, or
    those of git revision ``rev`` (``--tree-from HEAD``: what was committed, whatever is being
    edited in the checkout meanwhile)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    if rev:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", rev, *COPIED],
            capture_output=True,
            check=False,
        )
        if archive.returncode:
            raise SystemExit(f"mutation: --tree-from {rev}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
        # the campaign's own tooling (tracer, import check) is the one running, not rev's
        shutil.rmtree(dest / "conformance" / "mutation", ignore_errors=True)
        shutil.copytree(
            Path(__file__).parent,
            dest / "conformance" / "mutation",
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
        return
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)  # the copy, not the checkout, must provide conformance/reference
    return env | extra  # (the torch overlay sets PYTHONPATH to its sitecustomize's directory)


def _run_reports(args, work: Path) -> Path:
    """Where this shard's conformance runs write their reports (each run replaces the last)."""
    return work / f"runs-{args.shard_i}of{args.shard_n}"


def _suite_command(args, work: Path, tree: Path, impls, sizes, *rest: str) -> list[str]:
    """``python -m conformance`` over the copy ``tree`` for ``impls`` at ``sizes``, quiet, into
    :func:`_run_reports`; ``rest`` adds options and the node ids or files to run."""
    return [
        sys.executable,
        "-m",
        "conformance",
        "--impl",
        ",".join(impls),
        "--world-sizes",
        ",".join(map(str, sizes)),
        "--check-timeout",
        f"{args.check_timeout:g}",
        "--reports-dir",
        str(_run_reports(args, work).resolve()),
        "-q",
        "--tb=no",
        "-p",
        "no:cacheprovider",
        f"--rootdir={tree.resolve()}",  # node ids relative to the copy, whatever paths follow
        *rest,
    ]


def _run(cmd: list[str], cwd: Path, env: dict, timeout: float) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group; ``(None, output)`` when it ran out of time."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out or ""
    except BaseException:  # Ctrl-C / SIGTERM of the campaign: the run goes with it
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def source_hash(src: Path, target: str) -> str:
    """A hash of the torch target's copied sources ('' for the reference: tree_hash covers it)."""
    if target != "torch":
        return ""
    h = hashlib.sha256()
    for file in population.torch_files(src):
        h.update(file.encode() + b"\0" + (src / file).read_bytes())
    return "-torch" + h.hexdigest()[:12]


def measure_coverage(
    tree: Path, work: Path, ws: list[int], checks: str = "", target: str = "reference", src=None
) -> dict:
    """The coverage map and baseline of the unmutated tree (cached; see :mod:`.coverage`)."""
    digest = hashlib.sha256(checks.encode()).hexdigest()[:6]
    key = tree_hash(tree) + source_hash(src or tree, target)
    key += "-ws" + "".join(map(str, ws)) + (f"-k{digest}" if checks else "")
    cache = work / f"coverage-{key}.json"
    if cache.exists():
        return json.loads(cache.read_text()) | {"ws": ",".join(map(str, ws))}
    trace_dir = work / "trace"
    shutil.rmtree(trace_dir, ignore_errors=True)
    trace_dir.mkdir(parents=True)
    reports_dir = work / "trace-report"
    cmd = [
        sys.executable,
        "-m",
        "conformance",
        "--impl",
        ",".join(coverage.specs(target).values()),
        "--world-sizes",
        ",".join(map(str, ws)),
        "-p",
        "conformance.mutation.coverage",
        "-p",
        "no:cacheprovider",
        f"--rootdir={tree.resolve()}",  # node ids relative to the copy, whatever paths follow
        "--reports-dir",
        str(reports_dir.resolve()),
        "-q",
        "--tb=no",
        *(["-k", checks] if checks else []),
    ]
    print(f"mutation: measuring the coverage map (one traced run at ws {ws}) ...", flush=True)
    started = time.monotonic()
    code, out = _run(cmd, tree, _env(**{coverage.TRACE_ENV: str(trace_dir.resolve())}), 3600)
    if code == 5:  # pytest: no case selected (a --checks expression with none at these sizes)
        print(f"mutation: no selected case runs at ws {ws}: an empty coverage map", flush=True)
        return {"key": key, "wall_s": 0.0, "control_failures": [], "duration": {}, "lines": {}} | {
            "ws": ",".join(map(str, ws))
        }
    if code not in (0, 1) or not (trace_dir / "map.out").exists():
        raise SystemExit(f"mutation: the traced run exited {code}:\n{out[-3000:]}")
    lines = json.loads((trace_dir / "map.out").read_text())
    cases = json.loads((reports_dir / "conformance.json").read_text())["cases"]
    baseline = {c["nodeid"]: (c["outcome"], c["duration_s"]) for c in cases}
    usable = {n: f for n, f in lines.items() if baseline.get(n, ("",))[0] in ("pass", "xfail")}
    data = {
        "key": key,
        "wall_s": round(time.monotonic() - started, 1),
        "control_failures": sorted(n for n, (o, _) in baseline.items() if o == "fail"),
        "duration": {n: baseline[n][1] for n in usable},
        "lines": usable,
    }
    cache.write_text(json.dumps(data))
    data["ws"] = ",".join(map(str, ws))
    print(
        f"mutation: coverage map of {len(usable)} cases in {data['wall_s']} s "
        f"({len(data['control_failures'])} control failures left out)",
        flush=True,
    )
    return data


_WS = re.compile(r"\[(.+?)-ws(\d+)(?:-|\])")


def _overlay(args, work: Path, mutant, mutated: str) -> dict:
    """The environment of a fresh run in which the torch mutant's module is loaded from a private
    file (see [Note: the torch overlay] in ``overlay_site/sitecustomize.py``)."""
    path = work / f"overlay-{args.shard_i}of{args.shard_n}" / mutant.file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(mutated)
    site = Path(__file__).resolve().parent / "overlay_site"
    return {
        "PYTHONPATH": str(site),
        "FSDP_MUTATION_OVERLAY_MODULE": population.module_of(mutant.file),
        "FSDP_MUTATION_OVERLAY_FILE": str(path.resolve()),
    }


def judge(mutant, prep: dict, tree: Path, work: Path, cov: dict, args) -> dict:
    """Write the mutant into ``tree`` (the torch target: into an overlay, see :func:`_overlay`),
    run its cases in a fresh run (``-x``), restore the file."""
    started = time.monotonic()
    original = (tree / mutant.file).read_text() if args.target == "reference" else ""
    record, mutated, cases = prep["record"] | {"run": "process"}, prep["mutated"], prep["cases"]

    def done(status: str, note: str = "", **extra) -> dict:
        return (
            record
            | extra
            | {
                "status": status,
                "note": note,
                "seconds": round(time.monotonic() - started, 2),
            }
        )

    impls = sorted({_WS.search(n).group(1) for n in cases})
    sizes = sorted({int(_WS.search(n).group(2)) for n in cases})
    # a safety net for a hang outside any check (e.g. at import): a fresh run's start-up alone
    # takes 20-60 s on a loaded 2-core machine, so the budget starts well above that
    budget = args.timeout or 300 + 5 * sum(cov["duration"].get(n, 0.0) for n in cases)
    module = population.module_of(mutant.file)
    specs = coverage.specs(args.target)
    cmd = _suite_command(args, work, tree, [specs[i] for i in impls], sizes, "-x", *cases)
    if args.target == "torch":
        env = _env(**_overlay(args, work, mutant, mutated))
        # a module that does not import makes the conformance run fail before any adapter loads
        # (the harness imports torch's FSDP itself): ask first, in a bare interpreter
        check = [sys.executable, "-c", f"import torch.distributed.fsdp, {module}"]
        code, out = _run(check, tree, env, 300)
        if code != 0:
            return done("incompetent", "does not import: " + _last_line(out))
        code, out = _run(cmd, tree, env | {coverage.IMPORT_ENV: module}, budget)
    else:
        path = tree / mutant.file
        path.write_text(mutated)
        try:
            code, out = _run(cmd, tree, _env(**{coverage.IMPORT_ENV: module}), budget)
        finally:
            path.write_text(original)
    record["cases"] = len(cases)
    if code is None:
        return done("timeout", f"the run passed its {budget:.0f} s budget")
    if code == 2 and "could not load implementation" in out:
        return done("incompetent", "does not import: " + _last_line(out))
    if code == 0:
        return done("survived", f"{len(cases)} case(s) passed")
    if code == 1:
        failed = _failures(_run_reports(args, work))
        if failed:
            hung = all("did not finish within" in c["message"] for c in failed)
            return done("timeout" if hung else "killed", killer=failed[0]["id"])
    return done("error", f"the conformance run exited {code}: {_last_line(out)}")


def _kill_order(cases: list[str], duration: dict[str, float]) -> list[str]:
    """The order a mutant's cases run in (the first failure ends its run): the fastest case of
    every check first, then every check's second fastest, and so on: different checks assert
    different things, so a mutant meets each kind of assertion early."""
    by_check: dict[str, list[str]] = {}
    for n in sorted(cases, key=lambda n: (duration.get(n, 0.0), n)):
        by_check.setdefault(n.split("[", 1)[0], []).append(n)
    ranked = [(i, duration.get(n, 0.0), n) for ns in by_check.values() for i, n in enumerate(ns)]
    return [n for _, _, n in sorted(ranked)]


# [Note: fallback world sizes]
# Some statements run only at world sizes the campaign's main run does not use (1, 2 by default):
# an int reshard_after_forward that halves the mesh, HSDP's 2-D mesh. A mutant there is judged by
# the cases at the fallback world sizes (default 4) that execute the statement, measured by a
# second traced run made only when such a mutant comes up (and cached like the first). Its
# record says so in ``note``; only when no case at any of the sizes executes the statement does
# it survive unjudged ("no case executes the mutated statement").
#
# A mutant the main world sizes' cases reach and do not kill gets a second look: the cases at the
# fallback sizes that execute its statement (an HSDP or tensor-parallel check, say, running code
# every world size runs) judge it again, after the main pass, in shared runs like the first. A
# kill there is a kill (``note`` says at which sizes); a survivor's note counts both passes. So
# a campaign runs every relevant case of the default suite while paying for a world-size-4 run
# only for the few mutants the main pass leaves alive.


def prepare(mutant, tree: Path, cov: dict, fallback=None, classed: bool = False) -> dict:
    """The mutant's record so far, its mutated text, its cases and how it can be run: ``live``
    (inside a function body: a code swap in a shared run, see :mod:`.live`), ``process`` (a
    fresh run with the file rewritten) or ``done`` (no run needed; ``status`` set).
    ``fallback()``, when given, is the coverage map at the fallback world sizes (see the Note).
    ``tree`` holds the mutant's file (the torch target: the private copy of torch's sources);
    ``classed``: a mutant :func:`classes.classify` names a class of is recorded ``classed``, not
    run (the torch target, see [Note: classed mutants])."""
    original, mutated = population.mutated_source(tree, mutant)
    record = mutant.as_dict() | {
        "part": mutant.part,
        "diff": population.diff(original, mutated, mutant.file),
        "fingerprint": population.fingerprint(mutant, original, mutated),
        "cases": 0,
        "killer": "",
        "note": "",
        "seconds": 0.0,
    }
    try:
        compile(mutated, mutant.file, "exec")
    except SyntaxError as exc:
        return {"record": record | {"status": "incompetent", "note": f"does not compile: {exc}"}}
    kind = None
    if classed:
        kind = classes.classify(original, mutant.line, mutant.operator)
        if not kind and classes.no_caller(population.site_root(), mutant.file, mutant.line):
            kind = classes.NO_CALLER
    if kind:
        return {"record": record | {"status": "classed", "class": kind, "note": kind}}
    target = population.target_of(mutant.file)
    where = population.reach(original, mutant.line, population.called_at_import(tree, target))
    cases = population.select_cases(cov["lines"], mutant.file, where)
    widened = False
    if not cases and fallback is not None:
        extra, widened = fallback(), True
        cases = fallback_cases(mutant.file, where, cov, lambda: extra)
        if cases:
            record["note"] = f"judged at the fallback world sizes {extra['ws']}"
    if not cases:
        note = "no case executes the mutated statement"
        return {"record": record | {"status": "survived", "note": note}}
    cases = _kill_order(cases, cov["duration"])
    import ast

    live = not where.import_time and population._in_function(ast.parse(original), mutant.line)
    prep = {"record": record, "mutated": mutated, "cases": cases, "live": live}
    if fallback is not None and not widened:
        prep["second_look"] = lambda: _kill_order(
            fallback_cases(mutant.file, where, cov, fallback), cov["duration"]
        )
    return prep


def fallback_cases(file: str, where, cov: dict, fallback) -> list[str]:
    """The cases of the fallback map (``fallback()``, measured on first use) that execute the
    statement ``where`` of ``file``; their durations join ``cov`` (the kill order reads them)."""
    extra = fallback()
    cov["duration"].update(extra["duration"])
    return population.select_cases(extra["lines"], file, where)


def second_look(first: dict, rec: dict, ws: str) -> dict:
    """The verdict of a main-pass survivor ``first`` after the fallback sizes' run ``rec`` (see
    [Note: fallback world sizes])."""
    seconds = round(first["seconds"] + rec["seconds"], 2)
    if rec["status"] in ("killed", "timeout"):
        note = f"killed at the fallback world sizes {ws}; {first['note']} at the main ones"
        return rec | {"seconds": seconds, "note": note}
    if rec["status"] == "survived":
        note = f"{first['note']}; {rec['cases']} more at the fallback world sizes {ws}"
        return first | {"seconds": seconds, "note": note}
    note = f"{first['note']}; the fallback world sizes' run: {rec['status']} {rec['note']}"
    return first | {"seconds": seconds, "note": note.strip()}


def judge_batch(batch: list, tree: Path, work: Path, cov: dict, args) -> list[dict]:
    """Judge live mutants (``(mutant, prepared)`` pairs) in one conformance run (see
    :mod:`.live`); a mutant the ranks could not swap in comes back with status ``retry``."""
    adapters, order, owner = {}, [], {}
    for mutant, prep in batch:
        module = population.module_of(mutant.file)
        by_impl: dict[str, list[str]] = {}
        for nodeid in prep["cases"]:
            by_impl.setdefault(_WS.search(nodeid).group(1), []).append(nodeid)
        for impl, nodeids in sorted(by_impl.items()):
            n = len(adapters)
            adapters[f"m{n}"] = {
                "id": mutant.id,
                "impl": impl,
                "module": module,
                "line": mutant.line,
                "source": prep["mutated"],
            }
            for nodeid in nodeids:
                mine = nodeid.replace(f"[{impl}-ws", f"[mutant-{n}-ws", 1)
                order.append(mine)
                owner[mine] = mutant.id
    batch_file = work / f"batch-{args.shard_i}of{args.shard_n}.json"
    batch_file.write_text(json.dumps({"adapters": adapters, "order": order}))
    sizes = sorted({int(_WS.search(n).group(2)) for n in order})
    files = sorted({n.split("::", 1)[0] for n in order})
    run_reports = _run_reports(args, work)
    impls = [f"conformance.mutation.live:{a}" for a in adapters]
    cmd = _suite_command(args, work, tree, impls, sizes, "-p", "conformance.mutation.live", *files)
    budget = 120 + 4 * sum(cov["duration"].get(n, 0.0) for _, p in batch for n in p["cases"])
    budget += len(batch) * args.check_timeout  # each mutant may hang one check
    started = time.monotonic()
    env = _env(**{live.BATCH_ENV: str(batch_file.resolve())})
    code, out = _run(cmd, tree, env, budget)
    wall = time.monotonic() - started
    results = {}
    if code in (0, 1) and (run_reports / "conformance.json").exists():
        for case in json.loads((run_reports / "conformance.json").read_text())["cases"]:
            if case["nodeid"] in owner:
                results.setdefault(owner[case["nodeid"]], []).append(case)
    case_time = sum(c["duration_s"] for cs in results.values() for c in cs)
    overhead = max(0.0, wall - case_time) / len(batch)
    records = []
    for mutant, prep in batch:
        cases = results.get(mutant.id, [])
        ran = [c for c in cases if c["outcome"] != "skip"]
        failed = [c for c in ran if c["outcome"] == "fail"]
        rec = prep["record"] | {
            "cases": len(ran),
            "seconds": round(sum(c["duration_s"] for c in ran) + overhead, 2),
            "run": "live",
        }
        if code is None:
            rec |= {"status": "retry", "note": f"the batch passed its {budget:.0f} s budget"}
        elif not cases:
            rec |= {"status": "retry", "note": f"the batch run exited {code}: {_last_line(out)}"}
        elif any(live.NOT_APPLIED in c["message"] for c in failed):
            rec |= {"status": "retry", "note": "no code swap possible"}
        elif failed:
            hung = all("did not finish within" in c["message"] for c in failed)
            rec |= {"status": "timeout" if hung else "killed", "killer": failed[0]["id"]}
        elif len(cases) < len(prep["cases"]):
            rec |= {"status": "retry", "note": f"{len(cases)} of {len(prep['cases'])} collected"}
        else:
            rec |= {"status": "survived", "note": f"{len(ran)} case(s) passed or skipped"}
        records.append(rec)
    return records


def _failures(run_reports: Path) -> list[dict]:
    path = run_reports / "conformance.json"
    if not path.exists():
        return []
    return [c for c in json.loads(path.read_text())["cases"] if c["outcome"] == "fail"]


def _last_line(out: str) -> str:
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def run_campaign(todo: list, tree: Path, work: Path, cov: dict, args, out, src=None) -> None:
    """Judge ``todo`` in order, appending each verdict to ``out`` as soon as it is known: live
    mutants in batches of ``--batch`` (one shared run each), the others one run each. ``src``
    holds the mutated files (default ``tree``; the torch target: the copy of torch's sources)."""
    src = src or tree
    count = [0]
    extra: list[dict] = []

    def fallback() -> dict:
        """The coverage map at the fallback world sizes, measured on first use."""
        if not extra:
            extra.append(
                measure_coverage(tree, work, args.fallback_ws, args.checks, args.target, src)
            )
        return extra[0]

    widen = fallback if args.fallback_ws else None

    def emit(rec: dict) -> None:
        out.write(json.dumps(rec) + "\n")
        out.flush()
        os.fsync(out.fileno())
        count[0] += 1
        print(
            f"mutation: [{count[0]}/{len(todo)}] {rec['status']:11} {rec['seconds']:6.1f} s "
            f"{rec.get('run', '-'):7} {rec['id']}" + (f" ({rec['note']})" if rec["note"] else ""),
            flush=True,
        )

    later: list = []  # main-pass survivors waiting for their second look

    def settle(mutant, prep, rec) -> None:
        if "first" in prep:
            emit(second_look(prep["first"], rec, fallback()["ws"]))
        elif rec["status"] == "survived" and "second_look" in prep:
            cases = prep["second_look"]()
            if cases:
                later.append((mutant, prep | {"cases": cases, "first": rec}))
                return
            emit(rec)
        else:
            emit(rec)

    def process(mutant, prep) -> None:
        settle(mutant, prep, judge(mutant, prep, tree, work, cov, args))

    batch: list = []

    def flush_batch() -> None:
        if not batch:
            return
        for (mutant, prep), rec in zip(batch, judge_batch(batch, tree, work, cov, args)):
            if rec["status"] == "retry":
                print(f"mutation: {mutant.id}: {rec['note']}; a fresh run judges it", flush=True)
                process(mutant, prep)
            elif rec["status"] == "timeout":
                # a check that ran out of time in a shared run is judged again alone, so that a
                # slow moment of a loaded machine is not taken for a hang
                print(f"mutation: {mutant.id}: a check timed out; a fresh run confirms", flush=True)
                process(mutant, prep)
            else:
                settle(mutant, prep, rec)
        batch.clear()

    def judge_all(preps) -> None:
        for mutant, prep in preps:
            if "cases" not in prep:
                emit(prep["record"])
            elif prep["live"] and args.batch > 1:
                batch.append((mutant, prep))
                if len(batch) >= args.batch:
                    flush_batch()
            else:
                process(mutant, prep)
        flush_batch()

    judge_all(
        (mutant, prepare(mutant, src, cov, widen, classed=args.target == "torch"))
        for mutant in todo
    )
    if later:
        print(f"mutation: a second look at {len(later)} survivor(s) at the fallback world sizes")
        judge_all(list(later))


# [Note: carried verdicts]
# After checks are added for a campaign's survivors, the same draw is judged again with
# ``--carry <old session>``: only the survivors (and errors) of the old session run again; its
# kills are copied into the new session with ``carried`` naming the file they came from. That is
# sound while the suite only grew since (a kill by a check that still exists stays a kill); when
# checks were changed or removed, run the draw afresh instead. Verdicts are matched by fingerprint
# (the mutated text), so a mutant whose line moved keeps its verdict and an edited line is judged
# anew. ``--draw-from <old session>`` makes the draw itself the old session's mutants, found again
# by fingerprint: a seeded draw picks by index into the population, so any edit of reference/
# that adds or removes a mutant would draw another sample.
CARRIED = ("killed", "timeout", "incompetent")


def session_files(spec: str, flag: str) -> list[Path]:
    """The session files a comma-separated list of paths or globs names (``flag`` for errors)."""
    paths = []
    for part in (x.strip() for x in spec.split(",") if x.strip()):
        found = [Path(f) for f in sorted(glob.glob(part))] if glob.has_magic(part) else [Path(part)]
        if not found or not all(f.is_file() for f in found):
            raise SystemExit(f"mutation: {flag} {part!r}: no such session file")
        paths += found
    return paths


def by_fingerprint(paths: list[Path]) -> dict[str, dict]:
    """fingerprint -> the verdict the session files ``paths`` hold for it."""
    return {rec["fingerprint"]: rec for rec in load_session(paths).values()}


def fingerprints(tree: Path, mutants: list) -> dict[str, object]:
    """fingerprint -> mutant, for ``mutants`` of the copy at ``tree``."""
    return {population.fingerprint(m, *population.mutated_source(tree, m)): m for m in mutants}


def carry_over(paths: list[Path], tree: Path, todo: list, session: Path) -> list:
    """Append to ``session`` the verdicts of ``paths`` that carry over to mutants of ``todo`` (see
    the Note), under today's ids; return the mutants still to judge."""
    old = {f: rec for f, rec in by_fingerprint(paths).items() if rec["status"] in CARRIED}
    named = ", ".join(p.name for p in paths)
    take = [
        old[f] | m.as_dict() | {"carried": named}
        for f, m in fingerprints(tree, todo).items()
        if f in old
    ]
    with open(session, "a") as out:
        for rec in take:
            out.write(json.dumps(rec) + "\n")
    print(f"mutation: --carry: {len(take)} verdict(s) taken over unjudged", flush=True)
    taken = {rec["id"] for rec in take}
    return [m for m in todo if m.id not in taken]


def _first_removed(diff: str) -> str | None:
    """The first removed line of a unified diff, stripped (None when it removes nothing)."""
    for line in diff.splitlines():
        if line.startswith("-") and not line.startswith("---"):
            return line[1:].strip()
    return None


def session_paths(work: Path, key: str) -> list[Path]:
    return sorted(work.glob(f"session-{key}-*.jsonl"))


def load_session(paths: list[Path]) -> dict[str, dict]:
    done = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                done[rec["id"]] = rec
    return done


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    work = (ROOT / args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    label = "merge" if args.merge else f"{args.shard_i}of{args.shard_n}"
    tree = work / f"tree-{label}"
    copy_tree(tree, args.tree_from)  # every mutant is written here, never into the checkout
    src = tree
    if args.target == "torch":  # read from the installed torch, never written (see population)
        src = population.copy_torch_sources(work / f"torch-src-{label}")
    everything = population.population(src, args.target)
    if args.files:
        globs = [g.strip() for g in args.files.split(",") if g.strip()]
        everything = [m for m in everything if any(fnmatch.fnmatch(m.file, g) for g in globs)]
        if not everything:
            raise SystemExit(
                f"mutation: --files {args.files!r} matches no mutant of the {args.target} target"
            )
    drawn = population.draw(everything, args.sample, args.seed)
    if args.ids:
        wanted = {i.strip() for i in args.ids.split(",") if i.strip()}
        unknown = wanted - {m.id for m in everything}
        if unknown:
            raise SystemExit(f"mutation: --ids: no such mutant {sorted(unknown)}; see --list")
        drawn = [m for m in everything if m.id in wanted]
    if args.draw_from:
        earlier = by_fingerprint(session_files(args.draw_from, "--draw-from"))
        # a fingerprint holds the first changed line's text, so only mutants at a line reading
        # like an earlier mutant's first removed line can match: computing every mutant's
        # fingerprint instead parses the file once per mutant (minutes for torch's 10,000)
        kinds = {
            (r["file"], r["operator"], _first_removed(r.get("diff", ""))) for r in earlier.values()
        }
        texts: dict[str, list[str]] = {}

        def line_text(m) -> str:
            lines = texts.setdefault(m.file, (src / m.file).read_text().splitlines())
            return lines[m.line - 1].strip() if m.line <= len(lines) else ""

        at = {(r["file"], r["operator"], r["line"]) for r in earlier.values()}  # unmoved ones
        candidates = [
            m
            for m in everything
            if (m.file, m.operator, m.line) in at
            or (m.file, m.operator, line_text(m)) in kinds
            or (m.file, m.operator, None) in kinds
        ]
        found = fingerprints(src, candidates)
        again = {m for f, m in found.items() if f in earlier}
        drawn = [m for m in everything if m in again]  # the population's order
        print(
            f"mutation: --draw-from: {len(drawn)} of its {len(earlier)} mutants found again "
            f"(the others' lines changed since)",
            flush=True,
        )
    # one campaign = this population (reference text), this suite, this draw
    ids = hashlib.sha256("\n".join(m.id for m in everything).encode()).hexdigest()
    key = hashlib.sha256(
        (
            tree_hash(tree)
            + source_hash(src, args.target)
            + ids
            + f"{args.sample}-{args.seed}-{args.world_sizes}-{args.ids}-{args.files}-{args.checks}"
            + f"-fb{args.fallback_ws}"
            + (f"-from:{args.draw_from}" if args.draw_from else "")
            + ("" if args.target == "reference" else f"-target:{args.target}")
        ).encode()
    ).hexdigest()[:12]
    session = work / f"session-{key}-{args.shard_i}of{args.shard_n}.jsonl"
    if args.list:
        for m in drawn:
            print(m.id)
        return 0
    if not args.merge:
        mine = drawn[args.shard_i - 1 :: args.shard_n]
        done = load_session(session_paths(work, key))  # any shard's verdicts count
        todo = [m for m in mine if m.id not in done]
        if args.carry:
            todo = carry_over(session_files(args.carry, "--carry"), src, todo, session)
        print(
            f"mutation: population {len(everything)}, drawn {len(drawn)} "
            + (f"(from {args.draw_from}), " if args.draw_from else f"(seed {args.seed}), ")
            + f"shard {args.shard}: {len(mine)}, already judged {len(mine) - len(todo)}; "
            f"session {session.relative_to(ROOT) if session.is_relative_to(ROOT) else session}",
            flush=True,
        )
        cov = measure_coverage(tree, work, args.ws, args.checks, args.target, src)
        with open(session, "a") as out:
            run_campaign(todo, tree, work, cov, args, out, src)
    results = load_session(session_paths(work, key))
    missing = [m.id for m in drawn if m.id not in results]
    summary = report.write(
        [results[m.id] for m in drawn if m.id in results],
        drawn=len(drawn),
        missing=len(missing),
        args=args,
        population=len(everything),
        triage_path=Path(args.triage),
        reports_dir=(ROOT / args.reports_dir),
    )
    print(summary)
    return 0
