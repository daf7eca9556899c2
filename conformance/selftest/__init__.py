"""The suite's self-test: seeded faults and a mutation score (``python -m conformance selftest``).

Every seeded fault (:mod:`.faults_fsdp2`, :mod:`.faults_fsdp1`) is loadable as an implementation
spec ``conformance.selftest:fault_<id with _ for ->``, so one conformance run can carry many
faults next to the unpatched implementations; :mod:`.run` drives those runs and :mod:`.score`
turns their reports into the table fault -> catching cases / MISSED.
"""

from __future__ import annotations

from conformance.selftest import faults_fsdp1, faults_fsdp2  # noqa: F401 - registers the faults
from conformance.selftest.faults import FAULTS, Fault, FaultAdapter, adapter_factory

__all__ = ["FAULTS", "Fault", "FaultAdapter"]


def __getattr__(name: str):
    """``fault_<id>``: a zero-argument factory of that fault's adapter (for ``--impl``)."""
    if name.startswith("fault_"):
        fault_id = name[len("fault_") :].replace("_", "-")
        if fault_id in FAULTS:
            return adapter_factory(fault_id)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
