"""``python -m conformance [options] [pytest args]``: the conformance suite without nox.

Equivalent to ``python -m pytest -p conformance.plugin conformance/checks [args]``.
"""

import sys
from pathlib import Path

import pytest


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    checks = str(Path(__file__).parent / "checks")
    has_target = any(a.startswith("conformance") or "::" in a for a in argv if not a.startswith("-"))
    return int(pytest.main(["-p", "conformance.plugin", *([] if has_target else [checks]), *argv]))


if __name__ == "__main__":
    sys.exit(main())
