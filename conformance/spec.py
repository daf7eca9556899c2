"""The behaviour ids of ``conformance/SPEC.md`` and the checks that cite them.

A check cites the behaviours it covers in its docstring, in parentheses or as a leading ``S11:``;
``S2-S4`` cites S2, S3 and S4. ``SPEC.md`` defines every id (a line ``- **<id>** ...``) and, for an
id no check can cover here, says why in the same line after ``*No check:*``. Its id -> checks table
is generated from the registry::

    python -m conformance.spec           # print the table
    python -m conformance.spec --write   # rewrite the generated section of SPEC.md
    python -m conformance.spec --check   # exit 1 when SPEC.md and the checks disagree

(``tests/harness/test_spec.py`` runs the same checks.)
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import re
import sys
from collections import defaultdict
from pathlib import Path

from conformance.registry import CHECKS

SPEC_MD = Path(__file__).parent / "SPEC.md"
CHECKS_DIR = Path(__file__).parent / "checks"
BEGIN = "<!-- BEGIN GENERATED: python -m conformance.spec --write -->"
END = "<!-- END GENERATED -->"

_ID = r"[PRSWX]\d+"
_CITE = re.compile(rf"\b({_ID})(?:\s*[-\u2013]\s*({_ID}))?\b")
_DEFINITION = re.compile(rf"^- \*\*({_ID})\*\*(.*)$", re.M)
_NO_CHECK = "*No check:*"


def _order(bid: str) -> tuple[int, int]:
    return "SPRWX".index(bid[0]), int(bid[1:])


def cited_ids(text: str) -> set[str]:
    """Every id ``text`` cites; a range ``S2-S4`` (same letter) cites each id in it."""
    ids = set()
    for first, last in _CITE.findall(text):
        if last and last[0] == first[0] and int(last[1:]) >= int(first[1:]):
            ids.update(f"{first[0]}{n}" for n in range(int(first[1:]), int(last[1:]) + 1))
        else:
            ids.update(x for x in (first, last) if x)
    return ids


def load_checks() -> None:
    """Import every built-in check module, so that the registry holds all checks."""
    for info in pkgutil.walk_packages([str(CHECKS_DIR)], "conformance.checks."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            importlib.import_module(info.name)


def coverage() -> dict[str, list[str]]:
    """id -> the ``area::check`` names whose docstring cites it."""
    load_checks()
    out = defaultdict(set)
    for spec in CHECKS:
        for bid in cited_ids(spec.fn.__doc__ or ""):
            out[bid].add(f"{spec.area}::{spec.name}")
    return {bid: sorted(names) for bid, names in out.items()}


def definitions(text: str) -> dict[str, str]:
    """id -> its definition line in SPEC.md's text (outside the generated section)."""
    head, _, rest = text.partition(BEGIN)
    text = head + rest.partition(END)[2]
    return {m.group(1): m.group(2).strip() for m in _DEFINITION.finditer(text)}


def render(defined: dict[str, str], covered: dict[str, list[str]]) -> str:
    """The generated section: one row per defined id with its checks, or why none runs here."""
    rows = ["| id | checks |", "|---|---|"]
    for bid in sorted(defined, key=_order):
        if covered.get(bid):
            cell = ", ".join(f"`{name}`" for name in covered[bid])
        else:
            cell = (
                "none: " + defined[bid].partition(_NO_CHECK)[2].strip()
                if _NO_CHECK in defined[bid]
                else "**none**"
            )
        rows.append(f"| {bid} | {cell} |")
    return "\n".join([BEGIN, "", *rows, "", END])


def problems(text: str, covered: dict[str, list[str]]) -> list[str]:
    """What is wrong between SPEC.md's text and the checks (empty when they agree)."""
    defined = definitions(text)
    out = []
    cited = set(covered)
    for bid in sorted(cited - set(defined), key=_order):
        out.append(f"{bid} is cited by {', '.join(covered[bid])} but SPEC.md does not define it")
    for bid in sorted(defined, key=_order):
        if bid not in cited and _NO_CHECK not in defined[bid]:
            out.append(f"{bid} has no check and SPEC.md gives no reason ('{_NO_CHECK} <why>')")
        elif bid in cited and _NO_CHECK in defined[bid]:
            out.append(
                f"{bid} is checked by {', '.join(covered[bid])} but SPEC.md still says "
                f"'{_NO_CHECK}': remove the reason"
            )
    if BEGIN not in text or END not in text:
        out.append(f"SPEC.md lacks the generated section markers {BEGIN!r} ... {END!r}")
    elif text[text.index(BEGIN) : text.index(END) + len(END)] != render(defined, covered):
        out.append(
            "the generated id -> checks table of SPEC.md is stale: run "
            "`python -m conformance.spec --write`"
        )
    return out


def write(path: Path = SPEC_MD) -> None:
    text = path.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    path.write_text(text[:start] + render(definitions(text), coverage()) + text[end:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conformance.spec", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--write", action="store_true", help="rewrite the generated section of SPEC.md"
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when SPEC.md and the checks disagree"
    )
    args = parser.parse_args(argv)
    if args.write:
        write()
        print(f"wrote {SPEC_MD}")
    text = SPEC_MD.read_text()
    if args.check:
        found = problems(text, coverage())
        print("\n".join(found) or "SPEC.md and the checks agree")
        return 1 if found else 0
    if not args.write:
        print(render(definitions(text), coverage()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
