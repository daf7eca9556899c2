"""What the driver sends to ranks and what comes back."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

# RankResult.status values
OK = "ok"  # the check body returned
ERROR = "error"  # the check body raised (traceback in ``detail``)
NOT_SUPPORTED = "not-supported"  # the body raised NotSupported (capability in ``detail``)
SKIPPED = "skipped"  # the body raised registry.Skip: it cannot fail here (reason in ``detail``)
TIMEOUT = "timeout"  # still running when the check's time ran out (stack in ``detail``)
DIED = "died"  # the process exited (exit code / signal in ``detail``)
ABANDONED = "abandoned"  # finished its part but the group had to be torn down around it

PROBE = "probe"  # driver -> worker: run the health probe (see conformance.runner.worker)


@dataclass(frozen=True)
class Task:
    """One check invocation, identical on every rank.

    ``fn`` is an import path ``"package.module:function"``; the function is called as
    ``fn(ctx, **kwargs)`` on every rank, where ``ctx`` is a :class:`conformance.context.CheckContext`
    built for ``impl`` (an implementation spec, see :mod:`conformance.adapters.registry`).
    """

    fn: str
    impl: str | None
    kwargs: dict = field(default_factory=dict)
    timeout: float = 60.0  # seconds
    timeout_text: str = (
        ""  # how the timeout came about, for messages ("30 s (3 x --check-timeout 10)")
    )
    case: str = ""  # the case id, for the driver's messages ("rank 1 exceeded ... in <case>")
    isolated: bool = True  # snapshot and restore the global state around it (runner.isolation)


@dataclass
class RankResult:
    rank: int
    status: str
    value: Any = None
    detail: str = ""  # traceback, stack dump or exit reason
    duration: float = 0.0
    recycle: bool = False  # the rank holds state it could not put back: restart the group

    @property
    def ok(self) -> bool:
        return self.status == OK


def resolve(path: str):
    """Import ``"package.module:attr"`` (attr may be dotted)."""
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"expected 'package.module:attr', got {path!r}")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
