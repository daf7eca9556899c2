"""pytest plugin for the self-test's conformance runs (``-p conformance.selftest.no_shrink``).

A seeded fault makes many fuzz cases fail; shrinking each failure to its smallest example (up to
90 s per case) would multiply the self-test's time and adds nothing to a verdict, which only needs
to know that the case failed. The fuzz item's shrink budget is set to zero here: it then reports
the first failing example.
"""

from __future__ import annotations


def pytest_configure(config):
    try:
        from conformance.fuzz import item
    except ImportError:  # no fuzz area in this checkout
        return
    budget = getattr(item, "SHRINK_SECONDS", None)
    if not isinstance(budget, dict):
        raise RuntimeError(
            "selftest: conformance.fuzz.item.SHRINK_SECONDS is gone; update "
            "conformance/selftest/no_shrink.py to disable fuzz shrinking"
        )
    for key in budget:
        budget[key] = 0.0
