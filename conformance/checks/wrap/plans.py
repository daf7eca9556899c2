"""Area "wrap", the plan builder: ``ns.wrap.build_wrap_plan`` lists the units an auto-wrap policy
selects, with their kwargs and managed parameters, without touching the model (W1-W5, W9-W12).

Upstream torch has no side-effect-free plan builder (its FSDP1 constructor wraps in place), so these
checks run where an implementation provides one (the reference) and are NotSupported elsewhere. The
expected plans come from the rules in ``_cases.py``'s Note.
"""

from __future__ import annotations

import warnings

from torch import nn

from conformance.adapters import base
from conformance.adapters.base import NotSupported
from conformance.checks._shared.models import expect_error
from conformance.checks.wrap import _models as zoo
from conformance.checks.wrap._cases import (
    MP_WARNING,
    ZOO,
    ZOO_CASES,
    build_policy,
    expected_groups,
    expected_kwargs,
    ignored_of,
    lora_message,
    mp_policy,
    never_wrap,
    seeded_model,
    user_warnings,
)
from conformance.registry import check


def _plan_builder(ctx):
    """The implementation's side-effect-free plan builder, ``ns.wrap.build_wrap_plan`` (the
    reference's; upstream torch has none)."""
    fn = getattr(ctx.impl.ns.wrap, "build_wrap_plan", None)
    if fn is None:
        raise NotSupported("a wrap plan builder (ns.wrap.build_wrap_plan)")
    return fn


@check(
    area="wrap",
    requires={base.AUTO_WRAP, base.FSDP2_API},
    cases=ZOO_CASES,
    world_sizes=(1,),
    timeout=180,
)
def plan_matches_expected(ctx, case):
    """build_wrap_plan lists exactly the expected units in build order, each with the kwargs and
    managed parameters the rules give, and leaves the model untouched (W1-W5, W9); a plan that
    offers the ``module_fqns`` / ``targets`` views gives its entries' FQNs / (FQN, kwargs)."""
    build = _plan_builder(ctx)
    c, ns = ZOO[case], ctx.impl.ns
    model = seeded_model(ctx, c.model)
    ignored_modules, ignored_params, ignored = ignored_of(model, c)
    root_kwargs = {"mixed_precision": mp_policy(ns, c.mixed_precision), "use_orig_params": False}
    before = [
        (n, id(m), len(m._forward_pre_hooks), len(m._forward_hooks), sorted(vars(m)))
        for n, m in model.named_modules()
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = build(
            model,
            build_policy(c, ns, enums=False),
            ignored_modules=ignored_modules,
            ignored_params=ignored_params,
            root_kwargs=root_kwargs,
        )
    where = f"{ctx.where()} {case}:"
    got = tuple(e.module_fqn for e in plan.entries)
    assert got == c.units, f"{where} planned units {got}, expected {c.units} (build order)"
    views = {"module_fqns": got, "targets": [(e.module_fqn, dict(e.kwargs)) for e in plan.entries]}
    for attr, want in views.items():  # a WrapPlan's read-only views of its entries, where offered
        if hasattr(type(plan), attr):
            assert getattr(plan, attr) == want, (
                f"{where} plan.{attr} is {getattr(plan, attr)!r}, expected {want!r} (its entries)"
            )
    groups, ignored_fqns = expected_groups(model, c.units, ignored)
    for entry in plan.entries:
        unit = entry.module_fqn
        want = expected_kwargs(c, unit, root_kwargs, None)
        assert dict(entry.kwargs) == want, (
            f"{where} unit {unit!r} kwargs {dict(entry.kwargs)}, expected {want}"
        )
        assert set(entry.param_fqns) == groups[unit] and len(entry.param_fqns) == len(
            groups[unit]
        ), (
            f"{where} unit {unit!r} manages {sorted(entry.param_fqns)}, "
            f"expected {sorted(groups[unit])}"
        )
    assert set(plan.ignored_param_fqns) == ignored_fqns, (
        f"{where} ignored parameters {sorted(plan.ignored_param_fqns)}, expected {sorted(ignored_fqns)}"
    )
    after = [
        (n, id(m), len(m._forward_pre_hooks), len(m._forward_hooks), sorted(vars(m)))
        for n, m in model.named_modules()
    ]
    assert after == before, f"{where} building the plan changed the model"


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP2_API}, world_sizes=(1,))
def plan_errors_and_warnings(ctx):
    """build_wrap_plan raises/warns as FSDP1's constructor would: W10 bad CustomPolicy answer
    (ValueError), W12 mixed frozen parameters (ValueError / UserWarning by use_orig_params,
    False when ``root_kwargs`` does not give it, FSDP1's default), W11 the batch-norm
    mixed-precision warning. The plan it returns is read-only: assigning one of its fields
    raises AttributeError."""
    build, ns = _plan_builder(ctx), ctx.impl.ns
    W = ns.wrap
    model = zoo.nested_sequential()
    try:
        build(model, W.CustomPolicy(lambda m: 1))
    except ValueError as e:
        want = (
            "The lambda_fn passed to CustomPolicy should return False/True or a kwarg dict, "
            "but it returned 1"
        )
        assert str(e) == want, f"{ctx.where()} W10 message {str(e)!r}, expected {want!r}"
    else:
        raise AssertionError(f"{ctx.where()} W10: a CustomPolicy answer of 1 did not raise")

    policy = W.ModuleWrapPolicy({zoo.LoraAttention})
    # use_orig_params=False given, or left to FSDP1's default (False): no root_kwargs at all, or
    # root_kwargs without the key
    for given in ({"root_kwargs": {"use_orig_params": False}}, {}, {"root_kwargs": {}}):
        try:
            build(zoo.LoraModel(), policy, **given)
        except ValueError as e:
            want = lora_message("layers.0.attn", False)
            assert str(e) == want, (
                f"{ctx.where()} W12 ({given}) message {str(e)!r}, expected {want!r}"
            )
        else:
            raise AssertionError(
                f"{ctx.where()} W12: mixed frozen parameters did not raise with {given} "
                "(use_orig_params=False, given or by default)"
            )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        plan = build(zoo.LoraModel(), policy, root_kwargs={"use_orig_params": True})
    got = user_warnings(record, "requires_grad=True and False")
    want = [lora_message(f"layers.{i}.attn", True) for i in range(2)]
    assert got == want, f"{ctx.where()} W12 warnings {got}, expected {want}"
    units = tuple(e.module_fqn for e in plan.entries)
    assert units == ("layers.0.attn", "layers.1.attn", ""), f"{ctx.where()} W12 units {units}"
    for field in ("entries", "ignored_param_fqns"):  # a plan is read-only, as its entries
        expect_error(
            ctx, f"assigning plan.{field}", AttributeError, "", lambda f=field: setattr(plan, f, ())
        )
    assert units == tuple(e.module_fqn for e in plan.entries), f"{ctx.where()} plan changed"

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        build(zoo.NormNet(), never_wrap, root_kwargs={"mixed_precision": mp_policy(ns, True)})
    got = user_warnings(record, "Both mixed precision")
    want = [MP_WARNING.format(classes={nn.BatchNorm1d})]
    assert got == want, f"{ctx.where()} W11 warnings {got}, expected {want}"
