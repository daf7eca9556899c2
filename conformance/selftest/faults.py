"""The seeded-fault registry and the adapter that runs the suite against one fault.

A :class:`Fault` breaks exactly one rule of one implementation (a built-in: ``reference``,
``reference-fsdp1``, ``torch-fsdp2``, ``torch-fsdp1``) by replacing one target (see
:mod:`conformance.selftest._patching`) while a check runs. :class:`FaultAdapter` is that
implementation's adapter under another name (``fault-<id>``) whose :meth:`patched` applies the fault
on every rank; it inherits the broken implementation's known deviations (``inherits``), so a
case that fails the documented way is an expected failure, not a catch, and its fuzz cases draw
the control's examples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from conformance.adapters.base import RenamedImplementation
from conformance.selftest import _patching

BUILTIN_TARGETS = ("reference", "reference-fsdp1", "torch-fsdp2", "torch-fsdp1")


@dataclass(frozen=True)
class Fault:
    id: str  # lower-case words joined by "-"; the adapter is "fault-<id>"
    impl: str  # the built-in implementation it breaks
    behaviour: str  # P*/S*/W* id of the rule it breaks
    area: str  # the area of the suite that should catch it
    description: str  # one line
    target: str  # "package:Name[.attr]" replaced while it is active
    make: Callable[[object], object]  # original -> replacement
    world_sizes: tuple[int, ...] = (2,)  # where it shows
    fast: bool = False  # in the one-per-area subset run by ``nox -s tests``

    @property
    def spec(self) -> str:
        """The ``--impl`` spec that loads its adapter (in the driver and in every rank)."""
        return f"conformance.selftest:fault_{self.id.replace('-', '_')}"

    @property
    def adapter_name(self) -> str:
        return f"fault-{self.id}"


FAULTS: dict[str, Fault] = {}


def fault(
    id: str,
    impl: str,
    behaviour: str,
    area: str,
    target: str,
    description: str,
    *,
    world_sizes=(2,),
    fast: bool = False,
):
    """Register the decorated ``make(original) -> replacement`` as a seeded fault."""
    if impl not in BUILTIN_TARGETS:
        raise ValueError(f"fault {id}: impl must be one of {BUILTIN_TARGETS}, not {impl!r}")
    if id in FAULTS or "_" in id:
        raise ValueError(f"fault id {id!r} is taken or contains '_' (use '-')")

    def register(make):
        FAULTS[id] = Fault(
            id, impl, behaviour, area, description, target, make, tuple(world_sizes), fast
        )
        return make

    return register


def wrap(after=None, before=None):
    """``make`` for a method/function: call the original, with ``before(*args, **kwargs)`` run
    first and ``after(result, *args, **kwargs)`` returning the (changed) result."""

    def make(original):
        def replacement(*args, **kwargs):
            if before is not None:
                before(*args, **kwargs)
            result = original(*args, **kwargs)
            return after(result, *args, **kwargs) if after is not None else result

        return replacement

    return make


def replace_with(function):
    """``make`` that ignores the original and installs ``function``."""
    return lambda original: function


class FaultAdapter(RenamedImplementation):
    """The broken implementation's adapter, renamed, with the fault applied around each check.
    Its control's known deviations (expectations, fuzz drops) are its own, so it draws the
    control's fuzz examples: a catch is then a failure the fault caused (see score)."""

    def __init__(self, fault: Fault):
        self.fault = fault
        super().__init__(fault.impl, fault.adapter_name, fault.description)

    @property
    def version(self) -> str:
        return f"{self.inner.version}, seeded fault {self.fault.id}"

    def patched(self):
        return _patching.patch(self.fault.target, self.fault.make)


def adapter_factory(fault_id: str) -> Callable[[], FaultAdapter]:
    def factory() -> FaultAdapter:
        return FaultAdapter(FAULTS[fault_id])

    return factory
