"""The HTML scoreboard: one self-contained page from one or more runs' ``conformance.json``.

Every run writes ``reports/conformance.html`` next to its JSON (conformance.reporting);
``python -m conformance report RUN_DIR_OR_JSON... [-o page.html]`` (``nox -s report``) builds one
page from several runs: implementations, torch versions, devices, world sizes side by side.

[Note: the page]
One file, no network: the CSS and the script are inline, the data is one JSON blob in a
``<script type="application/json">`` element that the script renders. :func:`build_model` does
all the counting here in Python (so it is unit-tested without a browser); the page only lays it
out. The model:

* ``columns``: one per (run, implementation), in the order given; ``areas``: the rows;
* ``cells[area][column]``: outcome counts per world size, and the capabilities that gated the
  cell's not-supported cases (a cell whose every case is not supported shows just those, folded);
* ``unsupported``: every gating capability with its count per column and the areas it covers
  (a case that lacks two capabilities counts under both);
* ``ids`` / ``cases`` / ``details``: each case as ``[column, id index, world size, outcome index,
  duration, detail index]``; only failures, expected failures and skips carry a detail (message,
  ranks, repro, the expectation entry), so that 10,000 passing cases cost a few hundred KB;
* ``diffs``: for each pair of consecutive runs that share an implementation, conformance.diff's
  comparison of their cases of the shared implementations (or of their one implementation each:
  upstream against a fork).

The template (templates/scoreboard.html.j2, Jinja2) holds the markup, style and script; the blob is
escaped so that no ``</script>`` inside a message can end it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from conformance import diff as diff_mod
from conformance.reporting import OUTCOMES, expectation_of, gate_of, interrupted_line

DETAILED = ("fail", "xfail", "skip")  # outcomes whose cases carry message, ranks, repro
_ISSUE = re.compile(
    r"\b(?:(?P<owner>[\w.-]+)/)?(?P<repo>pytorch|torch|[\w.-]+)#(?P<number>\d+)\b|https?://\S+"
)


def issue_links(text: str) -> list[dict]:
    """The upstream issues ``text`` cites: ``pytorch#123`` and ``owner/repo#123`` become GitHub
    links (``pytorch`` is pytorch/pytorch), bare URLs are kept as they are."""
    links, seen = [], set()
    for found in _ISSUE.finditer(text or ""):
        if found["number"] is None:
            url, label = found[0].rstrip(").,;"), found[0].rstrip(").,;")
        else:
            owner = found["owner"] or ("pytorch" if found["repo"] in ("pytorch", "torch") else "")
            if not owner:
                continue
            repo = "pytorch" if found["repo"] == "torch" else found["repo"]
            url = f"https://github.com/{owner}/{repo}/issues/{found['number']}"
            label = found[0]
        if url not in seen:
            seen.add(url)
            links.append({"label": label, "url": url})
    return links


_CAPABILITY = re.compile(r"[\w.-]+")


def capabilities(gate: str) -> list[str]:
    """The capabilities of a gate: a list such as ``flat-param, hsdp`` is split (a case that
    lacks two counts under both); any other text (what an implementation said it does not
    support) is one gate."""
    parts = [p.strip() for p in gate.split(",")]
    return parts if all(_CAPABILITY.fullmatch(p) for p in parts) else [gate]


def load_run(path: Path) -> tuple[dict, Path]:
    """A run's report from its ``conformance.json`` or the directory holding it."""
    path = Path(path)
    if path.is_dir():
        path = path / "conformance.json"
    return diff_mod.load(path), path


def default_labels(docs: list[dict], paths: list[Path]) -> list[str]:
    """A label per run that tells the runs apart: what differs among torch, device, world sizes,
    else the report's directory."""
    if len(docs) == 1:
        return [f"torch {docs[0].get('torch', '?')}"]
    parts: list[list[str]] = [[] for _ in docs]
    aspects = (
        ("torch", lambda d: f"torch {d.get('torch', '?')}"),
        ("device", lambda d: "/".join(sorted({p["device"] for p in d.get("placement", {}).values()}))),
        ("world sizes", lambda d: "ws" + ",".join(str(w) for w in d.get("world_sizes", []))),
    )  # fmt: skip
    for _, describe in aspects:
        values = [describe(d) for d in docs]
        if len(set(values)) > 1:
            for part, value in zip(parts, values):
                part.append(value)
    labels = [" · ".join(p) for p in parts]
    if len(set(labels)) < len(labels):
        labels = [f"{p.parent.name or p.name} {lab}".strip() for p, lab in zip(paths, labels)]
    if len(set(labels)) < len(labels):
        labels = [f"run {i + 1} {lab}".strip() for i, lab in enumerate(labels)]
    return labels


def _run_info(doc: dict, label: str) -> dict:
    return {
        "label": label,
        "torch": doc.get("torch", "?"),
        "python": doc.get("python", "?"),
        "platform": doc.get("platform", ""),
        "created": doc.get("created", ""),
        "wall_time_s": doc.get("wall_time_s"),
        "command": doc.get("command", ""),
        "placement": doc.get("placement", {}),
        "interrupted": interrupted_line(doc) if doc.get("interrupted") else "",
        "summary": {o: sum(1 for c in doc["cases"] if c["outcome"] == o) for o in OUTCOMES},
        "stale": doc.get("stale_expectations", []),
        "implementations": doc.get("implementations", []),
    }


def _detail(case: dict) -> dict:
    message = case.get("message") or ""
    out = {
        "message": message,
        "ranks": [
            {k: r.get(k) for k in ("rank", "status", "duration_s", "detail")}
            for r in case.get("ranks", [])
            if r.get("detail") or r.get("status") != "ok"
        ],
        "repro": case.get("repro", ""),
        "rule": case.get("rule", ""),
    }
    entry = case.get("expectation") or (
        expectation_of(message) if case["outcome"] == "xfail" else None
    )
    if case["outcome"] == "fail" and diff_mod.outcome_of(case) == diff_mod.XPASS:
        out["xpass"] = True
    if entry:
        out["expectation"] = {**entry, "links": issue_links(entry.get("reason", ""))}
    for key in ("repro_script",):
        if case.get(key):
            out[key] = case[key]
    return out


def _only(doc: dict, impls: set[str]) -> dict:
    """``doc`` with only the cases of ``impls``."""
    return {**doc, "cases": [c for c in doc["cases"] if c["impl"] in impls]}


def _diffs(docs: list[dict], labels: list[str]) -> list[dict]:
    """conformance.diff's comparison of each run with the next, over the implementations both
    ran; two runs of one implementation each, under different names (upstream and a fork), are
    compared as one implementation, their cases matched by id. Other runs that share no
    implementation have nothing to compare."""
    out = []
    for i in range(len(docs) - 1):
        old, new = docs[i], docs[i + 1]
        before, after = {c["impl"] for c in old["cases"]}, {c["impl"] for c in new["cases"]}
        shared = before & after
        title = f"{labels[i]} → {labels[i + 1]}"
        renamed = False
        if shared:
            old, new = _only(old, shared), _only(new, shared)
        elif len(before) == len(after) == 1:
            (was,), (now,) = before, after
            new = {**new, "cases": [{**c, "impl": was} for c in new["cases"]]}
            shared, renamed = {f"{was} → {now}"}, True
            title = f"{labels[i]} {was} → {labels[i + 1]} {now}"
        else:
            continue
        result = diff_mod.compare(old, new)
        if renamed:  # each name is absent from one of the two runs: not a version change
            result.versions = [v for v in result.versions if "(absent)" not in v[1:]]
        out.append(
            {
                "old": i,
                "new": i + 1,
                "title": title,
                "impls": sorted(shared),
                "versions": [list(v) for v in result.versions],
                "unchanged": result.unchanged,
                "sections": [
                    {
                        "key": key,
                        "title": title,
                        "changes": [
                            {
                                "impl": c.impl,
                                "id": c.case_id,
                                "old": c.old,
                                "new": c.new,
                                "message": c.message,
                            }
                            for c in getattr(result, key)
                        ],  # fmt: skip
                    }
                    for key, title in diff_mod.SECTIONS
                ],
            }
        )
    return out


def build_model(docs: list[dict], labels: list[str] | None = None, title: str = "") -> dict:
    """The page's data from loaded reports (see [Note: the page])."""
    labels = labels or default_labels(docs, [Path(f"run{i}") for i in range(len(docs))])
    columns: list[dict] = []
    column_of: dict[tuple[int, str], int] = {}
    for r, doc in enumerate(docs):
        versions = {i["name"]: i.get("version", "") for i in doc.get("implementations", [])}
        names = list(versions) + sorted({c["impl"] for c in doc["cases"]} - set(versions))
        for name in names:
            column_of[(r, name)] = len(columns)
            columns.append({"run": r, "impl": name, "version": versions.get(name, ""),
                            "label": labels[r], "total": {}})  # fmt: skip
    areas = sorted({c["area"] for d in docs for c in d["cases"]})
    area_index = {a: i for i, a in enumerate(areas)}
    world_sizes = sorted({c["world_size"] for d in docs for c in d["cases"]})
    counts: dict = defaultdict(Counter)  # (area, column, ws) -> outcomes
    gates: dict = defaultdict(Counter)  # (area, column) -> capability -> n
    unsupported: dict = defaultdict(lambda: {"columns": Counter(), "areas": set()})
    ids: list[str] = []
    area_of: list[int] = []  # per id: its area's index
    id_index: dict[str, int] = {}
    cases, details = [], []
    gate_detail: dict[str, int] = {}
    for r, doc in enumerate(docs):
        for case in doc["cases"]:
            col = column_of[(r, case["impl"])]
            outcome, ws, area = case["outcome"], case["world_size"], case["area"]
            counts[(area, col, ws)][outcome] += 1
            if case["id"] not in id_index:
                id_index[case["id"]] = len(ids)
                ids.append(case["id"])
                area_of.append(area_index[area])
            detail = -1
            if outcome == "not-supported":
                gate = case.get("capability") or gate_of(case.get("message", "")) or "(not stated)"
                for capability in capabilities(gate):
                    gates[(area, col)][capability] += 1
                    unsupported[capability]["columns"][col] += 1
                    unsupported[capability]["areas"].add(area)
                if gate not in gate_detail:  # one shared detail per gate
                    gate_detail[gate] = len(details)
                    details.append({"capability": gate})
                detail = gate_detail[gate]
            elif outcome in DETAILED:
                detail = len(details)
                details.append(_detail(case))
            cases.append([col, id_index[case["id"]], ws, OUTCOMES.index(outcome),
                          round(case.get("duration_s") or 0, 2), detail])  # fmt: skip
    cells = []
    for area in areas:
        row = []
        for col in range(len(columns)):
            per_ws = {
                str(ws): {o: counts[(area, col, ws)][o] for o in OUTCOMES if counts[(area, col, ws)][o]}
                for ws in world_sizes
                if counts.get((area, col, ws))
            }  # fmt: skip
            total = Counter()
            for c in per_ws.values():
                total.update(c)
            row.append(
                {
                    "ws": per_ws,
                    "total": dict(total),
                    "folded": bool(total) and set(total) == {"not-supported"},
                    "gates": dict(gates.get((area, col), Counter()).most_common()),
                    "status": status_of(total),
                }
            )
        cells.append(row)
    for col, column in enumerate(columns):
        total, per_ws = Counter(), defaultdict(Counter)
        for area in areas:
            for ws in world_sizes:
                total.update(counts.get((area, col, ws), {}))
                per_ws[ws].update(counts.get((area, col, ws), {}))
        column["total"] = {o: total[o] for o in OUTCOMES if total[o]}
        column["ws"] = {
            str(ws): {o: per_ws[ws][o] for o in OUTCOMES if per_ws[ws][o]}
            for ws in world_sizes
            if per_ws[ws]
        }
        column["status"] = status_of(total)
    return {
        "title": title or "FSDP conformance scoreboard",
        "generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "outcomes": list(OUTCOMES),
        "runs": [_run_info(d, lab) for d, lab in zip(docs, labels)],
        "columns": columns,
        "areas": areas,
        "world_sizes": world_sizes,
        "cells": cells,
        "unsupported": [
            {
                "capability": gate,
                "columns": {str(c): n for c, n in sorted(u["columns"].items())},
                "areas": sorted(u["areas"]),
                "total": sum(u["columns"].values()),
            }
            for gate, u in sorted(
                unsupported.items(), key=lambda kv: -sum(kv[1]["columns"].values())
            )
        ],
        "ids": ids,
        "area_of": area_of,
        "cases": cases,
        "details": details,
        "diffs": _diffs(docs, labels),
    }


def status_of(counter) -> str:
    """A cell's colour: the worst outcome in it (fail > xfail > pass > skip > not supported)."""
    for outcome in ("fail", "xfail", "pass", "skip", "not-supported"):
        if counter.get(outcome):
            return outcome
    return "empty"


def _blob(model: dict) -> str:
    """What the page's script needs of the model, as JSON that is safe inside a ``<script>``
    element (the rest is laid out by the template)."""
    data = {k: model[k] for k in ("outcomes", "areas", "ids", "area_of", "cases", "details")}
    data["runs"] = len(model["runs"])
    data["diffs"] = [  # each section's changes as [impl, id, old, new, message]
        [[[c["impl"], c["id"], c["old"], c["new"], c["message"]] for c in s["changes"]]
         for s in d["sections"]]
        for d in model["diffs"]
    ]  # fmt: skip
    data["columns"] = [{"impl": c["impl"], "label": c["label"]} for c in model["columns"]]
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render(model: dict) -> str:
    """The page (one HTML string) for ``model``."""
    import jinja2  # torch depends on Jinja2, so every environment that runs the suite has it

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("conformance.html", "templates"),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )
    return env.get_template("scoreboard.html.j2").render(model=model, blob=_blob(model))


def page(docs: list[dict], labels: list[str] | None = None, title: str = "") -> str:
    return render(build_model(docs, labels, title))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conformance report",
        description="Build one HTML scoreboard from one or more runs (side by side, with the "
        "diff of consecutive runs that share an implementation).",
    )
    parser.add_argument(
        "runs", nargs="+", type=Path, metavar="RUN_DIR_OR_JSON",
        help="a run's conformance.json or the reports directory holding it, in column order",
    )  # fmt: skip
    parser.add_argument("-o", "--output", type=Path, default=Path("reports/scoreboard.html"))
    parser.add_argument(
        "--label", action="append", default=None,
        help="a column label per run, in order (default: what differs among the runs)",
    )  # fmt: skip
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    try:
        loaded = [load_run(p) for p in args.runs]
    except diff_mod.ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    docs, paths = [d for d, _ in loaded], [p for _, p in loaded]
    if args.label is not None and len(args.label) != len(docs):
        print(
            f"error: {len(args.label)} --label for {len(docs)} runs: give one per run",
            file=sys.stderr,
        )
        return 2
    labels = args.label or default_labels(docs, paths)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(page(docs, labels, args.title))
    cases = sum(len(d["cases"]) for d in docs)
    print(
        f"{args.output}: {len(docs)} run(s), {cases} cases, {args.output.stat().st_size / 1e6:.2f} MB"
    )
    return 0
