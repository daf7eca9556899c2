"""Differential fuzzing: random models and settings checked against a single-process oracle.

[Note: how a fuzz case runs]
A fuzz check (``conformance/checks/fuzz/fuzz.py``, ``state_dict.py``) is an ordinary registered
check whose body takes one drawn *example*: a plain dict (see :mod:`conformance.fuzz.model`) that
every rank turns into the same model, wrap plan and options. The check's pytest item (:class:`conformance.fuzz.item.FuzzItem`)
runs hypothesis in the driver; each drawn example is sent to the persistent rank group as one task,
so no process is spawned per example. A failing example is shrunk the same way and printed as a
standalone script (:mod:`conformance.fuzz.repro`) that spawns the ranks itself and fails with the
same assertion; the script is also stored in the JSON report's case record (``repro_script``).

Budget: by default every fuzz case draws :func:`conformance.fuzz.item.default_budget` examples (8 at
world sizes 1 and 2, 4 from 3 up) with hypothesis derandomized (the same examples on every run; nothing written to a database);
``--fuzz-examples N`` draws N random ones. Shrinking stops after
:data:`conformance.fuzz.item.SHRINK_SECONDS`.

What an example may contain is the check's *features* less its :class:`Drop` s for the case and
the implementation (see the Note there): a known upstream limitation is steered around for the
implementations that inherit it only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

EVERY = "*"  # ``Drop.impls``: every implementation


@dataclass(frozen=True)
class Drop:
    """``features`` left out of the examples of a fuzz check's ``cases`` for the implementations
    that carry a deviation set named in ``impls`` (or :data:`EVERY` implementation), because of
    ``reason``. ``raises`` / ``match`` (optional) pin how the dropped feature fails on that
    deviation set, as an expectations entry would (an exception class name, ``A|B`` for either,
    and a regex searched in the message): a fork that does not inherit the set and fails that way
    is told which deviation it met and how to inherit it.

    [Note: per-implementation drops]
    A drop is for a *known* failure that the fuzz would otherwise find again and again: an upstream
    limitation already pinned by a hand-written check and an expectation entry (name both in the
    reason), or a feature that means nothing for a case. It names the *deviation set* it belongs
    to (``impls="torch-fsdp2"``), never an implementation to single out: it applies to an
    implementation whose name or ``inherits`` chain holds that set
    (:func:`conformance.adapters.registry.lineage`; see [Note: inherited deviations] in
    :mod:`conformance.adapters.base`). So a fork of upstream that declares
    ``inherits = "torch-fsdp2"`` gets the same examples as torch-fsdp2, and every implementation
    that does not (the reference, a re-implementation) is still fuzzed on the feature.
    The examples an implementation gets are a function of the check, the case, the world size and
    the implementation's lineage and capabilities only, so a derandomized run draws the same
    examples every time and a failure reproduces; the reproducer embeds the example itself. Drops
    are not expectation entries: a fuzz failure's example is random, so an xfail pinned on it could
    not be strict; a known limitation is pinned by its hand-written check instead."""

    features: frozenset
    reason: str
    impls: frozenset = frozenset({EVERY})
    cases: frozenset = frozenset({EVERY})
    raises: str = ""
    match: str = ""

    def __post_init__(self):
        for name in ("features", "impls", "cases"):
            value = getattr(self, name)
            object.__setattr__(self, name, frozenset([value] if isinstance(value, str) else value))
        if not self.reason.strip():
            raise ValueError(f"fuzz Drop of {sorted(self.features)}: give the reason")
        if self.match:
            re.compile(self.match)

    def applies(self, case: str, impl) -> bool:
        """Whether the drop applies to ``case`` for ``impl`` (an adapter, or the name of one
        loaded in this process): one of its deviation sets is in ``impl``'s lineage."""
        return (EVERY in self.cases or case in self.cases) and (
            EVERY in self.impls or bool(self.impls.intersection(deviation_sets(impl)))
        )


def deviation_sets(impl) -> tuple[str, ...]:
    """The deviation sets ``impl`` carries: its name and the names it inherits, nearest first.
    ``impl`` is an adapter or the name of one loaded in this process."""
    from conformance.adapters.registry import lineage, lineage_of

    return lineage_of(impl) if isinstance(impl, str) else lineage(impl)


def dropped(drops, case: str, impl) -> list[Drop]:
    """The drops that apply to ``case`` for ``impl`` (an adapter, or the name of one loaded in
    this process)."""
    return [d for d in drops if d.applies(case, impl)]


def fuzz_check(features, drops=(), case_requires=None):
    """Mark a registered check as a fuzz check whose examples may use ``features`` (see
    :mod:`conformance.fuzz.strategies`), less those of the :class:`Drop` s in ``drops`` that apply
    to a case and implementation: the plugin collects it as a :class:`~conformance.fuzz.item.FuzzItem`.
    ``case_requires``: case -> capabilities that case needs beyond the check's ``requires`` (an
    implementation without them is NotSupported before any example is drawn). Put it above
    ``@check``."""

    def mark(fn):
        from conformance.fuzz.item import FuzzItem
        from conformance.registry import CHECKS

        fn.item_class = FuzzItem
        fn.fuzz_features = frozenset(features)
        fn.fuzz_drops = tuple(drops)
        fn.fuzz_case_requires = {c: frozenset(r) for c, r in (case_requires or {}).items()}
        cases = {c for spec in CHECKS if spec.fn is fn for c in spec.cases}
        unknown = {c for d in fn.fuzz_drops for c in d.cases} | set(fn.fuzz_case_requires)
        unknown = unknown - cases - {EVERY}
        if unknown:  # a misspelt case would silently drop nothing
            raise ValueError(
                f"fuzz check {fn.__name__}: Drop or case_requires for unknown case(s) "
                f"{sorted(unknown)} "
                f"(its cases: {sorted(cases)})"
            )
        return fn

    return mark
