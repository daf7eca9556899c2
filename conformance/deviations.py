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


def expectations_for(impl, device: str, directory: Path) -> expectations.Expectations:
    """The entries that apply to ``impl`` on ``device``: those of each name in its lineage."""
    loaded = []
    for i, name in enumerate(lineage(impl)):
        source = directory
        own = (directory / f"{name}.txt", directory / f"{name}.{device}.txt")
        if i and not any(p.exists() for p in own):
            source = expectations.DEFAULT_DIR
        loaded.append(expectations.load(name, device, source))
    merged = expectations.Expectations()
    for f in dataclasses.fields(merged):  # the entries (and any other list it keeps), in order
        setattr(merged, f.name, [x for exp in loaded for x in getattr(exp, f.name)])
    return merged


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
    return (
        f"\n\nThis failure fits a known deviation of {', '.join(dict(found))}, which "
        f"{impl.name} does not inherit:{lines}\n"
        f'If {impl.name} is built on {base} and keeps this behaviour, set `inherits = "{base}"` on '
        f"its adapter (a class attribute, or FullyShardAdapter / FlatParamAdapter(..., "
        f'inherits="{base}")): the case is then expected (xfail) or steered around as for {base}. '
        f"See docs/adapters.md, 'Upstream's known deviations'."
    )
