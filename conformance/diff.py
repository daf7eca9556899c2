"""``python -m conformance diff OLD.json NEW.json``: what changed between two runs' reports.

Cases are matched by (implementation, case id). Listed, in this order:

* **new failures**: ``fail`` now, anything else before (or not there before), except an XPASS;
* **fixed**: ``fail`` or ``xfail`` before, and now ``pass`` or an **XPASS** (a listed expected
  failure that passed, which fails the run: its message starts with ``[XPASS``). An XPASS is
  an upstream fix (or a fork's) to record: remove the entry, or limit it to the torch versions
  that still fail (``torch<2.14``, see conformance/expectations.py); the change names the entry;
* **new expected failures**: ``xfail`` now, anything else before;
* **other changes**: any other change of outcome (e.g. ``pass`` -> ``not-supported``);
* **appeared** / **vanished**: cases only in the new / only in the old report (with their outcome);
* version changes: torch, Python, and every implementation's version string.

Output is plain text, or markdown with ``--markdown``; ``--output PATH`` also writes it to a file.
In the lists an XPASS reads ``xpass``; ``pass -> xpass`` (an entry added for a case that passes) and
``xpass -> pass`` (its entry removed) are other changes.
Exit status: 1 when there is at least one new failure, 2 when a report cannot be read, else 0 (a
fix alone is not a new failure).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

SECTIONS = (
    ("new_failures", "New failures"),
    ("fixed", "Fixed"),
    ("new_xfails", "New expected failures"),
    ("changed", "Other outcome changes"),
    ("appeared", "Appeared"),
    ("vanished", "Vanished"),
)


class ReportError(Exception):
    """A file is not a readable conformance report."""


@dataclass
class Change:
    impl: str
    case_id: str
    old: str | None  # outcome before (None: not in the old report)
    new: str | None
    message: str = ""  # new failures: the message's first line; XPASS fixes: the entry


@dataclass
class Diff:
    versions: list[tuple[str, str, str]] = field(default_factory=list)  # (what, old, new)
    new_failures: list[Change] = field(default_factory=list)
    fixed: list[Change] = field(default_factory=list)
    new_xfails: list[Change] = field(default_factory=list)
    changed: list[Change] = field(default_factory=list)
    appeared: list[Change] = field(default_factory=list)
    vanished: list[Change] = field(default_factory=list)
    unchanged: int = 0


def load(path: Path) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ReportError(f"{path}: cannot read a JSON report ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("cases"), list):
        raise ReportError(
            f"{path}: not a conformance report (no 'cases' list); pass the "
            "conformance.json a run wrote into its --reports-dir"
        )
    return doc


def _first_line(message: str) -> str:
    lines = [ln.strip() for ln in (message or "").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "assert" in ln.lower()]
    return (errors[-1] if errors else lines[0] if lines else "")[:200]


XPASS = "xpass"  # a case's outcome in the lists when it failed as an expected failure that passed
_XPASS = re.compile(
    r"\[XPASS[^\]]*\] (?P<reason>.*?)(?: \[(?P<source>[^;\]]+)(?:;[^\]]*)?\])?\s*$", re.S
)


def outcome_of(case: dict) -> str:
    """The case's outcome, with a strict XPASS (recorded as ``fail``) told apart as ``xpass``."""
    if case["outcome"] == "fail" and _XPASS.match(case.get("message") or ""):
        return XPASS
    return case["outcome"]


def _xpass_note(case: dict) -> str:
    found = _XPASS.match(case.get("message") or "")
    where = f" in {found['source']}" if found and found["source"] else ""
    reason = found["reason"].strip()[:120] if found else ""
    return f"expected failure passed: entry{where} ({reason}); remove it or limit it to the torch that still fails"


def _versions(old: dict, new: dict) -> list[tuple[str, str, str]]:
    out = [
        (key, str(old.get(key)), str(new.get(key)))
        for key in ("torch", "python")
        if old.get(key) != new.get(key)
    ]
    before = {i["name"]: i.get("version", "") for i in old.get("implementations", [])}
    after = {i["name"]: i.get("version", "") for i in new.get("implementations", [])}
    for name in sorted(set(before) | set(after)):
        if before.get(name) != after.get(name):
            out.append(
                (
                    f"implementation {name}",
                    before.get(name, "(absent)"),
                    after.get(name, "(absent)"),
                )
            )
    return out


def compare(old: dict, new: dict) -> Diff:
    """The differences between two loaded reports (see the module docstring)."""
    key = lambda c: (c["impl"], c["id"])  # noqa: E731
    before = {key(c): c for c in old["cases"]}
    after = {key(c): c for c in new["cases"]}
    diff = Diff(versions=_versions(old, new))
    for k in sorted(set(before) | set(after)):
        was = outcome_of(before[k]) if k in before else None
        now = outcome_of(after[k]) if k in after else None
        change = Change(k[0], k[1], was, now)
        if now == XPASS:
            change.message = _xpass_note(after[k])
        if now == "fail" and was != "fail":
            change.message = _first_line(after[k].get("message", ""))
            diff.new_failures.append(change)
        elif now is None:
            diff.vanished.append(change)
        elif was is None:
            diff.appeared.append(change)
        elif was == now:
            diff.unchanged += 1
        elif now in ("pass", XPASS) and was in ("fail", "xfail"):
            diff.fixed.append(change)
        elif now == "xfail":
            diff.new_xfails.append(change)
        else:
            diff.changed.append(change)
    return diff


def _describe(c: Change) -> str:
    outcome = f"{c.old or '(absent)'} -> {c.new or '(absent)'}"
    return f"{c.case_id} on {c.impl}: {outcome}" + (f" ({c.message})" if c.message else "")


def _partial(doc: dict) -> str:
    """`` (INTERRUPTED by SIGINT: partial)`` for a report of a run that did not finish."""
    if not doc.get("interrupted"):
        return ""
    return f" (INTERRUPTED by {doc.get('signal') or 'a signal'}: partial; cases it never ran count as vanished or appeared)"


def _header(old_path, new_path, old: dict, new: dict) -> list[tuple[str, str]]:
    return [
        (
            "old",
            f"{old_path} ({old.get('created', '?')}, torch {old.get('torch', '?')})"
            + _partial(old),
        ),
        (
            "new",
            f"{new_path} ({new.get('created', '?')}, torch {new.get('torch', '?')})"
            + _partial(new),
        ),
    ]


def text(diff: Diff, header) -> str:
    out = [f"{name}: {value}" for name, value in header]
    out += [f"version {what}: {a} -> {b}" for what, a, b in diff.versions]
    for attr, title in SECTIONS:
        changes = getattr(diff, attr)
        if changes:
            out += ["", f"{title} ({len(changes)}):"] + [f"  {_describe(c)}" for c in changes]
    out += ["", summary(diff)]
    return "\n".join(out) + "\n"


def markdown(diff: Diff, header) -> str:
    out = ["# FSDP conformance: run-to-run diff", ""]
    out += [f"- {name}: `{value}`" for name, value in header]
    if diff.versions:
        out += ["", "| version | old | new |", "|---|---|---|"]
        out += [f"| {what} | {a} | {b} |" for what, a, b in diff.versions]
    for attr, title in SECTIONS:
        changes = getattr(diff, attr)
        if not changes:
            continue
        out += [
            "",
            f"## {title} ({len(changes)})",
            "",
            "| case | implementation | old | new | message |",
            "|---|---|---|---|---|",
        ]
        out += [
            f"| `{c.case_id}` | {c.impl} | {c.old or '—'} | {c.new or '—'} | "
            f"{c.message.replace('|', '/')} |"
            for c in changes
        ]
    out += ["", summary(diff)]
    return "\n".join(out) + "\n"


def summary(diff: Diff) -> str:
    counts = ", ".join(f"{len(getattr(diff, attr))} {title.lower()}" for attr, title in SECTIONS)
    return f"{counts}; {diff.unchanged} unchanged"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conformance diff",
        description="List the cases whose outcome changed between two conformance.json reports. "
        "Exit status 1 when there are new failures, 2 when a report cannot be read.",
    )
    parser.add_argument("old", type=Path, help="the earlier run's conformance.json")
    parser.add_argument("new", type=Path, help="the later run's conformance.json")
    parser.add_argument("--markdown", action="store_true", help="print markdown instead of text")
    parser.add_argument("--output", type=Path, help="also write the output to this file")
    args = parser.parse_args(argv)
    try:
        old, new = load(args.old), load(args.new)
    except ReportError as exc:
        print(f"conformance diff: {exc}", file=sys.stderr)
        return 2
    diff = compare(old, new)
    for path, doc in ((args.old, old), (args.new, new)):
        if doc.get("interrupted"):
            print(
                f"conformance diff: warning: {path} is a partial report{_partial(doc)}",
                file=sys.stderr,
            )
    render = markdown if args.markdown else text
    output = render(diff, _header(args.old, args.new, old, new))
    sys.stdout.write(output)
    if args.output:
        args.output.write_text(output)
    return 1 if diff.new_failures else 0


if __name__ == "__main__":
    sys.exit(main())
