"""Expected failures: ``conformance/expectations/<impl>[.<device>].txt``.

One entry per line: a case-id prefix, whitespace, and a mandatory reason (cite the upstream issue
when there is one). ``*`` inside a prefix matches any run of characters (so
``layout::flat_param_shard[ws*-zero-`` covers every world size). ``#`` starts a comment line. A case whose id starts with a listed prefix is expected to
fail (reported xfail); if it passes instead, the run fails (strict). Entries that match no case
are reported as stale.

    layout::per_param_dim0_layout[ws2-2d-zero-numel  torch keeps no rows for a zero-numel param (pytorch#NNN)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_DIR = Path(__file__).parent / "expectations"


class ExpectationsError(ValueError):
    pass


@dataclass
class Entry:
    prefix: str
    reason: str
    source: str  # file:line
    matched: int = 0

    def matches(self, case_id: str) -> bool:
        pattern = ".*".join(re.escape(part) for part in self.prefix.split("*"))
        return re.match(pattern, case_id) is not None


@dataclass
class Expectations:
    entries: list[Entry] = field(default_factory=list)

    def match(self, case_id: str) -> Entry | None:
        """The longest listed prefix of ``case_id``."""
        best = None
        for entry in self.entries:
            if entry.matches(case_id) and (best is None or len(entry.prefix) > len(best.prefix)):
                best = entry
        return best


def parse(text: str, source: str) -> list[Entry]:
    entries = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = "" if raw.lstrip().startswith("#") else raw.strip()
        if not line:
            continue
        parts = line.split(None, 1)
        if len(parts) < 2 or not parts[1].strip():
            raise ExpectationsError(
                f"{source}:{lineno}: entry {parts[0]!r} has no reason; write "
                f"'<case-id prefix> <why it is expected to fail>'"
            )
        entries.append(Entry(parts[0], parts[1].strip(), f"{source}:{lineno}"))
    return entries


def load(impl_name: str, device: str, directory: Path = DEFAULT_DIR) -> Expectations:
    """Entries of ``<impl>.txt`` and ``<impl>.<device>.txt`` (both optional)."""
    entries = []
    for path in (directory / f"{impl_name}.txt", directory / f"{impl_name}.{device}.txt"):
        if path.exists():
            entries += parse(path.read_text(), str(path))
    return Expectations(entries)
