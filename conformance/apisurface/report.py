"""``python -m conformance api-coverage``: each public API entry of the torch under test, and the
checks that exercise it (or why it is out of scope). See docs/api-coverage.md.

    python -m conformance api-coverage                 # markdown, from the checked-in snapshot
    python -m conformance api-coverage --json          # the same as JSON
    python -m conformance api-coverage --trace         # measure again (one traced run; cached)
    python -m conformance api-coverage --trace --write # ... and update the snapshot
    python -m conformance api-coverage --trace --only "hsdp or optim" --write  # new checks only

Exit status: 0, or 1 with ``--check`` when an entry is neither covered nor out of scope.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from conformance.apisurface import surface as surface_mod

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (as conformance/mutation/report.py)
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
SNAPSHOT = HERE / "coverage.json"
OUT_OF_SCOPE = HERE / "out_of_scope.toml"
UNCOVERED = HERE / "uncovered.txt"


@dataclass
class Row:
    id: str
    kind: str
    status: str  # covered | out-of-scope | uncovered
    checks: list[str] = field(default_factory=list)
    reason: str = ""
    values: list[str] = field(default_factory=list)
    via: str = ""  # a name entry covered through one of its members


# ------------------------------------------------------------------------------------ inputs
def load_out_of_scope(path: Path = OUT_OF_SCOPE) -> dict[str, str]:
    """entry id -> reason, from ``[[out_of_scope]]`` tables (``entries`` + ``reason``)."""
    data = tomllib.loads(path.read_text()) if path.exists() else {}
    out: dict[str, str] = {}
    for i, table in enumerate(data.get("out_of_scope", [])):
        reason = str(table.get("reason", "")).strip()
        if not reason:
            raise ValueError(f"{path.name}: table {i + 1} has no reason; give every entry one")
        for entry in table.get("entries", []):
            if entry in out:
                raise ValueError(f"{path.name}: {entry!r} is listed twice")
            out[entry] = reason
    return out


def load_allowlist(path: Path = UNCOVERED) -> list[str]:
    """The entry ids of ``uncovered.txt`` (one a line; ``#`` starts a comment)."""
    if not path.exists():
        return []
    ids = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            ids.append(line)
    return ids


def allowlist_notes(path: Path = UNCOVERED) -> dict[str, str]:
    """entry id -> the comment after it in ``uncovered.txt`` (what a check of it would assert)."""
    notes = {}
    if path.exists():
        for line in path.read_text().splitlines():
            entry, _, note = line.partition("#")
            if entry.strip():
                notes[entry.strip()] = note.strip()
    return notes


def snapshot_from_trace(data: dict) -> dict:
    """The checked-in form of a trace: per entry the checks (``area::name``) whose passing (or
    expected-failing) cases called or passed it, the implementations, a few values seen."""
    entries: dict[str, dict] = {}
    for case in data["cases"].values():
        if case["outcome"] not in _trace().COVERING:
            continue
        check = case["id"].split("[", 1)[0]
        for entry, values in case["entries"].items():
            row = entries.setdefault(entry, {"checks": set(), "impls": set(), "values": set()})
            row["checks"].add(check)
            row["impls"].add(case["impl"])
            row["values"].update(values)
    return {
        "torch": data.get("torch", ""),
        "key": data.get("key", ""),
        "ws": data.get("ws", []),
        "wall_s": data.get("wall_s"),
        "cases": len(data["cases"]),
        "entries": {
            e: {
                "checks": sorted(r["checks"]),
                "impls": sorted(r["impls"]),
                "values": sorted(r["values"])[:8],
            }
            for e, r in sorted(entries.items())
        },
    }


def merge_snapshot(old: dict, partial: dict, expr: str) -> dict:
    """``old`` with the checks a partial trace (``--only EXPR``) ran replaced by what they
    recorded there: their old coverage goes, the partial trace's comes in."""
    traced = {c["id"].split("[", 1)[0] for c in partial["cases"].values()}
    new = snapshot_from_trace(partial)["entries"]
    entries: dict[str, dict] = {}
    for entry, row in old.get("entries", {}).items():
        kept = [c for c in row["checks"] if c not in traced]
        if kept:
            entries[entry] = dict(row, checks=kept)
    for entry, row in new.items():
        if entry in entries:
            was = entries[entry]
            row = {
                "checks": sorted({*was["checks"], *row["checks"]}),
                "impls": sorted({*was.get("impls", []), *row["impls"]}),
                "values": sorted({*was.get("values", []), *row["values"]})[:8],
            }
        entries[entry] = row
    merged = dict(old, entries=dict(sorted(entries.items())))
    merged["merged"] = [*old.get("merged", []), expr]
    return merged


def load_snapshot(path: Path = SNAPSHOT) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"entries": {}}


# ------------------------------------------------------------------------------------ the map
def rows(surface, snapshot: dict, out_of_scope: dict[str, str]) -> list[Row]:
    """One row per entry of ``surface``: covered by the snapshot's checks (a name entry also
    through its members), else out of scope with its reason, else uncovered."""
    covered = snapshot.get("entries", {})
    children: dict[str, list[str]] = {}
    for e in surface.entries:
        if e.parent:
            children.setdefault(e.parent, []).append(e.id)
    out = []
    for e in surface.entries:
        row = Row(e.id, e.kind, "uncovered", reason=out_of_scope.get(e.id, ""))
        if e.id in covered:
            row.status = "covered"
            row.checks = list(covered[e.id]["checks"])
            row.values = list(covered[e.id].get("values", []))
        else:
            via = [c for c in children.get(e.id, []) if c in covered]
            if via:
                row.status, row.via = "covered", via[0]
                row.checks = sorted({c for v in via for c in covered[v]["checks"]})
            elif e.id in out_of_scope:
                row.status = "out-of-scope"
        out.append(row)
    return out


def problems(surface, snapshot: dict, out_of_scope: dict[str, str]) -> list[str]:
    """Lines of the inputs that do not match the surface: out-of-scope ids that are no entry or
    are covered, snapshot entries that are no entry (a stale snapshot)."""
    ids = set(surface.ids())
    found = []
    for entry in sorted(set(out_of_scope) - ids):
        found.append(f"out_of_scope.toml names {entry!r}, which is no entry of torch "
                     f"{surface.torch_version}: remove the line")  # fmt: skip
    covered = {r.id for r in rows(surface, snapshot, {}) if r.status == "covered"}
    for entry in sorted(set(out_of_scope) & covered):
        found.append(f"out_of_scope.toml names {entry!r}, but checks cover it: remove the line")
    for entry in sorted(set(snapshot.get("entries", {})) - ids):
        found.append(f"coverage.json records {entry!r}, which is no entry of torch "
                     f"{surface.torch_version}: run api-coverage --trace --write")  # fmt: skip
    return found


def summary(table: list[Row]) -> dict:
    by_reason: dict[str, int] = {}
    for r in table:
        if r.status == "out-of-scope":
            by_reason[r.reason] = by_reason.get(r.reason, 0) + 1
    return {
        "entries": len(table),
        "covered": sum(r.status == "covered" for r in table),
        "out_of_scope": sum(r.status == "out-of-scope" for r in table),
        "uncovered": sum(r.status == "uncovered" for r in table),
        "out_of_scope_by_reason": dict(sorted(by_reason.items(), key=lambda kv: -kv[1])),
    }


def summary_line(s: dict) -> str:
    return (
        f"{s['entries']} entries: {s['covered']} covered, {s['out_of_scope']} out of scope, "
        f"{s['uncovered']} uncovered"
    )


def _checks_cell(checks: list[str], limit: int = 3) -> str:
    shown = ", ".join(f"`{c}`" for c in checks[:limit])
    return shown + (f" +{len(checks) - limit}" if len(checks) > limit else "")


def render_md(table: list[Row], s: dict, header: list[str], notes: dict | None = None) -> str:
    lines = ["# API coverage", "", *header, "", f"**{summary_line(s)}**", ""]
    uncovered = [r for r in table if r.status == "uncovered"]
    notes = notes or {}
    if uncovered:
        lines += ["## Uncovered", ""]
        for r in uncovered:
            note = notes.get(r.id)
            lines.append(f"- `{r.id}` ({r.kind})" + (f": {note}" if note else ""))
        lines.append("")
    lines += ["## Entries", "", "| entry | kind | status | checks / reason |", "|---|---|---|---|"]
    for r in table:
        if r.status == "covered":
            cell = _checks_cell(r.checks) + (f" (via `{r.via}`)" if r.via else "")
        else:
            cell = r.reason
        lines.append(f"| `{r.id}` | {r.kind} | {r.status} | {cell} |")
    if s["out_of_scope_by_reason"]:
        lines += ["", "## Out of scope, by reason", ""]
        lines += [f"- {n}: {reason}" for reason, n in s["out_of_scope_by_reason"].items()]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ the CLI
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conformance api-coverage",
        description="The public API surface of the torch under test and the checks that "
        "exercise each entry (docs/api-coverage.md).",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    parser.add_argument(
        "--trace",
        action="store_true",
        help="measure coverage with one traced run of torch-fsdp2 and torch-fsdp1 (cached by "
        "a hash of conformance/, the torch version and the world sizes)",
    )
    parser.add_argument("--fresh", action="store_true", help="with --trace: ignore the cache")
    parser.add_argument(
        "--only",
        metavar="EXPR",
        help="with --trace: trace only the cases `-k EXPR` selects (new checks) and merge them "
        "into the snapshot, replacing what those checks recorded before (not cached)",
    )
    parser.add_argument(
        "--write", action="store_true", help="with --trace: write the snapshot coverage.json"
    )
    parser.add_argument(
        "--world-sizes",
        default=",".join(map(str, _trace().DEFAULT_WS)),
        help="world sizes of the traced run (default %(default)s)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when an entry is neither covered nor out of scope, or an input is stale",
    )
    args = parser.parse_args(argv)
    if args.write and not args.trace:
        parser.error("--write updates the snapshot from a traced run: add --trace")
    trace = _trace()
    ws = [int(w) for w in args.world_sizes.split(",") if w.strip()]
    surface = surface_mod.entries()
    if args.only and not args.trace:
        parser.error("--only selects what --trace measures: add --trace")
    if args.trace and args.only:
        partial = trace.run_trace(ws, extra=["-k", args.only])
        snapshot = merge_snapshot(load_snapshot(SNAPSHOT), partial, args.only)
        print(f"api-coverage: traced {len(partial['cases'])} cases in {partial['wall_s']} s",
              file=sys.stderr)  # fmt: skip
    elif args.trace:
        snapshot = snapshot_from_trace(trace.cached_trace(ws, refresh=args.fresh))
    else:
        snapshot = load_snapshot(SNAPSHOT)
    if args.write:
        SNAPSHOT.write_text(json.dumps(snapshot, indent=1) + "\n")
        print(f"api-coverage: wrote {SNAPSHOT}", file=sys.stderr)
    try:
        out_of_scope = load_out_of_scope()
    except ValueError as exc:
        print(f"api-coverage: {exc}", file=sys.stderr)
        return 2
    table = rows(surface, snapshot, out_of_scope)
    s = summary(table)
    header = [f"torch {surface.torch_version}; coverage measured on torch "
              f"{snapshot.get('torch') or '?'} at world sizes {snapshot.get('ws')} "
              f"({snapshot.get('cases', 0)} cases, traced in {snapshot.get('wall_s')} s)"]  # fmt: skip
    current = trace.tree_key(snapshot.get("ws") or ws)
    if snapshot.get("key") and snapshot["key"] != current:
        header.append("The snapshot was measured on another tree (conformance/ changed since): "
                      "`python -m conformance api-coverage --trace --write` measures it again.")  # fmt: skip
    if snapshot.get("merged"):
        header.append("Partial traces merged in since: " + ", ".join(
            f"`-k {e}`" for e in snapshot["merged"]))  # fmt: skip
    found = problems(surface, snapshot, out_of_scope)
    header += [f"- problem: {p}" for p in found]
    if args.json:
        doc = {
            "torch": surface.torch_version,
            "snapshot": {k: snapshot.get(k) for k in ("torch", "key", "ws", "wall_s", "cases")},
            "current_key": current,
            "summary": s,
            "problems": found,
            "entries": [r.__dict__ for r in table],
        }
        print(json.dumps(doc, indent=1))
    else:
        print(render_md(table, s, header, allowlist_notes()), end="")
    print(f"api-coverage: {summary_line(s)}", file=sys.stderr)
    return 1 if args.check and (s["uncovered"] or found) else 0


def _trace():
    from conformance.apisurface import trace

    return trace


if __name__ == "__main__":
    sys.exit(main())
