"""Expected failures: ``conformance/expectations/<impl>[.<device>].txt``.

One entry per line::

    <case-id prefix> [torch<op><version>] [raises=<what>] [match=/<regex>/] <reason>

* The **prefix** is the start of a case id ``<area>::<check>[ws<N>-<case>]`` (it must contain
  ``::``); ``*`` inside it matches any run of characters, so ``layout::flat_param_shard[ws*-zero-``
  covers every world size. When several entries match a case, the longest prefix wins.
* The **signature** pins how the case fails, with one or both of these tokens right after the
  prefix (in any order, and in any order with the version marker):

  - ``raises=<what>``: the failure on a rank is the exception class ``<what>`` as the traceback's
    last line names it (``AssertionError``, ``RuntimeError``, ``torch.distributed.DistBackendError``
    or just ``DistBackendError``), or ``timeout`` (a rank hung past the check's time) or ``died``
    (a rank's process exited). Alternatives are joined with ``|``: ``raises=ValueError|TypeError``.
  - ``match=/<regex>/``: a Python regular expression searched in that rank's failure text (the
    exception's message; for ``timeout``/``died`` the stack dump or exit reason). It may contain
    spaces; write a ``/`` inside it as ``\\/``.

  A case matches the entry when at least one failed rank matches every token given. A listed case
  that fails any other way is a plain failure whose message names the entry and says what did not
  match. An entry without a signature (allowed in your own files, never in the shipped ones)
  matches any failure and is reported as *unpinned*.
* The **version marker** ``torch<op><version>[,<op><version>...]`` limits the entry to the torch
  releases it admits (``torch<2.14``, ``torch>=2.12,<2.14``, ``torch==2.14.*``; operators
  ``== != < <= > >=``, ``.*`` with ``==`` / ``!=`` only). Only the release numbers of the running
  torch count, so ``2.13.0+cpu`` is 2.13.0 and ``2.14.0a0+git..`` is 2.14.0 (see
  :mod:`conformance.versions`). An entry whose marker excludes the running torch is left out of
  the run: it matches no case and is not reported stale. Two entries for one case with disjoint
  markers pin how it fails on each side of a torch change. The marker is not a signature: an
  entry with only a marker is unpinned.
* The **reason** is mandatory: why the case fails, with the upstream issue when there is one.

A listed case that fails as described is reported ``xfail``; if it passes instead, the run fails
(strict). Entries that match no case are reported as stale. ``#`` starts a comment line. A file
that is not UTF-8 text, or a line that cannot be read as an entry, stops the run at start with a
usage error naming ``file:line``.

    layout::per_param_dim0_layout[ws*-2d-zero-numel raises=AssertionError match=/0 rows/  torch keeps no rows (pytorch#NNN)
    wrap::some_check[ws*-x torch>=2.14 raises=AssertionError match=/warned/  2.14 warns here
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from conformance import versions
from conformance.runner import protocol

DEFAULT_DIR = Path(__file__).parent / "expectations"

TIMEOUT, DIED = "timeout", "died"  # raises= values that are not exception classes
_KINDS = {protocol.TIMEOUT: TIMEOUT, protocol.DIED: DIED}
_EXC_NAME = re.compile(r"[A-Za-z_][\w.]*")
_EXC_LINE = re.compile(r"([A-Za-z_][\w.]*)(?::(?: (.*)|$)|$)", re.S)
_TEARDOWN = re.compile(r"\n?\(rank \d+ had returned; its stack at teardown:\)\n")


class ExpectationsError(ValueError):
    pass


@dataclass(frozen=True)
class Failure:
    """How one rank failed: ``kind`` is the exception class name, ``timeout`` or ``died``."""

    rank: int
    kind: str
    text: str


def exception_of(traceback_text: str) -> tuple[str, str]:
    """(class name, message) of the last exception in a ``traceback.format_exc()`` text.

    The class is the first unindented line after the last ``Traceback (most recent call last):``
    header (chained exceptions come before it); the message is the rest of that line and every line
    after it (multi-line messages, notes). ``("", text)`` when the text holds no traceback.
    """
    text = _TEARDOWN.split(traceback_text, maxsplit=1)[0]
    lines = text.rstrip("\n").splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")]
    if not starts:
        return "", text
    for i in range(starts[-1] + 1, len(lines)):
        if lines[i] and not lines[i][0].isspace():
            found = _EXC_LINE.fullmatch("\n".join(lines[i:]))
            if found:
                return found.group(1), found.group(2) or ""
            break
    return "", text


def failures(results) -> list[Failure]:
    """The failed ranks of one check run (``RankResult``s): errors, timeouts and deaths."""
    out = []
    for r in results:
        if r.status == protocol.ERROR:
            kind, message = exception_of(r.detail)
            out.append(Failure(r.rank, kind or "error", message))
        elif r.status in _KINDS:
            out.append(Failure(r.rank, _KINDS[r.status], r.detail))
    return out


@dataclass
class Entry:
    prefix: str
    reason: str
    source: str  # file:line
    raises: tuple[str, ...] = ()  # exception class names, TIMEOUT, DIED; () = any
    match: re.Pattern | None = None
    torch: versions.TorchSpec | None = None  # the version marker; None: every torch
    matched: int = 0

    def matches(self, case_id: str) -> bool:
        pattern = ".*".join(re.escape(part) for part in self.prefix.split("*"))
        floor = _WS_FROM.search(pattern)  # "[ws2+": world size 2 and every larger one
        if floor is not None:
            pattern = pattern[: floor.start()] + r"\[ws(?P<ws>\d+)" + pattern[floor.end() :]
        found = re.match(pattern, case_id)
        return found is not None and (floor is None or int(found["ws"]) >= int(floor[1]))

    @property
    def pinned(self) -> bool:
        return bool(self.raises) or self.match is not None

    def applies(self, torch_version: str) -> bool:
        """Whether the version marker (if any) admits ``torch_version``."""
        return self.torch is None or self.torch.contains(torch_version)

    def signature(self) -> str:
        """The entry's signature as written (``unpinned`` when it has none), with its marker."""
        parts = [str(self.torch)] if self.torch is not None else []
        parts += [f"raises={'|'.join(self.raises)}"] if self.raises else []
        if self.match is not None:
            parts.append(f"match=/{self.match.pattern}/")
        if not self.pinned:
            parts.append("unpinned: matches any failure")
        return " ".join(parts)

    def _why_not(self, failure: Failure) -> str | None:
        if self.raises and not any(
            failure.kind == name or failure.kind.rsplit(".", 1)[-1] == name for name in self.raises
        ):
            return f"rank {failure.rank}: expected {'|'.join(self.raises)}, got {failure.kind}"
        if self.match is not None and not self.match.search(failure.text):
            return (
                f"rank {failure.rank}: pattern /{self.match.pattern}/ not found in its "
                f"{failure.kind} message {failure.text.strip()[:200]!r}"
            )
        return None

    def mismatch(self, failed: list[Failure]) -> str | None:
        """None when one of ``failed`` fits the signature, else why none does."""
        if not failed:
            return "no rank failed"
        reasons = [self._why_not(f) for f in failed]
        if any(r is None for r in reasons):
            return None
        return "; ".join(reasons)


@dataclass(frozen=True)
class Inherit:
    """``inherit <implementation> <case-id prefix>``: adopt that implementation's entries with
    exactly this prefix (every version marker of them), for an implementation that shares one of
    its deviations without being built on it (no ``inherits``)."""

    base: str
    prefix: str
    source: str  # file:line


@dataclass
class Expectations:
    entries: list[Entry] = field(default_factory=list)  # those that apply to the running torch
    other_torch: list[Entry] = field(default_factory=list)  # left out by their version marker
    inherit: list[Inherit] = field(default_factory=list)  # single deviations adopted by id

    def match(self, case_id: str) -> Entry | None:
        """The longest listed prefix of ``case_id``."""
        best = None
        for entry in self.entries:
            if entry.matches(case_id) and (best is None or len(entry.prefix) > len(best.prefix)):
                best = entry
        return best


_WS_FROM = re.compile(r"\\\[ws(\d+)\\\+")  # "[ws<N>+" in an escaped prefix
_MARKER = re.compile(r"torch(?:[=!<>~]|\s*$)")


def _signature(rest: str, where: str):
    """Read the ``raises=`` / ``match=`` / ``torch<op>...`` tokens at the start of ``rest``;
    return ``(raises, match, torch marker, reason)``."""
    raises, match, marker = (), None, None
    rest = rest.lstrip()
    while True:
        if _MARKER.match(rest):
            token, _, rest = rest.partition(" ")
            if marker is not None:
                raise ExpectationsError(
                    f"{where}: two torch version markers; join the clauses with ',' in one, "
                    f"e.g. torch>=2.12,<2.14"
                )
            try:
                marker = versions.parse_spec(token)
            except versions.VersionSpecError as exc:
                raise ExpectationsError(f"{where}: {exc}") from None
        elif rest.startswith("raises="):
            token, _, rest = rest[len("raises=") :].partition(" ")
            names = tuple(token.split("|"))
            bad = [n for n in names if not _EXC_NAME.fullmatch(n)]
            if raises:
                raise ExpectationsError(f"{where}: raises= given twice; join alternatives with '|'")
            if bad:
                raise ExpectationsError(
                    f"{where}: 'raises={token}': give exception class names (or '{TIMEOUT}', "
                    f"'{DIED}') joined by '|', e.g. raises=RuntimeError|ValueError"
                )
            raises = names
        elif rest.startswith("match=/"):
            end = re.search(r"(?<!\\)/(\s|$)", rest[len("match=/") :])
            if match is not None:
                raise ExpectationsError(f"{where}: match= given twice; use one regex with '|'")
            if end is None:
                raise ExpectationsError(
                    f"{where}: 'match=/' needs a closing '/' followed by a space, e.g. "
                    f"match=/storage of size 0/ (write a '/' inside it as '\\/')"
                )
            body = rest[len("match=/") : len("match=/") + end.start()]
            rest = rest[len("match=/") + end.end() :]
            try:
                match = re.compile(body.replace("\\/", "/"))
            except re.error as exc:
                raise ExpectationsError(
                    f"{where}: match=/{body}/ is not a valid regular expression ({exc}); fix or "
                    f"escape it"
                ) from None
        elif re.match(r"(raise|match)\w*=", rest):
            raise ExpectationsError(
                f"{where}: {rest.split()[0]!r}: write raises=<ExceptionName> or match=/<regex>/"
            )
        else:
            return raises, match, marker, rest.strip()
        rest = rest.lstrip()


def parse(text: str, source: str) -> list[Entry]:
    """The entries of an expectations file's text (its ``inherit`` lines: :func:`parse_all`)."""
    return parse_all(text, source)[0]


def parse_all(text: str, source: str) -> tuple[list[Entry], list[Inherit]]:
    entries, inherits = [], []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = "" if raw.lstrip().startswith("#") else raw.strip().replace("\t", " ")
        if not line:
            continue
        where = f"{source}:{lineno}"
        if not line.isprintable():
            raise ExpectationsError(
                f"{where}: the line holds control characters; is this an expectations file?"
            )
        prefix, _, rest = line.partition(" ")
        if prefix == "inherit":
            inherits.append(_inherit(rest, where))
            continue
        if "::" not in prefix:
            raise ExpectationsError(
                f"{where}: {prefix!r} is not a case-id prefix: write '<area>::<check>[ws<N>-<case>' "
                f"('*' matches anything, e.g. '*::' for every case), then the reason"
            )
        raises, match, marker, reason = _signature(rest, where)
        if not reason:
            raise ExpectationsError(
                f"{where}: entry {prefix!r} has no reason; write "
                f"'<case-id prefix> [torch<op><version>] [raises=<Exception>] [match=/<regex>/] "
                f"<why it is expected to fail>'"
            )
        entries.append(Entry(prefix, reason, where, raises, match, marker))
    return entries, inherits


def _inherit(rest: str, where: str) -> Inherit:
    base, _, prefix = rest.strip().partition(" ")
    prefix = prefix.strip()
    if not base or "::" not in prefix or " " in prefix:
        raise ExpectationsError(
            f"{where}: write 'inherit <implementation> <case-id prefix>', e.g. 'inherit "
            f"torch-fsdp2 training::train_parity_zero_numel_param[', naming one entry of that "
            f"implementation's expectations by its prefix"
        )
    return Inherit(base, prefix, where)


def read(path: Path) -> list[Entry]:
    """The entries of one file (ExpectationsError naming the file when it is not readable text)."""
    return read_all(path)[0]


def read_all(path: Path) -> tuple[list[Entry], list[Inherit]]:
    """The entries and ``inherit`` lines of one file."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ExpectationsError(
            f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); is this an expectations "
            f"file?"
        ) from None
    except OSError as exc:
        raise ExpectationsError(f"{path}: cannot be read ({exc.strerror})") from None
    return parse_all(text, str(path))


def load(
    impl_name: str, device: str, directory: Path = DEFAULT_DIR, torch_version: str | None = None
) -> Expectations:
    """Entries of ``<impl>.txt`` and ``<impl>.<device>.txt`` (both optional) that apply to
    ``torch_version`` (default: the installed torch's)."""
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    entries, inherits = [], []
    for path in (directory / f"{impl_name}.txt", directory / f"{impl_name}.{device}.txt"):
        if path.exists():
            more, adopted = read_all(path)
            entries += more
            inherits += adopted
    return Expectations(
        [e for e in entries if e.applies(torch_version)],
        [e for e in entries if not e.applies(torch_version)],
        inherits,
    )
