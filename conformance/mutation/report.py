"""The campaign's score and reports: ``reports/mutation.json``, ``mutation.md``, ``mutation-gaps.md``.

[Note: the score]
K = killed + timeout (a hang is a kill: the suite did notice), S = survivors not declared
equivalent in the triage file, M = K + S; the score is K / M. Incompetent mutants (they do not
import) and harness errors are left out of both. The 95 % interval is Wilson's score interval for
a binomial proportion (K successes in M draws): it stays inside [0, 1] and keeps sensible width at
small M and at scores near 100 %, where the normal approximation collapses to a point.
Each part (FSDP2, FSDP1 + hooks, wrap) and each operator family gets its own K/M and interval.

[Note: triage]
``conformance/mutation/triage.toml`` (checked in) holds one entry per survivor that someone looked
at, keyed by the mutant's fingerprint (see :func:`conformance.mutation.population.fingerprint`):

    [[equivalent]]              # no test can tell it apart from the original
    fingerprint = "5aa10b727c44"
    mutant = "reference/...:159:62:ReplaceAndWithOr:0"   # the id when it was triaged
    reason = "one line: why no observable behaviour changes"

    [[gap]]                     # a real gap: what a check must assert to kill it
    fingerprint = "..."
    mutant = "..."
    needs = "one line"

    [[killed]]                  # a gap closed since: the check that kills it now
    fingerprint = "..."
    mutant = "..."
    by = "area::check[case]"

    [[classed]]                 # no CPU run can reach or observe it: judged on a device, not here
    fingerprint = "..."
    mutant = "..."
    class = "cuda-only"         # or "performance"
    why = "one line: the only route to the line, or why only speed / memory changes"

Every entry names its ``target`` (``reference`` or ``torch``, see ``--target``; an entry without
one is the reference's): a campaign reads only its own target's entries.

A survivor is triaged when it has an entry of any kind; equivalent ones leave the score's M. A
``killed`` entry only matters for a session judged before that check existed (a rerun on the new
tree kills the mutant outright).

``classed`` is the hand-made twin of [Note: classed mutants] (``classes.py``), for what the static
classifier cannot see: the mutated line runs only on a path a CUDA device takes (no CPU
configuration of the public API reaches it: ``device_id=cuda``, pinned-memory CPU offload,
symmetric memory), or its whole effect is on speed or memory (a stream's priority, when a buffer
is freed), never on a value, an error or a warning. Such a survivor leaves M like an equivalent
one and is counted in the report's classed table as ``<class> (triage)``. Private code that only a
direct call reaches, a warning's stacklevel, or an effect only private state shows are *not*
classed: those stay gaps. ``TRIAGED_CLASSES`` holds the two classes the issue names.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from conformance.mutation import operators
from conformance.mutation.population import TARGETS, part_order

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

KILLED = ("killed", "timeout")
TRIAGED_CLASSES = ("cuda-only", "performance")  # [Note: triage], ``classed``
OUT_OF_SCORE = ("equivalent", "classed")  # triage kinds that leave M


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson's 95 % score interval for k successes in n trials ((0, 1) when n == 0)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    denom = 1 + z * z / n
    return max(0.0, (centre - half) / denom), min(1.0, (centre + half) / denom)


def load_triage(path: Path, target: str = "reference") -> dict[str, dict]:
    """fingerprint -> entry (with ``kind``: equivalent / gap / killed) of the ``target``'s
    entries; a missing file is empty."""
    if not path.exists():
        return {}
    data = tomllib.loads(path.read_text())
    entries = {}
    kinds = (("equivalent", "reason"), ("gap", "needs"), ("killed", "by"), ("classed", "why"))
    for kind, field in kinds:
        for entry in data.get(kind, []):
            if not entry.get("fingerprint") or not entry.get(field):
                raise SystemExit(
                    f"mutation: {path}: every [[{kind}]] needs a fingerprint and a {field}: {entry}"
                )
            if kind == "classed" and entry.get("class") not in TRIAGED_CLASSES:
                raise SystemExit(
                    f"mutation: {path}: class {entry.get('class')!r} of {entry['fingerprint']}: "
                    f"expected one of {', '.join(TRIAGED_CLASSES)}"
                )
            mine = entry.get("target", "reference")
            if mine not in TARGETS:
                raise SystemExit(
                    f"mutation: {path}: target {mine!r} of {entry['fingerprint']}: "
                    f"expected one of {', '.join(TARGETS)}"
                )
            if mine == target:
                entries[entry["fingerprint"]] = dict(entry, kind=kind)
    return entries


def _score(records: list[dict]) -> dict:
    k = sum(r["status"] in KILLED for r in records)
    s = sum(
        r["status"] == "survived" and r.get("triage", {}).get("kind") not in OUT_OF_SCORE
        for r in records
    )
    m = k + s
    lo, hi = wilson(k, m)
    return {
        "killed": k,
        "scored": m,
        "score": round(k / m, 4) if m else None,
        "ci95": [round(lo, 4), round(hi, 4)],
    }


def summarise(records: list[dict], triage: dict[str, dict], target: str = "reference") -> dict:
    for r in records:
        if r["status"] == "survived" and r["fingerprint"] in triage:
            r["triage"] = triage[r["fingerprint"]]
    counts = defaultdict(int)
    for r in records:
        counts[r["status"]] += 1
    survivors = [r for r in records if r["status"] == "survived"]
    by_part = {
        part: _score([r for r in records if r["part"] == part])
        for part in part_order(target)
        if any(r["part"] == part for r in records)
    }
    classed: dict[str, dict[str, int]] = {}  # [Note: classed mutants]: class -> part -> count
    for r in records:
        if r["status"] == "classed":
            per = classed.setdefault(r.get("class", r["note"]), {})
        elif r.get("triage", {}).get("kind") == "classed":
            per = classed.setdefault(f"{r['triage']['class']} (triage)", {})
        else:
            continue
        per[r["part"]] = per.get(r["part"], 0) + 1
    families = sorted({operators.operator_class(r["operator"]) for r in records})
    by_op = {
        f: _score([r for r in records if operators.operator_class(r["operator"]) == f])
        for f in families
    }
    timed = [r["seconds"] for r in records if r.get("cases")]
    return {
        **_score(records),
        "counts": dict(counts),
        "survivors": survivors,
        "by_part": by_part,
        "classed": classed,
        "by_operator": by_op,
        "median_s": round(statistics.median(timed), 1) if timed else None,
        "total_s": round(sum(r["seconds"] for r in records), 1),
    }


def _survivor_entry(r: dict) -> dict:
    t = r.get("triage")
    if t is None:
        triage = "untriaged"
    elif t["kind"] == "equivalent":
        triage = f"equivalent: {t['reason']}"
    elif t["kind"] == "killed":
        triage = f"killed by {t['by']}"
    elif t["kind"] == "classed":
        triage = f"classed {t['class']}: {t['why']}"
    else:
        triage = f"gap: {t['needs']}"
    return {
        "id": r["id"],
        "fingerprint": r["fingerprint"],
        "file": r["file"],
        "line": r["line"],
        "operator": r["operator"],
        "part": r["part"],
        "diff": r["diff"],
        "note": r["note"],
        "triage": triage,
    }


def write(records, *, drawn, missing, args, population, triage_path, reports_dir) -> str:
    """Write the three reports; return the final line (see the module's Note)."""
    target = getattr(args, "target", "reference")
    s = summarise(records, load_triage(triage_path, target), target)
    survivors = [_survivor_entry(r) for r in s["survivors"]]
    triaged = sum(e["triage"] != "untriaged" for e in survivors)
    killed_since = sum(e["triage"].startswith("killed by") for e in survivors)
    c = s["counts"]
    data = {
        "target": target,
        "sample": drawn,
        "seed": None if getattr(args, "draw_from", "") else args.seed,
        "drawn_from": getattr(args, "draw_from", "") or None,
        "population": population,
        "judged": len(records),
        "pending": missing,
        "killed": c.get("killed", 0),
        "survived": c.get("survived", 0),
        "timeout": c.get("timeout", 0),
        "incompetent": c.get("incompetent", 0),
        # not judged: changes a CPU run cannot observe by design (conformance/mutation/classes.py)
        "classed": c.get("classed", 0),
        "classed_by_class": s["classed"],
        "error": c.get("error", 0),
        "equivalent": sum(e["triage"].startswith("equivalent") for e in survivors),
        # survivors a [[classed]] triage entry takes out of the score (counted in classed_by_class)
        "classed_in_triage": sum(e["triage"].startswith("classed") for e in survivors),
        # verdicts taken over from an earlier session of the same draw (run.py --carry)
        "carried": sum(bool(r.get("carried")) for r in records),
        "carried_from": sorted({r["carried"] for r in records if r.get("carried")}),
        "score": s["score"],
        "score_ci95_wilson": s["ci95"],
        "score_k": s["killed"],
        "score_m": s["scored"],
        # the survivors a [[killed]] triage entry names a check for, counted as kills: the score
        # this draw would get on today's suite at the world sizes those checks ran
        "score_with_triaged_kills": round((s["killed"] + killed_since) / s["scored"], 4)
        if s["scored"]
        else None,
        "triaged_kills": killed_since,
        "by_part": s["by_part"],
        "by_operator": s["by_operator"],
        "median_s_per_mutant": s["median_s"],
        "total_s": s["total_s"],
        "world_sizes": args.world_sizes,
        "fallback_world_sizes": ",".join(map(str, getattr(args, "fallback_ws", []))),
        "survivors": survivors,
        "errors": [{"id": r["id"], "note": r["note"]} for r in records if r["status"] == "error"],
    }
    reports_dir.mkdir(parents=True, exist_ok=True)
    (reports_dir / "mutation.json").write_text(json.dumps(data, indent=2) + "\n")
    pct = f"{100 * s['score']:.1f}%" if s["score"] is not None else "n/a"
    line = (
        f"mutation score: {s['killed']}/{s['scored']} = {pct} "
        f"(survivors triaged {triaged}/{len(survivors)})"
    )
    (reports_dir / "mutation.md").write_text(_markdown(data, line))
    (reports_dir / "mutation-gaps.md").write_text(_gaps(survivors))
    return line


def _fmt(score: dict) -> str:
    if score["score"] is None:
        return f"{score['killed']}/{score['scored']}"
    lo, hi = score["ci95"]
    return (
        f"{score['killed']}/{score['scored']} = {100 * score['score']:.1f}% "
        f"[{100 * lo:.1f}, {100 * hi:.1f}]"
    )


def _markdown(d: dict, line: str) -> str:
    out = [
        "# Mutation campaign" + (f" (target {d['target']})" if d["target"] != "reference" else ""),
        "",
        (
            f"Sample {d['sample']} of {d['population']} mutants (seed {d['seed']}), world sizes "
            if not d["drawn_from"]
            else f"Sample: the {d['sample']} mutants of {d['drawn_from']} found again by "
            f"fingerprint among {d['population']}, world sizes "
        )
        + f"{d['world_sizes']}"
        + (
            f" (fallback {d['fallback_world_sizes']} for statements no case there executes)"
            if d["fallback_world_sizes"]
            else ""
        )
        + f"; judged {d['judged']}, pending {d['pending']}.",
        "",
        f"killed {d['killed']}, timeout {d['timeout']}, survived {d['survived']} "
        f"(equivalent {d['equivalent']}, classed in triage {d['classed_in_triage']}), "
        f"incompetent {d['incompetent']}, classed {d['classed']}, error {d['error']}; "
        f"median {d['median_s_per_mutant']} s per mutant run, {d['total_s']} s in all.",
        "",
        *(
            [
                f"{d['carried']} verdicts (kills, timeouts, incompetent) were carried unjudged "
                f"from {', '.join(d['carried_from'])} (`--carry`); the rest were judged on "
                "this suite.",
                "",
            ]
            if d["carried"]
            else []
        ),
        f"Survivors since killed by a named check (triage [[killed]]): {d['triaged_kills']}; "
        f"counting them, the score is {d['score_with_triaged_kills']}.",
        "",
        "Score = (killed + timeout) / (killed + timeout + survivors triaged neither equivalent "
        "nor classed), with Wilson's 95 % interval.",
        "",
        "| part | score [95 % interval] |",
        "|---|---|",
        *(f"| {p} | {_fmt(v)} |" for p, v in d["by_part"].items()),
        "",
        *(
            [
                "Classed, not scored (a CPU run cannot observe them by design; "
                "`conformance/mutation/classes.py`, and `(triage)`: survivors a `[[classed]]` "
                "triage entry classes):",
                "",
                "| class | mutants | per part |",
                "|---|---|---|",
                *(
                    f"| {k} | {sum(v.values())} | "
                    + ", ".join(f"{p} {n}" for p, n in sorted(v.items()))
                    + " |"
                    for k, v in sorted(d["classed_by_class"].items())
                ),
                "",
            ]
            if d["classed_by_class"]
            else []
        ),
        "| operator family | score [95 % interval] |",
        "|---|---|",
        *(f"| {p} | {_fmt(v)} |" for p, v in d["by_operator"].items()),
        "",
        "## Survivors",
        "",
    ]
    for e in d["survivors"]:
        out += [
            f"### {e['id']} ({e['part']})",
            "",
            f"fingerprint `{e['fingerprint']}`; {e['note']}; triage: {e['triage']}",
            "",
            "```diff",
            e["diff"],
            "```",
            "",
        ]
    out += [line, ""]
    return "\n".join(out)


def _gaps(survivors: list[dict]) -> str:
    out = ["# Mutation gaps: survivors triaged neither equivalent nor classed", ""]
    for e in survivors:
        if e["triage"].startswith(("equivalent", "classed")):
            continue
        out += [
            f"* `{e['file']}:{e['line']}` {operators.short_name(e['operator'])} "
            f"(`{e['fingerprint']}`): {e['triage']}",
            "",
            "  ```diff",
            *("  " + ln for ln in e["diff"].splitlines()),
            "  ```",
            "",
        ]
    return "\n".join(out)
