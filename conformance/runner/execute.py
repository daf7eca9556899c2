"""Run one task on this rank (shared by the worker processes and the torchrun path)."""

from __future__ import annotations

import contextlib
import time
import traceback

import torch

from conformance.adapters.base import NotSupported
from conformance.registry import Skip
from conformance.runner import isolation
from conformance.runner.protocol import ERROR, NOT_SUPPORTED, OK, SKIPPED, RankResult, Task, resolve

_IMPLS: dict[str, object] = {}  # implementation spec -> loaded adapter, per process


def _implementation(spec: str | None):
    if spec is None:
        return None
    if spec not in _IMPLS:
        from conformance.adapters.registry import load_implementation

        _IMPLS[spec] = load_implementation(spec)
    return _IMPLS[spec]


def execute(
    task: Task, rank: int, world_size: int, device: torch.device, backend: str
) -> RankResult:
    from conformance.context import CheckContext

    start = time.perf_counter()
    before = None
    try:
        fn = resolve(task.fn)
        ctx = CheckContext(
            rank=rank,
            world_size=world_size,
            device=device,
            backend=backend,
            impl=_implementation(task.impl),
            params=dict(task.kwargs),
            deadline=time.monotonic() + task.timeout,
        )
        patched = getattr(ctx.impl, "patched", contextlib.nullcontext)  # seeded faults (selftest)
        # after loading the implementation and the check: what an import sets up is not a leak
        before = isolation.snapshot() if task.isolated else None
        with patched():
            value = fn(ctx, **task.kwargs)
        status, detail = OK, ""
    except NotSupported as exc:
        value, status, detail = None, NOT_SUPPORTED, str(exc)
    except Skip as exc:
        value, status, detail = None, SKIPPED, str(exc)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, never swallowed
        if isinstance(exc, KeyboardInterrupt):
            raise
        value, status, detail = None, ERROR, traceback.format_exc()
    recycle = False
    if before is not None:  # see [Note: isolation between checks]
        allowed = tuple(getattr(ctx.impl, "allowed_global_state", ()))
        try:
            settled = isolation.settle(before, allowed)
        except Exception:  # noqa: BLE001 - state the check left that cannot even be compared
            settled = isolation.Outcome([f"(not comparable)\n{traceback.format_exc()}"], True)
        recycle = settled.recycle
        if settled.leaks:
            status = ERROR
            detail = (detail.rstrip() + "\n\n" if detail else "") + settled.message()
    result = RankResult(rank, status, _picklable(value), detail, time.perf_counter() - start)
    result.recycle = recycle
    return result


def _picklable(value):
    import pickle

    try:
        pickle.dumps(value)
        return value
    except Exception:  # noqa: BLE001
        return repr(value)
