"""The "Capabilities" table of docs/adapters.md is true: one row per capability constant, each with what
declaring it promises, and the cases it gates as the check registry says today."""

from conformance import capabilities
from conformance.adapters import base


def test_every_capability_has_a_promise():
    assert set(base.PROMISES) == base.ALL_CAPABILITIES, sorted(
        base.ALL_CAPABILITIES ^ set(base.PROMISES)
    )
    assert all(len(text) > 20 and "|" not in text for text in base.PROMISES.values())


def test_readme_table_is_current():
    current = capabilities.readme_table(capabilities.README.read_text())
    assert current is not None, "docs/adapters.md lost the capabilities table's markers"
    assert current == capabilities.table(), (
        "docs/adapters.md's capabilities table is stale: run `python -m conformance.capabilities --write`"
    )


def test_gating_counts_come_from_the_registry():
    """Capabilities that checks require gate cases; the API capabilities gate the most areas."""
    gates = capabilities.gating()
    assert set(gates) <= base.ALL_CAPABILITIES
    assert gates[base.PER_PARAM_DIM0]["layout"] > 0
    assert gates[base.LOCAL_STATE_DICT]["fuzz"] == 1  # case_requires of the local case
    assert gates[base.FULL_STATE_DICT]["state_dict"] > 0  # cases of kind "full"
    widest = max(gates, key=lambda cap: len(gates[cap]))
    assert widest in (base.FSDP2_API, base.TRAINING), widest
