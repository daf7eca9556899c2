"""Declaring checks.

A check is a module-level function in ``conformance/checks/<part>/<concern>.py`` decorated with :func:`check`.
Its body runs on every rank as ``fn(ctx, **case_kwargs)`` and passes by returning; it fails by raising
(usually ``AssertionError`` with a message that says what was expected on which rank). Its docstring
states the rule it checks. A check whose assertion cannot fail where it runs (e.g. "offloaded shards
live on the CPU" when the compute device is the CPU) raises :class:`Skip` with the reason instead of
passing; the case is reported ``skip``.

Each check expands into one case per (implementation, world size, case). The case id that
expectations files and reports use is ``<area>::<check>[ws<N>-<case>]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

CHECKS: list[CheckSpec] = []


class Skip(Exception):
    """Raised by a check body whose assertion cannot fail on this device; the message is the reason
    ("needs an accelerator: on CPU, offloaded and resident memory are the same")."""


@dataclass(frozen=True)
class CheckSpec:
    fn: Callable
    area: str
    requires: frozenset[str]
    cases: dict[str, dict] = field(default_factory=dict)
    world_sizes: tuple[int, ...] | None = None  # None: every selected world size
    min_world_size: int = 1
    timeout: float | None = None  # None: the run's default

    @property
    def name(self) -> str:
        return self.fn.__name__

    @property
    def path(self) -> str:
        return f"{self.fn.__module__}:{self.fn.__qualname__}"

    @property
    def rule(self) -> str:
        return (self.fn.__doc__ or "").strip().splitlines()[0] if self.fn.__doc__ else ""

    def applies_to(self, world_size: int) -> bool:
        if world_size < self.min_world_size:
            return False
        return self.world_sizes is None or world_size in self.world_sizes


def check(
    *,
    area: str,
    requires=(),
    cases: dict[str, dict] | None = None,
    world_sizes=None,
    min_world_size: int = 1,
    timeout: float | None = None,
):
    """Register the decorated function as a conformance check (see the module docstring)."""

    def register(fn):
        CHECKS.append(
            CheckSpec(
                fn,
                area,
                frozenset(requires),
                dict(cases or {"": {}}),
                tuple(world_sizes) if world_sizes else None,
                min_world_size,
                timeout,
            )
        )
        return fn

    return register


def case_id(area: str, name: str, world_size: int, case: str) -> str:
    suffix = f"ws{world_size}" + (f"-{case}" if case else "")
    return f"{area}::{name}[{suffix}]"
