"""``python -m conformance list-checks``: where each built-in check lives and what it checks.

One line per check: its id (``area::check``, the part of a case id before ``[``), the file and line
that define it, and the ``conformance/SPEC.md`` ids its docstring cites::

    python -m conformance list-checks                      # every check, sorted by id
    python -m conformance list-checks state_dict::         # ids or files containing a text
    python -m conformance list-checks --cites S5           # the checks that cite S5
    python -m conformance list-checks --tsv                # tab-separated, no header

A failure ``state_dict::sharded_values[ws2-dtensor]`` is found with
``python -m conformance list-checks state_dict::sharded_values``. Only the built-in checks under
``conformance/checks/`` are listed (checks of a ``--check-dir`` are not imported here).
"""

from __future__ import annotations

import argparse
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

from conformance import spec
from conformance.registry import CHECKS

ROOT = Path(__file__).resolve().parent.parent  # the checkout: paths are printed relative to it


@dataclass(frozen=True)
class Row:
    id: str  # area::check
    file: str  # relative to the checkout when inside it
    line: int  # where its definition starts (its first decorator)
    cites: tuple[str, ...]  # SPEC ids, in the order SPEC.md defines them


def _relative(path: str) -> str:
    resolved = Path(path).resolve()
    try:
        return resolved.relative_to(ROOT).as_posix()
    except ValueError:
        return str(resolved)


def rows() -> list[Row]:
    """One row per built-in check (a check registered for several case sets is one row)."""
    spec.load_checks()
    order = {bid: i for i, bid in enumerate(spec.definitions(spec.SPEC_MD.read_text()))}
    out: dict[str, Row] = {}
    for entry in CHECKS:
        fn = inspect.unwrap(entry.fn)
        cid = f"{entry.area}::{entry.name}"
        if cid in out:
            continue
        cites = sorted(
            spec.cited_ids(fn.__doc__ or ""), key=lambda b: (order.get(b, len(order)), b)
        )
        out[cid] = Row(
            cid, _relative(inspect.getsourcefile(fn)), fn.__code__.co_firstlineno, tuple(cites)
        )
    return [out[k] for k in sorted(out)]


def select(found: list[Row], texts: list[str], cites: str | None) -> list[Row]:
    """The rows whose id or file contains any of ``texts`` (all when none) and that cite ``cites``."""
    picked = [r for r in found if not texts or any(t in r.id or t in r.file for t in texts)]
    return [r for r in picked if cites is None or cites in r.cites]


def render(found: list[Row], tsv: bool = False) -> str:
    cells = [(r.id, f"{r.file}:{r.line}", " ".join(r.cites) or "-") for r in found]
    if tsv:
        return "\n".join("\t".join(c) for c in cells)
    head = ("id", "file", "cites")
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(2)]
    lines = [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in [head, *cells]]
    files = len({r.file for r in found})
    return "\n".join([*lines, f"{len(found)} checks in {files} files"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conformance list-checks", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "texts", nargs="*", metavar="TEXT", help="list only ids or files containing a TEXT"
    )
    parser.add_argument("--cites", metavar="ID", help="list only checks citing this SPEC id (S5)")
    parser.add_argument("--tsv", action="store_true", help="tab-separated id, file:line, cites")
    args = parser.parse_args(argv)
    if args.cites is not None:
        defined = spec.definitions(spec.SPEC_MD.read_text())
        if args.cites not in defined:
            parser.error(
                f"--cites {args.cites}: conformance/SPEC.md defines no such id; give one of its "
                "ids, e.g. S5, P1, W9, X3"
            )
    found = select(rows(), args.texts, args.cites)
    if not found:
        print("no check matches", file=sys.stderr)
        return 1
    print(render(found, args.tsv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
