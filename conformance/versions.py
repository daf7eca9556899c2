"""Torch versions: the supported range, version markers, and the cross-version matrix.

* :data:`SUPPORTED` is the range of torch releases the reference and the harness run on (APIs and
  collectives that exist across it). A run on a torch outside it starts with one warning line
  (:func:`support_warning`) and goes on: a torch newer than the range is what someone checking a
  new release runs, and its failures are the information they came for.
* A **version marker** ``torch<op><version>[,<op><version>...]`` limits an expectation entry to
  some torch releases (``torch<2.14``, ``torch>=2.12,<2.14``, ``torch==2.14.*``). Operators:
  ``==``, ``!=``, ``<``, ``<=``, ``>``, ``>=``; ``.*`` after the version of ``==`` / ``!=`` matches
  every release that starts with it. Only the release numbers of the running torch count:
  ``2.14.0a0+gitabc`` and ``2.14.0.dev20260101`` are 2.14.0 and ``2.13.0+cpu`` is 2.13.0 (a
  pre-release or local build of a release behaves like that release, which is what an entry
  about upstream behaviour means). Missing numbers are zeros: ``2.14`` is ``2.14.0``.
* ``python -m conformance.versions REPORT.json ... [--output-dir reports]`` reads one
  ``conformance.json`` per torch (``nox -s versions`` writes them) and writes
  ``versions.md`` / ``versions.json``: totals per torch and every case whose outcome is not the
  same on all of them. Exit status 2 when a report cannot be read, else 0.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from conformance.diff import ReportError
from conformance.diff import load as load_report

SUPPORTED = "torch>=2.11,<2.15"

_OPS = ("==", "!=", "<=", ">=", "<", ">")
_CLAUSE = re.compile(r"(==|!=|<=|>=|<|>)(\d+(?:\.\d+)*)(\.\*)?")
_RELEASE = re.compile(r"\d+(?:\.\d+)*")


class VersionSpecError(ValueError):
    """A version marker that cannot be read; the message says what to write instead."""


def release(version: str) -> tuple[int, ...]:
    """The release numbers at the start of a version string (``"2.13.0+cpu"`` -> ``(2, 13, 0)``)."""
    found = _RELEASE.match(version.strip().lstrip("v"))
    if not found:
        raise VersionSpecError(
            f"{version!r} is not a version: it must start with numbers, e.g. 2.13.0"
        )
    return tuple(int(n) for n in found.group().split("."))


def _padded(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    n = max(len(a), len(b))
    return a + (0,) * (n - len(a)), b + (0,) * (n - len(b))


@dataclass(frozen=True)
class TorchSpec:
    """A parsed ``torch<op><version>,...`` marker; every clause must hold."""

    text: str
    clauses: tuple[tuple[str, tuple[int, ...], bool], ...]  # (op, release, wildcard)

    def contains(self, version: str) -> bool:
        have = release(version)
        for op, want, wildcard in self.clauses:
            if wildcard:
                same = have[: len(want)] == want
                ok = same if op == "==" else not same
            else:
                a, b = _padded(have, want)
                ok = {
                    "==": a == b,
                    "!=": a != b,
                    "<": a < b,
                    "<=": a <= b,
                    ">": a > b,
                    ">=": a >= b,
                }[op]
            if not ok:
                return False
        return True

    def __str__(self) -> str:
        return self.text


def parse_spec(text: str) -> TorchSpec:
    """``torch>=2.12,<2.14`` -> :class:`TorchSpec`; :class:`VersionSpecError` saying what to fix."""
    example = "write e.g. torch<2.14, torch>=2.12,<2.14 or torch==2.14.*"
    if not text.startswith("torch") or text[len("torch") : len("torch") + 1] not in "=!<>~":
        raise VersionSpecError(f"{text!r} is not a torch version marker; {example}")
    body = text[len("torch") :]
    if not body:
        raise VersionSpecError(f"{text!r} names no version; {example}")
    clauses = []
    for clause in body.split(","):
        found = _CLAUSE.fullmatch(clause)
        if not found:
            raise VersionSpecError(
                f"{text!r}: {clause!r} is not <op><version> (op one of {' '.join(_OPS)}, "
                f"version numbers only); {example}"
            )
        op, number, wildcard = found.groups()
        if wildcard and op not in ("==", "!="):
            raise VersionSpecError(f"{text!r}: '.*' goes with == or != only; {example}")
        clauses.append((op, tuple(int(n) for n in number.split(".")), bool(wildcard)))
    return TorchSpec(text, tuple(clauses))


def support_warning(torch_version: str) -> str | None:
    """One line when ``torch_version`` is outside :data:`SUPPORTED`, else None."""
    if parse_spec(SUPPORTED).contains(torch_version):
        return None
    return (
        f"fsdp conformance: WARNING torch {torch_version} is outside the supported range "
        f"{SUPPORTED} (docs/torch-versions.md): the reference and the harness use torch APIs of "
        f"that range, so a failure here may be the suite's, not the implementation's; compare with "
        f"a run on a torch inside the range"
    )


# ---------------------------------------------------------------- the cross-version matrix
def _label(doc: dict, path: Path, taken: set[str]) -> str:
    label = str(doc.get("torch") or path.parent.name)
    n = 2
    while label in taken:  # the same torch twice (two builds of one version): keep both
        label, n = f"{doc.get('torch')} ({n})", n + 1
    return label


def _first_line(message: str) -> str:
    lines = [ln.strip() for ln in (message or "").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "assert" in ln.lower()]
    return (errors[-1] if errors else lines[0] if lines else "")[:160]


def matrix(reports: list[tuple[Path, dict]]) -> dict:
    """The cross-version matrix of loaded reports, in the order given (oldest torch first reads
    best). Per torch: its report, totals and wall time. ``changed``: every case whose outcome
    differs between the reports it is in, with the outcome on each (None where it did not run;
    ``xpass`` for an expected failure that passed, which the totals count as a fail) and the
    message of each outcome other than pass and xpass. ``partial``: cases missing from some report (the
    suite itself changed between the runs) with one outcome wherever they ran; ``unchanged``: how
    many cases have one outcome in every report."""
    labels: list[str] = []
    columns = []
    for path, doc in reports:
        label = _label(doc, path, set(labels))
        labels.append(label)
        totals = {k: 0 for k in ("pass", "xfail", "fail", "skip", "not-supported")}
        for c in doc["cases"]:
            totals[c["outcome"]] = totals.get(c["outcome"], 0) + 1
        columns.append(
            {
                "label": label,
                "torch": doc.get("torch"),
                "report": str(path),
                "created": doc.get("created"),
                "command": doc.get("command"),
                "wall_time_s": doc.get("wall_time_s"),
                "world_sizes": doc.get("world_sizes"),
                "implementations": [i.get("name") for i in doc.get("implementations", [])],
                "totals": totals,
                "interrupted": bool(doc.get("interrupted")),
            }
        )
    from conformance.diff import XPASS, outcome_of  # a strict XPASS reads "xpass", as in diff

    cases: dict[tuple[str, str], dict[str, dict]] = {}
    for label, (_, doc) in zip(labels, reports):
        for c in doc["cases"]:
            cases.setdefault((c["impl"], c["id"]), {})[label] = c
    changed, partial, unchanged = [], [], 0
    for (impl, case_id), by_label in sorted(cases.items()):
        outcomes = {
            label: outcome_of(by_label[label]) if label in by_label else None for label in labels
        }
        present = {o for o in outcomes.values() if o is not None}
        if len(present) == 1:  # the same wherever it ran
            if None in outcomes.values():  # not in every report (the suite changed between runs)
                partial.append({"impl": impl, "id": case_id, "outcomes": outcomes})
            else:
                unchanged += 1
            continue
        changed.append(
            {
                "impl": impl,
                "id": case_id,
                "outcomes": outcomes,
                "messages": {
                    label: _first_line(c.get("message", ""))
                    for label, c in by_label.items()
                    if outcome_of(c) not in ("pass", XPASS) and c.get("message")
                },
            }
        )
    return {"versions": columns, "changed": changed, "partial": partial, "unchanged": unchanged}


def markdown(doc: dict) -> str:
    labels = [v["label"] for v in doc["versions"]]
    out = ["# FSDP conformance across torch versions", ""]
    out += ["| torch | pass | xfail | fail | skip | not-supported | wall time | report |"]
    out += ["|---|---|---|---|---|---|---|---|"]
    for v in doc["versions"]:
        t = v["totals"]
        wall = f"{v['wall_time_s']:.0f} s" if v.get("wall_time_s") is not None else "?"
        flag = " (interrupted)" if v.get("interrupted") else ""
        out.append(
            f"| {v['label']}{flag} | {t['pass']} | {t['xfail']} | {t['fail']} | {t['skip']} | "
            f"{t['not-supported']} | {wall} | `{v['report']}` |"
        )
    out += ["", f"## Cases whose outcome differs between versions ({len(doc['changed'])})", ""]
    if not doc["changed"]:
        out.append(f"None: all {doc['unchanged']} cases in every report have the same outcome.")
    else:
        out += ["| case | implementation | " + " | ".join(labels) + " | messages |"]
        out += ["|---|---|" + "---|" * len(labels) + "---|"]
        for c in doc["changed"]:
            cells = [c["outcomes"][label] or "—" for label in labels]
            notes = "; ".join(f"{label}: {m}" for label, m in c["messages"].items())
            out.append(
                f"| `{c['id']}` | {c['impl']} | "
                + " | ".join(cells)
                + f" | {notes.replace('|', '/')} |"
            )
        out += ["", f"{doc['unchanged']} other cases have the same outcome on every torch."]
    if doc["partial"]:
        missing = {
            label: sum(c["outcomes"][label] is None for c in doc["partial"]) for label in labels
        }
        out += [
            "",
            f"{len(doc['partial'])} cases are not in every report (the suite changed between the "
            "runs) and have one outcome wherever they ran; missing per torch: "
            + ", ".join(f"{label} {n}" for label, n in missing.items())
            + " (listed in versions.json under 'partial').",
        ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conformance.versions",
        description="Write the cross-version matrix (versions.md, versions.json) of conformance.json "
        "reports from runs on different torch versions.",
    )
    parser.add_argument("reports", nargs="+", type=Path, help="conformance.json, one per torch")
    parser.add_argument("--output-dir", type=Path, default=Path("reports"))
    args = parser.parse_args(argv)
    try:
        loaded = [(path, load_report(path)) for path in args.reports]
    except ReportError as exc:
        print(f"conformance versions: {exc}", file=sys.stderr)
        return 2
    doc = matrix(loaded)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "versions.json").write_text(json.dumps(doc, indent=1) + "\n")
    md = markdown(doc)
    (args.output_dir / "versions.md").write_text(md)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
