"""Differential fuzzing: random models and settings checked against a single-process oracle.

[Note: how a fuzz case runs]
A fuzz check (``conformance/checks/fuzz.py``) is an ordinary registered check whose body takes one
drawn *example*: a plain dict (see :mod:`conformance.fuzz.model`) that every rank turns into the
same model, wrap plan and options. The check's pytest item (:class:`conformance.fuzz.item.FuzzItem`)
runs hypothesis in the driver; each drawn example is sent to the persistent rank group as one task,
so no process is spawned per example. A failing example is shrunk the same way and printed as a
standalone script (:mod:`conformance.fuzz.repro`) that spawns the ranks itself and fails with the
same assertion; the script is also stored in the JSON report's case record (``repro_script``).

Budget: by default every fuzz case draws :data:`conformance.fuzz.item.CI_EXAMPLES` examples with
hypothesis derandomized (the same examples on every run; nothing written to a database);
``--fuzz-examples N`` draws N random ones. Shrinking stops after
:data:`conformance.fuzz.item.SHRINK_SECONDS`.
"""

from __future__ import annotations


def fuzz_check(features, drop=None):
    """Mark a registered check as a fuzz check whose examples may use ``features`` (see
    :mod:`conformance.fuzz.strategies`), less ``drop[case]`` for a case: the plugin collects it as
    a :class:`~conformance.fuzz.item.FuzzItem`. Put it above ``@check``."""

    def mark(fn):
        from conformance.fuzz.item import FuzzItem

        fn.item_class = FuzzItem
        fn.fuzz_features = frozenset(features)
        fn.fuzz_drop = {case: frozenset(f) for case, f in (drop or {}).items()}
        return fn

    return mark
