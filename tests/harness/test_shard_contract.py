"""The ``shard`` contract (docs/adapters.md): no option or plan reaches an adapter's ``shard``
without the capability tied to it, and a check reading ``ctx.impl.ns`` from an adapter without
one is not supported, never an AttributeError. Issue 26, point 4.

``test_no_option_reaches_an_adapter_undeclared`` walks every hand-written check's calls: each case
runs once at world size 1 against an adapter that declares *nothing*; its ``shard`` (behind the
guard every adapter's ``shard`` runs behind, ``base.guard_shard``) records each option or plan part
that reaches it without its capability, and the check's own failure is recorded when it is an
AttributeError naming ``ns``. ``test_the_guard_refuses_before_shard`` is the guard's unit test.
"""

from __future__ import annotations

import pytest

from tests._spawn import run_on_ranks


def _walk(rank, world_size):
    import contextlib
    import importlib
    import pkgutil

    import torch

    import conformance.checks as checks
    from conformance.adapters import base
    from conformance.context import CheckContext
    from conformance.registry import CHECKS

    seen: list[str] = []

    class DeclaresNothing(base.Implementation):
        name = "declares-nothing"

        def shard(self, module, ctx, *, plan=None, **options):
            missing = base.undeclared_for_shard(self.capabilities, plan, options)
            seen.extend(f"shard({k}) without {c}" for k, c in missing.items())
            return module

    for info in pkgutil.walk_packages(checks.__path__, "conformance.checks."):
        importlib.import_module(info.name)
    found, walked = {}, 0
    for spec in CHECKS:
        if spec.area == "fuzz" or not spec.applies_to(1):
            continue  # fuzz examples are drawn from the capabilities (test_fuzz.py)
        for case, kwargs in spec.cases.items():
            seen.clear()
            ctx = CheckContext(0, 1, torch.device("cpu"), "gloo", DeclaresNothing(), dict(kwargs))
            walked += 1
            with contextlib.suppress(Exception):
                try:
                    spec.fn(ctx, **kwargs)
                except AttributeError as exc:
                    if "'ns'" in str(exc):
                        seen.append(f"AttributeError reading ns: {exc}")
                    raise
            if seen:
                found[f"{spec.area}::{spec.name}[{case}] ({spec.path})"] = sorted(set(seen))
    return found, walked


def test_no_option_reaches_an_adapter_undeclared():
    found, walked = run_on_ranks(_walk, 1, timeout=900)[0]
    assert walked > 500, walked
    assert not found, "options that reached shard() undeclared, or ns read as an attribute:\n" + (
        "\n".join(f"  {case}: {', '.join(what)}" for case, what in sorted(found.items()))
    )


def test_the_guard_refuses_before_shard():
    """An adapter that declares nothing never sees a plan, an option tied to a capability or a
    2-D mesh: its ``shard`` is not called and the case is not supported, in the one wording."""
    from types import SimpleNamespace

    from conformance.adapters import base

    calls = []

    class Bare(base.Implementation):
        name = "bare"

        def shard(self, module, ctx, *, plan=None, **options):
            calls.append((plan, options))
            return module

    bare = Bare()
    for plan, options, capability in (
        ([("inner", {}), ("", {})], {}, base.AUTO_WRAP),
        (None, {"ignored_modules": []}, base.FLAT_PARAM),
        (None, {"mixed_precision": {"param_dtype": None}}, base.MIXED_PRECISION),
        (None, {"mesh": SimpleNamespace(ndim=2)}, base.HSDP),
        ([("", {"reshard_after_forward": False})], {}, base.RESHARD_AFTER_FORWARD),
    ):
        with pytest.raises(base.NotSupported) as raised:
            bare.shard(None, None, plan=plan, **options)
        assert str(raised.value) == f"does not declare {capability}", raised.value
        reason = base.not_supported_reason("bare", str(raised.value))
        assert reason == f"NotSupported: bare does not declare {capability}", reason
    assert not calls, calls
    bare.shard(None, None, plan=[("", {})], mesh=SimpleNamespace(ndim=1), unknown=1)
    assert calls == [([("", {})], {"mesh": calls[0][1]["mesh"], "unknown": 1})]
