"""``python -m conformance.runner.order A.json B.json [--world-size N]``: did the order matter?

Compares the per-case outcomes of two runs' ``conformance.json`` that ran the same cases in
different orders (``--shuffle SEED``, see docs/running.md, "Isolation between checks"): every
case of the chosen world size (all when not given) that either run has must be in both, with the
same outcome. Prints each difference; exit status 1 when there is one, 2 when a report cannot be
read, else 0. The CI job (noxfile.py, session ``tests``) compares the ws-1 part of the smoke run
(collection order) with a ws-1 run in a shuffled order.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def outcomes(path: str, world_size: int | None) -> dict[tuple[str, str], str]:
    """(implementation, case id) -> outcome of the report at ``path``."""
    cases = json.loads(Path(path).read_text())["cases"]
    return {
        (c["impl"], c["id"]): c["outcome"]
        for c in cases
        if world_size is None or c["world_size"] == world_size
    }


def differences(a: dict, b: dict) -> list[str]:
    """One line per case whose outcome differs or that only one run has."""
    lines = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            impl, case = key
            lines.append(f"{case} on {impl}: {a.get(key, 'not run')} -> {b.get(key, 'not run')}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.runner.order")
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--world-size", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        a = outcomes(args.first, args.world_size)
        b = outcomes(args.second, args.world_size)
    except (OSError, ValueError, KeyError) as exc:
        print(f"order: cannot read a report: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    diff = differences(a, b)
    where = f" at world size {args.world_size}" if args.world_size else ""
    if diff:
        print(f"order: {len(diff)} of {len(set(a) | set(b))} case(s){where} depend on the order:")
        print("\n".join(f"  {line}" for line in diff))
        return 1
    print(f"order: {len(a)} case(s){where}, the same outcome in both orders")
    return 0


if __name__ == "__main__":
    sys.exit(main())
