"""Known deviations an implementation takes from what it ``inherits`` (see [Note: inherited
deviations] in :mod:`conformance.adapters.base`), and the hint a fork gets when it fails the way a
built-in's known deviation does without inheriting it.

* :func:`expectations_for`: the expectation entries of every deviation set in an implementation's
  lineage (its own ``<name>[.<device>].txt`` first, then each base's). A base's files are read from
  the expectations directory when it holds them, else from the shipped ones
  (``conformance/expectations/``), so a vendor's own directory need not copy upstream's entries.
* :func:`inherit_hint`: for a failing case that the implementation's own expectations do not list,
  the built-in deviation sets it does not inherit whose expectation entry for the case, or whose
  fuzz drop or steer for the check, fits the failure's signature; the hint names that deviation
  and says how to inherit it.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

from conformance import expectations
from conformance.adapters.registry import DEFAULT_SELECTION, lineage


def _source(name: str, device: str, directory: Path) -> Path:
    """Where another implementation's files are read from: ``directory`` when it holds them,
    else the shipped ones."""
    own = (directory / f"{name}.txt", directory / f"{name}.{device}.txt")
    return directory if any(p.exists() for p in own) else expectations.DEFAULT_DIR


def expectations_for(impl, device: str, directory: Path) -> expectations.Expectations:
    """The entries that apply to ``impl`` on ``device``: those of each name in its lineage, and
    the single entries its own files adopt with ``inherit <implementation> <prefix>``."""
    loaded = []
    for i, name in enumerate(lineage(impl)):
        source = _source(name, device, directory) if i else directory
        loaded.append(expectations.load(name, device, source))
    loaded += [adopted(a, device, directory) for a in loaded[0].inherit]
    merged = expectations.Expectations()
    for f in dataclasses.fields(merged):  # the entries (and any other list it keeps), in order
        setattr(merged, f.name, [x for exp in loaded for x in getattr(exp, f.name)])
    return merged


def adopted(line: expectations.Inherit, device: str, directory: Path):
    """The entries one ``inherit`` line adopts: ``line.base``'s entries whose prefix is exactly
    ``line.prefix`` (each version-marker variant), their reasons saying where they came from; an
    ExpectationsError naming the line when there are none."""
    base = expectations.load(line.base, device, _source(line.base, device, directory))
    if not any(e.prefix == line.prefix for e in base.entries + base.other_torch):
        known = sorted({e.prefix for e in base.entries + base.other_torch})
        raise expectations.ExpectationsError(
            f"{line.source}: inherit {line.base} {line.prefix}: {line.base}'s expectations have no "
            f"entry with exactly that prefix"
            + (f" (e.g. {', '.join(known[:3])})" if known else f" ({line.base} has none)")
        )

    def copy(entry):
        return dataclasses.replace(
            entry, reason=f"{entry.reason} (inherited by {line.source})", matched=0
        )

    return expectations.Expectations(
        [copy(e) for e in base.entries if e.prefix == line.prefix],
        [copy(e) for e in base.other_torch if e.prefix == line.prefix],
    )


@functools.cache
def _shipped(name: str, device: str) -> expectations.Expectations:
    return expectations.load(name, device, expectations.DEFAULT_DIR)


def _fits(raises: str, match: str, failed) -> bool:
    """Whether one of ``failed`` (:class:`expectations.Failure`) has the signature."""
    pattern = re.compile(match) if match else None
    entry = expectations.Entry("", "", "", tuple(raises.split("|")) if raises else (), pattern)
    return bool(raises or match) and entry.mismatch(failed) is None


def known_deviations(meta, impl, results) -> list[tuple[str, str]]:
    """(deviation set, what it is) for each built-in deviation set outside ``impl``'s lineage whose
    expectation entry for the case (``meta.case_id`` on ``meta.device``), or whose fuzz drop or
    steer for the check, fits how the case failed (``results``, the ranks' results)."""
    from conformance.fuzz import strategies

    failed = expectations.failures(results)
    if not failed:
        return []
    mine = set(lineage(impl))
    fn = meta.spec.fn
    found = []
    for base in DEFAULT_SELECTION:
        if base in mine:
            continue
        entry = _shipped(base, meta.device).match(meta.case_id)
        if entry is not None and entry.pinned and entry.mismatch(failed) is None:
            found.append((base, f"{entry.reason} ({entry.source})"))
            continue
        for drop in getattr(fn, "fuzz_drops", ()):
            if (
                base in drop.impls
                and drop.applies(meta.case, base)
                and _fits(drop.raises, drop.match, failed)
            ):
                found.append((base, f"{drop.reason} (a fuzz Drop of {fn.__name__})"))
        features = getattr(fn, "fuzz_features", None)
        for steer in strategies.STEERS if features is not None else ():
            if (
                steer.impls == base
                and steer.needs <= features
                and _fits(steer.raises, steer.match, failed)
            ):
                found.append((base, f"{steer.reason} (fuzz steer {steer.name!r})"))
    return found


def inherit_hint(meta, impl, results) -> str:
    """The text appended to a failure that fits a built-in's known deviation (see
    :func:`known_deviations`), or ``""``."""
    found = known_deviations(meta, impl, results)
    if not found:
        return ""
    lines = "".join(f"\n  {base}: {what}" for base, what in found)
    base = found[0][0]
    entry = _shipped(base, meta.device).match(meta.case_id)
    single = (
        f"\nIf {impl.name} is not built on {base} but shares this one deviation, adopt that entry "
        f"alone: add the line `inherit {base} {entry.prefix}` to {impl.name}'s expectations file "
        f"(docs/expectations.md, 'Adopting one upstream deviation')."
        if entry is not None and entry.pinned
        else ""
    )
    return (
        f"\n\nThis failure fits a known deviation of {', '.join(dict(found))}, which "
        f"{impl.name} does not inherit:{lines}\n"
        f'If {impl.name} is built on {base} and keeps this behaviour, set `inherits = "{base}"` on '
        f"its adapter (a class attribute, or FullyShardAdapter / FlatParamAdapter(..., "
        f'inherits="{base}")): the case is then expected (xfail) or steered around as for {base}. '
        f"See docs/adapters.md, 'Upstream's known deviations'." + single
    )
